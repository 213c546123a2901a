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
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_common import arguments, layouts, load, peaks, timed

import seqify
from seqify.pipe.config import PipeConfig

torchpp = load("scaling_torchpp", Path(__file__).resolve().parent.parent / "scaling" / "torchpp.py")


def main() -> None:
    args = arguments(__doc__).parse_args()
    work = layouts().workload(args.model, args.tiny)
    device = _init()
    cfg = PipeConfig.load(args.config)
    x, y = work.data(args.per_gpu * dist.get_world_size())
    seq = seqify.convert(work.build(), (x[:2],) if work.example else None, verify=False)
    for schedule in torchpp.schedules(cfg.placement, dist.get_world_size()):
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
    torchpp.exit_without_teardown()


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

    seconds = timed(step, device, args.steps, args.warm)
    allocated, reserved, held = peaks(device)
    return dict(samples_per_s=len(x) / seconds, peak_gib=allocated, reserved_gib=reserved, in_use_gib=held)


if __name__ == "__main__":
    main()
