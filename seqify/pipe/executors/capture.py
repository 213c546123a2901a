"""Capture: programs warmed up and recorded as CUDA graphs, a device's in the order it issues them, in one memory pool.

Used by both replaying executors (in-process :mod:`.build` and a torchrun rank's
:func:`seqify.distributed.replay.capture`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from seqify.pipe.executors.pool_segments import expandable_segments
from seqify.pipe.executors.programs import Program

__all__ = ["capture_in_order", "saved_buffers", "warm"]


def saved_buffers(modules: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every buffer with a copy: building runs the partitions, which may update running statistics or
    counters, and must leave them as it found them."""
    return [(b, b.clone()) for part in modules for b in part.buffers()]


def warm(programs: list[Program], device: torch.device, warmup: int, stream: torch.cuda.Stream) -> None:
    """Run each program forward and backward ``warmup`` times outside capture (cuDNN/cuBLAS choose
    kernels and workspaces), leaving its input gradients (which inputs a gradient reaches) and its
    outputs' values from the last run; the accumulators are zeroed after."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for p in programs:
            for _ in range(warmup):
                p._outputs()
                p.backward_whole()
        if programs and programs[0].acc:
            torch._foreach_zero_(programs[0].acc)


def capture_in_order(order: Sequence[tuple[str, Program]], device: torch.device, stream: torch.cuda.Stream,
                      lanes: bool = False, expandable: bool = True) -> None:
    """Capture ``order``'s programs (("F" | "B" | "W", program), everything one device runs, in the
    order it runs it: one partition's programs or several partitions') as CUDA graphs sharing one
    memory pool, so memory is reused as eager execution would reuse it: a backward (a split one's W)
    frees what its forward kept, and a forward captured after it takes that memory again, whichever
    partition it belongs to; what a split B keeps for its W (the graph's activations, the boundary
    gradients) stays allocated until W is captured. Replaying in any other order would overwrite
    activations still needed, so a step must issue this device's programs in exactly this order.

    With ``lanes`` the backwards (B, W) take their memory from a pool of their own: a forward then only
    reuses memory some backward captured before it freed (so it must run after that backward, and may
    run beside the later ones), and a backward never reuses a forward's (see :class:`Lanes`).

    With ``expandable`` the pools grow in expandable segments (:func:`.pool_segments.expandable_segments`), so
    a pool holds little more than its most bytes alive at once."""
    pools = {"F": torch.cuda.graph_pool_handle()}
    pools["B"] = pools["W"] = torch.cuda.graph_pool_handle() if lanes else pools["F"]

    def captured(part: Callable[[], None], kind: str) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pools[kind], stream=stream):
            part()
        return graph

    with torch.cuda.device(device), torch.cuda.stream(stream), expandable_segments(expandable):
        forwards: dict[int, torch.cuda.CUDAGraph] = {}
        backwards: dict[int, torch.cuda.CUDAGraph | None] = {}
        for kind, p in order:
            key = id(p)
            flows = any(g is not None for g in p.out_grads)
            if kind == "W" and not p.split:  # an unsplit program's W is part of its B
                continue
            if kind == "F":
                forwards[key] = captured(p._outputs, kind)
            elif kind == "B" and not p.split:
                p.graphs = (forwards[key], captured(p._grads, kind) if flows else None, None)
            elif kind == "B" and flows and p._wrt_inputs():
                backwards[key] = captured(p._grads_input, kind)
            elif kind == "B":  # nothing to compute (no input needs a gradient): no empty graph
                p._grads_input()
                backwards[key] = None
            elif flows and p.params:
                p.graphs = (forwards[key], backwards.pop(key), captured(p._grads_weight, kind))
            else:  # no weights: W only lets B's graph go (no empty graph)
                p._grads_weight()
                p.graphs = (forwards[key], backwards.pop(key), None)
