"""The default candidate bytes (``--rounding`` not given): ``auto`` where it can score and its
input Hessians fit, else llama-quantize's own bytes with a line saying why
(``voodoo.cli._default_rounding``)."""

from __future__ import annotations

import argparse

import pytest
import torch


def _specs(layers, n_embd, n_ff):
    from voodoo.tensormap import MapEntry
    out = [MapEntry("token_embd.weight", (32000, n_embd), [])]
    for i in range(layers):
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)),
                            ("attn_v", (n_embd, n_embd)), ("attn_output", (n_embd, n_embd)),
                            ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)),
                            ("ffn_down", (n_embd, n_ff))):
            out.append(MapEntry(f"blk.{i}.{name}.weight", shape, []))
    out.append(MapEntry("blk.0.ffn_down_exps.weight", (8, n_embd, n_ff), []))  # no Hessian
    return out


def test_default_is_auto_for_a_small_model_and_given_flags_win(capsys):
    from voodoo.cli import UsageError, _default_rounding
    small = _specs(2, 256, 512)
    a = argparse.Namespace(rounding=None, n_eval_blocks=8)
    _default_rounding(a, small)
    assert a.rounding == "auto"
    assert "candidate bytes: --rounding auto (the default)" in capsys.readouterr().err
    for given, n_eval in (("ggml", 0), ("gptq", 0), ("auto", 8)):
        a = argparse.Namespace(rounding=given, n_eval_blocks=n_eval)
        _default_rounding(a, _specs(32, 4096, 11008))
        assert a.rounding == given
    assert capsys.readouterr().err == ""
    # asked for auto with nothing to score on: refused here, before any stage
    with pytest.raises(UsageError, match="--n_eval_blocks 0"):
        _default_rounding(argparse.Namespace(rounding="auto", n_eval_blocks=0), small)


def test_no_eval_blocks_or_too_large_falls_back_to_ggml_with_a_line(capsys):
    from voodoo.cli import _default_rounding, hessian_bytes
    a = argparse.Namespace(rounding=None, n_eval_blocks=0)
    _default_rounding(a, _specs(2, 256, 512))
    err = capsys.readouterr().err
    assert a.rounding == "ggml" and "has none" in err and "--n_eval_blocks" in err
    # a 7B-shaped model: its two sets of Hessians exceed a quarter of any machine this runs on
    big = _specs(32, 4096, 11008)
    ram = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    if 2 * hessian_bytes(big) <= ram // 4:
        pytest.skip(f"this machine has {ram / 2**30:.0f} GiB: a 7B's Hessians fit")
    a = argparse.Namespace(rounding=None, n_eval_blocks=8)
    _default_rounding(a, big)
    err = capsys.readouterr().err
    assert a.rounding == "ggml" and "GiB of input Hessians" in err and "--rounding auto" in err


def test_hessian_bytes_bounds_what_compute_hessians_holds():
    """On a real (tiny) model: the bound is at least the float64 bytes of the distinct inputs
    compute_hessians accumulates, and less than 3x them (q/k/v and gate/up share inputs)."""
    from voodoo.cli import hessian_bytes
    from voodoo.imatrix import compute_hessians
    from voodoo.models import cache_root, make_tiny_model
    from voodoo.pipeline import _linear_name_map, load_context
    ctx = load_context(make_tiny_model(cache_root() / "test-models" / "tiny-llama-s0", seed=0))
    blocks = torch.randint(0, ctx.model.config.vocab_size, (2, 16), generator=torch.Generator()
                           .manual_seed(0))
    hs = compute_hessians(ctx.model, blocks, dict(_linear_name_map(ctx, partial=True)))
    distinct = {id(h): h for h in hs.values()}.values()
    real = sum(8 * h.shape[0] ** 2 for h in distinct)
    bound = hessian_bytes(ctx.specs)
    assert real <= bound < 3 * real, (real, bound)
