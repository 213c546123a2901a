"""Training throughput of seqify.distributed (one stage per process, NCCL) on ResNet-101.

    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --batch 256 --chunks 4 8 16 --out DIR

Balanced by parameters on rank 0 and broadcast; rank 0 prints one JSON row per chunk count and writes
them to DIR/distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

import seqify
import seqify.distributed as sd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--balance", default="flops")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    sd.init()
    rank = dist.get_rank()
    rows = []
    for chunks in args.chunks:
        name = f"seqify-distributed-c{chunks}"
        try:
            torch.manual_seed(0)
            seq = seqify.convert(torchvision.models.resnet101())
            stage = sd.stage(seq, balance=args.balance, chunks=chunks, sample=torch.randn(2, 3, args.res, args.res))
            opt = torch.optim.SGD(stage.parameters(), lr=0.01)
            x = torch.randn(args.batch, 3, args.res, args.res, device=stage.device)
            y = torch.randint(0, 1000, (args.batch,), device=stage.device)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=F.cross_entropy)
                opt.step()

            for _ in range(args.warm):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            sec = (time.perf_counter() - start) / args.steps
            peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=stage.device)
            peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
            dist.all_gather(peaks, peak)
            row = dict(name=name, batch=args.batch, sec_per_step=round(sec, 4), samples_per_s=round(args.batch / sec, 1),
                       peak_gib=[round(float(v), 2) for v in peaks], balance=stage.balance)
            del stage, opt, seq
        except Exception as e:  # one broken configuration must not hide the rest
            row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(args.out, "distributed.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
