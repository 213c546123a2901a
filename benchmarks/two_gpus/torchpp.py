"""torch.distributed.pipelining on ResNet-101 with hand-cut stages: the anchor seqify is measured against.

    torchrun --nproc-per-node 2 benchmarks/two_gpus/torchpp.py --batch 256 --chunks 4 8 16 --out DIR

The model is cut by hand into two stages (stem..layer2 | layer3..fc, or with ``--cuts K`` the first K
blocks of layer3 moved to the first stage), wrapped in PipelineStage and run with ScheduleGPipe and
Schedule1F1B. Rank 0 prints one JSON row per configuration and writes them to
DIR/torchpp.json (torchpp-bf16.json with --bf16).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torchvision
from torch import nn

import ranks


def halves(r: torchvision.models.ResNet, cut: int = 0) -> tuple[nn.Module, nn.Module]:
    """Two stages: the stem, layer1, layer2 and the first ``cut`` blocks of layer3; then the rest."""
    first = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3[:cut])
    second = nn.Sequential(r.layer3[cut:], r.layer4, r.avgpool, nn.Flatten(), r.fc)
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
    p.add_argument("--cuts", type=int, nargs="+", default=[0],
                   help="blocks of layer3 on the first stage (0: stem..layer2 | layer3..fc; 3 sits near "
                        "seqify's time-balanced cut on an H200)")
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

    for schedule, cut, chunks in [(s, k, c) for s in (ScheduleGPipe, Schedule1F1B) for k in args.cuts for c in args.chunks]:
        at = f"-cut{cut}" if cut else ""
        name = f"torchpp-{schedule.__name__}{at}-c{chunks}" + ("-bf16" if args.bf16 else "")
        try:
            torch.manual_seed(0)
            part = halves(torchvision.models.resnet101(), cut)[rank].to(device)
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

            sec, peaks = ranks.measure(step, args.warm, args.steps, device)
            r = ranks.row(name, args.batch, sec, peaks, reserved_gib=ranks.reserved(device))
        except Exception as e:  # one broken configuration must not hide the rest
            r = ranks.error_row(name, e)
        ranks.report(rows, r)
    ranks.finish(rows, os.path.join(args.out, "torchpp-bf16.json" if args.bf16 else "torchpp.json"))


if __name__ == "__main__":
    main()
