"""Evaluation: PPL, KLD and same top-p, in torch and with llama.cpp's ``llama-perplexity``.

Units: negative log-likelihoods and KL divergences are in **nats per token**; ``same_top_p`` is
a **fraction** in [0, 1] (llama-perplexity prints it ×100, as a percentage).

The torch numbers (:func:`torch_ppl_kl`) and llama.cpp's (:func:`run_perplexity`) measure
different token sets: torch scores every position of each block, llama-perplexity only the
second half of each ``ctx`` chunk (``tools/perplexity/perplexity.cpp``), with a BOS first when
the vocabulary asks for one. Compare like with like.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from .fsutil import atomic_write_text, changed_since_written, sha256_file, written_record
from .llamatext import readable_text
from .progress import log as _log

from voodoo.llamacpp import LlamaCppNotBuilt, cache_root, llama_cpp_commit, tool_env, tool_path

__all__ = ["torch_ppl_kl", "run_perplexity", "kld_base", "parse_perplexity_output",
           "format_table", "save_report", "PerplexityError", "LlamaCppNotBuilt",
           "assignment_grid", "plot_assignment", "plot_size_vs_kld"]


class PerplexityError(RuntimeError):
    """llama-perplexity failed or printed nothing Voodoo could parse (message holds its tail)."""


# ------------------------------------------------------------------------------------- torch
@torch.no_grad()
def torch_ppl_kl(student: torch.nn.Module, teacher: torch.nn.Module | None,
                 blocks: torch.Tensor, batch_size: int = 1) -> dict:
    """PPL of ``student`` on ``blocks`` and, when ``teacher`` is given, KL(teacher ‖ student).

    ``blocks``: LongTensor ``(n_blocks, seq_len)``. PPL = exp(mean NLL of tokens 1..seq_len-1
    given the tokens before them); KL and same top-p are averaged over every position of every
    block (``n_blocks * seq_len`` distributions). Logits are compared in float32.

    Returns ``{"ppl", "nll" (nats/token), "kl" (mean nats/token or None), "same_top_p"
    (fraction of positions where both argmaxes agree, or None), "teacher_ppl" (or None),
    "n_tokens" (tokens scored for PPL)}``. Raises ValueError when ``blocks`` holds no token
    to score."""
    models = [student] + ([teacher] if teacher is not None else [])
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    nll_s = nll_t = kl = 0.0
    same = n_pos = n_tok = 0
    try:
        for i in range(0, blocks.shape[0], batch_size):
            ids = blocks[i:i + batch_size]                                   # (B, T)
            dev = next(student.parameters()).device
            s = torch.log_softmax(student(input_ids=ids.to(dev), use_cache=False)
                                  .logits.float(), -1).cpu()                 # (B, T, V)
            tgt = ids[:, 1:].unsqueeze(-1)                                   # (B, T-1, 1)
            nll_s += -s[:, :-1].gather(-1, tgt).sum().item()
            n_tok += tgt.numel()
            if teacher is not None:
                dev_t = next(teacher.parameters()).device
                t = torch.log_softmax(teacher(input_ids=ids.to(dev_t), use_cache=False)
                                      .logits.float(), -1).cpu()             # (B, T, V)
                nll_t += -t[:, :-1].gather(-1, tgt).sum().item()
                kl += (t.exp() * (t - s)).sum().item()
                same += (t.argmax(-1) == s.argmax(-1)).sum().item()
                n_pos += ids.numel()
                del t
            del s
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    if not n_tok:
        raise ValueError("torch_ppl_kl: no tokens to score (blocks of shape "
                         f"{tuple(blocks.shape)}: give at least one block of 2+ tokens)")
    nll = nll_s / n_tok
    out = {"ppl": math.exp(nll), "nll": nll, "kl": None, "same_top_p": None,
           "teacher_ppl": None, "n_tokens": n_tok}
    if teacher is not None:
        out.update(kl=kl / n_pos, same_top_p=same / n_pos, teacher_ppl=math.exp(nll_t / n_tok))
    return out


# --------------------------------------------------------------------------------- llama.cpp
_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|-?nan|-?inf))"
_PM = r"\s*(?:±|\+/-)\s*"
_PATTERNS = {
    # perplexity mode (perplexity()): "Final estimate: PPL = %.4lf +/- %.5lf"
    "final": re.compile(r"Final estimate: PPL = " + _NUM + _PM + _NUM),
    # KL-divergence mode (kl_divergence())
    "ppl_q": re.compile(r"Mean PPL\(Q\)\s*:\s*" + _NUM + _PM + _NUM),
    "ppl_base": re.compile(r"Mean PPL\(base\)\s*:\s*" + _NUM + _PM + _NUM),
    "ln_ratio": re.compile(r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _NUM + _PM + _NUM),
    "kld": re.compile(r"Mean\s+KLD:\s*" + _NUM + _PM + _NUM),
    "kld_max": re.compile(r"Maximum KLD:\s*" + _NUM),
    "kld_p99_9": re.compile(r"99\.9%\s+KLD:\s*" + _NUM),
    "kld_p99": re.compile(r"99\.0%\s+KLD:\s*" + _NUM),
    "kld_median": re.compile(r"Median\s+KLD:\s*" + _NUM),
    "rms_dp": re.compile(r"RMS Δp\s*:\s*" + _NUM + _PM + _NUM + r"\s*%"),
    "same_top_p": re.compile(r"Same top p:\s*" + _NUM + _PM + _NUM + r"\s*%"),
    "n_chunks": re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)"),
}


def parse_perplexity_output(text: str) -> dict:
    """Parses llama-perplexity's output (stdout and stderr together) into a dict.

    Perplexity mode: ``ppl``, ``ppl_err`` (the "+/-" of "Final estimate"). KL-divergence mode:
    ``ppl``, ``ppl_err`` (Mean PPL(Q)), ``ppl_base``, ``ppl_base_err``, ``ln_ppl_ratio``,
    ``kld``, ``kld_err`` (mean, nats/token), ``kld_max``, ``kld_p99_9``, ``kld_p99``,
    ``kld_median``, ``rms_dp`` (fraction), ``same_top_p``, ``same_top_p_err`` (fractions). Both:
    ``n_chunks``, ``ctx``. Keys whose lines are absent are left out. Line formats from
    ``tools/perplexity/perplexity.cpp`` (``perplexity()``, ``kl_divergence()``)."""
    out: dict = {}

    def last(key):
        ms = _PATTERNS[key].findall(text)
        return ms[-1] if ms else None

    m = last("final")
    if m:
        out["ppl"], out["ppl_err"] = float(m[0]), float(m[1])
    m = last("ppl_q")
    if m:
        out["ppl"], out["ppl_err"] = float(m[0]), float(m[1])
    m = last("ppl_base")
    if m:
        out["ppl_base"], out["ppl_base_err"] = float(m[0]), float(m[1])
    m = last("ln_ratio")
    if m:
        out["ln_ppl_ratio"], out["ln_ppl_ratio_err"] = float(m[0]), float(m[1])
    m = last("kld")
    if m:
        out["kld"], out["kld_err"] = float(m[0]), float(m[1])
    for key in ("kld_max", "kld_p99_9", "kld_p99", "kld_median"):
        m = last(key)
        if m:
            out[key] = float(m)
    m = last("rms_dp")
    if m:
        out["rms_dp"], out["rms_dp_err"] = float(m[0]) / 100, float(m[1]) / 100
    m = last("same_top_p")
    if m:
        out["same_top_p"], out["same_top_p_err"] = float(m[0]) / 100, float(m[1]) / 100
    m = last("n_chunks")
    if m:
        out["n_chunks"], out["ctx"] = int(m[0]), int(m[1])
    return out


#: Lines of a crashed llama.cpp tool's output that are its debugger's backtrace (ggml's abort
#: handler runs gdb/lldb: ``#3  0x... in ggml_abort ...``, ``[New LWP ...]``), not its reason.
_BACKTRACE = re.compile(r"^\s*(#\d+\s|\[New LWP|\[Thread debugging|\[Inferior |Using host "
                        r"libthread_db|0x[0-9a-f]+ in |warning: \d+\s)")
#: Lines that carry a llama.cpp tool's reason for failing.
_REASON = re.compile(r"error|GGML_ASSERT|fatal|failed|terminate called|what\(\)|abort",
                     re.IGNORECASE)


def _tail(text: str, n: int = 25) -> str:
    """The last ``n`` lines of a tool's output that are not a debugger backtrace, preceded by
    up to 5 earlier lines that name an error (so an abort's reason survives a long trace)."""
    lines = [ln for ln in text.rstrip().splitlines() if not _BACKTRACE.match(ln)]
    tail = lines[-n:]
    earlier = [ln for ln in lines[:-n] if _REASON.search(ln)][-5:]
    return "\n".join(earlier + (["..."] if earlier else []) + tail)


_HASHES: dict[tuple, str] = {}


def _sha256_file(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


#: Set once a tool died of SIGILL with weight repacking on: later runs pass ``--no-repack``.
#: A llama.cpp built with ``-march=native`` on a CPU that reports AMX inside a VM that does not
#: enable the AMX tile state dies in ``ggml_backend_amx_mul_mat``; the AMX (and other repacked)
#: buffers are only used when repacking is on. ``VOODOO_LLAMA_NO_REPACK=1`` forces it.
_NO_REPACK = os.environ.get("VOODOO_LLAMA_NO_REPACK", "") not in ("", "0")


_TOTAL = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks")
_PPL_CHUNK = re.compile(r"\[(\d+)\]-?[\d.]+(?:e[-+]?\d+)?,|\[(\d+)\](?:-?nan|-?inf),")
_KL_CHUNK = re.compile(r"^\s*(\d+)\s{4}", re.MULTILINE)


def _chunks_done(text: str) -> int:
    """Chunks llama-perplexity has finished so far, from its running output: the ``[i]ppl,``
    entries of perplexity mode or the per-chunk rows after KL mode's ``chunk  PPL`` header."""
    done = 0
    for m in _PPL_CHUNK.finditer(text):
        done = max(done, int(m.group(1) or m.group(2)))
    i = text.find("chunk             PPL")
    if i >= 0:
        for m in _KL_CHUNK.finditer(text, i):
            done = max(done, int(m.group(1)))
    return done


def _raise_if_too_short(out: str, text: Path, ctx: int) -> None:
    """One clear line for llama-perplexity's refusal of a short text (``tools/perplexity``:
    "you need at least 2*n_ctx tokens to evaluate perplexity with a context of n_ctx")."""
    import re
    m = re.search(r"you need at least (\d+) tokens", out)
    if m:
        raise PerplexityError(f"{text} is too short for llama-perplexity -c {ctx}: it needs at "
                              f"least {m.group(1)} tokens; give a longer text or a smaller "
                              "--ctx")


def _run_tool(args: list[str], timeout: float | None, desc: str | None = None) -> str:
    """Runs a llama.cpp tool; returns stdout+stderr. With ``desc``, shows llama-perplexity's
    progress over its chunks (:class:`voodoo.progress.Progress`: a bar on a terminal, a line
    per 10%% otherwise). Retries once with ``--no-repack`` when the tool dies of SIGILL (see
    ``_NO_REPACK``). Raises PerplexityError on failure or after ``timeout`` seconds."""
    global _NO_REPACK
    import threading

    from .progress import Progress
    if _NO_REPACK and "--no-repack" not in args:
        args = [*args, "--no-repack"]
    from .proc import die_with_parent
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=tool_env(),
                         preexec_fn=die_with_parent)
    parts: list[str] = []
    state = {"bar": None}

    def pump():
        buf = b""
        while True:
            chunk = p.stdout.read1(1 << 16) if hasattr(p.stdout, "read1") else \
                p.stdout.read(1 << 16)
            if not chunk:
                break
            buf += chunk
            text = buf.decode(errors="replace")
            if desc is None:
                continue
            if state["bar"] is None:
                m = _TOTAL.search(text)
                if m:
                    state["bar"] = Progress(int(m.group(1)), desc, unit="chunk", min_gap_s=10.0)
            if state["bar"] is not None:
                state["bar"].set(_chunks_done(text))
        parts.append(buf.decode(errors="replace"))

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        th.join(5)
        raise PerplexityError(f"`{' '.join(args)}` timed out after {timeout} s\n"
                              f"{_tail(''.join(parts))}") from None
    except BaseException:
        p.kill()
        p.wait()
        raise
    th.join()
    out = "".join(parts)
    if state["bar"] is not None:
        state["bar"].close(ok=rc == 0)
    if rc in (-4, 132) and "--no-repack" not in args:   # SIGILL
        _NO_REPACK = True
        return _run_tool(args, timeout, desc)
    if rc:
        raise PerplexityError(f"`{' '.join(args)}` failed (exit {rc}):\n{_tail(out)}")
    return out


def _common_args(ctx: int, chunks: int | None, threads: int | None,
                 batch: int | None) -> list[str]:
    a = ["-c", str(ctx)]
    if chunks is not None:
        a += ["--chunks", str(chunks)]
    if threads is not None:
        a += ["-t", str(threads)]
    if batch is not None:
        a += ["-b", str(batch)]
    return a


def kld_base(reference_gguf: str | os.PathLike, text_file: str | os.PathLike, ctx: int = 512,
             chunks: int | None = None, threads: int | None = None, batch: int | None = None,
             cache_dir: str | os.PathLike | None = None, timeout: float | None = None) -> dict:
    """The base-logits file for KLD against ``reference_gguf`` on ``text_file``, made once with
    ``llama-perplexity --kl-divergence-base FILE.kld`` and cached.

    Cached in ``cache_dir`` (default ``<cache>/kld``) under a key of the model's sha256, the
    text's sha256, ``ctx``, ``chunks`` and the llama.cpp commit; written to a temporary name and
    renamed when the run succeeded. Size: about ``2·n_vocab·ctx`` bytes per chunk (≈50 MB per
    chunk for a 49k vocabulary at ctx 512), so limit ``chunks`` for large vocabularies.

    Returns ``{"path": .kld path, "ppl", "ppl_err", "n_chunks", "ctx", "cached": bool}`` (the
    reference's own PPL from that run). Raises LlamaCppNotBuilt (no tool), FileNotFoundError,
    PerplexityError (the run failed or printed no PPL)."""
    ref, text = Path(reference_gguf), Path(text_file)
    for p in (ref, text):
        if not p.is_file():
            raise FileNotFoundError(p)
    shown, text = text, readable_text(ref, text)  # an unreadable one would abort the tool
    key_src = json.dumps({"model": _sha256_file(ref), "text": _sha256_file(text), "ctx": ctx,
                          "chunks": chunks, "llama.cpp": llama_cpp_commit()}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    d = Path(cache_dir) if cache_dir is not None else cache_root() / "kld"
    d.mkdir(parents=True, exist_ok=True)
    kld_path, info_path = d / f"{key}.kld", d / f"{key}.json"
    if kld_path.is_file() and info_path.is_file():
        info = _cached_kld_info(kld_path, info_path)
        if info is not None:
            return {**info, "path": str(kld_path), "cached": True}
    exe = str(tool_path("llama-perplexity"))
    fd, tmp = tempfile.mkstemp(prefix=f"{key}.", suffix=".kld.partial", dir=d)
    os.close(fd)
    try:
        out = _run_tool([exe, "-m", str(ref), "-f", str(text),
                         *_common_args(ctx, chunks, threads, batch),
                         "--kl-divergence-base", tmp], timeout,
                        desc=f"llama-perplexity {ref.name} (base logits)")
        res = parse_perplexity_output(out)
        if "ppl" not in res or os.path.getsize(tmp) <= 16:
            _raise_if_too_short(out, shown, ctx)
            raise PerplexityError(f"llama-perplexity wrote no base logits for {ref.name} on "
                                  f"{shown.name} (ctx {ctx}):\n{_tail(out)}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, kld_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    info = {"ppl": res["ppl"], "ppl_err": res.get("ppl_err"), "n_chunks": res.get("n_chunks"),
            "ctx": ctx, "reference": str(ref), "text": str(text), "key": json.loads(key_src),
            **dict(zip(("kld_bytes", "kld_sha256"), written_record(kld_path, _sha256_file)))}
    _write_atomic(info_path, json.dumps(info, indent=1) + "\n")
    return {**info, "path": str(kld_path), "cached": False}


def _cached_kld_info(kld_path: Path, info_path: Path) -> dict | None:
    """The record of a cached base-logits file when the pair is intact: the ``.json`` parses
    and the ``.kld`` has the size and sha256 it was written with (hashed once per process and
    file version). A damaged pair is removed, with a line, and None returned so it is made
    again; an entry from before these records gets them now."""
    why = None
    try:
        info = json.loads(info_path.read_text())
        if not isinstance(info, dict) or "ppl" not in info:
            raise ValueError("no ppl")
    except (OSError, ValueError) as e:
        info, why = None, f"its record {info_path.name} is unreadable ({e})"
    if info is not None:
        if "kld_bytes" not in info or "kld_sha256" not in info:
            size, digest = written_record(kld_path, _sha256_file)
            info.update(kld_bytes=size, kld_sha256=digest)
            try:
                _write_atomic(info_path, json.dumps(info, indent=1) + "\n")
            except OSError:
                pass
        else:
            why = changed_since_written(kld_path, info["kld_bytes"], info["kld_sha256"],
                                        _sha256_file)
    if why is None:
        return info
    _log(f"the cached base logits {kld_path} are damaged ({why}): removing them and running "
         "the reference again")
    for q in (kld_path, info_path):
        q.unlink(missing_ok=True)
    return None


def run_perplexity(gguf: str | os.PathLike, text_file: str | os.PathLike, ctx: int = 512,
                   chunks: int | None = None, kl_base: str | os.PathLike | None = None,
                   threads: int | None = None, batch: int | None = None,
                   timeout: float | None = None) -> dict:
    """Runs ``llama-perplexity -m GGUF -f TEXT -c CTX [--chunks N]`` and parses the result.

    Without ``kl_base``: returns ``{"ppl", "ppl_err", "n_chunks", "ctx", "model"}``.
    With ``kl_base`` (the reference GGUF, or a ready ``.kld`` base-logits file): the reference's
    base logits are made (or taken from the cache) with :func:`kld_base`, then the candidate runs
    with ``--kl-divergence-base FILE.kld --kl-divergence``; the result adds ``ppl_base``,
    ``kld``, ``kld_err``, ``kld_p99_9``, ``kld_p99``, ``kld_median``, ``kld_max`` (nats/token),
    ``same_top_p``, ``same_top_p_err``, ``rms_dp`` (fractions), ``kl_base`` (the .kld path).
    The KL run evaluates the tokens stored in the .kld file (``chunks`` and ``ctx`` of the base
    run). ``threads``/``batch``: llama.cpp's ``-t``/``-b`` (default: its own).

    Raises LlamaCppNotBuilt when the tool is not built, FileNotFoundError for a missing input,
    PerplexityError when the tool fails or prints no result (with its output's tail;
    llama-perplexity exits 0 after some errors, e.g. a text shorter than 2·ctx tokens)."""
    model, text = Path(gguf), Path(text_file)
    for p in (model, text):
        if not p.is_file():
            raise FileNotFoundError(p)
    shown, text = text, readable_text(model, text)  # an unreadable one would abort the tool
    exe = str(tool_path("llama-perplexity"))
    if kl_base is None:
        out = _run_tool([exe, "-m", str(model), "-f", str(text),
                         *_common_args(ctx, chunks, threads, batch)], timeout,
                        desc=f"llama-perplexity {model.name}")
        res = parse_perplexity_output(out)
        if "ppl" not in res:
            _raise_if_too_short(out, shown, ctx)
            raise PerplexityError(f"llama-perplexity printed no final PPL for {model.name}:\n"
                                  f"{_tail(out)}")
        return {**res, "model": str(model)}
    kb = Path(kl_base)
    if kb.suffix == ".kld":
        if not kb.is_file():
            raise FileNotFoundError(kb)
        base = {"path": str(kb)}
    else:
        base = kld_base(kb, shown, ctx=ctx, chunks=chunks, threads=threads, batch=batch,
                        timeout=timeout)
    out = _run_tool([exe, "-m", str(model), *_common_args(ctx, None, threads, batch),
                     "--kl-divergence-base", base["path"], "--kl-divergence"], timeout,
                    desc=f"llama-perplexity {model.name}")
    m = re.search(r"inconsistent vocabulary \((\d+) vs (\d+)\)", out)
    if m:   # tools/perplexity logs it and goes on to compare unlike token ids: no KLD at all
        raise PerplexityError(
            f"{model.name} has a vocabulary of {m.group(2)} tokens and the reference's base "
            f"logits {m.group(1)}: KLD compares the two next-token distributions token by "
            "token, so the file must be of the reference's model (give the model it was made "
            "from)")
    res = parse_perplexity_output(out)
    if "ppl" not in res and "kld" not in res:
        _raise_if_too_short(out, shown, ctx)
    if "kld" not in res and _chunks_done(out):
        # kl_divergence() in tools/perplexity/perplexity.cpp: "if (kld.count < 100) return;"
        raise PerplexityError(f"llama-perplexity scored {model.name} chunk by chunk but printed "
                              "no statistics: it needs at least 100 scored tokens (each chunk "
                              f"scores ctx/2 - 1); raise --chunks or --ctx:\n{_tail(out)}")
    if "kld" not in res:
        raise PerplexityError(f"llama-perplexity printed no KL divergence for {model.name} "
                              f"against {base['path']}:\n{_tail(out)}")
    return {**res, "model": str(model), "kl_base": base["path"]}


# ------------------------------------------------------------------------------------ reports
def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v).replace("|", "\\|")


def format_table(rows: Sequence[Mapping], columns: Sequence[str] | None = None) -> str:
    """A Markdown table of ``rows`` (dicts). ``columns``: which keys, in order (default: every
    key, in order of first appearance). Floats print with 4 decimals (scientific when tiny or
    huge), missing values as blanks."""
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    lines = ["| " + " | ".join(columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def save_report(rows: Sequence[Mapping], path: str | os.PathLike,
                columns: Sequence[str] | None = None, title: str | None = None
                ) -> tuple[Path, Path]:
    """Writes ``rows`` as ``<path>.json`` (a list of dicts) and ``<path>.md`` (the table of
    :func:`format_table`, after ``title`` and a blank line when one is given: say there what
    was measured, e.g. the text and the chunks), atomically. Returns both paths."""
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    pj, pm = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    _write_atomic(pj, json.dumps(list(rows), indent=1, default=str) + "\n")
    _write_atomic(pm, (f"{title}\n\n" if title else "") + format_table(rows, columns))
    return pj, pm


def evaluate_rows(results: Iterable[tuple[str, Mapping]]) -> list[dict]:
    """``[(label, result dict)]`` → rows with a leading ``"model"`` column, for format_table."""
    return [{"model": label, **{k: v for k, v in r.items() if k != "model"}}
            for label, r in results]


# ------------------------------------------------------------------------------------ pictures
_BLOCK = re.compile(r"^(?P<pre>.*?)blk\.(?P<n>\d+)\.(?P<kind>.+?)(?:\.weight)?$")


def assignment_grid(types: Mapping[str, str]) -> tuple[list[str], list[str], dict]:
    """Lays out ``{gguf_name: type}`` as a grid: one row per block (``blk.N`` parsed from GGUF
    names ``[prefix]blk.N.<kind>.weight``, rows in block order, the prefix kept when there is
    one) plus one row ``"outside blocks"`` for every other tensor (``token_embd``,
    ``output``, ...), and one column per tensor kind (``attn_q``, ``ffn_down``,
    ``ffn_down_exps``, whatever the architecture names them; kinds in first-seen order, then
    the outside-block names). Nothing about an architecture is assumed.

    Returns ``(rows, columns, cells)`` with ``cells[(row, column)] = type``."""
    cells: dict = {}
    rows: list[tuple[str, int]] = []
    kinds: list[str] = []
    others: list[str] = []
    for name, t in types.items():
        m = _BLOCK.match(name)
        if m:
            key = (m.group("pre"), int(m.group("n")))
            if key not in rows:
                rows.append(key)
            if m.group("kind") not in kinds:
                kinds.append(m.group("kind"))
            cells[(f"{key[0]}blk.{key[1]}", m.group("kind"))] = t
        else:
            col = name.removesuffix(".weight")
            if col not in others:
                others.append(col)
            cells[("outside blocks", col)] = t
    row_names = [f"{pre}blk.{n}" for pre, n in sorted(rows)]
    if others:
        row_names.append("outside blocks")
    return row_names, kinds + others, cells


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_assignment(assignment, path: str | os.PathLike, title: str | None = None) -> Path:
    """Writes a PNG of an assignment: blocks × tensor kinds (:func:`assignment_grid`), each
    cell coloured by its ggml type's bits per weight (one colour per type, low bpw dark, high
    bpw light; ``viridis``) and labelled with the type's name; blank where a block has no
    tensor of that kind. ``assignment``: the assignment JSON (dict or path) or
    ``{gguf_name: type}``. Written atomically (Agg backend, no display needed). Returns the
    path."""
    import numpy as np

    from .export import assignment_types
    from .quants import qtype
    plt = _pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    types = assignment_types(assignment)
    rows, cols, cells = assignment_grid(types)
    present = sorted({t for t in cells.values()}, key=lambda t: qtype(t).bpw)
    index = {t: i for i, t in enumerate(present)}
    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), t in cells.items():
        grid[rows.index(r), cols.index(c)] = index[t]
    base = plt.get_cmap("viridis")
    colours = [base(0.1 + 0.85 * i / max(1, len(present) - 1)) for i in range(len(present))]
    cmap = ListedColormap(colours).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(len(present) + 1) - 0.5, len(present))
    fig_w = 1.6 + 0.95 * len(cols)
    fig_h = 1.4 + 0.26 * len(rows)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto",
                   interpolation="nearest")
    for (r, c), t in cells.items():
        i = index[t]
        light = sum(colours[i][:3]) / 3 > 0.5
        ax.text(cols.index(c), rows.index(r), t, ha="center", va="center", fontsize=7,
                color="black" if light else "white")
    ax.set_xticks(range(len(cols)), cols, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    cb = fig.colorbar(im, ax=ax, ticks=range(len(present)), fraction=0.04, pad=0.02)
    cb.ax.set_yticklabels([f"{t} ({qtype(t).bpw:.2f} bpw)" for t in present], fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save_fig(fig, path)


def plot_size_vs_kld(rows: Sequence[Mapping], path: str | os.PathLike,
                     title: str | None = None) -> Path:
    """Writes a PNG of file size (MiB, x) against mean KLD (nats/token, y, log scale): the
    stock llama.cpp types as a line of points (``file`` starting with ``"stock"``), every
    other row (Voodoo) as a star; each point labelled. ``rows``: the rows of ``voodoo run``'s
    report (``file``, ``size_mib``, ``kld``); rows without a KLD are left out. Written
    atomically (Agg backend). Returns the path. Raises ValueError when no row has a KLD."""
    plt = _pyplot()
    pts = [r for r in rows if r.get("kld") is not None and r.get("size_mib") is not None]
    if not pts:
        raise ValueError("no row with both size_mib and kld to plot")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    stock = sorted((r for r in pts if str(r["file"]).startswith("stock")),
                   key=lambda r: r["size_mib"])
    ours = [r for r in pts if not str(r["file"]).startswith("stock")]
    if stock:
        ax.plot([r["size_mib"] for r in stock], [r["kld"] for r in stock], "o-",
                color="tab:gray", label="stock llama.cpp types")
    for r in stock:
        ax.annotate(f"{str(r['file']).removeprefix('stock ').strip()} {r['kld']:.3g}",
                    (r["size_mib"], r["kld"]), textcoords="offset points", xytext=(6, 4),
                    fontsize=8, color="dimgray")
    for r in ours:
        ax.plot([r["size_mib"]], [r["kld"]], "*", markersize=14, color="tab:red",
                label=str(r.get("name") or r["file"]))
        ax.annotate(f"{r['kld']:.3g}", (r["size_mib"], r["kld"]), textcoords="offset points",
                    xytext=(8, -3), fontsize=8, color="tab:red")
    from matplotlib.ticker import FuncFormatter
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("mean KLD vs reference (nats/token)")
    ax.set_yscale("log")
    ax.margins(x=0.12, y=0.15)
    def minor(v, _):
        # 2, 3 and 5 times a power of ten: the others crowd a short decade
        return f"{v:g}" if f"{v:.0e}"[0] in "235" else ""
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.tick_params(axis="y", which="both", labelsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        import textwrap
        ax.set_title(textwrap.fill(title, 75), fontsize=9)
    fig.tight_layout()
    return _save_fig(fig, path)


def _save_fig(fig, path) -> Path:
    import io

    from .fsutil import atomic_write_bytes
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
