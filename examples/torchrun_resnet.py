"""Train a ResNet over processes with seqify.distributed: one (or --loops) pipeline partitions per rank, under torchrun.

    torchrun --nproc-per-node 2 examples/torchrun_resnet.py                 # 2 stages (GPUs, or CPUs with gloo)
    torchrun --standalone --nproc-per-node 2 examples/torchrun_resnet.py --model resnet18 --batch 4 --size 32 --steps 1   # a quick run on a CPU
    torchrun --nproc-per-node 4 examples/torchrun_resnet.py --stages 2      # 2 stages x 2 data-parallel replicas
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/torchrun_resnet.py --stages 4                              # two machines
    torchrun --standalone --nproc-per-node 2 examples/torchrun_resnet.py --model resnet18 --batch 4 --size 32 \
        --steps 1 --schedule interleaved --loops 2                          # 4 partitions on 2 ranks

Synthetic data; prints the loss of each step on the last stage of replica 0.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

import seqify
import seqify.distributed as sd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--stages", type=int, default=0, help="pipeline stages (default: all processes)")
    p.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--schedule", default="gpipe", help="gpipe, 1f1b, interleaved, zb-h1 or zb-h2")
    p.add_argument("--loops", type=int, default=1, help="partitions per rank (interleaved; zb-h1: 2 in a V)")
    args = p.parse_args()

    chunks = max(1, min(args.chunks, args.batch // 2))  # BatchNorm (train) needs >= 2 samples per micro-batch
    sd.init()
    world = dist.get_world_size()
    stages = args.stages or world
    torch.manual_seed(0)  # every rank must build the same model
    seq = seqify.convert(torchvision.models.get_model(args.model, num_classes=10))
    plan = seqify.balance(seq, stages * args.loops, by="params", progress=False)
    stage = sd.stage(seq, balance=plan.balance, chunks=chunks, schedule=args.schedule, loops=args.loops)
    opt = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
    if dist.get_rank() == 0:
        if chunks != args.chunks:
            print(f"chunks: {chunks} instead of {args.chunks}: micro-batches of 1 sample cannot be normalised by "
                  "BatchNorm in training mode", flush=True)
        print(f"{world} processes: {stages} stages x {world // stages} replicas, {args.loops} partition(s) per "
              f"stage, balance {plan.balance}", flush=True)

    g = torch.Generator().manual_seed(stage.replica)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    for step in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=F.cross_entropy)
        opt.step()
        if loss is not None and stage.replica == 0:
            print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
