"""Text that llama.cpp's tokenizer can read with a given GGUF's vocabulary.

llama.cpp's SentencePiece tokenizer (``tokenizer.ggml.model == "llama"``, ``llm_tokenizer_spm``
in ``src/llama-vocab.cpp``) splits the text into UTF-8 characters, merges them into vocabulary
pieces, and sends every character it could not place through ``llama_vocab::byte_to_token``:
the ``<0xHH>`` byte token, else the one-byte string itself, else ``std::out_of_range`` — the
tool aborts ("terminate called after throwing an instance of 'std::out_of_range'"). Vocabularies
with SentencePiece's byte fallback (every real Llama-family tokenizer) never get there; a
vocabulary without it (a small or old SentencePiece model) crashes llama-perplexity and
llama-imatrix on the first character it does not hold, often the newline. The other vocabulary
types (byte-level BPE, WordPiece, Unigram) read any text.

So every text Voodoo hands to a llama.cpp tool goes through :func:`readable_text` (a file) or
:func:`llama_join` (decoded calibration blocks): unchanged when the vocabulary reads it, else
with each unreadable character replaced by a space (said once, naming the characters).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from .progress import log

__all__ = ["untokenizable", "readable", "readable_text", "llama_join", "text_note",
           "UnreadableTextError", "MIN_READABLE"]

#: the least fraction of a text's non-space characters that must survive the replacement;
#: below it the text is refused (it would be scored as mostly blanks)
MIN_READABLE = 0.5


class UnreadableTextError(ValueError):
    """A text of which llama.cpp's tokenizer, with the model's vocabulary, cannot read most."""

#: SentencePiece's escaped space (U+2581), what llama.cpp turns " " into before the lookup
_SPACE = "\u2581"

_VOCABS: dict[tuple, frozenset | None] = {}
_SAID: set[str] = set()


def _spm_vocab(gguf_path) -> frozenset | None:
    """The token strings of a GGUF whose vocabulary is SentencePiece without a byte token for
    every byte; None for any other vocabulary (it reads any text), and for a file that cannot
    be read as GGUF (the llama.cpp tool it is for then says what is wrong with it). Cached
    per file version."""
    try:
        st = os.stat(gguf_path)
    except OSError:
        return None
    key = (os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)
    if key not in _VOCABS:
        from .ggufio import read_gguf
        try:
            r = read_gguf(gguf_path)
        except (OSError, ValueError):
            _VOCABS[key] = None
            return None
        model = r.fields.get("tokenizer.ggml.model")
        toks = r.fields.get("tokenizer.ggml.tokens")
        vocab = None
        if model is not None and toks is not None and model.contents() == "llama":
            s = frozenset(toks.contents())
            if not all(f"<0x{b:02X}>" in s for b in range(256)):
                vocab = s
        _VOCABS[key] = vocab
    return _VOCABS[key]


def _readable(ch: str, vocab: frozenset) -> bool:
    if (_SPACE if ch == " " else ch) in vocab:
        return True
    return all(f"<0x{b:02X}>" in vocab or (b < 0x80 and chr(b) in vocab)
               for b in ch.encode("utf-8"))


def untokenizable(gguf_path: str | os.PathLike, text: str) -> list[str]:
    """The distinct characters of ``text`` that llama.cpp's tokenizer cannot read with
    ``gguf_path``'s vocabulary (it aborts on them; module docstring), sorted; ``[]`` when it
    reads all of them, and always for vocabularies other than byte-fallback-less
    SentencePiece. Reads the GGUF's metadata only."""
    vocab = _spm_vocab(gguf_path)
    if vocab is None:
        return []
    return sorted(ch for ch in set(text) if not _readable(ch, vocab))


def _replace(text: str, bad: Iterable[str]) -> str:
    table = {ord(ch): " " for ch in bad}
    return text.translate(table)


def _shown(bad: list[str]) -> str:
    s = ", ".join(repr(c) for c in bad[:12]) + (f" and {len(bad) - 12} more"
                                                if len(bad) > 12 else "")
    if "\ufffd" in bad:
        s += " ('\ufffd' stands for bytes that are not UTF-8)"
    return s


def _say(what: str, bad: list[str]) -> None:
    if what in _SAID:  # once per text and process (a table scores several files on it)
        return
    _SAID.add(what)
    log(f"{what}: llama.cpp's tokenizer cannot read {len(bad)} character(s) with "
        f"this model's vocabulary (SentencePiece without byte tokens), so they are replaced "
        f"by spaces: {_shown(bad)}")


def _nonspace(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def readable(gguf_path: str | os.PathLike, text: str) -> tuple[str, list[str]]:
    """``(text with every character llama.cpp cannot read with gguf_path's vocabulary replaced
    by a space, those characters)``; the text unchanged and ``[]`` when it reads them all."""
    bad = untokenizable(gguf_path, text)
    return (_replace(text, bad) if bad else text), bad


def llama_join(gguf_path: str | os.PathLike, pieces: Iterable[str], what: str = "text") -> str:
    """``"\\n".join(pieces)`` made readable for llama.cpp with ``gguf_path``'s vocabulary:
    pieces are joined by a newline, or a space when the vocabulary cannot read a newline, and
    any other character it cannot read becomes a space (said once on stderr, naming ``what``).
    For decoded calibration or eval blocks handed to llama-imatrix / llama-perplexity."""
    sep = "\n" if not untokenizable(gguf_path, "\n") else " "
    text, bad = readable(gguf_path, sep.join(pieces))
    if bad:
        _say(what, bad)
    return text


def _plain_copy(path: Path, cache_dir=None) -> Path:
    """A ``.jsonl``/``.parquet`` text (as ``--data_name`` reads it: its ``text`` field) as a
    plain text file, documents separated by a blank line, written once (atomically) to
    ``cache_dir`` (default ``<cache>/texts``) under the file's sha256: what llama-perplexity
    scores, rather than the JSON around the texts."""
    from .data import read_documents
    from .fsutil import atomic_write_text, sha256_file
    from .llamacpp import cache_root
    d = Path(cache_dir) if cache_dir is not None else cache_root() / "texts"
    out = d / f"{path.stem}.{sha256_file(path)[:16]}.txt"
    if not out.is_file():
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "\n\n".join(read_documents(path)[0]) + "\n")
    return out


def readable_text(gguf_path: str | os.PathLike, text_file: str | os.PathLike,
                  cache_dir: str | os.PathLike | None = None) -> Path:
    """``text_file`` itself when llama.cpp's tokenizer reads all of it with ``gguf_path``'s
    vocabulary, else a copy with every character it cannot read replaced by a space (newlines
    included), written once (atomically) to ``cache_dir`` (default ``<cache>/texts``) under the
    text's sha256 and the replaced characters, and said on stderr. The KLDs of all files
    scored on that copy compare with each other, not with scores on the original text
    (:func:`text_note` says so for a report). Raises FileNotFoundError, and
    UnreadableTextError when less than :data:`MIN_READABLE` of the text's non-space characters
    would be left."""
    text_file = Path(text_file)
    if text_file.suffix.lower() in (".jsonl", ".parquet"):
        text_file = _plain_copy(text_file, cache_dir)
    if _spm_vocab(gguf_path) is None:
        if not text_file.is_file():
            raise FileNotFoundError(text_file)
        return text_file
    raw = text_file.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = untokenizable(gguf_path, text)
    if not bad:
        return text_file
    fixed = _replace(text, bad)
    before, after = _nonspace(text), _nonspace(fixed)
    if after < MIN_READABLE * before or after == 0:
        raise UnreadableTextError(
            f"{text_file}: llama.cpp's tokenizer cannot read {before - after} of its "
            f"{before} non-space characters with this model's vocabulary (SentencePiece "
            f"without byte tokens): {_shown(bad)}; scored as blanks it would measure nothing. "
            "Give a text in the language and script the model's vocabulary covers")
    from .fsutil import atomic_write_text
    from .llamacpp import cache_root
    d = Path(cache_dir) if cache_dir is not None else cache_root() / "texts"
    key = hashlib.sha256(raw + "\0".join(bad).encode()).hexdigest()[:16]
    out = d / f"{text_file.stem}.{key}.txt"
    if not out.is_file():
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, fixed)
    _say(f"{text_file.name} (scored as {out})", bad)
    return out


def text_note(gguf_path: str | os.PathLike, text_file: str | os.PathLike) -> str:
    """``""`` when llama.cpp reads ``text_file`` as it is with ``gguf_path``'s vocabulary,
    else a phrase for a report's header saying what :func:`readable_text` replaced (the
    scores are on that copy)."""
    if _spm_vocab(gguf_path) is None or not Path(text_file).is_file():
        return ""
    bad = untokenizable(gguf_path, Path(text_file).read_bytes().decode("utf-8", "replace"))
    if not bad:
        return ""
    return (f" ({len(bad)} character(s) this vocabulary cannot read, newlines "
            f"{'included' if chr(10) in bad else 'not among them'}, replaced by spaces)")
