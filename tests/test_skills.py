"""The skills in ``skills/*/SKILL.md`` stay true: every fenced ```` ```bash ```` / ```` ```sh ````
block is real.

- Fast: every ``voodoo ...`` command in every block (including ``ray job submit ... --
  voodoo ...`` and ``voodoo tp ... -- <train flags>``) parses with the CLI's own argparse parsers
  (captured from :mod:`voodoo.cli` as ``tests/test_cli_help.py`` does) and passes the CLI's early
  flag checks, so a renamed or removed flag fails here. A self-test feeds the checker a skill
  with a renamed flag and expects it to fail.
- Slow: the runnable blocks (those not marked ``<!-- check: help -->`` on the line before the
  fence: GPU, cluster and long runs are marked) run in order, skill after skill, in one shared
  run folder, on the tiny random llama (``voodoo.models.make_tiny_model``, seed 0, at a fixed
  place in the Voodoo cache so its F32 GGUF and candidates are reused): the blocks read
  ``MODEL`` and ``OUT``, which the test sets, and ``voodoo`` is a shim that appends small
  settings (:data:`SMALL`: 64-token blocks, 2 training steps, 2 llama-perplexity chunks) to each
  command, so the skills' own values are what a user runs and the test still runs every command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKILLS = REPO / "skills"

#: The skills issue 15 asks for, in the order their runnable blocks chain (each reads what the
#: ones before wrote into ``$OUT``).
SKILL_ORDER = ("install-and-doctor", "data-and-imatrix", "quantize-to-a-size",
               "export-and-reproduce-with-llama-quantize", "evaluate-against-stock-types",
               "recover-from-a-crash", "sweep-with-ray-tune")
SECTIONS = ("## When to use", "## Commands", "## What a good result looks like",
            "## When a step fails")
HELP_MARK = "<!-- check: help -->"

#: (flag, value or None for a switch, commands it applies to or None for any that has it):
#: appended by the shim in the slow test so the skills' commands run in seconds.
SMALL = (("--seq_len", "64", None), ("--n_train_blocks", "8", None),
         ("--n_eval_blocks", "5", None), ("--imatrix_blocks", "4", None),
         ("--fisher_blocks", "2", None), ("--max_steps", "2", None),
         ("--partial_save_interval", "1", None), ("--no_ray", None, None),
         ("--ctx", "128", ("run", "eval")), ("--chunks", "2", ("run", "eval")),
         ("--n_predict", "8", ("chat",)), ("--num_samples", "2", ("tune",)))


# ------------------------------------------------------------------------------ extraction
def shell_blocks(text: str) -> list[dict]:
    """Every fenced bash/sh block of a Markdown text: ``{"code", "line" (1-based line of the
    opening fence), "help" (True when the last non-blank line before the fence is
    :data:`HELP_MARK`)}``."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in ("bash", "sh", "shell"):
            prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            blocks.append({"code": "\n".join(lines[i + 1:j]), "line": i + 1,
                           "help": prev == HELP_MARK})
        i = j + 1
    return blocks


_PUNCT = set("();<>|&")
_STARTS = {None, "&&", "||", ";", "|", "(", "--", "then", "do", "!", "{"}


def voodoo_commands(code: str) -> list[list[str]]:
    """The argv (after ``voodoo``) of every ``voodoo`` command in a shell block: lines joined at
    backslash continuations, heredoc bodies skipped, ``$VAR`` / ``${VAR...}`` replaced by a
    placeholder; a command starts at ``voodoo`` at the start of a pipeline element (or after
    ``--``, as in ``ray job submit ... -- voodoo train ...``) and ends at a shell operator."""
    logical, buf, heredoc = [], "", None
    for raw in code.splitlines():
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", raw)
        if m:
            heredoc = m.group(1)
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        logical.append(buf + raw)
        buf = ""
    if buf:
        logical.append(buf)
    out = []
    for line in logical:
        line = re.sub(r"\$\{[^}]*\}|\$\w+", "X", line)
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            toks = list(lex)
        except ValueError as e:  # unbalanced quotes
            raise AssertionError(f"cannot tokenize {line!r}: {e}") from None
        prev = None
        k = 0
        while k < len(toks):
            t = toks[k]
            if t == "voodoo" and prev in _STARTS:
                argv = []
                k += 1
                while k < len(toks) and not (set(toks[k]) <= _PUNCT):
                    argv.append(toks[k])
                    k += 1
                out.append(argv)
                prev = None
                continue
            prev = t
            k += 1
    return out


# ------------------------------------------------------------------------------ the parsers
class _Captured(Exception):
    pass


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """{command: the ArgumentParser the command builds}, captured where it parses."""
    from voodoo import cli
    got = {}

    def grab(self, *args, **kwargs):
        got[self.prog.removeprefix("voodoo ")] = self
        raise _Captured

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = grab
    argparse.ArgumentParser.parse_known_args = grab
    try:
        for name, (fn, _) in cli.COMMANDS.items():
            try:
                fn([])
            except _Captured:
                pass
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    for ap in got.values():
        # skills spell flags in full: an abbreviation breaks once a flag with its prefix is added
        ap.allow_abbrev = False
    return got


@pytest.fixture(scope="module")
def parsers():
    return cli_parsers()


def check_command(argv: list[str], parsers: dict) -> str | None:
    """None when ``voodoo <argv>`` parses with the CLI's parser and passes its early flag
    checks (Ray flags, positive numbers); else the error argparse or the CLI gives."""
    from voodoo import cli
    if not argv:
        return "a bare `voodoo`"
    cmd, rest = argv[0], argv[1:]
    if cmd not in parsers:
        return f"unknown command {cmd!r} (commands: {', '.join(sorted(parsers))})"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if cmd == "tp":
                a, rest = parsers["tp"].parse_known_args(rest)
                if rest and rest[0] == "--":
                    rest = rest[1:]
                head = ["--ray", "--tensor_parallel", str(a.nproc), "--num_workers", str(a.nproc)]
                cmd, rest = "train", head + rest
            a = parsers[cmd].parse_args(rest)
            if cmd in ("train", "run"):
                cli._check_ray_flags(a)
            if cmd in ("train", "run", "tune"):
                cli._check_train_numbers(a)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"
    except cli.UsageError as e:
        return str(e)
    return None


def check_skill_text(text: str, parsers: dict) -> list[str]:
    """Every problem with the ``voodoo`` commands of a skill's shell blocks (empty: all parse)."""
    bad = []
    for b in shell_blocks(text):
        for argv in voodoo_commands(b["code"]):
            e = check_command(argv, parsers)
            if e:
                bad.append(f"block at line {b['line']}: voodoo {shlex.join(argv)}: {e}")
    return bad


def skill_files() -> list[Path]:
    return sorted(SKILLS.glob("**/SKILL.md"))


# ------------------------------------------------------------------------------ fast tests
def test_every_skill_is_there_with_its_sections():
    names = {p.parent.name for p in skill_files()}
    assert set(SKILL_ORDER) <= names, f"missing skills: {set(SKILL_ORDER) - names}"
    for p in skill_files():
        text = p.read_text()
        front = re.match(r"^---\nname: (.+)\ndescription: (.+)\n---\n", text)
        assert front and front.group(1) == p.parent.name, f"{p}: front matter name/description"
        for s in SECTIONS:
            assert s in text, f"{p}: no {s!r} section"
        blocks = shell_blocks(text)
        assert blocks, f"{p}: no ```bash block"
        assert sum(len(voodoo_commands(b["code"])) for b in blocks) >= 1, p


def test_agents_md_points_at_the_skills():
    text = (REPO / "AGENTS.md").read_text()
    for needle in ("bash scripts/main.sh", "bash scripts/test.sh", "WikiText", "hub",
                   "candidate cache", "blk.3.ffn_down.weight", "IQ2_XXS", "train/partial.pt"):
        assert needle in text, needle
    for name in SKILL_ORDER:
        assert f"skills/{name}" in text, name


@pytest.mark.parametrize("path", skill_files(), ids=lambda p: p.parent.name)
def test_every_voodoo_command_parses(path, parsers):
    bad = check_skill_text(path.read_text(), parsers)
    assert not bad, "\n".join(bad)


def test_extraction_finds_what_the_shell_would_run():
    code = ("X=$(ls -t \"$OUT\"/*.json | head -n 1)\n"
            "voodoo train --model \"$MODEL\" --output_dir \"$OUT/q\" \\\n"
            "  --compression_ratio 0.5   # a comment --bogus\n"
            "[ -s f ] || voodoo doctor --model \"$MODEL\" > \"$OUT/doctor.txt\"\n"
            "python - <<'PY'\nvoodoo eval --bogus\nPY\n"
            "ray job submit --address http://HEAD:8265 --working-dir . -- \\\n"
            "  voodoo train --ray --run_name r\n"
            "echo voodoo is not a command here\n")
    assert voodoo_commands(code) == [
        ["train", "--model", "X", "--output_dir", "X/q", "--compression_ratio", "0.5"],
        ["doctor", "--model", "X"],
        ["train", "--ray", "--run_name", "r"]]
    md = f"text\n\n{HELP_MARK}\n```bash\nvoodoo tp --nproc 2\n```\n\n```sh\nvoodoo data\n```\n"
    assert [(b["help"], b["code"]) for b in shell_blocks(md)] == [
        (True, "voodoo tp --nproc 2"), (False, "voodoo data")]


def test_checker_fails_on_a_renamed_flag(parsers):
    """The self-test: the same skill text passes, then fails once a flag is renamed, a command
    is misspelt, a value has the wrong type or a Ray-only flag lacks --ray."""
    good = ("## Commands\n\n" + HELP_MARK + "\n```bash\n"
            "voodoo train --model \"$MODEL\" --output_dir \"$OUT\" --compression_ratio 0.55\n"
            "voodoo tp --nproc 4 -- --model m --compression_ratio 0.45 --run_name tp4\n"
            "ray job submit --address http://HEAD:8265 --working-dir . -- \\\n"
            "  voodoo train --ray --use_gpu --storage_path /mnt/s --run_name r\n"
            "```\n")
    assert check_skill_text(good, parsers) == []
    for old, new, why in (("--compression_ratio 0.55", "--compression_rate 0.55",
                           "--compression_rate"),
                          ("--compression_ratio 0.55", "--compression 0.55", "--compression"),
                          ("voodoo train --model", "voodoo trian --model", "unknown command"),
                          ("--nproc 4", "--nproc four", "must be an integer"),
                          ("--ray --use_gpu", "--use_gpu", "needs --ray"),
                          ("--run_name tp4", "--run_nam tp4", "--run_nam")):
        bad = check_skill_text(good.replace(old, new, 1), parsers)
        assert len(bad) == 1 and why in bad[0], (new, bad)


# ------------------------------------------------------------------------------ the shim
def small_argv(argv: list[str], parsers: dict | None = None) -> list[str]:
    """``argv`` with :data:`SMALL`'s settings appended where the command has the flag (argparse
    keeps the last value, so they override the skill's own)."""
    if not argv:
        return argv
    parsers = parsers or cli_parsers()
    cmd = argv[0]
    ap = parsers.get("train" if cmd == "tp" else cmd)
    if ap is None:
        return argv
    extra = []
    for flag, value, cmds in SMALL:
        if flag in ap._option_string_actions and (cmds is None or cmd in cmds):
            extra += [flag] + ([value] if value is not None else [])
    if cmd == "tp" and "--" not in argv:
        extra = ["--"] + extra
    return list(argv) + extra


def shim_main(argv: list[str]) -> int:
    """What the ``voodoo`` shim runs: ``voodoo.cli.main(small_argv(argv))``."""
    from voodoo import cli
    argv = small_argv(argv)
    print(f"[test_skills shim] voodoo {shlex.join(argv)}", file=sys.stderr, flush=True)
    return cli.main(argv)


def test_small_argv_appends_only_known_flags(parsers):
    a = small_argv(["eval", "--gguf", "x.gguf"], parsers)
    assert a[:3] == ["eval", "--gguf", "x.gguf"] and "--ctx" in a and "--max_steps" not in a
    c = small_argv(["chat", "--gguf", "x.gguf"], parsers)
    assert c == ["chat", "--gguf", "x.gguf", "--n_predict", "8"]
    t = small_argv(["train", "--max_steps", "24"], parsers)
    assert parsers["train"].parse_args(t[1:]).max_steps == 2


# ------------------------------------------------------------------------------ slow: run them
@pytest.fixture(scope="module")
def tiny_fixed_model() -> Path:
    """The tiny random llama (seed 0) at the fixed place tests/test_pipeline.py uses, so the
    converted F32 GGUF and the candidate cache are reused across sessions."""
    from voodoo.llamacpp import LlamaCppNotBuilt, cache_root, source_dir, tool_path
    try:
        source_dir()
        for t in ("llama-quantize", "llama-perplexity", "llama-completion"):
            tool_path(t)
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from conftest import SMOL_GGUF
    from voodoo.models import make_tiny_model
    return make_tiny_model(cache_root() / "test-models" / "tiny-llama-s0", seed=0,
                           tokenizer_gguf=SMOL_GGUF if SMOL_GGUF.is_file() else None)


def _shim_dir(tmp: Path) -> Path:
    d = tmp / "bin"
    d.mkdir()
    shim = d / "voodoo"
    # loaded by file name, not by putting tests/ on sys.path: tests/cython_ggml would shadow
    # the (editable-installed) package
    shim.write_text(f"#!{sys.executable}\nimport importlib.util, sys\n"
                    f"spec = importlib.util.spec_from_file_location('test_skills', {__file__!r})\n"
                    "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
                    "sys.exit(m.shim_main(sys.argv[1:]))\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return d


@pytest.mark.slow
def test_skills_run_on_the_tiny_model(tiny_fixed_model, tmp_path):
    """Every runnable block of every skill, in SKILL_ORDER, one bash script per skill
    (``set -euo pipefail``), in one shared ``$OUT``; then what they wrote is checked."""
    out = tmp_path / "run"
    env = dict(os.environ, MODEL=str(tiny_fixed_model), OUT=str(out),
               PATH=f"{_shim_dir(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    walls = {}
    for name in SKILL_ORDER:
        blocks = [b for b in shell_blocks((SKILLS / name / "SKILL.md").read_text())
                  if not b["help"]]
        if not blocks:
            continue
        script = "set -euo pipefail\n" + "\n".join(
            f"echo '[test_skills] {name} block at line {b['line']}' >&2\n{b['code']}"
            for b in blocks)
        t0 = time.perf_counter()
        r = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=900)
        walls[name] = time.perf_counter() - t0
        assert r.returncode == 0, (f"skills/{name}/SKILL.md failed (exit {r.returncode}):\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        (tmp_path / f"{name}.log").write_text(r.stdout + r.stderr)
    print("\n[test_skills] wall s: " + ", ".join(f"{k} {v:.0f}" for k, v in walls.items()))

    # what the chain wrote: a Voodoo55 GGUF that llama-quantize reproduces byte for byte, a
    # KLD table with it and the stock Q4_K_M, a --match_size assignment, a resumed training
    (asg,) = out.glob("*.Voodoo55_*.assignment.json")
    stem = asg.name.removesuffix(".assignment.json")
    assert (out / f"{stem}.gguf").is_file() and (out / f"{stem}.tensor-types.txt").is_file()
    log = (tmp_path / "export-and-reproduce-with-llama-quantize.log").read_text()
    m = re.search(r"(\d+) of (\d+) tensors byte-identical to llama-quantize, (\d+) differ; "
                  r"the file declares (\d+) with error-feedback bytes", log)
    assert m, log[-2000:]
    same, n, differ, own = (int(x) for x in m.groups())
    assert same + differ == n and differ <= own < n and same > 10, m.group(0)
    report = json.loads((out / "eval" / "compare.json").read_text())
    rows = {Path(r["file"]).name: r for r in report}
    ours, stock = rows[f"{stem}.gguf"], rows["stock.Q4_K_M.gguf"]
    assert 0 <= ours["kld"] < 0.05 and 0 <= stock["kld"] < 0.05, rows
    assert ours["size_mib"] < stock["size_mib"], rows   # 0.55 x Q8_0 < Q4_K_M on this model
    assert 0.5 < ours["same_top_p"] <= 1, rows
    q = json.loads(next((out / "q4km").glob("*.assignment.json")).read_text())
    assert q["total_bytes"] <= q["budget_bytes"] * 1.005
    res_log = (tmp_path / "recover-from-a-crash.log").read_text()
    assert "stopped after 1 of 2 steps" in res_log and "baked:" in res_log
    assert list((out / "resume").glob("*.Voodoo50_*.assignment.json"))
