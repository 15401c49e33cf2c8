"""voodoo.progress: off a terminal, progress is plain newline-terminated lines (no carriage
returns filling log files); tqdm bars are tamed the same way."""

from __future__ import annotations

import io
import subprocess
import sys

from voodoo.progress import Progress, fmt_duration


def test_fmt_duration():
    assert fmt_duration(9.44) == "9.4 s"
    assert fmt_duration(161.2) == "2 min 41 s"
    assert fmt_duration(3725) == "1 h 2 min"


def test_progress_off_a_tty_prints_lines():
    buf = io.StringIO()                       # not a TTY
    with Progress(100, "build tools", stream=buf, prefix="") as p:
        for _ in range(100):
            p.update(1)
    out = buf.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert [l.split(" (")[0] for l in lines[:-1]] == [f"build tools: {p}%"
                                                     for p in range(10, 101, 10)]
    assert lines[-1].startswith("build tools: done in ")


def test_progress_set_and_time_lines():
    buf = io.StringIO()
    p = Progress(8, "llama-perplexity x.gguf", stream=buf, prefix="", every_s=1e9)
    p.set(3)
    p.set(2)       # never backwards, and no new decile: no line
    p.set(8)
    p.close()
    lines = buf.getvalue().splitlines()
    assert [l.split(" (")[0] for l in lines[:2]] == ["llama-perplexity x.gguf: 38%",
                                                    "llama-perplexity x.gguf: 100%"]
    assert p.n == 8
    # a long step: after every_s seconds a heartbeat line says what is running
    buf = io.StringIO()
    p = Progress(100, "build", stream=buf, prefix="", every_s=0.0)
    p.set(5, note="compiling server.cpp")
    assert buf.getvalue().endswith(") compiling server.cpp\n")
    assert buf.getvalue().startswith("build: 5% (")


def test_tqdm_in_a_log_file_has_no_carriage_returns(tmp_path):
    """A child process whose stderr is a file (as under CI or `> log`): after tame_tqdm,
    tqdm writes whole lines, at most one per mininterval."""
    code = ("from voodoo.progress import tame_tqdm; import sys, time\n"
            "assert tame_tqdm(mininterval=0.05)\n"
            "from tqdm.auto import tqdm\n"
            "for _ in tqdm(range(30), desc='gates'):\n"
            "    time.sleep(0.01)\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True)
    text = log.read_text()
    assert "\r" not in text
    lines = [l for l in text.splitlines() if l.strip()]
    assert lines[-1].startswith("gates: 100%")
    assert 2 <= len(lines) < 30                       # throttled, not one line per step


def test_min_gap_keeps_a_fast_stage_short():
    """A fast stage of few units (llama-perplexity's 8 chunks) prints its end, not a line per
    unit, when 10%-step lines must be min_gap_s apart; the heartbeat still comes every_s."""
    buf = io.StringIO()
    with Progress(8, "llama-perplexity x.gguf", stream=buf, prefix="", min_gap_s=60.0) as p:
        for _ in range(8):
            p.update(1)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llama-perplexity x.gguf: done in "), lines
    buf = io.StringIO()
    p = Progress(8, "slow", stream=buf, prefix="", min_gap_s=60.0, every_s=0.0)
    p.update(1)
    assert buf.getvalue().startswith("slow: 12% (")


def test_log_lines_name_their_room(capsys):
    from voodoo.progress import log, room_log
    log("plain")
    room_log("models")("converted")
    err = capsys.readouterr().err
    assert err == "[voodoo] plain\n[voodoo models] converted\n"
