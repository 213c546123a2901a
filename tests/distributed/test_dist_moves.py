"""A distributed stage is placed when it is built: moves to other devices are refused, casts work in place."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import seqify
import seqify.distributed as sd
from helpers.dist_worker import Tiny

pytestmark = pytest.mark.timeout(60)

MOVES: dict[str, Callable[[sd.DistributedStage], object]] = {
    "to-meta": lambda s: s.to("meta"),
    "to-meta-and-float64": lambda s: s.to("meta", torch.float64),
    "cuda": lambda s: s.cuda(),
    "to-empty-on-meta": lambda s: s.to_empty(device="meta"),
}


def stages() -> list[sd.DistributedStage]:
    torch.manual_seed(0)
    seq = seqify.convert(Tiny())
    return [sd.DistributedStage(seq, [3, 3], index=i, device=torch.device("cpu")) for i in range(2)]


@pytest.mark.parametrize("move", list(MOVES))
def test_a_move_to_another_device_is_refused_and_nothing_moves(move: str) -> None:
    stage = stages()[0]
    before = [(t.device, t.dtype, t.detach().clone()) for t in stage.state_dict().values()]
    with pytest.raises(seqify.DeviceError) as info:
        MOVES[move](stage)
    for phrase in ("placed on [cpu]", "nothing was moved", "seqify.distributed.stage(model, device=...)",
                   "stage.double()"):
        assert phrase in str(info.value), str(info.value)
    after = [(t.device, t.dtype, t) for t in stage.state_dict().values()]
    assert [(d, t) for d, t, _ in after] == [(d, t) for d, t, _ in before]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after, before))


def test_casts_and_moves_to_its_own_device_work_in_place() -> None:
    stage = stages()[0]
    params = list(stage.parameters())
    assert stage.cpu() is stage and stage.to("cpu") is stage
    assert stage.double() is stage
    assert [p.dtype for p in stage.parameters()] == [torch.float64] * len(params)
    assert all(a is b for a, b in zip(stage.parameters(), params))  # the optimizer's parameters stay its own


def test_a_stage_builds_its_optimizer_as_a_pipeline_does() -> None:
    """``stage.optimizer(factory)``: the same training loop as an in-process pipeline, over this rank's
    parameters; a factory that builds on other parameters is refused, naming the rank."""
    first, second = stages()
    opt = first.optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["params"] == list(first.parameters())
    with pytest.raises(seqify.OptionError, match="parameters it was not given .*stage 1/2"):
        first.optimizer(lambda params: torch.optim.SGD(second.parameters(), lr=0.1))
