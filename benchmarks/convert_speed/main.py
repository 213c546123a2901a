"""How fast convert is, and how the converted model's speed compares with its source, side by side.

    python benchmarks/convert_speed/main.py [--model resnet101] [--batch 4] [--size 224] [--repeats 5] [--device cpu]

Prints a table: conversion time (cold: first call in the process; warm: median of the next calls) and
forward+backward time of the source and of the converted model, measured alternately in one run on
the same device, with their ratio (converted speed / source speed; 1.00 means equal speed).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torchvision

import seqify


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    model(x).float().square().mean().backward()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--convert-repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    start = time.perf_counter()
    seq = seqify.convert(model)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(args.convert_repeats):
        start = time.perf_counter()
        seqify.convert(model)
        warm.append(time.perf_counter() - start)

    model.to(device).train()
    seq.to(device).train()
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    for m in (model, seq):  # warm up allocators and kernels
        step(m, x, device)
        m.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {"source": [], "converted": []}
    for _ in range(args.repeats):  # alternate, so drift in machine load hits both alike
        for name, m in (("source", model), ("converted", seq)):
            times[name].append(step(m, x, device))
            m.zero_grad(set_to_none=True)
    src = statistics.median(times["source"])
    conv = statistics.median(times["converted"])

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"model {args.model}, {len(seq)} layers, {len(seq.skips)} skips; torch {torch.__version__}; {where}")
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| convert, first call in process | {cold:.3f} s |")
    print(f"| convert, median of {args.convert_repeats} more | {statistics.median(warm):.3f} s |")
    print(f"| source fwd+bwd, batch {args.batch}x3x{args.size}x{args.size}, median of {args.repeats} | {src * 1000:.1f} ms |")
    print(f"| converted fwd+bwd, same | {conv * 1000:.1f} ms |")
    print(f"| converted speed / source speed | {src / conv:.3f}x |")


if __name__ == "__main__":
    main()
