"""Children of a killed ``voodoo`` process: the converter and the llama.cpp tools get SIGTERM
when Voodoo dies, even by SIGKILL (a tester's ``kill -9`` during conversion left
``convert_hf_to_gguf.py`` running with PPID 1 and its ``.partial`` file in the cache)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

STARTERS = {
    "converter": "from voodoo.models import run_converter as f; f(CMD, dict(os.environ))",
    "llama tool": "from voodoo.evaluate import _run_tool as f; f(CMD, None)",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped by init) is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("how", sorted(STARTERS))
def test_a_child_dies_with_a_killed_voodoo(how, tmp_path):
    pidfile = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 120"]
    code = f"import os\nCMD = {cmd!r}\n{STARTERS[how]}\n"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):   # the import of torch on a loaded machine: up to a minute
            if pidfile.is_file() and pidfile.read_text().strip():
                break
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        for _ in range(100):
            if not _alive(child):
                break
            time.sleep(0.1)
        assert not _alive(child), f"{how}: child {child} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if pidfile.is_file() and pidfile.read_text().strip():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
