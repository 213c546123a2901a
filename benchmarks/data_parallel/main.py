"""Data parallelism beside the pipeline for a model that fits one GPU: torchvision ResNet-101, batch B in all
(B / world per rank), fp32, SGD, DDP over the ranks. The alternative a user with two GPUs reaches for first.

    torchrun --nproc-per-node 2 benchmarks/data_parallel/main.py      # JSON row on rank 0: samples/s, peak GiB per rank
"""
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn

B = int(os.environ.get("B", 256))
STEPS = int(os.environ.get("STEPS", 6))
WARM = int(os.environ.get("WARM", 2))
GIB = 2**30


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, 224, 224, generator=g).chunk(world)[rank].to(dev)
    y = torch.randint(0, 1000, (B,), generator=g).chunk(world)[rank].to(dev)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torchvision.models.resnet101().to(dev), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(WARM):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    sec = (time.perf_counter() - t) / STEPS
    mem = torch.tensor([torch.cuda.max_memory_allocated(dev) / GIB, torch.cuda.max_memory_reserved(dev) / GIB], device=dev)
    every = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(every, mem)
    if rank == 0:
        print(json.dumps(dict(name="resnet101-ddp-fp32", world=world, batch=B, samples_per_s=round(B / sec, 1),
                              peak_gib=[round(float(m[0]), 2) for m in every],
                              reserved_gib=[round(float(m[1]), 2) for m in every])), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
