"""Checkpoints of a distributed pipeline: one file per stage, under the source model's key names."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from seqify.distributed.rank import RankStage
from seqify.errors import StateDictError
from seqify.model.sequential import Sequential

__all__ = ["save", "load", "merge", "stage_file"]

FORMAT = "seqify.distributed/1"


def stage_file(path: str | os.PathLike[str], index: int) -> str:
    """The file of stage ``index`` inside checkpoint folder ``path``."""
    return os.path.join(os.fspath(path), f"stage{index}.pt")


def _places(stage: RankStage) -> OrderedDict[str, list[torch.Tensor]]:
    """Source key -> the tensors of that key this stage holds (a read-only buffer may sit in several stages)."""
    model, part = stage.model, stage.partition
    state_map = getattr(model, "_state_map", None)
    if state_map is None:  # a plain nn.Sequential: its own keys are the source's
        return OrderedDict((k, [t]) for k, t in part.state_dict(keep_vars=True).items())
    layers = set(part._modules)
    found: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for key, places in state_map.items():
        places = (places,) if isinstance(places[0], str) else places
        for path, name in places:
            if path == "<unused>":  # state the source's forward never reads: the first stage keeps it
                # a state map is a seqify.Sequential's, which keeps that state in _unused
                module: nn.Module | None = cast(Sequential, model)._unused if stage.is_first else None
            else:
                module = part.get_submodule(path) if path.split(".")[0] in layers else None
            if module is None:
                continue
            t: torch.Tensor | None = module._parameters.get(name)
            t = module._buffers[name] if t is None else t
            if t is not None and all(t is not s for s in found.get(key, [])):
                found.setdefault(key, []).append(t)
    return found


def _optimizer_state(optimizer: torch.optim.Optimizer, keys: dict[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter numbers replaced by source key names."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stray = [i for i, p in enumerate(params) if id(p) not in keys]
    if stray:
        raise StateDictError(
            f"the optimizer holds {len(stray)} parameter(s) that are not this stage's (first: number {stray[0]}): "
            "build it over the stage's own parameters, torch.optim.SGD(stage.parameters(), ...)"
        )
    state = optimizer.state_dict()
    name = [keys[id(p)] for p in params]
    return {
        "state": {name[i]: v for i, v in state["state"].items()},
        "param_groups": [dict(g, params=[name[i] for i in g["params"]]) for g in state["param_groups"]],
    }


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any], keys: dict[int, str], file: str) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    number = {keys.get(id(p), f"<parameter {i}>"): i for i, p in enumerate(params)}
    wanted = [k for g in saved["param_groups"] for k in g["params"]]
    if sorted(wanted) != sorted(number):
        missing = sorted(set(number) - set(wanted))[:4]
        extra = sorted(set(wanted) - set(number))[:4]
        raise StateDictError(
            f"{file}: the saved optimizer covers other parameters than this one (not saved: {missing}; saved but "
            f"absent here: {extra}): build the optimizer over stage.parameters() as when saving"
        )
    optimizer.load_state_dict({
        "state": {number[k]: v for k, v in saved["state"].items()},
        "param_groups": [dict(g, params=[number[k] for k in g["params"]]) for g in saved["param_groups"]],
    })


def save(
    stage: RankStage,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> None:
    """Every rank calls this: replica 0 of each stage writes ``path/stage{i}.pt`` (its parameters and
    buffers under the source model's keys, the optimizer's state under the same keys, and ``extra``);
    all ranks then wait for every file to be written."""
    from seqify.distributed.link import peer as _peer

    places = _places(stage)
    if stage.replica == 0:
        os.makedirs(os.fspath(path), exist_ok=True)
        keys = {id(t): k for k, ts in places.items() for t in ts}
        record = {
            "format": FORMAT,
            "stage": stage.index,
            "stages": stage.stages,
            "balance": list(stage.balance),
            "state": OrderedDict((k, ts[0].detach().cpu()) for k, ts in places.items()),
            "optimizer": None if optimizer is None else _optimizer_state(optimizer, keys),
            "extra": extra,
        }
        file = stage_file(path, stage.index)
        torch.save(record, file + ".tmp")
        os.replace(file + ".tmp", file)  # a job killed while saving leaves the previous file whole
    if dist.is_initialized():
        with _peer(stage.me, list(range(dist.get_world_size())), "waiting for every stage to write its checkpoint"):
            dist.barrier()


def _read(path: str | os.PathLike[str], index: int) -> dict[str, Any]:
    file = stage_file(path, index)
    if not os.path.exists(file):
        raise StateDictError(f"{file} does not exist: pass the folder given to seqify.distributed.save(stage, path)")
    record = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise StateDictError(f"{file} is not a seqify.distributed checkpoint (written by seqify.distributed.save)")
    return record


def load(
    stage: RankStage,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Every rank calls this: reads its stage's file, loads parameters, buffers and the optimizer's
    state, and returns the ``extra`` given to :func:`save`."""
    record = _read(path, stage.index)
    file = stage_file(path, stage.index)
    if record["balance"] != list(stage.balance):
        raise StateDictError(
            f"{file} was saved by a pipeline with balance {record['balance']}, and this job's is {stage.balance}: "
            "stage it with the same balance, or load seqify.distributed.merge(path) into the source model "
            "(model.load_state_dict) and stage that"
        )
    places = _places(stage)
    saved = record["state"]
    missing = sorted(set(places) - set(saved))
    if missing:
        raise StateDictError(f"{file} lacks keys of stage {stage.index}: {missing[:8]} (saved by another model?)")
    with torch.no_grad():
        for k, ts in places.items():
            for t in ts:
                if t.shape != saved[k].shape:
                    raise StateDictError(f"{file}: {k} is {tuple(saved[k].shape)} there and {tuple(t.shape)} here")
                t.copy_(saved[k])
    if optimizer is not None:
        if record["optimizer"] is None:
            raise StateDictError(f"{file} holds no optimizer state: pass optimizer= to seqify.distributed.save")
        _load_optimizer(optimizer, record["optimizer"], {id(t): k for k, ts in places.items() for t in ts}, file)
    return record["extra"]


def merge(path: str | os.PathLike[str]) -> OrderedDict[str, torch.Tensor]:
    """The stages' files of one checkpoint as one state dict of the source model
    (``model.load_state_dict(merge(path))``)."""
    first = _read(path, 0)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for index in range(first["stages"]):
        for k, t in (first if index == 0 else _read(path, index))["state"].items():
            state.setdefault(k, t)
    return state
