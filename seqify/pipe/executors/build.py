"""Build: a step's programs made by running the step once eagerly, then reached and captured, into a whole Replay.

:func:`build` runs in named steps: :class:`_Builder` makes each partition's programs in turn (their input
buffers fed from the programs before, their skips routed), :func:`reach` learns which outputs a gradient
reaches and captures each device's programs (:mod:`.capture`), and the :class:`~.replay.Replay` is
constructed last, with everything it holds. Building restores every buffer it ran through.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from seqify.errors import BoundaryError
from seqify.model.stash_sizes import size_skips
from seqify.pipe.executors.buffers import Buffers, partition_order, places
from seqify.pipe.executors.capture import capture_in_order, saved_buffers, warm
from seqify.pipe.executors.casts import Casts, find, lowered
from seqify.pipe.executors.lanes import Lanes
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.executors.programs import Flat, Program, Unreplayable, accumulators, checkpointing, mark_writer
from seqify.pipe.executors.replay import Handoff, Replay
from seqify.pipe.executors.user_hooks import refusal, suspended
from seqify.pipe.executors.wiring import Route, Wiring
from seqify.pipe.recompute import draws_random
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import Transfer
from seqify.schedule.actions import Schedule, ahead
from seqify.skip.namespace import SkipKey

__all__ = ["build", "mark_first_writers", "reach"]

Streams = dict[torch.device, torch.cuda.Stream]


def mark_first_writers(programs: list[list[Program]], schedule: Schedule) -> None:
    """Per partition, the part that writes the sums in a step (:func:`~.programs.mark_writer`), in the schedule's
    order; a backward call after ``pipe(x)`` runs the same backwards in the same order."""
    for j, row in enumerate(programs):
        mark_writer(row, [(a.kind, a.microbatch) for a in schedule.actions if a.partition == j])


def reach(programs: list[list[Program]], wiring: Wiring, shared: frozenset[int], streams: Streams | None,
          warmup: int, lanes: bool, expandable: bool = True) -> Handoff:
    """Run each partition's backward once, last partition first, and learn which outputs a gradient
    reaches: an output whose consumer gets no gradient for it (autograd's unused input) gets no
    gradient buffer, so parameters that only feed it keep ``.grad`` as autograd would (None), not zeros.
    With ``streams``, then capture each device's programs as CUDA graphs, in one memory pool per device
    and in the order the schedule runs them there (its partitions interleaved as the schedule interleaves
    them), so partitions sharing a GPU reuse each other's freed memory as eager execution would (the pools in
    expandable segments with ``expandable``). Returns the handoff: per partition, the parameters some backward
    reached and their sums."""
    for j in reversed(range(len(programs))):
        row = programs[j]
        _unreached(programs, wiring, j)
        if streams is None:
            for p in row:
                if any(id(t) in shared for t in p.inputs):  # a later micro-batch took its inputs
                    p._outputs()
                with suspended(p.params):  # its gradients are thrown away: the step runs the hooks
                    p.backward_whole()
                p.outputs = tuple(o.detach() for o in p.outputs)  # the build pass's graph is done with
        else:
            device = wiring.devices[j]
            warm(row, device, warmup, streams[device])
    mark_first_writers(programs, wiring.schedule)
    if streams is not None:
        for row in programs:
            for p in row:
                p.outputs, p.in_grads = (), [None] * len(p.inputs)
        for device, acts in wiring.device_orders().items():
            capture_in_order([(kind, programs[j][i]) for kind, j, i in acts], device, streams[device], lanes=lanes,
                             expandable=expandable)
    for row in programs:
        if row[0].acc:
            torch._foreach_zero_(row[0].acc)
    handoff: Handoff = []
    for row in programs:
        reached = [any(p.touched[k] for p in row) for k in range(len(row[0].params))]
        handoff.append(([w for w, r in zip(row[0].params, reached) if r],
                        [a for a, r in zip(row[0].acc, reached) if r]))
    return handoff


def _unreached(programs: list[list[Program]], wiring: Wiring, j: int) -> None:
    """Drop partition ``j``'s output-gradient buffers whose consumer got no gradient for that input."""
    for i, p in enumerate(programs[j]):
        for o, consumers in enumerate(wiring.consumers[j]):
            if consumers and p.out_grads[o] is not None:
                (b, s), = consumers
                if programs[b][i].in_grads[s] is None:
                    p.out_grads[o] = None


def build(stages: Sequence[Stage], batches: list[tuple[torch.Tensor, ...]], carried: int | None,
          graphs: bool, transfer: Transfer, warmup: int = 2, schedule: Schedule | None = None,
          stop: int = 0, overlap: bool = False, options: ReplayOptions | None = None) -> Replay:
    """Programs for these micro-batches (shapes, dtypes, grad requirements), captured as CUDA graphs
    when ``graphs``. Building runs the step once eagerly on the real inputs (so what flows on is real
    data) and restores every buffer afterwards (running statistics, counters): it leaves no trace.
    ``overlap``: a training step's graphs replay on two lanes per GPU (:class:`~.lanes.Lanes`).

    With graphs everything here runs on a side stream per device: autograd remembers the stream each
    node ran on, and a captured backward must never reach back to a device's default stream. ``options``:
    buffer sharing and casting once (:class:`~.options.ReplayOptions`; default: both on)."""
    options = options or ReplayOptions()
    if not graphs:
        return _build(stages, batches, carried, None, transfer, warmup, schedule, stop, False, options)
    streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys(s.device for s in stages)}
    with ExitStack() as scope:
        for d, stream in streams.items():
            stream.wait_stream(torch.cuda.current_stream(d))
            scope.enter_context(torch.cuda.stream(stream))
        replay = _build(stages, batches, carried, streams, transfer, warmup, schedule, stop, overlap, options)
    for d, stream in streams.items():
        torch.cuda.current_stream(d).wait_stream(stream)
    return replay


def _check_aliasing(seen: dict[int, tuple[int, int]], values: Sequence[torch.Tensor], partition: int) -> None:
    """Refuse a micro-batch in which two different tensors sharing memory, or one tensor going to two
    partitions, cross into partitions (``seen``: storage -> (tensor id, partition))."""
    for t in values:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = (id(t), partition)
        elif seen[key] != (id(t), partition):
            raise Unreplayable(
                f"partition {partition} receives a tensor that shares memory with another value crossing "
                "partitions, and some partition changes its inputs in place"
            )


class _Builder:
    """Makes a step's programs partition by partition: each partition's input slots routed from the
    programs before it (carried outputs, then popped skips), its programs run once for real values."""

    def __init__(self, stages: Sequence[Stage], batches: list[tuple[torch.Tensor, ...]], carried: int | None,
                 capturing: bool, schedule: Schedule | None, stop: int, share_buffers: bool,
                 cast_once: bool, fuse_grads: bool = True) -> None:
        self.stages, self.batches, self.capturing, self.schedule, self.stop = stages, batches, capturing, schedule, stop
        self.cast_once, self.fuse_grads = cast_once, fuse_grads
        # Where some partition changes what it receives in place, a value must reach it as the one tensor
        # (or view of one tensor) it is in the source; fixed buffers are copies, so such steps run eagerly.
        self.mutating = any(st.mutates_input or st.mutated_skips for st in stages[1:])
        self.crossing: list[dict[int, tuple[int, int]]] = [{} for _ in batches]
        # Buffers shared by micro-batches need a schedule whose backwards free them, and values that reach a
        # partition unchanged (a partition changing its inputs in place would change a later one's too).
        self.share = share_buffers and schedule is not None and torch.is_grad_enabled() and not self.mutating
        self.shared: set[int] = set()
        # Zero bubble: B and W apart (captured as separate graphs when replaying them).
        self.split = schedule is not None and schedule.split and torch.is_grad_enabled()
        self.programs: list[list[Program]] = []
        self.routes: list[list[Route]] = []
        self.stashed: dict[SkipKey, tuple[int, int]] = {}
        self.constant: dict[SkipKey, int] = {}  # a size skip -> the partition whose programs keep its values
        self.sized = frozenset(size_skips(layer for stage in stages for layer in stage.layers))
        self.returns: int | None = carried

    def all(self) -> list[list[Program]]:
        """Every partition's programs; refuses skips no later partition pops."""
        for j, stage in enumerate(self.stages):
            self.programs.append(self._partition(j, stage))
        if self.stashed or self.constant:
            left = sorted(k[1] for k in [*self.stashed, *self.constant])
            raise BoundaryError(f"skips {left} were stashed but no later partition popped them")
        return self.programs

    def _sources(self, j: int, stage: Stage) -> list[tuple[torch.Tensor, ...]]:
        """What partition ``j``'s input slots read, per micro-batch (noting the route of each slot)."""
        if j == 0:
            self.routes.append([])
            return [tuple(b) for b in self.batches]
        k = 1 if self.returns is None else self.returns
        slots = [(j - 1, o) for o in range(k)]
        slots += [self.stashed.pop(key) for key in stage.pops if key not in self.constant]
        self.routes.append(slots)
        sources = [tuple(self.programs[a][i].outputs[o] for a, o in slots) for i in range(len(self.batches))]
        if self.mutating:
            for i, src in enumerate(sources):
                _check_aliasing(self.crossing[i], src, j)
        return sources

    def _partition(self, j: int, stage: Stage) -> list[Program]:
        device = stage.device
        # Under torch.no_grad() the programs are inference ones: forwards only, no gradient sums.
        params = [p for p in stage.layers.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
        refused = refusal(stage.layers, j, self.capturing, training=bool(params))
        if refused is not None:  # eager steps run the hook as autograd does
            raise Unreplayable(f"{refused[0]}; the step runs eagerly, where it runs once per micro-batch")
        acc = accumulators(params)
        sources = self._sources(j, stage)
        # Input and output-gradient buffers: one set per micro-batch the schedule keeps in flight on
        # this partition (1F1B: a few), not one per micro-batch; fill-drain and inference keep all.
        schedule = self.schedule if self.share else None
        place = places(partition_order(schedule, j)) if schedule is not None else list(range(len(sources)))
        ins, outs = Buffers(device), Buffers(device)
        row: list[Program] = []
        cast: Casts | None = None
        for i, src in enumerate(sources):
            flat, inputs = self._flat(j, stage, i, src, ins, place[i])
            low = lowered(device) if i == 0 and self.cast_once else None
            if low is not None:  # which weights autocast only casts: watched on one more forward
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    cast = find(stage.layers, functools.partial(flat, *inputs), low)
            p = Program(flat, inputs, params, acc, self.split, cast, fuse=self.fuse_grads)
            p._outputs()  # real values for the next partition (and the output structure)
            if self.capturing:
                # Capturing runs every program again: keep only the values, so building holds one
                # micro-batch's activations at a time, not every micro-batch's (nothing else here
                # may hold an output of the forward: it would keep the whole graph alive).
                p.outputs = tuple(o.detach().requires_grad_(o.requires_grad) for o in p.outputs)
            fixed = iter(outs.take(place[i], [o for o in p.outputs if o.requires_grad], copy=False))
            p.out_grads = [next(fixed) if o.requires_grad else None for o in p.outputs]
            row.append(p)
        self.shared |= ins.shared | outs.shared
        self._route_skips(j, stage, row[0].flat)
        return row

    def _flat(self, j: int, stage: Stage, i: int, src: tuple[torch.Tensor, ...], ins: Buffers,
              place: int) -> tuple[Flat, tuple[torch.Tensor, ...]]:
        """Program (i, j)'s flat view of its stage and its input buffers. One tensor arriving through two
        slots (carried and popped, say) is one buffer, as it is one tensor in the source: an in-place change
        through one name shows through the other. A buffer needs a gradient exactly when the value it copies
        does (as in eager runs: an in-place op on a value that needs none saves nothing for backward)."""
        unique = list({id(t): t for t in src}.values())
        made = dict(zip([id(t) for t in unique], ins.take(place, unique)))
        inputs = tuple(made[id(t)] for t in src)
        flat = Flat(stage, self.returns, self.sized, checkpointing(stage, j, self.capturing) if i < self.stop else None)
        flat.given = {key: self.programs[self.constant[key]][i].flat.kept[key]
                      for key in stage.pops if key in self.constant}
        return flat, inputs

    def _route_skips(self, j: int, stage: Stage, flat: Flat) -> None:
        """After partition ``j``: the skips it pops are taken, those it stashes wait for their reader (tensors
        as output slots, sizes as constants its programs keep)."""
        for key in stage.pops:
            self.constant.pop(key, None)
        self.returns = flat.returns
        k = 1 if self.returns is None else self.returns
        kept = flat.kept
        for s, key in enumerate([key for key in stage.stashes if key not in kept]):
            self.stashed[key] = (j, k + s)
        self.constant.update({key: j for key in kept})


def _build(stages: Sequence[Stage], batches: list[tuple[torch.Tensor, ...]], carried: int | None,
           streams: Streams | None, transfer: Transfer, warmup: int, schedule: Schedule | None, stop: int,
           overlap: bool, options: ReplayOptions) -> Replay:
    saved = saved_buffers([s.layers for s in stages])
    # Two lanes per GPU (training graphs): the schedule's forwards issued a run earlier, so that they may run
    # beside the backwards they used to follow. Only for graphs that draw no random numbers: a replay sets
    # the generator's offset for its graph on the stream it runs on, and two at once would read each other's.
    lanes = (overlap and streams is not None and torch.is_grad_enabled()
             and not any(draws_random(s.layers) for s in stages))
    if lanes and schedule is not None:
        schedule = ahead(schedule)
    try:
        made = _Builder(stages, batches, carried, streams is not None, schedule, stop, options.share_buffers,
                        options.cast_once, options.fuse_grads)
        programs = made.all()
        wiring = Wiring.of(stages, programs, made.routes, schedule)
        shared = frozenset(made.shared)
        lane = Lanes(wiring.devices) if lanes else None
        handoff = reach(programs, wiring, shared, streams, warmup, lane is not None, options.expandable_pools)
        return Replay(stages, programs, wiring, made.returns, transfer, handoff, shared,
                      [row[0].casts for row in programs], lane)
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
