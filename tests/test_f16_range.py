"""Weights beyond float16's range (issue 13, item 5): a tensor whose row length forces
llama.cpp's F16 fallback (172-wide ``ffn_down``) with a 7e4 weight is kept in BF16 (same size;
``=bf16`` in the tensor-type file, so llama-quantize reproduces it byte for byte), and the run
says so; libggml's raw "fails ggml_validate_row_data" error is reworded to name the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_pipeline import run_cli

SMALL = ["--seq_len", "64", "--n_train_blocks", "8", "--n_eval_blocks", "2",
         "--imatrix_blocks", "4", "--no_ray", "--max_steps", "1"]
NAME = "blk.0.ffn_down.weight"


def test_quantize_candidate_names_the_tensor():
    from voodoo.candidates import quantize_candidate
    from voodoo.quants import range_safe_menu
    w = np.random.default_rng(0).standard_normal((4, 172)).astype(np.float32)
    w[1, 3] = 7e4
    with pytest.raises(ValueError, match=rf"{NAME}: weights up to 70000 exceed float16's range.*"
                                         r"BF16"):
        quantize_candidate(w, "F16", None, NAME)
    assert quantize_candidate(w, "BF16", None, NAME).shape == (4, 344)
    assert range_safe_menu(["F16"], 7e4) == ["BF16"]
    assert range_safe_menu(["BF16", "F16"], 7e4) == ["BF16"]
    assert range_safe_menu(["F16"], 6e4) == ["F16"]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from safetensors.torch import load_file, save_file

    from voodoo.models import make_tiny_model
    d = make_tiny_model(tmp_path_factory.mktemp("f16") / "tiny-llama-172", seed=0,
                        intermediate_size=172)
    (f,) = d.glob("*.safetensors")
    sd = load_file(f)
    sd["model.layers.0.mlp.down_proj.weight"][5, 7] = 7e4
    save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
    return d


def test_run_keeps_the_tensor_in_bf16(wide_model, tmp_path):
    from voodoo.ggufio import read_gguf

    from voodoo.export import quantize_with_llama
    from voodoo.models import prepare_model
    out = tmp_path / "run"
    # llama-quantize's own bytes, so that the tensor-type file reproduces the whole file
    rc, so, se = run_cli(["train", "--model", str(wide_model), "--output_dir", str(out),
                          *SMALL, "--rounding", "ggml"])
    assert rc == 0, se[-3000:]
    assert f"{NAME}: weights up to 70000 exceed float16's range" in se and "BF16" in se, se
    (asg,) = out.glob("*.assignment.json")
    a = json.loads(asg.read_text())
    assert a["tensors"][NAME]["type"] == "BF16" and a["tensors"][NAME]["menu"] == ["BF16"]
    rc, so, se = run_cli(["export", "--model", str(wide_model), "--output_dir", str(out),
                          "--assignment", str(asg), "--no_ray"])
    assert rc == 0, se[-3000:]
    (gguf,) = [p for p in out.glob("*.gguf") if p.name != "imatrix.gguf"]
    tt = gguf.with_suffix(".tensor-types.txt")
    (line,) = [ln for ln in tt.read_text().splitlines() if "blk\\.0\\.ffn_down" in ln]
    assert line.endswith("=bf16"), line
    base = prepare_model(wide_model).base_gguf
    ref = quantize_with_llama(base, tmp_path / "ref.gguf", tensor_type_file=tt,
                              imatrix_file=out / "imatrix.gguf", default_type="Q8_0")
    mine = {t.name: t for t in read_gguf(str(gguf)).tensors}
    theirs = {t.name: t for t in read_gguf(str(ref)).tensors}
    assert mine[NAME].tensor_type.name == theirs[NAME].tensor_type.name == "BF16"
    assert np.asarray(mine[NAME].data).tobytes() == np.asarray(theirs[NAME].data).tobytes()
    for n, t in mine.items():  # the whole file, as test_pipeline checks it
        assert np.asarray(t.data).tobytes() == np.asarray(theirs[n].data).tobytes(), n
