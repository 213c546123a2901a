"""A U-Net too large to train on one GPU trains across two: per-GPU peak memory, side by side.

    python benchmarks/unet_memory/main.py [--depth 5] [--blocks 2] [--channels 64] [--res 1024] [--headroom 1.25]
    python benchmarks/unet_memory/main.py --time 3      # and the speed of each way to train it over two GPUs

Measures one training step of seqify.zoo.unet at batch 1 on cuda:0, picks the batch at which one GPU
would need ``headroom`` times its memory, then tries that batch on one GPU (expected: out of memory)
and through seqify.pipeline over two GPUs balanced by memory (one micro-batch, no checkpointing; then
4 micro-batches with checkpointing). Prints a table of the outcome and the peak memory per GPU.

``--time STEPS`` (batch rounded up to a multiple of 8) then times training over the two GPUs, same balance:
the eager checkpointed configuration above (GPipe, 4 micro-batches, ``checkpoint='except_last'``) against
captured graphs with checkpointing (1F1B and ZB-H2, recomputing inside the captured backwards) and 1F1B
with graphs and no checkpointing: samples/s, the ratio to the eager checkpointed row, peak allocated and
reserved GiB per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys

import time

import torch
from torch import nn

import seqify


def peaks() -> list[float]:
    return [round(torch.cuda.max_memory_allocated(d) / 2**30, 1) for d in range(torch.cuda.device_count())]


def reset() -> None:
    gc.collect()
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--headroom", type=float, default=1.25)
    p.add_argument("--time", type=int, default=0, metavar="STEPS", help="also time training over two GPUs")
    args = p.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} ({total:.0f} GiB each), torch {torch.__version__}")
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    torch.manual_seed(0)
    model = seqify.zoo.unet(args.depth, args.blocks, args.channels).cuda(0)
    params = sum(t.numel() for t in model.parameters())
    reset()
    step(model, torch.randn(1, 3, args.res, args.res, device="cuda:0"))
    per_sample = torch.cuda.max_memory_allocated(0) / 2**30
    batch = max(2, int(args.headroom * total / per_sample) + 1)
    if args.time:
        batch = -(-batch // 8) * 8
    print(f"# U-Net(depth={args.depth}, B={args.blocks}, C={args.channels}), {params / 1e6:.1f} M parameters, "
          f"{args.res}x{args.res}: {per_sample:.1f} GiB at batch 1 -> batch {batch}")
    model.zero_grad(set_to_none=True)
    rows = []
    reset()
    x = torch.randn(batch, 3, args.res, args.res, device="cuda:0")
    try:
        step(model, x)
        rows.append(("one GPU", "trained", peaks()))
    except torch.cuda.OutOfMemoryError:
        rows.append(("one GPU", "out of memory", peaks()))
    model.zero_grad(set_to_none=True)
    del model
    reset()
    seq = seqify.convert(seqify.zoo.unet(args.depth, args.blocks, args.channels))
    plan = seqify.balance(seq, 2, sample=torch.randn(1, 3, args.res, args.res), by="memory", device="cuda:0", progress=False)
    print(f"# balance by memory: {plan.balance}")
    for chunks, checkpoint in ((1, "never"), (4, "except_last")):
        reset()
        try:
            pipe = seqify.pipeline(seq, gpus=2, balance=plan.balance, chunks=chunks, checkpoint=checkpoint)
            step(pipe, x)
            rows.append((f"seqify, 2 GPUs, chunks={chunks}, checkpoint={checkpoint}", "trained", peaks()))
        except torch.cuda.OutOfMemoryError:
            rows.append((f"seqify, 2 GPUs, chunks={chunks}, checkpoint={checkpoint}", "out of memory", peaks()))
        seq.zero_grad(set_to_none=True)
    print(f"\n| batch {batch} | outcome | peak GiB cuda:0 / cuda:1 |")
    print("|---|---|---|")
    for name, outcome, peak in rows:
        print(f"| {name} | {outcome} | {' / '.join(str(v) for v in peak)} |")
    if args.time:
        timed_rows(seq, plan.balance, x, args.time)


def timed_rows(seq: nn.Sequential, balance: list[int], x: torch.Tensor, steps: int) -> None:
    """Training over two GPUs, eager checkpointed against captured graphs, one row each."""
    def loss_fn(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    target = torch.zeros(x.size(0), device="cuda:1")
    configs = [("gpipe", 4, "except_last", False), ("1f1b", 4, "except_last", True), ("1f1b", 8, "except_last", True),
               ("zb-h2", 8, "except_last", True), ("1f1b", 8, "never", True)]
    rows: list[tuple[str, float | None, list[float], list[float]]] = []
    for schedule, chunks, checkpoint, graphs in configs:
        name = f"{schedule}, {chunks} micro-batches, checkpoint={checkpoint}, {'graphs' if graphs else 'eager'}"
        reset()
        try:
            pipe = seqify.pipeline(seq, gpus=2, balance=balance, chunks=chunks, checkpoint=checkpoint,
                                   schedule=schedule, graphs=graphs)

            def run() -> None:
                if schedule == "gpipe" and not graphs:
                    step(pipe, x)
                else:
                    pipe.step(x, target, loss_fn)
                seq.zero_grad(set_to_none=True)

            run()
            run()
            for d in range(2):
                torch.cuda.synchronize(d)
            start = time.perf_counter()
            for _ in range(steps):
                run()
            for d in range(2):
                torch.cuda.synchronize(d)
            rate = x.size(0) * steps / (time.perf_counter() - start)
            if graphs and pipe.graph_error:
                name += " (graphs fell back to eager)"
        except torch.cuda.OutOfMemoryError:
            rate = None
        rows.append((name, rate, peaks(),
                     [round(torch.cuda.max_memory_reserved(d) / 2**30, 1) for d in range(2)]))
        pipe = None
        seq.zero_grad(set_to_none=True)
        print(f"# {rows[-1]}", flush=True)
    base = rows[0][1]
    print(f"\n| batch {x.size(0)}, two GPUs | samples/s | x eager checkpointed | peak GiB allocated cuda:0 / cuda:1 | "
          "reserved |")
    print("|---|---|---|---|---|")
    for name, rate, alloc, reserved in rows:
        ratio = f"{rate / base:.2f}" if rate and base else "-"
        print(f"| {name} | {rate:.1f} | {ratio} | {alloc[0]} / {alloc[1]} | {reserved[0]} / {reserved[1]} |"
              if rate else f"| {name} | out of memory | - | {alloc[0]} / {alloc[1]} | {reserved[0]} / {reserved[1]} |")


if __name__ == "__main__":
    main()
