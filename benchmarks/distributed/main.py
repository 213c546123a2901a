"""Training throughput of seqify.distributed (NCCL) on ResNet-101, one or ``--loops`` partitions per process.

    torchrun --nproc-per-node 2 benchmarks/distributed/main.py --batch 256 --chunks 4 8 16 \
        --schedules gpipe 1f1b zb-h1 --graphs both --out DIR
    torchrun --nproc-per-node 2 benchmarks/distributed/main.py --loops 2 --schedules interleaved zb-h1 --out DIR

Balanced by FLOPs by default (``--balance``); rank 0 prints one JSON row per schedule and chunk count, with
every rank's peak allocated and reserved GiB, and writes them to DIR/distributed.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

import seqify
import seqify.distributed as sd

# timing and rows shared with the torch pipelining anchor in benchmarks/two_gpus/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "two_gpus"))
import ranks  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--balance", default="flops")
    p.add_argument("--schedules", nargs="+", default=["gpipe"], help="shared schedules: gpipe 1f1b interleaved zb-h1")
    p.add_argument("--loops", type=int, default=1, help="partitions per process (interleaved; zb-h1: 2 in a V)")
    p.add_argument("--graphs", choices=["off", "on", "both"], default="off", help="rows with graphs=True too")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around each step (rows tagged -bf16)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    sd.init()
    rows = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
    for schedule, graphs, chunks in [(s, g, c) for s in args.schedules for g in modes for c in args.chunks]:
        loops = f"-loops{args.loops}" if args.loops > 1 else ""
        name = f"seqify-distributed-{schedule}{loops}{'-graphs' if graphs else ''}-c{chunks}{'-bf16' if args.bf16 else ''}"
        try:
            torch.manual_seed(0)
            seq = seqify.convert(torchvision.models.resnet101())
            stage = sd.stage(seq, balance=args.balance, chunks=chunks, schedule=schedule, graphs=graphs,
                             loops=args.loops,
                             # balanced for the micro-batch the step runs (time at batch 2 is launch overhead)
                             sample=torch.randn(max(1, args.batch // chunks), 3, args.res, args.res))
            opt = torch.optim.SGD(stage.parameters(), lr=0.01)
            x = torch.randn(args.batch, 3, args.res, args.res, device=stage.device)
            y = torch.randint(0, 1000, (args.batch,), device=stage.device)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast(stage.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=F.cross_entropy)
                opt.step()

            sec, peaks = ranks.measure(step, args.warm, args.steps, stage.device)
            r = ranks.row(name, args.batch, sec, peaks, reserved_gib=ranks.reserved(stage.device), balance=stage.balance)
            del stage, opt, seq
        except Exception as e:  # one broken configuration must not hide the rest
            r = ranks.error_row(name, e)
        ranks.report(rows, r)
    ranks.finish(rows, os.path.join(args.out, "distributed-bf16.json" if args.bf16 else "distributed.json"))


if __name__ == "__main__":
    main()
