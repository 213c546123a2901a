"""Probe: where a pipelined ResNet-101 (fp32, SGD) step's time goes on N GPUs, against the ceiling its
micro-batch size allows: one GPU training its share whole and as accumulated micro-batches (N GPUs with no
bubble and no copy cost reach N x the accumulated rate), then each pipeline's wall time, GPU busy time per
device (summed kernel time from torch.profiler, captured graphs included) and its largest idle gaps.

    python benchmarks/busy_time/main.py --chunks 4 8 16 --schedules 1f1b zb-h1
    python benchmarks/busy_time/main.py --gpus 4 --batch 1024 --one-gpu-batch 256 --chunks 8 \
        --schedules zb-h2 1f1b      # weak scaling: one GPU trains 256, accumulated in micro-batches of 128

The one-GPU rows train ``--one-gpu-batch`` samples (default: the whole batch) whole and accumulated in
micro-batches of the pipeline's size, so the ceiling is (pipeline batch / one-GPU batch) x their rate.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torchvision
from torch import nn

import busy as probe  # this folder's profiler helpers (run as a script, its folder is on the path)

import seqify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--loops", type=int, nargs="+", default=[1])
    parser.add_argument("--batch", type=int, default=256, help="the pipeline's mini-batch")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--one-gpu-batch", type=int, help="samples the one-GPU rows train (default: --batch)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    devs = [torch.device("cuda", i) for i in range(args.gpus)]
    share = args.one_gpu_batch or args.batch
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224, device=devs[0])
    y = torch.randint(0, 1000, (args.batch,), device=devs[0])
    rows: list[dict] = []

    def note(name: str, wall: float, per: dict[int, float]) -> None:
        peaks = [(torch.cuda.max_memory_allocated(d) / 2**30, torch.cuda.max_memory_reserved(d) / 2**30) for d in devs]
        probe.show(name, wall, per)
        print(f"{'':<48} peak GiB allocated / reserved: " + ", ".join(f"{a:.2f} / {r:.2f}" for a, r in peaks))
        rows.append({"name": name, "wall_ms": wall * 1e3, "busy_ms": {str(k): v * 1e3 for k, v in per.items()},
                     "peak_allocated_gib": [round(a, 2) for a, _ in peaks],
                     "peak_reserved_gib": [round(r, 2) for _, r in peaks]})
        for d in devs:
            torch.cuda.reset_peak_memory_stats(d)

    for d in devs:
        torch.cuda.reset_peak_memory_stats(d)
    src = torchvision.models.resnet101().to(devs[0])
    opt = torch.optim.SGD(src.parameters(), lr=0.01)

    xs1, ys1 = x[:share], y[:share]

    def whole() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(src(xs1), ys1).backward()
        opt.step()

    whole(); whole()
    note(f"one GPU, batch {share}", *probe.busy(whole, devs[:1]))
    for m in args.chunks:
        k = max(1, m * share // args.batch)  # micro-batches of the pipeline's size (args.batch // m samples)

        def accumulate(k: int = k) -> None:
            opt.zero_grad(set_to_none=True)
            for xs, ys in zip(xs1.chunk(k), ys1.chunk(k)):
                (nn.functional.cross_entropy(src(xs), ys) / k).backward()
            opt.step()
        accumulate(); accumulate()
        note(f"one GPU, {k} micro-batches of {share // k} accumulated", *probe.busy(accumulate, devs[:1]))
    src = opt = None
    torch.cuda.empty_cache()

    plans: dict[tuple[int, int], list[int]] = {}
    for m in args.chunks:
        for schedule in args.schedules:
            for loops in args.loops:
                allowed = {"interleaved": loops > 1, "1f1b": loops == 1, "zb-h1": loops <= 2, "zb-h2": loops == 1}
                if not allowed.get(schedule, True):
                    continue
                torch.manual_seed(0)
                seq = seqify.convert(torchvision.models.resnet101())
                parts = args.gpus * loops
                if (m, parts) not in plans:
                    plans[(m, parts)] = seqify.balance(seq, parts, sample=x[: args.batch // m].cpu(), by="time",
                                                       device=devs[0], progress=False).balance
                pipe = seqify.pipeline(seq, gpus=args.gpus, loops=loops, balance=plans[(m, parts)], chunks=m,
                                       checkpoint="never", graphs=True, schedule=schedule)
                popt = torch.optim.SGD(pipe.parameters(), lr=0.01)

                def step() -> None:
                    popt.zero_grad(set_to_none=True)
                    pipe.step(x, y, nn.functional.cross_entropy)
                    popt.step()

                step(); step()
                print(f"# {schedule} loops {loops} chunks {m}: balance {plans[(m, parts)]}, host issues a step in "
                      f"{probe.host(step, devs) * 1e3:.1f} ms, graph error {pipe.graph_error!r:.80}", flush=True)
                probe.GAPS = True
                note(f"pipeline {schedule} loops={loops} chunks={m} graphs", *probe.busy(step, devs))
                probe.GAPS = False
                pipe = popt = seq = None
                torch.cuda.empty_cache()
    Path(args.out, "resnet-busy.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
