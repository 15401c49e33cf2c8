"""``voodoo make-teacher`` and ``--base_checkpoint`` on the tiny model: the BF16 checkpoint holds
the base weights rounded to bfloat16, the Q8_0 teacher holds libggml's Q8_0 of the base F32
GGUF dequantized (computed here from the GGUF, not from the torch model the command used), and
``--base_checkpoint`` loads a checkpoint into the model or refuses one that lacks weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import cython_ggml as cg
from voodoo import cli
from voodoo.ggufio import read_gguf
from voodoo.models import ModelPreparationError, load_hf_model
from voodoo.pipeline import load_base_checkpoint, load_context


@pytest.fixture(scope="module")
def teacher_dirs(tiny_prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("make-teacher")
    rc = cli.main(["make-teacher", "--model", str(tiny_prepared.hf_dir), "--output_dir",
                   str(out)])
    assert rc == 0
    return out / "teacher" / "bf16", out / "teacher" / "q8_0"


def _gguf_layout(ctx, model, spec):
    params = dict(model.named_parameters(remove_duplicate=True))
    return ctx.tmap.to_gguf(spec.gguf_name, {n: params[n].detach().float()
                                             for n in spec.params}).numpy()


def test_make_teacher_writes_bf16_base_and_libggml_q8_0_teacher(tiny_prepared, teacher_dirs):
    bf16_dir, q8_dir = teacher_dirs
    ctx = load_context(tiny_prepared.hf_dir, with_tokenizer=False)
    base = {t.name: np.asarray(t.data) for t in read_gguf(tiny_prepared.base_gguf).tensors}
    bf16 = load_hf_model(bf16_dir, dtype=torch.bfloat16)
    q8 = load_hf_model(q8_dir)
    assert (bf16_dir / "tokenizer_config.json").is_file() and (q8_dir / "config.json").is_file()
    assert ctx.specs
    for s in ctx.specs:
        w = base[s.gguf_name].reshape(s.shape).astype(np.float32)
        want_bf16 = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(_gguf_layout(ctx, bf16, s), want_bf16, err_msg=s.gguf_name)
        want_q8 = cg.dequantize(cg.quantize(np.ascontiguousarray(w), "Q8_0"), "Q8_0",
                                s.n_per_row).reshape(s.shape)
        got = _gguf_layout(ctx, q8, s)
        np.testing.assert_array_equal(got, want_q8, err_msg=s.gguf_name)
        assert not np.array_equal(got, w), s.gguf_name   # Q8_0 rounds random weights


def test_base_checkpoint_loads_and_one_lacking_a_weight_is_refused(tiny_prepared, teacher_dirs,
                                                                  tmp_path):
    bf16_dir, _ = teacher_dirs
    ctx = load_context(tiny_prepared.hf_dir, with_tokenizer=False)
    load_base_checkpoint(ctx, bf16_dir)
    ref = load_hf_model(bf16_dir)
    for (k, v), (k2, v2) in zip(ctx.model.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    part = tmp_path / "partial"
    shutil.copytree(bf16_dir, part)
    from safetensors.torch import load_file, save_file
    f = next(part.glob("*.safetensors"))
    sd = load_file(str(f))
    gone = sorted(k for k in sd if k.endswith("self_attn.q_proj.weight"))[0]
    del sd[gone]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelPreparationError, match=rf"--base_checkpoint {part} lacks 1 of the "
                       rf"model's weights \({gone}\)"):
        load_base_checkpoint(ctx, part)
