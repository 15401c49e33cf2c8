"""voodoo.budget: budgets in bytes, the dead-zone penalty, the reachable range."""

from types import SimpleNamespace

import pytest
import torch

from voodoo.budget import (budget_bpw, budget_bytes, check_reachable, n_weights, q8_0_bytes,
                           reachable_range, shapes_of, size_penalty)
from voodoo.quants import tensor_nbytes

SHAPES = {"blk.0.attn_q.weight": (256, 256), "blk.0.ffn_down.weight": (256, 512),
          "token_embd.weight": (1000, 256)}


def test_q8_0_bytes_and_weights():
    # Q8_0: 34 bytes per 32 weights.
    assert q8_0_bytes(SHAPES) == (256 * 256 + 256 * 512 + 1000 * 256) // 32 * 34
    assert q8_0_bytes(SHAPES) == sum(tensor_nbytes("Q8_0", *s) for s in SHAPES.values())
    assert n_weights(SHAPES) == 256 * 256 + 256 * 512 + 1000 * 256
    specs = [SimpleNamespace(gguf_name=n, shape=s) for n, s in SHAPES.items()]
    assert shapes_of(specs) == SHAPES


def test_budget_from_ratio_and_bits():
    q8 = q8_0_bytes(SHAPES)
    assert budget_bytes(SHAPES, compression_ratio=0.5) == int(0.5 * q8)
    got = budget_bytes(SHAPES, compression_ratio=0.5, budget_reduction=0.02)
    assert got == int(0.5 * q8 * 0.98)
    n = n_weights(SHAPES)
    assert budget_bytes(SHAPES, target_bits=4.0) == n // 2
    assert budget_bpw(n // 2, SHAPES) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="exactly one"):
        budget_bytes(SHAPES)
    with pytest.raises(ValueError, match="exactly one"):
        budget_bytes(SHAPES, 0.5, 4.0)
    with pytest.raises(ValueError, match="budget_reduction"):
        budget_bytes(SHAPES, 0.5, budget_reduction=1.0)


def test_size_penalty_dead_zone_and_quadratic():
    assert size_penalty(1000.0, 1000.0, 0.01, 10.0) == 0.0
    assert size_penalty(1010.0, 1000.0, 0.01, 10.0) == 0.0
    assert size_penalty(990.0, 1000.0, 0.01, 10.0) == 0.0
    assert size_penalty(1030.0, 1000.0, 0.01, 10.0) == pytest.approx(10 * 0.02 ** 2)
    assert size_penalty(950.0, 1000.0, 0.01, 10.0) == pytest.approx(10 * 0.04 ** 2)
    # Quadratic: doubling the excess quadruples it.
    a = size_penalty(1000 * (1.01 + 0.05), 1000.0, 0.01, 3.0)
    b = size_penalty(1000 * (1.01 + 0.10), 1000.0, 0.01, 3.0)
    assert b / a == pytest.approx(4.0)
    # Tensor version: same value, gradient 2 w (r - tol) / B outside, 0 inside.
    s = torch.tensor(1030.0, dtype=torch.float64, requires_grad=True)
    p = size_penalty(s, 1000.0, 0.01, 10.0)
    p.backward()
    assert p.item() == pytest.approx(0.004)
    assert s.grad.item() == pytest.approx(2 * 10 * 0.02 / 1000)
    s = torch.tensor(1005.0, requires_grad=True)
    size_penalty(s, 1000.0, 0.01, 10.0).backward()
    assert s.grad.item() == 0.0
    with pytest.raises(ValueError):
        size_penalty(1.0, 0.0, 0.01, 1.0)


def test_reachable_range_check():
    table = {n: [tensor_nbytes(t, *s) for t in ("Q8_0", "Q4_0")] for n, s in SHAPES.items()}
    lo, hi = reachable_range(table)
    assert hi == q8_0_bytes(SHAPES)
    assert lo == sum(tensor_nbytes("Q4_0", *s) for s in SHAPES.values())
    check_reachable(lo, table, SHAPES)
    check_reachable(hi, table, SHAPES)
    with pytest.raises(ValueError, match=r"compression ratio 0\.5294\.\.1\.0000 of Q8_0"):
        check_reachable(lo - 1, table, SHAPES)
    with pytest.raises(ValueError, match="outside the reachable range"):
        check_reachable(hi * 1.1, table, SHAPES)
    # and as Voodoo sizes, for --size users
    with pytest.raises(ValueError, match=r"choose a --size \(52\.9\.\.100\.0\)"):
        check_reachable(lo - 1, table, SHAPES)
    # the same range in bits per weight (Q4_0 4.5 .. Q8_0 8.5), for --target_bits users
    with pytest.raises(ValueError, match=r"= 4\.500\.\.8\.500 bits per weight"):
        check_reachable(lo - 1, table, SHAPES)


def test_menus_without_a_choice_say_why():
    """Rows that are not a multiple of 32 (hidden 80): llama.cpp keeps the tensors F16, every
    menu is one type, and the message said "widen the menus" about a "Q8_0" size that was
    F16's."""
    from voodoo.budget import check_reachable
    shapes = {"a": (80, 80), "b": (160, 80)}
    table = {"a": [80 * 80 * 2], "b": [160 * 80 * 2]}
    with pytest.raises(ValueError, match=r"nothing for Voodoo to choose") as e:
        check_reachable(1000, table, shapes)
    assert "rows of 80 weights are not a multiple of 32" in str(e.value)
    assert "widen the menus" not in str(e.value)
    # one tensor without a choice among others: the range, and what holds it
    shapes["c"] = (64, 64)
    table["c"] = [64 * 68, 64 * 36]
    with pytest.raises(ValueError, match=r"menus of 2 of the 3 tensors come down to one type"):
        check_reachable(1000, table, shapes)
