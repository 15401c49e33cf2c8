"""File helpers shared by every stage: content hashes and atomic writes (a temporary file in
the target's folder, fsync'd, then ``os.replace``: readers see the old file or the whole new
one, never a partial one)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["sha256_file", "written_record", "changed_since_written", "atomic_write_bytes",
           "atomic_write_text", "file_mode", "file_in_the_way", "is_disk_full",
           "no_space_message", "partial_prefix", "remove_dead_partials"]


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


#: mode of files Voodoo writes (mkstemp would leave 0600): 0666 less the umask, as open() does
_MODE = _umask_mode()


def file_mode() -> int:
    """The permission bits Voodoo gives the files it writes (0666 less the umask)."""
    return _MODE


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def written_record(path: str | os.PathLike, sha256=sha256_file) -> tuple[int, str]:
    """``(size in bytes, hex sha256)`` of a file just written, to keep beside it and check with
    :func:`changed_since_written` before the file is trusted again. ``sha256``: the hasher
    (a caching one may be passed)."""
    return os.stat(path).st_size, sha256(path)


def changed_since_written(path: str | os.PathLike, size: int, digest: str,
                          sha256=sha256_file) -> str | None:
    """None while ``path`` still holds what :func:`written_record` recorded; else why not, as
    a phrase ("it has N bytes, M when written" / "its sha256 … differs from … recorded when
    it was written"). The size is checked first, so a truncated file is not hashed. A file
    touched but unchanged passes: unlike a side file that follows size and mtime, the record
    is never rewritten."""
    now = os.stat(path).st_size
    if now != int(size):
        return f"it has {now} bytes, {size} when written"
    h = sha256(path)
    if h != digest:
        return f"its sha256 {h[:12]}… differs from {digest[:12]}…, recorded when it was written"
    return None


def partial_prefix(out: str | os.PathLike) -> str:
    """``.<name>.<pid>.``: the prefix of a temporary file or folder (suffix ``.partial``) that
    this process writes beside ``out`` and renames onto it when complete, so that
    :func:`remove_dead_partials` can tell a killed writer's leftovers from a live one's."""
    return f".{Path(out).name}.{os.getpid()}."


def remove_dead_partials(out: str | os.PathLike) -> None:
    """Removes ``.<name>.<pid>.*.partial`` files and folders beside ``out`` (see
    :func:`partial_prefix`) whose process is gone (killed with SIGKILL, or the machine went
    down: a converted 7B model's would be 28 GB); a live process's is left alone."""
    out = Path(out)
    for f in out.parent.glob(f".{out.name}.*.partial"):
        pid = f.name[len(out.name) + 2:].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal): still writing
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            else:
                f.unlink()
            logging.getLogger("voodoo").info("removed %s, left by an interrupted run", f.name)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes ``data`` to ``path`` atomically (parents created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode())


def file_in_the_way(folder: str | os.PathLike) -> Path | None:
    """The existing file (not folder) at ``folder`` or at one of its parents, which would make
    creating ``folder`` fail with "Not a directory"; None when the path can be a folder."""
    q = _nearest_existing(folder)
    return q if q is not None and not q.is_dir() else None


def _nearest_existing(path: str | os.PathLike) -> Path | None:
    """``path`` or its nearest parent that exists (None: none does)."""
    p = Path(path).expanduser()
    return next((q for q in (p, *p.parents) if q.exists()), None)


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write that failed for want of space: ``ENOSPC``/``EDQUOT``, or numpy's
    short write (``tofile``: "N requested and M written", an OSError without errno)."""
    import errno
    import re
    if not isinstance(e, OSError):
        return False
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return e.errno is None and re.search(r"\d+ requested and \d+ written", str(e)) is not None


def free_mib(folder: str | os.PathLike) -> float | None:
    """MiB free for this user on the file system of ``folder`` (its nearest existing parent);
    None when that cannot be read."""
    import shutil
    q = _nearest_existing(folder)
    try:
        return shutil.disk_usage(q).free / 2**20 if q is not None else None
    except OSError:
        return None


def _mib(x: float) -> str:
    """MiB for a message: one decimal below 100 (2.0 free and 3.4 needed, not 2 and 3)."""
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def no_space_message(folder: str | os.PathLike | None, what: str, need: int | None = None,
                     candidates: tuple = ()) -> str:
    """One line for a write into ``folder`` that ran out of space: what was being written,
    what is free there (and at least ``need`` bytes, when known), and the ways out. ``folder``
    None (the error named no file): what is free in each of ``candidates``, the folders the
    command writes to."""
    if folder is None:
        frees = [(c, free_mib(c)) for c in dict.fromkeys(map(str, candidates))]
        where = ("no space left on a device while writing (the error names no file; free: "
                 + ", ".join(f"{c} {_mib(f)} MiB" for c, f in frees if f is not None) + ")")
    else:
        free = free_mib(folder)
        where = (f"no space left on the device of {folder} while writing {what}"
                 + (f" ({_mib(free)} MiB free" if free is not None else " (")
                 + (f", at least {_mib(need / 2**20)} MiB needed)" if need else ")"))
    return (where + "; nothing half-written was kept. Free some space (`voodoo doctor "
            "--prune_cache 30` deletes cache entries unused for 30 days) or write elsewhere "
            "(--output_dir, --cache_dir, VOODOO_CACHE), and rerun the same command")


def not_writable_message(e: OSError, caches: tuple = ()) -> str | None:
    """One line for a write refused by the file system (read-only: ``EROFS``; no permission:
    ``EACCES``/``EPERM``) into a named file: which folder it is and how to write elsewhere.
    ``caches``: the cache folders in use (``VOODOO_CACHE``'s, ``--cache_dir``); a file under
    one of them is named as the cache's. None for other errors, or one that names no file."""
    import errno
    if not isinstance(e, OSError) or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) \
            or not getattr(e, "filename", None):
        return None
    f = Path(str(e.filename)).absolute()
    cache = next((Path(c).absolute() for c in caches
                  if c and (Path(c).absolute() == f or Path(c).absolute() in f.parents)), None)
    why = e.strerror or str(e)
    verb = "cannot write" if e.errno == errno.EROFS else "cannot read or write"
    if cache is not None:
        return (f"{verb} {f} ({why}): it is in the Voodoo cache {cache}, which every "
                "run writes to; point it at a writable folder (VOODOO_CACHE=/path, or "
                "--cache_dir for the candidates), or make it writable, and rerun the same "
                "command")
    return (f"{verb} {f} ({why}): pass a writable --output_dir (or make "
            f"{f.parent} writable), and rerun the same command")
