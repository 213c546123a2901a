"""Checkpoints that resume training exactly: model, optimizer, scheduler, step and RNG under the source's keys."""

from __future__ import annotations

import json
import operator
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify._version import __version__
from seqify.checkpoint import rng, store
from seqify.checkpoint.exported import export, load_exported
from seqify.checkpoint.keys import balance_of, holder, model_state, parameter_names, places, stage_keys
from seqify.checkpoint.optim import NamedState, check_named_state, load_named_state, named_state
from seqify.checkpoint.pretrained import save_pretrained
from seqify.errors import CheckpointError, StateDictError
from seqify.model.sequential import Sequential

__all__ = ["save", "load", "load_state_dict", "stage_keys", "export", "load_exported", "save_pretrained", "Restored"]

MODEL = "model/"
OPTIMIZER = "optimizer/"


@dataclass(frozen=True)
class Restored:
    """What :func:`load` restored besides the tensors: the ``step`` and ``extra`` given to :func:`save`, and
    the checkpoint's metadata (``seqify.json``: versions, source, balance, keys)."""

    step: int | None
    extra: Any
    meta: dict[str, Any] = field(default_factory=dict)


def save(
    pipe: Any,
    directory: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    step: int | None = None,
    extra: Any = None,
    *,
    rng_state: bool = True,
) -> list[str]:
    """Save ``pipe`` (a pipeline, a converted model or any module) to the folder ``directory``: its state under
    the source model's keys, the optimizer's state keyed by the same names, the LR scheduler's state, ``step``,
    ``extra`` (plain values) and, with ``rng_state``, the random generators (torch CPU and CUDA, ``random``,
    numpy). The folder is written under a temporary name and renamed, replacing an earlier checkpoint there.
    Returns the files written."""
    model = holder(pipe)
    step = _step(step)
    tensors = {MODEL + k: t for k, t in model_state(model).items()}
    keys = [k[len(MODEL):] for k in tensors]
    named = None if optimizer is None else named_state(optimizer, parameter_names(model))
    if named is not None:
        tensors.update({_optimizer_key(k, n): t for (k, n), t in named.tensors.items()})
    state = {
        "step": step,
        "extra": extra,
        "rng": rng.capture() if rng_state else None,
        "optimizer": None if named is None else {
            "groups": named.groups, "plain": named.plain, "tensors": [list(kn) for kn in named.tensors]},
        "scheduler": None if scheduler is None else scheduler.state_dict(),
    }
    return store.write(directory, tensors, state, _meta(pipe, model, keys, optimizer, scheduler, step, rng_state))


def _step(step: Any) -> int | None:
    if step is None:
        return None
    try:
        return operator.index(step)
    except TypeError:
        raise CheckpointError(f"step={step!r}: give the number of steps taken, an int (or None)") from None


def _optimizer_key(key: str, name: str) -> str:
    return f"{OPTIMIZER}{key}/{name}"


def _meta(pipe: Any, model: nn.Module, keys: list[str], optimizer: Any, scheduler: Any, step: int | None,
          rng_state: bool) -> dict[str, Any]:
    return {
        "seqify": __version__,
        "torch": torch.__version__,
        "source": getattr(model, "source", type(model).__name__),
        "balance": balance_of(pipe),
        "step": step,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "scheduler": None if scheduler is None else type(scheduler).__name__,
        "rng": rng_state,
        "keys": keys,
    }


def load(
    pipe: Any,
    directory: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    rng_state: bool = True,
) -> Restored:
    """Load a checkpoint written by :func:`save` into ``pipe`` (a pipeline of any balance and devices, the
    converted model or the source model), ``optimizer`` (built over ``pipe.parameters()`` with the groups it
    was saved with) and ``scheduler``, and, with ``rng_state``, set the random generators as they were, so
    training goes on as if it had not stopped. Everything is checked before anything changes: keys or shapes
    that do not fit raise :class:`~seqify.StateDictError`. Returns the step, ``extra`` and metadata."""
    if not os.path.isfile(os.path.join(directory, store.META)) and os.path.isfile(
            os.path.join(directory, store.LEGACY_INDEX)):
        return _load_legacy(pipe, directory, optimizer, scheduler)
    meta = store.read_meta(directory)
    saved = store.read_state(directory)
    shapes = store.tensor_shapes(directory)
    model = holder(pipe)
    spots = places(model)
    _check_model(spots, shapes, directory, meta)
    names = parameter_names(model)
    named = _optimizer_state(optimizer, saved, meta, names, directory)
    _check_scheduler(scheduler, saved, meta, directory)
    targets = {MODEL + k: ts[0] for k, ts in spots.items()}
    if named is not None:
        targets.update({_optimizer_key(k, n): _empty(shapes, _optimizer_key(k, n), directory) for k, n in
                        saved["optimizer"]["tensors"]})
    store.read_tensors(directory, targets)
    _spread(spots)
    if named is not None and optimizer is not None:
        named.tensors = {(k, n): targets[_optimizer_key(k, n)] for k, n in saved["optimizer"]["tensors"]}
        load_named_state(optimizer, named, names, str(directory))
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    if rng_state and saved["rng"] is not None:
        rng.restore(saved["rng"])
    return Restored(saved["step"], saved["extra"], meta)


def _check_model(spots: OrderedDict[str, list[torch.Tensor]], shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 directory: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model keys or shapes are not this model's, naming them."""
    saved = {k[len(MODEL):]: s for k, (s, _) in shapes.items() if k.startswith(MODEL)}
    missing = sorted(set(spots) - set(saved))
    unexpected = sorted(set(saved) - set(spots))
    if missing or unexpected:
        raise StateDictError(
            f"the checkpoint in {directory} holds the state of {meta.get('source')} and does not fit this model: "
            + (f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
            + (f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; " if unexpected else "")
            + "load it into a pipeline of the same model (any balance), its converted or source model, or read "
            "its tensors with seqify.checkpoint.load_state_dict(folder) and load the keys you need"
        )
    wrong = [f"{k}: checkpoint {tuple(saved[k])} vs model {tuple(ts[0].shape)}"
             for k, ts in spots.items() if tuple(saved[k]) != tuple(ts[0].shape)]
    if wrong:
        raise StateDictError(
            f"the checkpoint in {directory} holds tensors of other shapes than this model's: {'; '.join(wrong[:8])}"
            f"{' ...' if len(wrong) > 8 else ''}; build the model with the configuration it was saved from"
        )


def _optimizer_state(optimizer: torch.optim.Optimizer | None, saved: dict[str, Any], meta: dict[str, Any],
                     names: dict[int, str], directory: str | os.PathLike[str]) -> NamedState | None:
    """The saved optimizer state, checked to fit ``optimizer``; None without an optimizer."""
    if optimizer is None:
        return None
    _check_saved("optimizer", optimizer, saved, meta, directory, " over the same parameters")
    named = NamedState(plain=saved["optimizer"]["plain"], groups=saved["optimizer"]["groups"])
    check_named_state(optimizer, named, names, str(directory))
    return named


def _check_scheduler(scheduler: Any, saved: dict[str, Any], meta: dict[str, Any],
                     directory: str | os.PathLike[str]) -> None:
    if scheduler is not None:
        _check_saved("scheduler", scheduler, saved, meta, directory, "")


def _check_saved(what: str, obj: Any, saved: dict[str, Any], meta: dict[str, Any],
                 directory: str | os.PathLike[str], over: str) -> None:
    """The checkpoint holds ``what`` (optimizer, scheduler) state, saved from ``obj``'s class."""
    if saved[what] is None:
        raise CheckpointError(f"{directory} holds no {what} state: pass {what}= to seqify.checkpoint.save")
    if meta.get(what) != type(obj).__name__:
        raise CheckpointError(
            f"{directory} holds {meta.get(what)} {what} state, and this {what} is "
            f"{type(obj).__name__}: build {meta.get(what)}{over} to resume"
        )


def _empty(shapes: dict[str, tuple[torch.Size, torch.dtype]], name: str,
           directory: str | os.PathLike[str]) -> torch.Tensor:
    if name not in shapes:
        raise CheckpointError(f"{directory}: {name} is listed in {store.STATE} but not saved; copy the whole folder")
    size, dtype = shapes[name]
    return torch.empty(size, dtype=dtype)


def _spread(spots: OrderedDict[str, list[torch.Tensor]]) -> None:
    """Copy each loaded tensor to the other places that hold the same key (copies on other devices)."""
    with torch.no_grad():
        for ts in spots.values():
            for t in ts[1:]:
                t.copy_(ts[0])


def load_state_dict(directory: str | os.PathLike[str], map_location: Any = "cpu") -> OrderedDict[str, torch.Tensor]:
    """The model state of a checkpoint as one state dict under the source model's keys:
    ``source.load_state_dict(...)`` takes it, whatever the balance it was saved with."""
    if not os.path.isfile(os.path.join(directory, store.META)) and os.path.isfile(
            os.path.join(directory, store.LEGACY_INDEX)):
        return _legacy_state_dict(directory, map_location)
    meta = store.read_meta(directory)
    shapes = store.tensor_shapes(directory)
    targets = {MODEL + k: _empty(shapes, MODEL + k, directory) for k in meta["keys"]}
    store.read_tensors(directory, targets)
    return OrderedDict((k, targets[MODEL + k].to(map_location)) for k in meta["keys"])


def _legacy_state_dict(directory: str | os.PathLike[str], map_location: Any) -> OrderedDict[str, torch.Tensor]:
    """The per-stage files seqify 0.1 wrote (``index.json``, ``stage_J.pt``) merged into one state dict."""
    with open(os.path.join(directory, store.LEGACY_INDEX)) as f:
        index = json.load(f)
    merged: OrderedDict[str, torch.Tensor] = OrderedDict()
    for j, stage in enumerate(index["stages"]):
        file = os.path.join(directory, stage["file"])
        if not os.path.isfile(file):
            raise CheckpointError(
                f"stage {j}'s file {file} is missing; copy every stage_J.pt that {store.LEGACY_INDEX} lists")
        part = torch.load(file, map_location=map_location, weights_only=True)
        if sorted(part) != sorted(stage["keys"]):
            raise CheckpointError(
                f"{file} does not hold the keys {store.LEGACY_INDEX} lists for stage {j}; was it overwritten?")
        merged.update(part)
    return merged


def _load_legacy(pipe: Any, directory: str | os.PathLike[str], optimizer: Any, scheduler: Any) -> Restored:
    """Model state from the per-stage files of seqify 0.1, which kept nothing else."""
    if optimizer is not None or scheduler is not None:
        raise CheckpointError(
            f"{directory} is a checkpoint of seqify 0.1 (index.json and stage files): it holds the model's state "
            "only; load it without optimizer= and scheduler=, and save a new one with them"
        )
    state = _legacy_state_dict(directory, "cpu")
    model = holder(pipe)
    if isinstance(model, Sequential):
        model.load_original_state_dict(state)
    else:
        _check_model(places(model), {MODEL + k: (t.shape, t.dtype) for k, t in state.items()}, directory, {})
        with torch.no_grad():
            for k, t in model.state_dict().items():
                t.copy_(state[k])
    return Restored(None, None, {})
