"""Memory: predict each device's peak bytes for a schedule and checkpointing, and pick the fastest pair under a cap."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import MemoryCapError
from seqify.pipe.stage import Stage
from seqify.schedule.actions import Schedule
from seqify.skip.namespace import SkipKey

__all__ = ["MemoryPlan", "PartitionMemory", "measure", "parse_bytes", "predict", "weighted"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(cap: int | float | str) -> int:
    """``cap`` in bytes: a number, or a string such as '40GiB', '512 MiB', '1.5GB'."""
    if isinstance(cap, bool):
        raise MemoryCapError(f"memory_cap={cap!r}: give bytes (an int) or a size such as '40GiB'")
    if isinstance(cap, (int, float)):
        if cap <= 0:
            raise MemoryCapError(f"memory_cap={cap!r}: give a positive number of bytes, or a size such as '40GiB'")
        return int(cap)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(cap))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise MemoryCapError(f"memory_cap={cap!r}: write a size such as '40GiB', '40GB' or '512MiB' (or bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} bytes"


@dataclass(frozen=True)
class PartitionMemory:
    """Bytes one partition needs: its parameters and buffers, its parameters' gradients, what its
    forward keeps for backward per micro-batch, what it receives per micro-batch (all a checkpointed
    micro-batch keeps), and what a split backward's B keeps for W per micro-batch (the gradient at each
    weighted layer's output: W starts from them; none in the first partition, whose B has no input
    gradient to compute)."""

    params: int
    grads: int
    activations: int
    inputs: int
    kept: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted peak bytes per pipeline device (the schedule's device numbers) for one schedule and
    checkpointing: parameters + gradients + the most activations the schedule holds at once (+ one
    partition's activations recomputed during a checkpointed backward). Optimizer state is not included."""

    schedule: str
    checkpoint: str
    per_device: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(self.per_device)

    def __str__(self) -> str:
        devices = ", ".join(_size(b) for b in self.per_device)
        return f"{self.schedule}, checkpoint={self.checkpoint!r}: {devices}"


#: Normalisations whose weights' gradients a split backward's B computes along with the input's (their
#: backward yields both from the same reductions): they keep nothing for W. The modules behind
#: :data:`seqify.pipe.split_backward.NOW`'s autograd nodes.
NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def weighted(layer: nn.Module) -> bool:
    """Whether a layer has a parameter that wants a gradient and that a split backward's W computes (not
    a normalisation's, :data:`NORMS`): B then keeps the gradient at the layer's output for W (the bytes
    of that output)."""
    return not isinstance(layer, NORMS) and any(p.requires_grad for p in layer.parameters())


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """One entry per view: a micro-batch is a view of the mini-batch, so storages would over-count."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def _to(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor or a tuple of them) on ``device``, as the partition running there receives it."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def measure(stages: Sequence[Stage], x: Any) -> list[PartitionMemory]:
    """Run one micro-batch ``x`` through the partitions once, counting the bytes autograd saves in each
    (each view once; parameters are not activations; on a GPU, the bytes the forward leaves allocated)
    and, after the first, the bytes of its weighted layers' outputs (the gradients a split backward's B
    keeps for W have their shapes). Buffers (running statistics) are restored."""
    saved = [(b, b.clone()) for s in stages for b in s.layers.buffers()]
    out: list[PartitionMemory] = []
    pending: dict[SkipKey, Any] = {}
    try:
        for stage in stages:
            params = list(stage.layers.parameters())
            own = {p.untyped_storage().data_ptr() for p in params}
            seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
            saved_bytes = 0

            # a saved-tensor hook of this partition's forward only (below, in the same iteration)
            def pack(
                t: torch.Tensor, own: set[int] = own, seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = seen
            ) -> torch.Tensor:
                nonlocal saved_bytes
                key = _key(t)
                if t.untyped_storage().data_ptr() not in own and key not in seen:
                    seen.add(key)
                    saved_bytes += _bytes(t)
                return t

            outputs = 0

            def output(module: nn.Module, args: Any, result: Any) -> None:
                nonlocal outputs
                values = result if isinstance(result, (tuple, list)) else (result,)
                outputs += sum(_bytes(t) for t in values if isinstance(t, torch.Tensor) and t.is_floating_point())

            # the first partition's B has no input gradient to compute, so keeps nothing for W
            later = stage is not stages[0]
            # the partition's own modules (stage.modules may wrap some, e.g. a layer holding a tied weight)
            hooks = [m.register_forward_hook(output) for m in stage.layers.children() if later and weighted(m)]
            skips = {key: _to(pending.pop(key), stage.device) for key in stage.pops}
            x = _to(x, stage.device)
            inputs = [t for t in ((x,) if isinstance(x, torch.Tensor) else tuple(x)) if isinstance(t, torch.Tensor)]
            inputs += [v for v in skips.values() if isinstance(v, torch.Tensor)]
            received = sum(_bytes(t) for t in {_key(t): t for t in inputs}.values())
            x = x.detach() if isinstance(x, torch.Tensor) else x
            try:
                if stage.device.type == "cuda":
                    # On a GPU, what the forward leaves allocated (activations autograd keeps, and the outputs).
                    # Saved-tensor hooks are not used there: after a forward under them, capturing that
                    # partition's backward as a CUDA graph fails (seen with torch 2.11 on H200).
                    torch.cuda.synchronize(stage.device)
                    start = torch.cuda.memory_allocated(stage.device)
                    with torch.enable_grad():
                        x, made = stage.fresh(x, skips)
                    torch.cuda.synchronize(stage.device)
                    saved_bytes = max(0, torch.cuda.memory_allocated(stage.device) - start)
                else:
                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        x, made = stage.fresh(x, skips)
            finally:
                for h in hooks:
                    h.remove()
            pending.update(made)
            buffers = sum(b.numel() * b.element_size() for b in stage.layers.buffers())
            weights = sum(p.numel() * p.element_size() for p in params)
            grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            out.append(PartitionMemory(weights + buffers, grads, saved_bytes, received, outputs))
    finally:
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
    return out


def predict(parts: Sequence[PartitionMemory], schedule: Schedule, checkpoint: str) -> MemoryPlan:
    """Each device's predicted peak under ``schedule``: its partitions' parameters and gradients, plus
    the most activations it holds at once (F keeps a partition's activations, or only its inputs for a
    checkpointed micro-batch, until B frees them, or W in split schedules, where B adds what it keeps for
    W until then), plus, when it checkpoints, the largest activations one recomputation rebuilds."""
    m = schedule.microbatches
    stop = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]
    free = "W" if schedule.split else "B"
    peaks = []
    for d, actions in enumerate(schedule.per_device()):
        owned = [p for p, dev in enumerate(schedule.placement) if dev == d]
        static = sum(parts[p].params + parts[p].grads for p in owned)
        held = most = 0
        for a in actions:
            size = parts[a.partition].inputs if a.microbatch < stop else parts[a.partition].activations
            kept = parts[a.partition].kept if schedule.split else 0
            if a.kind == "F":
                held += size
            elif a.kind == "B" and schedule.split:
                held += kept
            elif a.kind == free:
                held -= size + kept
            most = max(most, held)
        recompute = max(parts[p].activations for p in owned) if stop else 0
        peaks.append(static + most + recompute)
    return MemoryPlan(schedule.name, checkpoint, tuple(peaks))
