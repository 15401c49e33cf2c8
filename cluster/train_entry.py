"""Command-line entry for gate training through the Ray layer.

Works the same when run directly, under ``ray job submit`` (a plain ``ray.init()`` joins the
job's cluster) and under ``torchrun`` (in-process mode; torchrun's processes form the group)::

    python -m cluster.train_entry --toy --max_steps 4 --run_name demo
    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m cluster.train_entry --factory voodoo.pipeline:student_factory \\
        --factory_kwargs '{"model": "..."}' --num_workers 4 --use_gpu --run_name r1 \\
        --storage_path /shared/ray_results
    python -m cluster.train_entry tp --nproc 2 -- --toy --max_steps 4   # torchrun, TP=2

Every :class:`voodoo.train.TrainConfig` field is a flag (``--max_steps``, ``--size_weight``,
``--compression_ratio`` ...). ``--factory module:attr`` names a callable that, called with
``--factory_kwargs`` (JSON), returns the picklable ``factory(WorkerInfo) -> StudentJob``;
``--toy`` uses :class:`cluster.toy.TinyLlamaFactory` instead. ``--output DIR`` writes
``gates.pt`` (gguf_name -> logits) and ``result.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import typing

__all__ = ["build_parser", "main", "tp_main", "torchrun_argv", "load_factory"]


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from voodoo.train import TrainConfig
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "version":
            continue
        t = hints[f.name]
        if t is bool:
            p.add_argument(f"--{f.name}", type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=None, help=f"TrainConfig.{f.name} (default {f.default})")
            continue
        base = next((a for a in typing.get_args(t) if a is not type(None)), t)
        conv = {int: int, float: float, str: str}.get(base, str)
        p.add_argument(f"--{f.name}", type=(lambda s, c=conv: None if s.lower() == "none"
                                            else c(s)),
                       default=argparse.SUPPRESS,
                       help=f"TrainConfig.{f.name} (default {f.default})")


def build_parser() -> argparse.ArgumentParser:
    """The entry's flags (TrainConfig fields plus the Ray ones)."""
    p = argparse.ArgumentParser(prog="python -m cluster.train_entry",
                                description="Voodoo gate training on Ray Train")
    p.add_argument("--factory", help="module:attr returning factory(WorkerInfo) -> StudentJob")
    p.add_argument("--factory_kwargs", default="{}", help="JSON kwargs for --factory")
    p.add_argument("--toy", action="store_true", help="a tiny random Llama (tests, demos)")
    p.add_argument("--num_workers", type=int, default=None,
                   help="Ray Train workers; 0: in-process; default tensor x data parallel")
    p.add_argument("--use_gpu", action="store_true")
    p.add_argument("--tensor_parallel", type=int, default=1)
    p.add_argument("--data_parallel", type=int, default=None)
    p.add_argument("--device_map", default=None, help='layer-wise split, "cuda:0,cuda:1"')
    p.add_argument("--cpus_per_worker", type=float, default=None)
    p.add_argument("--run_name", default=None,
                   help="Ray Train run name (default voodoo-train-<hash of the factory and the "
                        "settings that a resume must match>: the same command resumes, other "
                        "settings get their own run folder)")
    p.add_argument("--storage_path", default=None)
    p.add_argument("--max_failures", type=int, default=0)
    p.add_argument("--num_to_keep", type=int, default=2)
    p.add_argument("--stop_after", type=int, default=None)
    p.add_argument("--output", default=None, help="write gates.pt and result.json here")
    _add_config_flags(p)
    return p


def load_factory(args):
    """The factory named by ``--toy`` / ``--factory``. Raises SystemExit with a message when
    neither is given or the name does not import."""
    if args.toy:
        from cluster.toy import TinyLlamaFactory
        return TinyLlamaFactory()
    if not args.factory or ":" not in args.factory:
        raise SystemExit("give --factory module:attr (or --toy)")
    mod, _, attr = args.factory.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--factory {args.factory}: {e}") from None
    return obj(**json.loads(args.factory_kwargs))


def default_run_name(args, cfg) -> str:
    """``voodoo-train-<10 hex>``: a hash of the factory (``--toy`` / ``--factory``,
    ``--factory_kwargs``) and the config fields a resume must match (all but
    ``voodoo.train._RESUME_FREE``), so runs of other settings never share a run folder (a
    shared one was refused at resume, under a name the user never chose)."""
    import hashlib

    from voodoo.train import _RESUME_FREE
    key = {"factory": "toy" if args.toy else args.factory,
           "factory_kwargs": json.loads(args.factory_kwargs),
           "cfg": {k: v for k, v in cfg.to_dict().items() if k not in _RESUME_FREE}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return f"voodoo-train-{digest[:10]}"


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv``, trains, prints a one-line summary (and writes ``--output``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "tp":
        return tp_main(argv[1:])
    args = build_parser().parse_args(argv)
    from voodoo.train import TrainConfig
    keys = {f.name for f in dataclasses.fields(TrainConfig)} - {"version"}
    overrides = {k: v for k, v in vars(args).items() if k in keys and v is not None}
    if args.toy:
        overrides.setdefault("seq_len", 16)
        overrides.setdefault("batch_size", 2)
        overrides.setdefault("compression_ratio", 0.7)
    if "target_bits" in overrides and "compression_ratio" not in overrides:
        overrides["compression_ratio"] = None
    cfg = TrainConfig(**overrides)
    factory = load_factory(args)
    if args.run_name is None:
        args.run_name = default_run_name(args, cfg)
        print(f"[voodoo train] run name {args.run_name}", file=sys.stderr, flush=True)
    num_workers = args.num_workers
    if num_workers is None:
        num_workers = (0 if "RANK" in os.environ
                       else args.tensor_parallel * (args.data_parallel or 1))
    if num_workers > 0:
        from cluster.session import ensure_ray
        ensure_ray()  # joins RAY_ADDRESS's cluster, or a local Ray that ends with this process
    from cluster.train import run_training
    res = run_training(
        factory, cfg, num_workers=num_workers, use_gpu=args.use_gpu,
        tensor_parallel=args.tensor_parallel, data_parallel=args.data_parallel,
        run_name=args.run_name, storage_path=args.storage_path, max_failures=args.max_failures,
        num_to_keep=args.num_to_keep, device_map=args.device_map, stop_after=args.stop_after,
        resources_per_worker=({"CPU": args.cpus_per_worker} if args.cpus_per_worker else None))
    rank = int(os.environ.get("RANK", "0"))
    summary = {"run_name": args.run_name, "step": res.step, "finished": res.finished,
               "budget_bytes": res.budget_bytes, "checkpoint": res.checkpoint_path,
               "metrics": {k: v for k, v in res.metrics.items()
                           if isinstance(v, (int, float, str, bool))}}
    if args.output and rank == 0:
        import torch
        os.makedirs(args.output, exist_ok=True)
        torch.save(res.gates, os.path.join(args.output, "gates.pt"))
        with open(os.path.join(args.output, "result.json"), "w") as f:
            json.dump(summary, f, indent=2)
    if rank == 0:
        print("VOODOO_TRAIN_RESULT " + json.dumps(summary), flush=True)
    return 0


def torchrun_argv(nproc: int, train_args: list[str]) -> list[str]:
    """``torchrun --standalone --nproc_per_node N -m cluster.train_entry --num_workers 0
    --tensor_parallel N <train_args>`` (a ``--tensor_parallel`` in ``train_args`` wins, so
    ``N = tensor x data parallel`` also works). Raises ValueError for nproc < 1."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    exe = shutil.which("torchrun")
    head = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    tp = [] if "--tensor_parallel" in train_args else ["--tensor_parallel", str(nproc)]
    return [*head, "--standalone", f"--nproc_per_node={nproc}", "-m", "cluster.train_entry",
            "--num_workers", "0", *tp, *train_args]


def tp_main(argv: list[str]) -> int:
    """``tp --nproc N [--] <train flags>``: runs :func:`main` under torchrun; returns its
    exit status."""
    p = argparse.ArgumentParser(prog="python -m cluster.train_entry tp")
    p.add_argument("--nproc", type=int, required=True)
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return subprocess.call(torchrun_argv(args.nproc, rest))


if __name__ == "__main__":
    sys.exit(main())
