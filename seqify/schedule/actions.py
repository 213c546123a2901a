"""Schedules as data: the order of every forward (F), backward (B) and weight-gradient (W) step of a pipeline.

A :class:`Schedule` is a list of :class:`Action` ``(device, partition, microbatch, kind)`` in an order every
executor may issue them in (each action after the actions it depends on), built by :func:`gpipe`,
:func:`one_f_one_b`, :func:`interleaved`, :func:`zb_h1` or :func:`zb_h2`. Executors (eager, replay,
``seqify.distributed``) read it; :meth:`Schedule.check` verifies it and :meth:`Schedule.peak_activations`
predicts memory, without a model. This module imports no executor.

Kinds::

    F  forward of a partition on a micro-batch (keeps its activations)
    B  backward of a partition for a micro-batch: with ``split`` only the gradient of its inputs (what the
       previous partition waits for), else the whole backward (inputs and weights)
    W  the weight gradients of that backward (``split`` schedules only), freeing the activations

Dependencies: F(p, m) after F(p-1, m); B(p, m) after F(p, m) and B(p+1, m); W(p, m) after B(p, m).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from seqify.errors import ScheduleError

__all__ = [
    "Action", "Kind", "Schedule", "SCHEDULES", "SPLIT", "ahead", "clock_cycles", "gpipe", "one_f_one_b", "interleaved",
    "zb_h1", "zb_h2", "make", "merge", "round_robin", "v_shape", "last_gradients",
]

Kind = Literal["F", "B", "W"]
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
#: The schedules whose backward is split into B and W (zero bubble).
SPLIT = ("zb-h1", "zb-h2")


@dataclass(frozen=True)
class Action:
    """One step of a schedule: ``kind`` work of ``partition`` on ``microbatch``, run on ``device``."""

    device: int
    partition: int
    microbatch: int
    kind: Kind

    def __repr__(self) -> str:
        return f"{self.kind}{self.partition}.{self.microbatch}@{self.device}"


def last_gradients(actions: Sequence[Action]) -> frozenset[int]:
    """The ids of each partition's last action among ``actions`` that adds into its weights' gradients (B or
    W): after it, that partition's gradient sums are final for the step."""
    last: dict[int, Action] = {}
    for a in actions:
        if a.kind in ("B", "W"):
            last[a.partition] = a
    return frozenset(map(id, last.values()))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions`` in issue order for ``partitions`` placed on devices by
    ``placement`` (``placement[p]`` is partition p's device), over ``microbatches`` micro-batches.
    ``split``: backward is split into B (input gradients) and W (weight gradients)."""

    name: str
    placement: tuple[int, ...]
    microbatches: int
    actions: tuple[Action, ...]
    split: bool = False
    ticks: float = 0.0  # the builder's simulated length, in forward times (B = W = 1 split, B = 2 unsplit)

    @property
    def partitions(self) -> int:
        return len(self.placement)

    @property
    def devices(self) -> int:
        return max(self.placement) + 1

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def per_device(self) -> list[list[Action]]:
        """Each device's actions in the order it runs them (torch.distributed.pipelining's per-rank lists)."""
        out: list[list[Action]] = [[] for _ in range(self.devices)]
        for a in self.actions:
            out[a.device].append(a)
        return out

    def forwards(self) -> list[tuple[int, int]]:
        """The (micro-batch, partition) forward programs in issue order."""
        return [(a.microbatch, a.partition) for a in self.actions if a.kind == "F"]

    def backwards(self) -> list[tuple[int, int]]:
        """The (micro-batch, partition) backward programs (B) in issue order."""
        return [(a.microbatch, a.partition) for a in self.actions if a.kind == "B"]

    def check(self) -> None:
        """Raise :class:`ScheduleError` unless every (partition, micro-batch, kind) occurs exactly once, on
        its partition's device, after everything it depends on."""
        kinds: tuple[str, ...] = ("F", "B", "W") if self.split else ("F", "B")
        seen: dict[tuple[int, int, str], int] = {}
        for k, a in enumerate(self.actions):
            where = f"{self.name}: action {k} ({a!r})"
            if a.kind not in kinds:
                raise ScheduleError(f"{where} has kind {a.kind!r}; this schedule uses {kinds}")
            if not (0 <= a.partition < self.partitions and 0 <= a.microbatch < self.microbatches):
                raise ScheduleError(f"{where} names a partition or micro-batch the pipeline does not have")
            if self.placement[a.partition] != a.device:
                raise ScheduleError(f"{where} runs on device {a.device}, but partition {a.partition} lives on "
                                    f"device {self.placement[a.partition]}")
            key = (a.partition, a.microbatch, a.kind)
            if key in seen:
                raise ScheduleError(f"{where} repeats action {seen[key]}; each step runs exactly once")
            for need in needs(a.partition, a.microbatch, a.kind, self.partitions):
                if need not in seen:
                    raise ScheduleError(f"{where} comes before {need[2]}{need[0]}.{need[1]}, which it depends on")
            seen[key] = k
        missing = self.partitions * self.microbatches * len(kinds) - len(seen)
        if missing:
            raise ScheduleError(f"{self.name}: {missing} steps are missing; every partition runs every kind "
                                "on every micro-batch")

    def in_flight(self, weights: Sequence[float] | None = None) -> list[list[float]]:
        """Per device, the activations held after each of its actions (F holds a micro-batch's
        activations of a partition; they are freed by its W in split schedules, else by its B), in units
        of one partition's activations for one micro-batch, scaled by ``weights[partition]`` if given."""
        w = list(weights) if weights is not None else [1.0] * self.partitions
        free = "W" if self.split else "B"
        out: list[list[float]] = []
        for actions in self.per_device():
            held, trace = 0.0, []
            for a in actions:
                if a.kind == "F":
                    held += w[a.partition]
                elif a.kind == free:
                    held -= w[a.partition]
                trace.append(held)
            out.append(trace)
        return out

    def peak_activations(self, weights: Sequence[float] | None = None) -> list[float]:
        """Per device, the most micro-batch activations it holds at once (see :meth:`in_flight`)."""
        return [max(trace, default=0.0) for trace in self.in_flight(weights)]


def needs(partition: int, microbatch: int, kind: str, partitions: int) -> list[tuple[int, int, str]]:
    """The steps ``kind`` of (partition, microbatch) waits for, as (partition, microbatch, kind)."""
    p, m = partition, microbatch
    if kind == "F":
        return [(p - 1, m, "F")] if p else []
    if kind == "B":
        return [(p, m, "F")] + ([(p + 1, m, "B")] if p + 1 < partitions else [])
    return [(p, m, "B")]


def clock_cycles(micro_batches: int, partitions: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per clock cycle, the (micro-batch, partition) pairs that can run at once.

    Cycle ``k`` runs micro-batch ``i`` on partition ``j`` for every ``i + j == k``: partition ``j``
    receives micro-batch ``i`` one cycle after partition ``j - 1`` produced it.
    """
    for k in range(micro_batches + partitions - 1):
        yield [(k - j, j) for j in range(max(0, k - micro_batches + 1), min(k + 1, partitions))]


def round_robin(devices: int, loops: int = 1) -> tuple[int, ...]:
    """Partition p on device ``p % devices``: ``loops`` partitions per device, looping over the devices."""
    return tuple(p % devices for p in range(devices * loops))


def v_shape(devices: int) -> tuple[int, ...]:
    """Two partitions per device in a V: down the devices and back (0, 1, .., d-1, d-1, .., 1, 0), so the
    first and last partition share device 0 and each device's second partition follows closely."""
    return tuple(range(devices)) + tuple(reversed(range(devices)))


# -- building: a list-scheduling simulation with unit costs -----------------------------------------

Pick = Callable[[list[tuple[int, int]]], tuple[int, int]]


def _oldest(ready: list[tuple[int, int]]) -> tuple[int, int]:
    """Lowest micro-batch first, then the partition closest to the loss."""
    return min(ready, key=lambda pm: (pm[1], -pm[0]))


@dataclass
class _Device:
    forwards: list[tuple[int, int]] | None  # fixed order of (partition, microbatch), or None: greedy
    backwards: list[tuple[int, int]] | None
    limit: float  # micro-batches between F and B at most before another F (relaxed only if all else is stuck)
    owned: list[int]
    hold: float = float("inf")  # micro-batches between F and W at most (split schedules): else W before F
    done_f: list[tuple[int, int]] = field(default_factory=list)
    done_b: list[tuple[int, int]] = field(default_factory=list)
    pending_w: list[tuple[int, int]] = field(default_factory=list)
    held: int = 0  # F done, B not yet
    kept: int = 0  # F done, W not yet (split schedules)
    busy_until: float = 0.0
    alternate: bool = False  # after a B, an F first when both are ready (Megatron's steady 1F1B)
    last: str = ""


def _simulate(name: str, placement: Sequence[int], m: int, split: bool, devices: list[_Device],
              fill_drain: bool = False) -> Schedule:
    """Run the devices on a unit-cost clock (F = B = W = 1; an unsplit B costs 2) and record the actions
    in the order they start. A device prefers a ready B (it frees memory and unblocks the previous
    partition), then an F while it holds fewer than ``limit`` activations, then a pending W (filling
    what would be a bubble); with ``fill_drain`` it starts no B before all its Fs. In split schedules a
    device keeps at most ``hold`` micro-batches awaiting W before it must run a W instead of an F."""
    n = len(placement)
    finished: dict[tuple[int, int, str], float] = {}
    actions: list[Action] = []
    total = n * m * (3 if split else 2)
    clock = 0.0
    cost = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}

    def ready(p: int, mb: int, kind: str) -> bool:
        return all(finished.get(x, float("inf")) <= clock for x in needs(p, mb, kind, n))

    def candidates(dev: _Device, kind: str) -> list[tuple[int, int]]:
        done = dev.done_f if kind == "F" else dev.done_b
        fixed = dev.forwards if kind == "F" else dev.backwards
        if fixed is not None:
            k = len(done)
            return [fixed[k]] if k < len(fixed) and ready(*fixed[k], kind) else []
        taken = set(done)
        return [(p, mb) for p in dev.owned for mb in range(m) if (p, mb) not in taken and ready(p, mb, kind)]

    def start(d: int, dev: _Device, p: int, mb: int, kind: str) -> None:
        actions.append(Action(d, p, mb, kind))  # type: ignore[arg-type]
        finished[(p, mb, kind)] = clock + cost[kind]
        dev.busy_until = clock + cost[kind]
        if kind != "W":
            dev.last = kind
        if kind == "F":
            dev.done_f.append((p, mb))
            dev.held += 1
            dev.kept += 1
        elif kind == "B":
            dev.done_b.append((p, mb))
            dev.held -= 1
            if split:
                dev.pending_w.append((p, mb))
            else:
                dev.kept -= 1
        else:
            dev.pending_w.remove((p, mb))
            dev.kept -= 1

    while len(actions) < total:
        started = False
        for d, dev in enumerate(devices):
            if dev.busy_until > clock:
                continue
            all_f = len(dev.done_f) == len(dev.owned) * m
            bs = candidates(dev, "B") if (all_f or not fill_drain) else []
            fs = candidates(dev, "F") if dev.held < dev.limit and dev.kept < dev.hold else []
            if fs and (dev.alternate and dev.last == "B" or not bs):
                start(d, dev, *_oldest(fs), "F")
            elif bs:
                start(d, dev, *_oldest(bs), "B")
            elif dev.pending_w:
                start(d, dev, *dev.pending_w[0], "W")
            else:
                continue
            started = True
        if started:
            continue
        later = [dev.busy_until for dev in devices if dev.busy_until > clock]
        if later:
            clock = min(later)
            continue
        # Nothing runs and nothing can start: let the first device with a ready F exceed its limit.
        for d, dev in enumerate(devices):
            fs = candidates(dev, "F")
            if fs:
                start(d, dev, *_oldest(fs), "F")
                break
        else:
            raise ScheduleError(f"{name}: the schedule deadlocks (no step can start); use another schedule")
    schedule = Schedule(name, tuple(placement), m, tuple(actions), split, max(finished.values()))
    schedule.check()
    return schedule


def _owned(placement: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(max(placement) + 1)]
    for p, d in enumerate(placement):
        out[d].append(p)
    return out


def _check(name: str, placement: Sequence[int], microbatches: int) -> None:
    if microbatches < 1:
        raise ScheduleError(f"{name}: {microbatches} micro-batches; need at least one (chunks >= 1)")
    if not placement:
        raise ScheduleError(f"{name}: no partitions")
    used = set(placement)
    if used != set(range(max(placement) + 1)):
        raise ScheduleError(f"{name}: placement {tuple(placement)} leaves a device without partitions; number "
                            "devices 0..d-1 and give each at least one partition")


def gpipe(placement: Sequence[int], microbatches: int) -> Schedule:
    """Fill-drain: each device runs every forward of its partitions (lower partition first, micro-batches
    in order), then every backward (higher partition first, micro-batches in reverse, as autograd and
    captured graphs sharing a memory pool run them). Every micro-batch's activations are held at once."""
    _check("gpipe", placement, microbatches)
    devices = []
    for owned in _owned(placement):
        f = [(p, mb) for p in owned for mb in range(microbatches)]
        b = [(p, mb) for p in reversed(owned) for mb in reversed(range(microbatches))]
        devices.append(_Device(f, b, float("inf"), owned))
    return _simulate("gpipe", placement, microbatches, False, devices, fill_drain=True)


def one_f_one_b(placement: Sequence[int], microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): one partition per device; device s runs ``partitions - s`` forwards, then
    alternates one backward and one forward, so it holds at most ``partitions - s`` micro-batches."""
    _check("1f1b", placement, microbatches)
    if len(set(placement)) != len(placement):
        raise ScheduleError("1f1b: one partition per device; for several (loops > 1) use schedule='interleaved'")
    return _in_line("1f1b", placement, microbatches, lambda n, p: (n - p, float("inf")), split=False)


def _in_line(name: str, placement: Sequence[int], microbatches: int, bounds: Callable[[int, int], tuple[int, float]],
             split: bool) -> Schedule:
    """One partition per device, forwards and backwards in micro-batch order: partition ``p`` of ``n`` runs
    at most ``bounds(n, p)[0]`` forwards ahead of its backwards and, split, holds at most ``bounds(n, p)[1]``
    micro-batches awaiting W (1F1B, ZB-H1 and ZB-H2 differ only there)."""
    n = len(placement)
    devices = [_Device(None, None, 0, []) for _ in range(n)]
    for p, d in enumerate(placement):
        f = [(p, mb) for mb in range(microbatches)]
        ahead, hold = bounds(n, p)
        devices[d] = _Device(f, list(f), ahead, [p], hold=hold)
    return _simulate(name, placement, microbatches, split, devices)


def interleaved(placement: Sequence[int], microbatches: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM) for ``loops`` partitions per device placed round-robin: micro-batches
    go through a device's partitions in groups of ``devices``, so the bubble shrinks by ``loops``; a
    device holds at most ``2 (devices - d - 1) + (loops - 1) devices + 1`` partition activations."""
    _check("interleaved", placement, microbatches)
    d = max(placement) + 1
    loops, rest = divmod(len(placement), d)
    if rest or tuple(placement) != round_robin(d, loops):
        raise ScheduleError(f"interleaved: placement {tuple(placement)} is not round-robin; put partition p on "
                            "device p % devices (loops partitions per device)")
    devices = []
    for rank, owned in enumerate(_owned(placement)):
        f = _megatron(owned, microbatches, d, reverse=False)
        b = _megatron(owned, microbatches, d, reverse=True)
        warmup = min(2 * (d - rank - 1) + (loops - 1) * d, len(f))
        devices.append(_Device(f, b, warmup + 1, owned, alternate=True))
    return _simulate("interleaved", placement, microbatches, False, devices)


def _megatron(owned: list[int], m: int, group: int, reverse: bool) -> list[tuple[int, int]]:
    """Megatron's order over a device's partitions: ``group`` micro-batches through the first partition,
    the same through the next, ..., then the next group (partitions reversed for backward)."""
    parts = list(reversed(owned)) if reverse else owned
    out: list[tuple[int, int]] = []
    for start in range(0, m, group):
        for p in parts:
            out.extend((p, mb) for mb in range(start, min(start + group, m)))
    return out


def zb_h1(placement: Sequence[int], microbatches: int) -> Schedule:
    """Zero bubble ZB-H1 (Qi et al., 2023): backward split into B (input gradients, which the previous
    partition waits for) and W (weight gradients, which nothing waits for). The F/B order is 1F1B's; Ws
    fill the bubbles: a device runs a W when it would otherwise wait. Every device holds at most
    ``partitions`` micro-batches awaiting W, the peak of 1F1B's first device, so the busiest device needs
    no more memory than under 1F1B. With a V placement (:func:`v_shape`, two partitions per device) a
    device holds at most ``partitions`` partition activations (again 1F1B's peak, in half-size units), and
    both ends of the model share device 0."""
    _check("zb-h1", placement, microbatches)
    n = len(placement)
    owned = _owned(placement)
    if len(set(placement)) == n:
        return _in_line("zb-h1", placement, microbatches, lambda n, p: (n - p, n), split=True)
    if tuple(placement) != v_shape(len(owned)):
        raise ScheduleError(f"zb-h1: placement {tuple(placement)} is neither one partition per device nor a V "
                            "(loops=2 with placement='v')")
    devices = [_Device(None, None, n, own, hold=n) for own in owned]  # greedy, oldest micro-batch first
    return _simulate("zb-h1", placement, microbatches, True, devices)


def zb_h2(placement: Sequence[int], microbatches: int) -> Schedule:
    """Zero bubble with more memory (after ZB-H2, Qi et al., 2023): ZB-H1's split backward and W filling,
    but device ``s`` of ``n`` runs up to ``2 (n - s) - 1`` forwards ahead (1F1B and ZB-H1: ``n - s``) and
    holds up to that many, or ``n``, micro-batches awaiting W. The first device starts its next forward
    instead of waiting for the first input gradient, and each copy between devices hides behind work that
    is ready: on two GPUs, where the first partition's B is empty and its W the whole backward, ZB-H1
    waits there once per step and at every late copy. The first device holds up to ``2 n - 1``
    micro-batches (1F1B and ZB-H1: ``n``): more memory for less bubble. One partition per device."""
    _check("zb-h2", placement, microbatches)
    if len(set(placement)) != len(placement):
        raise ScheduleError(f"zb-h2: placement {tuple(placement)} puts several partitions on a device; zb-h2 runs "
                            "one per device (for two per device in a V use schedule='zb-h1' with loops=2)")
    return _in_line("zb-h2", placement, microbatches, lambda n, p: (2 * (n - p) - 1, max(2 * (n - p) - 1, n)),
                    split=True)


def ahead(schedule: Schedule) -> Schedule:
    """``schedule`` with every device's forwards one run earlier: on each device, the backward actions (B, W)
    issued between two forwards move behind the second. A device then issues each forward before the
    backwards it used to follow, so that on a second stream (:class:`~seqify.pipe.executors.lanes.Lanes`) they
    can run beside it; each device holds one more micro-batch's activations. Returned unchanged where the
    devices' new orders admit no issue order (:func:`merge`)."""
    lists = []
    for acts in schedule.per_device():
        out: list[Action] = []
        run: list[Action] = []  # the backwards since the last forward, held back until the next one
        for a in acts:
            if a.kind == "F":
                out.append(a)
                out += run
                run = []
            else:
                run.append(a)
        lists.append(out + run)
    merged = merge(lists, schedule.partitions)
    if merged is None:
        return schedule
    return replace(schedule, actions=tuple(merged))


def merge(lists: Sequence[Sequence[Action]], partitions: int) -> list[Action] | None:
    """One issue order from each device's own order: round by round, each device's next action once
    everything it depends on was issued; None when no device can go on (the orders wait on each other)."""
    heads = [0] * len(lists)
    done: set[tuple[int, int, str]] = set()
    out: list[Action] = []
    while len(out) < sum(map(len, lists)):
        moved = False
        for d, acts in enumerate(lists):
            if heads[d] < len(acts):
                a = acts[heads[d]]
                if all(n in done for n in needs(a.partition, a.microbatch, a.kind, partitions)):
                    out.append(a)
                    done.add((a.partition, a.microbatch, a.kind))
                    heads[d] += 1
                    moved = True
        if not moved:
            return None
    return out


def make(name: str | Schedule, placement: Sequence[int], microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`) for this placement, or ``name`` itself
    when it is a :class:`Schedule` (checked against the placement and micro-batch count)."""
    if isinstance(name, Schedule):
        if tuple(name.placement) != tuple(placement) or name.microbatches != microbatches:
            raise ScheduleError(
                f"schedule {name.name!r} is for placement {name.placement} and {name.microbatches} micro-batches, "
                f"but the pipeline has placement {tuple(placement)} and {microbatches}; build it for this pipeline"
            )
        name.check()
        return name
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1, "zb-h2": zb_h2}
    if name not in builders:
        raise ScheduleError(f"schedule={name!r}: choose one of {SCHEDULES} or pass a seqify.schedule.actions.Schedule")
    return builders[name](placement, microbatches)
