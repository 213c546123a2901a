"""A small training run that stops, checkpoints and resumes in fresh processes (``python -m helpers.resume``).

The net has a skip connection, BatchNorm (buffers) and dropout (torch's generator); each batch draws its
inputs from numpy's generator and a flip from Python's ``random``, so all three generators decide the run.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify import checkpoint

WIDTH, CLASSES, BATCH = 8, 3, 8


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, WIDTH, 3, padding=1)
        self.bn = nn.BatchNorm2d(WIDTH)
        self.drop = nn.Dropout(0.3)
        self.body = nn.Conv2d(WIDTH, WIDTH, 3, padding=1)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = h + self.drop(torch.tanh(self.body(h)))  # the skip around body
        v = h.mean((2, 3))
        return self.head(self.drop(v) + torch.relu(self.mix(v)))


def source(seed: int) -> SkipNet:
    torch.manual_seed(seed)
    return SkipNet().double()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.random.standard_normal((BATCH, 2, 6, 6)))
    if random.random() < 0.5:
        x = x.flip(-1)
    return x, torch.randint(0, CLASSES, (BATCH,))


def build(kind: str, seed: int, chunks: int, optim: str) -> tuple[Any, Any, Any]:
    """(runner, optimizer, scheduler) for ``kind``: 'source', or 'pipe:A,B,...' (a pipeline of that balance)."""
    model: Any = source(seed)
    if kind != "source":
        balance = [int(b) for b in kind.split(":")[1].split(",")]
        seq = seqify.convert(model)
        model = seqify.pipeline(seq, devices=["cpu"] * len(balance), balance=balance, chunks=chunks,
                                schedule="1f1b" if chunks > 1 else "gpipe")
    model.train()
    if optim == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model: Any, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = batch()
        opt.zero_grad()
        if isinstance(model, seqify.Pipeline):
            loss = model.step(x, y, F.cross_entropy)
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def state(model: Any) -> dict[str, torch.Tensor]:
    """The model's state under the source's keys."""
    held = model.model if isinstance(model, seqify.Pipeline) else model
    sd = held.original_state_dict() if isinstance(held, seqify.Sequential) else held.state_dict()
    return {k: v.clone() for k, v in sd.items()}


def reference(kind: str, chunks: int, optim: str, first: int, then: int, folder: str, out: str) -> None:
    """The uninterrupted run of first + then steps, and a run stopped after ``first`` steps and saved."""
    seed_all(7)
    model, opt, sched = build(kind, 0, chunks, optim)
    losses = train(model, opt, sched, first + then)
    result = {"losses": losses, "state": state(model), "lr": sched.get_last_lr()}
    seed_all(7)
    model, opt, sched = build(kind, 0, chunks, optim)
    result["first"] = train(model, opt, sched, first)
    checkpoint.save(model, folder, opt, sched, step=first, extra={"kind": kind})
    torch.save(result, out)


def resume(kind: str, chunks: int, optim: str, then: int, folder: str, out: str, rng: bool = True) -> None:
    """A fresh model (other weights, other seeds) restored from ``folder``, trained ``then`` more steps."""
    seed_all(123)
    model, opt, sched = build(kind, 1, chunks, optim)
    restored = checkpoint.load(model, folder, opt, sched, rng_state=rng)
    losses = train(model, opt, sched, then)
    torch.save({"losses": losses, "state": state(model), "lr": sched.get_last_lr(), "step": restored.step,
                "extra": restored.extra}, out)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["reference", "resume"])
    p.add_argument("--kind", required=True)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--optim", default="adam")
    p.add_argument("--first", type=int, default=3)
    p.add_argument("--then", type=int, default=3)
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.phase == "reference":
        reference(a.kind, a.chunks, a.optim, a.first, a.then, a.folder, a.out)
    else:
        resume(a.kind, a.chunks, a.optim, a.then, a.folder, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
