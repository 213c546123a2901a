"""Per-stage checkpoints: each pipeline stage's parameters and buffers in a file, under the source model's keys."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from seqify.errors import StateDictError
from seqify.model.sequential import Sequential

__all__ = ["save", "load", "load_state_dict", "stage_keys"]

INDEX = "index.json"


def _stage_file(j: int) -> str:
    return f"stage_{j}.pt"


def stage_keys(pipe: Any) -> list[list[str]]:
    """Per stage, the state keys it holds: the source model's keys for a converted model (a key used by
    several stages, such as a tied weight, goes with the first; unused ones with stage 0), else the
    ``nn.Sequential``'s own."""
    model = pipe.model
    stage_of = {name: j for j, count in enumerate(pipe.balance) for name in _names(pipe, j, count)}
    keys: list[list[str]] = [[] for _ in pipe.balance]
    if isinstance(model, Sequential):
        for key, found in model._state_map.items():
            places: Any = (found,) if isinstance(found[0], str) else found
            held = [stage_of[path.split(".")[0]] for path, _ in places if path != "<unused>"]
            keys[min(held) if held else 0].append(key)
    else:
        for key in model.state_dict():
            keys[stage_of[key.split(".")[0]]].append(key)
    return keys


def _names(pipe: Any, j: int, count: int) -> list[str]:
    start = sum(pipe.balance[:j])
    return list(pipe.model._modules)[start:start + count]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return model.original_state_dict() if isinstance(model, Sequential) else model.state_dict()


def save(pipe: Any, directory: str | os.PathLike[str]) -> list[str]:
    """Write ``stage_J.pt`` per stage (its tensors, on its device, under the source's keys) and
    ``index.json`` (balance, devices, which keys each stage holds). Returns the files written."""
    os.makedirs(directory, exist_ok=True)
    state = _state(pipe.model)
    keys = stage_keys(pipe)
    written = []
    for j, mine in enumerate(keys):
        path = os.path.join(directory, _stage_file(j))
        torch.save(OrderedDict((k, state[k]) for k in mine), path)
        written.append(path)
    index = {
        "source": getattr(pipe.model, "source", type(pipe.model).__name__),
        "balance": list(pipe.balance),
        "devices": [str(d) for d in pipe.devices],
        "stages": [{"file": _stage_file(j), "keys": mine} for j, mine in enumerate(keys)],
    }
    path = os.path.join(directory, INDEX)
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
    return [*written, path]


def load_state_dict(directory: str | os.PathLike[str], map_location: Any = "cpu") -> OrderedDict[str, torch.Tensor]:
    """All stages' tensors merged into one state dict (the source model's keys): ``source.load_state_dict(...)``
    takes it, whatever the balance it was saved with."""
    path = os.path.join(directory, INDEX)
    if not os.path.isfile(path):
        raise StateDictError(
            f"{directory} holds no {INDEX}; save a pipeline's stages there with seqify.checkpoint.save(pipe, dir)"
        )
    with open(path) as f:
        index = json.load(f)
    merged: OrderedDict[str, torch.Tensor] = OrderedDict()
    for j, stage in enumerate(index["stages"]):
        file = os.path.join(directory, stage["file"])
        if not os.path.isfile(file):
            raise StateDictError(f"stage {j}'s file {file} is missing; copy every stage_J.pt that {INDEX} lists")
        part = torch.load(file, map_location=map_location, weights_only=True)
        if sorted(part) != sorted(stage["keys"]):
            raise StateDictError(f"{file} does not hold the keys {INDEX} lists for stage {j}; was it overwritten?")
        merged.update(part)
    return merged


def load(pipe: Any, directory: str | os.PathLike[str]) -> None:
    """Load stages saved by :func:`save` into ``pipe`` (any balance and devices: every tensor goes to the
    device of each place that holds it)."""
    state = load_state_dict(directory)
    model = pipe.model
    if isinstance(model, Sequential):
        model.load_original_state_dict(state)
    else:
        mine = model.state_dict()
        missing = sorted(set(mine) - set(state))
        unexpected = sorted(set(state) - set(mine))
        if missing or unexpected:
            raise StateDictError(
                f"the checkpoint in {directory} does not fit this pipeline's model: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}; load it into the model it was saved from"
            )
        with torch.no_grad():
            for k, t in mine.items():
                t.copy_(state[k])
