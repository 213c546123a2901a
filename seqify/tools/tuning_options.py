"""The tuning options ``seqify inspect --tune`` and ``seqify bench SPEC`` share: their arguments and what they ask of
seqify.tune."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from seqify.schedule.actions import SCHEDULES
from seqify.tools.console import gpu_count

__all__ = ["add_tune_options", "devices_of", "tune_for", "precision", "cap", "optimizer_of"]


def add_tune_options(p: argparse.ArgumentParser) -> None:
    if not any("--devices" in a.option_strings for a in p._actions):
        p.add_argument("--devices", help="tuning: comma-separated devices, e.g. cpu,cpu or cuda:0,cuda:1 "
                       "(default: every GPU, else cpu,cpu)")
    p.add_argument("--top", type=int, default=3, help="tuning: best predicted candidates to confirm with timed steps")
    p.add_argument("--no-cache", action="store_true", help="tuning: measure again instead of reading the cache")
    p.add_argument("--memory-cap", metavar="SIZE", help="tuning: bytes per device, e.g. 40GiB; candidates predicted "
                   "over it are rejected")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help="tuning: fix the schedule (default: the tuner weighs every one that applies)")
    p.add_argument("--replicas", type=int, metavar="N", help="tuning: fix the layout's data-parallel copies of the "
                   "pipeline (1: pipelines only; the number of devices: plain data parallelism; default: the tuner "
                   "weighs every stages x replicas)")
    p.add_argument("--optimizer", metavar="NAME|BYTES", help="tuning: the optimizer training will use, a torch.optim "
                   "class (AdamW, SGD) or its state bytes per parameter byte (2 for Adam): its state is counted in "
                   "each candidate's memory")
    p.add_argument("--bf16", action="store_true", help="tuning: train under bf16 autocast (torch.autocast on the "
                   "devices' type), as mixed-precision training runs; the choice is cached apart from float32's")


def devices_of(args: argparse.Namespace) -> list[str]:
    """--devices cpu,cpu, else --gpus N, else every GPU (two CPU partitions without GPUs)."""
    if args.devices:
        return [d.strip() for d in args.devices.split(",") if d.strip()]
    gpus = getattr(args, "gpus", None) or gpu_count()
    return [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu", "cpu"]


def tune_for(seq: Any, x: torch.Tensor, args: argparse.Namespace) -> Any:
    from seqify.tuning import tune

    with precision(args):
        return tune(seq, x, devices=devices_of(args), top=args.top, cache=not args.no_cache, memory_cap=cap(args),
                    schedule=args.schedule, optimizer=optimizer_of(args), replicas=args.replicas)


def precision(args: argparse.Namespace) -> Any:
    """bf16 autocast on the devices' type with --bf16, else nothing."""
    kind = torch.device(devices_of(args)[0]).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=bool(getattr(args, "bf16", False)))


def cap(args: argparse.Namespace) -> float | None:
    """--memory-cap as bytes (None when not given)."""
    from seqify.pipe.memory import parse_bytes

    return None if args.memory_cap is None else float(parse_bytes(args.memory_cap))


def optimizer_of(args: argparse.Namespace) -> Any:
    """--optimizer as seqify.tune takes it: a torch.optim class by name (any case), or bytes per parameter byte."""
    from seqify.errors import TuneError

    given = getattr(args, "optimizer", None)
    if given is None:
        return None
    try:
        return float(given)
    except ValueError:
        pass
    base = torch.optim.Optimizer
    classes = {name.lower(): kind for name, kind in vars(torch.optim).items()
               if isinstance(kind, type) and issubclass(kind, base) and kind is not base}
    if given.lower() not in classes:
        names = ", ".join(sorted(k.__name__ for k in classes.values()))
        raise TuneError(f"--optimizer {given}: name a torch.optim optimizer ({names}) or give its state bytes per "
                        "parameter byte (2 for Adam)")
    return classes[given.lower()]
