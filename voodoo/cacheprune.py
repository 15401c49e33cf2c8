"""Removing what Voodoo's cache holds and nobody used lately (``voodoo doctor --prune_cache``).

The cache (``$VOODOO_CACHE`` or ``~/.cache/voodoo``) only grows: every model converted
(``models/<key>/``, an F32 GGUF of the whole model), every candidate quantized
(``candidates/<TYPE>/<digest>.arrow``), every Fisher diagonal (``fisher/``), every set of
input Hessians (``hessians/``, hard links of the run folders' ``hessians*.npz``), every
computed imatrix (``imatrix/``, likewise), every ``--rounding auto`` score (``rounding/``),
every reference's logits for KLD (``kld/``), every cleaned evaluation text (``texts/``) and
every llama.cpp build (``llama.cpp/<commit>/``). Everything there is rebuilt on demand when
missing, so deleting an entry costs only the time to remake it.

An entry's last use is the newest ``max(atime, mtime)`` of its files: reading a file updates
its atime on the usual ``relatime`` mounts at least once a day, so an entry a run still reads
is never older than a day. On a ``noatime`` mount only writes count; the entry is then remade
when next needed.

Kept whatever their age: the llama.cpp build of the commit in use, ``models/by-sha256`` (the
small index ``voodoo eval --gguf`` uses to find an exported file's reference model; an entry
whose reference was pruned still names the model, which is converted again when needed), and
what is not a cache of derived files (``downloads/``, ``data/``, ``tensormaps/``, tests'
models). Folders are first renamed out of the way, then deleted, so a run never sees half of
one.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CacheEntry", "PruneResult", "cache_entries", "is_voodoo_cache", "prune_cache"]

#: The sub-folders of the cache whose entries are derived files, rebuilt on demand.
PRUNABLE = ("candidates", "models", "fisher", "hessians", "imatrix", "rounding", "kld",
            "texts", "llama.cpp")


@dataclass(frozen=True)
class CacheEntry:
    """One removable unit: a file, or a folder with all it holds."""
    kind: str            # the cache sub-folder: "candidates", "models", ...
    paths: tuple         # the files/folders that go together (a .kld and its .json)
    last_use: float      # seconds since the epoch: newest max(atime, mtime) inside
    nbytes: int


@dataclass
class PruneResult:
    removed: list = field(default_factory=list)   # CacheEntry
    kept: int = 0
    kept_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.removed)

    def summary(self) -> str:
        by: dict[str, list] = {}
        for e in self.removed:
            by.setdefault(e.kind, []).append(e)
        parts = [f"{k} {len(v)} ({sum(e.nbytes for e in v) / 2**30:.2f} GiB)"
                 for k, v in sorted(by.items())]
        return (f"{len(self.removed)} entries, {self.nbytes / 2**30:.2f} GiB"
                + (f" ({', '.join(parts)})" if parts else "")
                + f"; {self.kept} kept ({self.kept_bytes / 2**30:.2f} GiB)")


def _usage(p: Path) -> tuple[float, int]:
    """(newest max(atime, mtime), total bytes) of a file or of every file under a folder (a
    link: the link itself)."""
    last, n = 0.0, 0
    walk = os.walk(p) if p.is_dir() and not p.is_symlink() else [(str(p.parent), [], [p.name])]
    for dirpath, _dirs, files in walk:
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            # a link's atime moves whenever a path through it is resolved (this listing too)
            used = st.st_mtime if stat.S_ISLNK(st.st_mode) else max(st.st_atime, st.st_mtime)
            last, n = max(last, used), n + st.st_size
    if p.is_dir() and last == 0.0:   # an empty folder: its own times
        try:
            st = os.lstat(p)
            last = max(st.st_atime, st.st_mtime)
        except OSError:
            pass
    return last, n


def cache_entries(root: str | os.PathLike, keep_commit: str | None = None) -> list[CacheEntry]:
    """Every prunable entry under the cache folder ``root`` (see the module docstring), with
    its last use and size. ``keep_commit``: the llama.cpp build never listed (default: the
    commit in use, :func:`voodoo.llamacpp.llama_cpp_commit`)."""
    if keep_commit is None:
        from .llamacpp import llama_cpp_commit
        keep_commit = llama_cpp_commit()
    root = Path(root)
    groups: list[tuple[str, list[Path]]] = []
    for kind in PRUNABLE:
        d = root / kind
        if not d.is_dir():
            continue
        if kind == "candidates":   # a linked folder is not descended into: only the link
            groups += [(kind, [f]) for t in sorted(d.iterdir())
                       if t.is_dir() and not t.is_symlink() for f in sorted(t.iterdir())]
            groups += [(kind, [t]) for t in sorted(d.iterdir()) if t.is_symlink()]
        elif kind in ("models", "llama.cpp"):
            groups += [(kind, [p]) for p in sorted(d.iterdir())
                       if p.name not in ("by-sha256", keep_commit)]
        else:   # flat folders: files of one stem go together (kld: <key>.kld + <key>.json)
            stems: dict[str, list[Path]] = {}
            for p in sorted(d.iterdir()):
                stems.setdefault(p.name.split(".", 1)[0], []).append(p)
            groups += [(kind, v) for v in stems.values()]
    out = []
    for kind, paths in groups:
        uses = [_usage(p) for p in paths]
        out.append(CacheEntry(kind, tuple(paths), max(u[0] for u in uses),
                              sum(u[1] for u in uses)))
    return out


def is_voodoo_cache(root: str | os.PathLike) -> bool:
    """Whether ``root`` is Voodoo's cache: it holds :data:`voodoo.llamacpp.CACHE_TAG` (written
    when the cache is first used) or a ``llama.cpp/`` build folder."""
    from .llamacpp import CACHE_TAG
    root = Path(root)
    return (root / CACHE_TAG).is_file() or (root / "llama.cpp").is_dir()


def prune_cache(root: str | os.PathLike, older_than_days: float, dry_run: bool = False,
                now: float | None = None) -> PruneResult:
    """Removes the entries of :func:`cache_entries` last used more than ``older_than_days``
    days ago (``now``: seconds since the epoch, default the current time). ``dry_run``: only
    lists them. Returns a :class:`PruneResult`. Raises ValueError for a negative age and for a
    ``root`` that is not Voodoo's cache (:func:`is_voodoo_cache`: a ``VOODOO_CACHE`` pointing at
    a project folder would otherwise lose its ``models/``). A file that vanished meanwhile
    (another process) is not an error."""
    if older_than_days < 0:
        raise ValueError(f"older_than_days must be >= 0, got {older_than_days}")
    if not is_voodoo_cache(root):
        from .llamacpp import CACHE_TAG
        raise ValueError(f"{root} does not look like Voodoo's cache (no {CACHE_TAG}, no "
                         "llama.cpp/ build folder), so nothing there is pruned: check "
                         "VOODOO_CACHE, or if it is the cache, create the tag file "
                         f"({Path(root) / CACHE_TAG}) and run this again")
    cutoff = (time.time() if now is None else now) - older_than_days * 86400
    res = PruneResult()
    for e in cache_entries(root):
        if e.last_use >= cutoff:
            res.kept, res.kept_bytes = res.kept + 1, res.kept_bytes + e.nbytes
            continue
        if not dry_run:
            for p in e.paths:
                _remove(p)
        res.removed.append(e)
    return res


def _remove(p: Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            gone = p.with_name(f".{p.name}.pruning.{os.getpid()}")
            os.rename(p, gone)   # the folder disappears at once, then its files
            shutil.rmtree(gone, ignore_errors=True)
        else:
            p.unlink()
    except FileNotFoundError:
        pass
