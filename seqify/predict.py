"""predict: a pipeline step's time and peak memory from per-layer costs, calibrated overheads and its schedule.

The model, per candidate (partitions on devices, ``m`` micro-batches of ``b`` samples):

* a layer's forward+backward seconds at micro-batch ``b`` is ``a + s * b``, a line through the layer's
  profiled times at two batch sizes (``a``: what does not shrink with the batch, e.g. small kernels);
  forward is a third of it, backward two thirds (``TRAINING_FACTOR``), and a checkpointed micro-batch's
  backward runs its forward again;
* every (micro-batch, partition) task costs the executor ``task_s`` of host time, and on CUDA without
  graphs every layer call costs ``launch_s`` of host time to issue (the host issues all devices' forwards
  from one thread, so step time is at least their sum);
* a value crossing a cut between two devices costs ``copy_latency_s + bytes / copy_bytes_per_s`` each way;
* tasks run on their device in the schedule's order as soon as what they need is done: the simulation
  gives the fill-drain bubble, ``(m + p - 1) / m`` for GPipe, and its looped and 1F1B variants, from the
  schedule itself rather than a formula. Partitions on CPU devices share the host: nothing overlaps, so
  their step is the sum of their work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .partition.cost import TRAINING_FACTOR

__all__ = ["LayerModel", "Calibration", "Candidate", "Prediction", "predict", "tasks_order"]


@dataclass(frozen=True)
class LayerModel:
    """Per layer: ``fixed_s + per_sample_s * b`` forward+backward seconds at micro-batch ``b``; saved and
    output bytes per sample; parameter and buffer bytes; the bytes crossing the cut before each layer per
    sample (the carried value plus live skips; ``cut_bytes[0]`` is the input)."""

    fixed_s: tuple[float, ...]
    per_sample_s: tuple[float, ...]
    saved_per_sample: tuple[float, ...]
    state_bytes: tuple[int, ...]
    cut_per_sample: tuple[float, ...]

    @classmethod
    def fit(cls, lo: tuple[int, Sequence[float]], hi: tuple[int, Sequence[float]], saved: Sequence[int],
            state: Sequence[int], cut: Sequence[int], batch: int) -> LayerModel:
        """The line through each layer's times ``lo = (batch, times)`` and ``hi``; bytes measured at ``batch``."""
        (b0, t0), (b1, t1) = lo, hi
        fixed, slope = [], []
        for x, y in zip(t0, t1):
            s = max(y - x, 0.0) / (b1 - b0) if b1 > b0 else y / max(b1, 1)
            fixed.append(max(y - s * b1, 0.0))
            slope.append(s)
        per = 1.0 / max(batch, 1)
        return cls(tuple(fixed), tuple(slope), tuple(v * per for v in saved), tuple(state), tuple(v * per for v in cut))

    def __len__(self) -> int:
        return len(self.fixed_s)

    def scaled(self, factor: float) -> LayerModel:
        """Every layer's time times ``factor`` (bytes unchanged)."""
        return replace(self, fixed_s=tuple(v * factor for v in self.fixed_s),
                       per_sample_s=tuple(v * factor for v in self.per_sample_s))

    def seconds(self, start: int, stop: int, batch: float) -> float:
        """Forward+backward seconds of layers ``start..stop-1`` at micro-batch ``batch``."""
        return math.fsum(self.fixed_s[start:stop]) + batch * math.fsum(self.per_sample_s[start:stop])


@dataclass(frozen=True)
class Calibration:
    """Measured overheads of the executor and the devices: see the module docstring. ``host_serial``:
    every partition runs on the host (CPU devices), so no two tasks overlap."""

    task_s: float
    launch_s: float
    copy_latency_s: float
    copy_bytes_per_s: float
    host_serial: bool


@dataclass(frozen=True)
class Candidate:
    """One configuration: layers per partition, the device of each partition, micro-batches, checkpointing,
    CUDA graphs and schedule (``'gpipe'`` for the fill-drain executor)."""

    balance: tuple[int, ...]
    devices: tuple[str, ...]
    chunks: int
    checkpoint: str
    graphs: bool = False
    schedule: str = "gpipe"


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per training step and peak bytes on the fullest device."""

    seconds: float
    memory_bytes: int


def tasks_order(schedule: str, devices: Sequence[str], m: int, graphs: bool) -> dict[str, list[tuple[str, int, int]]]:
    """Per device, its tasks ``(F|B, micro-batch, partition)`` in the order it runs them.

    ``gpipe`` without graphs: forwards in clock-cycle order (partition ``j`` takes micro-batch ``i`` at
    cycle ``i + j``), then backwards in the reverse; with graphs (looped, breadth-first): every micro-batch
    of a device's first partition, then of its next. ``1f1b`` (and the schedules derived from it): each
    partition runs ``p - j - 1`` forwards ahead, then alternates one forward, one backward.
    """
    p = len(devices)
    queues: dict[str, list[tuple[str, int, int]]] = {d: [] for d in devices}
    if schedule == "gpipe":
        if graphs:
            forwards = [(i, j) for j in range(p) for i in range(m)]
        else:
            forwards = [(k - j, j) for k in range(m + p - 1) for j in range(max(0, k - m + 1), min(k + 1, p))]
        for i, j in forwards:
            queues[devices[j]].append(("F", i, j))
        for i, j in reversed(forwards):
            queues[devices[j]].append(("B", i, j))
        return queues
    per_partition: list[list[tuple[str, int, int]]] = []
    for j in range(p):
        ahead = min(p - j, m)
        ops = [("F", i, j) for i in range(ahead)]
        for i in range(m):
            ops.append(("B", i, j))
            if ahead + i < m:
                ops.append(("F", ahead + i, j))
        per_partition.append(ops)
    for j, ops in enumerate(per_partition):  # partitions sharing a device take turns, task by task
        queues[devices[j]].extend(ops)
    for d in queues:
        queues[d].sort(key=lambda op: _interleave_rank(op, per_partition))
    return queues


def _interleave_rank(op: tuple[str, int, int], per_partition: list[list[tuple[str, int, int]]]) -> tuple[int, int]:
    return per_partition[op[2]].index(op), op[2]


def predict(c: Candidate, layers: LayerModel, cal: Calibration, batch: int) -> Prediction:
    """The step time and peak memory of candidate ``c`` for a mini-batch of ``batch`` samples."""
    m = max(1, min(c.chunks, batch))
    b = batch / m
    starts = [sum(c.balance[:j]) for j in range(len(c.balance))]
    stops = [s + n for s, n in zip(starts, c.balance)]
    p = len(c.balance)
    stop_ckpt = {"always": m, "except_last": m - 1, "never": 0}[c.checkpoint]
    launch = 0.0 if c.graphs else cal.launch_s
    compute = [layers.seconds(a, z, b) for a, z in zip(starts, stops)]
    fwd = [t / TRAINING_FACTOR for t in compute]
    bwd = [t - f for t, f in zip(compute, fwd)]
    issue = [cal.task_s + n * launch for n in c.balance]
    copy = [0.0] + [
        cal.copy_latency_s + layers.cut_per_sample[starts[j]] * b / cal.copy_bytes_per_s
        if c.devices[j] != c.devices[j - 1] else 0.0
        for j in range(1, p)
    ]

    def duration(kind: str, i: int, j: int) -> float:
        if kind == "F":
            return max(fwd[j], issue[j] / TRAINING_FACTOR) if not cal.host_serial else fwd[j] + issue[j] / TRAINING_FACTOR
        extra = fwd[j] if i < stop_ckpt else 0.0
        own = bwd[j] + extra
        host = issue[j] * (1 - 1 / TRAINING_FACTOR)
        return own + host if cal.host_serial else max(own, host)

    if cal.host_serial:
        seconds = sum(duration(k, i, j) + 2 * copy[j] for k in "FB" for i in range(m) for j in range(p))
    else:
        seconds = _simulate(tasks_order(c.schedule, c.devices, m, c.graphs), duration, copy, p, m, c.schedule)
        host = sum(issue[j] / TRAINING_FACTOR for j in range(p)) * m  # one thread issues every forward
        seconds = max(seconds, host)
    return Prediction(seconds, _memory(c, layers, starts, stops, m, b, batch))


def _simulate(queues: dict[str, list[tuple[str, int, int]]], run: Callable[[str, int, int], float], copy: list[float],
              p: int, m: int, schedule: str) -> float:
    """Run every device's queue in order, each task as soon as its device is free and its inputs are there."""
    end: dict[tuple[str, int, int], float] = {}
    free = {d: 0.0 for d in queues}
    heads = {d: 0 for d in queues}
    total = sum(len(q) for q in queues.values())
    while len(end) < total:
        progressed = False
        for d, q in queues.items():
            while heads[d] < len(q):
                kind, i, j = q[heads[d]]
                needs = _needs(kind, i, j, p, m, schedule)
                if not all(n in end for n in needs):
                    break
                ready = 0.0
                for n in needs:
                    ready = max(ready, end[n] + (copy[max(n[2], j)] if n[2] != j else 0.0))
                start = max(free[d], ready)
                end[(kind, i, j)] = free[d] = start + run(kind, i, j)
                heads[d] += 1
                progressed = True
        if not progressed:  # a queue order that deadlocks: cannot happen for the orders tasks_order makes
            raise RuntimeError("the simulated schedule deadlocks")
    return max(end.values()) if end else 0.0


def _needs(kind: str, i: int, j: int, p: int, m: int, schedule: str) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", i, j - 1)] if j > 0 else []
    if j < p - 1:
        return [("B", i, j + 1), ("F", i, j)]
    if schedule == "gpipe":  # the loss needs every micro-batch's output
        return [("F", k, p - 1) for k in range(m)]
    return [("F", i, j)]


def _memory(c: Candidate, layers: LayerModel, starts: list[int], stops: list[int], m: int, b: float,
            batch: int) -> int:
    """Peak bytes on the fullest device: parameters and their gradients, plus the activations the
    schedule keeps (every micro-batch's without checkpointing under GPipe; at most ``p - j`` under 1F1B;
    with checkpointing, every micro-batch's stage input plus one micro-batch's activations, twice while
    it is recomputed)."""
    per_device: dict[str, float] = {}
    p = len(c.balance)
    for j, (a, z) in enumerate(zip(starts, stops)):
        state = 2.0 * sum(layers.state_bytes[a:z])
        saved = math.fsum(layers.saved_per_sample[a:z]) * b
        held = m if c.schedule == "gpipe" else min(m, p - j)
        stash = layers.cut_per_sample[a] * b if a > 0 else 0.0
        if c.checkpoint == "never":
            acts = saved * held
        elif c.checkpoint == "except_last":
            acts = stash * max(held - 1, 0) + 2 * saved
        else:
            acts = stash * held + saved
        per_device[c.devices[j]] = per_device.get(c.devices[j], 0.0) + state + acts
    return int(max(per_device.values()))
