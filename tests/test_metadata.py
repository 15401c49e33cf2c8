"""The exported GGUF's own metadata: ``general.file_type`` is the badge in the file name
(``…Voodoo55_Q4_K_S.gguf`` -> MOSTLY_Q4_K_S), and ``voodoo.model`` holds the model's name and
content hash, never a local path, and leads back to the model on this machine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import LlamaFileType
from voodoo.ggufio import read_gguf

import cython_ggml
from voodoo.export import (badge_file_type, export_gguf, find_model, find_reference,
                           gguf_model_id, model_id, output_name, parse_model_id)
from voodoo.quants import FTYPE_NOMINAL_BPW, nearest_ftype, tensor_nbytes


def test_every_badge_is_a_llama_file_type():
    for badge in FTYPE_NOMINAL_BPW:
        ft = LlamaFileType(badge_file_type(badge))
        assert ft.name == "MOSTLY_" + badge
    assert badge_file_type("Q4_K_S") == int(LlamaFileType.MOSTLY_Q4_K_S) == 14
    assert badge_file_type("IQ4_NL") == 25
    with pytest.raises(ValueError, match="not a llama.cpp file type"):
        badge_file_type("Q4_K")          # a ggml type, not a file type


def test_model_id_round_trip():
    sha = "ab" * 32
    assert model_id("SmolLM2-135M-Instruct", sha) == f"SmolLM2-135M-Instruct@sha256:{sha}"
    assert parse_model_id(model_id("a@b", sha)) == ("a@b", sha)
    assert parse_model_id("/home/u/.cache/voodoo/models/x/hf") == \
        ("/home/u/.cache/voodoo/models/x/hf", None)
    with pytest.raises(ValueError, match="sha256"):
        model_id("m", "/not/a/hash")


def _q(base, name, t):
    tensors = {x.name: x for x in read_gguf(base).tensors}
    w = np.ascontiguousarray(np.asarray(tensors[name].data, dtype=np.float32))
    return cython_ggml.quantize(w, t, None, tensor_name=name)


@pytest.mark.parametrize("mix", ["Q8_0", "mixed"])
def test_file_type_is_the_name_badge(tiny_prepared, tmp_path, mix):
    """The stem as the CLI makes it (bpw of the selectable tensors -> badge) and the file's
    general.file_type name the same llama.cpp file type."""
    base = tiny_prepared.base_gguf
    mats = [t for t in read_gguf(base).tensors if len(t.shape) == 2]
    types = {t.name: ("Q8_0" if mix == "Q8_0" or i % 2 else "Q4_K") for i, t in
             enumerate(mats)}
    n = sum(int(t.shape[0]) * int(t.shape[1]) for t in mats)
    total = sum(tensor_nbytes(types[t.name], int(t.shape[1]), int(t.shape[0])) for t in mats)
    bpw = 8 * total / n
    name = output_name(tiny_prepared.name, 55, bpw)
    badge = name.removesuffix(".gguf").rsplit(".Voodoo55_", 1)[1]
    out = export_gguf(base, types, lambda nm, t: _q(base, nm, t), tmp_path / name)
    ft = read_gguf(out).fields["general.file_type"].contents()
    assert LlamaFileType(ft).name == "MOSTLY_" + badge
    assert badge == nearest_ftype(bpw) == ("Q8_0" if mix == "Q8_0" else "Q4_K_S")


def test_voodoo_model_is_name_and_hash(tiny_prepared, tmp_path, monkeypatch):
    """_provenance writes name@sha256 of the reference GGUF, no path; eval/chat find the
    model again through this machine's cache index."""
    from voodoo import cli
    from voodoo.fsutil import sha256_file
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    asg = {"budget_bytes": 10, "total_bytes": 9, "tensors": {}}
    kv = cli._provenance(SimpleNamespace(model=str(tiny_prepared.hf_dir)), asg, tiny_prepared)
    value = kv["voodoo.model"]
    sha = sha256_file(tiny_prepared.reference_gguf)
    assert value == f"{tiny_prepared.name}@sha256:{sha}"
    assert "/" not in value and str(tmp_path) not in value
    assert find_model(value) == str(Path(tiny_prepared.hf_dir).resolve())
    assert find_reference(value) == Path(tiny_prepared.reference_gguf).resolve()

    base = tiny_prepared.base_gguf
    out = export_gguf(base, {"blk.0.attn_q.weight": "Q8_0"},
                      lambda nm, t: _q(base, nm, t), tmp_path / "m.gguf", extra_kv=kv)
    assert gguf_model_id(out) == value
    for k, v in read_gguf(out).fields.items():
        if k.startswith("voodoo."):
            assert str(tmp_path) not in str(v.contents()), k
    # `voodoo eval --gguf` without --model: the recorded model
    a = SimpleNamespace(assignment=None, gguf=[str(out)])
    assert cli._recorded_model(a) == str(Path(tiny_prepared.hf_dir).resolve())
    # another machine (an empty cache): the error names the model and the way out
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "elsewhere"))
    assert find_model(value) is None
    with pytest.raises(cli.UsageError, match=f"made from {tiny_prepared.name}.*pass --model"):
        cli._recorded_model(a)


def test_default_model_hash_needs_no_index(smol_gguf):
    from voodoo.models import DEFAULT_MODEL_WHEEL
    value = model_id("SmolLM2-135M-Instruct", DEFAULT_MODEL_WHEEL["gguf_sha256"])
    assert Path(find_model(value)) == smol_gguf
    assert find_reference(value) == smol_gguf


def test_doctor_model_prints_where_the_files_are(tiny_prepared, tmp_path, monkeypatch):
    """`voodoo doctor --model M`: the base F32 GGUF the tensor-type-file recipe needs, the
    reference GGUF and the voodoo.model value, each on its own line."""
    import io

    import voodoo.models
    from voodoo import doctor
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(voodoo.models, "prepare_model", lambda m: tiny_prepared)
    out = io.StringIO()
    doctor.model_paths(str(tiny_prepared.hf_dir), out)
    lines = {l.split(None, 1)[0] if not l.startswith("  ") else l[2:24].strip(): l[24:].strip()
             for l in out.getvalue().splitlines() if l.strip()}
    assert lines["base F32 GGUF"] == str(tiny_prepared.base_gguf)
    assert lines["reference GGUF"] == str(tiny_prepared.reference_gguf)
    assert lines["voodoo.model"].startswith(f"{tiny_prepared.name}@sha256:")
    assert f"{tiny_prepared.base_gguf} out.gguf Q8_0" in lines["recipe"]


def test_recipes_name_llama_quantize_by_its_path(tiny_prepared, tmp_path, monkeypatch,
                                                capsys):
    """The printed llama-quantize commands (doctor --model, export, run) start with the tool's
    full path: the cached build is not on PATH, so a bare `llama-quantize` pasted into a shell
    was 'command not found'."""
    import io

    import voodoo.models
    from voodoo import cli, doctor
    tools = tmp_path / "tools"
    tools.mkdir()
    quantize = tools / "llama-quantize"
    quantize.write_text("#!/bin/sh\n")
    quantize.chmod(0o755)
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(tools))
    monkeypatch.setattr(voodoo.models, "prepare_model", lambda m: tiny_prepared)
    out = io.StringIO()
    doctor.model_paths(str(tiny_prepared.hf_dir), out)
    recipe = next(l for l in out.getvalue().splitlines() if l.strip().startswith("recipe"))
    assert recipe.split()[1] == str(quantize)
    gguf = tmp_path / "m.Voodoo50_Q4_0.gguf"
    gguf.with_suffix(".tensor-types.txt").write_text("blk.0.attn_q.weight=q4_0\n")
    cli._print_recipe(gguf, tiny_prepared.base_gguf, tmp_path / "imatrix.gguf")
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.split()[0] == str(quantize) and last.endswith("out.gguf Q8_0")


def test_doctor_names_a_missing_converter_source(tmp_path, monkeypatch):
    """A cache without llama.cpp's source (e.g. builds named by $VOODOO_LLAMA_CPP and
    $VOODOO_GGML_LIB, a fresh $VOODOO_CACHE) was "all good" to doctor while every model failed
    in seconds ("llama.cpp source not found"); doctor now lists it, with `voodoo bootstrap`,
    which fetches the source even when both builds come from elsewhere."""
    import io

    from voodoo import doctor
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(doctor, "self_check", lambda: [])
    out = io.StringIO()
    rc = doctor.run(out=out)
    text = out.getvalue()
    assert rc == 1 and "llama.cpp source" in text and "MISSING" in text, text
    assert "voodoo bootstrap" in text.split("problems:")[1]
