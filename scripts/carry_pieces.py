"""Carry a file larger than one device call allows to the GPU machine in pieces, and join it there.

A device call carries at most 64 MiB with the working tree, and a file written outside the repository
on the GPU machine survives only while the machine stays warm (30 s between calls). So a 1.1 GB GGUF
(Qwen2.5-Coder-1.5B) travels as ~17 pieces, one per call, each copied to a folder outside the repo,
and the last call joins them and checks the whole file's sha256 before anything reads it.

Here (the pieces go outside the repository; one at a time is moved into `.carry/`, which
`.git/info/exclude` ignores, and named in the call's `carry`)::

    python scripts/carry_pieces.py split ~/.cache/sparsekv_jax/assembled/.../model.gguf --out /work/pieces

On the GPU machine, call i (carry [".carry"]; to carry a whole 63 MiB piece the checkout must be
nearly empty then, e.g. an orphan branch with no files checked out)::

    mkdir -p /tmp/pieces && cp .carry/* /tmp/pieces/ && ls -la /tmp/pieces

The last call (the full checkout again)::

    python scripts/carry_pieces.py join /tmp/pieces --out /tmp/qwen2.5-coder-1.5b.gguf --sha256 <hex>

`join` checks every piece against the manifest written by `split` (carried with piece 1), refuses a
missing or damaged one by name (so only that piece is carried again), and writes the output under a
temporary name, renamed into place once its sha256 matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

MIB = 1 << 20
CHUNK = 8 * MIB


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split(source: Path, out: Path, piece_mib: int) -> list[Path]:
    """Write `source` as pieces of `piece_mib` MiB plus `<name>.manifest.json` into `out`."""
    if piece_mib <= 0:
        raise SystemExit(f"--piece-mib must be positive, got {piece_mib}")
    out.mkdir(parents=True, exist_ok=True)
    size = source.stat().st_size
    count = -(-size // (piece_mib * MIB))
    pieces, whole = [], hashlib.sha256()
    with open(source, "rb") as f:
        for index in range(count):
            path = out / f"{source.name}.part{index + 1:02d}"
            data = f.read(piece_mib * MIB)
            whole.update(data)
            path.write_bytes(data)
            pieces.append({"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"name": source.name, "bytes": size, "sha256": whole.hexdigest(), "pieces": pieces}
    manifest_path = out / f"{source.name}.manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(f"{source} ({size:,} bytes, sha256 {manifest['sha256']}) -> {count} pieces of <= {piece_mib} MiB in {out}")
    return [out / p["file"] for p in pieces]


def join(folder: Path, out: Path, sha256: str | None) -> None:
    """Join the pieces in `folder` (checked against its manifest) into `out`, checking the whole sha256."""
    manifests = sorted(folder.glob("*.manifest.json"))
    if len(manifests) != 1:
        raise SystemExit(f"{folder}: expected one *.manifest.json, found {[m.name for m in manifests]}")
    manifest = json.loads(manifests[0].read_text())
    expected = sha256 or manifest["sha256"]
    if expected != manifest["sha256"]:
        raise SystemExit(f"the manifest's sha256 {manifest['sha256']} is not the expected {expected}")
    bad = []
    for piece in manifest["pieces"]:
        path = folder / piece["file"]
        if not path.exists():
            bad.append(f"{piece['file']} (missing)")
        elif path.stat().st_size != piece["bytes"]:
            bad.append(f"{piece['file']} ({path.stat().st_size} bytes, expected {piece['bytes']})")
        elif _sha256(path) != piece["sha256"]:
            bad.append(f"{piece['file']} (sha256 differs)")
    if bad:
        raise SystemExit("carry these pieces again: " + ", ".join(bad))
    partial = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    with open(partial, "wb") as dest:
        for piece in manifest["pieces"]:
            data = (folder / piece["file"]).read_bytes()
            whole.update(data)
            dest.write(data)
    if whole.hexdigest() != expected:
        partial.unlink()
        raise SystemExit(f"joined file's sha256 {whole.hexdigest()} is not {expected}")
    os.replace(partial, out)
    print(f"{out}: {manifest['bytes']:,} bytes, sha256 {expected} (checked)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("split", help="cut a file into pieces plus a manifest")
    s.add_argument("source", type=Path)
    s.add_argument("--out", type=Path, required=True, help="folder for the pieces (outside the repository)")
    s.add_argument("--piece-mib", type=int, default=63, help="piece size in MiB (default 63: under the 64 MiB carry)")
    j = commands.add_parser("join", help="check the pieces against the manifest and join them")
    j.add_argument("folder", type=Path)
    j.add_argument("--out", type=Path, required=True)
    j.add_argument("--sha256", default=None, help="the whole file's expected sha256 (default: the manifest's)")
    args = parser.parse_args(argv)
    if args.command == "split":
        split(args.source, args.out, args.piece_mib)
    else:
        join(args.folder, args.out, args.sha256)


if __name__ == "__main__":
    sys.exit(main())
