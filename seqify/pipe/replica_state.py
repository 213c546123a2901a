"""What keeps data-parallel replicas one model: gradients summed into the first, state copied from it, running
statistics combined as one pipeline running every replica's micro-batches in turn would leave them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.cuda.nccl
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["BUCKET_BYTES", "sum_gradients", "share_gradients", "flattened", "flattened_by_partition", "copy_state",
           "Statistics", "distinct_cuda"]

#: Gradients are summed in flat buckets of at most this many bytes: one NCCL call per bucket rather than per
#: parameter, and no more than one bucket of extra memory per device.
BUCKET_BYTES = 64 * 2**20


def _buckets(params: Sequence[nn.Parameter]) -> Iterator[list[int]]:
    """Indices of ``params`` (those with a gradient) in buckets of one device and dtype, at most
    :data:`BUCKET_BYTES` each (a larger tensor is a bucket of its own), in order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, p in enumerate(params):
        if p.grad is not None:
            groups.setdefault((p.device, p.grad.dtype), []).append(k)
    for ks in groups.values():
        bucket: list[int] = []
        size = 0
        for k in ks:
            nbytes = params[k].numel() * params[k].element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(k)
            size += nbytes
        if bucket:
            yield bucket


def _grad(p: nn.Parameter, like: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient, or zeros where this replica's step left none (a parameter it did not use)."""
    return p.grad if p.grad is not None else torch.zeros_like(like, device=p.device)


def distinct_cuda(devices: Sequence[torch.device]) -> bool:
    """Whether NCCL can join these devices in one process: each a CUDA device of its own."""
    return all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)


def sum_gradients(replicas: Sequence[Sequence[nn.Parameter]]) -> None:
    """Add every replica's gradients into the first's (``replicas[r]``: replica ``r``'s parameters, all in the
    same order), then zero the others', so that a gradient accumulated over several steps counts each
    replica's part once. On CUDA devices NCCL reduces each bucket; elsewhere replicas are added in order."""
    first = replicas[0]
    with torch.no_grad():
        for ks in _buckets(first):
            mine = [_grad(first[k], first[k]) for k in ks]
            theirs = [[_grad(other[k], first[k]) for k in ks] for other in replicas[1:]]
            torch._foreach_copy_(mine, _summed([mine, *theirs]))
            for k, g in zip(ks, mine):
                if first[k].grad is None:
                    first[k].grad = g
        for other in replicas[1:]:
            grads = [p.grad for p in other if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)


def share_gradients(replicas: Sequence[Sequence[nn.Parameter]]) -> None:
    """Give every other replica's parameters the first's ``.grad`` (``replicas[r]``: replica ``r``'s parameters,
    all in the same order) as new tensors on their devices, None where the first has none: one NCCL broadcast
    per bucket where each replica is on its own CUDA device, else a copy per replica."""
    first = replicas[0]
    with torch.no_grad():
        for other in replicas[1:]:
            for p, q in zip(first, other):
                if p.grad is None:
                    q.grad = None
        for ks in _buckets(first):
            mine = [first[k].grad for k in ks]
            flat = _flatten_dense_tensors(mine)
            theirs = [torch.empty_like(flat, device=other[ks[0]].device) for other in replicas[1:]]
            copy_state([flat], [[t] for t in theirs])
            for other, t in zip(replicas[1:], theirs):
                for k, g in zip(ks, _unflatten_dense_tensors(t, mine)):
                    other[k].grad = g


def _summed(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The sums of ``grads[r][k]`` over the replicas ``r``, on the first's device: one NCCL reduction of the
    flattened bucket where each replica is on its own CUDA device, else added in replica order."""
    flats = [_flatten_dense_tensors(g) for g in grads]
    if distinct_cuda([f.device for f in flats]):
        torch.cuda.nccl.reduce(flats, root=0)
    else:
        for other in flats[1:]:
            flats[0].add_(other.to(flats[0].device))
    return list(_unflatten_dense_tensors(flats[0], grads[0]))


def flattened(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Move ``tensors`` (parameters and buffers) into one flat tensor per device and dtype, each becoming a view
    of it (its ``.data``; the same objects, so optimizers and modules keep them), and return the flat tensors in
    order of first appearance: a whole group then travels between GPUs as one NCCL call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flats = []
    with torch.no_grad():
        for (device, dtype), ts in groups.items():
            flat = torch.empty(sum(t.numel() for t in ts), device=device, dtype=dtype)
            offset = 0
            for t in ts:
                view = flat[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
                offset += t.numel()
            flats.append(flat)
    return flats


def flattened_by_partition(partitions: Sequence[nn.Module]) -> list[list[torch.Tensor]]:
    """Each partition's parameters and buffers in flat tensors of its own (:func:`flattened`; a tensor two
    partitions hold goes with the first), so that one partition's state can travel before the others'."""
    seen: set[int] = set()
    out = []
    for part in partitions:
        tensors = [t for t in (*part.parameters(), *part.buffers()) if id(t) not in seen]
        seen.update(map(id, tensors))
        out.append(flattened(tensors))
    return out


def copy_state(source: Sequence[torch.Tensor], targets: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy the first replica's flat state (:func:`flattened`) into each other replica's, in place (captured
    graphs keep reading the same memory): one NCCL broadcast per flat tensor where every replica is on its own
    CUDA device, else a copy per replica."""
    with torch.no_grad():
        for k, s in enumerate(source):
            group = [s, *(t[k] for t in targets)]
            if distinct_cuda([t.device for t in group]):
                torch.cuda.nccl.broadcast(group, root=0)
            else:
                for t in group[1:]:
                    t.copy_(s)


Norm = nn.modules.batchnorm._NormBase


class Statistics:
    """BatchNorm running statistics of replicas that each ran their own micro-batches from the same start,
    combined as one module running all of them in replica order would have updated them.

    With a momentum ``a``, ``m`` updates from ``r0`` give ``(1 - a)**m * r0 + d`` where ``d`` depends only on the
    micro-batches, so replica ``r``'s ``d`` is its result minus ``(1 - a)**m * r0`` and the chain is
    ``acc = (1 - a)**m_r * acc + d_r``. Without one (a cumulative average), ``n`` times the statistic grows by the
    sum of the batch statistics, so the sums add. The modules of one device and dtype are combined as one flat
    vector (a few kernels per step, not a few per module)."""

    def __init__(self, replicas: Sequence[Sequence[Norm]]) -> None:
        self.replicas = replicas
        self.momenta: tuple[float | None, ...] | None = None
        self.groups: list[_Group] = []

    def _grouped(self) -> list[_Group]:
        """The modules by device, dtype and kind of average (again where a momentum changed)."""
        momenta = tuple(m.momentum for m in self.replicas[0])
        if momenta != self.momenta:
            groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
            for k, m in enumerate(self.replicas[0]):
                groups.setdefault((_stats(m)[0].device, _stats(m)[0].dtype, m.momentum is None), []).append(k)
            self.groups = [_Group([[replica[k] for k in ks] for replica in self.replicas]) for ks in groups.values()]
            self.momenta = momenta
        return self.groups

    def keep(self) -> None:
        """Remember the first replica's statistics before a step (every replica starts from them)."""
        with torch.no_grad():
            for g in self._grouped():
                g.keep()

    def combine(self) -> None:
        """Put into the first replica what one module would hold after every replica's updates (nothing where
        no step was kept)."""
        with torch.no_grad():
            for g in self.groups:
                g.combine()


class _Group:
    """The modules of one device and dtype (``modules[r]``: replica ``r``'s, in the same order)."""

    def __init__(self, modules: list[list[Norm]]) -> None:
        self.modules = modules
        first = modules[0]
        self.tensors = [[t for m in ms for t in _stats(m)[:2]] for ms in modules]  # each module's mean and var
        self.counts = [[_stats(m)[2] for m in ms] for ms in modules]
        device, dtype = self.tensors[0][0].device, self.tensors[0][0].dtype
        sizes = torch.tensor([2 * _stats(m)[0].numel() for m in first], device=device)
        self.module_of = torch.repeat_interleave(torch.arange(len(first), device=device), sizes)
        self.cumulative = first[0].momentum is None
        keeps = [1.0 - (m.momentum or 0.0) for m in first]
        self.keep_of = torch.tensor(keeps, dtype=dtype, device=device)[self.module_of]
        self.start: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self) -> None:
        self.start = (_flatten_dense_tensors(self.tensors[0]).clone(), torch.stack(self.counts[0]).clone())

    def combine(self) -> None:
        if self.start is None:
            return
        flat0, n0 = self.start
        device = flat0.device
        flats = [_flatten_dense_tensors(ts).to(device) for ts in self.tensors]
        counts = [torch.stack(cs).to(device) - n0 for cs in self.counts]  # each replica's updates per module
        added = torch.stack(counts).sum(0)
        if self.cumulative:  # n times the statistic adds each update's statistic
            n = n0[self.module_of].to(flat0.dtype)
            grown = sum(f * (n + c[self.module_of]) - flat0 * n for f, c in zip(flats, counts))
            acc = (flat0 * n + grown) / (n + added[self.module_of])
        else:
            acc = flats[0]
            for f, c in zip(flats[1:], counts[1:]):
                decay = self.keep_of ** c[self.module_of]
                acc = decay * acc + (f - decay * flat0)
        torch._foreach_copy_(self.tensors[0], list(_unflatten_dense_tensors(acc, self.tensors[0])))
        torch._foreach_copy_(self.counts[0], list((n0 + added).unbind()))
        self.start = None


def _stats(m: Norm) -> tuple[torch.Tensor, ...]:
    assert m.running_mean is not None and m.running_var is not None and m.num_batches_tracked is not None
    return m.running_mean, m.running_var, m.num_batches_tracked
