"""A tiny random Llama gate-training job: the factory the Ray layer's tests, demos and the
``--toy`` job entry use (no files, no llama.cpp, builds in well under a second).

Candidates are synthetic, not llama.cpp's: candidate k of a weight W is
``W + noise * 0.02 * 3**k`` (menu order: more bits first, so noise grows down the menu), with
the byte sizes of the real ggml types of :data:`TYPES` from :func:`voodoo.quants.tensor_nbytes`.
Everything is a function of the seed, so every rank (and every Tune trial) builds the same job.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from cluster.train import StudentJob, WorkerInfo

__all__ = ["TinyLlamaFactory", "TYPES"]

#: Menu of the synthetic candidates (block size 32 each, so a row-parallel shard needs
#: n_per_row / tp to be a multiple of 32).
TYPES = ("Q8_0", "Q5_0", "Q4_0")


@dataclass
class TinyLlamaFactory:
    """``factory(info) -> StudentJob`` for a random LlamaForCausalLM.

    hidden/intermediate/layers/heads/kv_heads/vocab: the LlamaConfig. seq_len/n_blocks: the
    random token blocks (n_blocks, seq_len) int64 (plus ``n_eval`` eval blocks). seed: weights,
    candidates and tokens. Picklable (a dataclass of numbers), so it travels to Ray workers.
    ``make_shared()`` builds the weights and candidates once (for ``ray.put``); a job built
    from ``info.shared`` is identical to one built from scratch. ``calls_log`` (a path,
    optional): one line is appended per job built (counts trainings started, for tests)."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    seq_len: int = 16
    n_blocks: int = 8
    n_eval: int = 4
    tie: bool = True
    seed: int = 0
    calls_log: str | None = None

    def config(self):
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           tie_word_embeddings=self.tie, max_position_embeddings=256,
                           architectures=["LlamaForCausalLM"])

    def make_shared(self) -> dict:
        """{"state_dict": base weights, "candidates": gguf_name -> (K, rows, cols) float32,
        "blocks": (n_blocks + n_eval, seq_len) int64}."""
        from transformers import LlamaForCausalLM

        from voodoo.arch import get_adapter
        torch.manual_seed(self.seed)
        cfg = self.config()
        model = LlamaForCausalLM(cfg)
        specs = get_adapter(cfg).selectable(model)
        g = torch.Generator().manual_seed(self.seed + 1)
        cands = {}
        for s in specs:
            w = model.get_submodule(s.module_name).weight.detach()
            cands[s.gguf_name] = torch.stack(
                [w + torch.randn(w.shape, generator=g) * 0.02 * 3 ** k for k in range(len(TYPES))])
        blocks = torch.randint(0, self.vocab, (self.n_blocks + self.n_eval, self.seq_len),
                               generator=torch.Generator().manual_seed(self.seed + 2))
        return {"state_dict": model.state_dict(), "candidates": cands, "blocks": blocks}

    def __call__(self, info: WorkerInfo) -> StudentJob:
        from transformers import LlamaForCausalLM

        from voodoo.arch import get_adapter
        from voodoo.gates import install_gates
        from voodoo.quants import tensor_nbytes
        if self.calls_log:
            with open(self.calls_log, "a") as f:
                f.write(f"rank {info.rank}\n")
        shared = info.shared if info.shared is not None else self.make_shared()
        cfg = self.config()
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg)
        model.load_state_dict(shared["state_dict"])
        model.eval()
        adapter = get_adapter(cfg)
        specs = adapter.selectable(model)
        teacher = copy.deepcopy(model)
        cands = {n: c.clone() for n, c in shared["candidates"].items()}
        nbytes = {s.gguf_name: [tensor_nbytes(t, *s.shape) for t in TYPES] for s in specs}
        menus = {s.gguf_name: list(TYPES) for s in specs}
        install_gates(model, specs, cands, nbytes, menus=menus)
        blocks = shared["blocks"]
        return StudentJob(student=model, teacher=teacher, train_blocks=blocks[:self.n_blocks],
                          eval_blocks=blocks[self.n_blocks:], specs=specs,
                          n_head=adapter.n_head, n_head_kv=adapter.n_head_kv)


@dataclass
class KillOnce:
    """Step hook (``run_training(step_hook=...)``) that kills its worker process with
    ``os._exit(1)`` once, on rank ``rank`` after step ``at_step``; ``marker`` (a file path)
    records that it happened, so the restarted run goes on; ``steps_log`` (a path, optional)
    gets one line per step done on that rank; ``run_dir`` (the run's storage folder, optional):
    the marker's second line is then the step of the newest complete checkpoint on storage at
    the moment of the kill (:func:`cluster.train.newest_checkpoint`; -1 for none). For failure
    tests."""

    marker: str
    at_step: int
    rank: int = 0
    steps_log: str | None = None
    run_dir: str | None = None

    def __call__(self, step: int, info: WorkerInfo, student) -> None:
        import os
        if self.steps_log and info.rank == self.rank:
            with open(self.steps_log, "a") as f:
                f.write(f"{step}\n")
        if step == self.at_step and info.rank == self.rank and not os.path.exists(self.marker):
            newest = ""
            if self.run_dir:
                from cluster.train import newest_checkpoint
                found = newest_checkpoint(self.run_dir)
                newest = f"{found[1] if found else -1}\n"
            with open(self.marker, "w") as f:
                f.write(f"killed rank {info.rank} after step {step}\n{newest}")
            os._exit(1)


@dataclass
class RaiseAt:
    """Step hook that raises ``ValueError(message)`` on rank ``rank`` after step ``at_step``
    (every time it gets there), appending a line to ``log`` (a path) each time: a stand-in for
    an error that no retry can fix (bad input, non-finite weights). For failure tests."""

    log: str
    at_step: int
    rank: int = 0
    message: str = "non-finite weights in blk.0.ffn_down.weight (toy)"

    def __call__(self, step: int, info: WorkerInfo, student) -> None:
        if step == self.at_step and info.rank == self.rank:
            with open(self.log, "a") as f:
                f.write(f"raised on rank {info.rank} after step {step}\n")
            raise ValueError(self.message)


@dataclass
class DumpLogits:
    """Step hook that saves the student's logits (B, T, V) float32 on ``ids`` (B, T) after
    step ``at_step`` to ``{path}/rank-{rank}.pt`` (every rank; tensor-parallel ranks hold the
    full logits). For tests comparing layouts."""

    path: str
    at_step: int
    ids: torch.Tensor

    def __call__(self, step: int, info: WorkerInfo, student) -> None:
        import os
        if step != self.at_step:
            return
        with torch.no_grad():
            dev = next(iter(student.buffers())).device
            out = student(input_ids=self.ids.to(dev), use_cache=False).logits.float().cpu()
        os.makedirs(self.path, exist_ok=True)
        torch.save(out, os.path.join(self.path, f"rank-{info.rank}.pt"))
