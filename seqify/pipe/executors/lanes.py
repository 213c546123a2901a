"""Lanes: a GPU's forwards on one stream and its backwards on another, ordered only where memory or data says."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["Lanes"]


class Lanes:
    """Two streams per GPU for a replayed step: forwards (F) on one, backwards (B and W) on the other.

    A micro-batch's backward may then run beside another micro-batch's forward: at the small micro-batches
    of a deep pipeline one kernel does not fill the GPU, and two kernels at once fill it better. It is safe
    because the programs were captured with the backwards in a memory pool of their own
    (:func:`~seqify.pipe.executors.capture.capture_in_order` with ``lanes``): a forward can only reuse memory a
    backward captured before it freed, so each forward waits for the latest backward issued on its GPU
    before it; a backward waits for its own forward (its activations, and the loss seeded from it), given
    as ``made``. The two lanes start after what the caller queued before the step (:meth:`open`) and the
    caller's streams wait for both at its end (:meth:`close`)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.streams = {d: (torch.cuda.Stream(d), torch.cuda.Stream(d)) for d in dict.fromkeys(devices)}
        self.back = {d: torch.cuda.Event() for d in self.streams}  # each GPU's latest backward issued

    def open(self) -> None:
        """Start both lanes of every GPU after the work its current stream holds (the optimizer's)."""
        for d, lanes in self.streams.items():
            for lane in lanes:
                lane.wait_stream(torch.cuda.current_stream(d))

    def close(self) -> None:
        """Make every GPU's current stream wait for both lanes (the gradients and the loss are there)."""
        for d, lanes in self.streams.items():
            for lane in lanes:
                torch.cuda.current_stream(d).wait_stream(lane)

    @contextmanager
    def enter(self, device: torch.device, kind: str, made: torch.cuda.Event | None = None) -> Iterator[None]:
        """Issue one ``kind`` action of ``device`` (its copies in, its program, its events) on its lane."""
        forward, backward = self.streams[device]
        lane = forward if kind == "F" else backward
        with torch.cuda.stream(lane):
            if kind == "F":
                lane.wait_event(self.back[device])
            elif made is not None:
                lane.wait_event(made)
            yield
            if kind != "F":
                self.back[device].record(lane)
