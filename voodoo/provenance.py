"""What each artifact of a run folder was made from, so that no stage consumes an artifact
made from other inputs (another model, other calibration tokens, another imatrix, other menus).

``<output_dir>/provenance.json`` maps an artifact's path (relative to the run folder, e.g.
``imatrix.gguf``, ``train/partial.pt``, ``stock/stock.Q4_K_M.gguf``) to the record of its
inputs: a flat dict of strings and numbers, e.g. ``{"model": "tiny@sha256:…", "tokens":
"<sha256 of the calibration token ids>", "llama_cpp_commit": "0c1e57098"}``. A stage that
finds an artifact compares the record with its own inputs (:func:`check`) and either rebuilds
it, saying so (the imatrix, the stock files), or refuses with the way out (a training journal
of another model: a fresh ``--output_dir``, or delete the journal). The manifest is written
atomically (:func:`voodoo.fsutil.atomic_write_text`).

The model is identified by :func:`model_identity`: its name and the sha256 of its base F32
GGUF (the weights every candidate and stock file is quantized from), as
``Name@sha256:<hex>`` (:func:`voodoo.export.model_id`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from .fsutil import atomic_write_text, sha256_file

__all__ = ["MANIFEST", "ProvenanceError", "model_identity", "tokens_sha256", "file_sha256",
           "recorded", "record", "check", "forget", "describe"]

#: the manifest's file name in a run folder
MANIFEST = "provenance.json"


class ProvenanceError(ValueError):
    """An artifact in the run folder was made from other inputs and may not be rebuilt
    silently (the message names both and the way out)."""


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, remembered for this process and in a ``<file>.sha256`` side
    file keyed by size and mtime (a 540 MB base GGUF is hashed once, not at every run)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key in _SHA_MEMO:
        return _SHA_MEMO[key]
    side = p.with_name(p.name + ".sha256")
    try:
        size, mtime, digest = side.read_text().split()
        if int(size) == st.st_size and int(mtime) == st.st_mtime_ns and len(digest) == 64:
            _SHA_MEMO[key] = digest
            return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(p)
    _SHA_MEMO[key] = digest
    try:
        atomic_write_text(side, f"{st.st_size} {st.st_mtime_ns} {digest}\n")
    except OSError:
        pass  # a read-only cache: hashed again next time
    return digest


def model_identity(prepared) -> str:
    """``Name@sha256:<hex>`` of a :class:`voodoo.models.PreparedModel`: its name and the
    sha256 of its base F32 GGUF's bytes."""
    from .export import model_id
    return model_id(prepared.name, file_sha256(prepared.base_gguf))


def tokens_sha256(tokens) -> str:
    """sha256 over the shape and the int64 bytes of a token-id tensor/array ``(N, T)``."""
    import numpy as np
    a = np.ascontiguousarray(np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens),
                             dtype=np.int64)
    h = hashlib.sha256(f"int64:{'x'.join(map(str, a.shape))}:".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def _manifest(out_dir) -> Path:
    return Path(out_dir) / MANIFEST


def _load(out_dir) -> dict:
    p = _manifest(out_dir)
    if not p.is_file():
        return {}
    try:
        obj = json.loads(p.read_text())
    except ValueError:
        return {}  # unreadable: every artifact counts as of unknown origin
    return obj if isinstance(obj, dict) else {}


def recorded(out_dir, artifact: str) -> dict | None:
    """The recorded inputs of ``artifact`` (a path relative to ``out_dir``), or None."""
    rec = _load(out_dir).get(str(artifact))
    return rec if isinstance(rec, dict) else None


def record(out_dir, artifact: str, inputs: Mapping[str, Any]) -> None:
    """Records ``inputs`` (JSON values) as what ``artifact`` was made from."""
    m = _load(out_dir)
    m[str(artifact)] = dict(inputs)
    atomic_write_text(_manifest(out_dir), json.dumps(m, indent=1, sort_keys=True) + "\n")


def forget(out_dir, artifact: str) -> None:
    """Drops the record of ``artifact`` (it was deleted or is being rebuilt)."""
    m = _load(out_dir)
    if m.pop(str(artifact), None) is not None:
        atomic_write_text(_manifest(out_dir), json.dumps(m, indent=1, sort_keys=True) + "\n")


def check(out_dir, artifact: str, inputs: Mapping[str, Any]) -> list[str] | None:
    """Compares an existing artifact's record with ``inputs``. Returns None when the artifact
    does not exist (or is a folder empty but for a ``.voodoo.lock``); ``[]`` when its record
    matches; else the keys that differ (``["origin unknown"]`` when it has no record: made by
    a Voodoo before provenance, or copied in)."""
    p = Path(out_dir) / artifact
    if not p.exists() or (p.is_dir() and all(c.name == ".voodoo.lock" for c in p.iterdir())):
        return None  # a folder holding nothing but a run's lock (a Ray run folder) is not made
    rec = recorded(out_dir, artifact)
    if rec is None:
        return ["origin unknown"]
    return sorted(k for k in set(rec) | set(inputs) if rec.get(k) != inputs.get(k))


def _short(v: Any) -> str:
    s = str(v)
    if "@sha256:" in s:
        name, h = s.split("@sha256:", 1)
        return f"{name} (base F32 GGUF sha256 {h[:12]}…)"
    return s[:16] + "…" if len(s) == 64 and all(c in "0123456789abcdef" for c in s) else s


def describe(out_dir, artifact: str, inputs: Mapping[str, Any], diff: list[str],
             absent: Mapping[str, Any] | None = None) -> str:
    """``"made from model A, not B; tokens x…, not y…"``: the differing inputs, old vs new;
    ``absent``: what an input not recorded on one side stands for (e.g. ``{"rounding":
    "ggml"}``), shown instead of None."""
    if diff == ["origin unknown"]:
        return "its inputs are not recorded (made by an older Voodoo or copied in)"
    rec = recorded(out_dir, artifact) or {}
    absent = absent or {}

    def show(d, k):
        return _short(d.get(k, absent.get(k)))
    return "; ".join(f"{k} {show(rec, k)}, not {show(inputs, k)}" for k in diff)
