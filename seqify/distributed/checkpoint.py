"""seqify.distributed's checkpoint calls, kept for code that uses them: seqify.checkpoint's folder, and the
``stage{i}.pt`` folders of seqify.distributed's own earlier layout (read only)."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any

import torch

from seqify.distributed.rank import RankStage
from seqify.errors import StateDictError

__all__ = ["save", "load", "merge", "stage_file"]

FORMAT = "seqify.distributed/1"
NEW = "seqify.json"  # what marks a folder of seqify.checkpoint's layout


def stage_file(path: str | os.PathLike[str], index: int) -> str:
    """The file of stage ``index`` inside a folder of ``stage{i}.pt`` files."""
    return os.path.join(os.fspath(path), f"stage{index}.pt")


def _staged(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds ``stage{i}.pt`` files rather than a seqify.checkpoint folder."""
    return not os.path.isfile(os.path.join(path, NEW)) and os.path.isfile(stage_file(path, 0))


def save(
    stage: RankStage,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> None:
    """``seqify.checkpoint.save(stage, path, optimizer, extra=extra)``, which this forwards to (with a
    FutureWarning): every rank calls it, and they write one checkpoint folder together that loads onto any
    balance, number of ranks, an in-process pipeline or the source model."""
    from seqify import checkpoint

    warnings.warn("seqify.distributed.save(stage, path, optimizer, extra) is seqify.checkpoint.save(stage, path, "
                  "optimizer, scheduler, step=, extra=): call that", FutureWarning, stacklevel=2)
    checkpoint.save(stage, path, optimizer, extra=extra)


def load(
    stage: RankStage,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Every rank calls this: loads a checkpoint folder (``seqify.checkpoint.load(stage, path, optimizer)``,
    any balance) or a folder of ``stage{i}.pt`` files (the balance they were saved with) into the stage and
    ``optimizer``, and returns the ``extra`` given to :func:`save`."""
    if _staged(path):
        return _load_staged(stage, path, optimizer)
    from seqify import checkpoint

    return checkpoint.load(stage, path, optimizer).extra


def merge(path: str | os.PathLike[str]) -> OrderedDict[str, torch.Tensor]:
    """The model state of a checkpoint folder, or of a folder of ``stage{i}.pt`` files, as one state dict of
    the source model (``model.load_state_dict(merge(path))``)."""
    if not _staged(path):
        from seqify import checkpoint

        return checkpoint.load_state_dict(path)
    first = _read(path, 0)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for index in range(first["stages"]):
        for k, t in (first if index == 0 else _read(path, index))["state"].items():
            state.setdefault(k, t)
    return state


def _read(path: str | os.PathLike[str], index: int) -> dict[str, Any]:
    file = stage_file(path, index)
    if not os.path.exists(file):
        raise StateDictError(f"{file} does not exist: pass the folder given to seqify.distributed.save(stage, path)")
    record = torch.load(file, map_location="cpu", weights_only=False)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise StateDictError(f"{file} is not a seqify.distributed checkpoint (written by seqify.distributed.save)")
    return record


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


def _load_staged(stage: RankStage, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None) -> Any:
    """A ``stage{i}.pt`` file into the stage of the balance it was saved with."""
    from seqify.checkpoint.keys import rank_places

    record = _read(path, stage.index)
    file = stage_file(path, stage.index)
    if record["balance"] != list(stage.balance):
        raise StateDictError(
            f"{file} was saved by a pipeline with balance {record['balance']}, and this job's is {stage.balance}: "
            "stage it with the same balance, or load seqify.distributed.merge(path) into the source model "
            "(model.load_state_dict) and stage that"
        )
    places = rank_places(stage.model, stage.partition, stage.is_first)
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
            raise StateDictError(f"{file} holds no optimizer state: load it without optimizer=")
        _load_optimizer(optimizer, record["optimizer"], {id(t): k for k, ts in places.items() for t in ts}, file)
    return record["extra"]
