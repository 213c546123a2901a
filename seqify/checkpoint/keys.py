"""Which module holds a checkpoint's state, and its tensors and parameters under the source model's keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from seqify.errors import CheckpointError
from seqify.model.sequential import Sequential

__all__ = ["holder", "balance_of", "model_state", "places", "parameter_names", "stage_keys", "first_partitions",
           "rank_places"]


def holder(obj: Any) -> nn.Module:
    """The module whose state a checkpoint keeps: a pipeline's model (a ``seqify.Sequential`` or a plain
    ``nn.Sequential``), or ``obj`` itself (a converted model, the source model, any module)."""
    model = getattr(obj, "model", None) if hasattr(obj, "balance") else None
    if isinstance(model, nn.Module):
        return model
    if isinstance(obj, nn.Module):
        return obj
    raise CheckpointError(
        f"seqify.checkpoint takes a pipeline, a converted model or an nn.Module, not a {type(obj).__name__}: "
        "pass the pipeline itself (seqify.pipeline(...)) or the model"
    )


def balance_of(obj: Any) -> list[int] | None:
    """The pipeline's balance, or None for a model."""
    balance = getattr(obj, "balance", None) if isinstance(getattr(obj, "model", None), nn.Module) else None
    return None if balance is None else [int(b) for b in balance]


def model_state(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The model's state under the source's keys (detached tensors sharing the model's storage)."""
    if isinstance(model, Sequential):
        return model.original_state_dict()
    return OrderedDict(model.state_dict())


def places(model: nn.Module) -> OrderedDict[str, list[torch.Tensor]]:
    """Every tensor that holds each key (a pipeline may keep copies of one source tensor on other devices)."""
    if isinstance(model, Sequential):
        return OrderedDict((k, [t.detach() for t in model._tensors(k)]) for k in model.original_keys())
    return OrderedDict((k, [t]) for k, t in model.state_dict().items())


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its source key (a tied parameter: its first key, as ``state_dict`` orders them)."""
    names: dict[int, str] = {}
    if isinstance(model, Sequential):
        for key in model.original_keys():
            for t in model._tensors(key):
                if isinstance(t, nn.Parameter):
                    names.setdefault(id(t), key)
        return names
    for key, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter):
            names.setdefault(id(t), key)
    return names


def stage_keys(pipe: Any) -> list[list[str]]:
    """Per stage, the state keys it holds: the source model's keys for a converted model (a key used by
    several stages, such as a tied weight, goes with the first; unused ones with stage 0), else the
    ``nn.Sequential``'s own."""
    keys: list[list[str]] = [[] for _ in pipe.balance]
    for key, j in first_partitions(pipe.model, pipe.balance).items():
        keys[j].append(key)
    return keys


def first_partitions(model: nn.Module, balance: Sequence[int]) -> dict[str, int]:
    """Each state key of ``model`` split by ``balance`` -> the first partition that holds it (a key no layer
    uses: partition 0), in the model's key order."""
    names = list(model._modules)
    stage_of = {name: j for j, count in enumerate(balance)
                for name in names[sum(balance[:j]):sum(balance[:j]) + count]}
    if not isinstance(model, Sequential):
        return {key: stage_of[key.split(".")[0]] for key in model.state_dict()}
    first: dict[str, int] = {}
    for key, found in model._state_map.items():
        spots: Any = (found,) if isinstance(found[0], str) else found
        held = [stage_of[path.split(".")[0]] for path, _ in spots if path != "<unused>"]
        first[key] = min(held) if held else 0
    return first


def rank_places(model: nn.Module, partition: nn.Module, first: bool) -> OrderedDict[str, list[torch.Tensor]]:
    """Source key -> the tensors of that key that ``partition`` (some layers of ``model``) holds; state no
    layer reads goes with the ``first`` partition (a read-only buffer may sit in several partitions)."""
    state_map = getattr(model, "_state_map", None)
    if state_map is None:  # a plain nn.Sequential: its own keys are the source's
        return OrderedDict((k, [t]) for k, t in partition.state_dict(keep_vars=True).items())
    layers = set(partition._modules)
    found: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for key, spots in state_map.items():
        spots = (spots,) if isinstance(spots[0], str) else spots
        for path, name in spots:
            module = _holding(model, partition, layers, path, first)
            t = None if module is None else _tensor(module, name)
            if t is not None and all(t is not s for s in found.get(key, [])):
                found.setdefault(key, []).append(t)
    return found


def _holding(model: nn.Module, partition: nn.Module, layers: set[str], path: str, first: bool) -> nn.Module | None:
    if path == "<unused>":  # a seqify.Sequential keeps state its forward never reads in _unused
        return getattr(model, "_unused", None) if first else None
    return partition.get_submodule(path) if path.split(".")[0] in layers else None


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    t: torch.Tensor | None = module._parameters.get(name)
    return module._buffers.get(name) if t is None else t
