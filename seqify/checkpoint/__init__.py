"""Checkpoints that resume training exactly: model, optimizer, scheduler, step and RNG under the source's keys."""

from __future__ import annotations

import json
import operator
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify._version import __version__
from seqify.checkpoint import ranks, rng, store
from seqify.checkpoint.exported import export, load_exported
from seqify.checkpoint.keys import balance_of, holder, model_state, parameter_names, places, stage_keys
from seqify.checkpoint.optim import NamedState, check_named_state, load_named_state, named_state
from seqify.checkpoint.pretrained import save_pretrained
from seqify.checkpoint.ranks import Share
from seqify.errors import CheckpointError, SeqifyError, StateDictError
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

    ``pipe`` may be a rank's stage of a ``seqify.distributed`` pipeline: then every rank of the job calls this
    with its stage, optimizer and scheduler, and they write one folder together (the same layout), each tensor
    once; ``step`` and ``extra`` are rank 0's, the generators every rank's. Returns the files written."""
    share = ranks.share_of(pipe)
    if share is not None:
        return _save_share(share, pipe, directory, optimizer, scheduler, step, extra, rng_state)
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


def _save_share(share: Share, pipe: Any, directory: str | os.PathLike[str], optimizer: Any, scheduler: Any,
                step: Any, extra: Any, rng_state: bool) -> list[str]:
    """Every rank: the tensors it writes into one DCP folder, together; rank 0: the rest, merged from all ranks."""
    ranks.check_job(share, "save")
    spots = ranks.spots_of(share)
    tensors = {MODEL + k: spots[k][0].detach() for k in ranks.writes(share, spots)}
    piece, error = None, None
    try:
        piece = _piece(share, spots, optimizer, scheduler, rng_state, tensors)
        step = _step(step)
    except SeqifyError as e:
        error = e
    pieces = ranks.gather(piece, error)
    schedulers = [p["scheduler"] for p in pieces]
    if any(not ranks.same(s, schedulers[0]) for s in schedulers):
        raise CheckpointError("the ranks' schedulers are in different states: step every rank's scheduler alike "
                              "(one checkpoint keeps one scheduler state)")
    state = {
        "step": step,
        "extra": extra,
        "rng": pieces[0]["rng"],
        "rng_ranks": [p["rng"] for p in pieces] if rng_state else None,
        "optimizer": ranks.merge_optimizer([p["optimizer"] for p in pieces]),
        "scheduler": schedulers[0],
    }
    meta = _meta(pipe, share.model, list(model_state(share.model)), optimizer, scheduler, step, rng_state)
    meta["ranks"] = share.ranks
    return _write_together(directory, tensors, state, meta)


def _piece(share: Share, spots: OrderedDict[str, list[torch.Tensor]], optimizer: Any, scheduler: Any,
           rng_state: bool, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's part of the state; its optimizer's tensors join ``tensors`` on replica 0 (the others hold
    the same)."""
    named = None if optimizer is None else named_state(optimizer, ranks.names_of(share, spots))
    if named is not None and share.replica == 0:
        tensors.update({_optimizer_key(k, n): t for (k, n), t in named.tensors.items()})
    return {
        "rng": rng.capture() if rng_state else None,
        "optimizer": None if named is None else {
            "groups": named.groups, "plain": named.plain,
            "tensors": [list(kn) for kn in named.tensors] if share.replica == 0 else []},
        "scheduler": None if scheduler is None else scheduler.state_dict(),
    }


def _write_together(directory: str | os.PathLike[str], tensors: dict[str, torch.Tensor], state: dict[str, Any],
                    meta: dict[str, Any]) -> list[str]:
    """Rank 0 makes the temporary folder, every rank writes its tensors into it, rank 0 writes the rest and
    renames it; every rank returns once the folder is in place (or raises if any rank failed)."""
    final = os.path.abspath(os.fspath(directory))
    first = ranks.rank() == 0
    tmp, plain, error = "", b"", None
    try:
        if first:
            plain = store.plain_bytes(state)
            tmp = store.begin(final)
    except SeqifyError as e:
        error = e
    tmp = ranks.gather(tmp, error)[0]
    try:
        store.write_tensors(tmp, tensors, together=ranks.world() > 1)
        if first:
            store.finish(tmp, final, plain, meta)
    except OSError as e:
        error = CheckpointError(f"writing the checkpoint {final} failed ({e}): free space or fix the folder's "
                                "permissions, and save again")
    finally:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
    ranks.agree(error)
    return store.listing(final)


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
    converted model, the source model, or a rank's ``seqify.distributed`` stage of any balance and number of
    ranks, every rank calling this), ``optimizer`` (built over ``pipe.parameters()`` with the groups it was saved
    with) and ``scheduler``, and, with ``rng_state``, set the random generators as they were, so training goes
    on as if it had not stopped. Everything is checked before anything changes: keys or shapes that do not fit
    raise :class:`~seqify.StateDictError`. Returns the step, ``extra`` and metadata."""
    if not os.path.isfile(os.path.join(directory, store.META)) and os.path.isfile(
            os.path.join(directory, store.LEGACY_INDEX)):
        return _load_legacy(pipe, directory, optimizer, scheduler)
    share = ranks.share_of(pipe)
    if share is not None:
        return _load_share(share, directory, optimizer, scheduler, rng_state)
    model = holder(pipe)
    spots = places(model)
    names = parameter_names(model)
    plan = _plan(directory, spots, spots, names, optimizer, scheduler, None)
    return _apply(plan, spots, names, optimizer, scheduler, plan.saved["rng"] if rng_state else None)


def _load_share(share: Share, directory: str | os.PathLike[str], optimizer: Any, scheduler: Any,
                rng_state: bool) -> Restored:
    """Every rank: checks the whole model and its own optimizer (all ranks raise if one fails), then reads the
    tensors of its own layers and optimizer only."""
    ranks.check_job(share, "load")
    spots = ranks.spots_of(share)
    names = ranks.names_of(share, spots)
    plan, error = None, None
    try:
        plan = _plan(directory, spots, places(share.model), names, optimizer, scheduler, set(names.values()))
    except SeqifyError as e:
        error = e
    ranks.agree(error)
    assert plan is not None
    by_rank = plan.saved.get("rng_ranks")
    generators = by_rank[ranks.rank()] if by_rank and len(by_rank) == ranks.world() else plan.saved["rng"]
    return _apply(plan, spots, names, optimizer, scheduler, generators if rng_state else None)


@dataclass
class _Plan:
    """A checkpoint checked against what loads it: the tensors to read (name -> where), the optimizer's state."""

    directory: str | os.PathLike[str]
    meta: dict[str, Any]
    saved: dict[str, Any]
    targets: dict[str, torch.Tensor]
    named: NamedState | None
    moments: list[tuple[str, str]]  # the optimizer tensors to read, (key, state name)


def _plan(directory: str | os.PathLike[str], spots: OrderedDict[str, list[torch.Tensor]],
          whole: OrderedDict[str, list[torch.Tensor]], names: dict[int, str], optimizer: Any, scheduler: Any,
          only: set[str] | None) -> _Plan:
    """Read the checkpoint's metadata and check it against the model (``whole``), the optimizer (over ``only``
    those keys, for a rank's share) and the scheduler; nothing changes yet."""
    meta = store.read_meta(directory)
    saved = store.read_state(directory)
    shapes = store.tensor_shapes(directory)
    _check_model(whole, shapes, directory, meta)
    named = _optimizer_state(optimizer, saved, meta, names, directory, only)
    _check_scheduler(scheduler, saved, meta, directory)
    targets = {MODEL + k: ts[0] for k, ts in spots.items()}
    moments = [] if named is None else [(k, n) for k, n in saved["optimizer"]["tensors"] if only is None or k in only]
    targets.update({_optimizer_key(k, n): _empty(shapes, _optimizer_key(k, n), directory) for k, n in moments})
    return _Plan(directory, meta, saved, targets, named, moments)


def _apply(plan: _Plan, spots: OrderedDict[str, list[torch.Tensor]], names: dict[int, str], optimizer: Any,
           scheduler: Any, generators: dict[str, Any] | None) -> Restored:
    """Read the planned tensors and set the model, optimizer, scheduler and (given their state) generators."""
    store.read_tensors(plan.directory, plan.targets)
    _spread(spots)
    if plan.named is not None and optimizer is not None:
        plan.named.tensors = {(k, n): plan.targets[_optimizer_key(k, n)] for k, n in plan.moments}
        load_named_state(optimizer, plan.named, names, str(plan.directory))
    if scheduler is not None:
        scheduler.load_state_dict(plan.saved["scheduler"])
    if generators is not None:
        rng.restore(generators)
    return Restored(plan.saved["step"], plan.saved["extra"], plan.meta)


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
                     names: dict[int, str], directory: str | os.PathLike[str],
                     only: set[str] | None) -> NamedState | None:
    """The saved optimizer state (of the keys ``only``, where given), checked to fit ``optimizer``; None
    without an optimizer."""
    if optimizer is None:
        return None
    _check_saved("optimizer", optimizer, saved, meta, directory, " over the same parameters")
    state = saved["optimizer"]
    named = NamedState(plain=state["plain"], groups=state["groups"])
    if only is not None:
        named = NamedState(plain={k: v for k, v in named.plain.items() if k in only},
                           groups=[dict(g, params=[k for k in g["params"] if k in only]) for g in named.groups])
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
