"""Wiring: how a step's programs connect between partitions, and the order a schedule issues them in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from seqify.errors import GraphError
from seqify.pipe.executors.programs import Program
from seqify.pipe.stage import Stage
from seqify.schedule.actions import Schedule, gpipe

__all__ = ["Route", "Wiring", "consumers_of", "device_orders", "order", "slots"]


def _drains(order: Sequence[tuple[str, int]]) -> bool:
    """Whether every forward in ``order`` comes before every backward (B or W)."""
    backward = [k != "F" for k, _ in order]
    return backward == sorted(backward)


# Where a partition's input slot is filled from: (partition, output slot) of the same micro-batch.
Route = tuple[int, int]


def slots(devices: Sequence[torch.device]) -> tuple[int, ...]:
    """A schedule placement from partition devices: partitions on one device share its number."""
    first: dict[torch.device, int] = {}
    return tuple(first.setdefault(d, len(first)) for d in devices)


def order(devices: Sequence[torch.device], micro_batches: int,
          needs: Callable[[int, int], list[tuple[int, int]]], backward: bool,
          schedule: Schedule | None = None) -> list[tuple[int, int]]:
    """The (micro-batch, partition) programs in the order to issue them: the forwards (or backwards) of
    ``schedule``, by default GPipe's fill-drain over these devices (:func:`~.schedule.gpipe`). With one
    partition per device that is fill-drain; with several (devices ``[0, 1, 0, 1]``) it is looped:
    each device runs all micro-batches of one partition before the next, which shrinks the bubble with
    the number of partitions per device. A program comes after every program it ``needs`` (the
    schedule's F and B chains imply the routes between partitions; checked here)."""
    if schedule is None:
        schedule = gpipe(slots(devices), micro_batches)
    out = schedule.backwards() if backward else schedule.forwards()
    issued: set[tuple[int, int]] = set()
    for ij in out:
        if any(n not in issued for n in needs(*ij)):
            raise GraphError(f"schedule {schedule.name!r} issues program {ij} before one it reads from")
        issued.add(ij)
    return out


def consumers_of(programs: list[list[Program]], routes: list[list[Route]]) -> list[list[list[tuple[int, int]]]]:
    """Per partition and output slot, the (partition, input slot) pairs that read it."""
    out: list[list[list[tuple[int, int]]]] = [[[] for _ in row[0].outputs] for row in programs]
    for j, slots in enumerate(routes):
        for s, (a, o) in enumerate(slots):
            out[a][o].append((j, s))
    return out


@dataclass(frozen=True)
class Wiring:
    """How a step's programs connect and the order a step issues them in, fixed before any is captured:
    ``routes`` ([partition][input slot] -> (partition, output slot)), ``consumers`` (the reverse), the
    ``schedule`` (default fill-drain), its forwards and backwards as (micro-batch, partition) orders
    (checked against the routes), whether it drains (every device's forwards before its backwards) and
    each (partition, micro-batch)'s ``last`` action kind."""

    devices: list[torch.device]
    routes: list[list[Route]]
    consumers: list[list[list[tuple[int, int]]]]
    schedule: Schedule
    forward_order: list[tuple[int, int]]
    backward_order: list[tuple[int, int]]
    drains: bool
    last: dict[tuple[int, int], str]

    @classmethod
    def of(cls, stages: Sequence[Stage], programs: list[list[Program]], routes: list[list[Route]],
           schedule: Schedule | None = None) -> Wiring:
        devices = [s.device for s in stages]
        m = len(programs[0])
        consumers = consumers_of(programs, routes)
        sources = [sorted({a for a, _ in slots}) for slots in routes]
        users = [sorted({b for outs in consumers[j] for b, _ in outs}) for j in range(len(stages))]
        if schedule is not None and (schedule.partitions != len(stages) or schedule.microbatches != m):
            raise GraphError(f"schedule {schedule.name!r} is for {schedule.partitions} partitions and "
                             f"{schedule.microbatches} micro-batches, not {len(stages)} and {m}")
        schedule = schedule or gpipe(slots(devices), m)
        forward_order = order(devices, m, lambda i, j: [(i, a) for a in sources[j]], False, schedule)
        backward_order = order(devices, m, lambda i, j: [(i, b) for b in users[j]], True, schedule)
        # pipe(x) + loss.backward() replays every forward before any backward: only programs captured in
        # such an order (fill-drain on every device) may run that way (see capture.capture_in_order), and
        # unsplit (its backward has no W steps to issue).
        drains = not schedule.split and all(
            _drains([(kind, i) for kind, _, i in acts]) for acts in device_orders(schedule, devices).values())
        last: dict[tuple[int, int], str] = {(a.partition, a.microbatch): a.kind for a in schedule.actions}
        return cls(devices, routes, consumers, schedule, forward_order, backward_order, drains, last)

    def device_orders(self) -> dict[torch.device, list[tuple[str, int, int]]]:
        """Each device's (kind, partition, micro-batch) actions in the order a step issues them there:
        the schedule's actions of the partitions on that device (the order their graphs are captured in)."""
        return device_orders(self.schedule, self.devices)


def device_orders(schedule: Schedule,
                  devices: Sequence[torch.device]) -> dict[torch.device, list[tuple[str, int, int]]]:
    """See :meth:`Wiring.device_orders`."""
    out: dict[torch.device, list[tuple[str, int, int]]] = {d: [] for d in devices}
    for a in schedule.actions:
        out[devices[a.partition]].append((a.kind, a.partition, a.microbatch))
    return out
