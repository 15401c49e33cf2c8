"""voodoo.evaluate: torch PPL/KL, llama-perplexity output parsing and runs, reports."""

from __future__ import annotations

import json
import math
import stat
import subprocess

import pytest
import torch

from voodoo import evaluate as ve
from voodoo.llamacpp import LlamaCppNotBuilt, tool_path

# Lines as kl_divergence() and perplexity() in tools/perplexity/perplexity.cpp print them.
KLD_OUTPUT = """\
kl_divergence: computing over 2 chunks, n_ctx=128, batch_size=128, n_seq=1
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      17.2034 ±    2.6532       0.01187 ±    0.01532       0.03307 ±    0.00460     4.012 ±  0.611 %    91.875 ±  2.164 %
====== Perplexity statistics ======
Mean PPL(Q)                   :  23.130544 ±   6.637651
Mean PPL(base)                :  22.370785 ±   6.381410
Cor(ln(PPL(Q)), ln(PPL(base))):  99.43%
Mean ln(PPL(Q)/PPL(base))     :   0.033399 ±   0.017401
Mean PPL(Q)/PPL(base)         :   1.033963 ±   0.017992
Mean PPL(Q)-PPL(base)         :   0.759759 ±   0.497712

====== KL divergence statistics ======
Mean    KLD:   0.036512 ±   0.004338
Maximum KLD:   0.476113
99.9%   KLD:   0.457104
99.0%   KLD:   0.286839
95.0%   KLD:   0.120133
90.0%   KLD:   0.082791
Median  KLD:   0.017866
10.0%   KLD:   0.000839
 5.0%   KLD:   0.000331
 1.0%   KLD:  -0.000000
 0.1%   KLD:  -0.000001
Minimum KLD:  -0.000001

====== Token probability statistics ======
Mean    Δp: -0.676 ± 0.284 %
RMS Δp    :  4.126 ± 0.466 %
Same top p: 91.732 ± 1.722 %
"""
PPL_OUTPUT = ("perplexity: calculating perplexity over 2 chunks, n_ctx=128, batch_size=2048, "
              "n_seq=16\nperplexity: 8.74 seconds per pass - ETA 0.11.933.753 I Final estimate: "
              "PPL = 22.3708 +/- 6.38143\n")


def test_parse_kld_output():
    r = ve.parse_perplexity_output(KLD_OUTPUT)
    assert r["ppl"] == 23.130544 and r["ppl_err"] == 6.637651
    assert r["ppl_base"] == 22.370785
    assert r["ln_ppl_ratio"] == 0.033399
    assert r["kld"] == 0.036512 and r["kld_err"] == 0.004338
    assert r["kld_p99_9"] == 0.457104 and r["kld_p99"] == 0.286839
    assert r["kld_median"] == 0.017866 and r["kld_max"] == 0.476113
    assert r["same_top_p"] == pytest.approx(0.91732) and r["same_top_p_err"] == pytest.approx(0.01722)
    assert r["rms_dp"] == pytest.approx(0.04126)
    assert r["n_chunks"] == 2 and r["ctx"] == 128


def test_parse_ppl_output():
    r = ve.parse_perplexity_output(PPL_OUTPUT)
    assert r == {"ppl": 22.3708, "ppl_err": 6.38143, "n_chunks": 2, "ctx": 128}
    assert ve.parse_perplexity_output("Final estimate: PPL = nan +/- nan")["ppl"] != 0  # nan
    assert ve.parse_perplexity_output("nothing here") == {}


def test_format_table_and_report(tmp_path):
    rows = ve.evaluate_rows([("Q4_1", {"ppl": 22.3708, "kld": None, "model": "/x.gguf"}),
                             ("mix", {"ppl": 23.1, "kld": 0.0000365, "same_top_p": 0.917})])
    md = ve.format_table(rows)
    lines = md.strip().splitlines()
    assert lines[0] == "| model | ppl | kld | same_top_p |"
    assert lines[2] == "| Q4_1 | 22.3708 |  |  |"
    assert lines[3] == "| mix | 23.1000 | 3.650e-05 | 0.9170 |"
    pj, pm = ve.save_report(rows, tmp_path / "report")
    assert json.loads(pj.read_text()) == rows and pm.read_text() == md


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_torch_ppl_kl(tiny_llama):
    import copy
    blocks = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    r = ve.torch_ppl_kl(tiny_llama, tiny_llama, blocks, batch_size=2)
    with torch.no_grad():
        logits = tiny_llama(input_ids=blocks).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
                                           blocks[:, 1:].reshape(-1))
    assert r["ppl"] == pytest.approx(math.exp(ce.item()), rel=1e-5)
    assert r["teacher_ppl"] == pytest.approx(r["ppl"]) and r["n_tokens"] == 3 * 15
    assert abs(r["kl"]) < 1e-6 and r["same_top_p"] == 1.0
    student = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        student.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        student.lm_head.weight.add_(0.05 * torch.randn_like(student.lm_head.weight))
    r2 = ve.torch_ppl_kl(student, tiny_llama, blocks)
    with torch.no_grad():
        t = torch.log_softmax(tiny_llama(input_ids=blocks).logits, -1)
        s = torch.log_softmax(student(input_ids=blocks).logits, -1)
    kl = (t.exp() * (t - s)).sum(-1).mean().item()
    assert r2["kl"] == pytest.approx(kl, rel=1e-4) and r2["kl"] > 1e-4
    assert r2["teacher_ppl"] == pytest.approx(r["ppl"])
    assert ve.torch_ppl_kl(student, None, blocks)["kl"] is None


def _fake_tool(tmp_path, script):
    d = tmp_path / "bin"
    d.mkdir()
    p = d / "llama-perplexity"
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return d


def test_run_perplexity_errors(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("hello")
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(tmp_path / "nowhere"))
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(LlamaCppNotBuilt, match="llama-perplexity"):
        ve.run_perplexity(model, text)
    with pytest.raises(FileNotFoundError):
        ve.run_perplexity(tmp_path / "missing.gguf", text)
    fails = _fake_tool(tmp_path, 'echo "main: error: unable to load model" >&2\nexit 1\n')
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(fails))
    with pytest.raises(ve.PerplexityError, match="unable to load model"):
        ve.run_perplexity(model, text)
    (fails / "llama-perplexity").write_text(
        "#!/bin/sh\necho 'perplexity: you need at least 1024 tokens' >&2\nexit 0\n")
    with pytest.raises(ve.PerplexityError, match="too short .* at least 1024 tokens"):
        ve.run_perplexity(model, text)
    with pytest.raises(ve.PerplexityError, match="too short .* at least 1024 tokens"):
        ve.run_perplexity(model, text, kl_base=model)
    (fails / "llama-perplexity").write_text("#!/bin/sh\necho 'perplexity: done' >&2\nexit 0\n")
    with pytest.raises(ve.PerplexityError, match="no base logits"):
        ve.run_perplexity(model, text, kl_base=model)

    # a file of another vocabulary than the base logits': llama-perplexity logs it and goes on
    # to print a KLD of unlike token ids (kl_divergence() in tools/perplexity)
    (fails / "llama-perplexity").write_text(
        "#!/bin/sh\ncase \"$*\" in\n"
        "  *--kl-divergence-base*--kl-divergence*)\n"
        "    echo 'kl_divergence: inconsistent vocabulary (49152 vs 49157)' >&2\n"
        "    echo 'Mean    KLD:  20.140000 +/-   0.100000' >&2;;\n"
        "  *--kl-divergence-base*)\n"
        "    for a in \"$@\"; do last=$a; done; head -c 64 /dev/zero > \"$last\"\n"
        "    echo 'Final estimate: PPL = 5.0000 +/- 0.10000' >&2;;\nesac\nexit 0\n")
    with pytest.raises(ve.PerplexityError, match=r"m.gguf has a vocabulary of 49157 tokens and "
                       r"the reference's base logits 49152"):
        ve.run_perplexity(model, text, kl_base=model)

    # an abort: ggml's handler prints a gdb backtrace longer than the tail; the reason stays
    (fails / "llama-perplexity").write_text(
        "#!/bin/sh\nfor i in $(seq 30); do echo 'llama_model_load: ok' >&2; done\n"
        "echo '/src/llama-graph.cpp:2072: fatal error' >&2\n"
        "for i in $(seq 40); do echo \"#$i  0x00007f in ggml_abort () from libggml.so\" >&2; "
        "done\necho '[Inferior 1 (process 7) detached]' >&2\nkill -ABRT $$\n")
    with pytest.raises(ve.PerplexityError, match="(?s)exit -6.*llama-graph.cpp:2072: fatal "
                       "error") as e:
        ve.run_perplexity(model, text)
    assert "ggml_abort" not in str(e.value)


def _tool(name):
    try:
        return str(tool_path(name))
    except LlamaCppNotBuilt as e:
        pytest.skip(f"{name} not built: {e}")


@pytest.mark.slow
def test_real_perplexity_and_kld(smol_gguf, wikitext_test, tmp_path, monkeypatch):
    """SmolLM2 Q4_1 on wikitext-2 test (evaluation), 2 chunks of 128; KLD of a Q4_0 requant.

    Measured: PPL(Q4_1) = 22.37 ± 6.38 on these 2 chunks of the first 30 kB."""
    from pathlib import Path
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(Path(_tool("llama-perplexity")).parent))
    monkeypatch.setenv("VOODOO_CACHE", str(tmp_path / "cache"))  # a fresh .kld cache
    text = tmp_path / "wt.txt"
    text.write_text(wikitext_test.read_text()[:30000])
    r = ve.run_perplexity(smol_gguf, text, ctx=128, chunks=2, batch=128)
    assert r["n_chunks"] == 2 and r["ctx"] == 128
    assert 5 < r["ppl"] < 100 and r["ppl_err"] > 0
    cand = tmp_path / "q4_0.gguf"
    q = subprocess.run([_tool("llama-quantize"), "--allow-requantize", str(smol_gguf), str(cand),
                        "Q4_0", "2"], capture_output=True, text=True)
    assert q.returncode == 0, q.stderr[-2000:]
    k = ve.run_perplexity(cand, text, ctx=128, chunks=2, kl_base=smol_gguf, batch=128)
    print("\nQ4_0 requant vs Q4_1:", {x: k[x] for x in ("ppl", "ppl_base", "kld", "kld_p99_9",
                                                       "kld_median", "same_top_p")})
    assert k["ppl_base"] == pytest.approx(r["ppl"], rel=1e-4)
    assert 1e-4 < k["kld"] < 1.0 and k["kld_p99_9"] >= k["kld_median"] >= 0
    assert 0.5 < k["same_top_p"] < 1.0
    base = ve.kld_base(smol_gguf, text, ctx=128, chunks=2, batch=128)
    assert base["cached"] and base["path"] == k["kl_base"]
    same = ve.run_perplexity(smol_gguf, text, ctx=128, kl_base=base["path"], batch=128)
    assert abs(same["kld"]) < 1e-4 and same["same_top_p"] == 1.0
    # a damaged cached .kld (bytes zeroed, same size) is made again, not scored against
    raw = bytearray(Path(base["path"]).read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 4096] = bytes(4096)
    Path(base["path"]).write_bytes(bytes(raw))
    k2 = ve.run_perplexity(cand, text, ctx=128, chunks=2, kl_base=smol_gguf, batch=128)
    assert k2["kld"] == pytest.approx(k["kld"], rel=1e-6)


def test_cached_base_logits_are_checked(tmp_path):
    """:func:`voodoo.evaluate._cached_kld_info`: an intact cached pair is reused; a ``.kld``
    with bytes changed (same size), a truncated one, or an unreadable ``.json`` record is
    removed (None: made again); an entry from before the records gets them."""
    import json

    from voodoo.evaluate import _cached_kld_info

    def entry(name, info=True):
        k, j = tmp_path / f"{name}.kld", tmp_path / f"{name}.json"
        k.write_bytes(bytes(range(256)) * 64)
        j.write_text(json.dumps({"ppl": 3.0}))
        return k, j
    k, j = entry("old")
    assert _cached_kld_info(k, j)["ppl"] == 3.0
    rec = json.loads(j.read_text())
    assert rec["kld_bytes"] == 16384 and len(rec["kld_sha256"]) == 64
    assert _cached_kld_info(k, j)["ppl"] == 3.0  # intact: reused
    raw = bytearray(k.read_bytes())
    raw[100:200] = bytes(100)
    k.write_bytes(bytes(raw))
    assert _cached_kld_info(k, j) is None and not k.exists() and not j.exists()
    k, j = entry("trunc")
    _cached_kld_info(k, j)
    k.write_bytes(k.read_bytes()[:1000])
    assert _cached_kld_info(k, j) is None and not k.exists()
    k, j = entry("json")
    j.write_text('{"ppl": 3.0, "ctx')
    assert _cached_kld_info(k, j) is None and not k.exists() and not j.exists()


def test_short_text_refusal_is_one_clear_line(tmp_path):
    """llama-perplexity's own refusal of a text under 2*ctx tokens (tools/perplexity) becomes a
    PerplexityError naming the text, the tokens needed and the fix; other output does not."""
    from voodoo.evaluate import PerplexityError, _raise_if_too_short
    text = tmp_path / "short.txt"
    out = ("perplexity: tokenizing the input ..\n"
           "perplexity: you need at least 1024 tokens to evaluate perplexity with a context of "
           "512\n")
    with pytest.raises(PerplexityError, match=r"short.txt is too short .* -c 512: it needs at "
                                              r"least 1024 tokens; give a longer text"):
        _raise_if_too_short(out, text, 512)
    _raise_if_too_short("perplexity: calculating perplexity over 8 chunks\n", text, 512)
