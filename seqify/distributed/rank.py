"""What a rank's step, replay and checkpoint code read from the stage a rank holds: routes and a protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from seqify.pipe.stage import Stage
from seqify.schedule.actions import Schedule
from seqify.skip.layout import routes
from seqify.skip.namespace import SkipKey

__all__ = ["Route", "RankStage", "crossing_routes"]


@dataclass(frozen=True)
class Route:
    """A skip that crosses partitions: its index among the model's routes, its name, and both ends."""

    index: int
    name: str
    src: int  # partition that stashes
    dst: int  # partition that pops


class RankStage(Protocol):
    """The partitions one rank holds (:class:`seqify.distributed.DistributedStage`), as its executors see them."""

    model: nn.Sequential  # the whole model every rank builds (a seqify.Sequential when converted)
    partition: nn.Sequential
    balance: list[int]
    index: int
    stages: int
    partitions: int
    replica: int
    device: torch.device
    routes: list[Route]
    runners: dict[int, Stage]
    norms: dict[int, list[nn.modules.batchnorm._NormBase]]
    params: dict[int, list[nn.Parameter]]
    _programs: dict[int, Any]  # partition -> its RankPrograms (graphs=True; replay imports this module)

    @property
    def is_first(self) -> bool: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def me(self) -> str: ...

    def rank_of_partition(self, partition: int) -> int: ...

    def skip_key(self, route: Route) -> SkipKey: ...

    def plan(self, m: int) -> Schedule: ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def over_replicas(self) -> Callable[[list[torch.Tensor]], Callable[[], int]] | None: ...


def crossing_routes(model: nn.Sequential, balance: Sequence[int]) -> tuple[list[Route], dict[int, SkipKey]]:
    """The skips whose stash and pop lie in different partitions, and each one's key."""
    part_of = [j for j, count in enumerate(balance) for _ in range(count)]
    found = routes(model)
    crossing = [Route(i, r.key[1], part_of[r.stash], part_of[r.pop])
                for i, r in enumerate(found) if part_of[r.stash] != part_of[r.pop]]
    return crossing, {rt.index: found[rt.index].key for rt in crossing}
