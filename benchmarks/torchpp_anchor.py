"""torch.distributed.pipelining on ResNet-101 with hand-cut stages: the anchor seqify is measured against.

    torchrun --nproc-per-node 2 benchmarks/torchpp_anchor.py --batch 256 --chunks 4 8 16 --out DIR

The model is cut by hand into two halves (stem..layer2 | layer3..fc), wrapped in PipelineStage and run
with ScheduleGPipe and Schedule1F1B. Rank 0 prints one JSON row per configuration and writes them to
DIR/torchpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn


def halves(r: torchvision.models.ResNet) -> tuple[nn.Module, nn.Module]:
    first = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2)
    second = nn.Sequential(r.layer3, r.layer4, r.avgpool, nn.Flatten(), r.fc)
    return first, second


def main() -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    x = torch.randn(args.batch, 3, args.res, args.res, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    rows = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), target)

    for schedule in (ScheduleGPipe, Schedule1F1B):
        for chunks in args.chunks:
            name = f"torchpp-{schedule.__name__}-c{chunks}" + ("-bf16" if args.bf16 else "")
            try:
                torch.manual_seed(0)
                part = halves(torchvision.models.resnet101())[rank].to(device)
                stage = PipelineStage(part, rank, world, device)
                sched = schedule(stage, n_microbatches=chunks, loss_fn=loss_fn)
                opt = torch.optim.SGD(part.parameters(), lr=0.01)

                def step() -> None:
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                        if rank == 0:
                            sched.step(x)
                        else:
                            sched.step(target=y, losses=[])
                    opt.step()

                for _ in range(args.warm):
                    step()
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
                dist.barrier()
                sec = (time.perf_counter() - start) / args.steps
                peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
                peaks = [torch.zeros_like(peak) for _ in range(world)]
                dist.all_gather(peaks, peak)
                row = dict(name=name, batch=args.batch, sec_per_step=round(sec, 4),
                           samples_per_s=round(args.batch / sec, 1), peak_gib=[round(float(v), 2) for v in peaks])
            except Exception as e:  # one broken configuration must not hide the rest
                row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(args.out, "torchpp.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
