"""Distributed runs that stop, checkpoint with seqify.checkpoint and resume in fresh processes: onto the same
ranks, other ranks and balances, an in-process pipeline, the source model (``python -m helpers.dist_resume``).

Run "same" has dropout and two micro-batches under 1F1B (it resumes onto the same layout only); run "moved" has
no random layer and one micro-batch, so every layout computes the same values and it resumes anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import seqify
import seqify.distributed as sd
from seqify import checkpoint

FIRST, THEN, BATCH = 3, 2, 8
RUNS: dict[str, dict[str, Any]] = {"same": {"drop": 0.3, "chunks": 2, "schedule": "1f1b"},
                                   "moved": {"drop": 0.0, "chunks": 1, "schedule": "gpipe"}}


class Net(nn.Module):
    """Linear layers with BatchNorm (buffers), dropout, a skip, and a buffer that layers of two stages read."""

    def __init__(self, drop: float) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(drop)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x))) * self.scale
        g = self.drop(torch.tanh(self.b(h))) + h
        return self.d(torch.relu(self.c(g)) * self.scale)


def source(run: str, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(RUNS[run]["drop"]).double().train()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def split(n: int, parts: int) -> list[int]:
    return [n // parts] * (parts - 1) + [n - (parts - 1) * (n // parts)]


def optimizer(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.Adam(params, lr=0.02, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def step(model: Any, opt: torch.optim.Optimizer, sched: Any, i: int) -> float | None:
    """One training step of a rank's stage, an in-process pipeline or the source model; the loss where known."""
    x, y = batch(i)
    opt.zero_grad()
    if isinstance(model, sd.DistributedStage):
        loss = model.step(x if model.is_first else None, y if model.is_last else None, loss_fn=F.cross_entropy)
    elif isinstance(model, seqify.Pipeline):
        loss = model.step(x, y, F.cross_entropy)
    else:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    opt.step()
    sched.step()
    return None if loss is None else loss.item()


def params(net: nn.Module, held: Any) -> dict[str, torch.Tensor]:
    """The parameters and buffers ``held`` (a stage, pipeline or the net) holds, under the source's names."""
    mine = {id(t) for t in [*held.parameters(), *held.buffers()]}
    return {k: t.detach().clone() for k, t in net.state_dict(keep_vars=True).items() if id(t) in mine}


def staged(run: str, seed: int) -> tuple[Net, sd.DistributedStage]:
    net = source(run, seed)
    seq = seqify.convert(net)
    spec = RUNS[run]
    return net, sd.stage(seq, balance=split(len(seq), torch.distributed.get_world_size()), chunks=spec["chunks"],
                         schedule=spec["schedule"])


def reference(folder: str) -> dict[str, Any]:
    """Each run on this job's ranks for FIRST + THEN steps, saved after FIRST into ``folder/run``."""
    record: dict[str, Any] = {}
    for run in RUNS:
        net, stage = staged(run, 0)
        opt, sched = optimizer(stage.parameters())
        torch.manual_seed(7)
        random.seed(7)
        losses = []
        for i in range(FIRST + THEN):
            losses.append(step(stage, opt, sched, i))
            if i + 1 == FIRST:
                checkpoint.save(stage, os.path.join(folder, run), opt, sched, step=FIRST, extra={"run": run})
        record[run] = {"losses": losses, "params": params(net, stage), "lr": sched.get_last_lr()}
    return record


def resumed(folder: str, runs: list[str]) -> dict[str, Any]:
    """Fresh stages (other weights, other seeds) of this job's ranks loaded from ``folder/run``, THEN steps on."""
    record: dict[str, Any] = {}
    for run in runs:
        net, stage = staged(run, 1)
        opt, sched = optimizer(stage.parameters())
        torch.manual_seed(123)
        restored = checkpoint.load(stage, os.path.join(folder, run), opt, sched)
        losses = [step(stage, opt, sched, i) for i in range(restored.step, restored.step + THEN)]
        record[run] = {"losses": losses, "params": params(net, stage), "lr": sched.get_last_lr(),
                       "step": restored.step, "extra": restored.extra}
    return record


def job(rank: int, world: int, port: int, out: str, phase: str, folder: str, runs: list[str]) -> None:
    """One rank started by ``torch.multiprocessing.spawn``: ``reference`` or ``resumed``, saved to out/rank{rank}.pt."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        record = reference(folder) if phase == "reference" else resumed(folder, runs)
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def one_process(folder: str, out: str, port: int) -> None:
    """Run "moved" resumed in this process: into an in-process pipeline, the source model, and a one-rank job."""
    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    net = source("moved", 1)
    pipe = seqify.pipeline(seqify.convert(net), devices=["cpu"] * 2, balance=[4, len(seqify.convert(net)) - 4])
    for name, model, held in [("pipeline", pipe, net), ("source", source("moved", 1), None)]:
        opt, sched = optimizer(model.parameters())
        restored = checkpoint.load(model, os.path.join(folder, "moved"), opt, sched)
        losses = [step(model, opt, sched, i) for i in range(restored.step, restored.step + THEN)]
        mine = held if held is not None else model
        record[name] = {"losses": losses, "params": params(mine, model), "lr": sched.get_last_lr()}
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        record["one rank"] = resumed(folder, ["moved"])["moved"]
    finally:
        torch.distributed.destroy_process_group()
    torch.save(record, out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(sys.argv[1:])
    one_process(a.folder, a.out, a.port)
