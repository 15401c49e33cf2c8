"""Child processes that do not outlive Voodoo.

A ``voodoo`` process killed by SIGKILL (the OOM killer, ``kill -9``, a scheduler's hard stop)
cannot stop its children, and a llama.cpp converter or tool then ran on with PPID 1, spending
CPU and writing its ``.partial`` file beside the rerun that converts the same model (a tester's
report). :func:`die_with_parent` as ``preexec_fn`` has the kernel send the child SIGTERM when
its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; a no-op elsewhere).
"""

from __future__ import annotations

import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def _bind_prctl():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


#: bound here, in the parent: the child, between fork and exec, only makes the call (no import,
#: no library lookup that could wait on a lock another thread of the parent held at the fork)
_PRCTL = _bind_prctl()


def die_with_parent() -> None:
    """``preexec_fn`` for :mod:`subprocess`: in the child before exec, asks for SIGTERM when
    the process that started it dies, even by SIGKILL. A no-op where libc has no ``prctl``."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
