"""PyTorch's model-parallel tutorial (ResNet-50 split over two GPUs) in a few lines of seqify.

The tutorial ("Single-Machine Model Parallel Best Practices") subclasses torchvision's ResNet, puts
conv1..layer2 on cuda:0 and layer3..fc on cuda:1 by hand, rewrites forward to move the activations, and
then hand-writes a pipelined forward over split_size micro-batches. With seqify the same is:

    model = torchvision.models.resnet50(num_classes=1000)
    pipe = seqify.pipeline(model, devices=["cuda:0", "cuda:1"], balance="params", chunks=6)

where chunks=6 is the tutorial's batch 120 / split_size 20, and the rest of the tutorial's training loop
is unchanged. Without two GPUs it runs on two CPU devices.

    python examples/resnet50_two_gpus.py                          # the tutorial's sizes
    python examples/resnet50_two_gpus.py --batch 8 --size 32 --batches 1 --repeats 1   # a quick run on a CPU

The tutorial's sizes take about a second a run on two GPUs but many minutes on a CPU (the example warns).
BatchNorm in training mode needs more than one sample per micro-batch, so --chunks is lowered to at most
--batch // 2 (the example prints when it does).
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from typing import Any

import torch
import torch.nn as nn
import torch.optim as optim
import torchvision

import seqify

NUM_CLASSES = 1000


def train(model: nn.Module, batches: int, batch: int, size: int, first: torch.device, last: torch.device) -> None:
    """The tutorial's train(): MSE against one-hot labels, SGD, random images."""
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=0.001)
    one_hot_indices = torch.LongTensor(batch).random_(0, NUM_CLASSES).view(batch, 1)
    for _ in range(batches):
        inputs = torch.randn(batch, 3, size, size)
        labels = torch.zeros(batch, NUM_CLASSES).scatter_(1, one_hot_indices, 1)
        optimizer.zero_grad()
        outputs = model(inputs.to(first))
        loss_fn(outputs, labels.to(last)).backward()
        optimizer.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=120)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--batches", type=int, default=3, help="batches per training run")
    p.add_argument("--repeats", type=int, default=10, help="timed training runs")
    p.add_argument("--chunks", type=int, default=6, help="micro-batches (the tutorial's batch / split_size)")
    p.add_argument("--plot", help="write the tutorial's bar chart here (e.g. mp_vs_rn.png)")
    args = p.parse_args()

    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devices = [torch.device("cuda:0"), torch.device("cuda:1")] if two else [torch.device("cpu")] * 2
    print(f"devices: {[str(d) for d in devices]}{'' if two else ' (no 2 GPUs here: two CPU partitions)'}")

    chunks = max(1, min(args.chunks, args.batch // 2))  # BatchNorm (train) needs >= 2 samples per micro-batch
    if chunks != args.chunks:
        print(f"chunks: {chunks} instead of {args.chunks}: {args.batch} samples in {args.chunks} micro-batches "
              "would leave some with 1 sample, which BatchNorm cannot normalise in training mode", flush=True)
    if not two and args.batch * args.size**2 * args.batches * args.repeats > 8 * 32**2 * 4:
        print(f"note: {2 * args.repeats} training runs of {args.batches} batches of {args.batch}x3x{args.size}x"
              f"{args.size} on a CPU take many minutes; for a quick run: --batch 8 --size 32 --batches 1 "
              "--repeats 1", flush=True)

    # The whole port: seqify converts torchvision's ResNet-50 and splits it over the two devices.
    pipe = seqify.pipeline(torchvision.models.resnet50(num_classes=NUM_CLASSES), devices=devices, balance="params",
                           chunks=chunks)
    print(f"{pipe}: partition 0 ends at layer {pipe.stages[0].names[-1]!r}")

    single = torchvision.models.resnet50(num_classes=NUM_CLASSES).to(devices[0])
    runs = {
        "Pipeline (seqify)": lambda: train(pipe, args.batches, args.batch, args.size, devices[0], devices[1]),
        "Single device": lambda: train(single, args.batches, args.batch, args.size, devices[0], devices[0]),
    }
    means, stds = [], []
    for name, run in runs.items():
        times = timeit.repeat(run, number=1, repeat=args.repeats)
        means.append(statistics.mean(times))
        stds.append(statistics.pstdev(times))
        print(f"{name:18s} {means[-1]:.3f} s +- {stds[-1]:.3f} per run of {args.batches} batches")
    if args.plot:
        fig = bar_chart(list(runs), means, stds, args.repeats,
                        f"ResNet-50 training, {args.batches} batch{'es' if args.batches > 1 else ''} of {args.batch}x3x"
                        f"{args.size}x{args.size}, {chunks} micro-batches on {devices[0].type}")
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


def bar_chart(names: list[str], means: list[float], stds: list[float], repeats: int, title: str) -> Any:
    """The tutorial's bar chart, titled; error bars only when several runs give a spread to show."""
    from seqify import plot

    plt = plot._plt()
    fig, ax = plt.subplots()
    spread = stds if repeats > 1 else None  # one run has no spread
    ax.bar(range(len(means)), means, yerr=spread, align="center", alpha=0.5, ecolor="red", capsize=10, width=0.6)
    ax.set_title(f"{title}\n{f'mean and std of {repeats} runs' if repeats > 1 else 'one run'}", fontsize=9)
    ax.set_ylabel("ResNet50 execution time (s)")
    ax.set_xticks(range(len(means)))
    ax.set_xticklabels(names)
    ax.yaxis.grid(True)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
