"""Train a converted ResNet-101 with seqify's pipeline on synthetic data.

    python examples/train_resnet101.py                            # every GPU, or 2 CPU partitions without GPUs
    python examples/train_resnet101.py --batch 4 --size 32 --steps 2   # a quick run on a CPU

The default sizes train ResNet-101 at 64x224x224 for 5 steps: a few seconds a step on GPUs, minutes on
a CPU (the example says so when it starts there). BatchNorm in training mode needs more than one sample
per micro-batch, so --chunks is lowered to at most --batch // 2 (the example prints when it does).

The model is torchvision's own ResNet-101, converted into an exact seqify.Sequential; the partitions
come from seqify.balance (by measured time on GPUs, by FLOPs on the CPU); training is ordinary PyTorch:
an optimizer over pipe.parameters(), loss.backward(), optimizer.step().
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision

import seqify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet101", help="torchvision model name")
    p.add_argument("--batch", type=int, default=64, help="mini-batch size")
    p.add_argument("--size", type=int, default=224, help="image side")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--devices", help="comma-separated devices (default: every GPU, else cpu,cpu)")
    args = p.parse_args()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(gpus)] or ["cpu", "cpu"]
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None, num_classes=args.classes)
    seq = seqify.convert(model)
    print(seq.summary())

    chunks = max(1, min(args.chunks, args.batch // 2))  # BatchNorm (train) needs >= 2 samples per micro-batch
    if chunks != args.chunks:
        print(f"chunks: {chunks} instead of {args.chunks}: {args.batch} samples in {args.chunks} micro-batches "
              "would leave some with 1 sample, which BatchNorm cannot normalise in training mode", flush=True)
    if not devices[0].startswith("cuda") and args.batch * args.size**2 > 8 * 64**2:
        print(f"note: {args.batch}x3x{args.size}x{args.size} on a CPU takes minutes per step; for a quick run: "
              "--batch 4 --size 32 --steps 2", flush=True)
    micro = torch.randn(max(1, args.batch // chunks), 3, args.size, args.size)
    by = "time" if devices[0].startswith("cuda") else "flops"
    plan = seqify.balance(seq, len(devices), micro, by=by, device=devices[0] if by == "time" else None)
    print(plan)

    pipe = seqify.pipeline(seq, devices=devices, balance=plan.balance, chunks=chunks)
    print(pipe)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 3, args.size, args.size, device=pipe.input_device)
    y = torch.randint(0, args.classes, (args.batch,), device=pipe.output_device)
    for step in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(pipe(x), y)   # outputs come back on the last device
        loss.backward()
        opt.step()
        if pipe.output_device.type == "cuda":
            torch.cuda.synchronize(pipe.output_device)
        took = time.perf_counter() - start
        print(f"step {step}: loss {loss.item():.4f}, {args.batch / took:.1f} samples/s", flush=True)


if __name__ == "__main__":
    main()
