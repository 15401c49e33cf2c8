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
* with ``--lazy on`` and ``--tp N`` / ``--device_map``: the sharded construction (meta-device
  model, candidates and the Q8_0 teacher as hashed ggml bytes made shard by shard,
  :class:`HashedStore`), per-rank / per-device peak memory, the ratio of a whole step to a
  plain training step of the same sharded model (timed in the worker, before the student is
  built), predicted memory per device (:func:`predict_sharded`); ``--agree``: then the same
  shape in one process, the first-step losses compared (``recipes/qwen32b_lazy_multi_gpu.sh``).

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
    #: the sharded-run construction (``--tp``/``--device_map``/``--agree`` with ``--lazy``):
    #: the model built on the meta device, candidates and the Q8_0 teacher as bytes made by a
    #: counter hash (:class:`HashedStore`) so that a rank makes only its shard's bytes and any
    #: shard equals the same slice of a one-process run's (agreement)
    hashed: bool = False
    dtype: str = "bfloat16"
    compression_ratio: float | None = None
    device_map: str | None = None
    out_dir: str | None = None  # sharded runs: per-rank JSON (plain step, peaks) goes here

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

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
            m = LlamaForCausalLM(self.config()).to(self.torch_dtype)
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
        if self.lazy and self.hashed:
            return self.hashed_job(info)
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


    def hashed_job(self, info):
        """The lazy student for sharded runs and their one-process agreement run: built on the
        meta device (no dense weights: a rank of a 32B model under ``--tp`` never holds the
        whole model), every selectable tensor gated by
        :func:`voodoo.gates.install_gates` over ggml bytes (``stores``: MixedQuantLinear /
        MixedQuantEmbedding, which :func:`cluster.tp.shard_model` narrows to a rank's blocks
        and :func:`cluster.train.dispatch_layers` moves with their layers). A TP-split tensor's
        candidates stay a :class:`HashedStore` (no bytes) until ``shard_model`` asks for the
        rank's shard; the others are made whole. The teacher is the same meta model gated over
        one Q8_0 candidate per tensor (``--teacher_quant Q8_0``; the same sharding applies),
        or the student's base in ``dtype`` (BF16: a dense copy of random weights)."""
        from cluster.train import StudentJob
        from voodoo.arch import get_adapter
        from voodoo.gates import install_gates
        from voodoo.quants import tensor_nbytes
        dev = info.device if info is not None else DEV
        tp = info.tp_size if info is not None else 1
        if self.out_dir and info is not None:
            self.plain_step(info)
        model = self.base("meta")
        specs = get_adapter(model.config).selectable(model)
        types = self.types

        where = self._devices_of(model, dev)  # --device_map: each layer's bytes on its GPU

        def stores_for(kind, tys):
            out = {}
            for i, s in enumerate(specs):
                st = HashedStore(tys, tuple(s.shape), seed=self.seed * 1000 + 17 * i + kind,
                                 device=where(s.module_name))
                # kept whole where tensor parallel does not split (the embedding) or no TP
                out[s.gguf_name] = st if (tp > 1 and s.tp in ("column", "row")) else st.full()
            return out
        table = {s.gguf_name: [tensor_nbytes(t, *s.shape) for t in types] for s in specs}
        install_gates(model, specs, {}, table, menus={s.gguf_name: types for s in specs},
                      stores=stores_for(0, types))
        materialize(model, where, self.torch_dtype, self.seed)
        if self.teacher_quant.upper() == "Q8_0":
            teacher = self.base("meta")
            install_gates(teacher, specs, {}, {s.gguf_name: [tensor_nbytes("Q8_0", *s.shape)]
                                               for s in specs},
                          menus={s.gguf_name: ["Q8_0"] for s in specs},
                          stores=stores_for(1, ["Q8_0"]))
            materialize(teacher, where, self.torch_dtype, self.seed)
        else:
            teacher = self.base("meta")
            materialize(teacher, where, self.torch_dtype, self.seed, dense=True)
        for p in teacher.parameters():
            p.requires_grad_(False)
        teacher.eval()
        _maybe_checkpoint(model, self.checkpointing)
        blocks = torch.randint(0, self.vocab, (self.n_blocks, self.tokens),
                               generator=torch.Generator().manual_seed(self.seed + 2))
        return StudentJob(student=model, teacher=teacher, train_blocks=blocks, specs=specs,
                          n_head=self.heads, n_head_kv=self.kv_heads)


    def _devices_of(self, model, dev):
        """A parameter's device: its decoder layer's under ``device_map`` (as
        :func:`cluster.train.dispatch_layers` places them), else ``dev``."""
        devs = self.device_map.split(",") if self.device_map else None
        if not devs:
            return lambda name: dev
        n = self.layers

        def where(name):
            parts = name.split(".")
            j = parts.index("layers") + 1 if "layers" in parts else len(parts)
            if j < len(parts) and parts[j].isdigit():
                return devs[int(parts[j]) * len(devs) // n]
            return devs[0]
        return where

    def plain_step(self, info):
        """A plain training step (forward + backward with weight gradients, same checkpointing)
        of the same sharded model, timed on this rank before the student is built; written to
        ``out_dir/plain-rank{r}.json`` with this rank's peak memory."""
        import resource
        from cluster.train import dispatch_layers
        from voodoo.arch import get_adapter
        dev = info.device
        plain = self.base("meta")
        specs = get_adapter(plain.config).selectable(plain)
        if info.tp_size > 1:
            from cluster.tp import TPGroup, shard_model
            shard_model(plain, specs, TPGroup(info.tp_rank, info.tp_size, None),
                        self.heads, self.kv_heads)
        materialize(plain, self._devices_of(plain, dev), self.torch_dtype, self.seed, dense=True)
        if self.device_map:
            dispatch_layers(plain, self.device_map.split(","))
        plain.train()
        _maybe_checkpoint(plain, self.checkpointing)
        for p in plain.parameters():
            p.requires_grad_(True)
        ids = torch.randint(0, self.vocab, (1, self.tokens),
                            generator=torch.Generator().manual_seed(self.seed + 9)).to(dev)

        def step():
            logits = plain(input_ids=ids, use_cache=False).logits
            F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        cuda = torch.device(dev).type == "cuda"
        devs = self.device_map.split(",") if self.device_map else [dev]
        if cuda:
            for d in devs:
                torch.cuda.reset_peak_memory_stats(d)
        global DEV
        DEV = "cuda" if cuda else "cpu"
        ms = _time(step, 3, warmup=1)
        out = {"rank": info.rank, "plain_ms": ms,
               "plain_peak_gib": {d: torch.cuda.max_memory_allocated(d) / 2**30 for d in devs}
               if cuda else None,
               "rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        del plain, ids
        if cuda:
            torch.cuda.empty_cache()
            for d in devs:
                torch.cuda.reset_peak_memory_stats(d)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"plain-rank{info.rank}.json"), "w") as fh:
            json.dump(out, fh)


class PeakHook:
    """``step_hook``: at the last step, each rank writes its peak memory (every device of a
    ``device_map``; on the CPU the process's peak RSS) to ``out_dir/peak-rank{r}.json``."""

    def __init__(self, out_dir, steps, devices):
        self.out_dir, self.steps, self.devices = out_dir, steps, devices

    def __call__(self, step, info, student):
        import resource
        if step != self.steps:
            return
        cuda = torch.device(info.device).type == "cuda"
        devs = self.devices or [info.device]
        out = {"rank": info.rank,
               "peak_gib": {d: torch.cuda.max_memory_allocated(d) / 2**30 for d in devs}
               if cuda else None,
               "rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"peak-rank{info.rank}.json"), "w") as fh:
            json.dump(out, fh)


def materialize(model, dev, dtype, seed, dense: bool = False):
    """Gives a model built on the meta device real tensors on ``dev``: norm weights 1, other
    meta parameters (``dense``: every weight) N(0, 0.02) from ``seed``, the rotary tables
    recomputed; what is already real (gates, stores) is left as it is."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    where = dev if callable(dev) else (lambda name: dev)
    done: dict[int, torch.nn.Parameter] = {}  # a tied weight stays one parameter
    for mname, mod in list(model.named_modules()):
        d = where(mname)
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                if p.dim() == 1:
                    t = torch.ones(p.shape, dtype=dtype, device=d)
                else:
                    g = torch.Generator(device=d).manual_seed(seed + 5 + len(done))
                    t = (torch.randn(p.shape, generator=g, device=d, dtype=dtype) * 0.02)
                done[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=d)
        if isinstance(mod, LlamaRotaryEmbedding):
            dev = d
            fresh = LlamaRotaryEmbedding(mod.config, device=dev) if "device" in \
                LlamaRotaryEmbedding.__init__.__code__.co_varnames else None
            if fresh is None:
                with torch.device(dev):
                    fresh = LlamaRotaryEmbedding(mod.config)
            mod.inv_freq = fresh.inv_freq.to(dev)
            mod.original_inv_freq = fresh.original_inv_freq.to(dev)
            mod.attention_scaling = fresh.attention_scaling
    return model


def _hash_bytes(idx: torch.Tensor, seed: int) -> torch.Tensor:
    """uint8 of a counter hash (splitmix-like, int64 wrap-around) of each global index."""
    x = idx * 0x9E3779B1 + seed * 0x632BE5AB + 0x1234567
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 12)
    x = x * 0x297A2D39
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


class HashedStore(torch.nn.Module):
    """K candidates of a ``(rows, cols)`` tensor as well-formed random ggml bytes (every fp16
    scale 2^-14, cf. ``lazy_candidates._random_blocks``) that exist only when asked for: byte j of
    row r of candidate k is a hash of ``(seed, k, r, j)``, so :meth:`narrow` (a TP rank's rows,
    or whole blocks of columns) makes exactly the bytes that slice has in :meth:`full`, without
    ever making the rest. Speed and memory do not depend on the values; the agreement check
    needs a shard to equal the one-process run's slice, which this gives."""

    def __init__(self, types, shape, seed: int, device="cpu"):
        super().__init__()
        self.types, self.shape, self.seed, self._device = tuple(types), tuple(shape), seed, device

    @property
    def k(self):
        return len(self.types)

    @property
    def device(self):
        return torch.device(self._device)

    @property
    def shape2d(self):
        return self.shape

    @property
    def nbytes(self):
        return 0

    def _bytes(self, k, r0, r1, c0, c1):
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lazy_candidates import F16_FIELDS

        from voodoo.quants import qtype
        t = qtype(self.types[k])
        row_bytes = t.row_nbytes(self.shape[1])
        j0, j1 = c0 // t.block_size * t.type_size, c1 // t.block_size * t.type_size
        out = torch.empty((r1 - r0, j1 - j0), dtype=torch.uint8, device=self.device)
        step = max(1, (1 << 26) // max(1, j1 - j0))
        cols = torch.arange(j0, j1, device=self.device, dtype=torch.int64)
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            rows = torch.arange(a, b, device=self.device, dtype=torch.int64)[:, None]
            out[a - r0:b - r0] = _hash_bytes(rows * row_bytes + cols, self.seed * 64 + k)
        blk = out.view(-1, t.type_size)
        # fp16 scales 2^-14: weights of order 0.005-0.05 (activations stay in range)
        small = torch.tensor([0x0400], dtype=torch.int16).view(torch.uint8).to(self.device)
        for off in F16_FIELDS.get(t.name, []):
            blk[:, off:off + 2] = small
        if t.name == "IQ1_M":
            for off, hi in ((49, 0), (51, 0), (53, 0), (55, 0x20)):
                blk[:, off] = (blk[:, off] & 0x0F) | hi
        return out

    def narrow(self, dim, start, length):
        from voodoo.lazy import QuantizedCandidates
        rows, cols = self.shape
        r0, r1, c0, c1 = 0, rows, 0, cols
        if dim % 2 == 0:
            r0, r1 = start, start + length
        else:
            c0, c1 = start, start + length
        return QuantizedCandidates([self._bytes(k, r0, r1, c0, c1) for k in range(self.k)],
                                   self.types, (r1 - r0, c1 - c0))

    def full(self):
        return self.narrow(0, 0, self.shape[0])


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
    # the teacher's forward alone: with the gated forward+backward, the floor of a whole step
    # (what is left is the loss over the logits and Adam)
    out["teacher_ms"] = _time(lambda: tfn(ids), n)
    out["ratio_gated_plus_teacher_over_plain"] = (out["gated_ms"] + out["teacher_ms"]) / plain_ms
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


def _ratio(f: BigLlamaFactory) -> float:
    """The budget: ``f.compression_ratio``, else 0.5 of Q8_0 when the menu reaches it, else
    the middle of what the menu can reach (a K = 3 smoke menu ends at Q5_K, 0.65)."""
    if f.compression_ratio:
        return f.compression_ratio
    from voodoo.quants import tensor_nbytes
    lo = tensor_nbytes(f.types[-1], 256, 4096) / tensor_nbytes("Q8_0", 256, 4096)
    return 0.5 if lo < 0.49 else round((lo + 1) / 2, 3)


def ray_run(f: BigLlamaFactory, steps: int, tp: int, device_map: str | None, name: str) -> dict:
    import glob
    import shutil

    import ray

    from cluster.train import run_training
    from voodoo.train import TrainConfig
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    cfg = TrainConfig(compression_ratio=_ratio(f), max_steps=steps, seq_len=f.tokens,
                      batch_size=1, device=DEV, dtype=f.dtype, compile=False,
                      partial_save_interval=steps, gradient_checkpointing=f.checkpointing,
                      # the Fisher prior needs dense candidates; a lazy student starts from the
                      # budget prior (the CLI computes the Fisher one in the driver)
                      gate_init="budget" if f.lazy else "fisher")
    f = copy.copy(f)
    f.device_map = device_map
    hook = None
    if f.hashed:
        f.out_dir = os.path.join("/tmp/voodoo-bench", name)
        shutil.rmtree(f.out_dir, ignore_errors=True)
        shutil.rmtree(os.path.join("/tmp/voodoo-ray", name), ignore_errors=True)
        hook = PeakHook(f.out_dir, steps, device_map.split(",") if device_map else None)

    t0 = time.perf_counter()
    n_gpu = torch.cuda.device_count()
    use_gpu = DEV == "cuda"
    kw = dict(num_workers=tp, use_gpu=use_gpu, tensor_parallel=tp)
    if device_map:
        kw = dict(num_workers=1, use_gpu=use_gpu, device_map=device_map,
                  resources_per_worker={"GPU": len(device_map.split(",")), "CPU": 2}
                  if use_gpu else {"CPU": 1})
    elif not use_gpu:
        kw["resources_per_worker"] = {"CPU": 1}
    res = run_training(f, cfg, run_name=name, storage_path="/tmp/voodoo-ray", step_hook=hook,
                       **kw)
    wall = time.perf_counter() - t0
    hist = res.history
    step_s = [h.get("step_seconds") for h in hist if h.get("step_seconds")]
    out = {"mode": name, "gpus_seen": n_gpu, "steps": res.step, "wall_s": wall,
           "tensor_parallel": tp, "device_map": device_map, "dtype": f.dtype,
           "compression_ratio": cfg.compression_ratio,
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
    if f.hashed:  # per rank / per device: the gate steps' peaks and the plain step
        ranks = {}
        for fn in sorted(glob.glob(os.path.join(f.out_dir, "*-rank*.json"))):
            with open(fn) as fh:
                d = json.load(fh)
            ranks.setdefault(f"rank{d.pop('rank')}", {}).update(
                {(f"plain_{k}" if k == "rss_peak_gib" and "plain" in os.path.basename(fn)
                  else k): v for k, v in d.items()})
        out["per_rank"] = ranks
        plain = [r["plain_ms"] for r in ranks.values() if "plain_ms" in r]
        if plain and step_s:
            out["plain_step_ms"] = max(plain)
            out["ratio_step_over_plain"] = out["step_s_median"] * 1e3 / max(plain)
    n_params = sum(p.numel() for p in f.base("meta").parameters())
    pred = f.predict(bool(f.lazy), n_params)
    out["predicted_gib"] = {k: v / 2**30 for k, v in pred.items()}
    out["predicted_per_device_gib"] = {
        k: v / 2**30 for k, v in predict_sharded(f, n_params, tp if tp > 1 else 1,
                                                 len(device_map.split(",")) if device_map
                                                 else 1).items()}
    out.update(lazy=bool(f.lazy), checkpointing=f.checkpointing, teacher_quant=f.teacher_quant)
    from voodoo.lazy import format_memory
    print(format_memory(pred, int(out["peak_gib"] * 2**30) if peaks else None), flush=True)
    return out


def predict_sharded(f: BigLlamaFactory, n_params: int, tp: int = 1, layer_devices: int = 1
                    ) -> dict:
    """:func:`voodoo.lazy.predict_memory` per device of a sharded run (the busiest device).

    ``tp``: tensor parallel -- each rank holds 1/tp of every decoder tensor (candidates,
    mixed weights, teacher) and the whole tied embedding, the residual stream's activations
    whole and the MLP's and attention's 1/tp, the logits whole (the head is not split).
    ``layer_devices``: layer-wise -- the first device holds its share of the layers plus the
    embedding and the logits (the busiest one). Both: the one-device prediction of the parts
    a device holds."""
    from voodoo.lazy import predict_memory
    from voodoo.quants import tensor_nbytes
    hd = f.hidden // f.heads
    layer = {"attn_q": (f.heads * hd, f.hidden), "attn_k": (f.kv_heads * hd, f.hidden),
             "attn_v": (f.kv_heads * hd, f.hidden), "attn_output": (f.hidden, f.heads * hd),
             "ffn_gate": (f.intermediate, f.hidden), "ffn_up": (f.intermediate, f.hidden),
             "ffn_down": (f.hidden, f.intermediate)}
    n_layers = -(-f.layers // layer_devices)  # the first device's layers (contiguous chunks)
    shapes = {f"blk.{b}.{n}.weight": (r // tp, c) for b in range(n_layers)
              for n, (r, c) in layer.items()}  # 1/tp of each tensor's bytes (rows or columns)
    shapes["token_embd.weight"] = (f.vocab, f.hidden)
    menus = {n: f.types for n in shapes}
    per_layer = sum(r * c for r, c in layer.values())
    params = n_params - f.layers * per_layer + n_layers * per_layer // tp
    tq = "Q8_0" if f.teacher_quant.upper() == "Q8_0" else "BF16"
    # activations: the model's layer count on this device, intermediate split by tp
    p = predict_memory(shapes, menus, n_params=params, n_layers=n_layers, hidden=f.hidden,
                       intermediate=f.intermediate // tp, vocab=f.vocab, tokens=f.tokens,
                       lazy=bool(f.lazy), teacher_quant=tq, checkpointing=f.checkpointing)
    del tensor_nbytes
    return p


def agreement(sharded: dict, one: dict, tol: float) -> dict:
    a, b = sharded.get("first_loss"), one.get("first_loss")
    out = {"sharded_mode": sharded.get("mode"), "sharded_first_loss": a,
           "one_process_first_loss": b, "rel_tol": tol}
    if a is not None and b is not None:
        out["abs_diff"] = abs(a - b)
        out["rel_diff"] = abs(a - b) / max(abs(b), 1e-12)
        out["ok"] = out["rel_diff"] <= tol
    print(f"agreement: {out}", flush=True)
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
    ap.add_argument("--agree", action="store_true",
                    help="after --tp/--device_map, the same shape in one process (TorchTrainer, "
                         "one worker, same construction and seed): first-step losses compared")
    ap.add_argument("--agree_tol", type=float, default=None,
                    help="relative tolerance of the agreement (default 1e-5 in float32, 2e-2 "
                         "in bfloat16)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the student's dtype (float32 for an exact CPU agreement check)")
    ap.add_argument("--compression_ratio", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    f = BigLlamaFactory(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.vocab, a.k,
                        a.tokens, lazy={"off": False, "on": True, "both": "both"}[a.lazy],
                        checkpointing=a.gradient_checkpointing, teacher_quant=a.teacher_quant,
                        assembly=a.lazy_assembly, dtype=a.dtype,
                        compression_ratio=a.compression_ratio)
    # sharded runs and their agreement run: meta-built model, hashed bytes (HashedStore)
    f.hashed = bool(f.lazy) and (bool(a.tp) or bool(a.device_map) or a.agree)
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
    if a.agree:
        one = ray_run(f, a.ray_steps, 1, None, "bench-1proc")
        results["one_process"] = one
        tol = a.agree_tol or (1e-5 if a.dtype == "float32" else 2e-2)
        results["agreement"] = {k: agreement(results[k], one, tol)
                                for k in (f"tp{a.tp}", "layerwise") if k in results}
        print(json.dumps(results["agreement"], indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
