"""Moves: a placed pipeline keeps its devices; ``.to()``, ``.cuda()``, ``.cpu()`` that would move it are refused."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from seqify.errors import DeviceError
from seqify.model.sequential import retie, tied_slots

__all__ = ["moved_to", "refuse_move", "Placed"]

PIPELINE = "seqify.pipeline(model, devices=[...]) (one device per partition)"


def _index(device: torch.device) -> int:
    """``device``'s index, the current CUDA device where a CUDA device names none (CPU: 0)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and _index(a) == _index(b)


def refuse_move(devices: Sequence[torch.device], target: torch.device | str | int, how: str,
                rebuild: str = PIPELINE, name: str = "pipe") -> None:
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
        f"was moved. Build the pipeline again on the devices you want: {rebuild}. Casts that keep every tensor "
        f"on its device work in place: {name}.double(), {name}.half(), {name}.to(torch.float64)"
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


class Placed(nn.Module):
    """A module placed on its devices once: ``.to()``, ``.cuda()``, ``.cpu()`` and tensor conversions
    (``.to_empty()``, ``.type()``) that would move it raise :class:`DeviceError` before anything changes;
    casts that keep every tensor on its device go through, tensors that layers share staying shared."""

    _rebuild = PIPELINE  # what the refusal tells to do instead

    def _placed(self) -> list[torch.device]:
        raise NotImplementedError

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            refuse_move(self._placed(), device, f"{self._said()}.to({str(device)!r})", self._rebuild,
                        self._said())
        return super().to(*args, **kwargs)

    def cuda(self, device: int | torch.device | None = None) -> Any:
        said = "" if device is None else repr(device)
        refuse_move(self._placed(), "cuda" if device is None else device, f"{self._said()}.cuda({said})",
                    self._rebuild, self._said())
        return super().cuda(device)

    def cpu(self) -> Any:
        refuse_move(self._placed(), "cpu", f"{self._said()}.cpu()", self._rebuild, self._said())
        return super().cpu()

    def _said(self) -> str:
        return "pipe" if self._rebuild == PIPELINE else "stage"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (behind ``.to``, ``.double()``, ``.to_empty()``, ...) once ``fn`` is known to
        leave every tensor on its device (checked on an empty tensor per device, before any changes)."""
        held = [t.device for t in self.parameters()] + [t.device for t in self.buffers()]
        target = moved_to(fn, [*map(torch.device, self._placed()), *held])
        if target is not None:
            refuse_move(self._placed(), target, "converting the tensors (.to_empty(), .type(), ...)", self._rebuild,
                        self._said())
        groups = tied_slots(self)
        super()._apply(fn, recurse)
        self._applied(fn)
        retie(groups)
        return self

    def _applied(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """What else a conversion ``fn`` of the module's tensors changes (state it holds outside its modules)."""
