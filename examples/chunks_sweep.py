"""How training throughput depends on the number of micro-batches (chunks), with a plot.

    python examples/chunks_sweep.py                                    # every GPU (or cpu,cpu), ResNet-101
    python examples/chunks_sweep.py --model resnet18 --batch 8 --size 32 --chunks 1 2 4 --steps 1   # a quick run on a CPU

More micro-batches shrink the pipeline's fill and drain bubble ((stages - 1) / (chunks + stages - 1) of
the time is idle) but make each kernel smaller; the sweep finds the best trade on your hardware. On a
CPU all partitions share the same cores, so the sweep shows the pipeline's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import os

import torch
import torchvision

import seqify
from seqify import measure, plot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet101")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--devices", help="comma-separated devices (default: every GPU, else cpu,cpu)")
    p.add_argument("--out", default="chunks-sweep", help="where to write sweep.png and sweep.svg")
    args = p.parse_args()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(gpus)] or ["cpu", "cpu"]
    if not devices[0].startswith("cuda") and args.batch * args.size**2 * len(args.chunks) * args.steps > 8 * 32**2 * 3 * 1 * 16:
        print(f"note: {len(args.chunks)} configurations x {args.steps + 1} steps of {args.batch}x3x{args.size}x{args.size} "
              f"on a CPU take many minutes; for a quick run: --model resnet18 --batch 8 --size 32 --chunks 1 2 4 "
              "--steps 1", flush=True)
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.get_model(args.model, weights=None))
    by = "time" if devices[0].startswith("cuda") else "flops"
    probe = torch.randn(max(1, args.batch // max(args.chunks)), 3, args.size, args.size)
    plan = seqify.balance(seq, len(devices), probe, by=by, device=devices[0] if by == "time" else None)
    print(plan)

    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    result = measure.sweep(seq, x, y, devices=devices, balance=plan.balance, chunks=args.chunks, steps=args.steps,
                           warm=1, checkpoint="never" if by == "time" else "except_last", label=args.model)
    print(result)
    best = result.best()
    print(f"best: {best.chunks} micro-batches, {best.samples_per_s:.1f} samples/s")
    if plot.available():
        files = plot.save(plot.plot_sweep(result), os.path.join(args.out, "sweep"))
        print("plot:", ", ".join(map(str, files)))
    else:
        print("plot skipped: pip install matplotlib")


if __name__ == "__main__":
    main()
