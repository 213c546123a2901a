"""One checkpoint written and read by every rank of a distributed pipeline: who holds and writes what, and agreeing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from seqify.checkpoint.keys import first_partitions, rank_places
from seqify.errors import CheckpointError, SeqifyError

__all__ = ["Share", "share_of", "rank", "world", "check_job", "spots_of", "names_of", "writes", "gather", "agree",
           "merge_optimizer", "same"]


@dataclass(frozen=True)
class Share:
    """What one rank of a distributed pipeline holds: the whole model every rank builds, this rank's layers
    (``partition``), the balance, the rank of each partition (``placement``), this rank's pipeline rank
    (``index``) and replica, and the number of processes of the job (``ranks``)."""

    model: nn.Module
    partition: nn.Module
    balance: Sequence[int]
    placement: Sequence[int]
    index: int
    replica: int
    ranks: int


def share_of(obj: Any) -> Share | None:
    """The share of a rank's stage (an object with ``checkpoint_share()``, as ``seqify.distributed`` stages
    have), or None for a pipeline or a model of this process alone."""
    get = getattr(obj, "checkpoint_share", None)
    return get() if callable(get) else None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def check_job(share: Share, what: str) -> None:
    """A rank's share is saved or loaded by every rank of its job together, through the process group."""
    if world() != share.ranks:
        raise CheckpointError(
            f"seqify.checkpoint.{what} of a stage that holds part of a pipeline of {share.ranks} process(es), and this "
            f"job has {world()}: call it on every rank of the job that built the stage (under torchrun, with the "
            "process group that seqify.distributed.stage initialises)"
        )


def spots_of(share: Share) -> OrderedDict[str, list[torch.Tensor]]:
    """Source key -> this rank's tensors of it."""
    return rank_places(share.model, share.partition, share.placement[0] == share.index)


def names_of(share: Share, spots: OrderedDict[str, list[torch.Tensor]]) -> dict[int, str]:
    """``id(parameter)`` -> source key, for the parameters of this rank's layers (those its optimizer holds)."""
    mine = {id(p) for p in share.partition.parameters()}
    return {id(t): k for k, ts in spots.items() for t in ts if isinstance(t, nn.Parameter) and id(t) in mine}


def writes(share: Share, spots: OrderedDict[str, list[torch.Tensor]]) -> list[str]:
    """The keys this rank writes: each key once, by replica 0 of the rank of the first partition that holds it."""
    if share.replica:
        return []
    first = first_partitions(share.model, share.balance)
    return [k for k in spots if share.placement[first[k]] == share.index]


def agree(error: SeqifyError | None) -> None:
    """Raise on every rank when any rank failed, so that none goes on into a collective the others left."""
    gather(None, error)


def gather(piece: Any, error: SeqifyError | None) -> list[Any]:
    """Every rank's ``piece`` (in rank order), once no rank failed; otherwise every rank raises."""
    found: list[Any] = [(piece, error)]
    if dist.is_initialized():
        found = [None] * world()
        dist.all_gather_object(found, (piece, error))
    if error is not None:
        raise error
    failed = [(r, e) for r, (_, e) in enumerate(found) if e is not None]
    if failed:
        r, e = failed[0]
        raise type(e)(f"rank {r}: {e}")
    return [p for p, _ in found]


def merge_optimizer(pieces: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The ranks' optimizer states (each over its own parameters) as one, over every parameter."""
    if all(p is None for p in pieces):
        return None
    if any(p is None for p in pieces):
        raise CheckpointError("some ranks passed an optimizer to seqify.checkpoint.save and others did not: pass "
                              "each rank's optimizer on every rank")
    given = [p for p in pieces if p is not None]
    if len({len(p["groups"]) for p in given}) > 1:
        raise CheckpointError("the ranks' optimizers have different numbers of parameter groups: build every rank's "
                              "optimizer with the same groups (a group may hold none of a rank's parameters)")
    groups = [_merge_group([p["groups"][j] for p in given], j) for j in range(len(given[0]["groups"]))]
    plain: dict[str, dict[str, Any]] = {}
    tensors: dict[tuple[str, str], None] = {}
    for p in given:
        for k, values in p["plain"].items():
            plain.setdefault(k, values)
        tensors.update(dict.fromkeys(tuple(kn) for kn in p["tensors"]))
    return {"groups": groups, "plain": plain, "tensors": [list(kn) for kn in tensors]}


def _merge_group(groups: list[dict[str, Any]], j: int) -> dict[str, Any]:
    """Parameter group ``j`` of every rank: their parameters together, their hyperparameters equal."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    odd = [r for r, s in enumerate(settings) if not same(s, settings[0])]
    if odd:
        differ = sorted(k for k in settings[0].keys() | settings[odd[0]].keys()
                        if not same(settings[0].get(k), settings[odd[0]].get(k)))
        raise CheckpointError(
            f"parameter group {j} of rank {odd[0]}'s optimizer has other settings than rank 0's ({differ}): one "
            "checkpoint keeps one value per group; give every rank's group the same settings"
        )
    params: dict[str, None] = {}
    for g in groups:
        params.update(dict.fromkeys(g["params"]))
    return dict(settings[0], params=list(params))


def same(a: Any, b: Any) -> bool:
    """Whether two plain values (numbers, strings, tensors, and lists, tuples and dicts of them) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)
