"""The ResNet-101 (fp32, SGD) pipeline that phases.py and gaps.py take apart: arguments and construction."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision

import seqify


@dataclass
class Built:
    """A layout of ResNet-101 on ``devices`` with its batch and optimizer; ``step()`` trains one step."""

    pipe: seqify.ReplicatedPipeline | seqify.Pipeline
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    devices: list[torch.device]
    replicas: int

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.pipe.step(self.x, self.y, F.cross_entropy)
        self.opt.step()

    def sync(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)


def arguments(doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """``--gpus``, ``--per-gpu`` and ``--layout`` (``STAGESxREPLICAS:schedule:chunks[:graphs][:loopsK]``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--layout", default="1x2:gpipe:1:graphs")
    if extra is not None:
        extra(p)
    return p.parse_args()


def build(args: argparse.Namespace) -> Built:
    """ResNet-101 converted and laid out as ``args.layout`` over ``args.gpus`` GPUs, SGD on its parameters."""
    shape, schedule, chunks, *rest = args.layout.split(":")
    stages, replicas = (int(v) for v in shape.split("x"))
    loops = next((int(r[len("loops"):]) for r in rest if r.startswith("loops")), 1)
    devices = [torch.device(f"cuda:{i}") for i in range(args.gpus)]
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet101())
    n = args.per_gpu * args.gpus
    x, y = torch.randn(n, 3, 224, 224, device="cuda:0"), torch.randint(0, 1000, (n,), device="cuda:0")
    pipe = seqify.pipeline(seq, devices=devices, replicas=replicas, chunks=int(chunks), schedule=schedule, loops=loops,
                           graphs="graphs" in rest, checkpoint="never", balance="time", sample=x)
    return Built(pipe, torch.optim.SGD(pipe.parameters(), lr=0.01), x, y, devices, replicas)
