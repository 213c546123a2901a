"""Checkpointing: recompute a stage's forward during backward, with RNG and BatchNorm state intact."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["is_checkpointing", "is_recomputing", "checkpointed", "recomputed", "rng_state", "norms_of",
           "draws_random", "RngState"]

# The CPU generator's state, and the devices (with their generators' states) some argument is on.
RngState = tuple[torch.Tensor, list[int], list[torch.Tensor]]

_local = threading.local()


def is_checkpointing() -> bool:
    """True while a checkpointed stage runs its first (forward) pass."""
    return getattr(_local, "checkpointing", False)


def is_recomputing() -> bool:
    """True while a checkpointed stage recomputes its forward during backward.

    A layer with side effects (a counter, a running statistic) should skip them when this is true.
    """
    return getattr(_local, "recomputing", False)


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def norms_of(module: nn.Module) -> list[nn.modules.batchnorm._NormBase]:
    """Normalisation modules (BatchNorm, InstanceNorm with ``track_running_stats``) whose running
    statistics a recomputation would update a second time."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


@contextmanager
def _scratch_statistics(norms: Sequence[nn.modules.batchnorm._NormBase]) -> Iterator[None]:
    """Let BatchNorm update throw-away copies of its running statistics (same shapes, so the
    tensors autograd saves match the forward pass), then put the real ones back untouched."""
    saved = []
    for m in norms:
        if m.training:
            saved.append((m, dict(m._buffers)))
            for k, v in m._buffers.items():
                if v is not None:
                    m._buffers[k] = v.clone()
    try:
        yield
    finally:
        for m, buffers in saved:
            m._buffers.update(buffers)


def checkpointed(fn: Callable[..., Any], *args: Any, norms: Sequence[nn.modules.batchnorm._NormBase] = (),
                 preserve_rng: bool = True) -> Any:
    """``fn(*args)``, keeping no activations for backward: they are recomputed when needed.

    The recomputation sees the same RNG and autocast state as the forward pass (torch's
    non-reentrant checkpoint) and leaves BatchNorm statistics as the forward pass left them.
    ``preserve_rng=False`` skips saving the RNG state (for code that draws no random numbers: CUDA-graph
    capture cannot read the generator's state).
    """
    first = True

    def run(*inner: Any) -> Any:
        nonlocal first
        if first:
            first = False
            with _flag("checkpointing"):
                return fn(*inner)
        with _flag("recomputing"), _scratch_statistics(norms):
            return fn(*inner)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng)


def rng_state(*args: Any) -> RngState:
    """The random generators' state before a checkpointed forward, for :func:`recomputed` to draw
    the same numbers again (not under CUDA-graph capture: it reads the generators)."""
    devices, states = get_device_states(*args)
    return torch.get_rng_state(), devices, states


def recomputed(fn: Callable[..., Any], *args: Any, norms: Sequence[nn.modules.batchnorm._NormBase] = (),
               rng: RngState | None = None) -> Any:
    """``fn(*args)`` once more, as :func:`checkpointed`'s recomputation runs it (``is_recomputing()``
    true, BatchNorm statistics left alone, the same random draws when given the ``rng`` state taken
    before the first run), but as an ordinary autograd graph that lives as long as its outputs: what a
    split backward needs, whose input-gradient part (B) recomputes and whose weight-gradient part (W)
    must walk the same graph later rather than recompute again."""
    with ExitStack() as scope:
        if rng is not None:
            cpu, devices, states = rng
            scope.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(cpu)
            set_device_states(devices, states)
        scope.enter_context(torch.enable_grad())
        scope.enter_context(_flag("recomputing"))
        scope.enter_context(_scratch_statistics(norms))
        return fn(*args)


_RANDOM = ("dropout", "bernoulli", "rand", "normal", "uniform", "multinomial", "exponential", "geometric", "cauchy",
           "log_normal", "random_", "poisson")


def draws_random(module: nn.Module) -> bool:
    """Whether running ``module`` in its current mode may draw random numbers (dropout in training, or a
    converted layer calling a random op): what a recomputation must replay with the same draws."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            return True
        for op in getattr(m, "ops", ()):
            name = str(getattr(op, "target", "")).lower()
            if any(word in name for word in _RANDOM):
                return True
    return False
