"""The command line's help: every flag of every subcommand says what it does, and shows its
default at most once (no "(default 0.55) (default: None)"); bootstrap prints lines, not a
dict."""

from __future__ import annotations

import argparse

import pytest

from voodoo import cli


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def parsers():
    """{prog: ArgumentParser} of every subcommand, captured where the command parses."""
    got = {}

    def grab(self, *args, **kwargs):
        got[self.prog] = self
        raise _Captured

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", grab)
    mp.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    try:
        for name, (fn, _) in cli.COMMANDS.items():
            with pytest.raises(_Captured):
                fn([])
    finally:
        mp.undo()
    return got


def test_every_command_has_a_parser(parsers):
    assert sorted(parsers) == sorted(f"voodoo {n}" for n in cli.COMMANDS)


def _option_helps(ap):
    fmt = ap._get_formatter()
    for act in ap._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        yield act, (fmt._expand_help(act) if act.help else "")


def test_every_flag_has_help_and_one_default(parsers):
    bad = []
    for prog, ap in sorted(parsers.items()):
        for act, text in _option_helps(ap):
            if not text.strip():
                bad.append(f"{prog} {act.option_strings}: no help")
            elif text.lower().count("default") > 1:
                bad.append(f"{prog} {act.option_strings}: {text!r}")
    assert not bad, "\n".join(bad)


def test_train_help_shows_the_real_defaults(parsers, capsys):
    """The budget's default (0.55, decided at run time) is said once and never as None; a
    plain default is shown by the formatter."""
    ap = parsers["voodoo train"]
    ap.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "default 0.55" in text
    assert "(default: None)" not in text
    assert "Adam learning rate on the gate logits (default: 0.05)" in text
    assert "gate-training steps (default: 24)" in text


def test_chat_and_serve_are_listed(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  chat " in out and "  serve " in out


def test_bootstrap_prints_lines_not_a_dict(monkeypatch, capsys, tmp_path):
    from voodoo import llamacpp
    monkeypatch.setattr(llamacpp, "bootstrap", lambda lib_only=False, force=False: {
        "lib": str(tmp_path / "libggml-base.so"), "bin": str(tmp_path / "bin")})
    assert llamacpp.main([]) == 0
    out = capsys.readouterr().out
    assert "{" not in out
    assert out.splitlines()[0].split() == ["libggml-base", str(tmp_path / "libggml-base.so")]
    assert out.splitlines()[1].startswith("llama.cpp tools  " + str(tmp_path / "bin"))


def test_a_zero_default_is_shown(parsers, capsys):
    """0 == False in Python: a default of 0 (--seed, --budget_reduction, --max_failures) is
    still a value, shown like any other (--seed, a dataset flag, defaults to the run folder's
    data first)."""
    ap = parsers["voodoo train"]
    ap.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "training order (default: the run folder's data/meta.json when it has one, else " \
        "0)" in text
    assert "aim 1% under) (default: 0.0)" in text
    assert "from the last checkpoint (default: 0)" in text
    assert "--no_ray quantize candidates in this process instead of Ray actors (default" \
        not in text


def test_descriptions_are_plain_text(parsers):
    """No reStructuredText of a docstring in a --help page (``voodoo doctor``: ...)."""
    bad = [prog for prog, ap in parsers.items() if "``" in (ap.description or "")]
    assert not bad, bad
