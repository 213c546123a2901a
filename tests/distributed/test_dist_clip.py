"""seqify.clip_grad_norm_ over torchrun ranks and data-parallel replicas: the global norm of one process, bit for bit
on the same gradients (real gloo processes, float64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import dist_worker as worker
from helpers.procs import free_port, spawn

pytestmark = pytest.mark.timeout(120)


def one_process(grads: dict[str, torch.Tensor], norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """torch.nn.utils.clip_grad_norm_ on the source model holding ``grads``: its total and clipped gradients."""
    model = worker.build("skippy")
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm)
    return total, {n: p.grad for n, p in model.named_parameters()}


def test_clipping_over_two_ranks_and_two_replicas_equals_one_process(tmp_path: Path) -> None:
    # 4 processes: 2 replicas of 2 ranks x 2 partitions (interleaved); each rank holds a part of the gradients,
    # each replica a copy of them
    spawn(worker.clip_spawned, args=(4, free_port(), str(tmp_path), [3, 3, 4, 4], 2), nprocs=4, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    before = {n: g for r in results if r["replica"] == 0 for n, g in r["grads"].items()}
    assert len(before) == len(list(worker.build("skippy").parameters()))  # the ranks' parts make the whole model
    for r in results[2:]:  # replica 1's gradients are replica 0's: averaged over the replicas by the step
        for n, g in r["grads"].items():
            assert torch.equal(g, before[n]), n

    # the same gradients as one process: the totals and clipped gradients bit-equal to torch's on them
    for norm in (2.0, "inf"):
        total, clipped = one_process(before, norm)
        assert total > 1e-3  # the gradients are clipped
        for r in results:
            assert torch.equal(r[norm][0], total), (norm, r[norm][0], total)
            for n, g in r[norm][1].items():
                assert torch.equal(g, clipped[n]), (norm, n)

    # and the pipeline's gradients are one process's on the whole batch (the replicas' shards averaged)
    model = worker.build("skippy").train()
    x, y = worker.data("skippy", 8, 0)
    for half in (slice(0, 4), slice(4, 8)):
        xs, ys = x[half], y[half]
        loss = sum(F.cross_entropy(model(a), b) * (len(a) / len(xs)) for a, b in zip(xs.tensor_split(2),
                                                                                     ys.tensor_split(2)))
        (loss / 2).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)
