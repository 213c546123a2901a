"""Moves: a placed pipeline keeps its devices; ``.to()``, ``.cuda()``, ``.cpu()`` that would move it are refused."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from seqify.errors import DeviceError

__all__ = ["moved_to", "refuse_move"]


def _index(device: torch.device) -> int:
    """``device``'s index, the current CUDA device where a CUDA device names none (CPU: 0)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and _index(a) == _index(b)


def refuse_move(devices: Sequence[torch.device], target: torch.device | str | int, how: str) -> None:
    """Raise :class:`DeviceError` when ``how`` (the call, for the message) would put a partition on
    ``devices`` (each partition's) anywhere but where it is; a move to the devices it has passes."""
    to = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
    placed = [torch.device(d) for d in devices]
    if all(_same(d, to) for d in placed):
        return
    names = ", ".join(map(str, placed))
    raise DeviceError(
        f"{how} would move the pipeline's partitions, placed on [{names}], to {to}; a pipeline is placed when it "
        "is built (its balance, transfers and streams are per device) and does not move afterwards, so nothing "
        f"was moved. Build the pipeline again on the devices you want: seqify.pipeline(model, devices=[...]) "
        "(one device per partition). Casts that keep every tensor on its device work in place: pipe.double(), "
        "pipe.half(), pipe.to(torch.float64)"
    )


def moved_to(fn: Callable[[torch.Tensor], torch.Tensor], devices: Iterable[torch.device]) -> torch.device | None:
    """Where ``fn`` (what ``nn.Module._apply`` calls on each tensor) sends an empty tensor on one of
    ``devices`` when that is another device, else None: the move is known before any tensor changes."""
    for device in dict.fromkeys(torch.device(d) for d in devices):
        probe = torch.empty(0, device=device)
        with torch.no_grad():
            out = fn(probe)
        if isinstance(out, torch.Tensor) and out.device != probe.device:
            return out.device
    return None
