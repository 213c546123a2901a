"""A U-Net too large to train on one GPU trains across two: per-GPU peak memory, side by side.

    python benchmarks/unet_memory.py [--depth 5] [--blocks 2] [--channels 64] [--res 1024] [--headroom 1.25]

Measures one training step of seqify.zoo.unet at batch 1 on cuda:0, picks the batch at which one GPU
would need ``headroom`` times its memory, then tries that batch on one GPU (expected: out of memory)
and through seqify.pipeline over two GPUs balanced by memory (one micro-batch, no checkpointing; then
4 micro-batches with checkpointing). Prints a table of the outcome and the peak memory per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys

import torch

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


if __name__ == "__main__":
    main()
