"""Distributed: one pipeline stage per process under torchrun; skips go point-to-point, stash rank to pop rank."""

from __future__ import annotations

import datetime
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dist_checkpoint import load, merge, save
from .dist_replay import RankPrograms
from .errors import BalanceError, BoundaryError, DeviceError, PeerError, ScheduleError, SeqifyError
from .pipeline.checkpoint import checkpointed, norms_of
from .pipeline.microbatch import gather, scatter
from .pipeline.pipe import CHECKPOINT, _check_balance, _place
from .pipeline.schedule import SCHEDULES, Schedule, make
from .pipeline.stage import Stage
from .pipeline import tied
from .sequential import Sequential
from .skip.layout import routes

__all__ = ["DistributedStage", "stage", "init", "save", "load", "merge", "SCHEDULES"]

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
]
_OUT = -1  # where a last stage running programs keeps the leaves its loss starts from
_MAX_TENSORS = 16
_MAX_DIMS = 8
_SLOT = 2 + _MAX_DIMS
_HEADER = 2 + _MAX_TENSORS * _SLOT


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """``init_process_group`` from torchrun's environment: NCCL when CUDA is here, else gloo.

    The timeout bounds how long a rank waits for a peer that died, so no job hangs forever.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@contextmanager
def _peer(me: str, peer: int | list[int], what: str) -> Iterator[None]:
    """Turns a failed send, receive or all-reduce (a peer died, or stayed silent past the process-group
    timeout) into a :class:`PeerError` naming both ranks and what to do."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise DistBackendError or a plain RuntimeError
        if isinstance(e, SeqifyError):
            raise
        who = f"rank {peer}" if isinstance(peer, int) else f"one of ranks {peer}"
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        cause = cause.split("] ", 1)[-1].split(". This is typically")[0]  # gloo's source location and advice
        raise PeerError(
            f"{me} lost {who} while {what} ({cause}). The peer process died or did not answer within the "
            "process-group timeout (seqify.distributed.init(timeout_s=...)). Look in its log (or its node's) for "
            "the first error; the rest of the job stops too. Restart the job and resume from the last "
            "seqify.distributed.save(stage, path, optimizer) with seqify.distributed.load(stage, path, optimizer)."
        ) from e


@dataclass(frozen=True)
class _Route:
    index: int
    name: str
    src: int  # stage that stashes
    dst: int  # stage that pops


class _Link:
    """Sends and receives tensors, tuples of tensors or None, with a small header so receivers need
    no shapes in advance."""

    def __init__(self, device: torch.device, me: str = "this rank") -> None:
        self.device = device
        self.me = me
        self.pending: list[Any] = []

    def send(self, value: Any, dst: int) -> list[torch.Tensor]:
        if value is None:
            tensors: tuple[torch.Tensor, ...] = ()
            kind = 2
        elif isinstance(value, torch.Tensor):
            tensors, kind = (value,), 0
        elif type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value):
            tensors, kind = value, 1
        else:
            raise BoundaryError(
                f"a {type(value).__name__} must cross to rank {dst}; only tensors, tuples of tensors and None "
                "travel between processes (move the cut so Python values stay inside one stage)"
            )
        if len(tensors) > _MAX_TENSORS or any(t.dim() > _MAX_DIMS for t in tensors):
            raise BoundaryError(f"at most {_MAX_TENSORS} tensors of at most {_MAX_DIMS} dims cross ranks at once")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = kind, len(tensors)
        for k, t in enumerate(tensors):
            base = 2 + k * _SLOT
            header[base] = _DTYPES.index(t.dtype)
            header[base + 1] = t.dim()
            header[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        sent = [header.to(self.device)] + [t.detach().contiguous() for t in tensors]
        with _peer(self.me, dst, "sending activations"):
            for t in sent:
                self.pending.append((dist.isend(t, dst), t, dst))
        return list(tensors)

    def _recv(self, t: torch.Tensor, src: int, what: str) -> None:
        with _peer(self.me, src, what):
            dist.irecv(t, src).wait()

    def recv(self, src: int) -> Any:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._recv(header, src, "receiving activations")
        header = header.cpu()
        kind, n = int(header[0]), int(header[1])
        tensors = []
        for k in range(n):
            base = 2 + k * _SLOT
            dtype = _DTYPES[int(header[base])]
            shape = [int(d) for d in header[base + 2:base + 2 + int(header[base + 1])]]
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, src, "receiving activations")
            tensors.append(t)
        if kind == 2:
            return None
        return tensors[0] if kind == 0 else tuple(tensors)

    def send_grads(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        self.send_values(tensors, [t.grad for t in tensors], dst)

    def send_values(self, like: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], dst: int) -> None:
        """The gradients of ``like``'s floating-point tensors (zeros where ``None``), for ``recv_grads``."""
        for t, g in zip(like, grads):
            if t.is_floating_point():
                g = g if g is not None else torch.zeros_like(t)
                g = g.contiguous()
                with _peer(self.me, dst, "sending gradients"):
                    self.pending.append((dist.isend(g, dst), g, dst))

    def recv_grads(self, like: Sequence[torch.Tensor], src: int) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = []
        for t in like:
            if t.is_floating_point():
                g = torch.empty_like(t)
                self._recv(g, src, "receiving gradients")
                grads.append(g)
            else:
                grads.append(None)
        return grads

    def flush(self) -> None:
        for work, _, peer in self.pending:
            with _peer(self.me, peer, "waiting for its sends to arrive"):
                work.wait()
        self.pending.clear()


def _leaves(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _requiring_grad(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """Received tensors as leaves that collect gradients, and clones of them for the stage to use (a
    first layer may work in place, which autograd forbids on a leaf)."""
    if value is None:
        return None, []
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    used = [t.clone() if t.requires_grad else t for t in leaves]
    return (used[0] if isinstance(value, torch.Tensor) else tuple(used)), leaves


class DistributedStage(nn.Module):
    """This process's partition of a pipeline that spans processes (one stage per rank).

    ``step(inputs, target, loss_fn)`` runs one mini-batch in the order of a shared schedule
    (``seqify.pipeline.schedule``: 'gpipe', every forward then every backward; '1f1b', a backward after
    each forward once the pipeline is full, which bounds the activations kept; 'zb-h1'; or a ``Schedule``
    with one partition per rank), exchanging activations with the
    neighbouring stages and skips directly with the stage that pops (or stashed) them. It returns the mini-batch
    loss on the last stage and ``None`` elsewhere; gradients are left in this stage's parameters (and
    averaged over data-parallel replicas), ready for ``optimizer.step()``.
    """

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        *,
        index: int,
        replica: int = 0,
        replicas: int = 1,
        device: torch.device,
        chunks: int = 1,
        checkpoint: str = "never",
        schedule: str | Schedule = "gpipe",
        graphs: bool = False,
    ) -> None:
        super().__init__()
        if graphs and checkpoint != "never":
            raise BalanceError(f"graphs=True with checkpoint={checkpoint!r}: captured graphs need checkpoint='never'")
        if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
            raise ScheduleError(f"schedule={schedule!r}: choose one of {SCHEDULES} or pass a "
                                "seqify.pipeline.schedule.Schedule with one partition per rank")
        if checkpoint not in CHECKPOINT:
            raise BalanceError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}")
        names = list(model._modules)
        balance = _check_balance(balance, len(names))
        tied.refuse_across_processes(model, balance)
        starts = [sum(balance[:j]) for j in range(len(balance))]
        part_of = [j for j, count in enumerate(balance) for _ in range(count)]
        layers = list(model._modules.values())
        start, count = starts[index], balance[index]
        part = nn.Sequential(OrderedDict(zip(names[start:start + count], layers[start:start + count])))
        _place([part], [device])  # like .to(device), keeping tensors its layers share one tensor
        found = routes(model)
        self.routes = [
            _Route(i, r.key[1], part_of[r.stash], part_of[r.pop])
            for i, r in enumerate(found)
            if part_of[r.stash] != part_of[r.pop]
        ]
        self._key = {rt.index: found[rt.index].key for rt in self.routes}
        self.partition = part
        object.__setattr__(self, "model", model)
        self.balance = list(balance)
        self.index = index
        self.stages = len(balance)
        self.replica = replica
        self.replicas = replicas
        self.device = device
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        pops = tuple(self._key[r.index] for r in self.routes if r.dst == index)
        stashes = tuple(self._key[r.index] for r in self.routes if r.src == index)
        self.runner = Stage(index, part, device, pops, stashes)
        self._norms = norms_of(part)
        self._dp_group: Any = None
        self._orders: dict[int, list[tuple[str, int]]] = {}  # per micro-batch count: built once
        self.graphs = graphs
        self._programs = RankPrograms(self.runner, device, graphs) if graphs else None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def rank_of(self, stage_index: int) -> int:
        return self.replica * self.stages + stage_index

    @property
    def me(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else self.rank_of(self.index)
        return f"rank {rank} (stage {self.index + 1}/{self.stages}, replica {self.replica + 1}/{self.replicas})"

    def __repr__(self) -> str:
        return (f"DistributedStage({self.index + 1}/{self.stages}, replica {self.replica + 1}/{self.replicas}, "
                f"{len(self.partition)} layers on {self.device}, chunks={self.chunks})")

    def _micro_inputs(self, inputs: Any) -> list[Any]:
        model = self.model
        if isinstance(inputs, tuple) and isinstance(model, Sequential):
            carried = model.flatten_inputs(*inputs)
        elif isinstance(model, Sequential) and not isinstance(inputs, tuple):
            carried = model.flatten_inputs(inputs)
        else:
            carried = inputs
        if isinstance(carried, torch.Tensor):
            carried = carried.to(self.device)
        else:
            carried = tuple(t.to(self.device) for t in carried)
        return scatter(carried, self.chunks)

    def _forward(self, x: Any, skips: dict[Any, Any], checkpoint: bool) -> tuple[Any, dict[Any, Any]]:
        if checkpoint:
            return checkpointed(self.runner.fresh, x, skips, norms=self._norms)
        return self.runner(x, skips)

    def _sizes(self, micro: list[Any]) -> list[int]:
        """Every stage learns the micro-batch sizes the first stage made (for loss weights and 1F1B)."""
        count = torch.tensor([len(micro)], dtype=torch.int64, device=self.device)
        if self.stages > 1 and not self.is_first:
            with _peer(self.me, self.rank_of(0), "receiving the micro-batch sizes"):
                dist.recv(count, self.rank_of(0))
        sizes = torch.tensor(
            [_leaves(v)[0].size(0) for v in micro] if self.is_first else [0] * int(count[0]),
            dtype=torch.int64, device=self.device,
        )
        if self.stages > 1:
            if self.is_first:
                for j in range(1, self.stages):
                    with _peer(self.me, self.rank_of(j), "sending the micro-batch sizes"):
                        dist.send(count, self.rank_of(j))
                        dist.send(sizes, self.rank_of(j))
            else:
                with _peer(self.me, self.rank_of(0), "receiving the micro-batch sizes"):
                    dist.recv(sizes, self.rank_of(0))
        return [int(v) for v in sizes.tolist()]

    def order(self, m: int) -> list[tuple[str, int]]:
        """This stage's work for ``m`` micro-batches, ('F', i) forwards and ('B', i) backwards, read from
        the shared schedule (``seqify.pipeline.schedule``: one partition per rank, rank = device).

        A split schedule's W (weight gradients, zero-bubble) runs inside its B here: the order is the
        schedule's, the split is not (yet). Messages between two ranks are matched in the order they are
        posted, so every rank must meet the micro-batches in the same order, forwards and backwards."""
        if m in self._orders:
            return self._orders[m]
        plan = make(self.schedule, tuple(range(self.stages)), m)
        lists = plan.per_device()
        if len(lists) != self.stages:
            raise ScheduleError(
                f"schedule {plan.name!r} places partitions on {len(lists)} devices; seqify.distributed runs one "
                f"partition per rank, placement {tuple(range(self.stages))}: build it with that placement"
            )
        for kind in ("F", "B"):
            seen = [[a.microbatch for a in actions if a.kind == kind] for actions in lists]
            odd = next((j for j, got in enumerate(seen) if got != seen[0]), None)
            if odd is not None:
                raise ScheduleError(
                    f"schedule {plan.name!r} runs {kind} of the micro-batches in order {seen[0]} on rank 0 and "
                    f"{seen[odd]} on rank {odd}; seqify.distributed matches messages in the order they are sent, "
                    "so every rank needs the same order (gpipe, 1f1b and zb-h1 have it)"
                )
        self._orders[m] = [(a.kind, a.microbatch) for a in lists[self.index] if a.kind != "W"]
        return self._orders[m]

    def step(
        self,
        inputs: Any = None,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one mini-batch. ``inputs`` on the first stage, ``target`` and
        ``loss_fn(output, target) -> mean loss of a micro-batch`` on the last."""
        if self.is_last and loss_fn is None:
            raise BoundaryError("the last stage needs loss_fn(output, target) to run backward")
        micro = self._micro_inputs(inputs) if self.is_first else []
        sizes = self._sizes(micro)
        m, batch = len(sizes), sum(sizes)
        targets = scatter(target.to(self.device), m) if self.is_last and target is not None else [None] * m
        link = _Link(self.device, self.me)
        grad = torch.is_grad_enabled()
        stop = 0 if not grad else {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]
        saved: dict[int, tuple[list[torch.Tensor], dict[int, list[torch.Tensor]], Any, dict[int, list[torch.Tensor]]]] = {}
        losses: list[torch.Tensor] = []
        # graphs=True: fixed programs per micro-batch; received values are copied in, not made leaves
        prog = self._programs if grad else None
        if prog is not None:
            prog.begin(sizes)

        def take(value: Any) -> tuple[Any, list[torch.Tensor]]:
            return (value, _leaves(value)) if prog is not None else _requiring_grad(value)

        def forward(i: int) -> None:
            x_leaves: list[torch.Tensor] = []
            if self.is_first:
                x = micro[i]
            else:
                x, x_leaves = take(link.recv(self.rank_of(self.index - 1)))
            skips_in: dict[Any, Any] = {}
            received: dict[int, list[torch.Tensor]] = {}
            for r in self.routes:
                if r.dst == self.index:
                    value, received[r.index] = take(link.recv(self.rank_of(r.src)))
                    skips_in[self._key[r.index]] = value
            if prog is None:
                y, skips_out = self._forward(x, skips_in, i < stop)
            else:
                y, skips_out = prog.forward(i, x, skips_in, needs_grad=not self.is_first)
            sent: dict[int, list[torch.Tensor]] = {}
            if not self.is_last:
                link.send(y, self.rank_of(self.index + 1))
            for r in self.routes:
                if r.src == self.index:
                    sent[r.index] = link.send(skips_out[self._key[r.index]], self.rank_of(r.dst))
            if self.is_last:
                if prog is not None:  # the loss on leaves: a program's outputs carry no autograd history
                    sent[_OUT] = [t.detach().requires_grad_(t.is_floating_point()) for t in _leaves(y)]
                    y = sent[_OUT][0] if isinstance(y, torch.Tensor) else tuple(sent[_OUT])
                out = self.model.unflatten_outputs(y) if isinstance(self.model, Sequential) else y
                assert loss_fn is not None
                y = loss_fn(out, targets[i]) * (sizes[i] / batch)  # the mini-batch mean, piece by piece
                losses.append(y.detach())
            saved[i] = (x_leaves, received, y, sent)

        def backward_program(i: int) -> None:
            assert prog is not None
            x_leaves, received, y, sent = saved.pop(i)
            if self.is_last:
                y.backward()
                grads = [t.grad for t in sent.pop(_OUT)]
            else:
                grads = link.recv_grads(_leaves(y), self.rank_of(self.index + 1))
            for r in self.routes:
                if r.src == self.index:
                    grads += link.recv_grads(sent[r.index], self.rank_of(r.dst))
            in_grads = prog.backward(i, grads)
            if not self.is_first:
                link.send_values(x_leaves, in_grads[:len(x_leaves)], self.rank_of(self.index - 1))
            at = len(x_leaves)
            for r in self.routes:
                if r.dst == self.index:
                    n = len(received[r.index])
                    link.send_values(received[r.index], in_grads[at:at + n], self.rank_of(r.src))
                    at += n

        def backward(i: int) -> None:
            if prog is not None:
                return backward_program(i)
            x_leaves, received, y, sent = saved.pop(i)
            outputs: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            if self.is_last:
                outputs.append(y)
                grads.append(None)
            else:
                ys = _leaves(y)
                outputs += ys
                grads += link.recv_grads(ys, self.rank_of(self.index + 1))
            for r in self.routes:
                if r.src == self.index:
                    outputs += sent[r.index]
                    grads += link.recv_grads(sent[r.index], self.rank_of(r.dst))
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and (g is not None or self.is_last)]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if not self.is_first:
                link.send_grads(x_leaves, self.rank_of(self.index - 1))
            for r in self.routes:
                if r.dst == self.index:
                    link.send_grads(received[r.index], self.rank_of(r.src))

        try:
            for kind, i in (self.order(m) if grad else [("F", i) for i in range(m)]):
                if kind == "F":
                    forward(i)
                else:
                    backward(i)
            if prog is not None:
                prog.finish(grad, self.order(m))
            if grad:
                self._all_reduce_grads()
            link.flush()
        finally:
            saved.clear()
        return torch.stack(losses).sum() if self.is_last else None

    def _all_reduce_grads(self) -> None:
        if self.replicas == 1 or self._dp_group is None:
            return
        grads = [p.grad for p in self.partition.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        others = [d * self.stages + self.index for d in range(self.replicas) if d != self.replica]
        with _peer(self.me, others, "averaging gradients over data-parallel replicas"):
            dist.all_reduce(flat, group=self._dp_group)
        flat /= self.replicas
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    @torch.no_grad()
    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        """Inference over the pipeline: the output (source structure) on the last stage, None elsewhere."""
        micro = self._micro_inputs(inputs if len(inputs) != 1 else inputs[0]) if self.is_first else []
        m = len(self._sizes(micro))
        link = _Link(self.device, self.me)
        outs = []
        for i in range(m):
            x = micro[i] if self.is_first else link.recv(self.rank_of(self.index - 1))
            skips_in = {self._key[r.index]: link.recv(self.rank_of(r.src)) for r in self.routes if r.dst == self.index}
            y, skips_out = self.runner(x, skips_in)
            if not self.is_last:
                link.send(y, self.rank_of(self.index + 1))
            for r in self.routes:
                if r.src == self.index:
                    link.send(skips_out[self._key[r.index]], self.rank_of(r.dst))
            outs.append(y)
        link.flush()
        if not self.is_last:
            return None
        out = gather(outs)
        return self.model.unflatten_outputs(out) if isinstance(self.model, Sequential) else out


def stage(
    model: nn.Module,
    *,
    balance: Sequence[int] | str | None = None,
    chunks: int = 1,
    checkpoint: str = "never",
    schedule: str | Schedule = "gpipe",
    graphs: bool = False,
    device: torch.device | str | None = None,
    sample: Any = None,
    example_inputs: Any = None,
) -> DistributedStage:
    """This process's stage of a pipeline over all processes of the job (call under torchrun).

    With ``world_size = stages * replicas``, rank ``r`` runs stage ``r % stages`` of replica
    ``r // stages``; ``balance`` fixes the number of stages (a list of layer counts), or a strategy name
    ('params', 'flops', 'time', 'memory') splits the model into ``world_size`` stages. Rank 0 decides
    the balance and broadcasts it, so every rank agrees. Every rank must build the same model (seed it).
    ``graphs=True`` runs each micro-batch's forward and backward as fixed programs, captured as CUDA
    graphs after the first step (eager programs on the CPU); the sends and receives stay between them.
    """
    if not dist.is_initialized():
        init()
    if not isinstance(model, nn.Sequential):
        from .convert import convert

        model = convert(model, example_inputs)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if isinstance(balance, str) or balance is None:
        shared: list[Any] = [None]
        if rank == 0:
            from .partition import balance as make_plan

            probe = sample if sample is not None else example_inputs
            shared[0] = make_plan(model, world, sample=probe, by=balance or "params", progress=False).balance
        dist.broadcast_object_list(shared, src=0)
        counts = list(shared[0])
    else:
        counts = list(balance)
    stages = len(counts)
    if world % stages:
        raise DeviceError(f"world size {world} is not a multiple of the {stages} pipeline stages; launch stages x replicas processes")
    replicas = world // stages
    result = DistributedStage(model, counts, index=rank % stages, replica=rank // stages, replicas=replicas,
                              device=device, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                              graphs=graphs)
    if replicas > 1:
        for s in range(stages):
            group = dist.new_group([d * stages + s for d in range(replicas)])
            if s == rank % stages:
                result._dp_group = group
    return result
