"""One layout row under torchrun: the configuration a layout row ran in one process, run by
``seqify.distributed.stage(model, config=...)``, one process per device, timed as the in-process rows are.

    torchrun --nproc-per-node 4 benchmarks/layouts/torchrun_layout.py --config layout.toml --per-gpu 128
    torchrun --nproc-per-node 2 benchmarks/layouts/torchrun_layout.py --model llama --per-gpu 4 --config layout.toml

``main.py --torchrun`` runs it after each seqify row, with that row's configuration. Rank 0 prints one JSON row:
samples/s of the whole batch (``--per-gpu`` times the processes), every rank's peak allocated and reserved GiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import seqify
import seqify.distributed as sd

GIB = 2**30


def _workloads() -> Any:
    """benchmarks/layouts/main.py, for its workloads (the same model, data, loss, precision and optimizer)."""
    spec = importlib.util.spec_from_file_location("layouts_main", Path(__file__).with_name("main.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["layouts_main"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet101", "llama", "llama8b"], default="resnet101")
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--config", required=True, help="the PipeConfig file (stages x replicas = the processes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the CPU smoke run's small models (gloo)")
    p.add_argument("--name", default="seqify under torchrun")
    args = p.parse_args()
    layouts = _workloads()
    work = (layouts.llama(args.tiny, "8b" if args.model == "llama8b" else "0.89b") if args.model.startswith("llama")
            else layouts.resnet(args.tiny))
    sd.init()
    world = dist.get_world_size()
    x, y = work.data(args.per_gpu * world)
    seq = seqify.convert(work.build(), (x[:2],) if work.example else None, verify=False)
    stage = sd.stage(seq, config=args.config)
    share = slice(stage.replica * len(x) // stage.replicas, (stage.replica + 1) * len(x) // stage.replicas)
    inputs = x[share].to(stage.device) if stage.is_first else None
    target = y[share].to(stage.device) if stage.is_last else None
    opt = work.optimizer(stage.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(stage.device.type, dtype=torch.bfloat16, enabled=work.autocast):
            stage.step(inputs, target, loss_fn=work.loss if stage.is_last else None)
        opt.step()

    seconds = timed(step, stage.device, args.steps, args.warm)
    cuda = stage.device.type == "cuda"
    mine = ([round(torch.cuda.max_memory_allocated(stage.device) / GIB, 2)] if cuda else [],
            [round(torch.cuda.max_memory_reserved(stage.device) / GIB, 2)] if cuda else [])
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(json.dumps(dict(row=args.name, batch=len(x), samples_per_s=len(x) / seconds,
                              peak_gib=[a for r in every for a in r[0]],
                              reserved_gib=[v for r in every for v in r[1]])), flush=True)
    dist.destroy_process_group()


def timed(step: Any, device: torch.device, steps: int, warm: int) -> float:
    """Mean seconds of ``step()`` over ``steps`` run back to back after ``warm``, every rank synchronized at the
    ends only (as main.py times its rows); peaks counted from the first timed step."""
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
