"""Programs: one partition on one micro-batch as fixed tensors (its flat view, and its forward, B and W parts).

A :class:`Program` is what every replaying executor runs (the in-process :class:`~.replay.Replay` and a
torchrun rank's :class:`~seqify.distributed.replay.RankPrograms`): eagerly on any device, or replayed from
the CUDA graphs :mod:`.capture` records of it, with the same effect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from seqify.pipe.executors.casts import Casts
from seqify.pipe.executors.fused_grads import Fused, accumulating, from_kept, fusable, write_kept
from seqify.pipe.microbatch import is_tensors
from seqify.pipe.recompute import RngState, checkpointed, draws_random, norms_of, recomputed, rng_state
from seqify.pipe.split_backward import Later, input_grads, owing, weight_values
from seqify.pipe.stage import Stage
from seqify.skip.namespace import SkipKey

__all__ = ["Flat", "Program", "Unreplayable", "accumulators", "checkpointing", "flat_sums"]


class Unreplayable(Exception):
    """A partition takes or returns something other than tensors: the step cannot be fixed programs."""


class Flat(nn.Module):
    """A stage as a function of flat tensors: (carried..., popped...) -> (carried..., stashed...).

    Skips that are sizes (``sized``: made from shapes alone, e.g. a batch size) are not tensors: they are
    kept as this micro-batch's constants, ``kept`` for those it stashes and ``given`` for those it pops,
    fixed like everything else in a program built for one input shape."""

    stage: Stage  # a plain attribute (set with object.__setattr__): the stage's layers are registered once, as layers

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
            self.rng = rng_state(*tensors) if draws_random(self.layers) else None  # eager only (see checkpointing)
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


def _writing_sums(part: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Run program part ``part`` (B or W), which adds into the sums; where it is its partition's first to in a
    step (:attr:`Program.writes_sums`), it writes them instead: its gradients copied in, every other sum zeroed,
    also where it yields none (so no sum keeps the last step's value, and nothing zeroes them beforehand)."""
    return functools.partial(_writing, part=part)


def _writing(method: Callable[..., None], part: str) -> Callable[..., None]:
    @functools.wraps(method)
    def run(self: Program) -> None:
        self._first = self.writes_sums == part
        try:
            method(self)
        finally:
            if self._first:
                self._first = False
                torch._foreach_zero_(self.acc)

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

    def __init__(self, flat: Flat, inputs: tuple[torch.Tensor, ...], params: list[nn.Parameter],
                 acc: list[torch.Tensor], split: bool = False, casts: Casts | None = None,
                 fuse: bool = True) -> None:
        self.flat = flat
        self.split = flat.split = split
        self.inputs = inputs
        self.params = params
        self.acc = acc
        # Under autocast, the weights read only through its cast are read from casts made once per step
        # (:mod:`.casts`); the gradients are taken for those casts and added into the float32 sums.
        self.casts = casts
        self.wrt: list[torch.Tensor] = casts.wrt(params) if casts is not None else list(params)
        # The backward (W, when split) writes the cast linear weights' gradients into their sums as it runs
        # (:mod:`.fused_grads`) rather than returning them for :meth:`_add`.
        self.fuse = fuse
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
        # The part (B or W) of this program that is its partition's first to add into the sums in a step
        # (:func:`~.build.mark_first_writers`; None: none is): it writes them, the first gradients copied
        # (widened) rather than added to zeros, which saves zeroing the sums and reading them once.
        self.writes_sums: str | None = None
        self._first = False  # inside that part, until it has written the sums
        self.grad = bool(params) or any(t.requires_grad for t in inputs)  # False: an inference program

    def adds(self, part: str) -> bool:
        """Whether part ``part`` (B or W) of this program adds into the sums (and so is captured): some gradient
        flows in, and, split, B has inputs to differentiate (it adds its norms' weights') or W has weights."""
        if not any(g is not None for g in self.out_grads):
            return False
        if not self.split:
            return part == "B"
        return bool(self._wrt_inputs()) if part == "B" else bool(self.params)

    def _wrt_inputs(self) -> list[int]:
        """The input slots to differentiate by: those needing a gradient, once per tensor."""
        first = {id(t): k for k, t in reversed(list(enumerate(self.inputs)))}
        return [k for k, t in enumerate(self.inputs) if t.requires_grad and first[id(t)] == k]

    def _add(self, grads: Sequence[torch.Tensor | None], done: frozenset[int] = frozenset()) -> None:
        """Add the parameters' gradients into ``acc`` (None: none reached that parameter; ``done``: the backward
        itself already put theirs in, :mod:`.fused_grads`)."""
        for k, g in enumerate(grads):
            self.touched[k] = self.touched[k] or g is not None or k in done
        used = [(a, g) for a, g in zip(self.acc, grads) if g is not None]
        if self._first:  # the step's first gradients: written, and every sum they leave out zeroed
            self._first = False
            unused = [a for k, (a, g) in enumerate(zip(self.acc, grads)) if g is None and k not in done]
            if used:
                torch._foreach_copy_([a for a, _ in used], [g for _, g in used])
            if unused:
                torch._foreach_zero_(unused)
        elif used:
            torch._foreach_add_([a for a, _ in used], [g for _, g in used])

    @_writing_sums("B")
    @_with_casts
    def _grads(self) -> None:
        """Differentiate outputs by inputs and parameters; add the parameters' part into ``acc``."""
        wrt_inputs = self._wrt_inputs()
        outs = [(o, g) for o, g in zip(self.outputs, self.out_grads) if g is not None]
        if not outs or not (wrt_inputs or self.params):
            return
        inputs = [self.inputs[k] for k in wrt_inputs]
        fused = self._fusable([o for o, _ in outs], inputs)
        skipped = {f.index for f in fused}
        wrt = [w for k, w in enumerate(self.wrt) if k not in skipped]
        with accumulating(fused, self.acc, write=self._first):
            grads = torch.autograd.grad([o for o, _ in outs], inputs + wrt, [g for _, g in outs], allow_unused=True)
        for k, g in zip(wrt_inputs, grads):
            self.in_grads[k] = g
        found = iter(grads[len(wrt_inputs):])
        self._add([None if k in skipped else next(found) for k in range(len(self.wrt))],
                  frozenset(f.index for f in fused if f.reached))

    def _casts(self) -> set[int]:
        """The weights read through their once-per-step cast (none unless fusing)."""
        if not self.fuse or self.casts is None:
            return set()
        return {k for k, (w, p) in enumerate(zip(self.wrt, self.params)) if w is not p}

    def _fusable(self, outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[Fused]:
        """The cast weights whose gradients the backward writes into their sums itself (:mod:`.fused_grads`):
        where the weights are cast once per step and the forward is not recomputed inside the backward (whose
        saved inputs a hook cannot read)."""
        if self.flat.checkpoint is not None:
            return []
        return fusable(outs, self.wrt, inputs, self.acc, self._casts())

    def _fused_weights(self, outs: list[torch.Tensor], later: Later | None) -> list[Fused]:
        """W's cast weights whose gradients it writes into their sums itself: multiplied from the gradient B kept
        at their product, or, where W walks from the outputs, by the product's backward. A checkpointed
        program's recomputed graph is an ordinary one (:meth:`Flat.recompute`): fused as well."""
        owed = owing(self.wrt, later)
        casts = {k for k in self._casts() if owed[k]}
        if later is not None and later.groups is not None:
            return from_kept(outs, self.wrt, self.acc, casts, later.groups)
        return fusable(outs, self.wrt, [], self.acc, casts, asked=owed)

    def _differentiated(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs a gradient flows back to, and those gradients; a checkpointed program's outputs
        recomputed, with a graph of their own."""
        outputs = self.flat.recompute(*self.inputs) if self.flat.checkpoint is not None else self.outputs
        outs = [(o, g) for o, g in zip(outputs, self.out_grads) if g is not None]
        return [o for o, _ in outs], [g for _, g in outs]

    @_writing_sums("B")
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

    @_writing_sums("W")
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
            fused = self._fused_weights(outs, later)
            with accumulating([f for f in fused if f.kept is None], self.acc, write=self._first):
                values = weight_values(outs, grads, self.wrt, later, retain_graph=False,
                                       skip=frozenset(f.index for f in fused))
            write_kept(fused, self.acc, write=self._first)
            self._add(values, frozenset(f.index for f in fused if f.reached))
            del fused, values
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


def mark_writer(row: Sequence[Program], order: Iterable[tuple[str, int]]) -> None:
    """Mark the part of one partition's programs (``row``, by micro-batch) that ``order`` (its ('F' | 'B' | 'W',
    micro-batch) actions as a step issues them) runs first of those that add into the sums: in a step it writes
    them (:attr:`Program.writes_sums`), so they need no zeroing before. Call it once gradients are known to reach
    (``out_grads``) and before capture: a part that adds nothing is not captured, so it cannot be the writer. A
    W follows its B; two lanes order a partition's backwards on their streams as the step issues them."""
    for p in row:
        p.writes_sums = None
    if not row or not row[0].acc:
        return
    first = next(((kind, i) for kind, i in order if kind in ("B", "W") and row[i].adds(kind)), None)
    if first is not None:
        row[first[1]].writes_sums = first[0]


def checkpointing(stage: Stage, j: int, capturing: bool) -> Callable[..., Any]:
    """How partition ``j``'s checkpointed programs run: recomputed inside their backward program, with
    BatchNorm statistics updated once. A captured recomputation cannot restore the generator's state,
    so a partition that draws random numbers (dropout) is not captured checkpointed."""
    if capturing and draws_random(stage.layers):
        raise Unreplayable(f"partition {j} draws random numbers (dropout) and is checkpointed: a captured "
                           "recomputation would draw different ones; use checkpoint='never' with graphs=True")
    return functools.partial(checkpointed, norms=norms_of(stage.layers), preserve_rng=not capturing)



def accumulators(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Zeroed gradient sums for ``params``, each a view (with its parameter's strides) of one flat tensor per
    dtype: replicas add a whole partition's sums together in one call (:mod:`seqify.pipe.partition_sums`). A
    parameter whose elements do not fill its memory densely gets a tensor of its own."""
    acc: list[torch.Tensor | None] = [None] * len(params)
    groups: dict[torch.dtype, list[int]] = {}
    for k, p in enumerate(params):
        if _dense(p):
            groups.setdefault(p.dtype, []).append(k)
        else:
            acc[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    for dtype, ks in groups.items():
        flat = torch.zeros(sum(params[k].numel() for k in ks), dtype=dtype, device=params[ks[0]].device)
        offset = 0
        for k in ks:
            p = params[k]
            acc[k] = flat.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()
    return [a for a in acc if a is not None]


def flat_sums(acc: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The flat tensors behind ``acc`` (:func:`accumulators`), in order; None where one is a tensor of its own."""
    if any(a._base is None for a in acc):
        return None
    return list({id(a._base): a._base for a in acc if a._base is not None}.values())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
