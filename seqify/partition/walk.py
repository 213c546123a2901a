"""Walk: a model's layers in order, each fed fresh inputs and the skips it pops, as costing needs them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.model.sequential import Sequential
from seqify.partition.errors import BalanceError
from seqify.skip.layout import SkipRoute, routes
from seqify.skip.namespace import SkipKey
from seqify.skip.skippable import pop_keys
from seqify.skip.tracker import SkipTracker

__all__ = ["Layers", "Skips", "layers", "first_input", "apply", "tensors", "nbytes", "storage", "saved_bytes", "fresh",
           "roots", "owned"]


@dataclass(frozen=True)
class Layers:
    """The layers of an ``nn.Sequential`` with their names and the skips between them."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    routes: tuple[SkipRoute, ...]

    def __len__(self) -> int:
        return len(self.modules)

    def describe(self, i: int) -> str:
        return f"layer {i} {self.names[i]!r} ({type(self.modules[i]).__name__})"


def layers(model: nn.Module) -> Layers:
    """The layers ``balance`` partitions: the children of an ``nn.Sequential``, with checked skip routes."""
    if not isinstance(model, nn.Sequential):
        raise BalanceError(
            f"balance partitions an nn.Sequential, not a {type(model).__name__}; convert it first: "
            "seq = seqify.convert(model, example_inputs), then balance(seq, ...)"
        )
    if len(model) == 0:
        raise BalanceError("the model has no layers, so there is nothing to partition")
    names = tuple(model._modules.keys())
    modules = tuple(m for m in model._modules.values() if m is not None)
    if len(modules) != len(names):
        raise BalanceError("the model has a child set to None; remove it (del model[i]) before balancing")
    return Layers(modules, names, tuple(routes(model)))


def first_input(model: nn.Module, sample: Any) -> Any:
    """What layer 0 receives: for a seqify.Sequential ``sample`` is what you pass to ``seq(...)`` (a tuple
    for several positional arguments, a dict for keyword arguments); for a plain nn.Sequential it is layer
    0's input itself."""
    if not isinstance(model, Sequential):
        return sample
    if isinstance(sample, dict):
        return model.flatten_inputs(**sample)
    if isinstance(sample, tuple):
        return model.flatten_inputs(*sample)
    return model.flatten_inputs(sample)


def apply(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (through tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(apply(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(apply(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: apply(fn, v) for k, v in value.items()}
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``."""
    found: list[torch.Tensor] = []
    apply(found.append, value)
    return found


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (0 for None and non-tensors)."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def storage(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, the same for all its views (real or fake)."""
    return int(t.untyped_storage()._cdata)


def saved_bytes(module: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[int, int]]:
    """A ``saved_tensors_hooks`` pack function and the bytes it records per storage: every storage autograd
    saves for backward that is not one of ``module``'s own parameters or buffers."""
    state = {storage(t) for t in list(module.parameters()) + list(module.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage(t)
        if key not in state:
            kept[key] = t.untyped_storage().nbytes()
        return t

    return pack, kept


def fresh(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """A copy of ``value`` as a layer inside a training graph receives it, and the leaves it hangs from.

    Floating tensors become non-leaf tensors that require grad (so in-place layers such as
    ``ReLU(inplace=True)`` and ``out += identity`` work); other tensors are detached.
    """
    leaves: list[torch.Tensor] = []

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() or t.is_complex():
            leaf = t.detach().requires_grad_()
            leaves.append(leaf)
            return leaf.clone()
        return t.detach()

    return apply(one, value), leaves


class Skips:
    """Skip values stashed so far (detached), handed out fresh to the layers that pop them."""

    def __init__(self) -> None:
        self.values: dict[SkipKey, Any] = {}
        self.bytes: dict[SkipKey, int] = {}

    def tracker(self, layer: nn.Module) -> tuple[SkipTracker, list[torch.Tensor]]:
        """A tracker holding fresh copies of what ``layer`` pops, and the leaves of those copies."""
        tracker = SkipTracker()
        leaves: list[torch.Tensor] = []
        for key in pop_keys(layer):
            value, more = fresh(self.values[key])
            tracker.stash(key, value)
            leaves += more
        return tracker, leaves

    def keep(self, layer: nn.Module, tracker: SkipTracker) -> None:
        """Record what ``layer`` stashed into ``tracker`` (after it ran) and forget what it popped."""
        for key in pop_keys(layer):
            self.values.pop(key, None)
        for key, value in tracker.values.items():
            self.values[key] = apply(torch.Tensor.detach, value)
            self.bytes[key] = nbytes(value)


def roots(output: Any, tracker: SkipTracker) -> list[torch.Tensor]:
    """The tensors a layer hands on (its output and its stashes) that a backward pass starts from."""
    return [t for t in tensors(output) + tensors(list(tracker.values.values())) if t.requires_grad]


def owned(modules: Sequence[nn.Module]) -> list[list[torch.Tensor]]:
    """Per layer, the parameters and buffers it is the first to use (a shared tensor counts once)."""
    seen: set[int] = set()
    result: list[list[torch.Tensor]] = []
    for module in modules:
        mine = []
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                mine.append(t)
        result.append(mine)
    return result
