"""voodoo.data: sources, the train/eval split by document, blocks, determinism, the folder."""

from __future__ import annotations

import json

import pytest
import torch

from voodoo import data as vd


def _docs(n: int) -> list[str]:
    # distinct, recognisable documents: doc k repeats its own marker word
    return [" ".join([f"doc{k:03d} word{k % 7} text"] * (3 + k % 5)) for k in range(n)]


@pytest.fixture()
def jsonl_source(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(_docs(40))))
    return p


def test_strip_wiki_markup():
    src = ("{{Infobox|name=x|{{nested|y}}}}'''Anarchism''' is a [[political philosophy]] "
           "that [[advocacy|advocates]] things.<ref name=a>cite {{cite|x}}</ref> More.<ref a/>\n"
           "== History ==\n"
           "[[File:A.jpg|thumb|caption with [[link]]]]\n"
           "{| class=wikitable\n|-\n| cell || cell\n|}\n"
           "See [http://example.org the site] &amp; <!-- hidden --> [[Category:Things]] [[de:Anarchismus]]")
    out = vd.strip_wiki_markup(src)
    assert out.startswith("Anarchism is a political philosophy that advocates things. More.")
    assert "History" in out and "==" not in out
    for junk in ("{{", "}}", "[[", "]]", "<ref", "cite", "caption", "cell", "Category",
                 "Anarchismus", "hidden", "http"):
        assert junk not in out, junk
    assert "See the site &" in out


def test_jsonl_blocks_split_and_determinism(smol_tokenizer, jsonl_source, tmp_path):
    kw = dict(seq_len=32, n_train_blocks=6, n_eval_blocks=3)
    m1 = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "a", seed=1, **kw)
    m2 = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "b", seed=1, **kw)
    m3 = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "c", seed=2, **kw)
    tr1, ev1, meta1 = vd.load_dataset_dir(tmp_path / "a")
    tr2, ev2, _ = vd.load_dataset_dir(tmp_path / "b")
    tr3, _, _ = vd.load_dataset_dir(tmp_path / "c")
    assert tr1.dtype == torch.long and tuple(tr1.shape) == (6, 32) and tuple(ev1.shape) == (3, 32)
    assert torch.equal(tr1, tr2) and torch.equal(ev1, ev2)
    assert m1["files"] == m2["files"]
    assert not torch.equal(tr1, tr3) and m3["files"] != m1["files"]
    # eval and train come from disjoint documents
    ev_docs, tr_docs = set(meta1["eval_document_indices"]), set(meta1["train_document_indices"])
    assert ev_docs and tr_docs and not (ev_docs & tr_docs)
    ev_text = smol_tokenizer.decode(ev1.flatten().tolist())
    tr_text = smol_tokenizer.decode(tr1.flatten().tolist())
    for k in range(40):
        marker = f"doc{k:03d}"
        assert not (marker in ev_text and marker in tr_text), marker
        if marker in ev_text:
            assert k in ev_docs
        if marker in tr_text:
            assert k in tr_docs
    # documents are joined by EOS
    eos = smol_tokenizer.eos_token_id
    assert (tr1 == eos).any()
    assert meta1["tokenizer"]["vocab_size"] == len(smol_tokenizer.get_vocab())
    assert meta1["seed"] == 1 and meta1["n_train_blocks"] == 6 and meta1["seq_len"] == 32


def test_txt_and_parquet_sources(smol_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = _docs(12)
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n\n".join(docs))
    assert vd.read_documents(txt)[0] == docs
    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs}), pqf)
    assert vd.read_documents(pqf)[0] == docs
    m = vd.build_dataset(smol_tokenizer, pqf, tmp_path / "d", seq_len=16, n_train_blocks=None,
                         n_eval_blocks=2, seed=0)
    tr, ev, _ = vd.load_dataset_dir(tmp_path / "d")
    assert tr.shape[1] == 16 and tr.shape[0] == m["n_train_blocks"] > 2 and ev.shape == (2, 16)


def test_one_document_txt_is_split_by_tokens(smol_tokenizer, tmp_path):
    """A plain .txt with single blank lines between paragraphs is one document: eval takes the
    last tokens of its stream, train the tokens before them (no shared text), with a warning;
    a text too short for both is refused, naming the sizes."""
    txt = tmp_path / "book.txt"
    txt.write_text("\n\n".join(_docs(30)))
    assert len(vd.read_documents(txt)[0]) == 1
    with pytest.warns(UserWarning, match="too few to keep eval and train documents apart"):
        m = vd.build_dataset(smol_tokenizer, txt, tmp_path / "d", seq_len=16, n_train_blocks=4,
                             n_eval_blocks=2, seed=0)
    tr, ev, meta = vd.load_dataset_dir(tmp_path / "d")
    assert meta["split"] == "tokens" and tr.shape == (4, 16) and ev.shape == (2, 16)
    stream = smol_tokenizer(txt.read_text().strip(), add_special_tokens=False)["input_ids"]
    assert ev.reshape(-1).tolist() == stream[-32:]
    assert tr.reshape(-1).tolist() == stream[:64] and len(stream) - 32 >= 64
    assert m["n_train_blocks"] == 4
    with pytest.raises(vd.DatasetError, match="tokens in all.*a shorter --seq_len"):
        vd.build_dataset(smol_tokenizer, txt, tmp_path / "e", seq_len=16,
                         n_train_blocks=len(stream) // 16, n_eval_blocks=2)
    # a source with documents to spare is still split by document
    m = vd.build_dataset(smol_tokenizer, tmp_path / "book.txt", tmp_path / "f", seq_len=16,
                         n_train_blocks=2, n_eval_blocks=0)
    assert m["split"] == "documents"


def test_errors(smol_tokenizer, jsonl_source, tmp_path):
    with pytest.raises(vd.DatasetError, match="fewer than.*--n_train_blocks"):
        vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "x", seq_len=64,
                         n_train_blocks=10_000, n_eval_blocks=1)
    with pytest.raises(vd.DatasetError, match="does not exist"):
        vd.read_documents(tmp_path / "nope.jsonl")
    with pytest.raises(vd.DatasetError, match="did you mean 'enwiki'"):  # a typo, not the hub
        vd.read_documents("enwik")
    with pytest.raises(vd.DatasetError, match="does not exist") as e:  # a file, not a dataset
        vd.check_source("texts/code.py")
    assert "hf:" not in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    with pytest.raises(vd.DatasetError, match=r'bad.jsonl:1: expected an object with a string '
                                              r'"text" field \(it has the keys txt\)'):
        vd.read_documents(bad)
    for suffix, raw in ((".txt", "caf\xe9\n"), (".jsonl", '{"text": "caf\xe9"}\n')):
        latin = tmp_path / f"latin{suffix}"
        latin.write_bytes(raw.encode("latin1"))
        with pytest.raises(vd.DatasetError, match=f"latin{suffix} is not UTF-8 text.*iconv"):
            vd.read_documents(latin)
    u16 = tmp_path / "u16.txt"   # the byte-order mark names the encoding to convert from
    u16.write_text("café\n", encoding="utf-16")
    with pytest.raises(vd.DatasetError, match="u16.txt is UTF-16 text.*iconv -f UTF-16 -t"):
        vd.read_documents(u16)
    # a UTF-8 text with a few broken bytes: converting it from latin1 would mangle the rest
    mostly = tmp_path / "mostly.txt"
    mostly.write_bytes(("caf\u00e9 \u2192 " * 400).encode() + b"\xff\xfe" + b"ok\n" * 100)
    with pytest.raises(vd.DatasetError, match=r"UTF-8 text but for 2 byte.*iconv -f utf-8 -t "
                                              r"utf-8 -c \S*mostly.txt") as e:
        vd.read_documents(mostly)
    # the command as printed works from any folder (the path as given, quoted) and its output
    # reads
    import re
    import subprocess
    cmd = re.search(r"`(iconv .+)`", str(e.value)).group(1)
    subprocess.run(["bash", "-c", cmd], cwd="/", check=True)
    assert vd.read_documents(tmp_path / "mostly.utf8.txt")
    binary = tmp_path / "binary.txt"   # UTF-8 by chance, NUL bytes throughout
    binary.write_bytes(b"ab\0\0cd\0" * 200)
    with pytest.raises(vd.DatasetError, match="binary.txt is not a text file .*NUL bytes"):
        vd.read_documents(binary)
    stray = tmp_path / "stray.txt"
    stray.write_bytes(b"a long text " * 200 + b"\0")
    with pytest.warns(UserWarning, match="stray.txt holds 1 NUL byte"):
        vd.read_documents(stray)
    # compressed files, whatever their names say: decompress them
    import bz2
    import gzip
    packed = tmp_path / "packed.txt"
    packed.write_bytes(gzip.compress(b"some text\n" * 100))
    with pytest.raises(vd.DatasetError, match=r"packed.txt is a gzip-compressed file, not text; "
                                              r"decompress it first \(`gunzip -c \S*packed.txt "
                                              r"> \S*packed.unpacked.txt`\)"):
        vd.read_documents(packed)
    gz = tmp_path / "corpus.txt.bz2"
    gz.write_bytes(bz2.compress(b"some text\n" * 100))
    with pytest.raises(vd.DatasetError, match=r"unsupported file type '.bz2'.*bzip2-compressed: "
                                              r"decompress it first \(`bunzip2 -c \S*corpus.txt.bz2 > \S*corpus.txt`"):
        vd.read_documents(gz)
    with pytest.raises(vd.DatasetError, match="no meta.json"):
        vd.load_dataset_dir(tmp_path / "empty")
    vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "ok", seq_len=16, n_train_blocks=2,
                     n_eval_blocks=1)
    (tmp_path / "ok" / "train.pt").write_bytes(b"garbage")
    with pytest.raises(vd.DatasetError, match="sha256"):
        vd.load_dataset_dir(tmp_path / "ok")


def test_hub_source_without_datasets(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_datasets(name, *a, **k):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(vd.DatasetError, match="datasets"):
        vd.read_documents("hf:wikitext:wikitext-2-raw-v1")


def test_enwiki_articles_and_split(smol_tokenizer, tmp_path):
    """The built-in corpus: cached from the gensim wheel; split by article, disjoint."""
    try:
        path = vd.fetch_enwiki()
    except vd.DatasetError as e:
        pytest.skip(f"enwiki corpus not reachable: {e}")
    titles = [t for t, _ in vd.iter_wiki_articles(path)]
    assert len(titles) > 50 and len(set(titles)) == len(titles)
    m = vd.build_dataset(smol_tokenizer, "enwiki", tmp_path / "w", seq_len=128,
                         n_train_blocks=4, n_eval_blocks=2, seed=0)
    assert m["n_documents"] == len(titles)
    assert not set(m["eval_document_indices"]) & set(m["train_document_indices"])
    tr, ev, _ = vd.load_dataset_dir(tmp_path / "w")
    assert tuple(tr.shape) == (4, 128) and tuple(ev.shape) == (2, 128)
    text = smol_tokenizer.decode(tr[0].tolist())
    assert "{{" not in text and "[[" not in text


def test_bom_and_folder_sources(tmp_path):
    """A UTF-8 byte-order mark is not text (no U+FEFF token at the corpus' start); a folder
    given as --data_name is named as a folder, not as a missing file or a hub dataset."""
    from voodoo.data import DatasetError, check_source, read_documents
    f = tmp_path / "bom.txt"
    f.write_bytes("\ufeffHello there.\n\n\nSecond document.".encode("utf-8"))
    docs, _ = read_documents(str(f))
    assert docs == ["Hello there.", "Second document."], docs
    j = tmp_path / "bom.jsonl"
    j.write_bytes('\ufeff{"text": "one"}\n{"text": "two"}\n'.encode("utf-8"))
    assert read_documents(str(j))[0] == ["one", "two"]
    for arg in (str(tmp_path), tmp_path.name):
        import os
        cwd = os.getcwd()
        os.chdir(tmp_path.parent)
        try:
            with pytest.raises(DatasetError, match="is a folder"):
                check_source(arg)
        finally:
            os.chdir(cwd)


def test_up_to_takes_what_the_text_holds(smol_tokenizer, jsonl_source, tmp_path):
    """``up_to=True`` (the CLI's ``--n_train_blocks auto``): a cap, not a demand. A text with
    fewer train tokens gives every whole block it holds (the same blocks a demand for exactly
    that many gives), one with more stops at the cap; the meta says what was asked. Without it
    the same cap is refused, naming how many fit."""
    full = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "all", seq_len=16,
                            n_train_blocks=None, n_eval_blocks=2)
    n = full["n_train_blocks"]
    assert n > 4
    m = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "big", seq_len=16,
                         n_train_blocks=10_000, n_eval_blocks=2, up_to=True)
    assert m["n_train_blocks"] == n and m["n_train_blocks_asked"] == "up to 10000"
    exact = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "exact", seq_len=16,
                             n_train_blocks=n, n_eval_blocks=2)
    assert torch.equal(vd.load_dataset_dir(tmp_path / "big")[0],
                       vd.load_dataset_dir(tmp_path / "exact")[0])
    assert exact["n_train_blocks_asked"] == n
    capped = vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "cap", seq_len=16,
                              n_train_blocks=3, n_eval_blocks=2, up_to=True)
    tr = vd.load_dataset_dir(tmp_path / "cap")[0]
    assert capped["n_train_blocks"] == 3 and torch.equal(tr, vd.load_dataset_dir(
        tmp_path / "exact")[0][:3])
    with pytest.raises(vd.DatasetError,
                       match=rf"fewer than.*\({n} fit: ask for at most {n}\)"):
        vd.build_dataset(smol_tokenizer, jsonl_source, tmp_path / "no", seq_len=16,
                         n_train_blocks=n + 1, n_eval_blocks=2)


def test_too_short_names_what_fits(smol_tokenizer, tmp_path):
    """A text too short for the eval blocks says how many fit; under ``up_to`` a text that
    leaves no train block after them names one train block (the cap is no demand)."""
    txt = tmp_path / "book.txt"
    txt.write_text("\n\n".join(_docs(30)))
    n = len(smol_tokenizer(txt.read_text().strip(), add_special_tokens=False)["input_ids"])
    with pytest.raises(vd.DatasetError, match=rf"at most {n // 16} fit"):
        vd.build_dataset(smol_tokenizer, txt, tmp_path / "a", seq_len=16,
                         n_train_blocks=4, n_eval_blocks=n // 16 + 1)
    with pytest.raises(vd.DatasetError, match=r"eval blocks and 1 train block\(s\) of 16"):
        vd.build_dataset(smol_tokenizer, txt, tmp_path / "b", seq_len=16,
                         n_train_blocks=192, n_eval_blocks=n // 16, up_to=True)


def test_a_text_the_tokenizer_cannot_read_is_refused(tmp_path):
    """Calibration text in a script the vocabulary cannot read (Chinese for a SentencePiece
    vocabulary without byte tokens: transformers 5 drops those characters) is refused, as
    `--eval_text` is, instead of training the gates on the few tokens left; a little of it is
    kept, with a warning."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from transformers import LlamaTokenizer
    from zoo import _spm_tokenizer_dir

    from voodoo.data import DatasetError, build_dataset
    tok = LlamaTokenizer.from_pretrained(str(_spm_tokenizer_dir()))
    zh = tmp_path / "zh.txt"
    zh.write_text("\n\n".join("这是一个用中文写的段落，模型的词表无法读取这些字符。" * 20
                              for _ in range(30)))
    with pytest.raises(DatasetError, match=r"reads back \d+\.\d% of its non-space"):
        build_dataset(tok, zh, tmp_path / "d1", seq_len=16, n_train_blocks=2, n_eval_blocks=1)
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\n\n".join("The model reads this English sentence well enough. " * 4
                                 + "中文字符" * 3 for _ in range(30)))   # ~7% unreadable
    with pytest.warns(UserWarning, match="calibrating on what it reads"):
        build_dataset(tok, mixed, tmp_path / "d2", seq_len=16, n_train_blocks=2,
                      n_eval_blocks=1)


def test_a_hub_name_with_a_slash_gets_the_hf_prefix_hint(tmp_path):
    """`--data_name Salesforce/wikitext:wikitext-2-raw-v1` is read as a missing file (a name
    with a slash is a path); the error now says how to name a hub dataset (a new user's
    report), and a missing .txt path gets no such hint."""
    from voodoo.data import DatasetError, check_source
    with pytest.raises(DatasetError, match=r"--data_name hf:Salesforce/wikitext:wikitext-2-"):
        check_source("Salesforce/wikitext:wikitext-2-raw-v1")
    with pytest.raises(DatasetError) as e:
        check_source(str(tmp_path / "calib.txt"))
    assert "does not exist" in str(e.value) and "hf:" not in str(e.value)
