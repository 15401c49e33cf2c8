"""voodoo.ggufio.read_gguf: gguf-py's GGUFReader over a plain ndarray view of its memmap gives
the same fields and tensors as the stock reader (speed: benchmarks/gguf_read.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from voodoo.ggufio import read_gguf


def test_same_fields_and_tensors_as_gguf_py(tiny_prepared):
    path = tiny_prepared.base_gguf
    a, b = read_gguf(path), GGUFReader(str(path))
    assert isinstance(a, GGUFReader)
    assert list(a.fields) == list(b.fields)
    for k in b.fields:
        assert a.fields[k].types == b.fields[k].types, k
        assert a.fields[k].contents() == b.fields[k].contents(), k
    assert len(b.fields["tokenizer.ggml.tokens"].contents()) > 1000   # a real vocabulary
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for s, t in zip(a.tensors, b.tensors):
        assert (s.tensor_type, list(s.shape), s.n_bytes) == (t.tensor_type, list(t.shape), t.n_bytes)
        assert type(s.data) is np.ndarray and not s.data.flags.writeable
        assert np.array_equal(np.asarray(s.data).view(np.uint8), np.asarray(t.data).view(np.uint8))


def test_errors_are_gguf_pys(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match=r"not a GGUF file \(it starts with b'NOPE'"):
        read_gguf(bad)
    tiny = tmp_path / "tiny.gguf"   # numpy's "When changing to a larger dtype ..." before
    tiny.write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes, too short for a GGUF file"):
        read_gguf(tiny)


@pytest.mark.parametrize("keep", [0.001, 0.5, 0.999])
def test_a_truncated_file_is_named_truncated(tiny_prepared, tmp_path, keep):
    """An interrupted copy (the header intact, the metadata or the tensor data cut off) gets a
    ValueError that says the file is truncated and to copy it again, at any cut."""
    raw = Path(tiny_prepared.base_gguf).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:max(64, int(len(raw) * keep))])
    with pytest.raises(ValueError, match="truncated") as e:
        read_gguf(cut)
    assert "copy or download it again" in str(e.value)


def test_an_unchanged_file_is_parsed_once_a_rewritten_one_again(tiny_prepared, tmp_path):
    import shutil
    import time
    f = tmp_path / "a.gguf"
    shutil.copy(tiny_prepared.base_gguf, f)
    a = read_gguf(f)
    assert read_gguf(f) is a and read_gguf(str(f)) is a
    time.sleep(0.01)
    tmp = tmp_path / "b.gguf"
    shutil.copy(tiny_prepared.base_gguf, tmp)
    tmp.replace(f)                                   # an atomic rewrite: a new inode
    b = read_gguf(f)
    assert b is not a and [t.name for t in b.tensors] == [t.name for t in a.tensors]
    assert read_gguf(f, mode="r+") is not b          # writable readers are never shared
