"""What a micro-batch's linear weight gradients cost on one GPU, at the 0.89 B Llama's linear layers: bfloat16
products (``dY^T @ X``, what autograd computes under autocast) all kept, then widened into the float32 sums (copied
for the step's first micro-batch, added for the later ones), against one product per weight that writes or adds
its float32 result into the sum (``torch.addmm`` with ``out_dtype=torch.float32``, seqify's fused sums). Each way
is checked against the float64 product before it is timed (the fused one is the closer); each way's timed calls
carry their peak allocated GiB, which includes the sums, inputs and output gradients every way holds.

    python benchmarks/layouts/fused_products.py --tokens 4096
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

import torch
from accumulate import timed
from main import llama
from torch import nn

GIB = 2**30


def linear_shapes(tiny: bool) -> list[tuple[int, int]]:
    """The (out, in) shapes of the 0.89 B Llama's linear layers (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = llama(tiny).build()
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]  # type: ignore[misc]


def error(sums: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """The largest difference from the float64 product, relative to that product's largest magnitude."""
    return max(float((s.double() - e).abs().max() / e.abs().max()) for s, e in zip(sums, exact))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="rows of a micro-batch (2 x 2048 tokens by default)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda:0")
    shapes = linear_shapes(args.tiny)
    g = torch.Generator(device=dev).manual_seed(0)
    x = {i: torch.randn(args.tokens, i, device=dev, generator=g).bfloat16() for i in {i for _, i in shapes}}
    dy = {o: torch.randn(args.tokens, o, device=dev, generator=g).bfloat16() for o in {o for o, _ in shapes}}
    sums = [torch.empty(o, i, device=dev) for o, i in shapes]
    exact = [dy[o].double().t() @ x[i].double() for o, i in shapes]

    def unfused(write: bool) -> None:
        grads = [dy[o].t() @ x[i] for o, i in shapes]  # autograd hands a program's gradients back together
        (torch._foreach_copy_ if write else torch._foreach_add_)(sums, grads)

    def fused(write: bool) -> None:
        for (o, i), s in zip(shapes, sums):
            torch.addmm(s, dy[o].t(), x[i], out_dtype=torch.float32, beta=0 if write else 1, out=s)

    row: dict[str, object] = dict(tokens=args.tokens, weights=sum(o * i for o, i in shapes),
                                  device=torch.cuda.get_device_name(0), torch=torch.__version__)
    ways: list[tuple[str, Callable[[bool], None]]] = [("unfused", unfused), ("fused", fused)]
    for name, fn in ways:
        fn(True)
        torch.cuda.synchronize()
        row[f"{name}_error"] = error(sums, exact)
    del exact
    for name, fn in ways:
        for write in (True, False):
            torch.cuda.reset_peak_memory_stats(dev)
            call = functools.partial(fn, write)
            row[f"{name}_{'write' if write else 'add'}_ms"] = round(timed(call, args.repeat), 3)
            row[f"{name}_{'write' if write else 'add'}_peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / GIB, 2)
    assert row["fused_error"] <= row["unfused_error"], row  # type: ignore[operator]
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
