"""Where a replicated step's time goes on GPUs: each phase timed alone (synchronised), ResNet-101, fp32.

    python benchmarks/layouts/phases.py --gpus 2 --layout 1x2:gpipe:1:graphs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision

import seqify
from seqify.pipe import replica_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--layout", default="1x2:gpipe:1:graphs")
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

    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    def timed(fn, k: int = 5) -> float:
        out = []
        for _ in range(k):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y, F.cross_entropy)
        opt.step()

    for _ in range(3):
        step()
    print(f"whole step {timed(step):.1f} ms")
    host = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
        sync()
    print(f"host issue of a step {statistics.median(host) * 1e3:.1f} ms")
    print(f"copy_state {timed(lambda: replica_state.copy_state(pipe._state[0], pipe._state[1:])):.1f} ms")
    print(f"sum_gradients {timed(lambda: replica_state.sum_gradients(pipe._params)):.1f} ms")
    print(f"optimizer step {timed(opt.step):.1f} ms")
    real = replica_state.sum_gradients
    pipe_mod = __import__("seqify.pipe.replicated", fromlist=["x"])
    pipe_mod.sum_gradients = lambda params: None
    print(f"step without summing gradients {timed(step):.1f} ms")
    pipe_mod.sum_gradients = real
    one = pipe.replicas[0]
    share = x[: n // replicas]
    print(f"one replica's step alone {timed(lambda: one.step(share, y[: n // replicas], F.cross_entropy)):.1f} ms")
    print(f"samples/s {n / timed(step) * 1e3:.1f}")


if __name__ == "__main__":
    main()
