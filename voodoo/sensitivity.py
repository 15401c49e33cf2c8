"""Per-tensor, per-candidate sensitivity from the Fisher information, and the gate prior
built from it (``--gate_init fisher``).

Why: the quantity Voodoo is judged by is the mean per-token KL(base || quantized). Around the
base weights W its second-order expansion is ``KL(W + dW) ~ 1/2 dW^T F dW`` with F the Fisher
information of the model's next-token distribution (the KL's Hessian at dW = 0; the gradient
there is zero). With F's diagonal and every tensor's error taken alone, candidate k of tensor t
costs about::

    D[t, k] = 1/2 * sum_ij F_t[i, j] * (W_k[i, j] - W[i, j]) ** 2        (nats per token)

and the whole assignment costs ``sum_t D[t, k_t]``. Minimising that under the byte budget is a
multiple-choice knapsack; its Lagrangian ``min_k D[t, k] + mu * bytes[t, k]`` with ``mu`` found
by bisection solves it on the lower convex hull (Everett, 1963; used for mixed precision by
HAWQ-V2/V3), but can leave up to one tensor's step of the budget unused -- a whole tied
embedding's rung on a small model -- so the choice comes from an exact dynamic program over
bytes (:func:`knapsack_choice`), the hull's answer being kept only where it is better.

The gate prior puts each gate's logits at ``z[t, k] = -(D[t, k] + mu * bytes[t, k]) / tau``,
lifting the DP's type half a logit above the best where the two differ: the argmax is the
knapsack's choice, and ``tau`` makes the median tensor's margin between its best
and second-best type ``strength`` (so clear choices start sharp and near-ties start soft). Gate
training then corrects what the diagonal, one-tensor-at-a-time model misses, and the bake's
repair (the most probable assignment inside the size window) works on the same logits.

F is estimated as llama.cpp's imatrix is -- from calibration text only -- by the squared
gradient of ``sum_positions log p(y)`` with the labels ``y`` *sampled from the model's own
distribution* (the true Fisher, not the empirical one: with sampled labels the cross terms
between positions vanish in expectation, so the squared per-sequence gradient is an unbiased
estimate of the sum over positions of the per-token Fisher diagonal).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = ["fisher_diagonal", "distortion_table", "correlated_distortion", "lagrangian_choice",
           "knapsack_choice", "fisher_gate_logits",
           "load_or_compute_fisher", "gated_specs", "prior_from_student", "FISHER_VERSION"]

FISHER_VERSION = 1


def _resolve(model: nn.Module, spec) -> nn.Parameter:
    """A spec's weight: ``spec.param`` (an HF parameter name) when it has one, else
    ``spec.module_name``'s ``weight``."""
    pname = getattr(spec, "param", None)
    if pname is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        if pname not in params:
            raise ValueError(f"the model has no parameter {pname!r} (were gates already "
                             "installed on it? compute the Fisher on the teacher)")
        return params[pname]
    return _weight(model, spec.module_name)


def _weight(model: nn.Module, module_name: str) -> nn.Parameter:
    mod = model.get_submodule(module_name)
    w = getattr(mod, "weight", None)
    if not isinstance(w, nn.Parameter):
        raise ValueError(f"module {module_name!r} has no weight parameter (were gates already "
                         f"installed on this model? compute the Fisher on the teacher)")
    return w


def fisher_diagonal(model: nn.Module, specs: Sequence, blocks: torch.Tensor, *, seed: int = 0,
                    progress: bool = True) -> dict[str, torch.Tensor]:
    """The diagonal of the per-token Fisher information of each selectable weight.

    Args:
        model: a HF causal LM with ordinary weights (e.g. the teacher), float32.
        specs: objects with ``gguf_name`` (the key of the result) and either ``param`` (an HF
            parameter name) or ``module_name`` (a module whose ``weight`` it is); a tied weight
            (embedding = output head) is one parameter, so both of its uses add up in its grad.
        blocks: (N, T) int64 token ids (calibration text), N >= 1.
        seed: seeds the sampled labels (block i uses ``seed * 1_000_003 + i``).

    Returns gguf_name -> float32 CPU tensor of the weight's shape (HF layout): the mean over
    blocks of the squared gradient of ``sum_t log p(y_t | x_<t)``, ``y_t`` sampled from the
    model, divided by T -- so ``1/2 * sum F * dW**2`` is in nats per token.

    Raises ValueError for empty or non-integer blocks, no specs, or a spec whose module has no
    weight.
    """
    if blocks.dim() != 2 or len(blocks) < 1 or blocks.dtype != torch.long:
        raise ValueError(f"blocks must be (N >= 1, T) int64, got {tuple(blocks.shape)} "
                         f"{blocks.dtype}")
    weights = {s.gguf_name: _resolve(model, s) for s in specs}
    if not weights:
        raise ValueError("no tensor specs to take the Fisher diagonal of (specs is empty)")
    was = {id(p): p.requires_grad for p in model.parameters()}
    wanted = {id(w) for w in weights.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in wanted)
    model.eval()
    dev = next(iter(weights.values())).device
    acc = {n: torch.zeros(w.shape, dtype=torch.float32, device=dev) for n, w in weights.items()}
    n, t = blocks.shape
    it = range(n)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="fisher", dynamic_ncols=True)
    try:
        for i in it:
            ids = blocks[i: i + 1].to(dev)
            out = model(input_ids=ids, use_cache=False)
            logits = (out.logits if hasattr(out, "logits") else out).float()[0]
            g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + i)
            with torch.no_grad():
                p = torch.softmax(logits.detach().cpu(), -1)
                y = torch.multinomial(p, 1, generator=g).squeeze(1).to(dev)
            loss = nn.functional.cross_entropy(logits, y, reduction="sum")
            grads = torch.autograd.grad(loss, list(weights.values()), allow_unused=True)
            for (name, _), gr in zip(weights.items(), grads):
                if gr is not None:
                    acc[name].add_(gr.float().square())
    finally:
        for p in model.parameters():
            p.requires_grad_(was[id(p)])
    return {k: (v / (n * t)).cpu() for k, v in acc.items()}


@torch.no_grad()
def distortion_table(fisher: Mapping[str, torch.Tensor], candidates: Mapping[str, torch.Tensor],
                     reference: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """``D[t, k] = 1/2 * sum F_t * (W_k - W_t)**2`` in nats per token (see the module docstring).

    Args:
        fisher: gguf_name -> (n_rows, n_per_row) from :func:`fisher_diagonal`.
        candidates: gguf_name -> (K, n_rows, n_per_row) dequantized candidates (HF layout).
        reference: gguf_name -> (n_rows, n_per_row) the weights the KL is measured against.

    Returns gguf_name -> K floats. Raises ValueError on a missing name or a shape mismatch."""
    out = {}
    for name, cand in candidates.items():
        if name not in fisher or name not in reference:
            raise ValueError(f"{name}: no Fisher diagonal or reference weight")
        f, w = fisher[name], reference[name]
        if tuple(f.shape) != tuple(cand.shape[1:]) or tuple(w.shape) != tuple(cand.shape[1:]):
            raise ValueError(f"{name}: Fisher {tuple(f.shape)}, reference {tuple(w.shape)} and "
                             f"candidates {tuple(cand.shape)} disagree")
        f = f.to(cand.device, torch.float32)
        w = w.to(cand.device, torch.float32)
        out[name] = [0.5 * float((f * (cand[k].float() - w).square()).sum(dtype=torch.float64))
                     for k in range(cand.shape[0])]
    return out


@torch.no_grad()
def correlated_distortion(fisher: torch.Tensor, candidates: torch.Tensor,
                          reference: torch.Tensor, hessian) -> list[float]:
    """``D[k] = 1/2 * sum_r (s_r * e_r) C (s_r * e_r)^T`` in nats per token: the Fisher
    diagonal's cost with the input correlation put back.

    The Fisher of a matmul ``y = W x`` couples two weights of one row through their inputs,
    ``F[(r, i), (r, j)] ~ E[g_r^2 x_i x_j]``; with ``s = sqrt(F_diag)`` and ``C`` the input
    Hessian ``H = E[x x^T]`` scaled to a unit diagonal, ``s_ri s_rj C_ij`` is that entry
    when ``g_r^2`` and ``x x^T`` are independent, and its diagonal is :func:`distortion_table`'s
    (so the two agree for errors that are uncorrelated across columns, as llama-quantize's
    rounding is). Error-feedback (GPTQ) rounding makes the error anti-correlated with the
    input on purpose; the diagonal charges it for its larger ``sum e^2`` and misses the gain.

    Args:
        fisher: (n_rows, n_per_row) Fisher diagonal, GGUF layout.
        candidates: (K, n_rows, n_per_row) dequantized candidates.
        reference: (n_rows, n_per_row) the weights the KL is measured against.
        hessian: (n_per_row, n_per_row) input Hessian (numpy or torch); inputs with a zero
            diagonal (never active) are taken as uncorrelated.

    Returns K floats. Raises ValueError on a shape mismatch."""
    h = torch.as_tensor(hessian, dtype=torch.float64)
    n = candidates.shape[-1]
    if tuple(h.shape) != (n, n) or tuple(fisher.shape) != tuple(candidates.shape[1:]) or \
            tuple(reference.shape) != tuple(candidates.shape[1:]):
        raise ValueError(f"Hessian {tuple(h.shape)}, Fisher {tuple(fisher.shape)}, reference "
                         f"{tuple(reference.shape)} and candidates {tuple(candidates.shape)} "
                         f"disagree")
    d = torch.diagonal(h).clamp_min(0)
    inv = torch.where(d > 0, d.rsqrt(), torch.zeros_like(d))
    c = h * inv[:, None] * inv[None, :]
    c.fill_diagonal_(1.0)
    c = c.float()
    s = fisher.float().clamp_min(0).sqrt()
    w = reference.float()
    out = []
    for k in range(candidates.shape[0]):
        se = s * (candidates[k].float() - w)
        out.append(0.5 * float(((se @ c) * se).sum(dtype=torch.float64)))
    return out


def lagrangian_choice(dist: Mapping[str, Sequence[float]], nbytes: Mapping[str, Sequence[int]],
                      budget: float, iters: int = 100) -> tuple[float, dict[str, int]]:
    """Solves ``min sum_t D[t, k_t]`` s.t. ``sum_t bytes[t, k_t] <= budget`` on the convex hull.

    Returns (mu, {gguf_name: k}) with the smallest ``mu >= 0`` (nats per byte, found by
    bisection on a log scale) whose choices ``argmin_k D + mu * bytes`` fit in ``budget``
    (``mu = 0`` when the best type of every tensor already fits). Raises ValueError if even the
    smallest types exceed ``budget``."""
    names = sorted(dist)

    def pick(mu):
        ch = {n: min(range(len(dist[n])), key=lambda k: (dist[n][k] + mu * nbytes[n][k], k))
              for n in names}
        return ch, sum(nbytes[n][ch[n]] for n in names)

    ch, tot = pick(0.0)
    if tot <= budget:
        return 0.0, ch
    if sum(min(nbytes[n]) for n in names) > budget:
        raise ValueError(f"budget {budget:.0f} bytes is below the smallest types' total")
    dmax = max(max(v) for v in dist.values()) + 1e-30
    bmin = min((b for v in nbytes.values() for b in v if b > 0), default=1)
    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:  # grow until it fits
        hi *= 10.0
        if hi > 1e6 * dmax / bmin:
            break
    lo = hi / 1e30
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if pick(mid)[1] > budget:
            lo = mid
        else:
            hi = mid
    return hi, pick(hi)[0]


def knapsack_choice(dist: Mapping[str, Sequence[float]], nbytes: Mapping[str, Sequence[int]],
                    budget: float, resolution: int = 200_000) -> dict[str, int]:
    """Solves ``min sum_t D[t, k_t]`` s.t. ``sum_t bytes[t, k_t] <= budget`` by dynamic
    programming over bytes (the multiple-choice knapsack), not just on the convex hull.

    The Lagrangian (:func:`lagrangian_choice`) cannot take a large step it has no room for, such
    as a big tied embedding's next rung, and so can leave several percent of the budget unused;
    the DP can pay for that step by demoting smaller tensors. Sizes are counted in units of
    ``ceil(budget / resolution)`` bytes, each tensor's size rounded *up*, so the result never
    exceeds ``budget``; it is optimal up to that rounding (at most one unit per tensor, i.e.
    ``n_tensors / resolution`` of the budget), and the Lagrangian's choice is returned instead
    when the rounding made the DP's worse (:func:`voodoo.budget.min_cost_assignment`).

    Returns {gguf_name: k}. Raises ValueError if even the smallest types exceed ``budget``."""
    from .budget import min_cost_assignment
    names = sorted(dist)
    if sum(min(nbytes[n]) for n in names) > budget:
        raise ValueError(f"budget {budget:.0f} bytes is below the smallest types' total")
    out = min_cost_assignment(dist, nbytes, 0, budget, resolution=resolution)
    # the rounding can cost the DP a little where the hull already fits well: keep the better
    _, hull = lagrangian_choice(dist, nbytes, budget)
    if out is None:  # rounded up, the sizes overfill a budget they fit exactly (e.g. a
        return hull  # Q8_0-only menu at ratio 1.0): the hull's choice fits, unrounded
    if sum(dist[n][hull[n]] for n in names) < sum(dist[n][out[n]] for n in names):
        return hull
    return out


def fisher_gate_logits(dist: Mapping[str, Sequence[float]], nbytes: Mapping[str, Sequence[int]],
                       budget: float, strength: float = 2.0) -> dict[str, torch.Tensor]:
    """Gate logits ``z[t, k] = -(D[t, k] + mu * bytes[t, k]) / tau`` (module docstring).

    ``tau``: the median over tensors (with K >= 2) of the margin between the best and
    second-best ``D + mu * bytes``, divided by ``strength``. Returns gguf_name -> (K,) float32.

    The argmax is the exact knapsack's choice (:func:`knapsack_choice`): where it differs from
    the Lagrangian's (which can leave a big tensor's step unused), the knapsack's type gets a
    logit half a unit above the tensor's best Lagrangian cost. Raises ValueError for a strength
    that is not a finite number > 0.
    """
    if not (strength > 0 and math.isfinite(strength)):
        raise ValueError(f"strength must be a finite number > 0, got {strength}")
    mu, _ = lagrangian_choice(dist, nbytes, budget)
    choice = knapsack_choice(dist, nbytes, budget)
    cost = {n: torch.tensor([d + mu * b for d, b in zip(dist[n], nbytes[n])],
                            dtype=torch.float64) for n in dist}
    margins = []
    for c in cost.values():
        if len(c) >= 2:
            s = torch.sort(c).values
            margins.append(float(s[1] - s[0]))
    margins = [m for m in margins if m > 0]
    tau = (sorted(margins)[len(margins) // 2] / strength) if margins else 1.0
    out = {}
    for n, c in cost.items():
        z = -(c - c.min()) / tau
        k = choice[n]
        if int(torch.argmax(z)) != k:  # the DP pays for a step the Lagrangian cannot take:
            z[k] = z.max() + 0.5        # its choice leads, by half a logit
        out[n] = z.float()
    return out


def _fisher_key(model_id: str, blocks: torch.Tensor, seed: int, reference_tag: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": FISHER_VERSION, "model": model_id, "seed": seed,
                         "ref": reference_tag, "shape": list(blocks.shape)}).encode())
    h.update(blocks.cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def load_or_compute_fisher(model: nn.Module, specs: Sequence, blocks: torch.Tensor,
                           cache_dir: str | os.PathLike, model_id: str, *, seed: int = 0,
                           reference_tag: str = "", progress: bool = True
                           ) -> dict[str, torch.Tensor]:
    """:func:`fisher_diagonal`, cached in ``cache_dir/fisher-<key>.pt`` (key: model id, the
    blocks' bytes, seed, ``reference_tag`` -- e.g. the teacher's kind). Written atomically; an
    unreadable cache file is recomputed and replaced; a cache that cannot be written (full,
    read-only) gets a line, and the computed diagonal is returned all the same."""
    import io

    from .fsutil import atomic_write_bytes
    cache_dir = Path(cache_dir)
    path = cache_dir / f"fisher-{_fisher_key(model_id, blocks, seed, reference_tag)}.pt"
    names = {s.gguf_name for s in specs}
    if path.is_file():
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if set(obj) == names:
                if progress:
                    from .progress import log
                    log(f"Fisher diagonal: taken from the cache ({path}); the prior's costs "
                        "are computed from it")
                return obj
        except Exception:  # noqa: BLE001 -- a torn or foreign file: recompute
            pass
    fisher = fisher_diagonal(model, specs, blocks, seed=seed, progress=progress)
    buf = io.BytesIO()
    torch.save(fisher, buf)
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError as e:   # a full or read-only cache: it is only a cache, the run goes on
        from .progress import log
        log(f"could not keep the Fisher diagonal in the cache ({cache_dir}: "
            f"{e.strerror or e}); a rerun computes it again")
    return fisher


def gated_specs(student: nn.Module) -> list:
    """``[(gguf_name, module_name)]`` (as objects with those attributes) of a student with
    gates installed: the first module that uses each gate, in gguf_name order."""
    from types import SimpleNamespace

    from .gates import MixedQuantEmbedding, MixedQuantLinear
    seen = {}
    for mod_name, mod in student.named_modules():
        if isinstance(mod, (MixedQuantLinear, MixedQuantEmbedding)):
            seen.setdefault(mod.mixed.gguf_name, mod_name)
    return [SimpleNamespace(gguf_name=n, module_name=m) for n, m in sorted(seen.items())]


def prior_from_student(student: nn.Module, teacher: nn.Module, blocks: torch.Tensor,
                       budget: float, strength: float = 2.0, seed: int = 0,
                       progress: bool = False) -> dict[str, torch.Tensor]:
    """The ``"fisher"`` gate prior from a gated student and its teacher (no cache): the
    teacher's module of the same name as each gated module gives the reference weight and the
    Fisher diagonal; the student's candidates give ``D``. For library use of
    :func:`voodoo.train.train_gates`; the CLI uses :func:`voodoo.pipeline.fisher_prior`
    (cached, candidates straight from the candidate cache).

    Raises ValueError when the teacher lacks a module or its weight's shape differs from the
    candidates' (e.g. a tensor-parallel shard: pass ``init_logits`` instead)."""
    from .gates import mixed_weights
    mws = mixed_weights(student)
    specs = gated_specs(student)
    for s in specs:
        w = _weight(teacher, s.module_name)
        if tuple(w.shape) != tuple(mws[s.gguf_name].shape):
            raise ValueError(f"{s.gguf_name}: teacher weight {tuple(w.shape)} but candidates "
                             f"{tuple(mws[s.gguf_name].shape)} (sharded?); compute the prior "
                             f"on the full model and pass init_logits")
    fisher = fisher_diagonal(teacher, specs, blocks, seed=seed, progress=progress)
    dist = distortion_table(fisher, {n: m.candidates for n, m in mws.items()},
                            {s.gguf_name: _weight(teacher, s.module_name).detach()
                             for s in specs})
    table = {n: [int(b) for b in m.nbytes.tolist()] for n, m in mws.items()}
    return fisher_gate_logits(dist, table, budget, strength)
