"""Does llama.cpp compute the model transformers computes? KLD of llama.cpp's logits on a GGUF
against torch logits on the very same tokens.

The trick: ``llama-perplexity --kl-divergence`` reads a *base logits* file (the one
``--kl-divergence-base`` writes) and evaluates the **tokens stored in that file**. So Voodoo
writes such a file itself from torch logits (:func:`write_kld_base`, the binary format of
``tools/perplexity/perplexity.cpp`` in the pinned llama.cpp), runs
``llama-perplexity -m F.gguf --kl-divergence-base ours.kld --kl-divergence -c N`` and reads its
mean KLD, 99.9% KLD and "same top p" (:func:`llama_vs_torch`). No text, no tokenizer: llama.cpp
sees token ids only.

What llama-perplexity scores (``kl_divergence()`` in ``perplexity.cpp``): the tokens are cut in
``n_chunk`` chunks of ``n_ctx``; each chunk runs from an empty KV cache, its first token replaced
by BOS when the vocabulary adds one (``tokenizer.ggml.add_bos_token``), and only the distributions
at positions ``n_ctx/2 .. n_ctx-2`` (those predicting the second half) are compared:
``n_ctx - 1 - n_ctx/2`` per chunk. It prints statistics only from 100 scored positions on.

Units: KLD in **nats per token**, ``same_top_p`` a **fraction** in [0, 1].

:func:`preflight` is the check Voodoo runs before training: transformers' model and llama.cpp's
F32 GGUF of it must agree, or the KLD Voodoo optimises (torch) is not what llama.cpp serves.
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .evaluate import PerplexityError, _run_tool, _tail, parse_perplexity_output
from .llamacpp import tool_path

__all__ = ["write_kld_base", "read_kld_base", "torch_logits", "chunk_tokens", "gguf_vocab",
           "llama_vs_torch", "preflight", "AgreementError", "LlamaCppLoadError", "KLD_MAGIC",
           "DEFAULT_PREFLIGHT_MAX_KLD", "DEFAULT_PREFLIGHT_TOKENS", "preflight_shape",
           "llama_tokenize", "tokenizer_agreement", "tokenizer_warning", "calibration_text"]

#: The base-logits file's first 8 bytes (``perplexity()`` / ``kl_divergence()``).
KLD_MAGIC = b"_logits_"
#: Width of the compressed log-prob range: ``log_softmax(..., uint16_t *)`` clamps the smallest
#: logit to ``max - 16`` and stores ``round((logit - min) / scale)`` with ``scale = range/65535``.
_LOGIT_RANGE = 16.0

#: Pre-flight threshold on the mean KLD (nats/token). An F32 GGUF that computes the same model
#: as transformers measures ~1e-6 (float32 rounding and the base file's 16-bit log-probs); the
#: configurations llama.cpp silently computes differently measured 3e-3 .. 0.5.
DEFAULT_PREFLIGHT_MAX_KLD = 1e-3
#: Pre-flight size: at least this many tokens, in chunks of the training length (see
#: :func:`preflight_shape`; at ``--seq_len 128`` 4 chunks, 252 scored positions; seconds).
DEFAULT_PREFLIGHT_TOKENS = 512


def preflight_shape(seq_len: int, n_tokens: int = DEFAULT_PREFLIGHT_TOKENS) -> tuple[int, int]:
    """``(n_chunk, n_ctx)`` of the pre-flight check for gates trained on ``seq_len``-token
    blocks: chunks of the full training length, as many as make ``n_tokens``.

    A check on shorter chunks misses what only shows later in a block: a sliding window that
    llama.cpp ignores or places differently (Mistral's ``sliding_window`` of 200, Qwen2's
    ``use_sliding_window``: KL below 1e-5 at 128 tokens, 4.3 and 1.6 at 512). llama-perplexity
    scores positions ``n_ctx/2 .. n_ctx-2`` of each chunk, so a difference from any position
    below ``seq_len`` on is among the scored ones. ``seq_len`` < 4 raises ValueError."""
    if seq_len < 4:
        raise ValueError(f"seq_len={seq_len} is too short for llama-perplexity's scoring")
    return max(1, -(-int(n_tokens) // int(seq_len))), int(seq_len)


#: llama-perplexity runs per check. The pinned build sometimes exits with status 0 right after
#: the first chunk's line, printing no statistics (seen with several threads, e.g. 3 of 8 runs
#: on the zoo's gemma2 with -t 2, none with -t 1); such a run is repeated.
_ATTEMPTS = 3


class AgreementError(RuntimeError):
    """llama.cpp's F32 GGUF and the transformers model compute different distributions.

    Attributes: ``result`` (the :func:`llama_vs_torch` dict)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


class LlamaCppLoadError(PerplexityError):
    """llama.cpp cannot load a GGUF at all (its loader refuses it, e.g. ``check_tensor_dims:
    tensor '...' has wrong shape`` for a configuration it does not support). Not an
    :class:`AgreementError`: ``--skip_preflight`` cannot help, every later step runs llama.cpp
    on that file.

    Attributes: ``reason`` (llama.cpp's own reason line, after ``error loading model:``),
    ``gguf_path``."""

    def __init__(self, message: str, reason: str, gguf_path, crashed: bool = False):
        super().__init__(message)
        self.reason = reason
        self.gguf_path = Path(gguf_path)
        self.crashed = crashed


_LOAD_ERROR = re.compile(r"error loading model:\s*(.+)")
#: ggml's GGML_ASSERT/GGML_ABORT line: ``<source file>:<line>: <message>`` before the abort
_ABORT = re.compile(r"^\S*?([\w.-]+\.(?:c|cc|cpp|h)):(\d+): (.+)$", re.M)


def _load_failure(gguf_path, output: str) -> LlamaCppLoadError | None:
    """A :class:`LlamaCppLoadError` when a llama.cpp tool's ``output`` says it could not load
    the model (``llama_model_load: error loading model: <reason>``) or it aborted on one of
    ggml's asserts (``llama-graph.cpp:2072: fatal error``, ``GGML_ASSERT(...) failed``: a
    graph llama.cpp cannot build for this configuration; ``crashed``), else None."""
    m = _LOAD_ERROR.search(output)
    if m:
        reason = m.group(1).strip()
        return LlamaCppLoadError(f"llama.cpp cannot load {Path(gguf_path).name}: {reason}",
                                 reason, gguf_path)
    m = _ABORT.search(output)
    if m:
        reason = f"{m.group(1)}:{m.group(2)}: {m.group(3).strip()}"
        return LlamaCppLoadError(f"llama.cpp aborted running {Path(gguf_path).name}: {reason}",
                                 reason, gguf_path, crashed=True)
    return None


# ---------------------------------------------------------------------------- the file format
def _nv(n_vocab: int) -> int:
    """uint16 slots per scored position: 4 (two float32: scale, min log-prob) + n_vocab, rounded
    up to even (``nv = 2*((n_vocab + 1)/2) + 4`` in perplexity.cpp)."""
    return 2 * ((n_vocab + 1) // 2) + 4


def _compress(logits: np.ndarray) -> np.ndarray:
    """Compressed log-probs of rows of logits, as perplexity.cpp's
    ``log_softmax(int n_vocab, const float * logits, uint16_t * log_prob, int tok)`` writes them.

    ``logits``: float32 (n, n_vocab). Returns uint16 (n, nv): slots 0-3 hold float32 ``scale``
    and ``min_log_prob``; slot ``4 + i`` holds ``round((logit_i - min_logit) / scale)`` (0 for
    logits at or below ``min_logit = max(min, max - 16)``); log p_i is decoded as
    ``scale * q_i + min_log_prob``. Arithmetic in float32 like the C++ (``expf`` sums in double,
    round-half-to-even like its ``nearest_int``)."""
    x = np.ascontiguousarray(logits, dtype=np.float32)                  # (n, V)
    n, v = x.shape
    mx = x.max(axis=1)                                                   # (n,)
    mn = np.maximum(x.min(axis=1), mx - np.float32(_LOGIT_RANGE))        # (n,)
    sum_exp = np.exp(x - mx[:, None]).astype(np.float64).sum(axis=1)     # (n,) double
    lse = np.log(sum_exp).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535.0)).astype(np.float32)
    out = np.zeros((n, _nv(v)), dtype=np.uint16)
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4")         # (n, 2)
    out[:, :4] = head.view("<u2").reshape(n, 4)
    nz = scale != 0
    if nz.any():
        inv = (np.float32(1.0) / np.where(nz, scale, np.float32(1.0))).astype(np.float32)
        q = np.rint(inv[:, None] * (x - mn[:, None])).astype(np.float32)  # (n, V)
        q = np.where(x > mn[:, None], q, 0).clip(0, 65535)
        q[~nz] = 0
        out[:, 4:4 + v] = q.astype(np.uint16)
    return out


def _decompress(rec: np.ndarray, n_vocab: int) -> np.ndarray:
    """uint16 (n, nv) records -> float32 log-probs (n, n_vocab), as ``kl_divergence()`` decodes
    them (``scale * q + min_log_prob``)."""
    head = np.ascontiguousarray(rec[:, :4]).view("<f4")                  # (n, 2)
    scale, mlp = head[:, :1], head[:, 1:2]
    return (scale * rec[:, 4:4 + n_vocab].astype(np.float32) + mlp).astype(np.float32)


def write_kld_base(path: str | os.PathLike, tokens: torch.Tensor, logits: torch.Tensor) -> Path:
    """Writes a llama-perplexity base-logits file (``--kl-divergence-base``) from torch logits.

    Format (``perplexity()`` in tools/perplexity/perplexity.cpp, little-endian): ``b"_logits_"``;
    uint32 ``n_ctx``; int32 ``n_vocab``; int32 ``n_chunk``; int32 tokens ``(n_chunk * n_ctx)``;
    then per chunk, for positions ``n_ctx/2 .. n_ctx-2``, one record of ``nv`` uint16 (see
    :func:`_compress`; lossy: each log-prob within ``scale/2 <= 16/131070 ≈ 1.2e-4`` nats,
    log-probs more than 16 below the top one are stored as the floor).

    Args:
        path: output file, written atomically (temporary name + ``os.replace``).
        tokens: LongTensor ``(n_chunk, n_ctx)``: the token ids llama.cpp will evaluate. When the
            GGUF's vocabulary adds a BOS, llama.cpp replaces each chunk's first token by BOS,
            so ``logits`` must have been computed with BOS there (:func:`llama_vs_torch` does).
        logits: FloatTensor ``(n_chunk, n_ctx, n_vocab)`` (any float dtype; used as float32):
            the model's next-token logits at every position of ``tokens``; only positions
            ``n_ctx/2 .. n_ctx-2`` are stored.

    Returns ``path``. Raises ValueError on mismatched shapes or ``n_ctx < 4``."""
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 2 or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"tokens must be (n_chunk, n_ctx) and logits (n_chunk, n_ctx, n_vocab); "
                         f"got {tuple(tokens.shape)} and {tuple(logits.shape)}")
    n_chunk, n_ctx = tokens.shape
    n_vocab = logits.shape[2]
    if n_ctx < 4:
        raise ValueError(f"n_ctx={n_ctx} is too small (llama-perplexity scores n_ctx-1-n_ctx/2 "
                         "positions per chunk)")
    first = n_ctx // 2
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(KLD_MAGIC)
            f.write(struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
            f.write(tokens.to(torch.int32).contiguous().numpy().astype("<i4").tobytes())
            for c in range(n_chunk):
                x = logits[c, first:n_ctx - 1].detach().to("cpu", torch.float32).numpy()
                f.write(_compress(x).astype("<u2").tobytes())
        from .fsutil import file_mode
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_kld_base(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads a base-logits file (ours or llama-perplexity's ``--kl-divergence-base``).

    Returns ``(tokens, log_probs)``: LongTensor ``(n_chunk, n_ctx)`` and FloatTensor
    ``(n_chunk, n_ctx - 1 - n_ctx/2, n_vocab)`` of decoded log-probs (nats) at positions
    ``n_ctx/2 .. n_ctx-2``. Raises ValueError when the file is not one."""
    data = Path(path).read_bytes()
    if data[:8] != KLD_MAGIC:
        raise ValueError(f"{path} does not start with {KLD_MAGIC!r}; not a base-logits file")
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", data, 8)
    off = 20
    tok = np.frombuffer(data, "<i4", n_chunk * n_ctx, off).reshape(n_chunk, n_ctx)
    off += 4 * n_chunk * n_ctx
    n_pos, nv = n_ctx - 1 - n_ctx // 2, _nv(n_vocab)
    want = off + 2 * n_chunk * n_pos * nv
    if len(data) < want:
        raise ValueError(f"{path} is truncated: {len(data)} bytes, expected {want}")
    rec = np.frombuffer(data, "<u2", n_chunk * n_pos * nv, off).reshape(n_chunk * n_pos, nv)
    lp = _decompress(rec, n_vocab).reshape(n_chunk, n_pos, n_vocab)
    return torch.from_numpy(tok.astype(np.int64)), torch.from_numpy(lp)


# ------------------------------------------------------------------------------------- torch
def chunk_tokens(ids: Sequence[int] | torch.Tensor, n_ctx: int, n_chunk: int | None = None
                 ) -> torch.Tensor:
    """Cuts a 1-D token sequence into ``(n_chunk, n_ctx)`` as llama-perplexity does (whole
    chunks only; ``n_chunk`` at most ``len(ids) // n_ctx``). Raises ValueError when not even one
    chunk fits."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    k = ids.numel() // n_ctx if n_chunk is None else min(n_chunk, ids.numel() // n_ctx)
    if k < 1:
        raise ValueError(f"{ids.numel()} tokens hold no chunk of {n_ctx}")
    return ids[:k * n_ctx].view(k, n_ctx)


@torch.no_grad()
def torch_logits(model: torch.nn.Module, tokens: torch.Tensor, batch_size: int = 1
                 ) -> torch.Tensor:
    """The model's logits at every position, each chunk from scratch (no cache), as llama.cpp
    runs each chunk from an empty KV cache.

    ``tokens``: LongTensor ``(n_chunk, n_ctx)``. Returns FloatTensor ``(n_chunk, n_ctx,
    n_vocab)`` float32 on CPU (``model(input_ids=...).logits``). The model's training mode is
    restored afterwards."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = []
    try:
        for i in range(0, tokens.shape[0], batch_size):
            ids = tokens[i:i + batch_size].to(dev)                            # (B, T)
            out.append(model(input_ids=ids, use_cache=False).logits.float().cpu())  # (B, T, V)
    finally:
        model.train(was)
    return torch.cat(out)


# ------------------------------------------------------------------------------------- GGUF
def gguf_vocab(gguf_path: str | os.PathLike) -> dict:
    """What llama.cpp will make of a GGUF's vocabulary: ``{"n_vocab": len(tokenizer.ggml.tokens),
    "bos": tokenizer.ggml.bos_token_id or None, "add_bos": tokenizer.ggml.add_bos_token or
    None (absent)}``. Reads the metadata only (gguf-py's ``GGUFReader``), once per file
    version (remembered by path, size and mtime)."""
    st = os.stat(gguf_path)
    key = (os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)
    if key not in _VOCAB_CACHE:
        _VOCAB_CACHE[key] = _read_vocab(gguf_path)
    return dict(_VOCAB_CACHE[key])


_VOCAB_CACHE: dict[tuple, dict] = {}


def _read_vocab(gguf_path) -> dict:
    from .ggufio import read_gguf
    r = read_gguf(gguf_path)

    def get(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    toks = r.fields.get("tokenizer.ggml.tokens")
    return {"n_vocab": len(toks.data) if toks is not None else None,
            "bos": get("tokenizer.ggml.bos_token_id"),
            "add_bos": get("tokenizer.ggml.add_bos_token")}


def _with_bos(tokens: torch.Tensor, vocab: dict) -> torch.Tensor:
    """``tokens`` with each chunk's first token set to the GGUF's BOS when it has one: then
    llama.cpp evaluates this exact sequence whether or not its vocabulary adds a BOS (it puts
    that same BOS there, or leaves the token as is)."""
    if vocab["bos"] is None:
        return tokens
    t = tokens.clone()
    t[:, 0] = int(vocab["bos"])
    return t


# --------------------------------------------------------------------------------- the check
def llama_vs_torch(gguf_path: str | os.PathLike, model_or_logits, tokens: torch.Tensor,
                   threads: int | None = None, timeout: float | None = 600,
                   work_dir: str | os.PathLike | None = None, flash_attn: str = "off") -> dict:
    """KLD of llama.cpp's distributions on ``gguf_path`` against torch's on the same tokens.

    Args:
        gguf_path: the GGUF llama.cpp runs (e.g. the converter's F32 GGUF of the HF model).
        model_or_logits: a transformers causal LM (its logits are computed here with
            :func:`torch_logits`, on ``tokens`` with each chunk's first token set to the GGUF's
            BOS, see :func:`_with_bos`), or a FloatTensor ``(n_chunk, n_ctx, n_vocab)`` of
            logits already computed on exactly the tokens llama.cpp will evaluate (first token
            of each chunk = BOS when the vocabulary adds one).
        tokens: LongTensor ``(n_chunk, n_ctx)``, ``n_chunk * (n_ctx - 1 - n_ctx/2) >= 100``
            (llama-perplexity prints no statistics below 100 scored positions).
        threads: llama.cpp's ``-t`` (default: its own).
        timeout: seconds for the llama-perplexity run.
        work_dir: where the base-logits file goes (default: a temporary folder, removed).
        flash_attn: llama.cpp's ``-fa`` (``"off"``, ``"on"``, ``"auto"``). Off by default: the
            CPU flash-attention path rounds through F16, enough to flip MoE routing at near
            ties (measured on the zoo's qwen3_moe: one position whose router's 2nd/3rd logits
            differ by 1.6e-4 flips, mean KLD 4.9e-4 with ``-fa on``, 1e-6 with ``-fa off``); the
            check is about the architecture, not F16 rounding.

    Returns ``{"kld_mean", "kld_err", "kld_99_9", "kld_99", "kld_median", "kld_max"`` (nats per
    token, KL(torch ‖ llama.cpp)), ``"same_top_p"`` (fraction of positions where the argmaxes
    agree), ``"ppl_torch", "ppl_llama"``, ``"entropy_torch"`` (mean entropy of torch's
    distributions at the scored positions, nats; ``log(n_vocab)`` when flat), ``"n_tokens"``
    (scored positions), ``"n_ctx",
    "n_chunk", "n_vocab", "tokens"`` (the evaluated LongTensor)``}``.

    Raises:
        ValueError: bad shapes, too few scored positions, or a vocabulary size that differs
            between the logits and the GGUF (llama.cpp would only log it and compare garbage).
        voodoo.llamacpp.LlamaCppNotBuilt: llama-perplexity is not built.
        voodoo.evaluate.PerplexityError: llama-perplexity failed or printed no KLD;
            :class:`LlamaCppLoadError` (a subclass) when it could not load ``gguf_path``.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(gguf_path)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (n_chunk, n_ctx); got shape {tuple(tokens.shape)}")
    n_chunk, n_ctx = tokens.shape
    n_scored = n_chunk * (n_ctx - 1 - n_ctx // 2)
    if n_scored < 100:
        raise ValueError(f"{n_chunk} chunks of {n_ctx} tokens score only {n_scored} positions; "
                         "llama-perplexity prints its KLD statistics from 100 on (use more or "
                         "longer chunks)")
    vocab = gguf_vocab(gguf_path)
    if isinstance(model_or_logits, torch.Tensor):
        logits = model_or_logits
        if vocab["add_bos"] and vocab["bos"] is not None and \
                bool((tokens[:, 0] != int(vocab["bos"])).any()):
            raise ValueError(f"{gguf_path.name} adds BOS (id {vocab['bos']}): llama.cpp replaces "
                             "each chunk's first token by it, so the logits must be computed "
                             "with tokens[:, 0] = BOS")
    else:
        tokens = _with_bos(tokens, vocab)
        logits = torch_logits(model_or_logits, tokens)
    if vocab["n_vocab"] is not None and logits.shape[-1] != vocab["n_vocab"]:
        raise ValueError(f"the model's logits have {logits.shape[-1]} entries per position "
                         f"(its embedding/output rows: config.json's vocab_size) but the "
                         f"tokenizer in {gguf_path.name} has {vocab['n_vocab']} tokens; llama.cpp "
                         "refuses such a file (check_tensor_dims: token_embd.weight has wrong "
                         "shape). Make the tokenizer and the embedding agree (tokens added to "
                         "the tokenizer need the embedding resized, or remove them)")
    lp = torch.log_softmax(logits[:, n_ctx // 2:n_ctx - 1].float(), -1)     # (C, P, V)
    entropy = -(lp.exp() * lp).sum(-1).mean().item()
    del lp
    with tempfile.TemporaryDirectory(prefix="voodoo-agree-", dir=work_dir) as tmp:
        base = write_kld_base(Path(tmp) / "torch.kld", tokens, logits)
        args = [str(tool_path("llama-perplexity")), "-m", str(gguf_path),
                "--kl-divergence-base", str(base), "--kl-divergence", "-c", str(n_ctx),
                "-fa", flash_attn]
        if threads is not None:
            args += ["-t", str(threads)]
        for _ in range(_ATTEMPTS):
            try:
                out = _run_tool(args, timeout)
            except PerplexityError as e:
                raise (_load_failure(gguf_path, str(e)) or e) from None
            res = parse_perplexity_output(out)
            # llama-perplexity sometimes exits 0 with its statistics missing or cut short
            # (seen under load: the KLD lines without the "Same top p" line): run it again
            if all(k in res for k in ("kld", "kld_p99_9", "same_top_p")):
                break
    if not all(k in res for k in ("kld", "kld_p99_9", "same_top_p")):
        bad = _load_failure(gguf_path, out)
        if bad is not None:
            raise bad
        raise PerplexityError(f"llama-perplexity printed no KL divergence for {gguf_path.name} "
                              f"against torch logits:\n{_tail(out)}")
    return {"kld_mean": res["kld"], "kld_err": res.get("kld_err"),
            "kld_99_9": res.get("kld_p99_9"), "kld_99": res.get("kld_p99"),
            "kld_median": res.get("kld_median"), "kld_max": res.get("kld_max"),
            "same_top_p": res.get("same_top_p"), "ppl_torch": res.get("ppl_base"),
            "ppl_llama": res.get("ppl"), "entropy_torch": entropy,
            "n_tokens": n_scored, "n_ctx": n_ctx,
            "n_chunk": n_chunk, "n_vocab": int(logits.shape[-1]), "tokens": tokens}


def preflight(hf_model: torch.nn.Module, f32_gguf: str | os.PathLike, tokens: torch.Tensor,
              max_kld: float = DEFAULT_PREFLIGHT_MAX_KLD, **kwargs) -> dict:
    """The pre-flight agreement check: does llama.cpp, on the converter's F32 GGUF, compute the
    model transformers computes? Run before any training; a few hundred tokens, seconds.

    Args:
        hf_model: the transformers causal LM (float32) that Voodoo will train against.
        f32_gguf: llama.cpp's F32 GGUF of the same weights (``convert_hf_to_gguf.py --outtype
            f32``); candidates and the exported file are quantized from it. Weights the
            converter kept quantized (gpt-oss's MXFP4 experts) are compared from a dequantized
            copy (:func:`voodoo.export.dequantized_copy`): llama.cpp's activation rounding for
            them is not a disagreement about the architecture.
        tokens: LongTensor ``(n_chunk, n_ctx)``, e.g. ``chunk_tokens(ids, n_ctx, n_chunk)``
            with ``n_chunk, n_ctx = preflight_shape(seq_len)``: chunks of the training length.
        max_kld: largest mean KLD (nats/token) that counts as agreement; the default
            :data:`DEFAULT_PREFLIGHT_MAX_KLD` sits far above float32 noise (~1e-6) and below the
            smallest disagreement seen (3e-3).
        kwargs: passed to :func:`llama_vs_torch` (``threads``, ``timeout``, ``work_dir``).

    Returns the :func:`llama_vs_torch` dict plus ``"max_kld"`` and, for a GGUF Voodoo
    converted, ``"converter_defaults"`` (:func:`voodoo.models.converter_defaults`: settings the
    converter looked for and config.json lacks, which the failure message names).

    Raises:
        AgreementError: mean KLD above ``max_kld``. The message names the KLD and the same
            top-p, says what it means (the KLD Voodoo optimises in torch would not be the one
            llama.cpp serves) and how to go on anyway (``--skip_preflight``).
        LlamaCppLoadError: llama.cpp cannot load ``f32_gguf`` at all (its converter wrote a
            file its loader refuses, e.g. ``check_tensor_dims: ... has wrong shape``); the
            one-line message quotes llama.cpp's reason and says no Voodoo flag helps.
        and what :func:`llama_vs_torch` raises.
    """
    from .export import dequantized_copy
    from .models import converter_defaults
    try:
        res = llama_vs_torch(dequantized_copy(f32_gguf), hf_model, tokens, **kwargs)
    except LlamaCppLoadError as e:
        from .llamacpp import llama_cpp_commit
        what, part = ("aborted running", "graph (e.g. an MoE router's scoring function "
                      "that config.json does not name: `scoring_func`)") if e.crashed \
            else ("cannot load", "loader")
        import re
        missing = re.search(r"key not found[^:]*:\s*(\S+)", e.reason or "")
        if missing and not e.crashed:  # a key the converter writes only when config.json has it
            key = missing.group(1).strip("'\"")
            part = (f"loader, which needs {key}: a key llama.cpp's converter writes only when "
                    "config.json names the setting"
                    + (", here the MoE router's scoring function (`scoring_func`, e.g. "
                       "\"sigmoid\" or \"softmax\")" if "gating_func" in key else ""))
        hint = _name_rule_hint(f32_gguf, e.reason or "")
        if hint:
            raise LlamaCppLoadError(
                f"llama.cpp {llama_cpp_commit()} cannot load {Path(f32_gguf).name} (llama.cpp "
                f"says: {e.reason}): {hint}", e.reason, f32_gguf, e.crashed) from None
        raise LlamaCppLoadError(
            f"llama.cpp {llama_cpp_commit()} {what} {Path(f32_gguf).name}, the F32 GGUF "
            f"its own converter wrote for this model (llama.cpp says: {e.reason}). It is a "
            f"limit of llama.cpp at this commit for this model's configuration (of its {part}, "
            "or of its converter reading this config.json through transformers "
            f"{_transformers_version()}; `gguf-dump {Path(f32_gguf)}` shows the metadata the "
            "converter wrote), not something a Voodoo flag changes (--skip_preflight neither: "
            "every later step runs llama.cpp on this file); use a configuration llama.cpp "
            "supports, or a llama.cpp that runs it." + _defaults_hint(converter_defaults(f32_gguf)),
            e.reason, f32_gguf, e.crashed) from None
    res["max_kld"] = max_kld
    looked_for = converter_defaults(f32_gguf)
    if looked_for is not None:
        res["converter_defaults"] = looked_for
    if not res["kld_mean"] <= max_kld:          # also catches nan
        top = res.get("same_top_p")
        top_s = f"{100 * top:.2f}%" if top is not None else "n/a"
        raise AgreementError(
            f"pre-flight check failed: llama.cpp does not compute the model transformers "
            f"computes. On {res['n_tokens']} positions ({res['n_chunk']} chunks of "
            f"{res['n_ctx']} tokens), KL(transformers ‖ llama.cpp on {Path(f32_gguf).name}) = "
            f"{res['kld_mean']:.4g} nats/token (99.9%: {res['kld_99_9']}), same top-p "
            f"{top_s}; agreement means ≤ {max_kld:g}. The F32 GGUF holds the same weights, so "
            "llama.cpp runs this architecture/config differently from transformers (e.g. a "
            "sliding-window pattern, no-RoPE layers, RoPE settings, an attention scale such as "
            "Gemma's query_pre_attn_scalar other than head_dim, or an MoE gating function "
            "(`scoring_func`) it does not read). Voodoo "
            "optimises the KLD of the torch model, which would not be the KLD of what llama.cpp "
            "serves. Fix the config or the llama.cpp version (a sliding window shows only in "
            f"chunks longer than it: these are the training length, --seq_len {res['n_ctx']}); "
            "to go on anyway, pass --skip_preflight." + _defaults_hint(looked_for), res)
    return res


def _defaults_hint(looked_for: list[str] | None) -> str:
    """The pre-flight failure's line on the settings llama.cpp's converter looked for and did
    not find (:func:`voodoo.models.converter_defaults`); "" when there were none."""
    if not looked_for:
        return ""
    names = ", ".join(f"`{k}`" for k in looked_for[:12]) + (
        f" and {len(looked_for) - 12} more" if len(looked_for) > 12 else "")
    return (f" Settings this model's converter class looked for and config.json does not give "
            f"(absent, or null; llama.cpp then uses its default for each, which need not be "
            f"what transformers does): {names}. If the model as published names any of them "
            "in its config.json "
            "(a config.json that transformers wrote from its own class leaves out keys that "
            "class does not use), add it to config.json (`rope_parameters.<key>`: inside its "
            "rope_parameters).")


#: Tokens llama.cpp looks up by text for a model whose ``general.name`` contains "phi3" or
#: "phi-3" (``llama_vocab::impl::load``, src/llama-vocab.cpp: Phi-3's token attributes), and
#: the name parts that trigger it.
_PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")
_PHI3_NAMES = ("phi-3", "phi3")


def _name_rule_hint(gguf_path, reason: str) -> str | None:
    """The cause of llama.cpp's vocabulary load failing with ``unordered_map::at`` when it is
    llama-vocab.cpp's name rule: ``general.name`` (the converter takes it from the model
    folder's name) contains "phi3"/"phi-3", and the vocabulary lacks one of Phi-3's tokens.
    None when that is not the case."""
    if "unordered_map::at" not in reason:
        return None
    try:
        from .ggufio import read_gguf
        r = read_gguf(gguf_path)
        name = r.fields["general.name"].contents()
        tokens = set(r.fields["tokenizer.ggml.tokens"].contents())
    except Exception:  # noqa: BLE001 -- only a hint
        return None
    if not isinstance(name, str) or not any(p in name.lower() for p in _PHI3_NAMES):
        return None
    missing = [t for t in _PHI3_TOKENS if t not in tokens]
    if not missing:
        return None
    return (f"its general.name {name!r} (the converter takes it from the model folder's "
            "name) contains 'phi3' or 'phi-3', so llama.cpp gives the vocabulary Phi-3's token "
            f"attributes and looks up {', '.join(_PHI3_TOKENS)}; this vocabulary has no "
            f"{', '.join(missing)} (src/llama-vocab.cpp). Rename the model folder so that its "
            "name holds neither, and run again")


def _transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return "(not installed)"


# ------------------------------------------------------------------------ the tokenizers
#: Characters of calibration text the tokenizer comparison reads (about 1,000 tokens; well
#: under a second for both tokenizers).
DEFAULT_TOKENIZER_CHARS = 4000


def llama_tokenize(gguf_path: str | os.PathLike, text: str, timeout: float = 120.0
                   ) -> list[int]:
    """llama.cpp's token ids for ``text`` with the vocabulary of ``gguf_path``: ``llama-tokenize
    -m F --ids --no-bos --no-escape`` (tools/tokenize in the pinned llama.cpp; it loads the
    vocabulary only; without ``--no-escape`` it would read a literal ``\\n`` as a newline). It
    reads a special token's text in the input as that token (its default; no
    ``--no-parse-special``), as transformers does.

    Raises LlamaCppNotBuilt (llama-tokenize missing: ``voodoo bootstrap``) or PerplexityError
    (the tool failed or printed no id list; its output's tail is quoted)."""
    import subprocess

    from .llamacpp import tool_env
    with tempfile.TemporaryDirectory(prefix="voodoo-tok-") as td:
        f = Path(td) / "text.txt"
        f.write_text(text, encoding="utf-8")
        args = [str(tool_path("llama-tokenize")), "-m", str(gguf_path), "-f", str(f), "--ids",
                "--no-bos", "--no-escape"]
        try:
            p = subprocess.run(args, capture_output=True, timeout=timeout, env=tool_env())
        except subprocess.TimeoutExpired:
            raise PerplexityError(f"llama-tokenize on {Path(gguf_path).name} ran past "
                                  f"{timeout:.0f} s") from None
    out = p.stdout.decode(errors="replace")  # the id list; the log goes to stderr
    m = re.search(r"\[([0-9,\s]*)\]\s*$", out)
    if p.returncode < 0:
        raise PerplexityError(
            f"llama-tokenize aborted (signal {-p.returncode}) on {Path(gguf_path).name}: "
            f"{_tail(p.stderr.decode(errors='replace'))}; llama.cpp cannot tokenize this text "
            "with this vocabulary (e.g. a SentencePiece vocabulary without byte pieces meets a "
            "character it has no piece for), and a GGUF of it aborts on such text when served")
    if p.returncode != 0 or m is None:
        raise PerplexityError(
            f"llama-tokenize failed on {Path(gguf_path).name} (exit {p.returncode}): "
            f"{_tail(p.stderr.decode(errors='replace') + out)}")
    return [int(x) for x in m.group(1).replace(",", " ").split()]


def tokenizer_agreement(gguf_path: str | os.PathLike, tokenizer, text: str,
                        timeout: float = 120.0) -> dict:
    """Does llama.cpp cut ``text`` into the tokens transformers' ``tokenizer`` does? Voodoo's
    calibration blocks are transformers' tokens (``voodoo data``); what llama.cpp serves reads
    text with the GGUF's own vocabulary and pre-tokenizer (``tokenizer.ggml.pre``, chosen by
    the converter), and llama-perplexity's tables read text with it too.

    Args:
        gguf_path: a GGUF whose vocabulary llama.cpp uses (the converter's F32 base).
        tokenizer: the transformers tokenizer the calibration data was made with.
        text: the text to compare, e.g. a decoded stretch of the calibration blocks.

    Characters llama.cpp's tokenizer cannot read with this vocabulary (a SentencePiece
    vocabulary without byte pieces; :func:`voodoo.llamatext.untokenizable`) are replaced by
    spaces first, as in every text Voodoo hands to llama.cpp; they are listed in
    ``"unreadable"``.

    Returns ``{"n_chars", "n_transformers", "n_llama", "n_differ", "first_diff", "same",
    "pre", "context", "unreadable"}``: ``n_differ`` counts the tokens outside the longest
    matching runs (``difflib.SequenceMatcher`` over the two id lists: 0 when they agree),
    ``first_diff`` the index of the first token that differs (None when they agree),
    ``context`` both sides' token strings from there (up to 6 each), ``pre`` the GGUF's
    ``tokenizer.ggml.pre``.

    Raises what :func:`llama_tokenize` raises."""
    import difflib

    from .ggufio import read_gguf
    from .llamatext import readable
    text, bad = readable(gguf_path, text)
    hf = [int(i) for i in tokenizer(text, add_special_tokens=False).input_ids]
    ll = llama_tokenize(gguf_path, text, timeout=timeout)
    r = read_gguf(gguf_path)
    pre = r.fields.get("tokenizer.ggml.pre")
    pre = pre.contents() if pre is not None else None
    matched = sum(b.size for b in difflib.SequenceMatcher(None, hf, ll, autojunk=False)
                  .get_matching_blocks())
    first = next((i for i, (a, b) in enumerate(zip(hf, ll)) if a != b),
                 None if len(hf) == len(ll) else min(len(hf), len(ll)))
    res = {"n_chars": len(text), "n_transformers": len(hf), "n_llama": len(ll),
           "n_differ": max(len(hf), len(ll)) - matched, "first_diff": first,
           "same": hf == ll, "pre": pre, "context": None, "unreadable": bad}
    if first is not None:
        vocab = r.fields.get("tokenizer.ggml.tokens")
        names = vocab.contents() if vocab is not None else []

        def piece(i):
            return names[i] if 0 <= i < len(names) else f"<id {i}>"
        res["context"] = {"transformers": [piece(i) for i in hf[first:first + 6]],
                          "llama.cpp": [piece(i) for i in ll[first:first + 6]]}
    return res


def tokenizer_warning(res: dict, gguf_name: str) -> str | None:
    """One line on a :func:`tokenizer_agreement` result that differs (None when it agrees):
    what differs, where, what it means for the run and what usually causes it."""
    if res.get("same"):
        return None
    ctx = res.get("context") or {}
    return (f"warning: llama.cpp's tokenizer ({gguf_name}, tokenizer.ggml.pre="
            f"{res.get('pre')!r}) cuts {res['n_chars']} characters of the calibration text "
            f"into {res['n_llama']} tokens where transformers' makes {res['n_transformers']}, "
            f"{res['n_differ']} of them different (first at token {res['first_diff']}: "
            f"transformers {ctx.get('transformers')} vs llama.cpp {ctx.get('llama.cpp')}). "
            "Voodoo calibrates on transformers' tokens; the GGUF will read text with llama.cpp's "
            "(chat, server, the eval tables). A few tokens apart is llama.cpp's pre-tokenizer "
            "regex approximating transformers' (around newlines, digits, punctuation); many "
            "usually mean the converter chose another pre-tokenizer (convert_hf_to_gguf.py's "
            "get_vocab_base_pre). The quantization itself is unaffected")


def calibration_text(tokenizer, ids: torch.Tensor, n_chars: int = DEFAULT_TOKENIZER_CHARS
                     ) -> str:
    """Up to ``n_chars`` characters of text decoded from calibration token ids (LongTensor, any
    shape; special tokens such as the EOS between documents dropped), cut at the last
    whitespace so no word is split, and without leading whitespace: the text
    :func:`tokenizer_agreement` compares on. (A block may start anywhere in a document; where a
    text starts with a space, SentencePiece tokenizers differ by design: transformers' merges
    it into the prefix space, llama.cpp's adds its own.)"""
    flat = ids.reshape(-1)[: max(64, n_chars // 2)].tolist()
    text = tokenizer.decode(flat, skip_special_tokens=True).lstrip()
    if len(text) > n_chars:
        cut = text[:n_chars]
        ws = max(cut.rfind(" "), cut.rfind("\n"))
        text = cut[:ws] if ws > n_chars // 2 else cut
    return text
