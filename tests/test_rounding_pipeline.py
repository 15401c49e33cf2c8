"""``--rounding gptq`` through the pipeline: candidates keyed apart from llama-quantize's bytes,
input Hessians from the calibration blocks, the export holding exactly the error-feedback bytes
the gates trained on, a GGUF stock llama.cpp runs, and the same file size as the ggml export."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from test_pipeline import run_cli, tiny_fixed  # noqa: F401  (fixture)
from voodoo.candidates import (CandidateCache, CandidateJob, candidate_key, plan_precache,
                               quantize_candidate, rounding_tag)
from voodoo.llamacpp import LlamaCppNotBuilt, tool_path


def test_keys_and_bytes():
    rng = np.random.default_rng(0)
    w = (0.05 * rng.standard_normal((16, 512))).astype(np.float32)  # two Q4_K column groups
    x = rng.standard_normal((1024, 512)) @ (np.eye(512) + 0.2 * rng.standard_normal((512, 512)))
    h = (x.T @ x / 1024).astype(np.float32)
    im = np.ascontiguousarray(np.diagonal(h)).astype(np.float32)
    k0 = candidate_key(w, "Q4_K", im)
    assert k0.rounding == "ggml"
    tag = rounding_tag(h)
    assert tag.startswith("gptq:") and rounding_tag(None) == "ggml"
    assert rounding_tag(h, "F16") == "ggml"  # float types: nothing to round
    k1 = candidate_key(w, "Q4_K", im, rounding=tag)
    assert k1.digest != k0.digest and k1.from_meta(k1.to_meta()) == k1
    q0 = quantize_candidate(w, "Q4_K", im, "blk.0.ffn_down.weight")
    q1 = quantize_candidate(w, "Q4_K", im, "blk.0.ffn_down.weight", hessian=h)
    assert q1.shape == q0.shape and q1.dtype == np.uint8 and not np.array_equal(q0, q1)
    res, todo = plan_precache([CandidateJob("t", w, "Q4_K", im, h),
                               CandidateJob("t", w, "F16", im, h)], CandidateCache("/nonexistent"))
    assert res[("t", "Q4_K")].rounding == tag and res[("t", "F16")].rounding == "ggml"
    assert todo[1][0].hessian is None


@pytest.mark.slow
def test_gptq_run_exports_its_own_bytes(tiny_fixed, tmp_path):
    try:
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    args = ["--model", str(tiny_fixed), "--seq_len", "64", "--n_train_blocks", "8",
            "--n_eval_blocks", "2", "--imatrix_blocks", "4", "--no_ray", "--seed", "0",
            "--candidate_types", "Q8_0,Q4_K,IQ4_XS,Q2_K"]
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", *args, "--output_dir", str(out), "--compression_ratio", "0.5",
                          "--max_steps", "1", "--output_name", "g", "--rounding", "gptq"])
    assert rc == 0, err[-3000:]
    assert (out / "hessians.npz").is_file()
    asg = out / "g.assignment.json"
    rc, _, err = run_cli(["export", *args, "--output_dir", str(out), "--assignment", str(asg),
                          "--rounding", "gptq"])
    assert rc == 0, err[-3000:]
    assert "error-feedback rounded bytes" in err
    # without --rounding, export takes the assignment's own (gptq): the very same file
    rc, _, err = run_cli(["export", *args, "--output_dir", str(out), "--assignment", str(asg),
                          "--output_name", "again"])
    assert rc == 0, err[-3000:]
    assert (out / "again.gguf").read_bytes() == (out / "g.gguf").read_bytes()
    # llama-quantize's bytes of the same types, asked for explicitly (and said so)
    rc, _, err = run_cli(["export", *args, "--output_dir", str(out), "--assignment", str(asg),
                          "--output_name", "plain", "--rounding", "ggml"])
    assert rc == 0, err[-3000:]
    assert "trained on --rounding gptq candidates" in err
    g, p = GGUFReader(out / "g.gguf"), GGUFReader(out / "plain.gguf")
    assert str(bytes(g.fields["voodoo.rounding"].parts[-1]), "utf8") == "gptq"
    assert "voodoo.rounding" not in p.fields
    # same tensor bytes; the files differ only by the two voodoo.rounding KV pairs
    assert sum(t.data.nbytes for t in g.tensors) == sum(t.data.nbytes for t in p.tensors)
    assert 0 < (out / "g.gguf").stat().st_size - (out / "plain.gguf").stat().st_size < 256
    pt = {t.name: t for t in p.tensors}
    from gguf import GGML_QUANT_SIZES
    differ = []
    for t in g.tensors:
        u = pt[t.name]
        assert t.tensor_type == u.tensor_type and t.data.nbytes == u.data.nbytes, t.name
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        # a layer matmul whose rows hold more than one block has later columns to feed back to
        if t.name.startswith("blk.") and len(t.shape) == 2 and block > 1 and \
                int(t.shape[0]) > block:
            differ.append(not np.array_equal(np.asarray(t.data), np.asarray(u.data)))
    assert len(differ) >= 4 and all(differ), differ
    from voodoo.evaluate import run_perplexity
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    r = run_perplexity(out / "g.gguf", text, ctx=128, chunks=2)
    assert np.isfinite(r["ppl"]) and r["ppl"] > 1
