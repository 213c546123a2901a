"""What adding a step's weight gradients into float32 sums costs on one GPU, at the 0.89 B Llama's parameter shapes:
bfloat16 gradients (what a replayed program's backward yields under autocast) added into zeroed sums
(``_foreach_zero_`` then ``_foreach_add_``, once per micro-batch), against copying the first micro-batch's into
the sums (``_foreach_copy_``, which widens as it copies) and adding the rest. Each way is checked against the
float32 sum of the widened gradients before it is timed.

    python benchmarks/layouts/accumulate.py --micro-batches 1 2 4
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
from main import llama


def shapes(tiny: bool) -> list[torch.Size]:
    """The parameter shapes of the 0.89 B Llama (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = llama(tiny).build()
    return [p.shape for p in model.parameters()]


def timed(fn: Callable[[], None], repeat: int) -> float:
    """Milliseconds per call of ``fn``, CUDA events around ``repeat`` calls after two untimed ones."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda:0")
    sizes = shapes(args.tiny)
    numel = sum(s.numel() for s in sizes)
    sums = [torch.empty(s, device=dev) for s in sizes]
    for m in args.micro_batches:
        g = torch.Generator(device=dev).manual_seed(m)
        grads = [[torch.randn(s, device=dev, generator=g).bfloat16() for s in sizes] for _ in range(m)]
        exact = [sum(gs[k].float() for gs in grads) for k in range(len(sizes))]

        def zero_then_add(grads: list[list[torch.Tensor]] = grads) -> None:
            torch._foreach_zero_(sums)
            for gs in grads:
                torch._foreach_add_(sums, gs)

        def copy_then_add(grads: list[list[torch.Tensor]] = grads) -> None:
            torch._foreach_copy_(sums, grads[0])
            for gs in grads[1:]:
                torch._foreach_add_(sums, gs)

        row = dict(micro_batches=m, parameters=numel, device=torch.cuda.get_device_name(0), torch=torch.__version__)
        for name, fn in (("zero_then_add", zero_then_add), ("copy_then_add", copy_then_add)):
            fn()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(sums, exact)), f"{name} differs from the widened sum"
            row[f"{name}_ms"] = round(timed(fn, args.repeat), 3)
        row["saved_ms"] = round(row["zero_then_add_ms"] - row["copy_then_add_ms"], 3)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        del grads, exact, zero_then_add, copy_then_add


if __name__ == "__main__":
    sys.exit(main())
