"""seqify.distributed checkpoints in one process: per-stage files under the source's keys, merged or reloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import seqify
import seqify.distributed as sd
from helpers.dist_worker import Tiny
from seqify.errors import StateDictError

pytestmark = pytest.mark.timeout(60)


def staged(balance: list[int]) -> tuple[Tiny, list[sd.DistributedStage]]:
    torch.manual_seed(0)
    source = Tiny()
    seq = seqify.convert(source)
    return source, [sd.DistributedStage(seq, balance, index=i, device=torch.device("cpu")) for i in range(len(balance))]


def trained(stage: sd.DistributedStage) -> torch.optim.Optimizer:
    """Give the stage's parameters new values and its optimizer momentum (no pipeline needed)."""
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    for p in stage.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_stage_files_merge_into_the_source_checkpoint(tmp_path: Path) -> None:
    source, stages = staged([3, 3])
    for s in stages:
        sd.save(s, tmp_path, trained(s), extra={"step": 7})
    state = torch.load(tmp_path / "stage1.pt", weights_only=False)["state"]
    assert set(state) == {"c.weight", "c.bias"}  # stage 1 holds only its part, under the source's names
    fresh = Tiny()
    fresh.load_state_dict(sd.merge(tmp_path))  # strict: all of the source's keys, unused buffer included
    for k, v in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_load_restores_parameters_and_optimizer_state(tmp_path: Path) -> None:
    _, stages = staged([3, 3])
    opts = [trained(s) for s in stages]
    for s, o in zip(stages, opts):
        sd.save(s, tmp_path, o, extra=5)
    _, again = staged([3, 3])
    for s, o, before in zip(again, [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in again], stages):
        assert sd.load(s, tmp_path, o) == 5
        for p, q in zip(s.parameters(), before.parameters()):
            assert torch.equal(p, q)
        momentum = [o.state[p]["momentum_buffer"] for p in s.parameters()]
        expected = [opts[s.index].state[p]["momentum_buffer"] for p in before.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(momentum, expected))


def test_load_with_another_balance_says_how_to_restage(tmp_path: Path) -> None:
    _, stages = staged([3, 3])
    for s in stages:
        sd.save(s, tmp_path)
    _, other = staged([2, 4])
    with pytest.raises(StateDictError, match=r"balance \[3, 3\].*merge\(path\)"):
        sd.load(other[0], tmp_path)


def test_merge_of_a_folder_without_the_files_names_it(tmp_path: Path) -> None:
    with pytest.raises(StateDictError, match="stage0.pt does not exist"):
        sd.merge(tmp_path)
