"""The tuner's memory bounds: the optimizer's state (bytes per parameter byte, and where it lands) and the GPUs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import nn

from seqify.errors import MemoryCapError, TuneError
from seqify.pipe.config import Trial
from seqify.tuning.predict import Candidate

__all__ = ["OptimizerSpec", "ROOM", "state_ratio", "trainable_bytes", "per_device", "with_state", "with_room",
           "predicted_to_fit", "fullness"]

#: The share of a GPU's memory a timed candidate may fill with its allocated peak plus the optimizer state it
#: will hold (``optimizer=``): the rest is left to the allocator's fragmentation and what the caller keeps.
ROOM = 0.95

#: What ``optimizer=`` accepts: an optimizer class or a function building one from parameters
#: (``functools.partial(torch.optim.AdamW, lr=3e-4)``), the bytes of state it keeps per parameter byte (``2.0``
#: for Adam with state in the parameters' dtype), or ``None`` (no state counted).
OptimizerSpec = (type[torch.optim.Optimizer] | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | float
                 | None)

_PROBE = 64  # elements of the parameter the optimizer is probed on

_HOW = ("give optimizer= the optimizer's class (torch.optim.AdamW), a function that builds it from parameters "
        "(functools.partial(torch.optim.AdamW, lr=3e-4)), or the bytes of state it keeps per parameter byte "
        "(2.0 for Adam, 1.0 for SGD with momentum)")


def state_ratio(optimizer: OptimizerSpec) -> float:
    """Bytes of per-parameter state ``optimizer`` keeps for each byte of float32 parameters it steps: its
    state tensors the size of the parameter after one step of a probe parameter (Adam's two moments: 2.0; SGD
    without momentum: 0.0). Scalars (Adam's step count) are left out."""
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, bool):
        raise TuneError(f"optimizer={optimizer!r}: {_HOW}")
    if isinstance(optimizer, (int, float)):
        if not (math.isfinite(optimizer) and optimizer >= 0):
            raise TuneError(f"optimizer={optimizer!r}: the bytes of state per parameter byte must be finite and >= 0")
        return float(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TuneError(f"optimizer= got an optimizer already built ({type(optimizer).__name__}): the tuner needs "
                        f"to know its kind before the pipeline exists; {_HOW}, and build the optimizer on "
                        "pipe.parameters() afterwards")
    if not callable(optimizer):
        raise TuneError(f"optimizer={optimizer!r} is not an optimizer: {_HOW}")
    probe = nn.Parameter(torch.zeros(_PROBE))
    try:
        make = cast(Callable[[list[nn.Parameter]], torch.optim.Optimizer], optimizer)  # a class or a factory
        built = make([probe])
        probe.grad = torch.full_like(probe, 1e-3)
        built.step()
    except Exception as e:  # a user's factory: any failure is theirs to see, with what to pass instead
        raise TuneError(f"optimizer={optimizer!r} could not be probed on one parameter ({type(e).__name__}: {e}); "
                        f"{_HOW}") from e
    if not isinstance(built, torch.optim.Optimizer):
        raise TuneError(f"optimizer={optimizer!r} built a {type(built).__name__}, not a torch.optim.Optimizer; {_HOW}")
    held = sum(t.numel() * t.element_size() for t in built.state[probe].values()
               if isinstance(t, torch.Tensor) and t.numel() == _PROBE)
    return held / (_PROBE * probe.element_size())


def trainable_bytes(model: nn.Sequential) -> list[int]:
    """Bytes of the parameters that want gradients, per layer (a parameter several layers share counted in the
    first): what an optimizer steps."""
    seen: set[int] = set()
    out = []
    for layer in model:
        mine = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in mine)
        out.append(sum(p.numel() * p.element_size() for p in mine))
    return out


def per_device(balance: Sequence[int], names: Sequence[str], trainable: Sequence[int], ratio: float,
               devices: Sequence[torch.device]) -> tuple[int, ...]:
    """The optimizer state each of ``devices`` will hold: ``ratio`` times the trainable bytes of the partitions
    ``names`` puts on it (the first replica's devices; the optimizer steps ``pipe.parameters()``, which are the
    first replica's, so the other replicas' devices hold none)."""
    held = dict.fromkeys(devices, 0)
    start = 0
    for size, name in zip(balance, names):
        device = torch.device(name)
        if device in held:
            held[device] += int(ratio * sum(trainable[start:start + size]))
        start += size
    return tuple(held.values())


def with_state(t: Trial, c: Candidate, ratio: float, trainable: Sequence[int], placed: list[torch.device]) -> Trial:
    """Trial ``t`` (of candidate ``c``) with the optimizer state its partitions' parameters will have: added to
    its predicted peak per pipeline device, and kept per CUDA device for the bounds on its timed peaks."""
    added = [0] * len(t.memory_per_device)
    start = 0
    for size, slot in zip(c.balance, c.slots()):
        added[slot] += int(ratio * sum(trainable[start:start + size]))
        start += size
    per_slot = tuple(m + a for m, a in zip(t.memory_per_device, added))
    cuda = _gpus(placed)
    held = per_device(c.balance, c.devices, trainable, ratio, cuda) if cuda else ()
    return replace(t, memory_per_device=per_slot, memory_bytes=max(per_slot, default=t.memory_bytes),
                   optimizer_bytes=held)


def fullness(t: Trial, placed: Sequence[torch.device]) -> float:
    """The largest share of a GPU's memory trial ``t``'s timed peak plus its optimizer state fills (0 unmeasured)."""
    capacity = [torch.cuda.get_device_properties(d).total_memory for d in _gpus(placed)]
    return max((h / c for h, c in zip(t.held(), capacity)), default=0.0)


def with_room(confirmed: list[Trial], placed: list[torch.device]) -> list[Trial]:
    """The timed candidates whose allocated peak plus optimizer state stays within :data:`ROOM` of every GPU;
    :class:`MemoryCapError` where some were timed and none does (each would run out of memory once the
    optimizer has stepped)."""
    if not _gpus(placed) or not confirmed:
        return confirmed
    roomy = [t for t in confirmed if fullness(t, placed) <= ROOM]
    if not roomy:
        fullest = min(confirmed, key=lambda t: fullness(t, placed))
        raise MemoryCapError(f"no timed configuration leaves room for the optimizer's state: the least full "
                             f"({fullest.label()}) would hold {fullness(fullest, placed):.0%} of a GPU once the "
                             f"optimizer has stepped (over {ROOM:.0%}); use more GPUs, a smaller mini-batch, "
                             "checkpoint='always', or an optimizer that keeps less state")
    return roomy


def _gpus(placed: Sequence[torch.device]) -> list[torch.device]:
    """``placed``'s CUDA devices, each once, in order (how the timed peaks are kept)."""
    return [d for d in dict.fromkeys(placed) if d.type == "cuda"]


def _capacity(placed: Sequence[torch.device]) -> int | None:
    """The memory of the smallest of ``placed``'s GPUs (``None`` without one)."""
    cuda = _gpus(placed)
    return min(torch.cuda.get_device_properties(d).total_memory for d in cuda) if cuda else None


def predicted_to_fit(fits: list[Trial], placed: Sequence[torch.device]) -> list[Trial]:
    """The candidates (in order) whose predicted peak on every device, the optimizer's state included, is within
    the GPUs' memory; all of them where none is (predictions err, and the timed steps find out). Timing one
    that cannot fit costs its build and capture, and can leave the GPU without room for cuBLAS's workspace."""
    capacity = _capacity(placed)
    if capacity is None:
        return fits
    return [t for t in fits if t.memory_bytes <= capacity] or fits

