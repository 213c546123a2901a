"""Replicas' state copied from the first partition by partition, each before the replicas' first forward of it."""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.cuda.nccl

from seqify.pipe.executors.replay import Replay
from seqify.pipe.replica_state import distinct_cuda
from seqify.pipe.side_streams import SideStreams

__all__ = ["PartitionCopies"]

#: Per replica, per partition, its flat tensors (:func:`~seqify.pipe.replica_state.flattened_by_partition`).
State = Sequence[Sequence[Sequence[torch.Tensor]]]


class PartitionCopies:
    """Gives the other replicas the first's parameters and buffers partition by partition, where a step
    replays programs: partition ``j`` must hold them only from the step's first forward of ``j``, so the
    copies of the later partitions run beside the forward of the earlier ones, and only the first
    partition's copy stays in front of the step (with ``loops``, a replica's partitions on one GPU).

    On CUDA devices (one per replica) every partition's copy is issued before the step as one NCCL broadcast per
    flat tensor on each GPU's collective stream, in partition order, after what the GPU's compute stream holds
    (the optimizer's step); each replica's compute stream, the first's included (its forward updates running
    statistics the broadcast reads), waits for partition ``j``'s copy before its first forward of ``j``, and
    the weights it casts under autocast are cast after. Elsewhere the first replica to reach ``j`` copies it
    to every other replica, under a lock (replicas may run in threads of their own)."""

    def __init__(self, streams: SideStreams) -> None:
        self._streams = streams
        self._lock = threading.Lock()
        self._events: defaultdict[tuple[int, int], torch.cuda.Event] = defaultdict(torch.cuda.Event)
        self._state: State = ()
        self._replays: list[Replay] = []
        self._pending: list[bool] = []

    @staticmethod
    def possible(replays: Sequence[Replay | None], state: State) -> bool:
        """Whether a step of these replays can take the state partition by partition: each replica replays
        programs over as many partitions as ``state`` has, on its own CUDA device per partition or on CPUs."""
        parts = len(state[0]) if state else 0
        if len(replays) != len(state) or any(r is None or len(r.devices) != parts for r in replays):
            return False
        for j in range(parts):
            devices = [r.devices[j] for r in replays if r is not None]
            if any(d.type == "cuda" for d in devices) and not distinct_cuda(devices):
                return False
        return True

    def begin(self, state: State, replays: Sequence[Replay]) -> None:
        """Before a step that must give the other replicas the first's state: issue the copies (CUDA) or mark
        them pending, and have each replay call in before a partition's first forward (:attr:`Replay.arrive`)."""
        self._state, self._replays = state, list(replays)
        self._pending = [True] * len(state[0])
        if replays[0].devices[0].type == "cuda":
            self._broadcast()
        for r, replay in enumerate(replays):
            replay.arrive = functools.partial(self._arrive, r)

    def finish(self) -> None:
        """After the step (or its failure): the replays no longer call in, a copy no replica reached is made
        (the others were), and the GPUs' compute streams wait for the copies (the first replica's weights
        must not change under a broadcast still reading them)."""
        for replay in self._replays:
            replay.arrive = None
        for j, pending in enumerate(self._pending):
            if pending:
                self._copy(j)
        if self._replays and self._replays[0].devices[0].type == "cuda":
            self._streams.join()
        self._state, self._replays, self._pending = (), [], []

    def _broadcast(self) -> None:
        """Every partition's copy, in order, on the collective streams; an event per replica and partition."""
        devices = {d for replay in self._replays for d in replay.devices}
        for d in devices:
            self._streams(d).wait_stream(torch.cuda.current_stream(d))
        with torch.no_grad():
            for j in range(len(self._pending)):
                streams = [self._streams(replay.devices[j]) for replay in self._replays]
                for group in zip(*(s[j] for s in self._state)):
                    torch.cuda.nccl.broadcast(list(group), root=0, streams=streams)
                for r, stream in enumerate(streams):
                    self._events[(r, j)].record(stream)
                self._pending[j] = False

    def _arrive(self, r: int, j: int) -> None:
        """Replica ``r`` is about to run partition ``j``'s first forward (on its thread, ``j``'s device current)."""
        device = self._replays[r].devices[j]
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._events[(r, j)])
            return
        with self._lock:
            if self._pending[j]:
                self._copy(j)

    def _copy(self, j: int) -> None:
        """Copy the first replica's partition ``j`` into every other replica's, on the host's order."""
        with torch.no_grad():
            for first, *others in zip(*(s[j] for s in self._state)):
                for other in others:
                    other.copy_(first)
        self._pending[j] = False
