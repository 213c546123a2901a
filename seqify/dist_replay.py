"""This rank's partition on each micro-batch as fixed programs, replayed from CUDA graphs on GPUs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .dist_link import ACTIVATION, GRAD, SKIP, SKIP_GRAD, Link, grads_for, leaves, like_grads
from .pipeline.replay import Program, _buffers, _Flat, _hand_over
from .pipeline.stage import Stage
from .sequential import Sequential
from .skip.namespace import SkipKey

if TYPE_CHECKING:
    from .distributed import DistributedStage

__all__ = ["RankPrograms", "program_step"]

_OUT = -1  # where the last stage keeps the leaves its loss starts from


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


class RankPrograms:
    """One :class:`~seqify.pipeline.replay.Program` per micro-batch of this rank's partition.

    The first step with given micro-batch sizes builds them and runs eagerly (autograd inside each
    program); on CUDA the programs are then captured as graphs and later steps only copy received
    values into their fixed inputs, replay, and send the fixed outputs: the sends and receives between
    ranks stay outside the graphs. On the CPU they keep running eagerly, the same computation."""

    def __init__(self, runner: Stage, device: torch.device, graphs: bool, warmup: int = 2) -> None:
        self.runner = runner
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.warmup = warmup
        self.params = [p for p in runner.layers.parameters() if p.requires_grad]
        self.acc = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.sizes: list[int] = []
        self.programs: list[Program | None] = []
        self.captured = False

    def begin(self, sizes: list[int]) -> None:
        """Start a step of these micro-batch sizes: new shapes build new programs."""
        if sizes != self.sizes:
            self.sizes, self.programs, self.captured = list(sizes), [None] * len(sizes), False

    def forward(self, i: int, x: Any, skips: dict[SkipKey, Any], needs_grad: bool) -> tuple[Any, dict[SkipKey, Any]]:
        """Micro-batch ``i`` through the partition: the carried output and the stashed skips (fixed
        tensors, valid until this micro-batch's next forward)."""
        values = _tensors(x) + [skips[k] for k in self.runner.pops]
        p = self.programs[i]
        if p is None:
            with torch.no_grad():
                inputs = tuple(t.detach().clone().requires_grad_(needs_grad and t.is_floating_point()) for t in values)
            carried = None if isinstance(x, torch.Tensor) else len(x)
            p = self.programs[i] = Program(_Flat(self.runner, carried), inputs, self.params, self.acc)
        else:
            with torch.no_grad():
                for buf, v in zip(p.inputs, values):
                    buf.copy_(v)
        p.forward()
        k = 1 if p.flat.returns is None else p.flat.returns
        y = p.outputs[0] if p.flat.returns is None else tuple(p.outputs[:k])
        return y, dict(zip(self.runner.stashes, p.outputs[k:]))

    def backward(self, i: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Micro-batch ``i``'s backward from the gradients of its outputs (carried, then stashed); the
        gradients of its inputs (carried, then popped); parameter gradients add up inside."""
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

    def finish(self, training: bool, order: list[tuple[str, int]]) -> None:
        """End of a step: hand the summed gradients to ``.grad`` as autograd would, then capture the
        programs as CUDA graphs after the step that built them."""
        programs = [p for p in self.programs if p is not None]
        if training and programs:
            touched = [any(p.touched[k] for p in programs) for k in range(len(self.params))]
            params = [w for w, t in zip(self.params, touched) if t]
            acc = [a for a, t in zip(self.acc, touched) if t]
            _hand_over(params, acc)
            if self.acc:
                torch._foreach_zero_(self.acc)
        if self.graphs and training and not self.captured and len(programs) == len(self.programs):
            self._capture(order)

    def _capture(self, order: list[tuple[str, int]]) -> None:
        """Capture every program on a side stream (a captured backward must not reach back to the default
        stream), in one memory pool and in the order the schedule runs them, so memory a captured step
        frees is reused only by steps that run after it."""
        saved = _buffers([self.runner.layers])  # warm-up runs the partition: leave running statistics alone
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        programs = [p for p in self.programs if p is not None]
        try:
            pool = torch.cuda.graph_pool_handle()
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                for p in programs:  # cuDNN/cuBLAS choose kernels and workspaces outside capture
                    for _ in range(self.warmup):
                        p._outputs()
                        p._grads()
                    p.outputs, p.in_grads = (), [None] * len(p.inputs)
                if self.acc:
                    torch._foreach_zero_(self.acc)
                forwards: dict[int, torch.cuda.CUDAGraph] = {}
                for kind, i in order:
                    p = programs[i]
                    if kind == "F":
                        forwards[i] = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(forwards[i], pool=pool, stream=stream):
                            p._outputs()
                    else:
                        backward = None
                        if any(g is not None for g in p.out_grads):
                            backward = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(backward, pool=pool, stream=stream):
                                p._grads()
                        p.graphs = (forwards[i], backward, None)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)
            if self.acc:
                torch._foreach_zero_(self.acc)
        self.captured = True


def program_step(stage: DistributedStage, link: Link, micro: list[Any], targets: list[Any], sizes: list[int],
                 loss_fn: Callable[[Any, Any], torch.Tensor]) -> list[torch.Tensor]:
    """One training step of a one-partition-per-rank ``stage`` as fixed programs, in its schedule's order
    (a split schedule's W runs inside its B: a program's backward is one piece); the micro-batch losses
    on the last stage."""
    prog = stage._programs
    assert prog is not None
    p, last, batch = stage.index, stage.partitions - 1, sum(sizes)
    routes = stage.routes
    prog.begin(sizes)
    saved: dict[int, tuple[list[torch.Tensor], dict[int, list[torch.Tensor]], Any, dict[int, list[torch.Tensor]]]] = {}
    losses: list[torch.Tensor] = []
    order = stage.order(len(sizes))

    def forward(i: int) -> None:
        x_in: list[torch.Tensor] = []
        x = micro[i] if p == 0 else link.recv((ACTIVATION, p - 1, i), stage.rank_of(p - 1))
        x_in = leaves(x) if p > 0 else []
        skips_in: dict[Any, Any] = {}
        received: dict[int, list[torch.Tensor]] = {}
        for r in routes:
            if r.dst == p:
                value = link.recv((SKIP, r.index, i), stage.rank_of(r.src))
                skips_in[stage.skip_key(r)], received[r.index] = value, leaves(value)
        y, skips_out = prog.forward(i, x, skips_in, needs_grad=p > 0)
        sent: dict[int, list[torch.Tensor]] = {}
        if p < last:
            link.send((ACTIVATION, p, i), y, stage.rank_of(p + 1))
        for r in routes:
            if r.src == p:
                value = skips_out[stage.skip_key(r)]
                link.send((SKIP, r.index, i), value, stage.rank_of(r.dst))
                sent[r.index] = leaves(value)
        if p == last:  # the loss on leaves: a program's outputs carry no autograd history
            sent[_OUT] = [t.detach().requires_grad_(t.is_floating_point()) for t in leaves(y)]
            y = sent[_OUT][0] if isinstance(y, torch.Tensor) else tuple(sent[_OUT])
            out = stage.model.unflatten_outputs(y) if isinstance(stage.model, Sequential) else y
            y = loss_fn(out, targets[i]) * (sizes[i] / batch)  # the mini-batch mean, piece by piece
            losses.append(y.detach())
        saved[i] = (x_in, received, y, sent)

    def backward(i: int) -> None:
        x_in, received, y, sent = saved.pop(i)
        if p == last:
            y.backward()
            grads: list[torch.Tensor | None] = [t.grad for t in sent.pop(_OUT)]
        else:
            ys = leaves(y)
            grads = grads_for(ys, link.recv((GRAD, p, i), stage.rank_of(p + 1)))
        for r in routes:
            if r.src == p:
                grads += grads_for(sent[r.index], link.recv((SKIP_GRAD, r.index, i), stage.rank_of(r.dst)))
        in_grads = prog.backward(i, grads)
        if p > 0:
            link.send((GRAD, p - 1, i), like_grads(x_in, in_grads[:len(x_in)]), stage.rank_of(p - 1))
        at = len(x_in)
        for r in routes:
            if r.dst == p:
                n = len(received[r.index])
                link.send((SKIP_GRAD, r.index, i), like_grads(received[r.index], in_grads[at:at + n]),
                          stage.rank_of(r.src))
                at += n

    try:
        for kind, i in order:
            if kind == "F":
                forward(i)
            else:
                backward(i)
        prog.finish(True, order)
    finally:
        saved.clear()
    return losses
