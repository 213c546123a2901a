"""A conversion that holds a program per mode, over seqify.distributed ranks: training steps and evaluation in
turn equal one process running the source the same way (gloo, float64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import dist_worker as worker
from helpers.procs import free_port, spawn

pytestmark = pytest.mark.timeout(120)
STEPS = 2


def test_ranks_train_and_evaluate_in_turn_like_one_process(tmp_path: Path) -> None:
    spawn(worker.modes_spawned, (2, free_port(), str(tmp_path), STEPS), nprocs=2)
    last = torch.load(tmp_path / "rank1.pt", weights_only=False)
    torch.manual_seed(0)
    model = worker.ModeNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = worker.data("skippy", 8)
    for step in range(STEPS):
        model.train()
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(a), b) * (len(a) / len(x)) for a, b in zip(x.tensor_split(2), y.tensor_split(2)))
        loss.backward()
        opt.step()
        assert last["losses"][step] == pytest.approx(float(loss), rel=1e-12, abs=1e-12)
        model.eval()
        with torch.no_grad():
            want = torch.cat([model(a) for a in x.tensor_split(2)])
        torch.testing.assert_close(last["outputs"][step], want, rtol=1e-12, atol=1e-13)
