"""Menus and llama.cpp's imatrix rules: a type a tensor cannot have without an imatrix row is
never offered to a tensor the imatrix does not cover (an untied token_embd, read only by
get_rows), and the rule is the one cython_ggml (libggml + llama-quantize) applies."""

from __future__ import annotations

import numpy as np
import pytest

import cython_ggml as cg
from voodoo import quants
from voodoo.quants import TYPES, imatrix_safe_menus, requires_imatrix

NAMES = ["token_embd.weight", "output.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight"]


@pytest.mark.parametrize("name", NAMES)
def test_requires_imatrix_agrees_with_cython_ggml(name):
    """quants.requires_imatrix (no libggml needed) = cython_ggml.requires_imatrix (libggml's
    ggml_quantize_requires_imatrix + llama-quantize's tensor_requires_imatrix) for every type."""
    for t in TYPES:
        if t in ("F32", "F16", "BF16"):
            continue
        assert requires_imatrix(t, name) == cg.requires_imatrix(t, name), (t, name)
    assert requires_imatrix("IQ2_XXS", "token_embd.weight")      # libggml aborts without one
    assert not requires_imatrix("IQ3_XXS", "token_embd.weight")  # llama-quantize exempts it
    assert requires_imatrix("IQ3_XXS", "blk.0.ffn_down.weight")


def test_libggml_aborts_where_the_rule_says():
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    for t in sorted(quants.GGML_IMATRIX_REQUIRED):
        with pytest.raises(ValueError, match="importance matrix"):
            cg.quantize(w, t, tensor_name="token_embd.weight")
        cg.quantize(w, t, imatrix=np.ones(256, np.float32), tensor_name="token_embd.weight")


def test_imatrix_safe_menus():
    menus = {"token_embd.weight": ["Q8_0", "Q4_K", "IQ3_XXS", "IQ2_XXS", "IQ1_S"],
             "output.weight": ["Q8_0", "IQ2_XXS"],
             "blk.0.ffn_down.weight": ["Q8_0", "IQ3_XXS", "IQ2_XXS"],
             "blk.0.ffn_up.weight": ["IQ2_XXS", "IQ1_S"]}
    im = {"output.weight": np.ones(256, np.float32),
          "blk.0.ffn_down.weight": np.ones(256, np.float32)}
    out, dropped = imatrix_safe_menus(menus, im)
    assert out["token_embd.weight"] == ["Q8_0", "Q4_K", "IQ3_XXS"]
    assert out["output.weight"] == menus["output.weight"]            # it has a row
    assert out["blk.0.ffn_down.weight"] == menus["blk.0.ffn_down.weight"]
    assert out["blk.0.ffn_up.weight"] == menus["blk.0.ffn_up.weight"]  # would be empty: kept
    assert dropped == {"token_embd.weight": ["IQ2_XXS", "IQ1_S"]}
    out, dropped = imatrix_safe_menus(menus, None)                    # no imatrix at all
    assert out["blk.0.ffn_down.weight"] == ["Q8_0"] and out["output.weight"] == ["Q8_0"]


def test_a_misspelt_type_name_gets_the_near_one():
    """``iq4xs`` or ``Q4-K`` (the same letters without, or with other, separators) are named
    with the type meant; any case is accepted as it is; a type that is no near spelling of one
    gets the list only."""
    import pytest

    from voodoo.quants import qtype
    assert qtype("q4_k").name == "Q4_K"
    for typo, meant in (("iq4xs", "IQ4_XS"), ("Q4-K", "Q4_K"), ("iq2 xxs", "IQ2_XXS")):
        with pytest.raises(ValueError, match=rf"did you mean {meant}\?"):
            qtype(typo)
    with pytest.raises(ValueError) as ei:
        qtype("Q9_K")
    assert "did you mean" not in str(ei.value) and "supported: " in str(ei.value)
