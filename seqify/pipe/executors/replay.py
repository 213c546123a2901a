"""Replay: a training step as fixed per-(partition, micro-batch) programs, issued in order without autograd."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import nn

from seqify.errors import BoundaryError, GraphError
from seqify.model.stash_sizes import size_skips
from seqify.pipe.executors.buffers import Buffers, places
from seqify.pipe.executors.casts import Casts, find, lowered
from seqify.pipe.executors.lanes import Lanes
from seqify.pipe.microbatch import is_tensors
from seqify.pipe.recompute import RngState, checkpointed, draws_random, norms_of, recomputed, rng_state
from seqify.pipe.split_backward import Later, input_grads, weight_values
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import Transfer
from seqify.schedule.actions import Schedule, ahead, gpipe
from seqify.skip.namespace import SkipKey

__all__ = ["Program", "Replay", "Unreplayable", "build", "order", "run", "slots"]


#: Whether micro-batches share boundary buffers where the schedule lets them (see :mod:`.buffers`);
#: False gives every micro-batch its own (for measuring what sharing saves).
SHARE_BUFFERS = True


class Unreplayable(Exception):
    """A partition takes or returns something other than tensors: the step cannot be fixed programs."""


class _Flat(nn.Module):
    """A stage as a function of flat tensors: (carried..., popped...) -> (carried..., stashed...).

    Skips that are sizes (``sized``: made from shapes alone, e.g. a batch size) are not tensors: they are
    kept as this micro-batch's constants, ``kept`` for those it stashes and ``given`` for those it pops,
    fixed like everything else in a program built for one input shape."""

    def __init__(self, stage: Stage, carried: int | None, sized: frozenset[SkipKey] = frozenset(),
                 checkpoint: Callable[..., Any] | None = None) -> None:
        super().__init__()
        # checkpoint: runs fresh() keeping no activations (recomputed inside the backward program)
        self.checkpoint = checkpoint
        self.layers = stage.layers
        object.__setattr__(self, "stage", stage)
        self.carried = carried  # None: one tensor; k: a tuple of k tensors
        self.returns: int | None = None  # the same, for the carried output
        self.sized = sized
        self.given: dict[SkipKey, Any] = {}
        self.kept: dict[SkipKey, Any] = {}
        # A split backward (zero bubble's B and W) recomputes a checkpointed forward itself, in B, so that
        # W walks the same graph (see recompute); the random draws it must repeat, taken per forward.
        self.split = False
        self.rng: RngState | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.checkpoint is not None and self.split:
            self.rng = rng_state(*tensors) if draws_random(self.layers) else None  # eager only (see _checkpoint)
        return self._run(tensors, self.checkpoint)

    def recompute(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A checkpointed forward once more, with a graph that lives as long as its outputs (B and W of a
        split backward both walk it; torch's checkpoint would recompute again for W)."""
        again = functools.partial(recomputed, norms=norms_of(self.layers), rng=self.rng)
        return self._run(tensors, again)

    def _run(self, tensors: tuple[torch.Tensor, ...], wrap: Callable[..., Any] | None) -> tuple[torch.Tensor, ...]:
        stage = self.stage
        k = 1 if self.carried is None else self.carried
        x: Any = tensors[0] if self.carried is None else tuple(tensors[:k])
        popped = dict(zip([key for key in stage.pops if key not in self.given], tensors[k:]))
        # fresh(): copies of what a layer modifies in place (a program's inputs are leaves autograd guards)
        skips = {**popped, **self.given}
        y, out = wrap(stage.fresh, x, skips) if wrap else stage.fresh(x, skips)
        kept = {key: out[key] for key in stage.stashes if not isinstance(out[key], torch.Tensor)}
        if not is_tensors(y):
            raise Unreplayable(f"partition {stage.index} returns {type(y).__name__}; only tensors and tuples of "
                               "tensors replay")
        if any(key not in self.sized for key in kept):  # runs per micro-batch: find the culprit only on error
            key = next(key for key in kept if key not in self.sized)
            raise Unreplayable(f"partition {stage.index} stashes skip {key[1]!r}, a {type(out[key]).__name__} that is "
                               "not a tensor nor a size; only tensors and tuples of tensors replay")
        self.kept = kept
        ys = (y,) if isinstance(y, torch.Tensor) else tuple(y)
        self.returns = None if isinstance(y, torch.Tensor) else len(ys)
        return ys + tuple(out[key] for key in stage.stashes if key not in kept)


def _with_casts(method: Callable[..., None]) -> Callable[..., None]:
    """Run a program part with the partition's once-per-step weight casts in the weights' slots."""

    @functools.wraps(method)
    def run(self: Program) -> None:
        if self.casts is None:
            return method(self)
        with self.casts.swapped():
            return method(self)

    return run


class Program:
    """One partition on one micro-batch, on fixed tensors: ``forward()`` reads ``inputs`` and writes
    ``outputs``; ``backward()`` reads ``out_grads`` and writes ``in_grads``, adding the parameters'
    gradients into the partition's accumulators. The driver only ever copies into ``inputs`` and
    ``out_grads``; run eagerly (any device) or replayed from captured CUDA graphs, it behaves the same.

    ``split`` (zero-bubble schedules): ``backward()`` is B, the inputs' gradients only, keeping the
    autograd graph and the gradients at the boundary where the weights' sub-graphs meet the inputs'
    path; ``weights()`` is W, the parameters' gradients from there added into the accumulators, after
    which the graph is released. Each is its own CUDA graph when captured."""

    def __init__(self, flat: _Flat, inputs: tuple[torch.Tensor, ...], params: list[nn.Parameter],
                 acc: list[torch.Tensor], split: bool = False, casts: Casts | None = None) -> None:
        self.flat = flat
        self.split = flat.split = split
        self.inputs = inputs
        self.params = params
        self.acc = acc
        # Under autocast, the weights read only through its cast are read from casts made once per step
        # (:mod:`.casts`); the gradients are taken for those casts and added into the float32 sums.
        self.casts = casts
        self.wrt: list[torch.Tensor] = casts.wrt(params) if casts is not None else list(params)
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.out_grads: list[torch.Tensor | None] = []
        self.in_grads: list[torch.Tensor | None] = [None] * len(inputs)
        # (forward, backward (B when split), weights (W; split only)), once captured
        self.graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph | None, torch.cuda.CUDAGraph | None] | None = None
        # What B keeps for W (split only): the outputs it differentiated, their gradients, what W owes
        # (None: W is the whole weights' backward). Set and used while running eagerly or capturing,
        # never on a replay.
        self.kept: tuple[list[torch.Tensor], list[torch.Tensor], Later | None] | None = None
        self.touched = [False] * len(params)  # which parameters some backward reached (the others keep .grad)
        self.grad = bool(params) or any(t.requires_grad for t in inputs)  # False: an inference program

    def _wrt_inputs(self) -> list[int]:
        """The input slots to differentiate by: those needing a gradient, once per tensor."""
        first = {id(t): k for k, t in reversed(list(enumerate(self.inputs)))}
        return [k for k, t in enumerate(self.inputs) if t.requires_grad and first[id(t)] == k]

    def _add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add the parameters' gradients into ``acc`` (None: none reached that parameter)."""
        for k, g in enumerate(grads):
            self.touched[k] = self.touched[k] or g is not None
        used = [(a, g) for a, g in zip(self.acc, grads) if g is not None]
        if used:
            torch._foreach_add_([a for a, _ in used], [g for _, g in used])

    @_with_casts
    def _grads(self) -> None:
        """Differentiate outputs by inputs and parameters; add the parameters' part into ``acc``."""
        wrt_inputs = self._wrt_inputs()
        outs = [(o, g) for o, g in zip(self.outputs, self.out_grads) if g is not None]
        if not outs or not (wrt_inputs or self.params):
            return
        grads = torch.autograd.grad(
            [o for o, _ in outs], [self.inputs[k] for k in wrt_inputs] + self.wrt, [g for _, g in outs],
            allow_unused=True,
        )
        for k, g in zip(wrt_inputs, grads):
            self.in_grads[k] = g
        self._add(grads[len(wrt_inputs):])

    def _differentiated(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs a gradient flows back to, and those gradients; a checkpointed program's outputs
        recomputed, with a graph of their own."""
        outputs = self.flat.recompute(*self.inputs) if self.flat.checkpoint is not None else self.outputs
        outs = [(o, g) for o, g in zip(outputs, self.out_grads) if g is not None]
        return [o for o, _ in outs], [g for _, g in outs]

    @_with_casts
    def _grads_input(self) -> None:
        """B of a split backward: the inputs' gradients only (:func:`~seqify.pipe.split_backward.input_grads`),
        keeping the graph and the boundary gradients for :meth:`_grads_weight`. A checkpointed program
        recomputes its forward here, into a graph W walks again rather than recomputing twice. Where no
        input needs a gradient (the first partition) B does nothing and W is the whole backward."""
        self.kept = None
        wrt_inputs = self._wrt_inputs()
        if not wrt_inputs or all(g is None for g in self.out_grads):
            return
        outs, grads = self._differentiated()
        found, now, later = input_grads(outs, grads, [self.inputs[k] for k in wrt_inputs], self.wrt)
        for k, g in zip(wrt_inputs, found):
            self.in_grads[k] = g
        self._add(now)  # the normalisations' weights, whose gradients B yields anyway
        self.kept = (outs, grads, later)

    @_with_casts
    def _grads_weight(self) -> None:
        """W of a split backward: the parameters' gradients from what B kept, added into ``acc`` (never
        ``.grad``: a captured W must write only fixed tensors); then the graph is released."""
        kept, self.kept = self.kept, None
        flows = any(g is not None for g in self.out_grads)
        if kept is None and flows and self.params and not self._wrt_inputs():  # B left everything to W
            outs, grads = self._differentiated()
            kept = (outs, grads, None)
        if kept is None or not kept[0]:
            return
        outs, grads, later = kept
        if self.params:
            self._add(weight_values(outs, grads, self.wrt, later, retain_graph=False))
        del outs, grads, later, kept
        # The graph's last owner goes (same memory); requires_grad stays: a replayed step's loss and the
        # next partition's inputs read it to know what gets a gradient.
        self.outputs = tuple(o.detach().requires_grad_(o.requires_grad) for o in self.outputs)

    @_with_casts
    def _outputs(self) -> None:
        with torch.set_grad_enabled(self.grad):
            self.outputs = self.flat(*self.inputs)
        if not self.out_grads:  # fixed buffers, zero where nothing flows back
            self.out_grads = [
                torch.zeros_like(o) if o.requires_grad else None for o in self.outputs
            ]

    def forward(self) -> None:
        if self.graphs is None:
            self._outputs()
        else:
            self.graphs[0].replay()

    def backward(self) -> None:
        """The backward, or B of a split one."""
        if self.graphs is None:
            self._grads_input() if self.split else self._grads()
        elif self.graphs[1] is not None:
            self.graphs[1].replay()

    def weights(self) -> None:
        """W of a split backward (nothing when unsplit: the backward did it)."""
        if self.graphs is None:
            if self.split:
                self._grads_weight()
        elif self.graphs[2] is not None:
            self.graphs[2].replay()

    def backward_whole(self) -> None:
        """The whole backward, eagerly: B then W when split."""
        if self.split:
            self._grads_input()
            self._grads_weight()
        else:
            self._grads()


def _buffers(modules: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every buffer with a copy: building runs the partitions, which may update running statistics or
    counters, and must leave them as it found them."""
    return [(b, b.clone()) for part in modules for b in part.buffers()]


def _warm(programs: list[Program], device: torch.device, warmup: int, stream: torch.cuda.Stream) -> None:
    """Run each program forward and backward ``warmup`` times outside capture (cuDNN/cuBLAS choose
    kernels and workspaces), leaving its input gradients (which inputs a gradient reaches) and its
    outputs' values from the last run; the accumulators are zeroed after."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for p in programs:
            for _ in range(warmup):
                p._outputs()
                p.backward_whole()
        if programs and programs[0].acc:
            torch._foreach_zero_(programs[0].acc)


def _capture_in_order(order: Sequence[tuple[str, Program]], device: torch.device, stream: torch.cuda.Stream,
                      lanes: bool = False) -> None:
    """Capture ``order``'s programs (("F" | "B" | "W", program), everything one device runs, in the
    order it runs it: one partition's programs or several partitions') as CUDA graphs sharing one
    memory pool, so memory is reused as eager execution would reuse it: a backward (a split one's W)
    frees what its forward kept, and a forward captured after it takes that memory again, whichever
    partition it belongs to; what a split B keeps for its W (the graph's activations, the boundary
    gradients) stays allocated until W is captured. Replaying in any other order would overwrite
    activations still needed, so a step must issue this device's programs in exactly this order.

    With ``lanes`` the backwards (B, W) take their memory from a pool of their own: a forward then only
    reuses memory some backward captured before it freed (so it must run after that backward, and may
    run beside the later ones), and a backward never reuses a forward's (see :class:`Lanes`)."""
    pools = {"F": torch.cuda.graph_pool_handle()}
    pools["B"] = pools["W"] = torch.cuda.graph_pool_handle() if lanes else pools["F"]

    def captured(part: Callable[[], None], kind: str) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools[kind], stream=stream):
            part()
        return graph

    with torch.cuda.device(device), torch.cuda.stream(stream):
        forwards: dict[int, torch.cuda.CUDAGraph] = {}
        backwards: dict[int, torch.cuda.CUDAGraph | None] = {}
        for kind, p in order:
            key = id(p)
            flows = any(g is not None for g in p.out_grads)
            if kind == "W" and not p.split:  # an unsplit program's W is part of its B
                continue
            if kind == "F":
                forwards[key] = captured(p._outputs, kind)
            elif kind == "B" and not p.split:
                p.graphs = (forwards[key], captured(p._grads, kind) if flows else None, None)
            elif kind == "B" and flows and p._wrt_inputs():
                backwards[key] = captured(p._grads_input, kind)
            elif kind == "B":  # nothing to compute (no input needs a gradient): no empty graph
                p._grads_input()
                backwards[key] = None
            elif flows and p.params:
                p.graphs = (forwards[key], backwards.pop(key), captured(p._grads_weight, kind))
            else:  # no weights: W only lets B's graph go (no empty graph)
                p._grads_weight()
                p.graphs = (forwards[key], backwards.pop(key), None)


def _drains(order: Sequence[tuple[str, int]]) -> bool:
    """Whether every forward in ``order`` comes before every backward (B or W)."""
    backward = [k != "F" for k, _ in order]
    return backward == sorted(backward)


def _partition_order(schedule: Schedule, j: int) -> list[tuple[str, int]]:
    """Partition ``j``'s forwards, backwards and (split schedules) weight-gradient steps in the order
    ``schedule`` issues them."""
    return [(a.kind, a.microbatch) for a in schedule.actions if a.partition == j]


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


class Replay:
    """Drives a step's programs: copies values between partitions (on copy streams between GPUs,
    ordered by events, never a host sync), replays forwards in the forward order and backwards in
    the backward order, and hands parameter gradients over as ``.grad`` once the backward is done."""

    def __init__(self, stages: Sequence[Stage], programs: list[list[Program]], routes: list[list[Route]],
                 returns: int | None, transfer: Transfer, schedule: Schedule | None = None) -> None:
        self.stages = stages
        self.programs = programs  # [partition][micro-batch]
        self.routes = routes  # [partition][input slot] -> (partition, output slot)
        self.returns = returns  # the last partition's carried output: None (a tensor) or k (a tuple)
        self.devices = [s.device for s in stages]
        m = len(programs[0])
        self.consumers: list[list[list[tuple[int, int]]]] = [
            [[] for _ in programs[j][0].outputs] for j in range(len(stages))
        ]
        for j, slots in enumerate(routes):
            for s, (a, o) in enumerate(slots):
                self.consumers[a][o].append((j, s))
        sources = [sorted({a for a, _ in slots}) for slots in routes]
        users = [sorted({b for outs in self.consumers[j] for b, _ in outs}) for j in range(len(stages))]
        if schedule is not None and (schedule.partitions != len(stages) or schedule.microbatches != m):
            raise GraphError(f"schedule {schedule.name!r} is for {schedule.partitions} partitions and "
                             f"{schedule.microbatches} micro-batches, not {len(stages)} and {m}")
        self.schedule = schedule or gpipe(slots(self.devices), m)
        self.forward_order = order(self.devices, m, lambda i, j: [(i, a) for a in sources[j]], False, self.schedule)
        self.backward_order = order(self.devices, m, lambda i, j: [(i, b) for b in users[j]], True, self.schedule)
        self.cuda = all(d.type == "cuda" for d in self.devices)
        self.transfer = transfer  # its copy streams, one per device
        self._events: dict[tuple[int, int, bool], torch.cuda.Event] = {}
        self.step = 0
        # pipe(x) + loss.backward() replays every forward before any backward: only programs captured in
        # such an order (fill-drain on every device) may run that way (see _capture_in_order), and unsplit (its
        # backward has no W steps to issue).
        self.drains = not self.schedule.split and all(
            _drains([(kind, i) for kind, _, i in order]) for order in self.device_orders().values())
        self.acc: list[list[torch.Tensor]] = [programs[j][0].acc for j in range(len(stages))]
        # Buffers several micro-batches write in turn (see buffers.places): a micro-batch's last backward
        # action frees them (an event per buffer), and a copy from another GPU into one waits for it.
        self.shared: set[int] = set()
        self.last = {(a.partition, a.microbatch): a.kind for a in self.schedule.actions}
        self._freed: dict[int, torch.cuda.Event] = {}
        # Per partition, the parameters some backward reaches and their sums (set once the first
        # backward has run: the others keep .grad as autograd would leave it).
        self.handoff: list[tuple[list[nn.Parameter], list[torch.Tensor]]] = []
        # The step's node in the caller's autograd graph needs an input that requires grad, even when
        # the pipeline's inputs do not (the parameters reach .grad without autograd seeing them).
        self.anchor = torch.empty(0, device=self.devices[-1], requires_grad=True)
        # Per partition, its weights cast once per step under autocast (None: none, or autocast is off)
        self.casts: list[Casts | None] = [None] * len(stages)
        # Forwards and backwards on streams of their own per GPU (train only; None: one stream per GPU)
        self.lanes: Lanes | None = None

    def device_orders(self) -> dict[torch.device, list[tuple[str, int, int]]]:
        """Each device's (kind, partition, micro-batch) actions in the order a step issues them there:
        the schedule's actions of the partitions on that device (the order their graphs are captured in)."""
        out: dict[torch.device, list[tuple[str, int, int]]] = {d: [] for d in self.devices}
        for a in self.schedule.actions:
            out[self.devices[a.partition]].append((a.kind, a.partition, a.microbatch))
        return out

    # -- plumbing ---------------------------------------------------------------------------------
    def _event(self, i: int, j: int, backward: bool) -> torch.cuda.Event:
        e = self._events.get((i, j, backward))
        if e is None:
            e = self._events[(i, j, backward)] = torch.cuda.Event()
        return e

    def _fence(self) -> None:
        """Copies into fixed buffers must not overtake what still reads them from the last step."""
        if self.cuda:
            for d in set(self.devices):
                self.transfer.stream(d).wait_stream(torch.cuda.current_stream(d))

    def _pull(self, pairs: list[tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]], device: torch.device,
              backward: bool) -> None:
        """Copy each source, made by program (i, j), into its buffer on ``device``. Between GPUs the copy
        runs on the source GPU's copy stream once the program's event has passed (torch runs a peer copy
        on the source's current stream), so neither GPU's compute stream carries it."""
        done: set[int] = set()
        remote = False
        for dst, src, (i, j) in pairs:
            if id(dst) in done:  # one buffer behind two slots
                continue
            done.add(id(dst))
            if src is None:
                dst.zero_()
            elif self.devices[j] == device:  # the compute stream, after the program that made it
                dst.copy_(src)
            else:
                leave = self.transfer.stream(self.devices[j])
                leave.wait_event(self._event(i, j, backward))
                freed = self._freed.get(id(dst))
                if freed is not None:  # an earlier micro-batch's backward on ``device`` is done with it
                    leave.wait_event(freed)
                with torch.cuda.stream(leave), torch.cuda.stream(self.transfer.stream(device)):
                    dst.copy_(src, non_blocking=True)
                remote = True
        if remote:
            torch.cuda.current_stream(device).wait_stream(self.transfer.stream(device))

    def _run(self, i: int, j: int, backward: bool) -> None:
        program = self.programs[j][i]
        device = self.devices[j]
        if self.cuda:
            with torch.cuda.device(device):
                program.backward() if backward else program.forward()
                self._event(i, j, backward).record(torch.cuda.current_stream(device))
        else:
            program.backward() if backward else program.forward()

    def _feed(self, i: int, j: int, batch: tuple[torch.Tensor, ...]) -> None:
        """Fill program (i, j)'s input buffers: the micro-batch itself, or what earlier partitions made."""
        program = self.programs[j][i]
        if j == 0:
            for dst, src in zip(program.inputs, batch):
                dst.copy_(src)
        else:
            pairs = [(dst, self.programs[a][i].outputs[o], (i, a)) for dst, (a, o) in zip(program.inputs, self.routes[j])]
            self._pull(pairs, self.devices[j], backward=False)

    def _feed_grads(self, i: int, j: int) -> None:
        """Fill program (i, j)'s output-gradient buffers from its consumers' input gradients."""
        program = self.programs[j][i]
        pairs = []
        for o, buf in enumerate(program.out_grads):
            if buf is None:
                continue
            (b, s), = self.consumers[j][o]
            pairs.append((buf, self.programs[b][i].in_grads[s], (i, b)))
        self._pull(pairs, self.devices[j], backward=True)

    def _free(self, i: int, j: int, kind: str) -> None:
        """After program (i, j)'s ``kind`` action: if it was its last, its shared buffers are free."""
        if not self.cuda or not self.shared or self.last[(j, i)] != kind:
            return
        program = self.programs[j][i]
        stream = torch.cuda.current_stream(self.devices[j])
        for t in [*program.inputs, *program.out_grads]:
            if t is not None and id(t) in self.shared:
                event = self._freed.get(id(t))
                if event is None:
                    event = self._freed[id(t)] = torch.cuda.Event()
                event.record(stream)

    def _cast(self) -> None:
        """Cast the weights the programs read through casts as they are now (the optimizer moved them)."""
        for j, c in enumerate(self.casts):
            if c is not None:
                with _on(self.devices[j]):
                    c.refresh()

    def _zero(self) -> None:
        for j, acc in enumerate(self.acc):
            if acc:
                with _on(self.devices[j]):
                    torch._foreach_zero_(acc)

    def _hand(self) -> None:
        for j, (params, acc) in enumerate(self.handoff):
            with _on(self.devices[j]):
                _hand_over(params, acc)

    def _outputs_of(self, i: int) -> tuple[torch.Tensor, ...]:
        program = self.programs[-1][i]
        return program.outputs[:1 if self.returns is None else self.returns]

    # -- a step -----------------------------------------------------------------------------------
    def forward(self, batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """Run every forward program; return the last partition's carried outputs, concatenated."""
        if not self.drains:
            raise GraphError(f"these programs were captured for schedule {self.schedule.name!r}, which interleaves "
                             "forwards and backwards; pipe(x) replays fill-drain programs only")
        self.step += 1
        self._fence()
        self._cast()
        with torch.no_grad():
            for i, j in self.forward_order:
                self._feed(i, j, batches[i])
                self._run(i, j, backward=False)
            k = 1 if self.returns is None else self.returns
            return tuple(torch.cat([self._outputs_of(i)[s] for i in range(len(batches))]) for s in range(k))

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor | None, ...]]:
        """Run every backward program from the gradients of the concatenated outputs; set ``.grad``;
        return the gradients of each micro-batch's inputs."""
        self._fence()
        with torch.no_grad():
            self._zero()
            last = self.programs[-1]
            sizes = [p.outputs[0].size(0) for p in last]
            split = [g.split(sizes) if g is not None else None for g in grads]
            n = len(self.stages)
            for i, j in self.backward_order:
                program = self.programs[j][i]
                if j == n - 1:
                    for s, parts in enumerate(split):
                        buf = program.out_grads[s]
                        if buf is not None:
                            buf.copy_(parts[i]) if parts is not None else buf.zero_()
                else:
                    self._feed_grads(i, j)
                self._run(i, j, backward=True)
            self._hand()
            return [tuple(g.clone() if g is not None else None for g in p.in_grads) for p in self.programs[0]]

    def train(self, batches: list[tuple[torch.Tensor, ...]], targets: list[Any],
              loss: Callable[[Any, int], torch.Tensor]) -> torch.Tensor:
        """One training step in the schedule's own order (1F1B, interleaved, zero-bubble): each forward,
        the micro-batch's loss as soon as the last partition has made its output (``loss(output, i)``, a
        scalar already weighed, computed eagerly), each backward; ``.grad`` is set at the end. A split
        schedule's B computes the input gradients only and its W the weight gradients, each its own
        program part (its own CUDA graph when captured). Returns the summed loss, detached."""
        self.step += 1
        self._fence()
        self._cast()
        n, total, lanes = len(self.stages), None, self.lanes
        with torch.no_grad():
            self._zero()
            if lanes is not None:
                lanes.open()
            for a in self.schedule.actions:
                i, j = a.microbatch, a.partition
                made = self._event(i, j, False) if a.kind == "B" and lanes is not None else None
                with lanes.enter(self.devices[j], a.kind, made) if lanes is not None else nullcontext():
                    if a.kind == "F":
                        self._feed(i, j, batches[i])
                        self._run(i, j, backward=False)
                        if j == n - 1:
                            value = self._seed_loss(i, loss)
                            total = value if total is None else total + value
                            if lanes is not None:  # its backward, on the other lane, reads the loss's gradient
                                self._event(i, j, False).record(torch.cuda.current_stream(self.devices[j]))
                    elif a.kind == "B":
                        if j < n - 1:
                            self._feed_grads(i, j)
                        self._run(i, j, backward=True)
                    elif a.kind == "W":
                        with _on(self.devices[j]):
                            self.programs[j][i].weights()
                    self._free(i, j, a.kind)
            if lanes is not None:
                lanes.close()
            self._hand()
        assert total is not None
        return total

    def _seed_loss(self, i: int, loss: Callable[[Any, int], torch.Tensor]) -> torch.Tensor:
        """Micro-batch ``i``'s loss from the last partition's outputs, and its gradient into that
        program's output-gradient buffers (where the backward program reads them)."""
        program = self.programs[-1][i]
        outs = self._outputs_of(i)
        with torch.enable_grad():
            leaves = [o.detach().requires_grad_(o.requires_grad) for o in outs]
            value = loss(leaves[0] if self.returns is None else tuple(leaves), i)
            wanted = [(s, t) for s, t in enumerate(leaves) if t.requires_grad and program.out_grads[s] is not None]
            got = torch.autograd.grad(value, [t for _, t in wanted], allow_unused=True) if wanted else ()
        for (s, _), g in zip(wanted, got):
            program.out_grads[s].copy_(g) if g is not None else program.out_grads[s].zero_()  # type: ignore[union-attr]
        return value.detach()


def _on(device: torch.device) -> Any:
    """``torch.cuda.device(device)`` for a CUDA device, nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _hand_over(params: list[nn.Parameter], acc: list[torch.Tensor]) -> None:
    """What autograd would leave in ``.grad``: a new tensor where there was none, else the sum (for the
    parameters a backward reached; autograd leaves the others alone too)."""
    fresh = [(p, a) for p, a in zip(params, acc) if p.grad is None]
    added = [(p, a) for p, a in zip(params, acc) if p.grad is not None]
    if fresh:
        for (p, _), g in zip(fresh, torch._foreach_mul([a for _, a in fresh], 1.0)):
            p.grad = g
    if added:
        torch._foreach_add_([p.grad for p, _ in added], [a for _, a in added])  # type: ignore[misc]


class _Step(torch.autograd.Function):
    """The whole pipeline step as one autograd node: its backward drives the backward programs."""

    @staticmethod
    def forward(ctx: Any, replay: Replay, m: int, anchor: torch.Tensor, *flat: torch.Tensor) -> Any:  # type: ignore[override]
        per = len(flat) // m
        outs = replay.forward([tuple(flat[i * per:(i + 1) * per]) for i in range(m)])
        ctx.replay, ctx.step, ctx.m, ctx.per = replay, replay.step, m, per
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        replay: Replay = ctx.replay
        if replay.step != ctx.step:
            raise GraphError(
                "this output's backward comes after a newer forward of the same pipeline: graphs=True keeps one "
                "step's activations in fixed memory, so call backward on a step's output before the next "
                "forward (or use graphs=False)"
            )
        ins = replay.backward(grads)
        return (None, None, None, *[g for per in ins for g in per])


def run(replay: Replay, batches: list[tuple[torch.Tensor, ...]]) -> Any:
    """The pipeline's output for these micro-batches, differentiable through the replayed step."""
    flat = [t for b in batches for t in b]
    outs = _Step.apply(replay, len(batches), replay.anchor, *flat)
    return outs[0] if replay.returns is None else tuple(outs)


def _reach(replay: Replay, streams: dict[torch.device, torch.cuda.Stream] | None, warmup: int) -> None:
    """Run each partition's backward once, last partition first, and learn which outputs a gradient
    reaches: an output whose consumer gets no gradient for it (autograd's unused input) gets no
    gradient buffer, so parameters that only feed it keep ``.grad`` as autograd would (None), not zeros.
    With ``streams``, then capture each device's programs as CUDA graphs, in one memory pool per device
    and in the order the schedule runs them there (its partitions interleaved as the schedule interleaves
    them), so partitions sharing a GPU reuse each other's freed memory as eager execution would."""
    programs = replay.programs
    for j in reversed(range(len(programs))):
        row = programs[j]
        for i, p in enumerate(row):
            for o, consumers in enumerate(replay.consumers[j]):
                if consumers and p.out_grads[o] is not None:
                    (b, s), = consumers
                    if programs[b][i].in_grads[s] is None:
                        p.out_grads[o] = None
        if streams is None:
            for p in row:
                if any(id(t) in replay.shared for t in p.inputs):  # a later micro-batch took its inputs
                    p._outputs()
                p.backward_whole()
                p.outputs = tuple(o.detach() for o in p.outputs)  # the build pass's graph is done with
        else:
            device = replay.devices[j]
            _warm(row, device, warmup, streams[device])
    if streams is not None:
        for row in programs:
            for p in row:
                p.outputs, p.in_grads = (), [None] * len(p.inputs)
        for device, order in replay.device_orders().items():
            _capture_in_order([(kind, programs[j][i]) for kind, j, i in order], device, streams[device],
                              lanes=replay.lanes is not None)
    for acc in replay.acc:
        if acc:
            torch._foreach_zero_(acc)
    for row in programs:
        reached = [any(p.touched[k] for p in row) for k in range(len(row[0].params))]
        replay.handoff.append(([w for w, r in zip(row[0].params, reached) if r],
                               [a for a, r in zip(row[0].acc, reached) if r]))


def build(stages: Sequence[Stage], batches: list[tuple[torch.Tensor, ...]], carried: int | None,
          graphs: bool, transfer: Transfer, warmup: int = 2, schedule: Schedule | None = None,
          stop: int = 0, overlap: bool = False) -> Replay:
    """Programs for these micro-batches (shapes, dtypes, grad requirements), captured as CUDA graphs
    when ``graphs``. Building runs the step once eagerly on the real inputs (so what flows on is real
    data) and restores every buffer afterwards (running statistics, counters): it leaves no trace.
    ``overlap``: a training step's graphs replay on two lanes per GPU (:class:`~.lanes.Lanes`).

    With graphs everything here runs on a side stream per device: autograd remembers the stream each
    node ran on, and a captured backward must never reach back to a device's default stream."""
    if not graphs:
        return _build(stages, batches, carried, None, transfer, warmup, schedule, stop)
    streams = {d: torch.cuda.Stream(d) for d in dict.fromkeys(s.device for s in stages)}
    with ExitStack() as scope:
        for d, stream in streams.items():
            stream.wait_stream(torch.cuda.current_stream(d))
            scope.enter_context(torch.cuda.stream(stream))
        replay = _build(stages, batches, carried, streams, transfer, warmup, schedule, stop, overlap)
    for d, stream in streams.items():
        torch.cuda.current_stream(d).wait_stream(stream)
    return replay


def _checkpoint(stage: Stage, j: int, capturing: bool) -> Callable[..., Any]:
    """How partition ``j``'s checkpointed programs run: recomputed inside their backward program, with
    BatchNorm statistics updated once. A captured recomputation cannot restore the generator's state,
    so a partition that draws random numbers (dropout) is not captured checkpointed."""
    if capturing and draws_random(stage.layers):
        raise Unreplayable(f"partition {j} draws random numbers (dropout) and is checkpointed: a captured "
                           "recomputation would draw different ones; use checkpoint='never' with graphs=True")
    return functools.partial(checkpointed, norms=norms_of(stage.layers), preserve_rng=not capturing)


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


def _build(stages: Sequence[Stage], batches: list[tuple[torch.Tensor, ...]], carried: int | None,
           streams: dict[torch.device, torch.cuda.Stream] | None, transfer: Transfer, warmup: int,
           schedule: Schedule | None = None, stop: int = 0, overlap: bool = False) -> Replay:
    saved = _buffers([s.layers for s in stages])
    # Two lanes per GPU (training graphs): the schedule's forwards issued a run earlier, so that they may run
    # beside the backwards they used to follow. Only for graphs that draw no random numbers: a replay sets
    # the generator's offset for its graph on the stream it runs on, and two at once would read each other's.
    lanes = overlap and streams is not None and torch.is_grad_enabled() and not any(draws_random(s.layers) for s in stages)
    if lanes and schedule is not None:
        schedule = ahead(schedule)
    # Where some partition changes what it receives in place, a value must reach it as the one tensor
    # (or view of one tensor) it is in the source; fixed buffers are copies, so such steps run eagerly.
    mutating = any(st.mutates_input or st.mutated_skips for st in stages[1:])
    crossing: list[dict[int, tuple[int, int]]] = [{} for _ in batches]
    # Buffers shared by micro-batches need a schedule whose backwards free them, and values that reach a
    # partition unchanged (a partition changing its inputs in place would change a later one's too).
    share = SHARE_BUFFERS and schedule is not None and torch.is_grad_enabled() and not mutating
    shared: set[int] = set()
    # Zero bubble: B and W apart (captured as separate graphs when replaying them).
    split = schedule is not None and schedule.split and torch.is_grad_enabled()
    try:
        programs: list[list[Program]] = []
        routes: list[list[Route]] = []
        stashed: dict[SkipKey, tuple[int, int]] = {}
        constant: dict[SkipKey, int] = {}  # a size skip -> the partition whose programs keep its values
        sized = frozenset(size_skips(layer for stage in stages for layer in stage.layers))
        returns: int | None = carried
        for j, stage in enumerate(stages):
            device = stage.device
            # Under torch.no_grad() the programs are inference ones: forwards only, no gradient sums.
            params = [p for p in stage.layers.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
            acc = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
            if j == 0:
                slots: list[Route] = []
                sources: list[tuple[torch.Tensor, ...]] = [tuple(b) for b in batches]
            else:
                k = 1 if returns is None else returns
                slots = [(j - 1, o) for o in range(k)] + [stashed.pop(key) for key in stage.pops if key not in constant]
                sources = [tuple(programs[a][i].outputs[o] for a, o in slots) for i in range(len(batches))]
                if mutating:
                    for i, src in enumerate(sources):
                        _check_aliasing(crossing[i], src, j)
            routes.append(slots)
            row: list[Program] = []
            # Input and output-gradient buffers: one set per micro-batch the schedule keeps in flight on
            # this partition (1F1B: a few), not one per micro-batch; fill-drain and inference keep all.
            place = places(_partition_order(schedule, j)) if share else list(range(len(sources)))
            ins, outs = Buffers(device), Buffers(device)
            cast: Casts | None = None
            for i, src in enumerate(sources):
                # One tensor arriving through two slots (carried and popped, say) is one buffer, as it is
                # one tensor in the source: an in-place change through one name shows through the other.
                # A buffer needs a gradient exactly when the value it copies does (as in eager runs: an
                # in-place op on a value that needs none saves nothing for backward).
                unique = list({id(t): t for t in src}.values())
                made = dict(zip([id(t) for t in unique], ins.take(place[i], unique)))
                inputs = tuple(made[id(t)] for t in src)
                flat = _Flat(stage, returns, sized, _checkpoint(stage, j, streams is not None) if i < stop else None)
                flat.given = {key: programs[constant[key]][i].flat.kept[key] for key in stage.pops if key in constant}
                low = lowered(device) if i == 0 else None
                if low is not None:  # which weights autocast only casts: watched on one more forward
                    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                        cast = find(stage.layers, functools.partial(flat, *inputs), low)
                p = Program(flat, inputs, params, acc, split, cast)
                p._outputs()  # real values for the next partition (and the output structure)
                if streams is not None:
                    # Capturing runs every program again: keep only the values, so building holds one
                    # micro-batch's activations at a time, not every micro-batch's (nothing else here
                    # may hold an output of the forward: it would keep the whole graph alive).
                    p.outputs = tuple(o.detach().requires_grad_(o.requires_grad) for o in p.outputs)
                fixed = iter(outs.take(place[i], [o for o in p.outputs if o.requires_grad], copy=False))
                p.out_grads = [next(fixed) if o.requires_grad else None for o in p.outputs]
                row.append(p)
            shared |= ins.shared | outs.shared
            for key in stage.pops:
                constant.pop(key, None)
            returns = row[0].flat.returns
            k = 1 if returns is None else returns
            kept = row[0].flat.kept
            for s, key in enumerate([key for key in stage.stashes if key not in kept]):
                stashed[key] = (j, k + s)
            constant.update({key: j for key in kept})
            programs.append(row)
        if stashed or constant:
            left = sorted(k[1] for k in [*stashed, *constant])
            raise BoundaryError(f"skips {left} were stashed but no later partition popped them")
        replay = Replay(stages, programs, routes, returns, transfer, schedule)
        replay.shared = shared
        replay.casts = [row[0].casts for row in programs]
        if lanes:
            replay.lanes = Lanes(replay.devices)
        _reach(replay, streams, warmup)
        return replay
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
