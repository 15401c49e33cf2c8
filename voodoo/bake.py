"""Baking: trained gate logits -> one ggml type per tensor, within the size budget.

Three steps, all deterministic:

1. **argmax** of each tensor's gate.
2. **guardrails** (``--tensor_upgrades``): a JSON list of ``{"pattern": regex, "levels": int}``.
   Every tensor whose GGUF name matches ``pattern`` (``re.search``) moves ``levels`` rungs up
   its own menu (positive: more bits) or down (negative) from its argmax type, clamped to the
   menu's ends. Where several rules match a tensor, the last one decides (``[{"pattern":
   "attn", "levels": 1}, {"pattern": "attn_v", "levels": -1}]``: every attention tensor one
   rung up, attn_v one down). The rung a rule leaves a tensor on becomes a *guardrail*: an
   upgraded tensor is not moved below it, a downgraded one not above it, by the repair step --
   unless the budget cannot be met otherwise.
3. **repair** to the budget, when the argmax total is outside ``budget * (1 -/+ tolerance)``.
   Over it: the assignment of largest total gate log-probability inside that window, found
   exactly by dynamic programming over bytes (a multiple-choice knapsack; sizes in units of
   about budget/200,000 bytes, rounded so the true total stays inside) among the types each
   gate finds plausible (probability at least :data:`PLAUSIBLE`, or its argmax), within the
   guardrails; where none lands there, the most probable assignment under the upper end, within
   the guardrails, then without them (a warning names every tensor whose guardrail gave way).
   Under the window (from the argmax, or after that): the most probable **upgrades only** (every
   tensor at its rung or above, within the guardrails) that land inside it: more bytes never
   cost a tensor bits. Where none lands there the file stays under, with a warning, and the fill
   (4) spends what it can. (Landing inside the window at any price, the old rule, promoted a big
   tensor of a tiny model and paid with types of p ~ 0 everywhere else: 6-9x the KLD of the
   argmax file, found by a tester on ministral3 and an IQ4_XS-born llama. With many tensors
   the most probable total under the upper end lies inside the window anyway.) A greedy repair
   remains as the fallback for windows too narrow for that resolution: while over, the move down
   with the smallest drop in log-probability per byte saved; while under, the move up with the
   least loss per byte spent that stays under the upper end. Log-probabilities are
   ``log_softmax(logits / temperature)``. (The greedy alone, ranking per byte, demoted the
   largest tensor first whenever its logits were close, even when the trained gates clearly
   preferred keeping it.)

4. **fill** (only given ``fill_costs``, e.g. the Fisher prior's predicted KL per type): bytes
   still left under the budget are spent on the upgrades that lower the summed cost most
   (exact knapsack over the upgrades). At SmolLM2's IQ2_M and IQ2_XXS sizes the trained gates
   left 0.47% and 0.40% of the budget unused; spending it this way took the KLD from 0.0372 to
   0.0351 and from 0.0430 to 0.0419 (``docs/method.md``).

Stated tolerance: the total never exceeds ``budget * (1 + tolerance)`` (default 0.5%), and
lands at or above ``budget * (1 - tolerance)`` whenever the menus' granularity and the
guardrails allow (with many tensors it does; a model of a few tiny tensors may end slightly
lower, with a warning). With
``ceiling=True`` (``--match_size``: a file at or under a target) the window is
``[budget - tolerance * ceiling_ref, budget]`` instead: never over the budget.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Mapping, Sequence

import torch

from .budget import min_cost_assignment

__all__ = ["bake", "parse_tensor_upgrades", "DEFAULT_TOLERANCE"]

DEFAULT_TOLERANCE = 0.005
#: Over the budget, the repair lands inside the window only by moving tensors to types their
#: gates give at least this probability (module docstring, step 3)
PLAUSIBLE = 1e-3


def parse_tensor_upgrades(spec) -> list[tuple[re.Pattern, int]]:
    """Parses ``--tensor_upgrades``: None, JSON text, a path to a JSON file, or an already
    parsed list of ``{"pattern": str, "levels": int}``.

    Returns [(compiled regex, levels)]. Raises ValueError on malformed JSON, a non-list, an
    entry without exactly the keys ``pattern``/``levels``, a non-integer ``levels`` or an
    invalid regex, each with a message naming the entry."""
    if spec is None:
        return []
    if isinstance(spec, (str, bytes, os.PathLike)):
        text = spec
        if not isinstance(spec, bytes) and str(spec).strip() and os.path.isdir(spec):
            raise ValueError(f"--tensor_upgrades {spec}: a folder; give a JSON file or the "
                             "JSON text itself")
        if not isinstance(spec, bytes) and os.path.isfile(spec):
            with open(spec) as f:
                text = f.read()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            t = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            if t.strip().lower().endswith(".json") and not t.lstrip().startswith("["):
                raise ValueError(f"--tensor_upgrades {t.strip()}: no such file (give a JSON "
                                 "file or the JSON text itself)") from None
            raise ValueError(f"--tensor_upgrades is not valid JSON ({e}); expected a list like "
                             f'[{{"pattern": "ffn_down", "levels": 1}}]') from None
    if not isinstance(spec, list):
        raise ValueError(f"--tensor_upgrades must be a JSON list of "
                         f'{{"pattern": regex, "levels": int}}, got {type(spec).__name__}')
    rules = []
    for i, entry in enumerate(spec):
        if not isinstance(entry, Mapping) or set(entry) != {"pattern", "levels"}:
            raise ValueError(f"--tensor_upgrades entry {i} must be an object with exactly the "
                             f'keys "pattern" and "levels", got {entry!r}')
        pat, lev = entry["pattern"], entry["levels"]
        if not isinstance(pat, str):
            raise ValueError(f"--tensor_upgrades entry {i}: pattern must be a string, got {pat!r}")
        if isinstance(lev, bool) or not isinstance(lev, int):
            raise ValueError(f"--tensor_upgrades entry {i}: levels must be an integer, got {lev!r}")
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise ValueError(f"--tensor_upgrades entry {i}: bad regex {pat!r}: {e}") from None
        rules.append((rx, lev))
    return rules


def _type_name(t) -> str:
    return getattr(t, "name", t)


def bake(gate_logits: Mapping[str, Sequence[float] | torch.Tensor],
         menus: Mapping[str, Sequence], bytes_table: Mapping[str, Sequence[int]],
         budget: int, tensor_upgrades=None, tolerance: float = DEFAULT_TOLERANCE,
         temperature: float = 1.0, ceiling: bool = False, ceiling_ref: int | None = None,
         fill_costs: Mapping[str, Sequence[float]] | None = None, fill_margin: int = 0) -> dict:
    """Chooses one type per tensor (see the module docstring for the rule).

    Args:
        gate_logits: gguf_name -> K logits (menu order).
        menus: gguf_name -> K type names (or QuantType), most to fewest bits per weight.
        bytes_table: gguf_name -> K sizes in bytes (``voodoo.quants.tensor_nbytes``).
        budget: bytes, over these tensors.
        tensor_upgrades: see :func:`parse_tensor_upgrades`.
        tolerance: relative; the total ends at most ``budget * (1 + tolerance)``.
        temperature: for the reported probs and the log-probabilities the repair ranks by.
        ceiling: the budget is a hard ceiling: the window is ``[budget - tolerance *
            ceiling_ref, budget]`` (``ceiling_ref``: bytes the tolerance is a fraction of,
            default ``budget``; ``--match_size`` passes the target file's size so the file
            lands within ``tolerance`` of it, never over).
        fill_costs: gguf_name -> K predicted costs (menu order; e.g. the Fisher prior's KL in
            nats/token). When given and the total is under ``budget - fill_margin``, the bytes
            left are spent (step 4 of the module docstring) on the upgrades that lower the
            summed cost most, never over ``budget - fill_margin`` and never above a
            downgrade guardrail.
        fill_margin: bytes kept free by step 4 (e.g. for GGUF padding and metadata).

    Returns the assignment (``docs/contracts.md``)::

        {"budget_bytes": int, "total_bytes": int,
         "tensors": {gguf_name: {"type": str, "bytes": int, "menu": [str], "probs": [float]}}}

    Raises ValueError if the inputs disagree (names, lengths), a logit is NaN, an upgrade rule
    is malformed or matches no tensor, or even the smallest type of every tensor exceeds
    ``budget * (1 + tolerance)``.
    """
    names = sorted(gate_logits)
    if set(names) != set(menus) or set(names) != set(bytes_table):
        raise ValueError("gate_logits, menus and bytes_table must name the same tensors")
    if budget <= 0 or tolerance < 0:
        raise ValueError(f"need budget > 0 and tolerance >= 0, got {budget}, {tolerance}")
    lp, probs, nb, menu = {}, {}, {}, {}
    for n in names:
        z = torch.as_tensor(gate_logits[n], dtype=torch.float64).flatten() / temperature
        menu[n] = [_type_name(t) for t in menus[n]]
        nb[n] = [int(b) for b in bytes_table[n]]
        if not (len(z) == len(menu[n]) == len(nb[n])) or len(z) == 0:
            raise ValueError(f"{n}: {len(z)} logits, {len(menu[n])} menu types and "
                             f"{len(nb[n])} sizes; they must match and be non-empty")
        if torch.isnan(z).any():
            raise ValueError(f"{n}: gate logits contain NaN ({z.tolist()}); the training "
                             f"diverged -- rerun with a fresh output directory, a smaller "
                             f"--lr or a finite --gate_init_strength")
        lp[n] = torch.log_softmax(z, 0).tolist()
        probs[n] = torch.softmax(z, 0).tolist()

    # 1. argmax (first maximum on ties: the type with more bits).
    cur = {n: max(range(len(lp[n])), key=lambda k: (lp[n][k], -k)) for n in names}

    # 2. guardrails. lo/hi: allowed index range during repair (0 = most bits).
    lo = {n: 0 for n in names}
    hi = {n: len(menu[n]) - 1 for n in names}
    argmax, rule, which = dict(cur), {}, {}
    rules = parse_tensor_upgrades(tensor_upgrades)
    for i, (rx, lev) in enumerate(rules):
        hit = [n for n in names if rx.search(n)]
        if not hit:
            raise ValueError(f"--tensor_upgrades pattern {rx.pattern!r} matches no tensor "
                             f"(names look like {names[0]!r})")
        for n in hit:   # the last rule that matches a tensor decides, counted from its argmax
            rule[n], which[n] = lev, i
    for n, lev in rule.items():
        cur[n] = min(max(argmax[n] - lev, 0), len(menu[n]) - 1)
        if lev > 0:
            lo[n], hi[n] = 0, cur[n]
        elif lev < 0:
            lo[n], hi[n] = cur[n], len(menu[n]) - 1
    if rules:  # what each rule did (the repair may move the other tensors to pay for it)
        from .progress import log
        said = []
        for i, (rx, lev) in enumerate(rules):
            mine = [n for n in rule if which[n] == i]
            moved = sum(cur[n] != argmax[n] for n in mine)
            said.append(f"{rx.pattern!r} {lev:+d}: {moved} of {len(mine)} tensors moved"
                        + (f" ({len(mine) - moved} at the end of their menu)"
                           if moved < len(mine) and lev else ""))
        log(f"guardrails (--tensor_upgrades): {'; '.join(said)}; the repair keeps them and "
            "moves other tensors to stay within the budget")

    # 3. repair.
    if ceiling:
        upper = float(budget)
        lower = budget - tolerance * (ceiling_ref or budget)
    else:
        upper = budget * (1.0 + tolerance)
        lower = budget * (1.0 - tolerance)
    total = sum(nb[n][cur[n]] for n in names)
    full_lo = {n: 0 for n in names}
    full_hi = {n: len(menu[n]) - 1 for n in names}

    def moves_down(n, hi_):
        c = cur[n]
        for j in range(c + 1, hi_[n] + 1):
            saved = nb[n][c] - nb[n][j]
            if saved > 0:
                yield ((lp[n][c] - lp[n][j]) / saved, n, j, c)

    def moves_up(n, lo_):
        c = cur[n]
        for j in range(lo_[n], c):
            spent = nb[n][j] - nb[n][c]
            if spent > 0:
                yield (-(lp[n][j] - lp[n][c]) / spent, n, j, c)

    neg = {n: [-v for v in lp[n]] for n in names}
    if total > upper:
        # exact: the most probable assignment inside the window of types the gates find
        # plausible (p >= PLAUSIBLE, or the argmax), within the guardrails; else the most
        # probable one under the upper end, within the guardrails, else without them. Not
        # "inside the window at any price": with coarse steps that took types of p ~ 0
        # everywhere (module docstring)
        big = 1e30
        odd = {n: [v if probs[n][k] >= PLAUSIBLE or k == cur[n] else big
                   for k, v in enumerate(neg[n])] for n in names}
        for cost, lo_, hi_, floor in ((odd, lo, hi, lower), (neg, lo, hi, 0),
                                      (neg, full_lo, full_hi, 0)):
            got = min_cost_assignment(cost, nb, floor, upper,
                                      {n: (lo_[n], hi_[n]) for n in names})
            if got is not None and all(cost[n][got[n]] < big for n in names):
                cur = got
                total = sum(nb[n][cur[n]] for n in names)
                break
    if total < lower:
        # exact: the most probable upgrades (every tensor at its rung or above, within the
        # guardrails) that land inside the window; none: it stays under, with a warning
        got = min_cost_assignment(neg, nb, lower, upper,
                                  {n: (min(lo[n], cur[n]), cur[n]) for n in names})
        if got is not None:
            cur = got
            total = sum(nb[n][cur[n]] for n in names)

    for hi_ in (hi, full_hi):  # greedy fallback; guardrails first, dropped only if needed
        if total <= upper:
            break
        heap = [m for n in names for m in moves_down(n, hi_)]
        heapq.heapify(heap)
        while total > upper and heap:
            _, n, j, c = heapq.heappop(heap)
            if cur[n] != c:
                continue
            total += nb[n][j] - nb[n][c]
            cur[n] = j
            for m in moves_down(n, hi_):
                heapq.heappush(heap, m)
    if total > upper:
        lo_b = sum(min(nb[n]) for n in names)
        raise ValueError(f"budget {budget} bytes is unreachable: the smallest type of every "
                         f"tensor already totals {lo_b} bytes")

    for lo_ in (lo,):   # under: within the guardrails only (see above)
        if total >= lower:
            break
        heap = [m for n in names for m in moves_up(n, lo_)]
        heapq.heapify(heap)
        while total < lower and heap:
            _, n, j, c = heapq.heappop(heap)
            if cur[n] != c or total + nb[n][j] - nb[n][c] > upper:
                continue  # stale, or too big now (the slack only shrinks, so for good)
            total += nb[n][j] - nb[n][c]
            cur[n] = j
            for m in moves_up(n, lo_):
                heapq.heappush(heap, m)

    import warnings
    broken = [n for n in names if not lo[n] <= cur[n] <= hi[n]]
    guarded = [n for n in names if (lo[n] > 0 or hi[n] < len(menu[n]) - 1)
               and n not in broken]   # the guardrails actually kept
    if total < lower:
        big = max(names, key=lambda n: max(nb[n]))
        cap = total - sum(nb[n][cur[n]] for n in names) + sum(nb[n][lo[n]] for n in names)
        if guarded and cap < lower:  # every tensor at the largest type its guardrail allows
            why = (f"the --tensor_upgrades guardrails of {len(guarded)} tensor(s) cap the file "
                   f"at {cap} bytes, every tensor at the largest type they allow; ask for "
                   "fewer downgrade levels to use the budget")
        else:
            why = (f"steps are coarse; the largest tensor, {big}, moves in steps of up to "
                   f"{max(abs(a - b) for a, b in zip(nb[big], nb[big][1:]))} bytes")
            if guarded:
                why += (f"; the --tensor_upgrades guardrails of {len(guarded)} tensor(s) are "
                        "kept, and may be what holds it under")
        warnings.warn(f"bake: {total} bytes is {100 * (1 - total / budget):.2f}% under the "
                      f"budget of {budget}: no assignment of these menus lands closer without "
                      f"going over ({why})", stacklevel=2)
    if broken:
        def asks(n):
            return "at least " + menu[n][hi[n]] if cur[n] > hi[n] else "at most " + menu[n][lo[n]]
        warnings.warn(
            f"bake: --tensor_upgrades could not be kept within the budget of {budget} bytes "
            f"for {len(broken)} tensor(s): " + ", ".join(
                f"{n} {menu[n][cur[n]]} (the rule asks for {asks(n)})" for n in broken[:8])
            + (", ..." if len(broken) > 8 else "")
            + "; raise the budget or ask for fewer levels", stacklevel=2)

    # 4. fill: bytes left under the budget are spent where ``fill_costs`` says they lower the
    # predicted cost most (the exact knapsack over the upgrades, each tensor at its own rung
    # or above, within ``budget - fill_margin``).
    room = budget - fill_margin - total
    if fill_costs is not None and room > 0:
        cost = {n: [float(c) for c in fill_costs[n]] for n in names}
        if any(len(cost[n]) != len(nb[n]) for n in names):
            raise ValueError("fill_costs must give one cost per menu type of every tensor")
        inc = {n: [max(0, nb[n][k] - nb[n][cur[n]]) for k in range(len(nb[n]))] for n in names}
        got = min_cost_assignment(cost, inc, 0, room, {n: (min(lo[n], cur[n]), cur[n])
                                                       for n in names})
        if got is not None and sum(cost[n][got[n]] for n in names) < \
                sum(cost[n][cur[n]] for n in names):
            cur = got
            total = sum(nb[n][cur[n]] for n in names)

    tensors = {n: {"type": menu[n][cur[n]], "bytes": nb[n][cur[n]], "menu": menu[n],
                   "probs": [float(p) for p in probs[n]]} for n in names}
    assert total == sum(t["bytes"] for t in tensors.values())
    return {"budget_bytes": int(budget), "total_bytes": int(total), "tensors": tensors}
