"""Transfer: move tensors between devices, on copy streams, with autograd and allocator safety."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from seqify.errors import DeviceError
from seqify.pipe.side_streams import SideStreams

__all__ = ["Transfer", "refuse_meta"]


def refuse_meta(value: Any, what: str, device: torch.device, names: list[str] | None = None) -> None:
    """A :class:`DeviceError` for a tensor in ``value`` (called ``what``; a tuple's tensors by ``names`` where
    given) on the meta device: it has a shape but no data to copy to ``device``, where the pipeline runs it."""
    for path, t in pytree.tree_flatten_with_path(value)[0]:
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            continue
        where = f"{what}{pytree.keystr(path)}"
        if names and isinstance(value, torch.Tensor) and len(names) == 1:
            where = f"{what} {names[0]!r}"
        elif names and type(value) is tuple and len(names) == len(value):
            key = path[0]
            assert isinstance(key, pytree.SequenceKey)  # a tuple's top-level keys are its indices
            where = f"{what} {names[key.idx]!r}"
        raise DeviceError(
            f"{where} of shape {tuple(t.shape)} is on the meta device: a shape without data, which cannot be "
            f"copied to {device}, where the pipeline takes it. Pass a tensor holding data (on the CPU or any GPU: "
            "it is moved); for shapes alone, run a meta copy of the converted model on it "
            "(copy.deepcopy(seq).to('meta')(x)), not a pipeline")


class Transfer:
    """Moves values (tensors, or structures holding them) to a device.

    On CUDA each destination device has its own copy stream: the copy waits for the stream that made
    the tensor, the destination's compute stream waits for the copy, and both tensors are recorded on
    the streams that use them so the caching allocator never reuses their memory early. No host
    synchronisation happens. ``.to()`` is differentiable, so gradients flow back the same way.
    """

    def __init__(self) -> None:
        self._streams = SideStreams()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of ``device`` (made on first use)."""
        return self._streams(device)

    def tensor(self, t: torch.Tensor, device: torch.device, ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """``t`` on ``device``; on CUDA the copy starts once ``ready`` (recorded where ``t`` was made) has
        passed, or once everything queued on ``t``'s device so far has, without an event."""
        if t.device == device:
            return t
        if device.type != "cuda" and t.device.type != "cuda":
            return t.to(device)
        copy_device = device if device.type == "cuda" else t.device
        stream = self.stream(copy_device)
        if t.device.type == "cuda":
            if ready is not None:
                stream.wait_event(ready)
            else:
                stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            moved = t.to(device, non_blocking=True)
        if t.device.type == "cuda":
            t.record_stream(stream)
        if device.type == "cuda":
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(stream)
            moved.record_stream(compute)
        else:
            stream.synchronize()  # a CPU destination can only read the data once the copy is done
        return moved

    def __call__(
        self,
        value: Any,
        device: torch.device,
        ready: torch.cuda.Event | None = None,
        memo: dict[int, Any] | None = None,
    ) -> Any:
        """``value`` on ``device``. With ``memo`` (one dict per destination and step), a tensor sent twice
        (as the carried value and as a skip, say) arrives as one tensor, so an in-place change through
        one name is seen through the other, as in the source."""
        if memo is None:
            move = lambda t: self.tensor(t, device, ready)  # noqa: E731
        else:

            def move(t: torch.Tensor) -> torch.Tensor:
                if t.device == device:
                    return t
                moved = memo.get(id(t))
                if moved is None:
                    moved = memo[id(t)] = self.tensor(t, device, ready)
                return moved

        if isinstance(value, torch.Tensor):
            return move(value)
        if type(value) is tuple:
            return tuple(move(t) if isinstance(t, torch.Tensor) else t for t in value)
        return pytree.tree_map(lambda t: move(t) if isinstance(t, torch.Tensor) else t, value)

    @staticmethod
    def mark(device: torch.device) -> torch.cuda.Event | None:
        """An event at the end of the work queued so far on ``device`` (None off CUDA): values made
        there so far can be copied once it has passed, whatever is queued after it."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
