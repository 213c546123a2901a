"""The tuner's memory bounds: the optimizer's state (bytes per parameter byte, and where it lands) and the GPUs."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seqify.errors import MemoryCapError, TuneError
from seqify.pipe.config import Trial
from seqify.tuning.predict import Candidate

__all__ = ["OptimizerSpec", "ROOM", "state_ratio", "step_ratio", "optimizer_ratio", "trainable_bytes", "per_device",
           "with_state", "with_room", "predicted_to_fit", "fullness"]

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
    return _probed(optimizer)[0]


def step_ratio(optimizer: OptimizerSpec) -> float:
    """Bytes ``optimizer``'s step allocates for a moment, on top of its state, per byte of parameters it steps,
    the way torch steps parameters on GPUs (its multi-tensor, ``foreach``, implementation, unless the optimizer
    was built ``fused``): Adam's square roots of its second moments, 1.0; SGD's, 0.0. Given a number, 0.0."""
    return _probed(optimizer)[1]


def optimizer_ratio(optimizer: OptimizerSpec) -> float:
    """What ``optimizer`` holds at the peak of its step per parameter byte: its state and its step's
    temporaries (:func:`state_ratio` plus :func:`step_ratio`). CUDA graphs' memory pools stay taken while the
    optimizer steps, so the tuner counts both beside a step's peak."""
    state, step = _probed(optimizer)
    return state + step


def _probed(optimizer: OptimizerSpec) -> tuple[float, float]:
    """(state, step temporaries) per parameter byte, from two steps of a probe parameter."""
    if optimizer is None:
        return 0.0, 0.0
    if isinstance(optimizer, bool):
        raise TuneError(f"optimizer={optimizer!r}: {_HOW}")
    if isinstance(optimizer, (int, float)):
        if not (math.isfinite(optimizer) and optimizer >= 0):
            raise TuneError(f"optimizer={optimizer!r}: the bytes of state per parameter byte must be finite and >= 0")
        return float(optimizer), 0.0
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
        if not isinstance(built, torch.optim.Optimizer):
            raise TuneError(f"optimizer={optimizer!r} built a {type(built).__name__}, not a torch.optim.Optimizer; "
                            f"{_HOW}")
        for group in built.param_groups:  # what torch picks for parameters on a GPU
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
        probe.grad = torch.full_like(probe, 1e-3)
        built.step()
        with _Peak(_PROBE) as peak:
            built.step()
    except TuneError:
        raise
    except Exception as e:  # a user's factory: any failure is theirs to see, with what to pass instead
        raise TuneError(f"optimizer={optimizer!r} could not be probed on one parameter ({type(e).__name__}: {e}); "
                        f"{_HOW}") from e
    held = sum(t.numel() * t.element_size() for t in built.state[probe].values()
               if isinstance(t, torch.Tensor) and t.numel() == _PROBE)
    size = _PROBE * probe.element_size()
    return held / size, peak.top / size


class _Peak(TorchDispatchMode):
    """The most bytes of new tensors of ``numel`` elements alive at once while it is entered (the probe's
    temporaries; scalars and views of existing tensors are left out)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.live, self.top = numel, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in known:
                known.add(t.untyped_storage().data_ptr())
                self.live += t.untyped_storage().nbytes()
                self.top = max(self.top, self.live)
                weakref.finalize(t, self._free, t.untyped_storage().nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


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
    """What the optimizer will hold on each of ``devices``: ``ratio`` times the trainable bytes of the partitions
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
    """Trial ``t`` (of candidate ``c``) with what the optimizer will hold for its partitions' parameters (``ratio``
    per parameter byte, :func:`optimizer_ratio`): added to its predicted peak per pipeline device, and kept per
    CUDA device for the bounds on its timed peaks."""
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
    """The largest share of a GPU's memory trial ``t``'s timed step plus its optimizer fills (0 unmeasured):
    :meth:`Trial.occupied`."""
    capacity = [torch.cuda.get_device_properties(d).total_memory for d in _gpus(placed)]
    return max((h / c for h, c in zip(t.occupied(), capacity)), default=0.0)


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

