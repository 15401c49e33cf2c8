"""The size budget, in bytes, and the dead-zone size penalty.

The budget counts only the **selectable** tensors (each stored tensor once: a tied lm_head is
not counted again). It is given either

* as a compression ratio of Q8_0:
  ``B = compression_ratio * bytes_at_Q8_0 * (1 - budget_reduction)``, where
  ``bytes_at_Q8_0`` sums :func:`voodoo.quants.tensor_nbytes` ("Q8_0", shape) over the
  selectable tensors (llama.cpp's shape fallbacks applied); or
* as bits per weight: ``B = target_bits * n_weights / 8 * (1 - budget_reduction)``.

``budget_reduction`` is a safety margin taken off either form (e.g. 0.01 aims 1% under).
Sizes are in bytes throughout; bits per weight are named ``bpw``/``bits``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from voodoo.quants import tensor_nbytes

__all__ = [
    "shapes_of", "q8_0_bytes", "n_weights", "budget_bytes", "budget_bpw", "reachable_range",
    "check_reachable", "size_penalty", "min_cost_assignment",
]

Shapes = Mapping[str, Sequence[int]]


def shapes_of(specs) -> dict[str, tuple[int, int]]:
    """gguf_name -> (n_rows, n_per_row) from a mapping of shapes or TensorSpec-like objects
    (attributes or dict keys ``gguf_name`` and ``shape``)."""
    if isinstance(specs, Mapping):
        return {k: (int(v[0]), int(v[1])) for k, v in specs.items()}
    out = {}
    for s in specs:
        name = s["gguf_name"] if isinstance(s, Mapping) else s.gguf_name
        shape = s["shape"] if isinstance(s, Mapping) else s.shape
        out[name] = (int(shape[0]), int(shape[1]))
    return out


def q8_0_bytes(shapes) -> int:
    """Bytes of all selectable tensors at Q8_0 (via :func:`voodoo.quants.tensor_nbytes`)."""
    return sum(tensor_nbytes("Q8_0", r, c) for r, c in shapes_of(shapes).values())


def n_weights(shapes) -> int:
    """Number of weights in all selectable tensors."""
    return sum(r * c for r, c in shapes_of(shapes).values())


def budget_bytes(shapes, compression_ratio: float | None = None,
                 target_bits: float | None = None, budget_reduction: float = 0.0) -> int:
    """The budget B in bytes (rounded down) over the selectable tensors ``shapes``.

    Exactly one of ``compression_ratio`` (fraction of the Q8_0 size, e.g. 0.5) or
    ``target_bits`` (bits per weight, e.g. 4.25) must be given; ``budget_reduction`` in [0, 1)
    is taken off either. Raises ValueError otherwise or for non-positive values.
    """
    if (compression_ratio is None) == (target_bits is None):
        raise ValueError("give exactly one of compression_ratio and target_bits")
    if not 0.0 <= budget_reduction < 1.0:
        raise ValueError(f"budget_reduction must be in [0, 1), got {budget_reduction}")
    if compression_ratio is not None:
        if compression_ratio <= 0:
            raise ValueError(f"compression_ratio must be positive, got {compression_ratio}")
        b = compression_ratio * q8_0_bytes(shapes)
    else:
        if target_bits <= 0:
            raise ValueError(f"target_bits must be positive, got {target_bits}")
        b = target_bits * n_weights(shapes) / 8.0
    return int(b * (1.0 - budget_reduction))


def budget_bpw(budget: float, shapes) -> float:
    """A budget in bytes as bits per weight over the selectable tensors."""
    return 8.0 * budget / n_weights(shapes)


def reachable_range(bytes_table: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(min, max) total bytes reachable by choosing one menu entry per tensor."""
    return (sum(min(b) for b in bytes_table.values()),
            sum(max(b) for b in bytes_table.values()))


def check_reachable(budget: float, bytes_table: Mapping[str, Sequence[int]], shapes) -> None:
    """Raises ValueError if ``budget`` (bytes) is outside the reachable range of the menus,
    stating the range in bytes and as compression ratios of Q8_0."""
    lo, hi = reachable_range(bytes_table)
    if lo <= budget <= hi:
        return
    q8 = q8_0_bytes(shapes)
    bpw = 8.0 / n_weights(shapes)
    fixed = [n for n, b in bytes_table.items() if len(set(b)) == 1]
    if len(fixed) == len(bytes_table):
        odd = sorted({int(shapes[n][-1]) for n in fixed if int(shapes[n][-1]) % 32})
        raise ValueError(
            f"no selectable tensor of this model has a choice of size: each menu comes down to "
            f"one type ({hi} bytes in all, {hi * bpw:.3f} bpw)"
            + (f"; rows of {', '.join(map(str, odd))} weights are not a multiple of 32, so "
               "llama.cpp keeps those tensors F16 whatever type is asked for "
               "(tensor_type_fallback in src/llama-quant.cpp)" if odd else
               "; widen the menus (--candidate_types)")
            + ". There is nothing for Voodoo to choose")
    raise ValueError(
        f"budget {int(budget)} bytes ({budget / q8:.4f} x Q8_0, {budget * bpw:.3f} bpw) is "
        f"outside the reachable range of the menus: {lo}..{hi} bytes = compression ratio "
        f"{lo / q8:.4f}..{hi / q8:.4f} of Q8_0 ({q8} bytes) = {lo * bpw:.3f}..{hi * bpw:.3f} "
        f"bits per weight; choose a --size ({100 * lo / q8:.1f}..{100 * hi / q8:.1f}), "
        "--compression_ratio or --target_bits in that range"
        + (f" (the menus of {len(fixed)} of the {len(bytes_table)} tensors come down to one "
           "type, e.g. F16 for rows that are not a multiple of 32)" if fixed else
           " or widen the menus"))


def size_penalty(size, budget: float, tolerance: float, weight: float):
    """Dead-zone quadratic penalty on the relative size error ``r = size / budget - 1``::

        0                              if |r| <= tolerance
        weight * (|r| - tolerance)**2  otherwise

    ``size`` in bytes: a float or a (differentiable) tensor, returned as the same kind.
    Penalises both over and under budget (being under wastes bits the model could use).
    Raises ValueError for budget <= 0 or negative tolerance/weight.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    if tolerance < 0 or weight < 0:
        raise ValueError(f"tolerance and weight must be >= 0, got {tolerance}, {weight}")
    r = (size - budget) / budget
    if isinstance(r, torch.Tensor):
        return weight * torch.clamp(r.abs() - tolerance, min=0.0) ** 2
    return weight * max(abs(r) - tolerance, 0.0) ** 2


def min_cost_assignment(cost: Mapping[str, Sequence[float]], nbytes: Mapping[str, Sequence[int]],
                        lower: float, upper: float,
                        allowed: Mapping[str, tuple[int, int]] | None = None,
                        resolution: int = 200_000) -> dict[str, int] | None:
    """The multiple-choice knapsack, solved by dynamic programming over bytes: one index per
    tensor minimising ``sum_t cost[t][k_t]`` with ``lower <= sum_t nbytes[t][k_t] <= upper``.

    Args:
        cost: name -> K floats (any sign). nbytes: name -> K sizes in bytes.
        allowed: name -> (first, last) index range to choose from (default: all).
        resolution: sizes are counted in units of ``ceil(upper / resolution)`` bytes, rounded
            up, so the true total never exceeds ``upper``; when a unit is more than a byte the
            lower end is raised by one unit per tensor so the true total never falls below
            ``lower`` either. Optimal up to that rounding (``n_tensors / resolution`` of the
            budget at most). Memory ``n_tensors * resolution`` int16, time about 1 s for 200
            tensors of K <= 10.

    Returns {name: index}, or None when nothing fits the window at this resolution."""
    import math

    import numpy as np
    names = sorted(cost)
    unit = max(1, math.ceil(upper / resolution))
    cap = int(upper // unit)
    u_min = max(0, math.ceil(lower / unit) + (len(names) if unit > 1 and lower > 0 else 0))
    if u_min > cap:
        return None
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = np.full((len(names), cap + 1), -1, dtype=np.int16)
    for i, n in enumerate(names):
        first, last = allowed[n] if allowed is not None else (0, len(cost[n]) - 1)
        new = np.full(cap + 1, np.inf)
        arg = np.full(cap + 1, -1, dtype=np.int16)
        for k in range(first, last + 1):
            w = -(-int(nbytes[n][k]) // unit)
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[: cap + 1 - w] + float(cost[n][k])
            better = cand < new
            new[better] = cand[better]
            arg[better] = k
        best, picks[i] = new, arg
    window = best[u_min:]
    if not np.isfinite(window).any():
        return None
    end = u_min + int(np.argmin(window))
    out = {}
    for i in range(len(names) - 1, -1, -1):
        k = int(picks[i, end])
        out[names[i]] = k
        end -= -(-int(nbytes[names[i]][k]) // unit)
    total = sum(int(nbytes[n][out[n]]) for n in names)
    return out if lower <= total <= upper else None
