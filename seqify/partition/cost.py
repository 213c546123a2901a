"""Cost models: each layer's cost by parameters, FLOPs, time or memory, and the bytes it holds and sends."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify.partition.errors import BalanceError
from seqify.partition.profile import profile
from seqify.partition.shapes import propagate
from seqify.partition.walk import Layers, first_input, layers, owned
from seqify.skip.namespace import SkipKey

__all__ = [
    "BY",
    "LINK_BANDWIDTH",
    "FLOPS_PER_BYTE",
    "TRAINING_FACTOR",
    "LayerCosts",
    "param_costs",
    "flop_costs",
    "time_costs",
    "memory_costs",
    "costs",
    "default_transfer_cost",
]

#: The cost models ``balance(by=...)`` knows.
BY = ("time", "memory", "flops", "params")

#: Assumed link bandwidth between neighbouring stages (bytes/s): NVLink-class, ~100 GB/s.
LINK_BANDWIDTH = 100e9

#: What moving one byte between stages costs in FLOPs: ~10 TFLOP/s of sustained training compute over a
#: ~100 GB/s link is 100 FLOP per byte, and every cut is crossed twice (activations forward, gradients
#: backward), so 200.
FLOPS_PER_BYTE = 200.0

#: Forward + backward of a layer costs about three forwards (backward computes two products per one).
TRAINING_FACTOR = 3


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer numbers the solver balances.

    ``cost`` is in the unit of ``by`` (parameters, FLOPs of forward+backward, seconds of forward+backward,
    or bytes); ``state_bytes`` are the parameter and buffer bytes a layer is the first to use;
    ``activation_bytes`` the bytes autograd keeps for its backward; ``output_bytes`` what it hands to the
    next layer and ``skip_bytes`` what each skip carries. Without a sample the byte counts are zeros and
    ``measured`` is False.
    """

    by: str
    cost: tuple[float, ...]
    state_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    skip_bytes: Mapping[SkipKey, int] = field(default_factory=dict)
    measured: bool = True
    host: tuple[float, ...] = ()  # by='time' on CUDA: host seconds to issue each layer's forward+backward

    def __len__(self) -> int:
        return len(self.cost)

    @property
    def memory(self) -> tuple[int, ...]:
        """Per layer, the bytes a stage holding it needs: its state plus its saved activations."""
        return tuple(s + a for s, a in zip(self.state_bytes, self.activation_bytes))


def _state_bytes(lays: Layers) -> tuple[int, ...]:
    return tuple(sum(t.numel() * t.element_size() for t in mine) for mine in owned(lays.modules))


def _need(sample: Any, by: str) -> None:
    if sample is None:
        raise BalanceError(
            f"by={by!r} needs sample=... (an input batch, as you would pass it to the model); "
            "balance by='params' needs none"
        )


def param_costs(model: nn.Module, sample: Any = None, *, progress: bool = False) -> LayerCosts:
    """Parameter count per layer (a shared parameter counts in the first layer using it). No sample
    needed; with one, byte counts are filled in from fake-tensor shape propagation."""
    lays = layers(model)
    seen: set[int] = set()
    counts: list[float] = []
    for module in lays.modules:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts.append(float(n))
    state = _state_bytes(lays)
    if sample is None:
        zeros = (0,) * len(lays)
        return LayerCosts("params", tuple(counts), state, zeros, zeros, {}, measured=False)
    try:
        shapes = propagate(lays, first_input(model, sample), progress=progress)
    except BalanceError as e:  # the counts stand without bytes; say why the byte columns are empty
        warnings.warn(f"balance by='params' leaves activation and cut bytes unknown: {e}", stacklevel=2)
        zeros = (0,) * len(lays)
        return LayerCosts("params", tuple(counts), state, zeros, zeros, {}, measured=False)
    return LayerCosts("params", tuple(counts), state, shapes.saved_bytes, shapes.output_bytes, shapes.skip_bytes)


def flop_costs(model: nn.Module, sample: Any, *, progress: bool = False) -> LayerCosts:
    """Training FLOPs per layer (``TRAINING_FACTOR`` x forward FLOPs), from shapes alone: the layers run on
    fake tensors, so nothing is computed, no device is needed and the model is not changed."""
    _need(sample, "flops")
    lays = layers(model)
    shapes = propagate(lays, first_input(model, sample), progress=progress)
    cost = tuple(float(TRAINING_FACTOR * f) for f in shapes.flops)
    return LayerCosts("flops", cost, _state_bytes(lays), shapes.saved_bytes, shapes.output_bytes, shapes.skip_bytes)


def time_costs(
    model: nn.Module,
    sample: Any,
    device: str | torch.device | None = None,
    *,
    repeats: int = 3,
    progress: bool = False,
) -> LayerCosts:
    """Measured forward+backward seconds per layer on ``device`` (CPU when None), the least of ``repeats``."""
    _need(sample, "time")
    lays = layers(model)
    prof = profile(lays, first_input(model, sample), device, repeats=repeats, progress=progress)
    return LayerCosts("time", prof.times, _state_bytes(lays), prof.saved_bytes, prof.output_bytes, prof.skip_bytes,
                      host=prof.host_times)


def memory_costs(
    model: nn.Module,
    sample: Any,
    device: str | torch.device | None = None,
    *,
    progress: bool = False,
) -> LayerCosts:
    """Bytes per layer: its parameters and buffers plus, on CUDA, the allocator's peak during its
    forward+backward above where it started, or on CPU the activation bytes autograd saves for backward."""
    _need(sample, "memory")
    lays = layers(model)
    prof = profile(lays, first_input(model, sample), device, repeats=1, progress=progress)
    state = _state_bytes(lays)
    cost = tuple(float(s + p) for s, p in zip(state, prof.peak_bytes))
    return LayerCosts("memory", cost, state, prof.saved_bytes, prof.output_bytes, prof.skip_bytes)


def costs(
    model: nn.Module,
    by: str,
    sample: Any = None,
    device: str | torch.device | None = None,
    *,
    progress: bool = False,
) -> LayerCosts:
    """The per-layer costs of cost model ``by`` (one of :data:`BY`)."""
    if by == "params":
        return param_costs(model, sample, progress=progress)
    if by == "flops":
        return flop_costs(model, sample, progress=progress)
    if by == "time":
        return time_costs(model, sample, device, progress=progress)
    if by == "memory":
        return memory_costs(model, sample, device, progress=progress)
    raise BalanceError(f"by={by!r} is not a cost model; use one of {', '.join(repr(b) for b in BY)}")


def default_transfer_cost(
    by: str, *, bandwidth: float = LINK_BANDWIDTH, flops_per_byte: float = FLOPS_PER_BYTE
) -> float:
    """Cost of one byte crossing a cut, in the unit of ``by``.

    ``time``: ``2 / bandwidth`` seconds (activations forward, gradients backward); ``flops``:
    ``flops_per_byte``; ``params`` and ``memory``: 0 (moving bytes takes no parameters or memory).
    """
    if by == "time":
        if bandwidth <= 0:
            raise BalanceError(f"bandwidth={bandwidth}: give the link bandwidth in bytes per second (> 0)")
        return 2.0 / bandwidth
    if by == "flops":
        return float(flops_per_byte)
    if by in ("params", "memory"):
        return 0.0
    raise BalanceError(f"by={by!r} is not a cost model; use one of {', '.join(repr(b) for b in BY)}")
