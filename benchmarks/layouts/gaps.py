"""Where each GPU waits during a replicated step: a profiled step of ResNet-101 (fp32), each GPU's busy time and its
longest idle gaps with what ran before and after them.

    python benchmarks/layouts/gaps.py --gpus 4 --layout 1x4:gpipe:1:graphs
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile

import seqify


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--layout", default="1x2:gpipe:1:graphs")
    p.add_argument("--gap-ms", type=float, default=0.2)
    args = p.parse_args()
    shape, schedule, chunks, *rest = args.layout.split(":")
    stages, replicas = (int(v) for v in shape.split("x"))
    devices = [torch.device(f"cuda:{i}") for i in range(args.gpus)]
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet101())
    n = args.per_gpu * args.gpus
    x, y = torch.randn(n, 3, 224, 224, device="cuda:0"), torch.randint(0, 1000, (n,), device="cuda:0")
    pipe = seqify.pipeline(seq, devices=devices, replicas=replicas, chunks=int(chunks), schedule=schedule,
                           graphs="graphs" in rest, checkpoint="never", balance="time", sample=x)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y, F.cross_entropy)
        opt.step()

    for _ in range(4):
        step()
    for d in devices:
        torch.cuda.synchronize(d)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        step()
        for d in devices:
            torch.cuda.synchronize(d)
        wall = time.perf_counter() - t0
    print(f"{args.layout} on {args.gpus} GPUs: last step {wall * 1e3:.1f} ms wall")
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    per: dict[int, list[tuple[int, int, str]]] = {}
    for e in events:
        per.setdefault(e.device_index(), []).append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    for dev, spans in sorted(per.items()):
        spans.sort()
        last_start = max(s for s, _, _ in spans)
        # the last step: from the first kernel after the last host sync (the final third of the profile)
        window = [s for s in spans if s[0] >= last_start - wall * 1e9]
        busy, gaps, end = 0, [], window[0][0]
        prev = window[0][2]
        for s, e, name in window:
            if s > end and (s - end) / 1e6 >= args.gap_ms:
                gaps.append(((s - end) / 1e6, prev[:60], name[:60]))
            busy += max(0, e - max(s, end))
            if e > end:
                end, prev = e, name
        span = (end - window[0][0]) / 1e6
        print(f"cuda:{dev}: {len(window)} kernels, busy {busy / 1e6:.1f} ms of {span:.1f} ms")
        for gap, before, after in sorted(gaps, reverse=True)[:8]:
            print(f"   idle {gap:6.2f} ms  after {before!r}  before {after!r}")


if __name__ == "__main__":
    main()
