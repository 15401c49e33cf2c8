"""voodoo.lazy.plan_memory: the decision made before anything is loaded (eager fits / switch to
--lazy / fail naming the flags that would fit), with a fake device capacity; shapes of the
Llama-3.2-3B and Qwen3-14B configs (the H200 runs of benchmarks/results/lazy_student/)."""

from __future__ import annotations

import pytest

from test_pipeline import tiny_fixed  # noqa: F401  (fixture)

GIB = 2 ** 30
MENU6 = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S"]


def _llama_shapes(h, i, n_layers, heads, kv, vocab):
    hd = h // heads
    out = {"token_embd.weight": (vocab, h)}
    for b in range(n_layers):
        for n, s in {"attn_q": (heads * hd, h), "attn_k": (kv * hd, h), "attn_v": (kv * hd, h),
                     "attn_output": (h, heads * hd), "ffn_gate": (i, h), "ffn_up": (i, h),
                     "ffn_down": (h, i)}.items():
            out[f"blk.{b}.{n}.weight"] = s
    return out


def _predictor(h, i, n_layers, heads, kv, vocab, n_params, tokens=8192):
    from voodoo.lazy import predict_memory
    shapes = _llama_shapes(h, i, n_layers, heads, kv, vocab)
    menus = {n: MENU6 for n in shapes}
    calls = []

    def predict(lazy, ckpt, q8):
        calls.append((lazy, ckpt, q8))
        return predict_memory(shapes, menus, lazy=lazy, checkpointing=ckpt,
                              teacher_quant="Q8_0" if (q8 and lazy) else "BF16",
                              n_params=n_params, n_layers=n_layers, hidden=h, intermediate=i,
                              vocab=vocab, tokens=tokens)
    predict.calls = calls
    return predict


P3 = dict(h=3072, i=8192, n_layers=28, heads=24, kv=8, vocab=128256, n_params=3212749824)
P14 = dict(h=5120, i=17408, n_layers=40, heads=40, kv=8, vocab=151936, n_params=13990384640)


def test_eager_fits_stays_eager():
    from voodoo.lazy import plan_memory
    lazy, pred, note = plan_memory(_predictor(**P3), int(139.8 * GIB), lazy=False,
                                   checkpointing=False, q8_teacher=False)
    assert lazy is False and note is None and pred["total"] < 139.8 * GIB


def test_switches_to_lazy_when_only_lazy_fits():
    from voodoo.lazy import plan_memory
    predict = _predictor(**P3)
    cap = (predict(False, False, False)["total"] + predict(True, False, False)["total"]) // 2
    predict.calls.clear()
    lazy, pred, note = plan_memory(predict, cap, lazy=False, checkpointing=False,
                                   q8_teacher=False, where="cuda:0")
    assert lazy is True and pred["total"] <= cap
    assert "--lazy" in note and "cuda:0" in note and "\n" not in note
    assert predict.calls == [(False, False, False), (True, False, False)]
    # the same without the automatic switch: an error naming --lazy
    from voodoo.lazy import MemoryPlanError
    with pytest.raises(MemoryPlanError, match="would fit with --lazy "):
        plan_memory(predict, cap, lazy=False, checkpointing=False, q8_teacher=False,
                    auto_lazy=False)


def test_fails_naming_the_flags_that_fit():
    from voodoo.lazy import MemoryPlanError, plan_memory
    predict = _predictor(**P14)
    # the 14B shape, lazy + checkpointing: a capacity where only the Q8_0 teacher makes it fit
    cap = (predict(True, True, True)["total"] + predict(True, True, False)["total"]) // 2
    with pytest.raises(MemoryPlanError) as e:
        plan_memory(predict, cap, lazy=True, checkpointing=True, q8_teacher=False)
    msg = str(e.value)
    assert "would fit with --teacher_quant Q8_0 (" in msg, msg
    assert "--device_map" in msg and "voodoo tp" in msg and "\n" not in msg
    # eager, nothing asked: the cheapest set that fits is named with every flag it needs
    with pytest.raises(MemoryPlanError) as e:
        plan_memory(predict, cap, lazy=False, checkpointing=False, q8_teacher=False)
    assert "--lazy --gradient_checkpointing --teacher_quant Q8_0" in str(e.value)


def test_chunked_distillation_loss_same_values_and_grads(monkeypatch):
    """distill_losses beyond DISTILL_CHUNK_ELEMENTS (chunks under checkpointing) gives the
    whole-tensor CE, KL and logit gradients within float32 rounding."""
    import torch

    import voodoo.train as T
    torch.manual_seed(0)
    s = torch.randn(2, 50, 300, requires_grad=True)
    t, ids = torch.randn(2, 50, 300), torch.randint(0, 300, (2, 50))
    c0, k0 = T.distill_losses(s, t, ids)
    g0 = torch.autograd.grad(c0 + 0.7 * k0, s)[0]
    monkeypatch.setattr(T, "DISTILL_CHUNK_ELEMENTS", 1000)  # 3 positions a chunk
    c1, k1 = T.distill_losses(s, t, ids)
    g1 = torch.autograd.grad(c1 + 0.7 * k1, s)[0]
    torch.testing.assert_close(c1, c0, rtol=1e-6, atol=0)
    torch.testing.assert_close(k1, k0, rtol=1e-6, atol=0)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-9)


def test_nothing_fits_names_the_splits():
    from voodoo.lazy import MemoryPlanError, plan_memory
    with pytest.raises(MemoryPlanError) as e:
        plan_memory(_predictor(**P14), 40 * GIB, lazy=False, checkpointing=False,
                    q8_teacher=False)
    msg = str(e.value)
    assert msg.startswith("this run is predicted to need ")
    assert "even --lazy --gradient_checkpointing --teacher_quant Q8_0 needs" in msg
    assert "--device_map" in msg and "voodoo tp" in msg


def test_voodoo_train_lazy_q8_teacher_prints_prediction(tiny_fixed, tmp_path):  # noqa: F811
    """``voodoo train --lazy --teacher_quant Q8_0 --gate_init fisher`` on the CPU: the memory
    prediction is printed before the teacher is built, the Fisher prior runs on a dense teacher
    and training on the lazy one; one step."""
    from test_pipeline import run_cli
    out = tmp_path / "run"
    rc, so, se = run_cli(["train", "--model", str(tiny_fixed), "--output_dir", str(out),
                          "--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
                          "--imatrix_blocks", "4", "--no_ray", "--max_steps", "1", "--lazy",
                          "--teacher_quant", "Q8_0", "--fisher_blocks", "2"])
    assert rc == 0, se[-3000:]
    lines = [ln for ln in so.splitlines() if ln.startswith("[voodoo] predicted device memory: ")]
    assert len(lines) == 1 and "candidates" in lines[0] and "teacher" in lines[0], so
    assert list(out.glob("*.assignment.json"))


def test_config_size_reads_per_layer_lists():
    """Gemma 3n's ``intermediate_size`` is a per-layer list: the memory plan takes its largest
    entry (int() of the list crashed ``voodoo run`` after the candidates)."""
    from types import SimpleNamespace

    from voodoo.cli import config_size
    c = SimpleNamespace(intermediate_size=[256, 512, 384], hidden_size=128, vocab_size=None,
                        flag=True)
    assert config_size(c, "intermediate_size") == 512
    assert config_size(c, "hidden_size") == 128
    assert config_size(c, "vocab_size", 7) == 7
    assert config_size(c, "missing", 3) == 3
    assert config_size(c, "flag", 5) == 5


def test_cpu_training_plans_with_the_hosts_memory(tiny_fixed, tmp_path, monkeypatch):  # noqa: F811
    """In-process training on the CPU compares the prediction with the host's memory
    (``host_memory_capacity``): nothing fits -> refused before the teacher is built, naming the
    need and what is free; only lazy candidates fit -> ``--lazy`` with one line, and the run
    finishes. (On the CPU nothing was decided: a model whose eager candidates outgrow the
    machine was killed by the kernel in gate training.)"""
    import voodoo.lazy as L
    from test_pipeline import run_cli
    seen = []
    real_predict = L.predict_memory

    def predict(*a, **k):
        p = real_predict(*a, **k)
        seen.append((k["lazy"], k["checkpointing"], k["teacher_quant"], p["total"]))
        return p
    monkeypatch.setattr(L, "predict_memory", predict)
    argv = ["train", "--model", str(tiny_fixed), "--seq_len", "64", "--n_train_blocks", "8",
            "--n_eval_blocks", "2", "--imatrix_blocks", "4", "--no_ray", "--max_steps", "1",
            "--fisher_blocks", "2", "--rounding", "ggml"]
    monkeypatch.setattr(L, "host_memory_capacity", lambda: 1000)
    rc, so, se = run_cli([*argv, "--output_dir", str(tmp_path / "a")])
    assert rc != 0
    line = [ln for ln in se.splitlines() if ln.startswith("voodoo train: error: ")]
    assert line and "predicted to need" in line[0] and "this machine (host memory)" in line[0] \
        and "--lazy --gradient_checkpointing" in line[0], se[-2000:]
    assert "Traceback" not in se
    assert not (tmp_path / "a" / "train" / "partial.pt").exists()
    eager = next(t for lz, ck, tq, t in seen if not lz and not ck)
    lazy = next(t for lz, ck, tq, t in seen if lz and not ck and tq != "Q8_0")
    assert lazy < eager
    monkeypatch.setattr(L, "host_memory_capacity", lambda: (lazy + eager) // 2)
    rc, so, se = run_cli([*argv, "--output_dir", str(tmp_path / "b")])
    assert rc == 0, se[-3000:]
    assert "using --lazy" in so
    assert list((tmp_path / "b").glob("*.assignment.json"))


def test_cgroup_headroom_reads_v1_and_v2_limits(tmp_path):
    """In a container or a job with a memory limit, /proc/meminfo shows the host's memory:
    the plan then said a run fits and the kernel killed it (rc 137). The cgroup's room,
    the smallest over it and its parents, is what counts."""
    from voodoo.lazy import cgroup_headroom
    GB = 2 ** 30
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{3 * GB}\n")
    (v2 / "job" / "memory.current").write_text(f"{1 * GB}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (v2 / "job" / "step" / "memory.current").write_text(f"{GB // 2}\n")
    pc = tmp_path / "cgroup2"
    pc.write_text("0::/job/step\n")
    assert cgroup_headroom(str(pc), str(v2)) == 2 * GB
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "abc").mkdir(parents=True)
    (v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{4 * GB}")
    (v1 / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(f"{GB}")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{8 * GB}")
    pc1 = tmp_path / "cgroup1"
    pc1.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_headroom(str(pc1), str(v1)) == 3 * GB
    pc1.write_text("4:memory:/\n")
    assert cgroup_headroom(str(pc1), str(v1)) is None
    assert cgroup_headroom(str(tmp_path / "none"), str(v1)) is None
