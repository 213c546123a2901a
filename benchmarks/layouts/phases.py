"""Where a replicated step's time goes on GPUs: each phase timed alone (synchronised), ResNet-101, fp32.

    python benchmarks/layouts/phases.py --gpus 2 --layout 1x2:gpipe:1:graphs
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch.nn.functional as F

from replicated_resnet import arguments, build
from seqify.pipe import replica_state, replicated


def main() -> None:
    run = build(arguments(__doc__))
    pipe, opt, x, y = run.pipe, run.opt, run.x, run.y

    def timed(fn: Callable[[], object], k: int = 5) -> float:
        out = []
        for _ in range(k):
            run.sync()
            t = time.perf_counter()
            fn()
            run.sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    for _ in range(3):
        run.step()
    print(f"whole step {timed(run.step):.1f} ms")
    host = []
    for _ in range(5):
        run.sync()
        t = time.perf_counter()
        run.step()
        host.append(time.perf_counter() - t)
        run.sync()
    print(f"host issue of a step {statistics.median(host) * 1e3:.1f} ms")
    print(f"copy_state {timed(lambda: replica_state.copy_state(pipe._state[0], pipe._state[1:])):.1f} ms")
    print(f"sum_gradients {timed(lambda: replica_state.sum_gradients(pipe._params)):.1f} ms")
    print(f"optimizer step {timed(opt.step):.1f} ms")
    real = replica_state.sum_gradients
    replicated.sum_gradients = lambda params: None
    print(f"step without summing gradients {timed(run.step):.1f} ms")
    replicated.sum_gradients = real
    one = pipe.replicas[0]
    n = len(x) // run.replicas
    print(f"one replica's step alone {timed(lambda: one.step(x[:n], y[:n], F.cross_entropy)):.1f} ms")
    print(f"samples/s {len(x) / timed(run.step) * 1e3:.1f}")


if __name__ == "__main__":
    main()
