"""Gate-training step cost on GPUs, measured against a plain bf16 training step in one run.

A real architecture at a real size with random weights (default: a Llama-3.2-3B-shaped
LlamaForCausalLM, tied embeddings) and K synthetic bf16 candidates per selectable tensor
(``W + noise``: speed and memory do not depend on the values). Prints, for ``--tokens`` tokens
a step:

* plain: bf16 forward + backward with weight gradients (the baseline), ms;
* gated: the student's forward + backward with gate-logit gradients only, ms, and its ratio
  to plain (the goal is <= 1.1x; reading the K candidates twice costs about 1.07x on an H200);
* step: a whole gate-training step (teacher forward, CE + KL + size penalty, Adam), ms;
* with ``--lazy_ops``: the gates' two candidate operations for every gated tensor of the model
  shape (one decoder layer timed, times ``--layers``, plus the tied embedding): ``mix`` and
  ``dots`` on K dense bf16 candidates (the eager path) against
  ``voodoo.lazy.QuantizedCandidates`` on the candidates' ggml bytes (``--lazy``), bytes held and
  ms a step for each, and the one-hot exactness of the lazy mix;
* with ``--ray``: the same training under Ray Train's ``TorchTrainer`` (one GPU worker;
  ``--tp 2``: tensor parallel over NCCL; ``--device_map cuda:0,cuda:1``: layer-wise in one
  worker), steps/s, tokens/s and peak memory per GPU, and its first-step loss next to the
  single-GPU one (agreement).

    python benchmarks/gpu_gate_step.py --layers 28 --tokens 8192 --k 6 [--ray] [--tp 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BigLlamaFactory:
    """``factory(info) -> StudentJob``: a random Llama of the given shape with K synthetic
    bf16 candidates per selectable tensor, built on the worker's device."""

    hidden: int = 3072
    intermediate: int = 8192
    layers: int = 28
    heads: int = 24
    kv_heads: int = 8
    vocab: int = 128256
    k: int = 6
    tokens: int = 8192
    n_blocks: int = 4
    seed: int = 0
    lazy: bool = False
    checkpointing: bool = False
    teacher_quant: str = "BF16"
    assembly: str = "module"

    def config(self):
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           tie_word_embeddings=True, max_position_embeddings=self.tokens,
                           architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")

    def base(self, device):
        from transformers import LlamaForCausalLM
        torch.manual_seed(self.seed)
        with torch.device(device):
            m = LlamaForCausalLM(self.config()).to(torch.bfloat16)
        return m.eval()

    def teacher(self, model, specs, dev):
        """The teacher: a bf16 copy of ``model`` (``BF16``), or (``Q8_0``) a copy whose
        selectable weights are held as Q8_0 bytes by :class:`voodoo.lazy.QuantizedParams`
        (well-formed random blocks: speed and memory do not depend on the values) and
        dequantized module by module in each forward, as ``--lazy --teacher_quant Q8_0``
        does."""
        teacher = copy.deepcopy(model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        if self.teacher_quant.upper() != "Q8_0":
            return teacher
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lazy_candidates import _random_blocks

        from voodoo.lazy import QuantizedCandidates, QuantizedParams
        g = torch.Generator(device=dev).manual_seed(self.seed + 3)
        stores = {s.gguf_name: QuantizedCandidates([_random_blocks("Q8_0", *s.shape, dev, g)],
                                                   ["Q8_0"], s.shape) for s in specs}
        teacher.voodoo_quantized = QuantizedParams(teacher, identity_map(teacher, specs), stores)
        return teacher

    def predict(self, lazy: bool, n_params: int) -> dict:
        """:func:`voodoo.lazy.predict_memory` of a whole gate-training step of this shape."""
        from voodoo.lazy import predict_memory
        hd = self.hidden // self.heads
        layer = {"attn_q": (self.heads * hd, self.hidden),
                 "attn_k": (self.kv_heads * hd, self.hidden),
                 "attn_v": (self.kv_heads * hd, self.hidden),
                 "attn_output": (self.hidden, self.heads * hd),
                 "ffn_gate": (self.intermediate, self.hidden),
                 "ffn_up": (self.intermediate, self.hidden),
                 "ffn_down": (self.hidden, self.intermediate)}
        shapes = {f"blk.{b}.{n}.weight": s for b in range(self.layers) for n, s in layer.items()}
        shapes["token_embd.weight"] = (self.vocab, self.hidden)
        menus = {n: self.types for n in shapes}
        tq = "Q8_0" if self.teacher_quant.upper() == "Q8_0" else "BF16"  # held lazily here
        return predict_memory(shapes, menus, n_params=n_params, n_layers=self.layers,
                              hidden=self.hidden, intermediate=self.intermediate,
                              vocab=self.vocab, tokens=self.tokens, lazy=lazy,
                              teacher_quant=tq, checkpointing=self.checkpointing)

    @property
    def types(self):
        return ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ1_S"][: self.k]

    def __call__(self, info):
        if self.lazy:
            return self.lazy_job(info)
        from cluster.train import StudentJob
        from voodoo.arch import get_adapter
        from voodoo.gates import install_gates
        from voodoo.quants import tensor_nbytes
        dev = info.device if info is not None else DEV
        model = self.base(dev)
        adapter = get_adapter(model.config)
        specs = adapter.selectable(model)
        teacher = self.teacher(model, specs, dev)
        types = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ1_S"][: self.k]
        g = torch.Generator(device=dev).manual_seed(self.seed + 1)
        cands, nbytes = {}, {}
        for s in specs:
            w = model.get_submodule(s.module_name).weight.detach()
            c = torch.empty((self.k, *w.shape), dtype=torch.bfloat16, device=dev)
            for i in range(self.k):
                c[i].copy_(w)
                c[i].add_(torch.randn(w.shape, generator=g, device=dev, dtype=torch.bfloat16),
                          alpha=0.002 * 2 ** i)
            cands[s.gguf_name] = c
            nbytes[s.gguf_name] = [tensor_nbytes(t, *s.shape) for t in types]
        install_gates(model, specs, cands, nbytes, menus={s.gguf_name: types for s in specs})
        blocks = torch.randint(0, self.vocab, (self.n_blocks, self.tokens),
                               generator=torch.Generator().manual_seed(self.seed + 2))
        _maybe_checkpoint(model, self.checkpointing)
        return StudentJob(student=model, teacher=teacher, train_blocks=blocks, specs=specs,
                          n_head=self.heads, n_head_kv=self.kv_heads)

    def lazy_job(self, info):
        """The ``--lazy`` student: each selectable weight's K candidates held as ggml bytes
        (well-formed random blocks of each type: speed and memory do not depend on the
        values) in :class:`voodoo.lazy.QuantizedCandidates`, gated by
        :func:`voodoo.gates.install_param_gates` over an identity tensor map (what
        ``build_student(lazy=True)`` does; a Llama's GGUF layout is its HF layout up to a row
        permutation, which costs nothing here): each weight mixed when its module is first
        called in a step (``per_module``; ``assembly="root"``: all before the forward)."""
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lazy_candidates import _random_blocks

        from cluster.train import StudentJob
        from voodoo.arch import get_adapter
        from voodoo.gates import install_param_gates
        from voodoo.lazy import QuantizedCandidates
        from voodoo.quants import tensor_nbytes
        dev = info.device if info is not None else DEV
        model = self.base(dev)
        specs = get_adapter(model.config).selectable(model)
        teacher = self.teacher(model, specs, dev)
        types = self.types
        g = torch.Generator(device=dev).manual_seed(self.seed + 1)
        stores, table = {}, {}
        for s in specs:
            stores[s.gguf_name] = QuantizedCandidates(
                [_random_blocks(t, *s.shape, dev, g) for t in types], types, s.shape)
            table[s.gguf_name] = [tensor_nbytes(t, *s.shape) for t in types]
        install_param_gates(model, identity_map(model, specs), {}, table,
                            menus={s.gguf_name: types for s in specs}, stores=stores,
                            per_module=self.assembly == "module")
        _maybe_checkpoint(model, self.checkpointing)
        blocks = torch.randint(0, self.vocab, (self.n_blocks, self.tokens),
                               generator=torch.Generator().manual_seed(self.seed + 2))
        return StudentJob(student=model, teacher=teacher, train_blocks=blocks, specs=specs,
                          n_head=self.heads, n_head_kv=self.kv_heads)


def identity_map(model, specs):
    """A :class:`voodoo.tensormap.TensorMap` in which each selectable tensor is its module's
    ``weight`` as it is (GGUF rows = HF rows): a Llama's layout up to a row permutation of
    attn_q/attn_k, which costs nothing here."""
    import numpy as np

    from voodoo.tensormap import Link, MapEntry, TensorMap
    entries = []
    for s in specs:
        n = s.shape[0]
        lk = Link(f"{s.module_name}.weight", False, np.arange(n), np.arange(n))
        entries.append(MapEntry(s.gguf_name, tuple(s.shape), [lk]))
    return TensorMap("llama", "LlamaForCausalLM", entries)


def _maybe_checkpoint(model, on: bool):
    if on:
        from voodoo.train import enable_checkpointing
        enable_checkpointing(model)


DEV = "cuda"


def _time(fn, n, warmup=2):
    if DEV == "cpu":  # smoke runs of this script on a CPU machine
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t))
        return statistics.median(ts)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def single_gpu(f: BigLlamaFactory, n: int) -> dict:
    """Plain bf16 forward+backward, then the eager and/or lazy student (``f.lazy``): gated
    forward+backward and a whole gate-training step, ms, peak GiB and ratios to plain."""
    ids = torch.randint(0, f.vocab, (1, f.tokens), device=DEV)
    out = {"tokens": f.tokens, "k": f.k}

    # plain bf16 forward + backward with weight gradients
    plain = f.base(DEV).train()
    _maybe_checkpoint(plain, f.checkpointing)
    for p in plain.parameters():
        p.requires_grad_(True)

    def plain_step():
        logits = plain(ids).logits
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["plain_ms"] = _time(plain_step, n)
    out["plain_peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0)
    out["params"] = sum(p.numel() for p in plain.parameters())
    del plain
    if DEV == "cuda":
        torch.cuda.empty_cache()
    print(json.dumps(out), flush=True)
    for lazy in ((False, True) if f.lazy == "both" else (bool(f.lazy),)):
        fl = copy.copy(f)
        fl.lazy = lazy
        res = {}
        try:
            _gated(fl, n, ids, out["plain_ms"], res)
        except torch.OutOfMemoryError as e:  # report what was measured, and where it ran out
            res["oom"] = str(e).split("\n")[0][:300]
        out.update({(f"lazy_{k}" if lazy else k): v for k, v in res.items()})
        print(json.dumps(res), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def _gated(f, n, ids, plain_ms, out):
    """The student's figures into ``out`` as they are measured."""
    from voodoo.budget import budget_bytes
    from voodoo.gates import gate_parameters, model_expected_bytes
    from voodoo.train import TrainConfig, train_step
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()

    job = f(None)
    student, teacher = job.student.train(), job.teacher
    params = gate_parameters(student)
    out["build_s"] = time.perf_counter() - t0
    if DEV == "cuda":
        out["held_gib"] = torch.cuda.memory_allocated() / 2**30
        out["build_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    t0 = time.perf_counter()

    def gated_step():
        logits = student(ids).logits
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
    gated_step()  # first call (compiles the lazy tiles)
    if DEV == "cuda":
        torch.cuda.synchronize()
    out["first_step_s"] = time.perf_counter() - t0
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["gated_ms"] = _time(gated_step, n)
    out["gated_peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0)
    out["ratio_gated_over_plain"] = out["gated_ms"] / plain_ms

    cfg = TrainConfig(compression_ratio=0.5, max_steps=1000, seq_len=f.tokens, batch_size=1,
                      device=DEV, dtype="bfloat16", compile=False)
    shapes = {s.gguf_name: tuple(s.shape) for s in job.specs}
    budget = budget_bytes(shapes, 0.5)
    opt = torch.optim.Adam(params, lr=cfg.lr)

    @torch.no_grad()
    def tfn(x):
        return teacher(x).logits

    def full_step():
        train_step(student, tfn, ids, opt, params, cfg, budget, 1.0)
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["step_ms"] = _time(full_step, n)
    out["step_peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0)
    out["ratio_step_over_plain"] = out["step_ms"] / plain_ms
    out["step_tokens_per_s"] = f.tokens / out["step_ms"] * 1e3
    out["expected_gib"] = float(model_expected_bytes(student).detach()) / 2**30
    n_params = sum(p.numel() for p in f.base("meta").parameters())
    pred = f.predict(bool(f.lazy), n_params)
    out["predicted_gib"] = {k: v / 2**30 for k, v in pred.items()}
    out["teacher_quant"] = f.teacher_quant
    if DEV == "cuda":
        from voodoo.lazy import format_memory
        print(format_memory(pred, int(out["step_peak_gib"] * 2**30)), flush=True)
    del job, student, teacher, opt, params
    return out


def lazy_ops(f: BigLlamaFactory, n: int) -> dict:
    """Eager (dense bf16) vs lazy (ggml bytes) candidate operations over the model's tensors."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lazy_candidates import _random_blocks

    from voodoo import kernels
    from voodoo.lazy import QuantizedCandidates
    types = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ1_S"][: f.k]
    hd = f.hidden // f.heads
    layer = {"attn_q": (f.heads * hd, f.hidden), "attn_k": (f.kv_heads * hd, f.hidden),
             "attn_v": (f.kv_heads * hd, f.hidden), "attn_output": (f.hidden, f.heads * hd),
             "ffn_gate": (f.intermediate, f.hidden), "ffn_up": (f.intermediate, f.hidden),
             "ffn_down": (f.hidden, f.intermediate)}
    tensors = [(name, shape, f.layers) for name, shape in layer.items()]
    tensors.append(("token_embd", (f.vocab, f.hidden), 1))
    gen = torch.Generator(device=DEV).manual_seed(0)
    probs = torch.softmax(torch.randn(f.k, device=DEV, generator=gen), 0)
    out = {"types": types, "per_tensor": {}}
    tot = {"eager_bytes": 0, "lazy_bytes": 0, "eager_ms": 0.0, "lazy_ms": 0.0}
    exact = True
    for name, shape, count in tensors:
        blocks = [_random_blocks(t, shape[0], shape[1], DEV, gen) for t in types]
        lz = QuantizedCandidates(blocks, types, shape)
        dense = torch.stack([lz.dense(i, torch.bfloat16) for i in range(f.k)])  # (K, R, C)
        g = torch.randn(shape, device=DEV, generator=gen).to(torch.bfloat16)
        t0 = time.perf_counter()
        lz.mix(probs, torch.bfloat16), lz.dots(g)
        first_s = time.perf_counter() - t0
        exact &= all(torch.equal(lz.mix(torch.nn.functional.one_hot(torch.tensor(i), f.k)
                                        .float().to(DEV)), lz.dense(i)) for i in range(f.k))
        row = {
            "shape": shape, "count": count, "first_call_s": round(first_s, 1),
            "eager_mix_ms": _time(lambda: kernels.mix(probs, dense, torch.bfloat16), n),
            "eager_dots_ms": _time(lambda: kernels.dots(dense, g), n),
            "lazy_mix_ms": _time(lambda: lz.mix(probs, torch.bfloat16), n),
            "lazy_dots_ms": _time(lambda: lz.dots(g), n),
            "eager_bytes": dense.numel() * dense.element_size(), "lazy_bytes": lz.nbytes}
        out["per_tensor"][name] = row
        tot["eager_bytes"] += count * row["eager_bytes"]
        tot["lazy_bytes"] += count * row["lazy_bytes"]
        tot["eager_ms"] += count * (row["eager_mix_ms"] + row["eager_dots_ms"])
        tot["lazy_ms"] += count * (row["lazy_mix_ms"] + row["lazy_dots_ms"])
        del blocks, lz, dense, g
    out.update(
        candidates_eager_gib=tot["eager_bytes"] / 2**30, candidates_lazy_gib=tot["lazy_bytes"] / 2**30,
        memory_ratio=tot["lazy_bytes"] / tot["eager_bytes"],
        mix_plus_dots_ms_per_step_eager=tot["eager_ms"], mix_plus_dots_ms_per_step_lazy=tot["lazy_ms"],
        lazy_onehot_exact=exact)
    return out


def ray_run(f: BigLlamaFactory, steps: int, tp: int, device_map: str | None, name: str) -> dict:
    import ray

    from cluster.train import run_training
    from voodoo.train import TrainConfig
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    cfg = TrainConfig(compression_ratio=0.5, max_steps=steps, seq_len=f.tokens, batch_size=1,
                      device=DEV, dtype="bfloat16", compile=False,
                      partial_save_interval=steps, gradient_checkpointing=f.checkpointing,
                      # the Fisher prior needs dense candidates; a lazy student starts from the
                      # budget prior (the CLI computes the Fisher one in the driver)
                      gate_init="budget" if f.lazy else "fisher")
    times = []

    t0 = time.perf_counter()
    n_gpu = torch.cuda.device_count()
    kw = dict(num_workers=tp, use_gpu=DEV == "cuda", tensor_parallel=tp)
    if device_map:
        kw = dict(num_workers=1, use_gpu=True, device_map=device_map,
                  resources_per_worker={"GPU": len(device_map.split(",")), "CPU": 2})
    res = run_training(f, cfg, run_name=name, storage_path="/tmp/voodoo-ray", **kw)
    wall = time.perf_counter() - t0
    hist = res.history
    step_s = [h.get("step_seconds") for h in hist if h.get("step_seconds")]
    out = {"mode": name, "gpus_seen": n_gpu, "steps": res.step, "wall_s": wall,
           "first_loss": hist[0]["loss"] if hist else None,
           "last_loss": hist[-1]["loss"] if hist else None,
           "metrics": {k: v for k, v in res.metrics.items() if isinstance(v, (int, float))}}
    if step_s:
        med = statistics.median(step_s[1:] or step_s)
        out.update(step_s_median=med, steps_per_s=1 / med, tokens_per_s=f.tokens / med,
                   step_s_all=step_s)
    peaks = [h.get("peak_gib") for h in hist if h.get("peak_gib")]
    if peaks:
        out["peak_gib"] = max(peaks)
    n_params = sum(p.numel() for p in f.base("meta").parameters())
    pred = f.predict(bool(f.lazy), n_params)
    out["predicted_gib"] = {k: v / 2**30 for k, v in pred.items()}
    out.update(lazy=bool(f.lazy), checkpointing=f.checkpointing, teacher_quant=f.teacher_quant)
    from voodoo.lazy import format_memory
    print(format_memory(pred, int(out["peak_gib"] * 2**30) if peaks else None), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--n", type=int, default=5, help="timed repetitions")
    ap.add_argument("--single", action="store_true", help="plain vs gated vs step on cuda:0")
    ap.add_argument("--lazy_ops", action="store_true",
                    help="candidate mix/dots: dense bf16 (eager) vs ggml bytes (lazy)")
    ap.add_argument("--lazy", choices=["off", "on", "both"], default="off",
                    help="--single: the eager student (off), the lazy one (on: candidates as "
                         "ggml bytes, voodoo.lazy) or both, one after the other")
    ap.add_argument("--gradient_checkpointing", action="store_true",
                    help="per decoder layer, for the plain baseline and the students alike")
    ap.add_argument("--teacher_quant", choices=["BF16", "Q8_0"], default="BF16",
                    help="the teacher: a bf16 copy, or Q8_0 bytes dequantized module by module "
                         "(voodoo.lazy.QuantizedParams, as --lazy --teacher_quant Q8_0)")
    ap.add_argument("--lazy_assembly", choices=["module", "root"], default="module",
                    help="lazy student: mix each weight when its module is first called in a "
                         "step (ParamGates per_module, build_student(lazy=True)'s) or all of "
                         "them before the forward (root)")
    ap.add_argument("--ray", action="store_true", help="TorchTrainer, one GPU worker")
    ap.add_argument("--tp", type=int, default=0, help="TorchTrainer tensor parallel N")
    ap.add_argument("--device_map", default=None, help="TorchTrainer layer-wise, one worker")
    ap.add_argument("--ray_steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    f = BigLlamaFactory(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.vocab, a.k,
                        a.tokens, lazy={"off": False, "on": True, "both": "both"}[a.lazy],
                        checkpointing=a.gradient_checkpointing, teacher_quant=a.teacher_quant,
                        assembly=a.lazy_assembly)
    results = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
               "shape": vars(a)}
    if a.single:
        results["single"] = single_gpu(f, a.n)
        print(json.dumps(results["single"], indent=1), flush=True)
    if a.lazy_ops:
        results["lazy_ops"] = lazy_ops(f, a.n)
        print(json.dumps(results["lazy_ops"], indent=1), flush=True)
    if a.ray:
        fr = copy.copy(f)
        fr.lazy = bool(f.lazy)  # "both": the lazy student under TorchTrainer
        results["ray1"] = ray_run(fr, a.ray_steps, 1, None, "bench-1gpu")
        print(json.dumps(results["ray1"], indent=1), flush=True)
    if a.tp:
        results[f"tp{a.tp}"] = ray_run(f, a.ray_steps, a.tp, None, f"bench-tp{a.tp}")
        print(json.dumps(results[f"tp{a.tp}"], indent=1), flush=True)
    if a.device_map:
        results["layerwise"] = ray_run(f, a.ray_steps, 1, a.device_map, "bench-layerwise")
        print(json.dumps(results["layerwise"], indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
