"""The main job's pictures: the assignment grid (blocks x tensor kinds, any architecture's
names) and the size-vs-KLD plot, written as PNG files with the Agg backend."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from voodoo.evaluate import assignment_grid, plot_assignment, plot_size_vs_kld


def test_grid_from_any_names():
    types = {
        "token_embd.weight": "Q6_K",
        "blk.10.ffn_down_exps.weight": "IQ2_S",        # MoE experts: its own kind
        "blk.2.attn_qkv.weight": "Q8_0",               # fused QKV (phi, falcon, ...)
        "blk.2.ffn_down_exps.weight": "IQ3_S",
        "v.blk.0.attn_q.weight": "Q4_K",               # a prefixed tower keeps its prefix
        "output.weight": "Q5_K",
    }
    rows, cols, cells = assignment_grid(types)
    assert rows == ["blk.2", "blk.10", "v.blk.0", "outside blocks"]   # numeric order
    assert cols == ["ffn_down_exps", "attn_qkv", "attn_q", "token_embd", "output"]
    assert cells[("blk.10", "ffn_down_exps")] == "IQ2_S"
    assert cells[("v.blk.0", "attn_q")] == "Q4_K"
    assert cells[("outside blocks", "output")] == "Q5_K"
    assert ("blk.10", "attn_qkv") not in cells                        # a blank cell
    assert len(cells) == len(types)


def _assignment(n_layers):
    kinds = ["attn_q", "attn_k", "ffn_up", "ffn_down"]
    ts = ["Q8_0", "Q4_K", "IQ2_S"]
    a = {f"blk.{i}.{k}.weight": ts[(i + j) % 3] for i in range(n_layers)
         for j, k in enumerate(kinds)}
    a["token_embd.weight"] = "Q6_K"
    return {"tensors": {n: {"type": t} for n, t in a.items()}}


def test_plot_assignment_png(tmp_path):
    small = plot_assignment(_assignment(4), tmp_path / "a4.png", title="4 blocks")
    big = plot_assignment(_assignment(30), tmp_path / "a30.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a30.png", "a4.png"]  # no temp files
    im_s, im_b = Image.open(small), Image.open(big)
    assert im_s.format == "PNG" and im_b.format == "PNG"
    assert im_b.size[1] > im_s.size[1] * 2            # one row per block
    assert im_b.size[0] == im_s.size[0]               # same kinds, same width
    # the types' colours are in the picture: Q8_0 (light), IQ2_S (dark) differ widely
    px = np.asarray(im_b.convert("RGB")).reshape(-1, 3).astype(int)
    lum = px.mean(1)
    assert (lum < 90).mean() > 0.05 and (lum > 180).mean() > 0.05


def test_plot_size_vs_kld(tmp_path):
    rows = [{"file": "Voodoo", "name": "M.Voodoo55_Q4_K_S.gguf", "size_mib": 76.5,
             "kld": 0.0876},
            {"file": "stock IQ4_XS", "size_mib": 86.7, "kld": 0.1037},
            {"file": "stock IQ2_M", "size_mib": 81.6, "kld": 0.3039},
            {"file": "stock IQ2_XXS", "size_mib": 79.9, "kld": None}]   # left out
    p = plot_size_vs_kld(rows, tmp_path / "s.png", title="t")
    assert Image.open(p).format == "PNG" and p.stat().st_size > 5000
    with pytest.raises(ValueError, match="no row with both size_mib and kld"):
        plot_size_vs_kld([{"file": "x", "size_mib": 1.0, "kld": None}], tmp_path / "e.png")
    assert not (tmp_path / "e.png").exists()


def test_voodoo_run_writes_both_next_to_the_report(tmp_path):
    """runner.write_pictures (called by compare_with_stock after report.{json,md})."""
    from types import SimpleNamespace

    from voodoo.runner import write_pictures
    r = SimpleNamespace(stem="M.Voodoo55_Q4_K_S", assignment=_assignment(3),
                        ctx=SimpleNamespace(prepared=SimpleNamespace(name="M")),
                        a=SimpleNamespace(ctx=512, chunks=8))
    rows = [{"file": "Voodoo", "size_mib": 1.0, "kld": 0.1},
            {"file": "stock IQ4_XS", "size_mib": 1.2, "kld": 0.2}]
    paths = write_pictures(r, rows, tmp_path / "eval")
    assert [p.name for p in paths] == ["assignment.png", "size_vs_kld.png"]
    assert all(Image.open(p).format == "PNG" for p in paths)
