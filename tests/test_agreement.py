"""voodoo.agreement: the base-logits writer, and llama.cpp vs transformers on the same tokens."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
import torch

from voodoo.agreement import (AgreementError, KLD_MAGIC, _nv, chunk_tokens, gguf_vocab,
                              llama_vs_torch, preflight, read_kld_base, torch_logits,
                              write_kld_base)

sys.path.insert(0, str(Path(__file__).parent))


def _tools():
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-perplexity")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------------------------- writer
def test_writer_round_trip_is_within_the_formats_16_bit_step(tmp_path):
    g = torch.Generator().manual_seed(0)
    n_chunk, n_ctx, n_vocab = 3, 16, 1001                 # odd vocab: one padding slot
    tokens = torch.randint(0, n_vocab, (n_chunk, n_ctx), generator=g)
    logits = torch.randn(n_chunk, n_ctx, n_vocab, generator=g) * 4
    logits[0, 9, 5] = 60.0                                # a row whose range is clamped at 16
    p = write_kld_base(tmp_path / "x.kld", tokens, logits)
    n_pos = n_ctx - 1 - n_ctx // 2
    assert p.stat().st_size == 8 + 12 + 4 * n_chunk * n_ctx + 2 * n_chunk * n_pos * _nv(n_vocab)
    raw = p.read_bytes()
    assert raw[:8] == KLD_MAGIC
    assert struct.unpack_from("<Iii", raw, 8) == (n_ctx, n_vocab, n_chunk)

    tok2, lp = read_kld_base(p)
    assert torch.equal(tok2, tokens)
    assert lp.shape == (n_chunk, n_pos, n_vocab)
    ref = torch.log_softmax(logits[:, n_ctx // 2:n_ctx - 1].double(), -1)     # (C, P, V)
    top = ref.max(-1, keepdim=True).values
    inside = ref > top - 16                                 # stored exactly up to the step
    step = 16.0 / 65535                                     # largest possible scale
    err = (lp.double() - ref).abs()
    assert err[inside].max().item() <= step / 2 + 1e-5
    # below the 16-nat floor every entry decodes to the floor (never above the truth + step)
    assert (lp.double()[~inside] <= ref.max(-1, keepdim=True).values.expand_as(ref)[~inside]
            - 16 + 1e-4).all()
    # argmax survives the compression
    assert torch.equal(lp.argmax(-1), ref.argmax(-1))


def test_writer_rejects_mismatched_shapes(tmp_path):
    with pytest.raises(ValueError, match="n_chunk, n_ctx"):
        write_kld_base(tmp_path / "x.kld", torch.zeros(2, 8, dtype=torch.long),
                       torch.zeros(2, 7, 10))


def test_chunk_tokens():
    t = chunk_tokens(list(range(300)), 128)
    assert t.shape == (2, 128) and t[1, 0].item() == 128
    with pytest.raises(ValueError):
        chunk_tokens(list(range(100)), 128)


# ------------------------------------------------------------------------ against llama.cpp
@pytest.fixture(scope="module")
def tiny_hf(tiny_prepared):
    from voodoo.models import load_hf_model
    return load_hf_model(tiny_prepared)


@pytest.fixture(scope="module")
def tiny_tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 49152, (4, 128), generator=g)       # 4 chunks x 128, 252 scored


def test_our_file_matches_llama_cpps_own_writer(tiny_prepared, tiny_hf, tmp_path):
    """llama-perplexity --kl-divergence-base writes a file from llama.cpp's logits on some
    text; ours from torch logits on the tokens stored in it must have the same header and
    tokens, and log-probs equal within the format's step (the F32 GGUF is the same model)."""
    _tools()
    from voodoo.evaluate import _run_tool
    from voodoo.llamacpp import tool_path
    text = tmp_path / "text.txt"
    text.write_text((Path(__file__).resolve().parents[1] / "README.md").read_text() * 2)
    theirs = tmp_path / "llama.kld"
    _run_tool([str(tool_path("llama-perplexity")), "-m", str(tiny_prepared.base_gguf),
               "-f", str(text), "-c", "64", "--chunks", "2", "--kl-divergence-base",
               str(theirs)], 600)
    tok, lp_llama = read_kld_base(theirs)
    vocab = gguf_vocab(tiny_prepared.base_gguf)
    assert vocab["n_vocab"] == 49152
    run = tok.clone()
    if vocab["add_bos"]:
        run[:, 0] = vocab["bos"]
    ours = write_kld_base(tmp_path / "torch.kld", tok, torch_logits(tiny_hf, run))
    assert ours.read_bytes()[:20 + 4 * tok.numel()] == theirs.read_bytes()[:20 + 4 * tok.numel()]
    assert ours.stat().st_size == theirs.stat().st_size
    _, lp_torch = read_kld_base(ours)
    assert (lp_torch - lp_llama).abs().max().item() < 2e-3


def test_tiny_llama_f32_gguf_agrees_with_transformers(tiny_prepared, tiny_hf, tiny_tokens):
    _tools()
    res = preflight(tiny_hf, tiny_prepared.base_gguf, tiny_tokens)
    print(f"tiny llama: KLD {res['kld_mean']:.3g}, 99.9% {res['kld_99_9']:.3g}, "
          f"same top-p {res['same_top_p']:.4f}")
    assert res["n_tokens"] == 4 * 63
    assert abs(res["kld_mean"]) < 1e-4
    assert res["kld_99_9"] < 1e-3
    assert res["same_top_p"] > 0.99
    # the BOS llama.cpp puts first is what torch saw
    assert (res["tokens"][:, 0] == gguf_vocab(tiny_prepared.base_gguf)["bos"]).all()


def test_a_perturbed_model_fails_the_preflight(tiny_prepared, tiny_hf, tiny_tokens):
    """One weight changed on the torch side (the final norm x 8): llama.cpp's F32 GGUF no
    longer computes that model, and the check says so with a large KL."""
    _tools()
    import copy
    wrong = copy.deepcopy(tiny_hf)
    with torch.no_grad():
        wrong.model.norm.weight.mul_(8.0)
    with pytest.raises(AgreementError, match="--skip_preflight") as ei:
        preflight(wrong, tiny_prepared.base_gguf, tiny_tokens)
    assert ei.value.result["kld_mean"] > 0.05
    assert "KLD Voodoo optimises" in str(ei.value) or "optimises the KLD" in str(ei.value)


def test_unpermuted_q_fails_the_check(tmp_path_factory, tiny_tokens):
    """The converter permutes Q/K rows for llama.cpp's rope; a torch model that holds the
    converter's (permuted) rows computes another model: large KL (zoo llama, spread weights)."""
    _tools()
    from zoo import make_tiny

    from voodoo.models import convert_hf_to_f32_gguf, load_hf_model
    d = make_tiny("llama")
    gguf = convert_hf_to_f32_gguf(d, tmp_path_factory.mktemp("agree") / "llama.gguf")
    m = load_hf_model(d)
    ok = llama_vs_torch(gguf, m, tiny_tokens)
    assert abs(ok["kld_mean"]) < 1e-4 and ok["same_top_p"] > 0.99
    att = m.model.layers[0].self_attn
    n_head, hd = m.config.num_attention_heads, m.config.head_dim
    with torch.no_grad():                       # llama.cpp's permute (convert_hf_to_gguf)
        w = att.q_proj.weight
        w.copy_(w.reshape(n_head, 2, hd // 2, -1).swapaxes(1, 2).reshape(w.shape))
    bad = llama_vs_torch(gguf, m, tiny_tokens)
    print(f"zoo llama: right {ok['kld_mean']:.3g}, Q permuted {bad['kld_mean']:.3g}")
    assert bad["kld_mean"] > 100 * max(ok["kld_mean"], 1e-5)
    assert bad["kld_mean"] > 1e-3


def test_logits_input_must_have_bos_where_llama_cpp_puts_it(tiny_prepared, tiny_tokens,
                                                             monkeypatch):
    """A vocabulary that adds BOS (as gemma's SentencePiece ones do): logits passed in must
    have been computed with BOS first; a model passed in gets BOS put there."""
    import voodoo.agreement as ag
    monkeypatch.setattr(ag, "gguf_vocab", lambda p: {"n_vocab": 49152, "bos": 1, "add_bos": True})
    t = tiny_tokens.clone()
    t[:, 0] = 7
    with pytest.raises(ValueError, match="BOS"):
        ag.llama_vs_torch(tiny_prepared.base_gguf, torch.zeros(4, 128, 49152), t)
    assert (ag._with_bos(t, {"bos": 1})[:, 0] == 1).all()
    assert torch.equal(ag._with_bos(t, {"bos": None}), t)



def test_a_tokenizer_longer_than_the_embedding_is_named(tiny_prepared, tiny_tokens):
    """Logits one entry shorter than the GGUF's tokenizer (a token added to the tokenizer
    without resizing the embedding): refused before llama.cpp runs, naming both sizes and the
    fix, not Voodoo's internal files."""
    n_vocab = gguf_vocab(tiny_prepared.base_gguf)["n_vocab"]
    t = tiny_tokens.clone()
    bos = gguf_vocab(tiny_prepared.base_gguf)["bos"]
    if bos is not None:
        t[:, 0] = int(bos)
    with pytest.raises(ValueError, match=rf"the model's logits have {n_vocab - 1} entries per "
                       rf"position .* the tokenizer in {tiny_prepared.base_gguf.name} has "
                       rf"{n_vocab} tokens; llama.cpp refuses such a file .* Make the tokenizer "
                       r"and the embedding agree"):
        llama_vs_torch(tiny_prepared.base_gguf, torch.zeros(*t.shape, n_vocab - 1), t)


def test_too_few_positions_is_refused(tiny_prepared):
    with pytest.raises(ValueError, match="100"):
        llama_vs_torch(tiny_prepared.base_gguf, torch.zeros(1, 128, 49152),
                       torch.ones(1, 128, dtype=torch.long))


def test_a_gguf_llama_cpp_cannot_load_is_a_clear_error(tiny_prepared, tiny_hf, tiny_tokens,
                                                        tmp_path):
    """When llama.cpp's loader refuses the F32 GGUF its converter wrote (here: the file says
    feed_forward_length 544 for ffn tensors of 512, as for a config its loader reads
    differently), the pre-flight says so in one line, quoting llama.cpp's reason, and that no
    Voodoo flag (not even --skip_preflight) helps: not an AgreementError, nor a raw
    llama-perplexity failure."""
    _tools()
    import shutil

    from voodoo.agreement import LlamaCppLoadError
    from voodoo.evaluate import PerplexityError
    bad = tmp_path / "base-f32.gguf"
    shutil.copy(tiny_prepared.base_gguf, bad)
    with open(bad, "r+b") as f:
        head = f.read(1 << 20)
        key = b"llama.feed_forward_length"
        i = head.index(key) + len(key)
        assert struct.unpack_from("<II", head, i) == (4, 512)      # GGUF uint32, 512
        f.seek(i + 4)
        f.write(struct.pack("<I", 544))
    with pytest.raises(LlamaCppLoadError) as ei:
        preflight(tiny_hf, bad, tiny_tokens, threads=1)
    e = ei.value
    assert isinstance(e, PerplexityError) and not isinstance(e, AgreementError)
    msg = str(e)
    assert "\n" not in msg
    assert "check_tensor_dims" in e.reason and "wrong shape" in e.reason and e.reason in msg
    assert "cannot load base-f32.gguf" in msg and "its own converter" in msg
    assert "--skip_preflight" in msg and "llama.cpp" in msg
    # llama_vs_torch (used on exported files too) raises the same type with the reason
    with pytest.raises(LlamaCppLoadError, match="cannot load base-f32.gguf: check_tensor_dims"):
        llama_vs_torch(bad, tiny_hf, tiny_tokens, threads=1)


def test_a_phi3_folder_name_on_another_vocabulary_is_named(tiny_prepared, tiny_hf,
                                                          tiny_tokens, tmp_path):
    """llama.cpp gives a model whose general.name (the converter takes it from the folder's
    name) contains "phi3" Phi-3's token attributes and looks up "</s>", "<unk>", "<s>": on
    SmolLM2's vocabulary its loader dies with "unordered_map::at". The pre-flight names the
    rule and the fix (rename the folder), not "a limit of llama.cpp for this configuration"
    (a tester's folder "phi3_longrope" failed so; renamed, the same model ran end to end)."""
    _tools()
    import shutil

    from voodoo.agreement import LlamaCppLoadError
    from voodoo.ggufio import read_gguf
    bad = tmp_path / "base-f32.gguf"
    shutil.copy(tiny_prepared.base_gguf, bad)
    name = read_gguf(bad).fields["general.name"].contents()
    assert len(name) >= 4 and "phi" not in name.lower()
    with open(bad, "r+b") as f:
        head = f.read(1 << 20)
        i = head.index(b"general.name") + len(b"general.name") + 4 + 8  # type, length
        assert head[i:i + len(name)] == name.encode()
        f.seek(i)
        f.write(b"Phi3")
    with pytest.raises(LlamaCppLoadError) as ei:
        preflight(tiny_hf, bad, tiny_tokens, threads=1)
    msg = str(ei.value)
    assert "unordered_map::at" in msg and "'Phi3" in msg and "Rename the model folder" in msg
    assert "</s>" in msg and "limit of llama.cpp" not in msg, msg


def test_an_abort_of_llama_cpp_is_named_as_its_limit(tmp_path, monkeypatch):
    """llama-perplexity dying on one of ggml's asserts (a graph llama.cpp cannot build for
    this configuration: an MoE gating function it does not know, a buffer not set) was
    reported as the raw command, its exit -6 and gdb's noise. Parsed from the output llama.cpp
    prints (the lines of a real abort of the pinned build, tiny dots1 with MHA)."""
    import voodoo.agreement as A
    out = ("llama_context: CPU compute buffer size = 1.28 MiB\n"
           "/root/.cache/voodoo/llama.cpp/0c1e57098/src/src/llama-graph.cpp:2072: fatal error\n"
           "30\t../sysdeps/unix/sysv/linux/wait4.c: No such file or directory.\n")
    e = A._load_failure(tmp_path / "base-f32.gguf", out)
    assert e.crashed and e.reason == "llama-graph.cpp:2072: fatal error"
    assert "aborted running base-f32.gguf" in str(e)
    e2 = A._load_failure(tmp_path / "m.gguf", "…/ggml/src/ggml-backend.cpp:338: GGML_ASSERT("
                         "buf != NULL && \"tensor buffer not set\") failed\n")
    assert e2.crashed and e2.reason.startswith("ggml-backend.cpp:338: GGML_ASSERT(buf != NULL")
    assert A._load_failure(tmp_path / "m.gguf", "ppl = 12.3\nall fine\n") is None

    msg = _preflight_message(e, tmp_path, monkeypatch)
    assert "aborted running base-f32.gguf" in msg and "llama-graph.cpp:2072" in msg
    assert "scoring_func" in msg and "--skip_preflight" in msg and "\n" not in msg


def test_a_key_the_loader_misses_names_the_config_setting(tmp_path, monkeypatch):
    """exaone_moe without `scoring_func` in config.json: llama.cpp's loader said `key not found
    in model: exaone-moe.expert_gating_func` and the message gave no hint (a new user's report;
    the graph abort of dots1 had one). The key and, for a gating function, the setting are
    named."""
    import voodoo.agreement as A
    out = ("llama_model_load: error loading model: error loading model hyperparameters: key "
           "not found in model: exaone-moe.expert_gating_func\n")
    e = A._load_failure(tmp_path / "base-f32.gguf", out)
    assert e is not None and not e.crashed and "exaone-moe.expert_gating_func" in e.reason
    msg = _preflight_message(e, tmp_path, monkeypatch)
    assert "cannot load base-f32.gguf" in msg and "needs exaone-moe.expert_gating_func" in msg
    assert "`scoring_func`" in msg and "\n" not in msg, msg


def _preflight_message(e, tmp_path, monkeypatch) -> str:
    """The one-line message :func:`voodoo.agreement.preflight` raises when llama.cpp fails
    with ``e`` (a LlamaCppLoadError from :func:`voodoo.agreement._load_failure`)."""
    import voodoo.agreement as A

    def fail(*a, **k):
        raise e
    monkeypatch.setattr(A, "llama_vs_torch", fail)
    monkeypatch.setattr("voodoo.export.dequantized_copy", lambda p: p)
    with pytest.raises(A.LlamaCppLoadError) as ei:
        A.preflight(None, tmp_path / "base-f32.gguf", None)
    return str(ei.value)


# ------------------------------------------------------------------------ the tokenizers
_TEXT = ("Hello world, the 1234 quick brown foxes (est. 1999) jumped 3.5 m.\n  Indented   "
         "spaces\tand a tab. Émile's naïve café, 日本語, \U0001F642 and <|im_start|>user\n\n"
         "\"Quoted\" -- dashes; semi: colons! 100,000 people @ 9:30pm. "
         # backslashes as source code and paths hold them (llama.cpp's tools read "\\n" as a
         # newline unless given --no-escape)
         "printf(\"%d\\n\", x); C:\\temp\\new.txt \\t \\\\ ") * 4


def _with_pre(src, dst, new: bytes):
    """A copy of the GGUF ``src`` whose tokenizer.ggml.pre value is overwritten in place with
    ``new`` (same length)."""
    import shutil

    from voodoo.ggufio import read_gguf
    old = read_gguf(src).fields["tokenizer.ggml.pre"].contents().encode()
    assert len(old) == len(new), (old, new)
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(1 << 20)
        i = head.index(b"tokenizer.ggml.pre") + len(b"tokenizer.ggml.pre") + 4 + 8
        assert head[i:i + len(old)] == old
        f.seek(i)
        f.write(new)
    return dst


def test_llama_cpps_tokenizer_is_compared_with_transformers(tiny_prepared, smol_tokenizer,
                                                           tmp_path):
    """llama-tokenize on the converter's GGUF cuts text (digits, whitespace runs, accents, CJK,
    an emoji, a special token's text, escape sequences written out) into transformers' ids;
    the same GGUF with another pre-tokenizer (falcon's regex instead of smollm's) is reported,
    with where and how many."""
    from voodoo.agreement import (calibration_text, llama_tokenize, tokenizer_agreement,
                                  tokenizer_warning)
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-tokenize")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    base = tiny_prepared.base_gguf
    ids = smol_tokenizer(_TEXT, add_special_tokens=False).input_ids
    assert llama_tokenize(base, _TEXT) == ids
    res = tokenizer_agreement(base, smol_tokenizer, _TEXT)
    assert res["same"] and res["n_differ"] == 0 and res["first_diff"] is None, res
    assert res["n_llama"] == len(ids) and res["pre"] == "smollm"
    assert tokenizer_warning(res, "x") is None
    # the text the run compares: calibration ids decoded, cut at whitespace, special tokens out
    text = calibration_text(smol_tokenizer, torch.tensor([[216] + ids * 40]), n_chars=1000)
    assert 500 < len(text) <= 1000 and text[-1] != " " and "<|im_start|>" not in text
    assert text.startswith("Hello world"), text[:20]  # id 216 is a space
    bad = _with_pre(base, tmp_path / "falcon.gguf", b"falcon")
    res = tokenizer_agreement(bad, smol_tokenizer, _TEXT)
    assert not res["same"] and res["n_differ"] > 10 and res["pre"] == "falcon", res
    assert res["n_llama"] != res["n_transformers"]
    i = res["first_diff"]
    assert ids[:i] == llama_tokenize(bad, _TEXT)[:i] and len(res["context"]["llama.cpp"]) > 0
    warn = tokenizer_warning(res, "falcon.gguf")
    assert "tokenizer.ggml.pre='falcon'" in warn and f"{res['n_differ']} of them" in warn
    # a pre-tokenizer llama.cpp does not know: its own message, quoted
    from voodoo.evaluate import PerplexityError
    with pytest.raises(PerplexityError, match="unknown pre-tokenizer type"):
        llama_tokenize(_with_pre(base, tmp_path / "bogus.gguf", b"bogus!"), _TEXT)
