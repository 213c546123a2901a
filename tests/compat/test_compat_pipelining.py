"""seqify.compat.pipelining against torch.distributed.pipelining itself: split points and schedule steps."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as torch_pipelining

import seqify
from helpers.exactness import by_micro_batch
from seqify.compat.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline, split_balance

pytestmark = pytest.mark.timeout(120)


class Block(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(n, n), nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.layer2 = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(torch.relu(self.stem(x)))))


def net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def stage_keys(pipe: seqify.Pipeline) -> list[set[str]]:
    """Per partition, the source model's parameter names of the parameters it holds."""
    key_of = {t.data_ptr(): k for k, t in pipe.model.original_state_dict().items()}
    return [{key_of[p.data_ptr()] for p in part.parameters()} for part in pipe.partitions]


@pytest.mark.parametrize("point", [SplitPoint, torch_pipelining.SplitPoint])
def test_split_points_put_the_same_parameters_in_each_stage_as_torch(point: type) -> None:
    x = torch.randn(2, 4, dtype=torch.float64)
    spec = {"layer1.1": point.BEGINNING, "layer2": point.END}
    theirs = torch_pipelining.pipeline(net(), (x,), split_spec={k: torch_pipelining.SplitPoint[v.name] for k, v in spec.items()})
    expected = [{n for n, _ in theirs.get_stage_module(i).named_parameters()} for i in range(theirs.num_stages)]
    source = net()
    pipe = pipeline(copy.deepcopy(source), (x,), split_spec=spec, devices=["cpu"] * 3)
    assert stage_keys(pipe) == expected
    assert torch.equal(pipe(x), source(x))


def test_a_list_of_split_points_begins_a_stage_at_each() -> None:
    x = torch.randn(2, 4, dtype=torch.float64)
    seq = seqify.convert(net(), (x,))
    assert split_balance(seq, ["layer1.1", "head"]) == split_balance(
        seq, {"layer1.1": SplitPoint.BEGINNING, "layer2": SplitPoint.END}
    )
    pipe = pipeline(net(), (x,), split_points=["layer2.0.b"], devices=["cpu", "cpu"])
    second = stage_keys(pipe)[1]
    assert "layer2.0.b.weight" in second and "layer2.0.a.weight" not in second


def test_plain_sequential_splits_at_children() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    assert split_balance(model, ["2"]) == [2, 2]
    assert split_balance(model, {"1": SplitPoint.END}) == [2, 2]


@pytest.mark.parametrize(
    "spec, phrases",
    [
        (["layer3"], ["'layer3'", "did you mean", "named_modules"]),
        (["stem"], ["'stem'", "no layers", "drop it"]),
        ({"head": SplitPoint.END}, ["'head'", "no layers"]),
        ({"layer1": SplitPoint.END, "layer2": SplitPoint.BEGINNING}, ["'layer1'", "'layer2'", "drop one"]),
        ({"layer1": "MIDDLE"}, ["'layer1'", "SplitPoint.BEGINNING"]),
    ],
)
def test_bad_split_points_say_what_to_do(spec: object, phrases: list[str]) -> None:
    seq = seqify.convert(net(), (torch.randn(2, 4, dtype=torch.float64),))
    with pytest.raises(seqify.SplitPointError) as info:
        split_balance(seq, spec)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


def test_split_points_given_where_mb_kwargs_go_are_explained() -> None:
    with pytest.raises(seqify.SplitPointError, match="split_points="):
        pipeline(net(), (torch.randn(2, 4, dtype=torch.float64),), ["layer2"])  # type: ignore[arg-type]


def test_a_name_inside_a_plain_sequential_layer_points_to_convert() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(seqify.SplitPointError, match="seqify.convert"):
        split_balance(model, ["1.0"])


@pytest.fixture
def one_rank() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ours, theirs", [(ScheduleGPipe, "ScheduleGPipe"), (Schedule1F1B, "Schedule1F1B")])
@pytest.mark.parametrize("scale_grads", [True, False])
def test_step_fills_losses_and_gradients_as_torchs_schedule(one_rank: None, ours: type, theirs: str, scale_grads: bool) -> None:
    """torch's schedule on one stage (the whole model, one rank) is the reference."""
    source = net()
    ref = copy.deepcopy(source)
    x = torch.randn(7, 4, dtype=torch.float64)
    y = torch.randn(7, 3, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    stage = torch_pipelining.PipelineStage(ref, 0, 1, torch.device("cpu"))
    schedule = getattr(torch_pipelining, theirs)(stage, 3, loss_fn=loss_fn, scale_grads=scale_grads)
    expected_losses: list[torch.Tensor] = []
    expected = schedule.step(x, target=y, losses=expected_losses)

    pipe = pipeline(source, (x,), split_spec=["layer2"], devices=["cpu", "cpu"])
    losses: list[torch.Tensor] = [torch.zeros(())]  # cleared first, as torch does
    out = ours(pipe, 3, loss_fn=loss_fn, scale_grads=scale_grads).step(x, target=y, losses=losses)
    assert torch.equal(out, expected)
    assert pipe.schedule == ("1f1b" if ours is Schedule1F1B else "gpipe")  # run in that order by pipe.step
    assert len(losses) == 3 and all(torch.equal(a, b) for a, b in zip(losses, expected_losses))
    for (name, p), q in zip(source.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_eval_fills_losses_without_gradients() -> None:
    source = net()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    pipe = pipeline(source, (x,), split_spec=["layer2"], devices=["cpu", "cpu"])
    losses: list[torch.Tensor] = []
    out = ScheduleGPipe(pipe, 2, loss_fn=nn.functional.mse_loss).eval(x, target=y, losses=losses)
    with torch.no_grad():
        expected = [nn.functional.mse_loss(source(xi), yi) for xi, yi in zip(x.tensor_split(2), y.tensor_split(2))]
    assert [float(v) for v in losses] == [float(v) for v in expected]
    assert not any(v.requires_grad for v in losses)
    assert torch.equal(out, by_micro_batch(source, (x,), 2)) and all(p.grad is None for p in source.parameters())
