"""Talking to a GGUF with llama.cpp's own programs: one-shot generation (``voodoo chat``) and
an HTTP server on 127.0.0.1 (``voodoo serve``).

:func:`generate` runs ``llama-completion`` for one turn: the prompt goes through the chat
template stored in the GGUF (``tokenizer.chat_template``; ``-cnv -st``), or is continued as
plain text when the GGUF has none (``-no-cnv``). Decoding is greedy (``--temp 0``), so the
same file and prompt always give the same text; :func:`side_by_side` runs a Voodoo GGUF and
its unquantized reference on the same prompt.

:class:`LlamaServer` starts ``llama-server`` on 127.0.0.1, waits until ``/health`` answers, and
stops it (SIGTERM, then SIGKILL) on exit; :func:`complete` sends one request to its
``/completion`` endpoint. The server also speaks OpenAI's API (``/v1/chat/completions``,
``/v1/completions``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .llamacpp import tool_env, tool_path
from .proc import die_with_parent

__all__ = ["ChatError", "generate", "side_by_side", "Reply", "LlamaServer", "complete",
           "free_port", "port_in_use", "has_chat_template"]


class ChatError(RuntimeError):
    """llama-completion or llama-server failed (the message holds the end of its output)."""


def _tail(text: str, n: int = 20) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-n:])


def has_chat_template(gguf: str | os.PathLike) -> bool:
    """Whether the GGUF stores a chat template (``tokenizer.chat_template``)."""
    from .ggufio import read_gguf
    return "tokenizer.chat_template" in read_gguf(gguf).fields


@dataclass
class Reply:
    """One generation: ``text`` (the model's answer, prompt and template not included),
    ``model`` (the GGUF), ``templated`` (whether the chat template was applied), ``seconds``
    (wall time, model load included), ``cut`` (the answer reached ``n_predict`` tokens:
    llama.cpp stopped it, not the model)."""

    text: str
    model: Path
    templated: bool
    seconds: float
    cut: bool = False


def generate(gguf: str | os.PathLike, prompt: str, n_predict: int = 128, ctx: int = 2048,
             threads: int | None = None, timeout: float | None = 600) -> Reply:
    """One greedy answer of ``gguf`` to ``prompt`` from ``llama-completion``.

    With a chat template in the GGUF: ``-cnv -st --jinja`` (one user turn rendered by the
    GGUF's own Jinja template, system prompt defaults included, as llama-server does; without
    ``--jinja`` llama.cpp would substitute a built-in template it guesses from the text); without
    a template: ``-no-cnv`` (the prompt is continued as text). ``--temp 0`` (greedy),
    ``-n n_predict`` tokens at most, ``-c ctx``, ``-t threads`` (default: llama.cpp's).
    The prompt is not echoed (``--no-display-prompt``); stdin is closed, so the tool can never
    wait for input.

    Raises voodoo.llamacpp.LlamaCppNotBuilt (no tool: run ``voodoo bootstrap``),
    FileNotFoundError, ChatError (the tool failed or timed out)."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    templated = has_chat_template(gguf)
    args = [str(tool_path("llama-completion")), "-m", str(gguf), "-p", prompt,
            "-n", str(int(n_predict)), "-c", str(int(ctx)), "--temp", "0", "--seed", "0",
            "--no-display-prompt", "--no-warmup", "--simple-io",
            *(["-cnv", "-st", "--jinja"] if templated else ["-no-cnv"])]
    if threads:
        args += ["-t", str(int(threads))]
    t0 = time.monotonic()
    try:
        r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           errors="replace", timeout=timeout, env=tool_env())
    except subprocess.TimeoutExpired as e:
        raise ChatError(f"llama-completion on {gguf.name} did not finish in {timeout} s") \
            from e
    if r.returncode:
        from .llamatext import untokenizable
        bad = untokenizable(gguf, prompt + ("\n" if templated else ""))
        why = ""
        if bad and "out_of_range" in r.stderr + r.stdout:  # byte_to_token threw: the cause
            why = (f"; llama.cpp's tokenizer cannot read {', '.join(map(repr, bad[:8]))} with "
                   "this model's vocabulary (SentencePiece without byte tokens), which aborts it")
            why += (" (the newlines of the GGUF's chat template among them: llama.cpp cannot "
                    "run this model through its template)" if templated and "\n" in bad
                    else ": give a prompt without them")
        raise ChatError(f"llama-completion failed on {gguf.name} (exit {r.returncode}){why}:\n"
                        f"{_tail(r.stderr or r.stdout)}")
    # common_perf_print's "eval time = ... / N runs": the first token comes from the prompt's
    # evaluation, so n_predict tokens are N + 1 (an end-of-text at exactly that count also
    # reads as cut)
    runs = re.findall(r"\beval time =[^/\n]*/\s*(\d+) runs", r.stderr)
    cut = bool(runs) and int(runs[-1]) + 1 >= int(n_predict)
    return Reply(_clean(r.stdout), gguf, templated, time.monotonic() - t0, cut)


def _clean(out: str) -> str:
    """The answer in llama-completion's stdout: without the interactive prompt marker
    (``"> "``) it prints after the turn and without ``[end of text]``."""
    text = out.replace("[end of text]", "")
    lines = text.rstrip().splitlines()
    while lines and lines[-1].strip() in (">", ""):
        lines.pop()
    return "\n".join(lines).strip()


def side_by_side(gguf: str | os.PathLike, prompt: str, reference: str | os.PathLike | None,
                 n_predict: int = 128, ctx: int = 2048, threads: int | None = None,
                 out=None) -> list[Reply]:
    """Prints (to ``out``, default stdout) the answer of ``gguf`` and, when ``reference`` is
    given, the reference model's answer to the same prompt, each under a header naming the
    file and its size in MiB. Returns the replies (``gguf`` first)."""
    import sys
    out = sys.stdout if out is None else out
    replies = []
    print(f"prompt: {prompt}", file=out)
    for label, f in (("quantized", gguf), ("reference", reference)):
        if f is None:
            continue
        rep = generate(f, prompt, n_predict=n_predict, ctx=ctx, threads=threads)
        replies.append(rep)
        size = Path(f).stat().st_size / 2**20
        how = "chat template" if rep.templated else "no chat template: plain continuation"
        print(f"\n--- {label}: {Path(f).name} ({size:.1f} MiB; greedy, {how}; "
              f"{rep.seconds:.1f} s)", file=out)
        print(rep.text + (f" [... cut at --n_predict {n_predict}]" if rep.cut else ""),
              file=out, flush=True)
    return replies


# ------------------------------------------------------------------------------ server
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (binding it fails). Checked before
    llama-server starts: otherwise another server on that port would answer ``/health`` and be
    taken for the new one."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return False                      # an unknown host: llama-server says so itself
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as servers bind
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


class LlamaServer:
    """``llama-server -m GGUF --host HOST --port PORT`` as a context manager.

    ``start()`` returns once ``GET /health`` answers 200 (the model is loaded) or raises
    ChatError when the server exits or ``timeout`` seconds pass first (with its log's tail).
    ``stop()`` sends SIGTERM, waits up to 10 s, then SIGKILL. The server's output goes to
    ``log`` (a file path; default a temporary file, deleted by ``stop()`` and kept, with its
    path in the message, when the server fails to start).

    Args:
        gguf: the model file.
        host: the address to bind; 127.0.0.1 keeps it on this machine.
        port: TCP port (default: a free one, :func:`free_port`).
        ctx: context size (``-c``); threads: ``-t``.
    """

    def __init__(self, gguf: str | os.PathLike, host: str = "127.0.0.1", port: int | None = None,
                 ctx: int = 2048, threads: int | None = None,
                 log: str | os.PathLike | None = None):
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise FileNotFoundError(f"{self.gguf}: no such GGUF file")
        self.host, self.port = host, int(port) if port else free_port(host)
        self.ctx, self.threads = ctx, threads
        self.log = Path(log) if log else None
        self._own_log = False
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (an IPv6 host in brackets: ``http://[::1]:PORT``)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") \
            else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The llama-server command line."""
        args = [str(tool_path("llama-server")), "-m", str(self.gguf), "--host", self.host,
                "--port", str(self.port), "-c", str(int(self.ctx)), "--no-warmup"]
        if self.threads:
            args += ["-t", str(int(self.threads))]
        return args

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        """Starts the server and waits for ``/health`` (see the class docstring)."""
        if port_in_use(self.host, self.port):
            raise ChatError(f"{self.host}:{self.port} is already in use (another voodoo serve "
                            f"or llama-server?): pick a free port (voodoo serve --port N) or "
                            f"stop that server")
        args = self.command()
        if self.log is None:
            fd, name = tempfile.mkstemp(prefix="llama-server.", suffix=".log")
            os.close(fd)
            self.log, self._own_log = Path(name), True
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT, env=tool_env(),
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._close_log()
                self._own_log = False   # kept for the user: its path is in the message
                raise ChatError(f"llama-server exited (code {self.proc.returncode}) before "
                                f"answering on {self.url} (log: {self.log}):\n"
                                f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self._own_log = False
                self.stop()
                raise ChatError(f"llama-server did not answer on {self.url}/health within "
                                f"{timeout} s (log: {self.log}):\n{self._log_tail()}")
            time.sleep(0.25)

    def _log_tail(self) -> str:
        try:
            return _tail(self.log.read_text(errors="replace")) if self.log else ""
        except OSError:
            return ""

    def _close_log(self) -> None:
        if getattr(self, "_logf", None) is not None:
            self._logf.close()
            self._logf = None

    def stop(self, grace: float = 10.0) -> int | None:
        """Stops the server (SIGTERM, then SIGKILL after ``grace`` s). Returns its exit code
        (None when it was never started)."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._close_log()
        if self._own_log and self.log is not None:
            self.log.unlink(missing_ok=True)
        return p.returncode

    def __enter__(self) -> "LlamaServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def complete(url: str, prompt: str, n_predict: int = 32, timeout: float = 120.0) -> dict:
    """One greedy request to a llama-server's ``POST /completion`` (``{"prompt", "n_predict",
    "temperature": 0}``). Returns the server's JSON answer (``"content"`` holds the text).
    Raises ChatError on an HTTP error."""
    body = json.dumps({"prompt": prompt, "n_predict": int(n_predict), "temperature": 0.0,
                       "seed": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise ChatError(f"{url}/completion answered {e.code}: {e.read()[:500]!r}") from e
