"""``--rounding gptq`` through the pipeline: candidates keyed apart from llama-quantize's bytes,
input Hessians from the calibration blocks, the export holding exactly the error-feedback bytes
the gates trained on, a GGUF stock llama.cpp runs, and the same file size as the ggml export."""

from __future__ import annotations

import re

import numpy as np
import pytest
from voodoo.ggufio import read_gguf

from test_pipeline import run_cli, tiny_fixed  # noqa: F401  (fixture)
from voodoo.candidates import (CandidateCache, CandidateJob, candidate_key, plan_precache,
                               quantize_candidate, rounding_tag)
from voodoo.llamacpp import LlamaCppNotBuilt, tool_path


def test_logit_kl_is_the_kl_to_second_order():
    """:func:`voodoo.rounding.logit_kl` against the exact mean KL(softmax(x w^T) ||
    softmax(x deq^T)) of a small head error: within 3%; and zero for no error."""
    import torch

    from voodoo.rounding import logit_kl
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 48)).astype(np.float32)
    x = (0.3 * rng.standard_normal((200, 48))).astype(np.float32)
    deq = (w + 0.02 * rng.standard_normal(w.shape)).astype(np.float32)
    lp = torch.log_softmax(torch.from_numpy(x @ w.T).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(x @ deq.T).double(), -1)
    exact = float((lp.exp() * (lp - lq)).sum(-1).mean())
    got = logit_kl(w, deq, x, chunk=64)
    assert exact > 0 and abs(got / exact - 1) < 0.03, (got, exact)
    assert logit_kl(w, w, x) == pytest.approx(0.0, abs=1e-12)


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
    # k-quants are tagged apart only when their indices are refined too
    import voodoo.candidates as C
    assert rounding_tag(h, "IQ4_XS") == tag and rounding_tag(h, "IQ4_NL") == tag
    # the uniform 32-block types' bytes come with grid recovery, and their tag says so
    grid = ":grid:" if C.GRID_RECOVERY else ":"
    assert rounding_tag(h, "Q5_0") == tag.replace(":cd4:", f":cd4{grid}")
    kd = f":cd{C.GPTQ_SWEEPS}kd{C.GPTQ_KQUANT_SWEEPS}:" if C.GPTQ_KQUANT_SWEEPS else ":cd4:"
    assert rounding_tag(h, "Q6_K") == tag.replace(":cd4:", kd)
    k1 = candidate_key(w, "Q4_K", im, rounding=tag)
    assert k1.digest != k0.digest and k1.from_meta(k1.to_meta()) == k1
    q0 = quantize_candidate(w, "Q4_K", im, "blk.0.ffn_down.weight")
    q1 = quantize_candidate(w, "Q4_K", im, "blk.0.ffn_down.weight", hessian=h)
    assert q1.shape == q0.shape and q1.dtype == np.uint8 and not np.array_equal(q0, q1)
    res, todo = plan_precache([CandidateJob("t", w, "Q4_K", im, h),
                               CandidateJob("t", w, "F16", im, h)], CandidateCache("/nonexistent"))
    assert res[("t", "Q4_K")].rounding == rounding_tag(h, "Q4_K") \
        == tag.replace(":cd4:", kd) and res[("t", "F16")].rounding == "ggml"
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
    # the Fisher prior scored every tensor with a Hessian by its input correlation
    import json
    from voodoo.pipeline import load_hessians
    sens = json.loads((out / "train" / "sensitivity.json").read_text())
    assert sens["input_correlated"] == sorted(load_hessians(out / "hessians.npz")), sens.keys()
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
    g, p = read_gguf(out / "g.gguf"), read_gguf(out / "plain.gguf")
    assert str(bytes(g.fields["voodoo.rounding"].parts[-1]), "utf8") == "gptq"
    assert "voodoo.rounding" not in p.fields
    # same tensor bytes; the files differ only by the two voodoo.rounding KV pairs
    assert sum(t.data.nbytes for t in g.tensors) == sum(t.data.nbytes for t in p.tensors)
    assert 0 < (out / "g.gguf").stat().st_size - (out / "plain.gguf").stat().st_size < 256
    pt = {t.name: t for t in p.tensors}
    from gguf import GGML_QUANT_SIZES

    from voodoo.candidates import GPTQ_KQUANT_SWEEPS
    from voodoo.rounding import COLUMN_TYPES, REFINE_TYPES
    refined = REFINE_TYPES if GPTQ_KQUANT_SWEEPS else COLUMN_TYPES
    differ = []
    for t in g.tensors:
        u = pt[t.name]
        assert t.tensor_type == u.tensor_type and t.data.nbytes == u.data.nbytes, t.name
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        # a layer matmul whose rows hold more than one block has later columns to feed back
        # to; coordinate descent moves the indices of a single block of a refined type too
        if t.name.startswith("blk.") and len(t.shape) == 2 and block > 1 and \
                (int(t.shape[0]) > block or t.tensor_type.name in refined):
            differ.append(not np.array_equal(np.asarray(t.data), np.asarray(u.data)))
    assert len(differ) >= 4 and all(differ), differ
    from voodoo.evaluate import run_perplexity
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    r = run_perplexity(out / "g.gguf", text, ctx=128, chunks=2)
    assert np.isfinite(r["ppl"]) and r["ppl"] > 1


@pytest.mark.slow
def test_auto_rounding_keeps_the_better_bytes_per_pair(tiny_fixed, tmp_path):
    """``--rounding auto``: every (tensor, type) pair gets whichever bytes have the smaller
    ``tr(E H E^T)`` on the held-out blocks' Hessian; recomputed here from the saved Hessians and
    libggml's bytes, and the export holds exactly the chosen bytes."""
    import json

    from voodoo.imatrix import read_imatrix
    from voodoo.models import prepare_model
    from voodoo.pipeline import base_weights, load_hessians
    from voodoo.rounding import proxy_error
    import cython_ggml as cg
    args = ["--model", str(tiny_fixed), "--seq_len", "64", "--n_train_blocks", "8",
            "--n_eval_blocks", "4", "--imatrix_blocks", "4", "--hessian_blocks", "8",
            "--no_ray", "--seed", "0", "--candidate_types", "Q8_0,Q5_0,IQ4_NL,Q4_K,Q2_K"]
    out = tmp_path / "run"
    rc, _, err = run_cli(["train", *args, "--output_dir", str(out), "--compression_ratio", "0.5",
                          "--max_steps", "1", "--output_name", "a", "--rounding", "auto"])
    assert rc == 0, err[-3000:]
    assert "--rounding auto: error-feedback bytes kept for" in err
    table = json.loads((out / "rounding.json").read_text())["tensors"]
    fit = load_hessians(out / "hessians.npz")
    held = load_hessians(out / "hessians-heldout.npz")
    # the prior's input correlation: every tensor with a (held-out) Hessian
    sens = json.loads((out / "train" / "sensitivity.json").read_text())
    assert sens["input_correlated"] == sorted(held) and len(held) > 0
    im = read_imatrix(out / "imatrix.gguf")
    w = base_weights(prepare_model(str(tiny_fixed)).base_gguf)
    # the tied embedding is rounded for its output head: that matmul's input Hessian
    assert fit["token_embd.weight"].shape == (w["token_embd.weight"].shape[1],) * 2
    assert "token_embd.weight" in table
    kinds = set()
    for name, per_type in table.items():
        for t, ent in per_type.items():
            assert ent["choice"] == ("feedback" if ent["feedback"] < ent["ggml"] else "ggml")
            # the output head is scored by its logits' KL, the rest by tr(E H E^T)
            assert ent["proxy"] == ("logit_kl" if name == "token_embd.weight" else
                                    "output_error"), (name, ent["proxy"])
            kinds.add(ent["choice"])
    assert len(table) >= 4 and kinds == {"feedback", "ggml"}, kinds
    # one pair of each kind, recomputed from scratch
    for want in ("feedback", "ggml"):
        name, t = next((n, t) for n, pt in sorted(table.items()) for t, e in sorted(pt.items())
                       if e["choice"] == want and e["proxy"] == "output_error")
        row = im.get(name)
        for src, h in (("ggml", None), ("feedback", fit[name])):
            q = quantize_candidate(w[name], t, row, name, hessian=h)
            e = proxy_error(w[name], cg.dequantize(q, t, w[name].shape[1]), held[name])
            assert e == pytest.approx(table[name][t][src], rel=1e-9), (name, t, src)
    # the export (without --rounding: the assignment's, auto) writes the chosen bytes of each
    # tensor's assigned type
    rc, _, err = run_cli(["export", *args, "--output_dir", str(out),
                          "--assignment", str(out / "a.assignment.json")])
    assert rc == 0, err[-3000:]
    asg = json.loads((out / "a.assignment.json").read_text())
    g = {x.name: x for x in read_gguf(out / "a.gguf").tensors}
    checked = 0
    for name, v in asg["tensors"].items():
        ent = table.get(name, {}).get(v["type"])
        if ent is None:
            continue
        h = fit[name] if ent["choice"] == "feedback" else None
        q = quantize_candidate(w[name], v["type"], im.get(name), name, hessian=h)
        assert np.array_equal(np.asarray(g[name].data).reshape(-1), q.reshape(-1)), name
        checked += 1
    assert checked >= 4
    # the assignment carries the choices the gates trained on
    saved = asg["rounding_feedback"]
    assert saved == {n: sorted(t for t, e in pt.items() if e["choice"] == "feedback")
                     for n, pt in sorted(table.items())
                     if any(e["choice"] == "feedback" for e in pt.values())}
    assert asg["provenance"]["rounding"] == "auto" and asg["provenance"]["rounding_feedback"]
    # asked for explicitly: the very same file
    rc, _, err = run_cli(["export", *args, "--output_dir", str(out), "--rounding", "auto",
                          "--assignment", str(out / "a.assignment.json"), "--output_name", "b"])
    assert rc == 0, err[-3000:]
    assert (out / "b.gguf").read_bytes() == (out / "a.gguf").read_bytes()
    # with none of the run's data flags (export takes the run's own data): the same file, even
    # with the held-out choices file gone
    (out / "rounding.json").unlink()
    rc, _, err = run_cli(["export", "--model", str(tiny_fixed), "--no_ray", "--output_dir",
                          str(out), "--assignment", str(out / "a.assignment.json"),
                          "--output_name", "c"])
    assert rc == 0, err[-3000:]
    assert (out / "c.gguf").read_bytes() == (out / "a.gguf").read_bytes()
    fields = read_gguf(out / "a.gguf").fields
    assert str(bytes(fields["voodoo.rounding"].parts[-1]), "utf8") == "auto"
    assert int(fields["voodoo.rounding.tensor_count"].parts[-1][0]) == sum(
        1 for n, v in asg["tensors"].items()
        if table.get(n, {}).get(v["type"], {}).get("choice") == "feedback")


def test_rounding_choice_shows_progress_and_keeps_what_it_scored(tiny_fixed, tmp_path,
                                                                  monkeypatch):
    """The held-out scoring of both roundings (minutes on a real model) prints progress lines,
    and a run stopped partway (Ctrl-C) keeps the pairs it scored in rounding.json: the rerun
    scores only the rest, to the same table."""
    import json

    import voodoo.rounding as vr
    args = ["train", "--model", str(tiny_fixed), "--seq_len", "64", "--n_train_blocks", "8",
            "--n_eval_blocks", "4", "--imatrix_blocks", "4", "--hessian_blocks", "8",
            "--no_ray", "--seed", "0", "--candidate_types", "Q8_0,Q5_0,IQ4_NL,Q4_K,Q2_K",
            "--compression_ratio", "0.5", "--max_steps", "1", "--rounding", "auto"]
    real, calls = vr.proxy_error, {"n": 0, "stop": None}

    def counted(*a, **k):
        calls["n"] += 1
        if calls["stop"] is not None and calls["n"] > calls["stop"]:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(vr, "proxy_error", counted)
    import voodoo.pipeline as vp

    def cache_in(d):   # the cache's scores (other run folders') in a folder of this test's
        monkeypatch.setattr(vp, "_shared_rounding",
                            lambda h: vp._shared_rounding_at(tmp_path / d / "scores.json"))
    cache_in("cache")
    full = tmp_path / "full"
    rc, _, err = run_cli([*args, "--output_dir", str(full)])
    assert rc == 0, err[-3000:]
    assert "rounding choice: held-out error of both roundings: done in" in err, err[-3000:]
    table = json.loads((full / "rounding.json").read_text())["tensors"]
    n_pairs = sum(e["proxy"] == "output_error" for pt in table.values() for e in pt.values())
    assert calls["n"] == 2 * n_pairs and n_pairs >= 6
    # another run folder with the same held-out blocks scores nothing: the cache has them
    calls.update(n=0, stop=None)
    rc, _, err = run_cli([*args, "--output_dir", str(tmp_path / "again")])
    assert rc == 0, err[-3000:]
    assert calls["n"] == 0 and "pairs taken from the cache" in err, err[-3000:]
    assert json.loads((tmp_path / "again" / "rounding.json").read_text())["tensors"] == table
    cache_in("empty-cache")   # the rest of the test: a folder's own rounding.json only
    part = tmp_path / "part"
    calls.update(n=0, stop=2 * (n_pairs // 2))  # stop in the middle
    rc, _, err = run_cli([*args, "--output_dir", str(part)])
    assert rc == 130, err[-3000:]
    kept = json.loads((part / "rounding.json").read_text())["tensors"]
    n_kept = sum(e["proxy"] == "output_error" for pt in kept.values() for e in pt.values())
    assert n_kept == n_pairs // 2
    calls.update(n=0, stop=None)
    rc, _, err = run_cli([*args, "--output_dir", str(part)])
    assert rc == 0, err[-3000:]
    assert calls["n"] == 2 * (n_pairs - n_kept)
    m = re.search(r"rounding choice: (\d+) \(tensor, type\) pairs already scored in "
                  r"rounding.json; (\d+) to score", err)  # the head's pairs too
    assert m and int(m.group(1)) >= n_kept and int(m.group(2)) >= n_pairs - n_kept, err[-3000:]
    assert json.loads((part / "rounding.json").read_text())["tensors"] == table


def test_fit_logit_map_recovers_scale_and_softcap():
    """:func:`voodoo.rounding.fit_logit_map` finds the identity, a final scale (a
    ``logit_scale``) and a final softcap with a scale to 1e-3, and refuses a bias (not an
    elementwise map of the head's output)."""
    from voodoo.rounding import fit_logit_map
    rng = np.random.default_rng(0)
    z = (8 * rng.standard_normal((64, 500))).astype(np.float32)
    assert fit_logit_map(z, z).identity
    m = fit_logit_map(z, 0.0625 * z)
    assert m.softcap is None and m.scale == pytest.approx(0.0625, rel=1e-3)
    m = fit_logit_map(z, 30 * np.tanh(z / 30))
    assert m.softcap == pytest.approx(30, rel=1e-3) and m.scale == pytest.approx(1, rel=1e-3)
    m = fit_logit_map(z, 5 * np.tanh(0.5 * z / 5))
    assert m.softcap == pytest.approx(5, rel=1e-3) and m.scale == pytest.approx(0.5, rel=1e-3)
    assert fit_logit_map(z, z + 0.3) is None


def test_logit_kl_through_a_softcap():
    """With a final softcap, :func:`voodoo.rounding.logit_kl` given the map is the exact KL
    of the capped logits to second order (within 3%), and without it is off by more than
    10% (the cap flattens the softmax and shrinks the error of large logits)."""
    import torch

    from voodoo.rounding import LogitMap, logit_kl
    rng = np.random.default_rng(2)
    w = (3 * rng.standard_normal((300, 48))).astype(np.float32)
    x = rng.standard_normal((200, 48)).astype(np.float32)
    deq = (w + 0.05 * rng.standard_normal(w.shape)).astype(np.float32)
    cap = 8.0

    def capped(a):
        return cap * torch.tanh(torch.from_numpy(a).double() / cap)
    lp = torch.log_softmax(capped(x @ w.T), -1)
    lq = torch.log_softmax(capped(x @ deq.T), -1)
    exact = float((lp.exp() * (lp - lq)).sum(-1).mean())
    got = logit_kl(w, deq, x, chunk=64, logit_map=LogitMap(softcap=cap))
    plain = logit_kl(w, deq, x, chunk=64)
    assert exact > 0 and abs(got / exact - 1) < 0.03, (got, exact)
    assert abs(plain / exact - 1) > 0.10, (plain, exact)


def test_head_inputs_measures_the_models_softcap():
    """:func:`voodoo.pipeline.head_inputs` with ``logit_map=True`` reads the final softcap
    off a model's forward (a tiny random Gemma 2 with ``final_logit_softcapping=2``, logits
    large enough to bend): no config field is read."""
    import types

    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from voodoo.pipeline import head_inputs
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, final_logit_softcapping=2.0, attn_logit_softcapping=None)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    blocks = torch.randint(0, 300, (2, 16))
    x, m = head_inputs(types.SimpleNamespace(model=model), blocks, max_tokens=32,
                       logit_map=True)
    assert x.shape == (32, 64)
    assert m is not None and m.softcap == pytest.approx(2.0, rel=1e-2), m
