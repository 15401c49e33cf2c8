"""Texts for llama.cpp's tools with a vocabulary that cannot read every character
(``voodoo.llamatext``): SentencePiece without byte tokens (the zoo's tiny ``tokenizer.model``)
aborts llama-perplexity and llama-imatrix on the first character it does not hold; Voodoo hands
them a text they can read instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from zoo import make_tiny  # noqa: E402


@pytest.fixture(scope="module")
def spm_model():
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-perplexity")
        tool_path("llama-imatrix")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from voodoo.models import prepare_model
    return prepare_model(make_tiny("qwen2"))  # the zoo's SentencePiece, no byte tokens


def _text(tmp_path) -> Path:
    from voodoo.llamacpp import source_dir
    body = (source_dir() / "docs" / "build.md").read_text(errors="replace")
    p = tmp_path / "text.txt"
    p.write_text("Snow \u2603 and caf\u00e9 \u4e2d.\n\n" + body * 2)
    return p


def test_untokenizable_names_what_the_vocabulary_lacks(spm_model):
    from voodoo.llamatext import untokenizable
    base = spm_model.base_gguf
    bad = untokenizable(base, "snow \u2603\nthe")
    assert "\n" in bad and "\u2603" in bad and not {"s", "n", "o", "w", " ", "t"} & set(bad)
    # a byte-level BPE vocabulary (SmolLM2's) reads anything
    smol = Path(make_tiny("llama"))
    from voodoo.models import prepare_model
    assert untokenizable(prepare_model(smol).base_gguf, "\u2603\n\x01") == []


def test_perplexity_and_imatrix_read_a_text_the_vocabulary_cannot(spm_model, tmp_path, capfd):
    """The raw tool aborts on the text (so this test can fail); through Voodoo it is scored on
    a copy with the unreadable characters replaced, said once; llama-imatrix gets decoded
    blocks joined so that it can read them."""
    from voodoo.evaluate import run_perplexity
    from voodoo.imatrix import llama_imatrix
    from voodoo.llamacpp import tool_env, tool_path
    base = spm_model.base_gguf
    text = _text(tmp_path)
    raw = subprocess.run([str(tool_path("llama-perplexity")), "-m", str(base), "-f", str(text),
                          "-c", "64", "--chunks", "4"], capture_output=True, text=True,
                         errors="replace", env=tool_env(), timeout=300)
    assert raw.returncode != 0 and "out_of_range" in raw.stdout + raw.stderr
    res = run_perplexity(base, text, ctx=64, chunks=4, kl_base=base)
    assert res["kld"] < 1e-3 and np.isfinite(res["ppl"])  # the file against itself
    err = capfd.readouterr().err
    assert err.count("cannot read") == 1 and "'\\n'" in err and "'\u2603'" in err, err
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spm_model.hf_dir)
    ids = tok(text.read_text())["input_ids"]
    blocks = torch.tensor(ids[:4 * 32]).reshape(4, 32)
    out = llama_imatrix(base, blocks, tmp_path / "imatrix.gguf", tok, timeout=300)
    assert out.is_file() and out.stat().st_size > 0


def test_a_text_mostly_unreadable_is_refused_and_the_report_says_what_was_replaced(spm_model,
                                                                                  tmp_path):
    """A text of which the vocabulary reads less than half (here nothing but symbols it lacks)
    is refused, naming the characters, instead of being scored as blanks; for a text it
    mostly reads, ``text_note`` gives the report's header a phrase saying what was replaced,
    and nothing for a byte-level BPE vocabulary."""
    from voodoo.evaluate import run_perplexity
    from voodoo.llamatext import UnreadableTextError, text_note
    from voodoo.models import prepare_model
    base = spm_model.base_gguf
    bad = tmp_path / "symbols.txt"
    bad.write_text("\u00a3\u00a9\u00b0\n" * 3000)
    with pytest.raises(UnreadableTextError, match=r"cannot read 9000 of its 9000 non-space"):
        run_perplexity(base, bad, ctx=64, chunks=4)
    text = _text(tmp_path)
    note = text_note(base, text)
    assert "replaced by spaces" in note and "newlines included" in note, note
    assert text_note(prepare_model(make_tiny("llama")).base_gguf, text) == ""


def test_chat_names_the_characters_that_abort_llama_completion(spm_model):
    """``voodoo chat``'s prompt goes to llama-completion as it is; when the vocabulary cannot
    read one of its characters the tool aborts, and the error names the character."""
    from voodoo.chat import ChatError, generate
    from voodoo.llamacpp import LlamaCppNotBuilt, tool_path
    try:
        tool_path("llama-completion")
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    with pytest.raises(ChatError, match="cannot read '\u2603'"):
        generate(spm_model.base_gguf, "Snow \u2603 falls", n_predict=4, timeout=300)


def test_run_refuses_an_unreadable_eval_text_for_that_reason_not_as_too_short(spm_model,
                                                                             tmp_path):
    """``run``/``eval --eval_text`` counted the text's tokens first: a text the vocabulary
    cannot read folds into a few HF tokens and was refused as too short ("give a longer
    text"); the reason is the script, and that is what is said now."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from voodoo.cli import _check_eval_text_tokens
    from voodoo.llamatext import UnreadableTextError
    bad = tmp_path / "symbols.txt"
    bad.write_text("\u00a3\u00a9\u00b0\n" * 3000)
    tok = AutoTokenizer.from_pretrained(spm_model.hf_dir)
    a = SimpleNamespace(eval_text=str(bad), ctx=512, chunks=8)
    with pytest.raises(UnreadableTextError, match="cannot read 9000 of its 9000"):
        _check_eval_text_tokens(a, tok, spm_model.base_gguf)
