"""Replicas' gradients summed partition by partition, each as soon as every replica's backward has passed it."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch
import torch.cuda.nccl

from seqify.pipe.executors.replay import Replay
from seqify.pipe.replica_state import distinct_cuda
from seqify.pipe.side_streams import SideStreams

__all__ = ["PartitionSums"]


class PartitionSums:
    """Adds the replicas' gradient sums of partition ``j`` (each replica's programs' flat accumulators) into the
    first replica's once every replica has issued ``j``'s last backward action, while the backward of the
    partitions before ``j`` still runs: DDP's buckets, one per partition (a pipeline's partitions on one GPU,
    ``loops``, make several buckets per GPU).

    On CUDA devices (one per replica) each sum is one NCCL reduce per flat tensor on the GPU's collective stream,
    which waits for that replica's backward of ``j`` on the GPU, not on the host; elsewhere the sums are added in
    replica order when the last replica gets there. The replicas may run in threads of their own (one lock orders
    the calls). The first replica's ``.grad`` is set by :meth:`finish`, once every replica's step has ended.

    Every sum is made in place, in the first replica's sums (a reduce) or, where every replica receives it, in
    every replica's (an all-reduce); ``.grad`` is then views of those sums, not a copy of them
    (:class:`~seqify.pipe.executors.grad_views.GradViews`)."""

    def __init__(self, streams: SideStreams | None = None) -> None:
        self._lock = threading.Lock()
        self._streams = streams or SideStreams()
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._replays: list[Replay] = []
        self._arrived: list[int] = []
        self._receivers = 1  # the replicas whose .grad gets the sums: the first, or every one

    @staticmethod
    def possible(replays: Sequence[Replay]) -> bool:
        """Whether these replicas' steps can be summed partition by partition: every one's sums are flat
        (:attr:`Replay.sums`), with the same partitions and flat tensors, and NCCL joins each partition's
        devices where they are GPUs."""
        first = replays[0]
        if any(r.sums is None for r in replays) or any(len(r.stages) != len(first.stages) for r in replays):
            return False
        for j in range(len(first.stages)):
            shapes = {tuple((f.numel(), f.dtype) for f in r.sums[j]) for r in replays}  # type: ignore[index]
            devices = [r.devices[j] for r in replays]
            if len(shapes) > 1 or (any(d.type == "cuda" for d in devices) and not distinct_cuda(devices)):
                return False
        return True

    @staticmethod
    def everyone_possible(replays: Sequence[Replay]) -> bool:
        """Whether every replica can receive this step's sums: no parameter of the first replica's partitions holds
        a ``.grad`` (one to add to would differ between replicas)."""
        return all(p.grad is None for params, _ in replays[0].handoff for p in params)

    def begin(self, replays: Sequence[Replay], everyone: bool = False) -> None:
        """Before a step: each replay tells this when a partition's sums are final (see :attr:`Replay.ready`);
        with ``everyone`` (where :meth:`everyone_possible`), every replica's ``.grad`` gets the sums, replacing
        what the others held."""
        self._replays = list(replays)
        self._arrived = [0] * len(replays[0].stages)
        self._receivers = len(replays) if everyone else 1
        if everyone:
            for replay in replays[1:]:
                for params, _ in replay.handoff:
                    for p in params:
                        p.grad = None
        for r, replay in enumerate(replays):
            replay.ready = functools.partial(self._ready, r)

    def finish(self, hand: bool = True) -> bool:
        """After every replica's step (or its failure, ``hand=False``): the GPUs' streams wait for the sums,
        the replays no longer call in, and, where every partition was summed and ``hand``, the first replica's
        ``.grad`` gets the sums. Whether it did."""
        replays, self._replays = self._replays, []
        for replay in replays:
            replay.ready = None
        self._streams.join()
        done = bool(replays) and all(n == len(replays) for n in self._arrived)
        if hand and done:
            with torch.no_grad():
                for r in range(self._receivers):
                    replays[r].hand()
        return hand and done

    def _ready(self, r: int, j: int) -> None:
        """Replica ``r`` has issued partition ``j``'s last backward action (on its thread, ``j``'s device current)."""
        device = self._replays[r].devices[j]
        if device.type == "cuda":
            event = self._events.get((r, j))
            if event is None:
                event = self._events[(r, j)] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        with self._lock:
            self._arrived[j] += 1
            if self._arrived[j] == len(self._replays):
                self._sum(j)

    def _sum(self, j: int) -> None:
        """Add every replica's sums of partition ``j`` in place: into the first's, or into every receiver's."""
        replays = self._replays
        groups = list(zip(*(replay.sums[j] for replay in replays)))  # type: ignore[index]
        devices = [replay.devices[j] for replay in replays]
        with torch.no_grad():
            if devices[0].type != "cuda":
                self._add(groups, self._receivers)
                return
            streams = [self._streams(d) for d in devices]
            for r, stream in enumerate(streams):
                stream.wait_event(self._events[(r, j)])
            for group in groups:
                if self._receivers == 1:
                    torch.cuda.nccl.reduce(list(group), root=0, streams=streams)
                else:
                    torch.cuda.nccl.all_reduce(list(group), streams=streams)

    @staticmethod
    def _add(groups: list[tuple[torch.Tensor, ...]], receivers: int) -> None:
        """Off CUDA: each group's sum in replica order into the first's tensor, then copied into the other
        receivers'."""
        for group in groups:
            first = group[0]
            for other in group[1:]:
                first.add_(other.to(first.device))
            for other in group[1:receivers]:
                other.copy_(first)
