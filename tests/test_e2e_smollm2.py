"""The real SmolLM2-135M-Instruct (the default model, a Q4_1 GGUF) through every stage of
``voodoo run`` with a very short training, its GGUF evaluated by llama-perplexity; and the
baked student in torch against llama-perplexity on the same tokens.

Small on purpose (2 shared cores): seq_len 128, 4 train blocks, 3 steps, 8 imatrix blocks, a
4-type menu (``Q8_0,Q4_K,IQ4_XS,IQ2_XXS``; rows of 576 fall back to Q5_0 / IQ4_NL), ctx 128.
The first precache of SmolLM2 takes a few minutes; the content-addressed candidate cache makes
reruns fast.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from test_pipeline import run_cli

pytestmark = pytest.mark.slow

CTX = 128
SETTINGS = ["--seq_len", "128", "--n_train_blocks", "4", "--n_eval_blocks", "2",
            "--imatrix_blocks", "8", "--max_steps", "3", "--partial_save_interval", "3",
            "--candidate_types", "Q8_0,Q4_K,IQ4_XS,IQ2_XXS", "--compression_ratio", "0.6",
            "--no_ray", "--seed", "0"]


@pytest.fixture(scope="module")
def smol_run(smol_gguf, wikitext_test, tmp_path_factory):
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("smol-run")
    t0 = time.perf_counter()
    rc, stdout, stderr = run_cli(["run", "--model", str(smol_gguf), "--output_dir", str(out),
                                  *SETTINGS, "--eval_text", str(wikitext_test),
                                  "--ctx", str(CTX), "--chunks", "2", "--stock_types", ""])
    wall = time.perf_counter() - t0
    assert rc == 0, stderr[-4000:]
    print(f"\n[SmolLM2 voodoo run: {wall:.1f} s]\n{stdout}")
    (asg,) = out.glob("*.assignment.json")
    stem = asg.name.removesuffix(".assignment.json")
    return {"out": out, "assignment": asg, "gguf": out / f"{stem}.gguf", "stdout": stdout,
            "imatrix": out / "imatrix.gguf", "model": smol_gguf}


def test_smollm2_every_stage(smol_run):
    """The run wrote every stage's output; llama.cpp loaded the GGUF and measured it against
    the source model: a sane PPL, small KLD, most top tokens kept."""
    from voodoo.ggufio import read_gguf
    out = smol_run["out"]
    for p in (out / "data" / "train.pt", smol_run["imatrix"], out / "train" / "partial.pt",
              smol_run["assignment"], smol_run["gguf"], out / "eval" / "report.json"):
        assert p.is_file(), p
    asg = json.loads(smol_run["assignment"].read_text())
    assert len(asg["tensors"]) == 30 * 7 + 1  # tied embeddings: no output.weight
    assert asg["total_bytes"] <= asg["budget_bytes"] * 1.005
    written = {t.name: int(t.n_bytes) for t in read_gguf(smol_run["gguf"]).tensors}
    assert sum(written[n] for n in asg["tensors"]) == asg["total_bytes"]
    (row,) = json.loads((out / "eval" / "report.json").read_text())
    print(f"\n[SmolLM2 Voodoo60 ctx {CTX} x 2 chunks: PPL {row['ppl']:.3f} (source Q4_1 "
          f"{row['ppl_base']:.3f}), KLD {row['kld']:.4f}, same top {row['same_top_p']:.3f}, "
          f"{row['bpw']:.2f} bpw]")
    assert math.isfinite(row["ppl"]) and 1 < row["ppl"] < 2 * row["ppl_base"]
    assert 0 <= row["kld"] < 0.5
    assert row["same_top_p"] > 0.7


def test_torch_ppl_matches_llama_perplexity(smol_run, smol_tokenizer, wikitext_test, tmp_path):
    """4. The baked assignment in torch (``assign_student``) scores the tokens llama-perplexity
    scores -- the whole text tokenized once (BOS only if the vocab asks: SmolLM2 does not),
    chunks of ``ctx`` tokens, the first token of each chunk set to BOS when it does, only the
    second half of each chunk predicted (``first = n_ctx/2``; tokens first+1..ctx-1) -- and
    the PPL agrees within 2%. (llama.cpp's CPU dot products round activations to 8 bits, so it
    is not exact.)"""
    import torch
    from voodoo.ggufio import read_gguf

    from voodoo.candidates import CandidateCache
    from voodoo.evaluate import kld_base
    from voodoo.imatrix import read_imatrix
    from voodoo.pipeline import assign_student, build_student, ensure_candidates, load_context

    # a short text: the start of wikitext-2 test, enough for 4 chunks of CTX tokens
    lines = wikitext_test.read_text(encoding="utf-8").splitlines(keepends=True)
    text, n = "", 0
    while len(smol_tokenizer(text, add_special_tokens=False)["input_ids"]) < 4 * CTX + 16:
        text += "".join(lines[n:n + 10])
        n += 10
    tf = tmp_path / "short.txt"
    tf.write_text(text, encoding="utf-8")

    # llama.cpp: the PPL and (from the --kl-divergence-base file) the very tokens it used
    gguf = smol_run["gguf"]
    base = kld_base(gguf, tf, ctx=CTX, chunks=4, cache_dir=tmp_path / "kld")
    ppl_llama = base["ppl"]
    raw = Path(base["path"]).read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
    assert (n_ctx, n_chunk) == (CTX, 4)
    llama_tokens = np.frombuffer(raw[20:20 + 4 * n_chunk * n_ctx], dtype=np.int32)

    add_bos = bool(read_gguf(gguf).fields["tokenizer.ggml.add_bos_token"].contents())
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_bos:
        ids = [smol_tokenizer.bos_token_id] + ids
    ids = torch.tensor(ids[: n_chunk * n_ctx], dtype=torch.long)
    assert np.array_equal(ids.numpy(), llama_tokens), "HF and llama.cpp tokenize differently"

    # torch: the student with the baked types (K = 1 per tensor: the assigned candidate)
    asg = json.loads(smol_run["assignment"].read_text())
    one = {"tensors": {k: {"type": v["type"], "menu": [v["type"]]}
                       for k, v in asg["tensors"].items()}}
    menus = {k: [v["type"]] for k, v in asg["tensors"].items()}
    ctx = load_context(smol_run["model"], with_tokenizer=False)
    cache = CandidateCache()
    keys = ensure_candidates(ctx, menus, read_imatrix(smol_run["imatrix"]), cache)
    mixed = build_student(ctx, menus, keys, cache)
    assign_student(mixed, one)
    model = ctx.model.eval()
    first = CTX // 2
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(int(n_chunk)):
            chunk = ids[i * CTX:(i + 1) * CTX].clone()
            if add_bos:
                chunk[0] = smol_tokenizer.bos_token_id
            logits = model(input_ids=chunk[None], use_cache=False).logits[0].double()
            lp = torch.log_softmax(logits[first:CTX - 1], -1)
            nll -= lp.gather(-1, chunk[first + 1:, None]).sum().item()
            count += CTX - 1 - first
    ppl_torch = math.exp(nll / count)
    gap = ppl_torch / ppl_llama - 1
    print(f"\n[PPL on {count} tokens ({n_chunk} chunks of {CTX}): torch {ppl_torch:.4f}, "
          f"llama-perplexity {ppl_llama:.4f}, gap {100 * gap:+.3f}%]")
    assert abs(gap) < 0.02
