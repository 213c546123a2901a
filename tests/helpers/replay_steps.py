"""A small pipeline replaying its steps (captured CUDA graphs on a GPU, eager programs on the CPU) or not, and SGD
steps of it with a change made before each: for tests of what a user may change between replayed steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.pipe.pipeline import Pipeline


def pipeline(seq: nn.Module, balance: Sequence[int], replay: bool, device: str, schedule: str = "1f1b"
             ) -> Pipeline:
    """``seq`` as two partitions on ``device`` (twice) with 2 micro-batches: replayed (captured on a GPU, eager
    programs elsewhere) or eager."""
    cuda = device.startswith("cuda")
    pipe = seqify.pipeline(seq, devices=[device, device], balance=list(balance), chunks=2, checkpoint="never",
                           schedule=schedule, graphs=cuda and replay)
    pipe._replay_eager = replay and not cuda
    return pipe


def sgd_steps(pipe: Pipeline, count: int, before: Callable[[int], None], replay: bool, device: str
              ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]]:
    """``count`` SGD steps on one batch, ``before(step)`` called first each time; a replayed pipeline must have
    replayed them all (captured on a GPU). Returns each step's loss, its gradients and buffers (running
    statistics), and the programs it ran (None: eager)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, target = torch.randn(8, 6, device=device), torch.randn(8, 3, device=device)
    losses, states, built = [], [], []
    for step in range(count):
        before(step)
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, target, lambda y, t: F.mse_loss(y, t)).detach())
        states.append([p.grad.clone() for p in pipe.parameters()] + [b.clone() for b in pipe.buffers()])
        built.append(pipe._graphed[1] if pipe._graphed is not None else None)
        opt.step()
    assert not replay or (pipe.graph_error is None and (not device.startswith("cuda") or pipe.graphs))
    return losses, states, built


def norm_steps(model: nn.Module, balance: Sequence[int], replay: bool, device: str,
               change: Callable[[nn.BatchNorm1d, int], None], norms: int = 2
               ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]]:
    """Four :func:`sgd_steps` of ``model`` converted and cut at ``balance``, ``change(norm, step)`` applied to each
    of its ``norms`` BatchNorms before each step."""
    seq = seqify.convert(model.to(device))
    found = [m for m in seq.modules() if isinstance(m, nn.BatchNorm1d)]
    assert len(found) == norms

    def before(step: int) -> None:
        for m in found:
            change(m, step)

    return sgd_steps(pipeline(seq, balance, replay, device), 4, before, replay, device)


def assert_like(got: tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]],
                want: tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]], tol: float = 0.0) -> None:
    """Two runs of :func:`sgd_steps` gave the same losses, gradients and buffers: bit-equal, or within ``tol``
    (relative; absolute ``tol / 10``) where one replayed captured graphs."""
    pairs = [*zip(got[0], want[0], strict=True),
             *(p for a, b in zip(got[1], want[1], strict=True) for p in zip(a, b, strict=True))]
    for a, b in pairs:
        if tol:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10)
        else:
            assert torch.equal(a, b)
