"""One side stream per GPU for the replicas' NCCL calls, so that each GPU runs them in the order they were issued."""

from __future__ import annotations

import torch

__all__ = ["CollectiveStreams"]


class CollectiveStreams:
    """The stream each GPU runs the replicas' collectives on (a state copy before a partition's forward, a
    gradient sum after its backward), beside its compute stream. NCCL calls that share a communicator must run
    in the order they were issued on every GPU: on one stream per GPU they do."""

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
