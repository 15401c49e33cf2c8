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

from .fsutil import atomic_write_text, sha256_file

from voodoo.llamacpp import LlamaCppNotBuilt, cache_root, llama_cpp_commit, tool_path

__all__ = ["torch_ppl_kl", "run_perplexity", "kld_base", "parse_perplexity_output",
           "format_table", "save_report", "PerplexityError", "LlamaCppNotBuilt"]


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
    "n_tokens" (tokens scored for PPL)}``."""
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


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


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


def _run_tool(args: list[str], timeout: float | None) -> str:
    """Runs a llama.cpp tool; returns stdout+stderr. Retries once with ``--no-repack`` when the
    tool dies of SIGILL (see ``_NO_REPACK``). Raises PerplexityError on failure."""
    global _NO_REPACK
    if _NO_REPACK and "--no-repack" not in args:
        args = [*args, "--no-repack"]
    try:
        r = subprocess.run(args, capture_output=True, text=True, errors="replace",
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (e.stdout, e.stderr))
        raise PerplexityError(f"`{' '.join(args)}` timed out after {timeout} s\n{_tail(out)}") \
            from None
    if r.returncode in (-4, 132) and "--no-repack" not in args:   # SIGILL
        _NO_REPACK = True
        return _run_tool(args, timeout)
    if r.returncode:
        raise PerplexityError(f"`{' '.join(args)}` failed (exit {r.returncode}):\n"
                              f"{_tail(r.stderr or r.stdout)}")
    return r.stdout + "\n" + r.stderr


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
    key_src = json.dumps({"model": _sha256_file(ref), "text": _sha256_file(text), "ctx": ctx,
                          "chunks": chunks, "llama.cpp": llama_cpp_commit()}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    d = Path(cache_dir) if cache_dir is not None else cache_root() / "kld"
    d.mkdir(parents=True, exist_ok=True)
    kld_path, info_path = d / f"{key}.kld", d / f"{key}.json"
    if kld_path.is_file() and info_path.is_file():
        info = json.loads(info_path.read_text())
        return {**info, "path": str(kld_path), "cached": True}
    exe = str(tool_path("llama-perplexity"))
    fd, tmp = tempfile.mkstemp(prefix=f"{key}.", suffix=".kld.partial", dir=d)
    os.close(fd)
    try:
        out = _run_tool([exe, "-m", str(ref), "-f", str(text),
                         *_common_args(ctx, chunks, threads, batch),
                         "--kl-divergence-base", tmp], timeout)
        res = parse_perplexity_output(out)
        if "ppl" not in res or os.path.getsize(tmp) <= 16:
            raise PerplexityError(f"llama-perplexity wrote no base logits for {ref.name} on "
                                  f"{text.name} (ctx {ctx}):\n{_tail(out)}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, kld_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    info = {"ppl": res["ppl"], "ppl_err": res.get("ppl_err"), "n_chunks": res.get("n_chunks"),
            "ctx": ctx, "reference": str(ref), "text": str(text), "key": json.loads(key_src)}
    _write_atomic(info_path, json.dumps(info, indent=1) + "\n")
    return {**info, "path": str(kld_path), "cached": False}


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
    exe = str(tool_path("llama-perplexity"))
    if kl_base is None:
        out = _run_tool([exe, "-m", str(model), "-f", str(text),
                         *_common_args(ctx, chunks, threads, batch)], timeout)
        res = parse_perplexity_output(out)
        if "ppl" not in res:
            raise PerplexityError(f"llama-perplexity printed no final PPL for {model.name}:\n"
                                  f"{_tail(out)}")
        return {**res, "model": str(model)}
    kb = Path(kl_base)
    if kb.suffix == ".kld":
        if not kb.is_file():
            raise FileNotFoundError(kb)
        base = {"path": str(kb)}
    else:
        base = kld_base(kb, text, ctx=ctx, chunks=chunks, threads=threads, batch=batch,
                        timeout=timeout)
    out = _run_tool([exe, "-m", str(model), *_common_args(ctx, None, threads, batch),
                     "--kl-divergence-base", base["path"], "--kl-divergence"], timeout)
    res = parse_perplexity_output(out)
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
                columns: Sequence[str] | None = None) -> tuple[Path, Path]:
    """Writes ``rows`` as ``<path>.json`` (a list of dicts) and ``<path>.md`` (the table of
    :func:`format_table`), atomically. Returns both paths."""
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    pj, pm = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    _write_atomic(pj, json.dumps(list(rows), indent=1, default=str) + "\n")
    _write_atomic(pm, format_table(rows, columns))
    return pj, pm


def evaluate_rows(results: Iterable[tuple[str, Mapping]]) -> list[dict]:
    """``[(label, result dict)]`` → rows with a leading ``"model"`` column, for format_table."""
    return [{"model": label, **{k: v for k, v in r.items() if k != "model"}}
            for label, r in results]
