"""This rank's partitions on each micro-batch as fixed programs, replayed from CUDA graphs on GPUs."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from seqify.distributed.eager import RankRun, hand_back
from seqify.distributed.link import ACTIVATION, GRAD, SKIP, SKIP_GRAD, Link, grads_for, leaves, like_grads
from seqify.distributed.rank import RankStage
from seqify.errors import GraphError
from seqify.pipe.executors.buffers import Buffers, partition_order, places
from seqify.pipe.executors.capture import capture_in_order, saved_buffers, warm
from seqify.pipe.executors.casts import Casts, find, lowered
from seqify.pipe.executors.grad_views import GradViews
from seqify.pipe.executors.layer_settings import named
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.executors.programs import (
    Flat,
    Program,
    Unreplayable,
    accumulators,
    checkpointing,
    flat_sums,
    mark_writer,
)
from seqify.pipe.executors.replayed import GraphWarning
from seqify.pipe.executors.user_hooks import built_for, refusal
from seqify.pipe.stage import Stage
from seqify.schedule.actions import Action, last_gradients
from seqify.schedule.interpreter import Hooks
from seqify.skip.namespace import SkipKey

__all__ = ["RankPrograms", "ProgramRun", "program_step"]

log = logging.getLogger("seqify.distributed")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


class RankPrograms:
    """One :class:`~seqify.pipe.executors.programs.Program` per micro-batch of one of this rank's partitions.

    The first step with given micro-batch sizes builds them and runs eagerly (autograd inside each
    program); on CUDA the programs are then captured as graphs and later steps only copy received
    values into their fixed inputs, replay, and send the fixed outputs: the sends and receives between
    ranks stay outside the graphs. On the CPU they keep running eagerly, the same computation.
    Micro-batches below ``stop`` are checkpointed: their forward keeps only its inputs and their
    backward recomputes it (:func:`~seqify.pipe.executors.programs.checkpointing`). Under a split schedule (zero
    bubble) each program's backward is B, the inputs' gradients only, and :meth:`weights` is W, the
    weights' gradients added later (``Program(split=True)``; their own graphs once captured). Skips that
    are sizes (``sized``: ints made from shapes, :func:`~seqify.model.stash_sizes.size_skips`) are no program
    inputs or outputs: each program keeps those it pops and stashes as constants of its micro-batch, as
    in-process replay does (``Flat.given`` and ``kept``). ``options``: buffer sharing and casting once
    (:class:`~seqify.pipe.executors.options.ReplayOptions`; default: both on)."""

    def __init__(self, runner: Stage, device: torch.device, graphs: bool, warmup: int = 2,
                 sized: frozenset[SkipKey] = frozenset(), options: ReplayOptions | None = None) -> None:
        self.runner = runner
        self.options = options or ReplayOptions()
        self.sized = sized  # the skips that are sizes: each program holds them as its micro-batch's constants
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.warmup = warmup
        self.params = [p for p in runner.layers.parameters() if p.requires_grad]
        # the gradient sums as views of one flat tensor per dtype: added over data-parallel replicas in place
        self.acc = accumulators(self.params)
        self.views = GradViews()  # the views of the sums handed out as .grad, released before the sums are written
        self.sizes: list[int] = []
        self.stop = 0
        self.split = False
        self.autocast: torch.dtype | None = None  # the autocast dtype the programs were built under (None: off)
        self.input_grads = False  # whether the programs differentiate their inputs on the first partition
        self.programs: list[Program | None] = []
        self.captured = False
        self.place: list[int] = []  # micro-batch -> its buffer set (see begin)
        self.ins, self.outs = Buffers(device), Buffers(device)
        # Under autocast, the weights read only through its cast, cast once per step (pipeline.casts);
        # which ones is watched on the first program's forward after (re)building
        self.casts: Casts | None = None
        self.watched = False
        self.marked = False  # the part writing the sums is marked (:func:`mark_writer`), once the programs are built
        self.layers = list(runner.layers.modules())
        self.settings = named(self.layers)  # their plain attributes (a dropout's p): captured as they were
        self.state: tuple[object, ...] = ()  # what the user may change that the programs were built for (built_for)

    def begin(self, sizes: list[int], stop: int = 0, split: bool = False,
              order: Sequence[tuple[str, int]] | None = None, autocast: torch.dtype | None = None,
              input_grads: bool = False) -> None:
        """Start a step of these micro-batch sizes, checkpointing micro-batches below ``stop``, with B and W
        apart when ``split``, under ``autocast`` (its dtype; None: off), the inputs differentiated where
        ``input_grads`` (the first partition, when the caller's inputs want a gradient): new shapes (or a new
        ``stop``, ``split``, autocast or ``input_grads``) build new programs. ``order`` (this partition's
        ('F' | 'B' | 'W', micro-batch) actions as the schedule issues them) sizes the input and output-gradient
        buffers to what it keeps in flight (:mod:`~seqify.pipe.executors.buffers`); without it every micro-batch
        has its own."""
        self.views.release()
        state = built_for(self.runner.layers.parameters(), self.layers, self.settings)
        if state != self.state:  # a parameter frozen, a mode, a hook or a setting changed: refused or built again
            self._check_trainable()
            self._check_hooks()
            self.state, self.sizes = state, []
        if (sizes != self.sizes or stop != self.stop or split != self.split or autocast != self.autocast
                or input_grads != self.input_grads):
            self.sizes, self.stop, self.split, self.autocast, self.captured = list(sizes), stop, split, autocast, False
            self.input_grads = input_grads
            self.programs = [None] * len(sizes)
            self.place = places(order) if order is not None and self.options.share_buffers else list(range(len(sizes)))
            self.ins, self.outs = Buffers(self.device), Buffers(self.device)
            self.casts, self.watched, self.marked = None, False, False
        elif self.casts is not None:  # the weights as the optimizer left them
            self.casts.refresh()
        built = [p for p in self.programs if p is not None]
        if order is not None and built and len(built) == len(self.programs) and not self.marked:
            mark_writer(built, order)
            self.marked = True
        if self.acc and not any(p.writes_sums for p in built):  # else the step's first backward writes them
            torch._foreach_zero_(self.acc)

    def _check_trainable(self) -> None:
        """Refuse a step after a parameter was frozen or unfrozen: the programs and their gradient sums (which
        replicas add together in place) are made for the parameters that wanted a gradient at the first step."""
        trainable = {id(p) for p in self.params}
        for name, p in self.runner.layers.named_parameters():
            if p.requires_grad != (id(p) in trainable):
                now = "wants a gradient" if p.requires_grad else "no longer wants a gradient"
                raise GraphError(
                    f"parameter {name!r} of partition {self.runner.index} {now} (requires_grad changed after the "
                    "first step): seqify.distributed(graphs=True) differentiates by the parameters that wanted one "
                    "when it was built. Set requires_grad before the first step and build the stage again to "
                    "change it, or use graphs=False")

    def _check_hooks(self) -> None:
        """Refuse a hook the programs would not run as an eager step does (a layer's, a parameter's
        post-accumulate-grad hook), and run the programs eagerly where only capturing would miss one (a
        parameter's gradient hook), as for a checkpointed partition that draws random numbers."""
        refused = refusal(self.runner.layers, self.runner.index, self.graphs, training=bool(self.params))
        if refused is None:
            return
        why, eager_runs_it = refused
        if not eager_runs_it:
            raise GraphError(f"{why}: seqify.distributed(graphs=True) cannot run it as an eager step does; use "
                             "graphs=False, where it runs once per micro-batch, or remove the hook")
        self.graphs = False
        log.warning("%s; its programs run eagerly instead", why)
        warnings.warn(f"seqify.distributed(graphs=True): {why}; its programs run eagerly instead", GraphWarning,
                      stacklevel=3)

    def _recompute(self, i: int) -> Callable[..., Any] | None:
        """How micro-batch ``i`` is checkpointed (None: it is not). A partition drawing random numbers
        cannot be captured checkpointed: its programs then stay eager (with a warning, once)."""
        if i >= self.stop:
            return None
        try:
            return checkpointing(self.runner, self.runner.index, self.graphs)
        except Unreplayable as e:
            self.graphs = False
            log.warning("partition %d: %s; its programs run eagerly instead", self.runner.index, e)
            warnings.warn(f"seqify.distributed(graphs=True): {e}; its programs run eagerly instead", GraphWarning,
                          stacklevel=2)
            return checkpointing(self.runner, self.runner.index, False)

    def forward(self, i: int, x: Any, skips: dict[SkipKey, Any], needs_grad: bool) -> tuple[Any, dict[SkipKey, Any]]:
        """Micro-batch ``i`` through the partition: the carried output and the stashed skips (fixed
        tensors, valid until this micro-batch's next forward)."""
        # as the stashing program keeps them: the sizes that are not tensors
        given = {k: skips[k] for k in self.runner.pops if k in self.sized and not isinstance(skips[k], torch.Tensor)}
        values = _tensors(x) + [skips[k] for k in self.runner.pops if k not in given]
        p = self.programs[i]
        if p is None:
            # one buffer per value (one tensor reaching two slots is two buffers, as before), shared with the
            # micro-batches the schedule never keeps in flight together with this one
            inputs = tuple(self.ins.take(self.place[i], values, grads=[needs_grad and t.is_floating_point()
                                                                       for t in values]))
            carried = None if isinstance(x, torch.Tensor) else len(x)
            flat = Flat(self.runner, carried, self.sized, checkpoint=self._recompute(i))
            flat.given = given
            if not self.watched:
                self.watched = True
                low = lowered(self.device) if self.options.cast_once else None
                if low is not None:  # one more forward, watched: random draws as if it had not run
                    with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                        self.casts = find(self.runner.layers, functools.partial(flat, *inputs), low)
            p = self.programs[i] = Program(flat, inputs, self.params, self.acc, self.split, self.casts,
                                               fuse=self.options.fuse_grads)
        else:
            if given != p.flat.given:
                raise GraphError(
                    f"partition {self.runner.index}, micro-batch {i}: its programs were built with sizes "
                    f"{_named(p.flat.given)} and now receive {_named(given)}: the input shapes changed. "
                    "seqify.distributed(graphs=True) keeps one set of shapes per micro-batch sizes; keep the other "
                    "dimensions (sequence length, image size) fixed, or use graphs=False")
            with torch.no_grad():
                for buf, v in zip(p.inputs, values):
                    if buf.shape != v.shape or buf.dtype != v.dtype:  # a copy would fail, or broadcast: wrong
                        raise GraphError(
                            f"partition {self.runner.index}, micro-batch {i}: its programs were built for inputs "
                            f"{_shapes(p.inputs)} and now receive {_shapes(values)}. seqify.distributed(graphs=True) "
                            "keeps one set of shapes per micro-batch sizes; keep the other dimensions (sequence "
                            "length, image size) fixed, or use graphs=False")
                    buf.copy_(v)
        fresh = not p.out_grads
        try:
            p.forward()
        except Unreplayable as e:
            raise GraphError(f"{e}: seqify.distributed(graphs=True) runs each partition as fixed programs on "
                             "tensors; move the cut so only tensors leave a partition, or use graphs=False") from e
        if fresh:  # the output-gradient buffers, shared as the inputs are
            fixed = iter(self.outs.take(self.place[i], [o for o in p.outputs if o.requires_grad], copy=False))
            p.out_grads = [next(fixed) if o.requires_grad else None for o in p.outputs]
        k = 1 if p.flat.returns is None else p.flat.returns
        y = p.outputs[0] if p.flat.returns is None else tuple(p.outputs[:k])
        tensors = [key for key in self.runner.stashes if key not in p.flat.kept]
        return y, {**dict(zip(tensors, p.outputs[k:])), **p.flat.kept}

    def backward(self, i: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Micro-batch ``i``'s backward (B when split) from the gradients of its outputs (carried, then
        stashed); the gradients of its inputs (carried, then popped); unsplit, the parameters' gradients
        add up inside."""
        p = self.programs[i]
        assert p is not None
        with torch.no_grad():
            for buf, g in zip(p.out_grads, grads):
                if buf is not None:
                    if g is None:
                        buf.zero_()
                    else:
                        buf.copy_(g)
        p.backward()
        return list(p.in_grads)

    def weights(self, i: int) -> None:
        """W of micro-batch ``i`` (split only): its weights' gradients added into the accumulators."""
        p = self.programs[i]
        assert p is not None
        p.weights()

    def sums(self) -> list[torch.Tensor]:
        """The gradient sums as they travel between replicas: their flat tensors, or each one where some is a
        tensor of its own."""
        return flat_sums(self.acc) or self.acc

    def finish(self, training: bool, summed: Callable[[], int] | None = None) -> None:
        """End of a step: hand the summed gradients to ``.grad`` as autograd would; over data-parallel replicas,
        ``summed()`` waits for the sums' all-reduce and returns the number of replicas, and the mean is handed
        over. Every replica's programs touch the same parameters."""
        programs = [p for p in self.programs if p is not None]
        if training and programs:
            touched = [any(p.touched[k] for p in programs) for k in range(len(self.params))]
            params = [w for w, t in zip(self.params, touched) if t]
            acc = [a for a, t in zip(self.acc, touched) if t]
            self.views.hand(params, acc, summed() if summed is not None else 1)

    def zero(self) -> None:
        """The sums zeroed for a step (or a capture, which runs the programs), once the views of them handed out as
        ``.grad`` are released."""
        self.views.release()
        if self.acc:
            torch._foreach_zero_(self.acc)

    def ready(self) -> bool:
        """Whether these programs are built (a training step ran them all) and wait to be captured."""
        return self.graphs and not self.captured and bool(self.programs) and all(p is not None for p in self.programs)


def capture(programs: dict[int, RankPrograms], order: Sequence[tuple[str, int, int]]) -> None:
    """Capture a rank's partitions' programs (``programs``: partition -> its programs, all on one GPU) as
    CUDA graphs after the step that built them: in one memory pool, in ``order`` (the rank's ('F' | 'B' |
    'W', partition, micro-batch) actions as its schedule issues them, partitions interleaved), so the
    rank's partitions reuse each other's freed memory as eager execution would (the in-process
    :func:`~seqify.pipe.executors.capture.capture_in_order`). On a side stream (a captured backward must not
    reach back to the default stream); running statistics and gradient sums are left as they were."""
    device = next(iter(programs.values())).device
    built = {j: [p for p in prog.programs if p is not None] for j, prog in programs.items()}
    saved = saved_buffers([prog.runner.layers for prog in programs.values()])  # warm-up runs the partitions
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    for j, row in built.items():  # the part writing each partition's sums, captured so
        mark_writer(row, [(kind, i) for kind, p, i in order if p == j])
        programs[j].marked = True
    for row in built.values():  # let the eager step's graphs go: their nodes belong to the default stream
        for p in row:
            p.outputs, p.kept = tuple(o.detach().requires_grad_(o.requires_grad) for o in p.outputs), None
    for prog in programs.values():  # the step just handed its sums over: the warm-up writes them
        prog.views.release()
    try:
        for j, prog in programs.items():
            warm(built[j], device, prog.warmup, stream)
        for row in built.values():
            for p in row:
                p.outputs, p.in_grads = (), [None] * len(p.inputs)
        expandable = all(prog.options.expandable_pools for prog in programs.values())
        capture_in_order([(kind, built[j][i]) for kind, j, i in order if j in programs], device, stream,
                         expandable=expandable)
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
        for prog in programs.values():
            prog.zero()
    for prog in programs.values():
        prog.captured = True


def _shapes(tensors: Sequence[torch.Tensor]) -> str:
    """Tensors' shapes and dtypes, for messages."""
    return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


def _named(sizes: dict[SkipKey, Any]) -> dict[str, Any]:
    """Size skips by their names, for messages."""
    return {key[1]: value for key, value in sizes.items()}


@dataclass
class _Fixed:
    """One (partition, micro-batch) between its forward and backward program."""

    x: list[torch.Tensor] = field(default_factory=list)  # the carried input as received
    given: list[torch.Tensor] = field(default_factory=list)  # first partition: the caller's inputs, to differentiate
    popped: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # route -> the popped skip as received
    y: Any = None  # the carried output (fixed tensors), or the micro-batch's weighted loss on the last partition
    out: list[torch.Tensor] = field(default_factory=list)  # last partition: the leaves the loss starts from
    stashed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # route -> the stashed skip's tensors


class ProgramRun(RankRun, Hooks):
    """A training step of ``stage``'s partitions as their fixed programs, in the rank's schedule order
    (the same actions :class:`~seqify.distributed.eager.RankRun` runs eagerly). Values between partitions of
    this rank are handed over directly (copied into the reader's program inputs), values across ranks
    cross the :class:`~seqify.distributed.link.Link`. Under a split schedule a program's backward is B, whose
    input gradients are sent on at once, and its W runs when the schedule says. Over data-parallel replicas
    each partition's gradient sums start their all-reduce as soon as its last B or W is issued (``lasts``),
    beside the backward of the rank's other partitions (``summing``: partition -> what waits for it)."""

    def __init__(self, stage: RankStage, link: Link, micro: list[Any], sizes: list[int],
                 loss: Callable[[Any, int], torch.Tensor] | None, stop: int, split: bool = False,
                 lasts: frozenset[int] = frozenset()) -> None:
        super().__init__(stage, link, micro, sizes, loss, stop, split)
        self.fixed: dict[tuple[int, int], _Fixed] = {}
        self.over = stage.over_replicas()
        self.lasts = lasts
        self.summing: dict[int, Callable[[], int]] = {}

    def after(self, action: Action) -> None:
        """Where ``action`` was its partition's last to add into the gradient sums: start their all-reduce."""
        if self.over is not None and id(action) in self.lasts:
            self.summing[action.partition] = self.over(self.s._programs[action.partition].sums())

    def forward(self, p: int, i: int) -> None:
        s, w = self.s, _Fixed()
        x = self.micro[i] if p == 0 else self._get((ACTIVATION, p - 1, i), p - 1)
        w.x = leaves(x) if p > 0 else []
        w.given = leaves(x) if p == 0 and self.input_grads else []
        skips: dict[Any, Any] = {}
        for r in s.routes:
            if r.dst == p:
                skips[s.skip_key(r)] = self._get((SKIP, r.index, i), r.src)
                w.popped[r.index] = leaves(skips[s.skip_key(r)])
        try:
            y, stashed = s._programs[p].forward(i, x, skips, needs_grad=p > 0 or self.input_grads)
        except GraphError as e:  # say which rank, too
            raise GraphError(f"{s.me}: {e}") from e
        self._send(p, i, y, stashed, w.stashed)
        if p == self.last:  # the loss on leaves: a program's outputs carry no autograd history
            assert self.loss is not None
            w.out = [t.detach().requires_grad_(t.is_floating_point()) for t in leaves(y)]
            y = self.loss(w.out[0] if isinstance(y, torch.Tensor) else tuple(w.out), i)
            self.losses.append(y.detach())
        w.y = y
        self.fixed[(p, i)] = w

    def backward(self, p: int, i: int) -> None:
        s, w = self.s, self.fixed.pop((p, i))
        if p == self.last:
            w.y.backward()
            grads: list[torch.Tensor | None] = [t.grad for t in w.out]
        else:
            grads = grads_for(leaves(w.y), self._get((GRAD, p, i), p + 1))
        for r in s.routes:
            if r.src == p and w.stashed[r.index]:  # a size skip: held by the programs, no gradient
                grads += grads_for(w.stashed[r.index], self._get((SKIP_GRAD, r.index, i), r.dst))
        in_grads = s._programs[p].backward(i, grads)
        if p > 0:
            self._put((GRAD, p - 1, i), like_grads(w.x, in_grads[:len(w.x)]), p - 1)
        elif w.given:  # copies: the programs' gradient outputs are written again by the next micro-batch
            hand_back(w.given, [g.clone() if g is not None else None for g in in_grads[:len(w.given)]])
        at = len(w.x)
        for r in s.routes:
            if r.dst == p and w.popped[r.index]:
                n = len(w.popped[r.index])
                self._put((SKIP_GRAD, r.index, i), like_grads(w.popped[r.index], in_grads[at:at + n]), r.src)
                at += n

    def weights(self, p: int, i: int) -> None:
        """W of (p, i): its program adds the weights' gradients from what its B kept."""
        self._split_only()
        self.s._programs[p].weights(i)


def program_step(stage: RankStage, link: Link, micro: list[Any], sizes: list[int],
                 loss: Callable[[Any, int], torch.Tensor] | None, stop: int = 0) -> list[torch.Tensor]:
    """One training step of ``stage``'s partitions as fixed programs, in its schedule's order, checkpointing
    micro-batches below ``stop``; the micro-batch losses on the rank holding the last partition."""
    plan = stage.plan(len(sizes))
    kind = stage.device.type
    on = torch.is_autocast_enabled(kind)
    dtype = torch.get_autocast_dtype(kind)
    actions = plan.per_device()[stage.index]
    run = ProgramRun(stage, link, micro, sizes, loss, stop, plan.split, last_gradients(actions))
    for p, prog in stage._programs.items():
        prog.begin(sizes, stop, plan.split, partition_order(plan, p), autocast=dtype if on else None,
                   input_grads=p == 0 and run.input_grads)
    # every program built in an earlier step (same sizes, same everything): this step sends what that one did
    link.steady = all(prog.programs and all(q is not None for q in prog.programs) for prog in stage._programs.values())
    # The caller's autocast without its cache of weight casts, as CUDA graphs need (torch's
    # make_graphed_callables asks for cache_enabled=False): each program casts its weights itself, inside
    # its graphs; the in-process executor builds its programs the same way (pipeline.replayed)
    with torch.autocast(kind, dtype=dtype, enabled=on, cache_enabled=False):
        try:
            run.run(actions)
            for p, prog in stage._programs.items():  # every partition's last B or W started its sum
                prog.finish(True, run.summing[p] if run.over is not None else None)
        finally:
            run.fixed.clear()
            run.local.clear()
        ready = {p: prog for p, prog in stage._programs.items() if prog.ready()}
        if ready:  # after the step's values are let go (the eager step's graphs with them)
            capture(ready, [(a.kind, a.partition, a.microbatch) for a in actions])
    return run.losses
