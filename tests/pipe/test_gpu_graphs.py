"""CUDA graphs under every schedule (marked gpu; one GPU or two): pipe.step replays what eager pipe.step computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import seqify
from seqify.pipe.executors.replay import Replay
from seqify.schedule.actions import ahead, make
from seqify.pipe.executors.replayed import GraphWarning
from helpers.gpu_checks import relative, strict_fp32  # noqa: F401  (strict_fp32: autouse fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]


close = relative(1e-4)


def layouts() -> list[tuple[str, int]]:
    """(schedule, partitions per GPU): with one GPU, partitions share it (1f1b: one partition)."""
    return [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h1", 2), ("zb-h2", 1), ("gpipe", 2)]


def twins(source: torch.nn.Module, loops: int, **options: object) -> tuple[torch.nn.Module, seqify.Pipeline, seqify.Pipeline]:
    """A copy of ``source`` and two pipelines over the same even cuts (``loops`` partitions per GPU, one or
    two GPUs): ``source`` converted and run eagerly, the copy converted and run with graphs=True."""
    twin = copy.deepcopy(source)
    seq, seq2 = seqify.convert(source), seqify.convert(twin)
    gpus = min(torch.cuda.device_count(), 2)
    parts, n = gpus * loops, len(seq)
    balance = [n // parts] * (parts - 1) + [n - (n // parts) * (parts - 1)]
    kwargs = dict(gpus=gpus, loops=loops, balance=balance, **{"chunks": 4, **options})
    overlap = kwargs.pop("overlap", False)
    return twin, seqify.pipeline(seq, **kwargs), seqify.pipeline(seq2, **kwargs, graphs=True, overlap=overlap)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule,loops", layouts())
def test_graphed_step_matches_eager_step(schedule: str, loops: int) -> None:
    """Three SGD steps of pipe.step with graphs=True (programs captured in the schedule's own order,
    so memory is reused as the schedule frees it) against the same schedule run eagerly: losses,
    gradients and BatchNorm statistics agree, and the step really replayed."""
    replay = _graphed_steps(schedule, loops)
    assert replay.lanes is None


@pytest.mark.parametrize("schedule,loops", layouts())
def test_two_lanes_step_matches_eager_step(schedule: str, loops: int) -> None:
    """overlap=True: each GPU replays forwards on one stream and backwards on another (backward programs
    captured in a pool of their own, forwards issued a run earlier): the same agreement with the eager
    step, step after step; the memory plan counts the micro-batch more in flight."""
    replay = _graphed_steps(schedule, loops, chunks=8, batch=64, overlap=True)
    issued = replay.schedule
    assert replay.lanes is not None
    assert issued.actions == ahead(make(issued.name, issued.placement, issued.microbatches)).actions


def _graphed_steps(schedule: str, loops: int, chunks: int = 4, batch: int = 16, overlap: bool = False) -> Replay:
    """Three SGD steps of an eager and a graphed pipeline from one ResNet-18, compared; the replay."""
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=10).train()
    twin, eager, graphed = twins(source, loops, checkpoint="never", schedule=schedule, chunks=chunks, overlap=overlap)
    sample = torch.randn(batch, 3, 64, 64, device="cuda:0")
    if overlap:  # the plan follows the order the lanes issue: a device holds at most one micro-batch more
        planned = graphed.plan_memory(sample).per_device
        graphed._replayer.overlap = False
        alone = graphed.plan_memory(sample).per_device
        graphed._replayer.overlap = True
        assert all(b >= a for a, b in zip(alone, planned))
        assert (planned != alone) == (schedule != "gpipe")  # fill-drain keeps every micro-batch in flight anyway
    opt_a = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(graphed.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    # Planning memory first (a measuring pass) must leave capture working: saved-tensor hooks broke it.
    assert all(b > 0 for b in graphed.plan_memory(torch.randn(16, 3, 64, 64, device="cuda:0")).per_device)
    for step in range(3):
        x = torch.randn(batch, 3, 64, 64, device="cuda:0")
        y = torch.randint(0, 10, (batch,), device="cuda:0")
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=step % 2 == 0)
        a = eager.step(x, y, loss_fn)
        b = graphed.step(x, y, loss_fn)
        close(b, a, f"step {step} loss")
        for (name, p), q in zip(source.named_parameters(), twin.parameters()):
            close(q.grad, p.grad, f"step {step} grad {name}")
        for (name, p), q in zip(source.named_buffers(), twin.buffers()):
            close(q.float(), p.float(), f"step {step} buffer {name}")
        opt_a.step()
        opt_b.step()
    assert graphed.graph_error is None and graphed._graphed is not None
    replay = graphed._graphed[1]
    assert replay.schedule.name == schedule and all(p.graphs is not None for row in replay.programs for p in row)
    # zero bubble replays B and W as separate graphs (every partition has weights, so each W is captured)
    split = replay.schedule.split
    assert all(p.split == split and (p.graphs[2] is not None) == split for row in replay.programs for p in row)
    return replay


@pytest.mark.parametrize("loops", [1, 2])
def test_inference_replays_forward_graphs(loops: int) -> None:
    """Under torch.no_grad() in eval mode, graphs=True replays forward-only graphs: outputs as eager's,
    step after step (new inputs each time), with no gradient buffers."""
    torch.manual_seed(0)
    source = torchvision.models.resnet50(num_classes=10).eval()
    _, eager, graphed = twins(source, loops, checkpoint="never")
    eager.eval()
    graphed.eval()
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(16, 3, 64, 64, device="cuda:0")
            close(graphed(x), eager(x), f"step {step} output")
    assert graphed.graph_error is None and graphed._graphed is not None
    replay = graphed._graphed[1]
    assert all(p.graphs is not None and not p.acc for row in replay.programs for p in row)


@pytest.mark.parametrize("schedule,loops", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 2)])
def test_checkpointed_graphs_recompute_inside_the_captured_backward(schedule: str, loops: int) -> None:
    """checkpoint='always' with graphs=True: forward graphs keep only their inputs, backward graphs
    recompute; gradients and BatchNorm statistics as the eager checkpointed step's. A partition with
    dropout cannot replay its draws in a captured recomputation: that pipeline falls back to eager."""
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=10).train()
    twin, eager, graphed = twins(source, loops, checkpoint="always", schedule=schedule)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(2):
        x = torch.randn(16, 3, 64, 64, device="cuda:0")
        y = torch.randint(0, 10, (16,), device="cuda:0")
        close(graphed.step(x, y, loss_fn), eager.step(x, y, loss_fn), f"step {step} loss")
        for (name, p), q in zip(source.named_parameters(), twin.parameters()):
            close(q.grad, p.grad, f"step {step} grad {name}")
            p.grad = q.grad = None
        for (name, p), q in zip(source.named_buffers(), twin.buffers()):
            close(q.float(), p.float(), f"step {step} buffer {name}")
    assert graphed.graph_error is None
    assert all(p.flat.checkpoint is not None and p.graphs is not None for row in graphed._graphed[1].programs for p in row)

    drop = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).cuda()
    noisy = seqify.pipeline(seqify.convert(drop), gpus=1, balance=[3], chunks=2, checkpoint="always", graphs=True)
    with pytest.warns(GraphWarning, match="random"):
        noisy(torch.randn(4, 8, device="cuda:0")).sum().backward()
    assert not noisy.graphs


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_distributed_rank_of_four_partitions_captures_and_trains_like_the_source(checkpoint: str, schedule: str) -> None:
    """seqify.distributed's fixed programs on a GPU: one rank holding four partitions (interleaved, or
    ZB-H1's split B and W on one rank: each B and each W its own graph), values handed over between them
    directly, each partition captured in its schedule order (checkpointed ones recompute inside their
    captured backward); three SGD steps agree with the source on the same GPU."""
    from helpers import dist_worker as worker
    import seqify.distributed as sd

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    model = worker.build("skippy").train().to(device)
    reference = copy.deepcopy(model)
    plan = worker.one_rank_zb(4, 4) if schedule == "zb-h1" else schedule
    stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=device, chunks=4,
                                schedule=plan, loops=4, checkpoint=checkpoint, graphs=True)
    loss_fn = worker.loss_fn("skippy")
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = (t.to(device) for t in worker.data("skippy", 8, step))
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = stage.step(x, y, loss_fn=loss_fn)
        want = sum(loss_fn(reference(a), b) * (len(a) / len(x)) for a, b in zip(x.tensor_split(4), y.tensor_split(4)))
        want.backward()
        close(loss.detach(), want.detach(), f"step {step} loss")
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            close(q.grad, p.grad, f"step {step} grad {name}")
        opt.step()
        opt_ref.step()
    assert all(prog.captured and all(p.graphs is not None for p in prog.programs) for prog in stage._programs.values())
    split = schedule == "zb-h1"
    for j, prog in stage._programs.items():
        # every program split exactly under zero bubble; each W captured where its partition has weights
        # and a gradient reaches it (all of Skippy's partitions do)
        assert all(p.split == split and (p.graphs[2] is not None) == split for p in prog.programs), j


def test_two_lanes_stay_off_where_a_partition_draws_random_numbers() -> None:
    """A replay sets the generator's offset on the stream it runs on: graphs with dropout keep one lane."""
    drop = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)).cuda()
    pipe = seqify.pipeline(seqify.convert(drop), gpus=1, balance=[3], chunks=2, checkpoint="never", graphs=True,
                           schedule="1f1b", overlap=True)
    pipe.step(torch.randn(4, 8, device="cuda:0"), torch.randint(0, 2, (4,), device="cuda:0"), torch.nn.CrossEntropyLoss())
    assert pipe.graph_error is None and pipe._graphed is not None and pipe._graphed[1].lanes is None


class _TokenModel(torch.nn.Module):
    """A small language model whose targets are padded: its loss divides by the kept tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.h, self.o = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 50)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.o(self.h(self.e(i)).tanh()).transpose(1, 2)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_padded_targets_weigh_like_one_device_on_gpus(schedule: str, graphs: bool) -> None:
    torch.manual_seed(0)
    source = _TokenModel().cuda()
    twin = copy.deepcopy(source)
    i = torch.randint(0, 50, (8, 12), device="cuda")
    t = torch.randint(0, 50, (8, 12), device="cuda")
    t[2:, 3:] = -100  # micro-batches keep different numbers of tokens
    loss_fn = torch.nn.CrossEntropyLoss()
    expected = loss_fn(source(i), t)
    expected.backward()
    gpus = min(torch.cuda.device_count(), 2)
    pipe = seqify.pipeline(seqify.convert(twin, example_inputs=(i,)), gpus=gpus, chunks=4, schedule=schedule,
                           graphs=graphs)
    for _ in range(2 if graphs else 1):  # graphs: the second step replays what the first captured
        for p in twin.parameters():
            p.grad = None
        got = pipe.step(i, t, loss_fn)
    close(got.reshape(1), expected.detach().reshape(1), "loss")
    for (name, p), q in zip(source.named_parameters(), twin.parameters()):
        close(q.grad, p.grad, name)


class _Scaled(torch.nn.Module):
    """A linear layer whose output is doubled in train mode and halved in eval mode: ops that differ between the
    modes, with nothing random, in a layer of their own (a module with a child is flattened into ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.f(x))
        return y * 2.0 if self.training else y * 0.5


def test_a_conversion_for_both_modes_replays_the_graphs_of_each_mode() -> None:
    """One export conversion whose layers hold a program per mode: graphs=True trains (pipe.step) and evaluates
    (forward graphs) in turn, each mode as the eager pipeline computes it."""
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(16, 32), _Scaled(), _Scaled(), torch.nn.Linear(32, 4))
    twin = copy.deepcopy(source)
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    seq, seq2 = (seqify.convert(m, x, frontend="export") for m in (source, twin))
    assert seq.two_mode_layers and not seq.mode_dependent
    gpus = min(torch.cuda.device_count(), 2)
    eager = seqify.pipeline(seq, gpus=gpus, chunks=4, balance=[3, len(seq) - 3] if gpus == 2 else None)
    graphed = seqify.pipeline(seq2, gpus=gpus, chunks=4, balance=eager.balance, graphs=True)
    opts = [torch.optim.SGD(p.parameters(), lr=0.05) for p in (eager, graphed)]
    x, y = x.cuda(0), y.cuda(0)
    for step in range(3):
        losses = []
        for pipe, opt in zip((eager, graphed), opts):
            pipe.train()
            opt.zero_grad()
            losses.append(pipe.step(x, y, torch.nn.functional.mse_loss))
            opt.step()
        close(losses[1], losses[0], f"step {step} loss")
        outs = []
        for pipe in (eager, graphed):
            pipe.eval()
            with torch.no_grad():
                outs.append(pipe(x))
        close(outs[1], outs[0], f"step {step} eval output")
        with torch.no_grad():
            trained = eager.train()(x)
        assert not torch.allclose(trained, outs[0])  # the modes compute different things
    assert graphed.graph_error is None and graphed._graphed is not None
