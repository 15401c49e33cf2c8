"""Progress for long stages that reads well both on a terminal and in a log file.

On a terminal (``stream.isatty()``) a tqdm bar redraws in place. Anywhere else (CI logs, ``>
log.txt``, ``tee``) redrawing with carriage returns fills the file with one huge line, so
:class:`Progress` prints a plain line instead, at most every ``every_s`` seconds (and at
10%-steps of the total), ending with the elapsed time::

    [voodoo] build llama.cpp tools: 40% (1 min 5 s)
    [voodoo] build llama.cpp tools: done in 2 min 41 s

:func:`tame_tqdm` (called by ``voodoo``'s main) makes every other tqdm bar behave the same
way when output is not a terminal: a newline-terminated line at most every 30 s.
"""

from __future__ import annotations

import sys
import time


def log(msg: str, room: str | None = None) -> None:
    """One status line to stderr, flushed: ``[voodoo] msg``, or ``[voodoo ROOM] msg`` for a
    stage that names itself (``models``, ``tensormap``, ``bootstrap``)."""
    print(f"[voodoo{' ' + room if room else ''}] {msg}", file=sys.stderr, flush=True)


def room_log(room: str):
    """:func:`log` bound to ``room``: ``_log = room_log("models")``."""
    return lambda msg: log(msg, room)


def fmt_duration(seconds: float) -> str:
    """``161.2`` -> ``"2 min 41 s"``; ``9.4`` -> ``"9.4 s"``; ``3725`` -> ``"1 h 2 min"``."""
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {s} s"
    h, m = divmod(m, 60)
    return f"{h} h {m} min"


def is_tty(stream=None) -> bool:
    """Whether ``stream`` (default stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A progress counter over ``total`` units (``update(n)``; ``close()`` prints the end).

    Args:
        total: units in all (e.g. 100 for percent).
        desc: what is running, e.g. ``"build llama.cpp tools"``.
        unit: the unit's name for the tqdm bar.
        stream: where to write (default stderr).
        every_s: in plain-line mode, the longest silence between lines (seconds).
        tty: force the mode (default: ``stream.isatty()``).
        min_gap_s: in plain-line mode, the shortest time between two 10%-step lines (a fast
            stage of few units then prints a line or two and its end, not one per unit).
    """

    def __init__(self, total: int, desc: str, unit: str = "it", stream=None,
                 every_s: float = 30.0, tty: bool | None = None, prefix: str = "[voodoo] ",
                 min_gap_s: float = 0.0):
        self.total, self.desc, self.n = int(total), desc, 0
        self.stream = sys.stderr if stream is None else stream
        self.every_s, self.prefix, self.min_gap_s = every_s, prefix, min_gap_s
        self.t0 = self._last_t = time.monotonic()
        self._last_decile = 0
        self.note = ""
        self.bar = None
        if is_tty(self.stream) if tty is None else tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)
            except ImportError:  # pragma: no cover
                self.bar = None

    def _line(self, text: str) -> None:
        print(f"{self.prefix}{self.desc}: {text}", file=self.stream, flush=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Adds ``n`` units (0: only a heartbeat). ``note``: what is being done now (shown
        after the percentage in plain-line mode, as the bar's postfix on a terminal)."""
        self.n = min(self.total, self.n + n) if self.total else self.n + n
        if note is not None:
            self.note = note
        if self.bar is not None:
            if note is not None:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        decile = int(10 * self.n / self.total) if self.total else 0
        if (decile > self._last_decile and now - self._last_t >= self.min_gap_s) or \
                now - self._last_t >= self.every_s:
            self._last_decile, self._last_t = decile, now
            pct = f"{100 * self.n / self.total:.0f}%" if self.total else f"{self.n}"
            note = f" {self.note}" if self.note else ""
            self._line(f"{pct} ({fmt_duration(now - self.t0)}){note}")

    def set(self, n: int, note: str | None = None) -> None:
        """Moves the counter to ``n`` units (never backwards); ``note`` as in
        :meth:`update`."""
        self.update(max(0, n - self.n), note)

    def close(self, ok: bool = True) -> float:
        """Ends the bar; in plain-line mode prints ``done in …`` when ``ok``. Returns the
        elapsed seconds."""
        dt = time.monotonic() - self.t0
        if self.bar is not None:
            self.bar.close()
        elif ok:
            self._line(f"done in {fmt_duration(dt)}")
        return dt

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        self.close(ok=et is None)


def tame_tqdm(stream=None, mininterval: float = 30.0) -> bool:
    """When ``stream`` (default stderr) is not a terminal, makes every tqdm bar (``tqdm``,
    ``tqdm.auto``; created afterwards) print at most one newline-terminated line every
    ``mininterval`` seconds instead of redrawing with carriage returns. A bar's own
    ``mininterval`` argument is kept. Returns True when it changed anything."""
    if is_tty(stream):
        return False
    try:
        import tqdm.std as tstd
    except ImportError:  # pragma: no cover
        return False
    if getattr(tstd.tqdm, "_voodoo_plain", False):
        return True
    orig_init = tstd.tqdm.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("mininterval", mininterval)
        orig_init(self, *args, **kwargs)

    def status_printer(file):
        flush = getattr(file, "flush", lambda: None)

        def print_status(s):
            s = s.strip()
            if s:
                file.write(s + "\n")
                flush()
        return print_status

    tstd.tqdm.__init__ = __init__
    tstd.tqdm.status_printer = staticmethod(status_printer)
    # no monitor thread: it forces a refresh (an extra line in a log) when a bar has waited
    # maxinterval (10 s) for a slow iteration, e.g. a training step on a loaded machine
    tstd.tqdm.monitor_interval = 0
    tstd.tqdm._voodoo_plain = True
    return True
