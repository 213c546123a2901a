"""predict: a pipeline step's time and peak memory from per-layer costs, calibrated overheads and its schedule.

The model, per candidate (partitions on devices, ``m`` micro-batches of ``b`` samples):

* a layer's forward+backward seconds at micro-batch ``b`` come from its times profiled at the micro-batch
  sizes the candidates run (``batch / m``), exact at those sizes and a straight line between two of them
  (beyond the smallest and the largest, the line through the nearest two: ``a + s * b``, ``a`` what does
  not shrink with the batch, e.g. small kernels). A GPU is not linear in the batch: a convolution of 64
  samples took 11% longer than the line through 16 and 256 predicts (ResNeXt-50 on an H200), so a line
  through two sizes alone under-predicted every pipeline of small micro-batches. Forward is a third of
  it, backward two thirds (``TRAINING_FACTOR``), and a checkpointed micro-batch's backward runs its
  forward again;
* every (micro-batch, partition) task costs the executor ``task_s`` of host time, and on CUDA without
  graphs every layer call costs the host the seconds the profile took to issue it (``host_s``; else the
  calibrated ``launch_s``). One thread issues the work: ``pipe.step`` every action in turn, ``pipe(x)``
  every forward in turn and then autograd's thread per device its backwards, so a step takes at least
  that long (an eager pipeline of many small layers can be bound by it: docs/design/cost-model.md);
* a value crossing a cut between two devices costs ``copy_latency_s + bytes / copy_bytes_per_s`` each way;
* a split backward (zero-bubble schedules) is B, the input gradients, ``1 - weight_share`` of it, and W,
  the weight gradients, ``weight_share`` of it, plus what splitting costs the executor beyond one
  backward (``split_backward - 1`` of it, measured: eager W walks the graph from the outputs again;
  ``split_replayed - 1`` under captured graphs, whose W starts from the gradients B kept), W a task of
  its own; the first partition has no input gradient to send: its B is empty and its W the
  whole backward;
* the actions of the candidate's :class:`~seqify.schedule.actions.Schedule` (GPipe, 1F1B, interleaved,
  ZB-H1) run on their device in the schedule's order as soon as what they need is done: the fill-drain
  bubble, ``(m + p - 1) / m`` for GPipe, and the smaller ones of the looped, 1F1B and zero-bubble
  schedules come from simulating the schedule with these costs, not from a formula (``pipe(x)`` with
  ``loss.backward()`` runs GPipe in clock-cycle order without graphs, and its loss waits for every
  micro-batch). Partitions on CPU devices share the host: nothing overlaps, so their step is the sum of
  their work;
* peak memory per pipeline device is :func:`seqify.pipe.memory.predict` on the schedule: parameters
  and gradients (once with graphs too: ``.grad`` views the programs' own sums) plus the most activations (or,
  checkpointed, stage inputs) the schedule keeps in flight, and under a split backward what each B keeps
  for its W (``kept_per_sample``: each weighted layer's output bytes, the shape of the gradient W starts
  from).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from seqify.partition.cost import TRAINING_FACTOR
from seqify.pipe.memory import PartitionMemory
from seqify.pipe.memory import predict as plan_memory
from seqify.schedule.actions import Action, Schedule, ahead, clock_cycles, make, needs

__all__ = ["LayerModel", "Calibration", "Candidate", "Prediction", "predict", "schedule_of", "device_orders",
           "WEIGHT_SHARE"]

#: the share of a backward that is weight gradients (W) when a zero-bubble schedule splits it: B and W
#: about equal, as for a matmul, whose input and weight gradients are one matmul each
WEIGHT_SHARE = 0.5


@dataclass(frozen=True)
class LayerModel:
    """Per layer: forward+backward seconds at micro-batch ``b``, ``fixed_s + per_sample_s * b`` (a line), or
    where ``sizes`` holds profiled batch sizes and ``times`` each size's per-layer seconds, those times,
    a straight line between two sizes and the line through the nearest two beyond them; saved and output
    bytes per sample; parameter and buffer bytes; the bytes crossing the cut before each layer per sample
    (the carried value plus live skips; ``cut_bytes[0]`` is the input)."""

    fixed_s: tuple[float, ...]
    per_sample_s: tuple[float, ...]
    saved_per_sample: tuple[float, ...]
    state_bytes: tuple[int, ...]
    cut_per_sample: tuple[float, ...]
    sizes: tuple[int, ...] = ()
    times: tuple[tuple[float, ...], ...] = ()
    host_s: tuple[float, ...] = ()  # on CUDA: the host's seconds to issue each layer's forward+backward
    kept_per_sample: tuple[float, ...] = ()  # bytes per sample a split backward's B keeps for W (see predict)

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

    @classmethod
    def through(cls, points: Sequence[tuple[int, Sequence[float]]], saved: Sequence[int], state: Sequence[int],
                cut: Sequence[int], batch: int, host: Sequence[float] = ()) -> LayerModel:
        """Each layer's times profiled at several batch sizes, ``points = [(size, times), ...]``, kept as
        they are (the line of :meth:`fit` through the smallest and largest); bytes measured at ``batch``;
        ``host``: each layer's host seconds to issue it (empty where not measured)."""
        by_size = {int(b): tuple(float(t) for t in times) for b, times in points}
        sizes = tuple(sorted(by_size))
        line = cls.fit((sizes[0], by_size[sizes[0]]), (sizes[-1], by_size[sizes[-1]]), saved, state, cut, batch)
        line = replace(line, host_s=tuple(float(h) for h in host))
        if len(sizes) < 3:
            return line
        return replace(line, sizes=sizes, times=tuple(by_size[b] for b in sizes))

    def __len__(self) -> int:
        return len(self.fixed_s)

    def issue_seconds(self, start: int, stop: int, cal: Calibration, graphs: bool) -> float:
        """The host's seconds to issue layers ``start..stop-1`` once (forward and backward): nothing
        per layer when replayed as captured graphs; else the profiled seconds where the profile has
        them (CUDA), or the calibrated launch cost per layer call."""
        if graphs:
            return 0.0
        if self.host_s and not cal.host_serial:
            return math.fsum(self.host_s[start:stop])
        return (stop - start) * cal.launch_s

    def scaled(self, factor: float) -> LayerModel:
        """Every layer's time times ``factor`` (bytes unchanged)."""
        return replace(self, fixed_s=tuple(v * factor for v in self.fixed_s),
                       per_sample_s=tuple(v * factor for v in self.per_sample_s),
                       times=tuple(tuple(v * factor for v in t) for t in self.times))

    def host_scaled(self, factor: float) -> LayerModel:
        """Every layer's host issue time times ``factor`` (GPU times and bytes unchanged)."""
        return replace(self, host_s=tuple(v * factor for v in self.host_s))

    def seconds(self, start: int, stop: int, batch: float) -> float:
        """Forward+backward seconds of layers ``start..stop-1`` at micro-batch ``batch``."""
        if not self.sizes:
            return math.fsum(self.fixed_s[start:stop]) + batch * math.fsum(self.per_sample_s[start:stop])
        k = 0  # the segment: sizes[k] .. sizes[k + 1], the first or last one beyond the profiled range
        while k < len(self.sizes) - 2 and batch > self.sizes[k + 1]:
            k += 1
        (b0, b1), (t0, t1) = self.sizes[k:k + 2], self.times[k:k + 2]
        y0, y1 = math.fsum(t0[start:stop]), math.fsum(t1[start:stop])
        slope = (y1 - y0) / (b1 - b0)
        if not b0 <= batch <= b1:
            slope = max(slope, 0.0)  # beyond the profiled sizes: more samples never take less time
        return max(y0 + slope * (batch - b0), 0.0)


@dataclass(frozen=True)
class Calibration:
    """Measured overheads of the executor and the devices: see the module docstring. ``host_serial``:
    every partition runs on the host (CPU devices), so no two tasks overlap. ``split_backward``: the
    seconds of a backward split into input and weight gradients over those of one whole backward
    (1.0: splitting is free); ``split_replayed``: the same for captured graphs, which split at the
    boundary where weights join the inputs' path (GPU work only: replay issues no per-op host work)."""

    task_s: float
    launch_s: float
    copy_latency_s: float
    copy_bytes_per_s: float
    host_serial: bool
    split_backward: float = 1.0
    split_replayed: float = 1.0


@dataclass(frozen=True)
class Candidate:
    """One configuration: layers per partition, the device of each partition, micro-batches, checkpointing,
    CUDA graphs, schedule (one of :data:`~seqify.schedule.actions.SCHEDULES`) and the schedule's
    placement (each partition's pipeline device number; by default partitions whose device names are
    equal share a number)."""

    balance: tuple[int, ...]
    devices: tuple[str, ...]
    chunks: int
    checkpoint: str
    graphs: bool = False
    schedule: str = "gpipe"
    placement: tuple[int, ...] | None = None
    overlap: bool = False  # two lanes per GPU: memory as they hold it (one more micro-batch); time not modelled

    def slots(self) -> tuple[int, ...]:
        """Each partition's pipeline device number."""
        if self.placement is not None:
            return self.placement
        first: dict[str, int] = {}
        return tuple(first.setdefault(d, len(first)) for d in self.devices)


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per training step, peak bytes on the fullest device and on each pipeline device."""

    seconds: float
    memory_bytes: int
    per_device: tuple[int, ...] = ()


@lru_cache(maxsize=256)
def schedule_of(name: str, placement: tuple[int, ...], m: int) -> Schedule:
    """The schedule ``name`` for this placement and micro-batch count (built once; raises
    :class:`~seqify.ScheduleError` where the schedule does not apply, e.g. 1F1B with loops)."""
    return make(name, placement, m)


def device_orders(c: Candidate, m: int) -> list[list[Action]]:
    """Per pipeline device, the actions in the order the executor runs them: the schedule's, except
    ``gpipe`` without graphs, which ``pipe(x)`` runs in clock cycles (partition ``j`` takes micro-batch
    ``i`` at cycle ``i + j``) and autograd backward in the reverse order."""
    placement = c.slots()
    if c.schedule == "gpipe" and not c.graphs:
        out: list[list[Action]] = [[] for _ in range(max(placement) + 1)]
        forwards = [(i, j) for cycle in clock_cycles(m, len(placement)) for i, j in cycle]
        for kind, order in (("F", forwards), ("B", forwards[::-1])):
            for i, j in order:
                out[placement[j]].append(Action(placement[j], j, i, kind))  # type: ignore[arg-type]
        return out
    return schedule_of(c.schedule, placement, m).per_device()


def predict(c: Candidate, layers: LayerModel, cal: Calibration, batch: int, *,
            weight_share: float = WEIGHT_SHARE, replicas: int = 1) -> Prediction:
    """The step time and peak memory of candidate ``c`` for a mini-batch of ``batch`` samples
    (``weight_share``: the share of a split backward that is weight gradients); with ``replicas``, of that
    many copies of it, each on a share of ``batch`` (see :func:`_replicated`)."""
    if replicas > 1:
        return _replicated(c, layers, cal, batch, replicas, weight_share)
    m = max(1, min(c.chunks, batch))
    b = batch / m
    starts = [sum(c.balance[:j]) for j in range(len(c.balance))]
    stops = [s + n for s, n in zip(starts, c.balance)]
    p = len(c.balance)
    placement = c.slots()
    built = schedule_of(c.schedule, placement, m)
    split = built.split
    stop_ckpt = {"always": m, "except_last": m - 1, "never": 0}[c.checkpoint]
    compute = [layers.seconds(a, z, b) for a, z in zip(starts, stops)]
    fwd = [t / TRAINING_FACTOR for t in compute]
    bwd = [t - f for t, f in zip(compute, fwd)]
    issue = [cal.task_s + layers.issue_seconds(a, z, cal, c.graphs) for a, z in zip(starts, stops)]
    copy = [0.0] + [
        cal.copy_latency_s + layers.cut_per_sample[starts[j]] * b / cal.copy_bytes_per_s
        if c.devices[j] != c.devices[j - 1] else 0.0
        for j in range(1, p)
    ]

    def combine(own: float, host: float) -> float:
        return own + host if cal.host_serial else max(own, host)

    def duration(kind: str, i: int, j: int) -> float:
        if kind == "F":
            return combine(fwd[j], issue[j] / TRAINING_FACTOR)
        host = issue[j] * (1 - 1 / TRAINING_FACTOR)
        recompute = fwd[j] if i < stop_ckpt else 0.0
        if not split:
            if kind == "W":  # an unsplit schedule has no W: its B is the whole backward
                return 0.0
            return combine(bwd[j] + recompute, host)
        if kind == "B":  # input gradients only; the first partition has none to send
            return 0.0 if j == 0 else combine(bwd[j] * (1 - weight_share) + recompute, host)
        extra = (cal.split_replayed if c.graphs else cal.split_backward) - 1.0
        whole = bwd[j] if j == 0 else bwd[j] * (weight_share + max(extra, 0.0))
        return combine(whole, cal.task_s + (host if j == 0 else 0.0))

    orders = device_orders(c, m)
    if cal.host_serial:
        seconds = math.fsum(duration(a.kind, a.microbatch, a.partition) for q in orders for a in q)
        seconds += math.fsum(2 * copy[j] * m for j in range(p))
    else:
        seconds = _simulate(orders, duration, copy, p, m, c.schedule == "gpipe")
        seconds = max(seconds, _host_seconds(c, issue, m, placement))
    parts = [PartitionMemory(params=sum(layers.state_bytes[a:z]), grads=sum(layers.state_bytes[a:z]),
                             activations=int(math.fsum(layers.saved_per_sample[a:z]) * b),
                             inputs=int(layers.cut_per_sample[a] * b) if a > 0 else 0,
                             kept=int(math.fsum(layers.kept_per_sample[a:z]) * b) if a > 0 else 0)
             for a, z in zip(starts, stops)]
    held = ahead(built) if c.overlap and c.graphs else built  # two lanes issue each forward a run earlier
    per_device = plan_memory(parts, held, c.checkpoint).per_device
    return Prediction(seconds, max(per_device), per_device)


def _replicated(c: Candidate, layers: LayerModel, cal: Calibration, batch: int, replicas: int,
                weight_share: float) -> Prediction:
    """``replicas`` copies of ``c``, each on its share of ``batch`` (the largest share times them). One host
    thread issues them in turn, so replica ``r`` starts ``r`` times one replica's issue time late. Gradients are
    reduced over the replicas after the last backward: with graphs partition by partition as each one's backward
    ends (:mod:`seqify.pipe.partition_sums`), leaving only the first partition's, which ends last, after it;
    eagerly all of the first device's. The first device's parameters are copied to the others before the step:
    with graphs partition by partition, each before its first forward (:mod:`seqify.pipe.partition_copies`),
    leaving only the first partition's in front; eagerly all of them (the other devices' overlap the first's
    forward). Each costs ``copy_latency_s + bytes / copy_bytes_per_s``.
    Memory per device is one replica's."""
    share = -(-batch // replicas)
    one = predict(c, layers, cal, share, weight_share=weight_share)
    m = max(1, min(c.chunks, share))
    starts = [sum(c.balance[:j]) for j in range(len(c.balance))]
    issue = [cal.task_s + layers.issue_seconds(a, a + n, cal, c.graphs) for a, n in zip(starts, c.balance)]
    slots = c.slots()
    host = _host_seconds(c, issue, m, slots)
    first = sum(sum(layers.state_bytes[a:a + n]) for a, n, d in zip(starts, c.balance, slots) if d == slots[0])
    # with graphs only the first partition's sum comes after the last backward, and its copy before the first forward
    edge = sum(layers.state_bytes[:c.balance[0]]) if c.graphs else first
    reduce = 2 * cal.copy_latency_s + 2 * edge / cal.copy_bytes_per_s
    if cal.host_serial:  # devices that share the host run the replicas one after another
        return replace(one, seconds=replicas * one.seconds + reduce)
    return replace(one, seconds=(replicas - 1) * host + one.seconds + reduce)


def _host_seconds(c: Candidate, issue: list[float], m: int, placement: tuple[int, ...]) -> float:
    """The least time one host thread needs to issue the step: ``pipe.step`` (every schedule but
    eager GPipe) issues each action from the caller's thread in turn, forwards and backwards alike;
    ``pipe(x)`` with ``loss.backward()`` issues the forwards in turn, then autograd's thread per device
    issues that device's backwards beside the others'."""
    if c.schedule != "gpipe" or c.graphs:
        return math.fsum(issue) * m
    forwards = math.fsum(issue) / TRAINING_FACTOR * m
    backwards = [0.0] * (max(placement) + 1)
    for j, d in enumerate(placement):
        backwards[d] += issue[j] * (1 - 1 / TRAINING_FACTOR) * m
    return forwards + max(backwards)


def _simulate(orders: list[list[Action]], run: Callable[[str, int, int], float], copy: list[float], p: int,
              m: int, whole_loss: bool) -> float:
    """Run every device's actions in order, each as soon as its device is free and what it needs is done
    (plus the copy across a cut between devices). ``whole_loss``: the last partition's backwards wait
    for every micro-batch's forward (``pipe(x)`` then one loss over the mini-batch)."""
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    heads = [0] * len(orders)
    total = sum(len(q) for q in orders)
    while len(end) < total:
        progressed = False
        for d, q in enumerate(orders):
            while heads[d] < len(q):
                a = q[heads[d]]
                kind, i, j = a.kind, a.microbatch, a.partition
                waits = [(k, mb, part) for part, mb, k in needs(j, i, kind, p)]
                if whole_loss and kind == "B" and j == p - 1:
                    waits += [("F", k, j) for k in range(m)]
                if not all(w in end for w in waits):
                    break
                ready = 0.0
                for w in waits:
                    ready = max(ready, end[w] + (copy[max(w[2], j)] if w[2] != j else 0.0))
                start = max(free[d], ready)
                end[(kind, i, j)] = free[d] = start + run(kind, i, j)
                heads[d] += 1
                progressed = True
        if not progressed:  # an order that deadlocks: schedules are checked, so this cannot happen
            raise RuntimeError("the simulated schedule deadlocks")
    return max(end.values()) if end else 0.0
