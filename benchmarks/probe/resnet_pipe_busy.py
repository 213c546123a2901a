"""Probe: where a pipelined ResNet-101 (batch 256, fp32, SGD) step's time goes on two GPUs, against the ceiling
its micro-batch size allows: one GPU training the batch whole and as m accumulated micro-batches (two GPUs with
no bubble and no copy cost reach 2 x the accumulated rate), then each pipeline's wall time, GPU busy time per
device (summed kernel time from torch.profiler, captured graphs included) and its largest idle gaps.

    python benchmarks/probe/resnet_pipe_busy.py --chunks 4 8 16 --schedules 1f1b zb-h1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_pipe_busy as probe  # noqa: E402

import seqify  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--loops", type=int, nargs="+", default=[1])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    devs = [torch.device("cuda:0"), torch.device("cuda:1")]
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

    def whole() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(src(x), y).backward()
        opt.step()

    whole(); whole()
    note(f"one GPU, batch {args.batch}", *probe.busy(whole, devs[:1]))
    for m in args.chunks:
        def accumulate(m: int = m) -> None:
            opt.zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                (nn.functional.cross_entropy(src(xs), ys) / m).backward()
            opt.step()
        accumulate(); accumulate()
        note(f"one GPU, {m} micro-batches accumulated", *probe.busy(accumulate, devs[:1]))
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
                parts = 2 * loops
                if (m, parts) not in plans:
                    plans[(m, parts)] = seqify.balance(seq, parts, sample=x[: args.batch // m].cpu(), by="time",
                                                       device=devs[0], progress=False).balance
                pipe = seqify.pipeline(seq, gpus=2, loops=loops, balance=plans[(m, parts)], chunks=m,
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
