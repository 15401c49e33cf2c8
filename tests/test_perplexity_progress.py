"""llama-perplexity runs report progress per chunk (plain lines when stderr is not a
terminal) and explain a KLD run too short for statistics. The tool is a stand-in script
printing what tools/perplexity/perplexity.cpp prints."""

from __future__ import annotations

import stat

import pytest

import voodoo.evaluate as ve

_HEAD = "kl_divergence: computing over 4 chunks, n_ctx=64, batch_size=2048, n_seq=32\n"
_TABLE = ("\nchunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
          "              Δp RMS            Same top p\n"
          + "".join(f"   {i}    52249.8981 ± 2856.0688      -0.00271 ±    0.00093       "
                    f"0.00001 ±    0.00000     0.000 ±  0.000 %    96.774 ±  3.226 %\n"
                    for i in range(1, 5)))
_STATS = ("====== KL divergence statistics ======\n"
          "Mean    KLD:   0.012345 ±   0.000100\n"
          "Maximum KLD:   0.500000\n99.9%   KLD:   0.400000\n99.0%   KLD:   0.100000\n"
          "Median  KLD:   0.005000\n"
          "Same top p: 93.750 ± 0.500 %\n")


def _tool(tmp_path, monkeypatch, body: str):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    p = d / "llama-perplexity"
    out = tmp_path / "out.txt"
    out.write_text(body)
    # chunks arrive one by one, as from the real tool
    p.write_text(f"#!/bin/sh\necho '{_HEAD.strip()}' >&2\nsleep 0.2\ncat '{out}'\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("VOODOO_LLAMA_CPP", str(d))
    model, kld = tmp_path / "m.gguf", tmp_path / "base.kld"
    model.write_bytes(b"GGUF")
    kld.write_bytes(b"x" * 64)
    return model, kld


def test_kld_run_reports_chunks_and_parses(tmp_path, monkeypatch, capsys):
    model, kld = _tool(tmp_path, monkeypatch, _TABLE + _STATS)
    res = ve.run_perplexity(model, kld, kl_base=kld)
    assert res["kld"] == pytest.approx(0.012345) and res["same_top_p"] == pytest.approx(0.9375)
    err = capsys.readouterr().err                  # captured: not a terminal
    assert "\r" not in err
    lines = [l for l in err.splitlines() if "llama-perplexity m.gguf" in l]
    # a fast run: its end, not a line per chunk (10%-step lines are at least 10 s apart)
    assert len(lines) <= 2, lines
    assert lines[-1].startswith("[voodoo] llama-perplexity m.gguf: done in ")


def test_too_few_tokens_for_kld_statistics_says_so(tmp_path, monkeypatch):
    model, kld = _tool(tmp_path, monkeypatch, _TABLE)
    with pytest.raises(ve.PerplexityError, match="at least 100 scored tokens.*raise --chunks"):
        ve.run_perplexity(model, kld, kl_base=kld)
