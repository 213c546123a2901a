"""torch.distributed.pipelining on a pipeline layout's cuts, with the layouts workload's loss, optimizer and
precision: main.py's torch pipelining rows (``--torchpp``).

    torchrun --nproc-per-node 4 benchmarks/layouts/torchpp_layout.py --config layout.json --per-gpu 128

The configuration (a pure pipeline: one replica, one partition per process, or several in a loop or a V) gives
the cuts and the micro-batch count; each partition becomes a ``PipelineStage`` as benchmarks/scaling/torchpp.py
wraps it (skips that cross a cut travel as extra stage inputs and outputs), and every schedule torch pipelining
has for that placement trains ``--steps`` steps back to back (the workload's optimizer stepping each rank's
parameters), timed as main.py times its rows. Rank 0 prints one JSON row per schedule (or its error).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import seqify
from seqify.pipe.config import PipeConfig

GIB = 2**30


def _load(name: str, path: Path) -> Any:
    """A benchmark script imported by its path, once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


HERE = Path(__file__).resolve().parent
layouts = _load("layouts_main", HERE / "main.py")
torchpp = _load("scaling_torchpp", HERE.parent / "scaling" / "torchpp.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet101", "llama", "llama8b"], default="resnet101")
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--config", required=True, help="a pure pipeline's PipeConfig file (its stages = processes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the CPU smoke run's small models (gloo)")
    args = p.parse_args()
    work = (layouts.llama(args.tiny, "8b" if args.model == "llama8b" else "0.89b") if args.model.startswith("llama")
            else layouts.resnet(args.tiny))
    device = _init()
    world = dist.get_world_size()
    cfg = PipeConfig.load(args.config)
    x, y = work.data(args.per_gpu * world)
    seq = seqify.convert(work.build(), (x[:2],) if work.example else None, verify=False)
    for schedule in torchpp.schedules(cfg.placement, world):
        row = dict(row=f"torch pipelining {schedule.__name__} chunks {cfg.chunks}", batch=len(x))
        try:
            row.update(_run(schedule, seq, cfg, work, x, y, device, args))
        except Exception as e:  # every rank fails alike (a schedule this placement cannot run): record it
            row.update(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}")
        seq.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def _init() -> torch.device:
    """The process group (NCCL on GPUs, gloo on the CPU) and this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _run(schedule: Any, seq: torch.nn.Module, cfg: PipeConfig, work: Any, x: torch.Tensor, y: torch.Tensor,
         device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """``schedule`` on ``cfg``'s cuts: samples/s and every rank's peak allocated and reserved GiB."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    placement, balance, chunks = cfg.placement, list(cfg.balance), int(cfg.chunks)
    mine = [j for j, r in enumerate(placement) if r == rank]
    torch.manual_seed(1)
    into = torchpp.cuts(seq, balance, x[: len(x) // chunks], device)
    parts = torchpp.stages_of(seq, balance, mine, device, into)
    stages = [PipelineStage(part, j, len(balance), device) for part, j in zip(parts, mine)]
    kwargs = dict(n_microbatches=chunks, loss_fn=lambda out, target: work.loss(out, target))
    sched = schedule(stages[0], **kwargs) if len(placement) == world else schedule(stages, **kwargs)
    first, last = 0 in mine, len(balance) - 1 in mine
    inputs, target = x.to(device), y.to(device)
    opt = work.optimizer([q for part in parts for q in part.parameters()])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=work.autocast):
            if first:
                sched.step(inputs, target=target if last else None, losses=[] if last else None)
            else:
                sched.step(target=target if last else None, losses=[] if last else None)
        opt.step()

    seconds = _timed(step, device, args.steps, args.warm)
    cuda = device.type == "cuda"
    mine_peaks = [torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0,
                  torch.cuda.max_memory_reserved(device) / GIB if cuda else 0.0]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine_peaks)
    return dict(samples_per_s=len(x) / seconds, peak_gib=[round(a, 2) for a, _ in every] if cuda else [],
                reserved_gib=[round(r, 2) for _, r in every] if cuda else [])


def _timed(step: Any, device: torch.device, steps: int, warm: int) -> float:
    """Mean seconds of ``step()`` over ``steps`` back to back after ``warm``, synchronized at the ends only."""
    for _ in range(warm):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    main()
