"""One rank of the meta-device tests: memory of a large model staged from meta, and two steps of pipelines built
from meta and from real models (``torch.multiprocessing.spawn``)."""

from __future__ import annotations

import datetime
import gc
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import seqify.distributed as sd
from helpers import dist_worker

BIG_LAYERS, BIG_WIDTH = 64, 1024  # 64 x 1024 x 1024 float32: 256 MiB of weights


class Scaled(nn.Module):
    """Linear layers, a skip, a persistent buffer and a non-persistent one (checkpoints lack it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.register_buffer("shift", torch.randn(8))
        # torch.empty, not torch.linspace: once transformers' from_pretrained has run in the process, torch.device()
        # contexts no longer place torch.linspace (transformers.initialization swaps it while torch caches its
        # list of factory functions), and a later Scaled built on meta would hold real values
        self.register_buffer("scale", torch.empty(8), persistent=False)
        scale_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * self.scale + self.shift
        return self.c(torch.relu(self.b(h)) + h)


def scale_init(module: nn.Module) -> None:
    """What ``Scaled.__init__`` does for its non-persistent buffer."""
    if isinstance(module, Scaled):
        with torch.no_grad():
            module.scale.copy_(torch.linspace(0.5, 1.5, 8))


class Big(nn.Module):
    """Wide Linear layers: weights dominate a rank's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False) for _ in range(BIG_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return Scaled().double() if name == "scaled" else dist_worker.build(name)


def data(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "scaled":
        g = torch.Generator().manual_seed(1 + step)
        return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    return dist_worker.data(name, 8, step)


def loss_fn(name: str) -> Any:
    return F.cross_entropy if name == "scaled" else dist_worker.lm_loss


def peak_kib() -> int:
    """This process's peak resident memory so far (VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _big(weights: str) -> dict[str, int]:
    before = peak_kib()
    with torch.device("meta"):
        model = Big()
    stage = sd.stage(model, balance=[BIG_LAYERS // 2] * 2, weights=weights)
    mine = sum(p.numel() * p.element_size() for p in stage.parameters())
    grown = (peak_kib() - before) * 1024
    del stage, model
    gc.collect()
    return {"grown": grown, "mine": mine, "whole": BIG_LAYERS * BIG_WIDTH * BIG_WIDTH * 4}


def _train(name: str, model: nn.Module, **keywords: Any) -> dict[str, Any]:
    """Two SGD steps (momentum) of the pipeline over the two ranks: losses, gradients and parameters by
    source name."""
    example = {"input_ids": data(name, 0)[0]} if name == "llama" else None
    stage = sd.stage(model, chunks=2, example_inputs=example, **keywords)
    keys = {id(p): _key(stage, p) for p in stage.partition.parameters()}
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(2):
        x, y = data(name, step)
        opt.zero_grad()
        loss = stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=loss_fn(name))
        out["losses"].append(None if loss is None else float(loss))
        out["grads"].append({keys[id(p)]: p.grad.clone() for p in stage.partition.parameters()})
        opt.step()
    out["params"] = {keys[id(p)]: p.detach().clone() for p in stage.partition.parameters()}
    return out


def _key(stage: sd.DistributedStage, p: torch.Tensor) -> str:
    """The source key of parameter ``p`` of the stage's layers."""
    model: Any = stage.model
    return next(k for k in model.original_keys() if any(t is p for t in model._tensors(k)))


def spawned(rank: int, port: int, out: str, weights: dict[str, str]) -> None:
    """Rank ``rank`` of two: the large model's memory from meta, then each small model trained from meta
    (filled from ``weights[name]``) and from its real build; saved to ``out/rank{rank}.pt``."""
    torch.set_num_threads(1)
    import transformers  # noqa: F401  (imports before the memory baseline: they are not the model's memory)

    import seqify.checkpoint  # noqa: F401  (torch.distributed.checkpoint, which reading the weights loads)

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        record: dict[str, Any] = {"big": _big(weights["big"])}
        for name in ("scaled", "llama"):
            with torch.device("meta"):
                meta = build(name)
            record[name] = {
                "meta": _train(name, meta, balance="params", weights=weights[name],
                               buffers=scale_init if name == "scaled" else None),
                "real": _train(name, build(name), balance="params"),
            }
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()
