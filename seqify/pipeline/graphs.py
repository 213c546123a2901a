"""Graphs: stages replayed as captured CUDA graphs, one per micro-batch, to remove launch overhead."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..skip.namespace import SkipKey
from .stage import Stage

__all__ = ["GraphedStage", "capture", "graphable"]


class _Flat(nn.Module):
    """A stage as a module of tensors in, tensors out (what make_graphed_callables needs)."""

    def __init__(self, stage: Stage, tuple_input: int | None) -> None:
        super().__init__()
        self.layers = stage.layers
        object.__setattr__(self, "stage", stage)
        self.tuple_input = tuple_input  # None: one tensor; k: a tuple of k tensors
        self.tuple_output: int | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stage = self.stage
        k = 1 if self.tuple_input is None else self.tuple_input
        x: Any = tensors[0] if self.tuple_input is None else tuple(tensors[:k])
        skips = dict(zip(stage.pops, tensors[k:]))
        y, out = stage.fresh(x, skips)  # copies: the captured inputs are leaves a layer must not modify in place
        ys = (y,) if isinstance(y, torch.Tensor) else tuple(y)
        self.tuple_output = None if isinstance(y, torch.Tensor) else len(ys)
        return ys + tuple(out[key] for key in stage.stashes)


def graphable(values: Sequence[Any]) -> bool:
    """Whether values are all CUDA tensors (a captured graph takes nothing else)."""
    return all(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


class GraphedStage:
    """A stage whose micro-batch ``i`` replays its own captured forward and backward graphs.

    GPipe runs every micro-batch forward before any backward, so each micro-batch needs graphs (and
    activation memory) of its own; all of a stage's graphs share one memory pool, captured in the
    order they run (forwards 0..m-1, backwards m-1..0), so memory is reused exactly as eager would.
    """

    def __init__(self, stage: Stage, flats: list[_Flat], graphed: Sequence[Any]) -> None:
        self.stage = stage
        self.flats = flats
        self.graphed = graphed

    def __call__(self, x: Any, skips: dict[SkipKey, Any], i: int) -> tuple[Any, dict[SkipKey, Any]]:
        stage = self.stage
        flat = self.flats[i]
        args = ((x,) if isinstance(x, torch.Tensor) else tuple(x)) + tuple(skips[k] for k in stage.pops)
        outs = self.graphed[i](*args)
        n = 1 if flat.tuple_output is None else flat.tuple_output
        y = outs[0] if flat.tuple_output is None else tuple(outs[:n])
        return y, dict(zip(stage.stashes, outs[n:]))


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextmanager
def _capture_stream(device: torch.device) -> Iterator[None]:
    """torch.cuda.graph captures on one class-wide stream, made on whichever device came first; a stage
    on another device must capture on a stream of its own device (else cuBLAS refuses the capture)."""
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream(device)
    previous = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = stream
    try:
        yield
    finally:
        torch.cuda.graph.default_capture_stream = previous


def _norm_state(modules: Sequence[nn.Module]) -> list[tuple[nn.Module, dict[str, torch.Tensor]]]:
    return [
        (m, {k: v.clone() for k, v in m._buffers.items() if v is not None})
        for part in modules
        for m in part.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def capture(
    stages: Sequence[Stage],
    inputs: Sequence[Any],
    move: Any,
    warmup: int = 2,
) -> list[GraphedStage]:
    """Capture every stage for these micro-batch inputs (shapes, dtypes and grad requirements).

    Capturing runs each stage a few times eagerly (warm-up) and once more to learn the next stage's
    input shapes; BatchNorm running statistics are restored afterwards, so capturing leaves no trace.
    """
    saved = _norm_state([s.layers for s in stages])
    try:
        current = [x for x in inputs]
        pending: list[dict[SkipKey, Any]] = [{} for _ in inputs]
        result: list[GraphedStage] = []
        for stage in stages:
            device = stage.device
            flats: list[_Flat] = []
            samples: list[tuple[torch.Tensor, ...]] = []
            for i, x in enumerate(current):
                x = move(x, device)
                skips = [move(pending[i][k], device) for k in stage.pops]
                xs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
                sample = tuple(
                    t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point()) for t in xs + tuple(skips)
                )
                if not graphable(sample):
                    raise RuntimeError(f"stage {stage.index}: only CUDA tensors can enter a captured graph")
                flats.append(_Flat(stage, None if isinstance(x, torch.Tensor) else len(xs)))
                samples.append(sample)
            with torch.cuda.device(device), _capture_stream(device):
                graphed = torch.cuda.make_graphed_callables(
                    tuple(flats), tuple(samples), num_warmup_iters=warmup, allow_unused_input=True
                )
            runner = GraphedStage(stage, flats, graphed)
            result.append(runner)
            with torch.no_grad():
                for i, sample in enumerate(samples):
                    k = 1 if flats[i].tuple_input is None else flats[i].tuple_input
                    x = sample[0] if flats[i].tuple_input is None else tuple(sample[:k])
                    skips = dict(zip(stage.pops, sample[k:]))
                    y, out = runner(x, skips, i)
                    # What the next stages receive: floating values are taken to need gradients (the
                    # safe side: a graph that computes an unneeded gradient loses nothing).
                    current[i] = _like(y)
                    for key, v in out.items():
                        pending[i][key] = _like_one(v)
        return result
    finally:
        for m, buffers in saved:
            for k, v in buffers.items():
                m._buffers[k].copy_(v)


def _like_one(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point())


def _like(y: Any) -> Any:
    if isinstance(y, torch.Tensor):
        return _like_one(y)
    return tuple(_like_one(t) for t in y)
