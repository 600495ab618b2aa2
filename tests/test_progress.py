"""Progress bars: on with ``progress=True``, off with ``progress=False`` or ``TQDM_DISABLE`` set true (tqdm alone
lets an explicit ``disable=False`` override that variable)."""

from __future__ import annotations

import hashlib

import pytest

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.models import embedded


@pytest.mark.parametrize(("value", "disabled"), [(None, False), ("1", True), ("True", True), ("yes", True),
                                                 ("0", False), ("", False), ("false", False)])
def test_bar_disabled_reads_tqdm_disable(monkeypatch, value, disabled):
    if value is None:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TQDM_DISABLE", value)
    assert bar_disabled(True) is disabled
    assert bar_disabled(False) is True


def test_a_library_bar_is_silenced_by_tqdm_disable(tmp_path, monkeypatch, capsys, rng):
    """The sha256 check of a cached file (its bar on stderr) gives the right hash either way; its bar shows with
    progress on and disappears under TQDM_DISABLE=1."""
    path = tmp_path / "blob.bin"
    data = rng.integers(0, 256, size=3 << 20, dtype="uint8").tobytes()
    path.write_bytes(data)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert embedded._sha256(path, progress=True) == hashlib.sha256(data).hexdigest()
    assert "sha256 blob.bin" in capsys.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert embedded._sha256(path, progress=True) == hashlib.sha256(data).hexdigest()
    assert "sha256 blob.bin" not in capsys.readouterr().err
