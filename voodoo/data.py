"""Calibration data: documents → tokens → fixed-length blocks on disk.

A dataset folder holds::

    train.pt    torch.LongTensor (n_train, seq_len)   token ids
    eval.pt     torch.LongTensor (n_eval, seq_len)    token ids, from documents disjoint from train
    meta.json   tokenizer (name, vocab size, hash), source, seed, counts, sha256 of both .pt files

Documents are split into train and eval **by document** (by article for the built-in corpus), in an
order fixed by ``seed``: the shuffled documents fill the eval blocks first, the rest fill the train
blocks. A source with too few documents for that (eval would take them all, e.g. a plain ``.txt``
that is one document) is split by tokens instead, with a warning: eval takes the last tokens of the
stream, train the tokens before them (``meta.json``'s ``split``). Inside each split, documents are
tokenized without special tokens, concatenated with EOS between documents and cut into blocks of
``seq_len`` (the remainder is dropped). No BOS is inserted; a block may start in the middle of a
document.

Sources (``build_dataset(source=...)``):

* ``"enwiki"`` (the default): the shortened English Wikipedia dump (MediaWiki XML, CC BY-SA)
  shipped as test data in the gensim 4.4.0 wheel, fetched with ``pip download`` (gensim is never
  installed), cached under ``<cache>/data``; articles (namespace 0, no redirects) with their wiki
  markup stripped.
* a local ``.txt`` (documents separated by two or more blank lines; a file without such breaks is
  one document), ``.jsonl`` (one JSON object per line with a ``"text"`` field) or ``.parquet``
  file (a ``"text"`` column).
* ``"hf:NAME"``, ``"hf:NAME:CONFIG"`` or a bare hub name: a Hugging Face ``datasets`` dataset
  with a ``"text"`` column (split ``train``); needs ``datasets`` and network.

wikitext-2's *test* split is for evaluation only: never calibrate on it.
"""

from __future__ import annotations

import bz2
import difflib
import hashlib
import html
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from voodoo.fsutil import atomic_write_bytes as _atomic_write_bytes
from voodoo.fsutil import sha256_file as _sha256_file
from voodoo.llamacpp import cache_root

#: The built-in calibration corpus.
DEFAULT_SOURCE = "enwiki"
GENSIM_VERSION = "4.4.0"
#: The dump inside the gensim wheel (a shortened enwiki pages-articles XML, bz2).
ENWIKI_MEMBER = ("gensim/test/test_data/"
                 "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
#: sha256 of that member (identical in every platform wheel of gensim 4.4.0).
ENWIKI_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"

#: Format version of a dataset folder (bump when the layout changes).
DATASET_FORMAT = 1
#: Articles shorter than this many characters after markup stripping are skipped.
MIN_ARTICLE_CHARS = 200


class DatasetError(RuntimeError):
    """A dataset folder is missing, incomplete or corrupt, or a source cannot be read."""


# ------------------------------------------------------------------------------ file helpers


def _atomic_torch_save(obj, path: Path) -> None:
    # through a buffer: torch.save names the zip's records after a real file, which would make
    # the bytes depend on the temporary name
    buf = io.BytesIO()
    torch.save(obj, buf)
    _atomic_write_bytes(path, buf.getvalue())


# ------------------------------------------------------------------------- the enwiki corpus
def _extract_enwiki(wheel: Path, dst: Path) -> Path:
    """Copies ``ENWIKI_MEMBER`` out of a gensim wheel to ``dst`` (atomically) after checking
    its sha256. Raises DatasetError when the member is missing or differs."""
    with zipfile.ZipFile(wheel) as z:
        if ENWIKI_MEMBER not in z.namelist():
            raise DatasetError(f"{wheel.name} has no member {ENWIKI_MEMBER}")
        data = z.read(ENWIKI_MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != ENWIKI_SHA256:
        raise DatasetError(f"{ENWIKI_MEMBER} in {wheel.name} has sha256 {digest}, expected "
                           f"{ENWIKI_SHA256}")
    _atomic_write_bytes(dst, data)
    return dst


def fetch_enwiki() -> Path:
    """Path of the cached enwiki dump (``<cache>/data/<member name>``), fetched on first use.

    Runs ``pip download --no-deps gensim==4.4.0 --only-binary :all:`` into a temporary folder
    (any platform's wheel carries the dump; gensim is not installed), extracts the bz2 member and
    checks its sha256. Raises DatasetError when pip fails (PyPI unreachable) or the member is
    missing or differs."""
    dst = cache_root() / "data" / Path(ENWIKI_MEMBER).name
    if dst.is_file() and _sha256_file(dst) == ENWIKI_SHA256:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", tmp, f"gensim=={GENSIM_VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("gensim-*.whl"))
        if r.returncode or not wheels:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
            raise DatasetError(f"could not fetch the enwiki calibration corpus: `{' '.join(cmd)}` "
                               f"failed (exit {r.returncode}); check that PyPI is reachable, or "
                               f"pass a local .txt/.jsonl/.parquet source.\n{tail}")
        return _extract_enwiki(wheels[0], dst)


_NS = re.compile(r"^\{[^}]*\}")


def iter_wiki_articles(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yields ``(title, plain text)`` for every article of a MediaWiki XML dump (``.xml`` or
    ``.xml.bz2``), in file order: namespace 0 only, redirects skipped, markup stripped with
    :func:`strip_wiki_markup`, articles shorter than ``MIN_ARTICLE_CHARS`` skipped."""
    import xml.etree.ElementTree as ET
    path = Path(path)
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _NS.sub("", elem.tag) != "page":
                continue
            fields = {_NS.sub("", c.tag): c for c in elem}
            ns = fields.get("ns")
            rev = fields.get("revision")
            text_el = None
            if rev is not None:
                for c in rev:
                    if _NS.sub("", c.tag) == "text":
                        text_el = c
            title = fields["title"].text if "title" in fields else ""
            ok = (ns is not None and (ns.text or "").strip() == "0" and "redirect" not in fields
                  and text_el is not None and text_el.text
                  and not text_el.text.lstrip().lower().startswith("#redirect"))
            if ok:
                text = strip_wiki_markup(text_el.text)
                if len(text) >= MIN_ARTICLE_CHARS:
                    yield title or "", text
            elem.clear()


def _remove_balanced(text: str, open_: str, close: str, keep=None) -> str:
    """Removes every balanced ``open_ … close`` span (nested spans included). ``keep(inner)``,
    when given, returns a replacement for a span (``None`` removes it)."""
    out = []
    i = 0
    n = len(text)
    lo, lc = len(open_), len(close)
    while i < n:
        j = text.find(open_, i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        depth = 0
        k = j
        while k < n:
            if text.startswith(open_, k):
                depth += 1
                k += lo
            elif text.startswith(close, k):
                depth -= 1
                k += lc
                if depth == 0:
                    break
            else:
                k += 1
        inner = text[j + lo:k - lc] if depth == 0 else text[j + lo:]
        if keep is not None:
            rep = keep(inner)
            if rep:
                out.append(rep)
        i = k
    return "".join(out)


_DROP_LINK_NS = re.compile(r"^\s*:?\s*(file|image|media|category|wikipedia|wp|template|help|"
                           r"portal|special|user|talk|wikt|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I)
_LINK = re.compile(r"\[\[([^\[\]|]*)\|?([^\[\]]*)\]\]")
_EXTLINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]*\s*([^\]]*)\]")
_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_BLOCK_TAGS = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap)"
                         r"[^>]*>.*?</\1>", re.S | re.I)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^\s*=+\s*(.*?)\s*=+\s*$", re.M)
_LIST = re.compile(r"^[*#:;]+\s*", re.M)
_MAGIC = re.compile(r"__[A-Z]+__")


def _link_text(inner: str) -> str | None:
    if _DROP_LINK_NS.match(inner):
        return None
    return "[[" + inner + "]]"  # plain links are rewritten afterwards by _LINK


def strip_wiki_markup(text: str) -> str:
    """Wiki markup → plain text, reasonably: drops comments, ``<ref>``s, templates ``{{…}}``,
    tables ``{|…|}``, file/category/interlanguage links and math/gallery blocks; ``[[a|b]]`` →
    ``b``, ``[[a]]`` → ``a``, ``[http://x text]`` → ``text``; headings ``== H ==`` → ``H``; bold,
    italics, list markers and HTML tags removed; HTML entities decoded; runs of blank lines
    collapsed. Not a full MediaWiki parser."""
    t = _COMMENT.sub("", text)
    t = _REF.sub("", t)
    t = _BLOCK_TAGS.sub("", t)
    t = _remove_balanced(t, "{{", "}}")
    t = _remove_balanced(t, "{|", "|}")
    t = _remove_balanced(t, "[[", "]]", keep=_link_text)
    for _ in range(3):  # nested plain links inside kept captions
        t2 = _LINK.sub(lambda m: m.group(2) or m.group(1), t)
        if t2 == t:
            break
        t = t2
    t = _EXTLINK.sub(lambda m: m.group(1), t)
    t = _HEADING.sub(lambda m: m.group(1), t)
    t = t.replace("'''", "").replace("''", "")
    t = _TAG.sub("", t)
    t = _MAGIC.sub("", t)
    t = html.unescape(t)
    t = _LIST.sub("", t)
    lines = [ln.strip() for ln in t.split("\n")]
    t = "\n".join(lines)
    t = re.sub(r"\n{3,}", "\n\n", t)
    t = re.sub(r"[ \t\u00a0]{2,}", " ", t)
    return t.strip()


# ------------------------------------------------------------------------------------ sources
#: magic bytes of compressed files -> (format, the command that writes ``FILE`` decompressed to
#: standard output, the suffix its files usually have)
_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip -c", ".gz"),
               (b"BZh", "bzip2", "bunzip2 -c", ".bz2"),
               (b"\xfd7zXZ\x00", "xz", "unxz -c", ".xz"),
               (b"\x28\xb5\x2f\xfd", "zstd", "unzstd -c", ".zst"),
               (b"PK\x03\x04", "zip", "unzip -p", ".zip"))


def compressed_format(path: str | os.PathLike) -> tuple[str, str] | None:
    """``(format, shell command that decompresses it beside it)`` when the file starts with
    the magic bytes of gzip, bzip2, xz, zstd or zip (whatever its name says), else None (also
    when unreadable). The command names ``path`` as given, quoted, and writes ``NAME`` less
    the compression suffix (``NAME.unpacked.SUFFIX`` when the name has none):
    ``gunzip -c t.txt.gz > t.txt``."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    for magic, fmt, cmd, suffix in _COMPRESSED:
        if head.startswith(magic):
            p = Path(path)
            out = (p.with_suffix("") if p.suffix.lower() == suffix
                   else p.with_name(f"{p.stem}.unpacked{p.suffix}"))
            return fmt, f"{cmd} {_sh(p)} > {_sh(out)}"
    return None


def _sh(path: Path) -> str:
    """``path`` as the user gave it, quoted for a shell command in a message."""
    import shlex
    return shlex.quote(str(path))


def _utf8_name(path: Path) -> Path:
    """Where a message's conversion command writes: beside ``path``, ``NAME.utf8.SUFFIX``."""
    return path.with_name(f"{path.stem}.utf8{path.suffix}")


def _not_utf8(path: Path, e: UnicodeDecodeError) -> DatasetError:
    """The error for a file that does not decode as UTF-8, with what to do: decompress it (a
    gzip/bzip2/xz/zstd/zip file, told by its magic bytes), convert it from UTF-16/32 (its
    byte-order mark), drop the few bytes that are not UTF-8 in an otherwise UTF-8 text
    (``iconv -c``: at most 1 in 1000 bytes, the first one's offset named), else convert it from
    Latin-1 (a guess)."""
    packed = compressed_format(path)
    if packed:
        fmt, cmd = packed
        return DatasetError(f"{path} is a {fmt}-compressed file, not text; decompress it first "
                            f"(`{cmd}`) and give the text file")
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
    except OSError:
        raw = b""
    head = raw[:4]
    src = ("UTF-32" if head[:4] in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff") else
           "UTF-16" if head[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin1")
    if src == "latin1" and raw:
        bad = raw.decode("utf-8", errors="replace").count("\ufffd")
        if bad * 1000 <= len(raw):  # a UTF-8 text with a few broken bytes: latin1 would mangle it
            return DatasetError(
                f"{path} is UTF-8 text but for {bad} byte(s) that are not ({e}); fix those bytes, "
                f"or drop them: `iconv -f utf-8 -t utf-8 -c {_sh(path)} > {_sh(_utf8_name(path))}`")
    what = f"{src} text (its byte-order mark says so)" if src != "latin1" else "UTF-8 text"
    return DatasetError(f"{path} is {'not ' if src == 'latin1' else ''}{what} ({e}); convert it "
                        f"first, e.g. `iconv -f {src} -t utf-8 {_sh(path)} > "
                        f"{_sh(_utf8_name(path))}`")


def _read_txt(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    nul = text.count("\0")
    if nul * 100 > len(text):  # UTF-8 by chance: a binary file, not text
        raise DatasetError(f"{path} is not a text file ({nul} of its {len(text)} characters are "
                           "NUL bytes); give a UTF-8 text file")
    if nul:  # --eval_text refuses them; as calibration text they are tokens like any other
        warnings.warn(f"{path} holds {nul} NUL byte(s); they are calibrated on as they are "
                      "(as --eval_text the file would be refused)", stacklevel=2)
    docs = [d.strip() for d in re.split(r"\n[ \t]*\n[ \t]*\n+", text)]
    return [d for d in docs if d]


def _json_kind(v) -> str:
    """JSON's name for a decoded value's type (``array`` for a list...)."""
    return {list: "array", dict: "object", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _read_jsonl(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    docs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{i}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            found = (f"it has the keys {', '.join(map(str, list(obj)[:8]))}"
                     + (", ..." if len(obj) > 8 else "") if isinstance(obj, dict) and obj
                     else f"it is a JSON {_json_kind(obj)}" if not isinstance(obj, dict)
                     else "it is an empty object")
            if isinstance(obj, dict) and "text" in obj:
                found = f"its \"text\" is a JSON {_json_kind(obj['text'])}"
            raise DatasetError(f"{path}:{i}: expected an object with a string \"text\" field "
                               f"({found}); one document per line, as "
                               f"{{\"text\": \"...\"}}")
        if obj["text"].strip():
            docs.append(obj["text"])
    return docs


def _read_parquet(path: Path) -> list[str]:
    import pyarrow.parquet as pq
    table = pq.read_table(path)
    if "text" not in table.column_names:
        raise DatasetError(f"{path} has no \"text\" column (columns: {table.column_names})")
    return [t for t in table.column("text").to_pylist() if isinstance(t, str) and t.strip()]


def _read_hub(name: str) -> list[str]:
    try:
        import datasets  # optional
    except ImportError:
        raise DatasetError(f"source {name!r} is not a local file; loading it from the Hugging "
                           "Face hub needs the `datasets` package (pip install datasets), or pass "
                           "a local .txt/.jsonl/.parquet file or 'enwiki'") from None
    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None, split="train")
    except Exception as e:  # offline, unknown name, ...
        raise DatasetError(f"could not load hub dataset {name!r} ({type(e).__name__}: {e}); "
                           "is the hub reachable? Use a local file or 'enwiki' offline") from None
    if "text" not in ds.column_names:
        raise DatasetError(f"hub dataset {name!r} has no \"text\" column ({ds.column_names})")
    return [t for t in ds["text"] if isinstance(t, str) and t.strip()]


#: suffixes that name a file, not a Hugging Face dataset (no hf: hint for a missing one)
_FILE_SUFFIXES = frozenset((".txt", ".jsonl", ".parquet", ".json", ".csv", ".tsv", ".md", ".py",
                            ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".html", ".xml",
                            ".pdf", ".arrow"))


def check_source(source: str | os.PathLike) -> None:
    """The checks :func:`read_documents` makes on a source before reading it, without reading
    it: a local file that does not exist or has a suffix other than .txt/.jsonl/.parquet.
    Raises DatasetError (what is wrong and what to give instead); returns None otherwise (hub
    names and the default are checked when fetched)."""
    s = str(source)
    if s == DEFAULT_SOURCE or s.startswith("hf:"):
        return
    p = Path(s).expanduser()
    if p.is_dir():
        raise DatasetError(f"--data_name {p} is a folder; give one .txt, .jsonl or .parquet "
                           "file (concatenate the folder's texts into one)")
    if p.is_file():
        if p.suffix.lower() not in (".txt", ".jsonl", ".parquet"):
            packed = compressed_format(p)
            raise DatasetError(f"{p}: unsupported file type {p.suffix.lower()!r} "
                               "(expected .txt, .jsonl or .parquet)" + (
                                   f"; it is {packed[0]}-compressed: decompress it first "
                                   f"(`{packed[1]}`)" if packed else ""))
    elif p.suffix.lower() in (".txt", ".jsonl", ".parquet") or os.sep in s:
        hub = (f"; a Hugging Face dataset is named with hf: (--data_name hf:{s}, which "
               "needs the `datasets` package and the hub)"
               if p.suffix.lower() not in _FILE_SUFFIXES and not
               Path(s).is_absolute() and s.count("/") == 1 and not s.startswith(".") else "")
        raise DatasetError(f"calibration text {p} does not exist (--data_name): give a "
                           ".txt, .jsonl or .parquet file that exists, or leave --data_name "
                           f"out for the default enwiki text{hub}")
    elif s != DEFAULT_SOURCE and difflib.get_close_matches(s.lower(), [DEFAULT_SOURCE],
                                                           cutoff=0.7):
        raise DatasetError(f"--data_name {s!r} is neither a file nor the built-in text: did you "
                           f"mean {DEFAULT_SOURCE!r}? (a Hugging Face dataset is named with hf:, "
                           f"e.g. --data_name hf:{s})")


def local_source_description(source: str | os.PathLike) -> str | None:
    """The ``source`` entry that :func:`build_dataset` would write to meta.json for a local
    ``.txt``/``.jsonl``/``.parquet`` file as it is now (its resolved path and sha256), so a
    dataset folder built from an older version of the file can be told apart; None for the
    default enwiki text, a hub dataset, or a path that is not a file."""
    s = str(source)
    if s == DEFAULT_SOURCE or s.startswith("hf:"):
        return None
    p = Path(s).expanduser()
    if not p.is_file():
        return None
    return f"{p.resolve()} (sha256 {_sha256_file(p)})"


def read_documents(source: str | os.PathLike) -> tuple[list[str], str]:
    """Reads a source into a list of documents (strings, file order) and a canonical source
    description for meta.json. See the module docstring for the sources.

    Raises DatasetError (unreadable source, missing ``text`` field/column, no documents)."""
    s = str(source)
    if s == DEFAULT_SOURCE:
        path = fetch_enwiki()
        docs = [text for _, text in iter_wiki_articles(path)]
        desc = (f"enwiki (gensim=={GENSIM_VERSION}:{Path(ENWIKI_MEMBER).name}, "
                f"sha256 {ENWIKI_SHA256})")
    else:
        check_source(s)
        p = Path(s).expanduser()
        hub = s[3:] if s.startswith("hf:") else None
        if hub is None and p.is_file():
            suffix = p.suffix.lower()
            docs = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}[suffix](p)
            desc = local_source_description(p)
            if re.search(r"wiki.*test|test.*wiki", p.name, re.I):
                warnings.warn(f"{p.name} looks like an evaluation split (wikitext test?); "
                              "calibrating on evaluation text makes the evaluation meaningless",
                              stacklevel=2)
        else:
            hub = hub or s
            docs = _read_hub(hub)
            desc = f"hf:{hub}"
    if not docs:
        raise DatasetError(f"calibration text {s!r} (--data_name) holds no documents (it is "
                           "empty or all blank): give a file with text, or leave --data_name "
                           "out for the default enwiki text")
    return docs, desc


# -------------------------------------------------------------------------------- tokenizing
def tokenizer_fingerprint(tokenizer) -> dict:
    """``{"name", "vocab_size", "eos_token_id", "sha256"}`` of a transformers tokenizer; the hash
    covers the vocabulary (token → id) and the EOS id, enough to tell tokenizers apart."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    h.update(f"eos={tokenizer.eos_token_id}".encode())
    return {"name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            "vocab_size": len(vocab), "eos_token_id": tokenizer.eos_token_id,
            "sha256": h.hexdigest()}


def _token_stream(tokenizer, docs: Sequence[str], eos: int, n_tokens: int | None,
                  batch: int = 64) -> tuple[list[int], int]:
    """Concatenates tokenized ``docs`` with ``eos`` between consecutive documents; stops once
    ``n_tokens`` tokens are gathered (None: all). Returns (ids, documents used)."""
    ids: list[int] = []
    used = 0
    for start in range(0, len(docs), batch):
        chunk = list(docs[start:start + batch])
        enc = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        for toks in enc:
            if used:
                ids.append(eos)
            ids.extend(toks)
            used += 1
            if n_tokens is not None and len(ids) >= n_tokens:
                return ids, used
    return ids, used


def _blocks(ids: list[int], seq_len: int, n_blocks: int | None) -> torch.Tensor:
    n = len(ids) // seq_len if n_blocks is None else min(n_blocks, len(ids) // seq_len)
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).reshape(n, seq_len)


#: the way out when a corpus is too small for the blocks asked of it
_NEED_MORE = (" (ask for fewer blocks with --n_eval_blocks/--n_train_blocks, a shorter "
              "--seq_len, or a bigger --data_name source)")


#: Refused when the tokenizer reads back less than this fraction of the calibration text's
#: non-space characters (``decode(encode(text))``; warned below :data:`READ_WARN`): a text in a
#: script the vocabulary cannot read (e.g. Chinese for a SentencePiece vocabulary without byte
#: tokens) becomes ``<unk>`` tokens, or nothing at all (transformers 5 drops such characters).
#: The same floor as ``--eval_text``'s for llama.cpp's tokenizer (``voodoo.llamatext``).
READ_REFUSE = 0.5
READ_WARN = 0.99
_READ_SAMPLE_CHARS = 200_000


def _check_readable(tokenizer, docs: Sequence[str], desc: str) -> None:
    """Raises DatasetError when ``tokenizer`` reads back less than :data:`READ_REFUSE` of the
    non-space characters of ``docs`` (their first 200,000 characters), warns below
    :data:`READ_WARN`."""
    sample, n = [], 0
    for d in docs:
        sample.append(d[:_READ_SAMPLE_CHARS - n])
        n += len(sample[-1])
        if n >= _READ_SAMPLE_CHARS:
            break
    text = "\n".join(sample)
    before = sum(1 for ch in text if not ch.isspace())
    if before == 0:
        return
    back = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"])
    for tok in {getattr(tokenizer, "unk_token", None), "\u2047"} - {None}:
        back = back.replace(tok, " ")   # <unk> (and SentencePiece's ⁇ for it) read nothing
    frac = min(1.0, sum(1 for ch in back if not ch.isspace()) / before)
    if frac >= READ_WARN:
        return
    what = (f"{desc}: the model's tokenizer reads back {100 * frac:.1f}% of its non-space "
            "characters (the rest become unknown tokens or are dropped: a script its "
            "vocabulary cannot read)")
    if frac < READ_REFUSE:
        raise DatasetError(f"{what}; the gates would be trained on what is left: calibrate on "
                           "text in a language and script the model reads (--data_name)")
    warnings.warn(f"{what}; calibrating on what it reads", stacklevel=3)


def build_dataset(tokenizer, source: str | os.PathLike = DEFAULT_SOURCE,
                  output_dir: str | os.PathLike = "data", seq_len: int = 512,
                  n_train_blocks: int | None = 128, n_eval_blocks: int = 16,
                  seed: int = 0, up_to: bool = False) -> dict:
    """Builds a dataset folder (``train.pt``, ``eval.pt``, ``meta.json``) and returns the meta.

    ``tokenizer``: a transformers tokenizer with an EOS token. ``seq_len``: tokens per block.
    ``n_train_blocks``: train blocks (None: every block the train documents give);
    ``up_to``: ``n_train_blocks`` is a cap, not a demand: fewer (at least one) when the text
    holds fewer (the CLI's ``--n_train_blocks auto``);
    ``n_eval_blocks``: eval blocks (may be 0). Documents are shuffled with ``seed``; eval takes
    leading documents until it has ``n_eval_blocks * seq_len`` tokens, train the documents after
    them, so no document is in both. Same tokenizer, source, sizes and seed → identical files.

    Raises DatasetError when the source is unreadable or too small for the requested blocks,
    ValueError for bad sizes or a tokenizer without EOS. Files are written atomically; meta.json
    is written last, so a folder with a meta.json is complete."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if n_eval_blocks < 0 or (n_train_blocks is not None and n_train_blocks < 1):
        raise ValueError(f"need n_train_blocks >= 1 and n_eval_blocks >= 0, got "
                         f"{n_train_blocks}, {n_eval_blocks}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; Voodoo puts EOS between documents")
    docs, desc = read_documents(source)
    _check_readable(tokenizer, docs, desc)
    order = np.random.default_rng(seed).permutation(len(docs))
    shuffled = [docs[i] for i in order]

    n_eval_tok = n_eval_blocks * seq_len
    n_train_tok = None if n_train_blocks is None else n_train_blocks * seq_len
    split = "documents"
    if n_eval_blocks:
        eval_ids, n_eval_docs = _token_stream(tokenizer, shuffled, eos, n_eval_tok)
        if len(eval_ids) < n_eval_tok:
            raise DatasetError(f"{desc}: all {len(docs)} document(s) give {len(eval_ids)} "
                               f"tokens, fewer than the {n_eval_tok} that {n_eval_blocks} eval "
                               f"blocks of {seq_len} need (at most "
                               f"{len(eval_ids) // seq_len} fit){_NEED_MORE}")
    else:
        eval_ids, n_eval_docs = [], 0
    if n_eval_blocks and n_eval_docs >= len(docs):
        # too few documents to split by document (e.g. a plain .txt with no triple newline is
        # one document): the token stream is split instead, eval = its last n_eval_tok tokens,
        # train = what comes before them, so the two still share no text
        stream, _ = _token_stream(tokenizer, shuffled, eos, None)
        if len(stream) - n_eval_tok < max(seq_len, 0 if up_to else n_train_tok or 0):
            fit = max(0, len(stream) - n_eval_tok) // seq_len
            raise DatasetError(f"{desc}: {len(stream)} tokens in all; {n_eval_blocks} eval "
                               f"blocks and {1 if up_to else n_train_blocks or 1} train "
                               f"block(s) of {seq_len} "
                               f"need more ({fit} train block(s) fit after the eval blocks"
                               f"{f': ask for at most {fit}' if fit else ''})"
                               f"{_NEED_MORE}")
        split = "tokens"
        warnings.warn(f"{desc}: {len(docs)} document(s), too few to keep eval and train "
                      f"documents apart; eval takes the last {n_eval_tok} tokens of the text "
                      "and train the tokens before them", stacklevel=2)
        eval_ids, train_ids = stream[len(stream) - n_eval_tok:], stream[:len(stream) - n_eval_tok]
        n_eval_docs, n_train_docs = 0, len(docs)
    else:
        train_docs = shuffled[n_eval_docs:]
        train_ids, n_train_docs = _token_stream(tokenizer, train_docs, eos, n_train_tok)
    if n_train_tok is not None and len(train_ids) < n_train_tok and not up_to:
        fit = len(train_ids) // seq_len
        raise DatasetError(f"{desc}: the {len(train_docs)} train documents give "
                           f"{len(train_ids)} tokens, fewer than the {n_train_tok} that "
                           f"{n_train_blocks} train blocks of {seq_len} need ({fit} fit"
                           f"{f': ask for at most {fit}' if fit else ''})"
                           f"{_NEED_MORE}")
    train = _blocks(train_ids, seq_len, n_train_blocks)
    if train.shape[0] == 0:
        raise DatasetError(f"{desc}: not enough train tokens for one block of {seq_len}"
                           f"{_NEED_MORE}")
    evalb = _blocks(eval_ids, seq_len, n_eval_blocks)

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # the folder is incomplete until meta is back
    _atomic_torch_save(train, out / "train.pt")
    _atomic_torch_save(evalb, out / "eval.pt")
    meta = {
        "format": DATASET_FORMAT,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": desc,
        "source_arg": str(source),
        "seed": seed,
        "seq_len": seq_len,
        "n_train_blocks": int(train.shape[0]),
        "n_train_blocks_asked": (f"up to {n_train_blocks}" if up_to and n_train_blocks
                                 else n_train_blocks),
        "n_eval_blocks": int(evalb.shape[0]),
        "n_documents": len(docs),
        "n_eval_documents": n_eval_docs,
        "n_train_documents": n_train_docs,
        # documents in file order: eval = these indices, train = the next n_train_documents
        # of the seed's permutation
        "eval_document_indices": sorted(int(i) for i in order[:n_eval_docs]),
        "train_document_indices": sorted(int(i) for i in order[n_eval_docs:
                                                                 n_eval_docs + n_train_docs]),
        "split": split,
        "separator": "eos",
        "bos": False,
        "files": {"train.pt": _sha256_file(out / "train.pt"),
                  "eval.pt": _sha256_file(out / "eval.pt")},
    }
    _atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    return meta


def write_heldout_text(data_dir: str | os.PathLike, out_path: str | os.PathLike,
                       n_chars: int = 400_000) -> Path:
    """Writes calibration-source text that the dataset in ``data_dir`` does *not* use, for
    validation with llama.cpp's tools (``llama-perplexity -f``) without touching the
    evaluation text: documents of the same source, taken from the end of the dataset's
    shuffled order and skipping every document its train or eval blocks came from, joined by
    blank lines, until ``n_chars`` characters. Written atomically.

    Raises DatasetError if the folder has no meta.json or the unused documents are fewer than
    ``n_chars`` characters."""
    data_dir = Path(data_dir)
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{data_dir} is not a dataset folder ({e}); run `voodoo data` "
                           "first") from None
    docs, desc = read_documents(meta.get("source_arg", DEFAULT_SOURCE))
    used = set(meta["eval_document_indices"]) | set(meta["train_document_indices"])
    order = np.random.default_rng(meta["seed"]).permutation(len(docs))
    picked, n = [], 0
    for i in order[::-1]:
        if int(i) in used or not docs[i].strip():
            continue
        picked.append(docs[i].strip())
        n += len(picked[-1]) + 2
        if n >= n_chars:
            break
    if n < n_chars:
        raise DatasetError(f"{desc}: only {n} characters of documents unused by {data_dir}; "
                           f"ask for fewer than {n_chars}")
    _atomic_write_bytes(Path(out_path), ("\n\n".join(picked) + "\n").encode())
    return Path(out_path)


def load_dataset_dir(data_dir: str | os.PathLike,
                     verify: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Loads a folder written by :func:`build_dataset`.

    Returns ``(train, eval, meta)``: LongTensors ``(n_train, seq_len)`` and ``(n_eval, seq_len)``
    and the meta dict. ``verify`` checks the files' sha256 against meta.json. Raises DatasetError
    when the folder, meta.json or a .pt file is missing, a checksum differs, or a tensor has the
    wrong dtype or shape."""
    d = Path(data_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise DatasetError(f"{d} is not a dataset folder (no meta.json); build it with "
                           "voodoo.data.build_dataset")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{meta_path} is corrupt ({e})") from None
    tensors = []
    for name, n_key in (("train.pt", "n_train_blocks"), ("eval.pt", "n_eval_blocks")):
        p = d / name
        if not p.is_file():
            raise DatasetError(f"{p} is missing")
        if verify and _sha256_file(p) != meta.get("files", {}).get(name):
            raise DatasetError(f"{p} does not match the sha256 in meta.json (corrupt or "
                               "overwritten); rebuild the dataset")
        try:
            t = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:
            raise DatasetError(f"{p} cannot be read ({type(e).__name__}: {e})") from None
        want = (meta.get(n_key), meta.get("seq_len"))
        if not isinstance(t, torch.Tensor) or t.dtype != torch.long or tuple(t.shape) != want:
            raise DatasetError(f"{p}: expected a LongTensor of shape {want}, got "
                               f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        tensors.append(t)
    return tensors[0], tensors[1], meta


def iter_batches(blocks: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    """Yields consecutive ``(≤batch_size, seq_len)`` slices of ``blocks`` (no shuffling)."""
    for i in range(0, blocks.shape[0], batch_size):
        yield blocks[i:i + batch_size]
