"""measure: what a pipeline run did (forward/backward boxes per micro-batch and partition) and a chunks sweep.

Both work from outside the pipeline: :func:`record` swaps each of ``pipe.stages`` for a timing
subclass that shares its state, and registers autograd hooks on the values a stage takes and returns;
everything is put back when the ``with`` block ends.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.pipe.recompute import is_recomputing
from seqify.pipe.stage import Stage
from seqify.progress import progress

__all__ = ["Box", "Timeline", "record", "SweepPoint", "Sweep", "sweep", "train_step"]


@dataclass(frozen=True)
class Box:
    """Partition ``partition`` ran ``kind`` ('forward', 'backward' or 'recompute') of micro-batch
    ``micro_batch`` from ``start`` to ``end`` seconds after the recording began."""

    partition: int
    micro_batch: int
    kind: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The boxes of one recorded run; ``devices[j]`` is partition ``j``'s device.

    On CPU the clock is the host's; on CUDA, events on each device's stream (offsets from an event
    recorded on every device when the recording began), so boxes show when the GPU ran the work.
    A backward box runs from the first to the last autograd node the partition made for the
    micro-batch (its share of the graph, from its outputs back to its inputs), so it includes the
    recomputation of a checkpointed micro-batch, which happens inside it.
    """

    devices: list[str]
    chunks: int
    boxes: list[Box] = field(default_factory=list)
    seconds: float = 0.0
    label: str = ""

    @property
    def partitions(self) -> int:
        return len(self.devices)

    def of(self, kind: str) -> list[Box]:
        return [b for b in self.boxes if b.kind == kind]

    def busy(self, partition: int) -> float:
        """Seconds partition ``partition`` spent in forward or backward boxes."""
        return sum(b.seconds for b in self.boxes if b.partition == partition and b.kind != "recompute")

    def chrome_trace(self) -> dict[str, Any]:
        """The boxes as a Chrome trace (the JSON chrome://tracing and https://ui.perfetto.dev open): one
        complete event (``ph: "X"``, ``ts`` and ``dur`` in microseconds from the recording's start) per box,
        named ``forward mb3``, one thread (``tid``) per partition, named ``partition 1 (cuda:1)``."""
        label = self.label or "seqify pipeline"
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                         "args": {"name": label}}]
        for j, device in enumerate(self.devices):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": j,
                           "args": {"name": f"partition {j} ({device})"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": j, "args": {"sort_index": j}})
        for b in self.boxes:
            events.append({"name": f"{b.kind} mb{b.micro_batch}", "cat": b.kind, "ph": "X", "pid": 0,
                           "tid": b.partition, "ts": b.start * 1e6, "dur": b.seconds * 1e6,
                           "args": {"partition": b.partition, "micro_batch": b.micro_batch,
                                    "device": self.devices[b.partition]}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`chrome_trace` to ``path`` as JSON: open it in chrome://tracing or Perfetto."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def __str__(self) -> str:
        lines = [f"Timeline: {self.partitions} partitions, {self.chunks} micro-batches, {self.seconds * 1e3:.1f} ms"]
        for j, d in enumerate(self.devices):
            f = sum(b.seconds for b in self.boxes if b.partition == j and b.kind == "forward")
            bw = sum(b.seconds for b in self.boxes if b.partition == j and b.kind == "backward")
            lines.append(f"  partition {j} ({d}): forward {f * 1e3:.1f} ms, backward {bw * 1e3:.1f} ms")
        return "\n".join(lines)


class _Clock:
    """Marks on the host clock (CPU) or CUDA events (resolved once the work is done)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.refs: dict[torch.device, Any] = {}
        for d in self.cuda:
            torch.cuda.synchronize(d)
            self.refs[d] = self._event(d)
        self.t0 = time.perf_counter()

    @staticmethod
    def _event(device: torch.device) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def mark(self, device: torch.device) -> Any:
        if device.type == "cuda":
            return (device, self._event(device))
        return time.perf_counter() - self.t0

    def resolve(self, mark: Any) -> float:
        if isinstance(mark, tuple):
            device, event = mark
            return self.refs[device].elapsed_time(event) / 1e3
        return float(mark)

    def finish(self) -> float:
        for d in self.cuda:
            torch.cuda.synchronize(d)
        return time.perf_counter() - self.t0


def _grad_nodes(value: Any) -> list[Any]:
    return [t.grad_fn for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _stage_nodes(outputs: list[Any], stop: set[Any]) -> list[Any]:
    """Autograd nodes reachable from ``outputs`` without passing through ``stop``; parameters'
    gradient accumulators are left out (every micro-batch shares them)."""
    seen: set[Any] = set()
    todo = [n for n in outputs if n not in stop]
    found = []
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            continue
        found.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None and n not in stop and n not in seen)
    return found


class _TimedStage(Stage):
    """A pipeline stage that records its forward, recompute and backward boxes. Shares the original
    stage's state (its ``__dict__``), so it runs exactly what the original runs."""

    _clock: _Clock
    _marks: dict[tuple[int, str], Any]
    _calls: int
    _inside: bool
    _micro_batch_of: dict[int, int]

    def _timed(self, kind: str, i: int, run: Callable[..., Any], x: Any, skips: Any) -> Any:
        clock = self._clock
        track = kind == "forward" and torch.is_grad_enabled()
        self._inside = True
        start = clock.mark(self.device)
        try:
            y, out = run(self, x, skips)
        finally:  # torch's checkpoint ends a recomputation early by raising once it has what it needs
            self._marks[(i, kind)] = (start, clock.mark(self.device))
            self._inside = False
        if track:
            # This stage's share of the autograd graph for micro-batch i: from its outputs back to (not
            # into) the nodes that made its inputs. Its backward runs from the first of these nodes to
            # start until the last one finishes.
            for node in _stage_nodes(_grad_nodes((y, out)), set(_grad_nodes((x, skips)))):
                node.register_prehook(self._hook(i, "backward_start", first=True))
                node.register_hook(self._hook(i, "backward_end"))
        return y, out

    def _hook(self, i: int, what: str, first: bool = False) -> Callable[..., None]:
        """An autograd hook that marks the time ``what`` happens for micro-batch ``i`` (the first time
        only, with ``first``; else the last), changing no gradient."""
        key = (i, what)

        def hook(*grads: Any) -> None:
            if not (first and key in self._marks):
                self._marks[key] = self._clock.mark(self.device)

        return hook

    def __call__(self, x: Any, skips: Any) -> Any:
        if self._inside:
            return Stage.__call__(self, x, skips)
        i = self._calls
        self._calls += 1
        return self._timed("forward", i, Stage.__call__, x, skips)

    def fresh(self, x: Any, skips: Any) -> Any:
        if self._inside:
            return Stage.fresh(self, x, skips)
        if is_recomputing():
            i = self._micro_batch_of.get(id(x), -1)
            return self._timed("recompute", i, Stage.fresh, x, skips)
        i = self._calls
        self._calls += 1
        self._micro_batch_of[id(x)] = i
        return self._timed("forward", i, Stage.fresh, x, skips)


@contextmanager
def record(pipe: Any, label: str = "") -> Iterator[Timeline]:
    """Record what ``pipe`` (a :class:`seqify.Pipeline`) runs inside the ``with`` block.

    ::

        with seqify.measure.record(pipe) as timeline:
            loss = F.cross_entropy(pipe(x), y)
            loss.backward()
        print(timeline)                      # busy time per partition
        seqify.plot.plot_timeline(timeline, "timeline.png")

    Record one mini-batch, forward and backward, inside the block (work after it is not recorded):
    micro-batches are numbered by the order a partition receives them. Eager pipelines only
    (``graphs=True`` replays captured graphs, which run no Python per stage). The recording adds a
    Python hook call per autograd node, which slows very small layers a little.
    """
    if getattr(pipe, "graphs", False) and pipe.training and torch.is_grad_enabled():
        raise ValueError("record() times eager stages; build the pipeline with graphs=False to record a timeline")
    originals = list(pipe.stages)
    timeline = Timeline(devices=[str(s.device) for s in originals], chunks=pipe.chunks, label=label)
    clock = _Clock([s.device for s in originals])
    timed: list[_TimedStage] = []
    for stage in originals:
        t = _TimedStage.__new__(_TimedStage)
        t.__dict__.update(stage.__dict__)
        t._clock, t._marks, t._calls, t._inside, t._micro_batch_of = clock, {}, 0, False, {}
        timed.append(t)
    pipe.stages[:] = timed
    try:
        yield timeline
    finally:
        pipe.stages[:] = originals
        timeline.seconds = clock.finish()
        for t in timed:
            _boxes(t, clock, timeline)
        timeline.boxes.sort(key=lambda b: (b.start, b.partition))


def _boxes(t: _TimedStage, clock: _Clock, timeline: Timeline) -> None:
    marks = t._marks
    for (i, kind), mark in marks.items():
        if kind in ("forward", "recompute"):
            start, end = mark
            timeline.boxes.append(Box(t.index, i, kind, clock.resolve(start), clock.resolve(end)))
        elif kind == "backward_start" and (i, "backward_end") in marks:
            start, end = clock.resolve(mark), clock.resolve(marks[(i, "backward_end")])
            if end >= start:
                timeline.boxes.append(Box(t.index, i, "backward", start, end))


# -- chunks sweep ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """Training throughput of one configuration: ``chunks`` micro-batches (0: the model on one device,
    no pipeline), median seconds per step over ``steps`` timed steps."""

    chunks: int
    batch: int
    seconds: float
    steps: int

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.seconds


@dataclass
class Sweep:
    points: list[SweepPoint]
    devices: list[str]
    balance: list[int]
    label: str = ""
    baseline: SweepPoint | None = None
    graphs: bool = False

    def best(self) -> SweepPoint:
        return max(self.points, key=lambda p: p.samples_per_s)

    def __str__(self) -> str:
        how = ", CUDA graphs" if self.graphs else ""
        lines = [f"chunks sweep over {len(self.devices)} partitions {self.balance} on {', '.join(self.devices)}{how}:"]
        if self.baseline is not None:
            lines.append(f"  one device, no pipeline: {self.baseline.samples_per_s:8.2f} samples/s")
        for p in self.points:
            ratio = f", {p.samples_per_s / self.baseline.samples_per_s:.2f}x one device" if self.baseline else ""
            lines.append(
                f"  chunks {p.chunks:3d}: {p.samples_per_s:8.2f} samples/s ({p.seconds * 1e3:.0f} ms per step{ratio})"
            )
        return "\n".join(lines)


def _sync(devices: Sequence[torch.device]) -> None:
    for d in {torch.device(d) for d in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def train_step(model: nn.Module, x: Any, target: Any, loss_fn: Callable[..., torch.Tensor],
               optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """One training step: forward, loss, backward (and ``optimizer.step()`` when one is given)."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), target)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def _time(model: nn.Module, x: Any, target: Any, loss_fn: Callable[..., torch.Tensor], devices: Sequence[Any],
          steps: int, warm: int, optimizer: torch.optim.Optimizer | None,
          on_step: Callable[[int, float, float], None] | None) -> float:
    times = []
    for k in range(warm + steps):
        _sync(devices)
        start = time.perf_counter()
        loss = train_step(model, x, target, loss_fn, optimizer)
        _sync(devices)
        took = time.perf_counter() - start
        if k >= warm:
            times.append(took)
        if on_step is not None:
            on_step(k - warm, float(loss), took)
    if optimizer is None:
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def sweep(
    model: nn.Module,
    x: torch.Tensor,
    target: Any,
    *,
    devices: Sequence[Any],
    balance: Sequence[int],
    chunks: Sequence[int] = (1, 2, 4, 8),
    loss_fn: Callable[..., torch.Tensor] | None = None,
    steps: int = 2,
    warm: int = 1,
    checkpoint: str = "except_last",
    baseline: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[int, int, float, float], None] | None = None,
    show: bool = True,
    label: str = "",
    graphs: bool = False,
) -> Sweep:
    """Training throughput of ``model`` (a Sequential) pipelined over ``devices`` with ``balance``, for
    each number of micro-batches in ``chunks``; with ``baseline``, also the model alone on ``devices[0]``
    (reported as chunks 0). A step is forward, loss, backward and, if given, ``optimizer.step()`` (use
    one without per-parameter state, such as plain SGD, as parameters move between devices); without an
    optimizer nothing is trained. The median of ``steps`` timed steps after ``warm`` untimed ones.
    ``on_step(chunks, step, loss, seconds)`` is called after every step (warm-up steps count from
    ``-warm``). ``x`` and ``target`` are moved where they are needed. A progress bar shows on stderr (on
    a terminal, or with ``SEQIFY_PROGRESS=1``) if ``show``. ``graphs`` runs the pipelines with CUDA graphs
    (``checkpoint='never'``; the first warm-up step captures them).
    """
    from seqify.api import pipeline

    loss_fn = loss_fn or nn.functional.cross_entropy
    placed = [torch.device(d) for d in devices]
    was_training = model.training
    model.train()
    result = Sweep(points=[], devices=[str(d) for d in placed], balance=list(balance), label=label, graphs=graphs)
    runs = ([0] if baseline else []) + list(chunks)
    try:
        for c in progress(runs, len(runs), desc="chunks sweep", enabled=show):
            report = None if on_step is None else (lambda k, loss, took, c=c: on_step(c, k, loss, took))
            if c == 0:
                model.to(placed[0])
                sec = _time(model, x.to(placed[0]), _to(target, placed[0]), loss_fn, placed[:1], steps, warm,
                            optimizer, report)
                result.baseline = SweepPoint(0, x.shape[0], sec, steps)
                continue
            pipe = pipeline(model, devices=placed, balance=list(balance), chunks=c, checkpoint=checkpoint,
                                   graphs=graphs)
            pipe.train()
            sec = _time(pipe, x.to(placed[0]), _to(target, placed[-1]), loss_fn, placed, steps, warm, optimizer, report)
            result.points.append(SweepPoint(c, x.shape[0], sec, steps))
    finally:
        model.train(was_training)
    return result


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)
