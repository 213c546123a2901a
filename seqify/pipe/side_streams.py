"""One side stream per GPU beside its compute stream, made on first use (copy streams, collective streams)."""

from __future__ import annotations

import torch

__all__ = ["SideStreams"]


class SideStreams:
    """A stream per CUDA device, made the first time it is asked for: the copy streams of
    :class:`~seqify.pipe.transfer.Transfer`, and the replicas' collective streams, where NCCL calls that share a
    communicator run in the order they were issued on every GPU (a state copy before a partition's forward, a
    gradient sum after its backward)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __call__(self, device: torch.device) -> torch.cuda.Stream:
        """``device``'s stream (made on first use)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def join(self) -> None:
        """Every GPU's current stream waits for what its side stream was given so far."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
