"""seqify.distributed's fixed programs (graphs=True) in one process: one rank holding every partition, values
handed over between its partitions directly; per-partition capture order; equal to the source's training."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import dist_worker as worker
from helpers.fake_cuda import FakeGraph, fake_cuda
import seqify
import seqify.distributed as sd
from seqify.distributed import replay as dist_replay
from seqify.distributed.replay import RankPrograms
from seqify.pipe.executors.buffers import partition_order as _partition_order
from seqify.pipe.executors.programs import Program

BALANCE = [3, 3, 4, 4]  # Skippy's 14 layers, every skip between two partitions


def one_rank(schedule: Any, checkpoint: str, graphs: bool) -> tuple[torch.nn.Module, sd.DistributedStage]:
    model = worker.build("skippy").train()
    stage = sd.DistributedStage(seqify.convert(model), BALANCE, index=0, device=torch.device("cpu"), chunks=4,
                                schedule=schedule, loops=4, checkpoint=checkpoint, graphs=graphs)
    return model, stage


def train(model: torch.nn.Module, stage: sd.DistributedStage | None,
          steps: int = 2) -> list[tuple[float, dict[str, Any]]]:
    """SGD steps of the stage (or, without one, of the source on the same micro-batches): loss and gradients."""
    params = stage.parameters() if stage is not None else model.parameters()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        x, y = worker.data("skippy", 8, step)
        opt.zero_grad()
        if stage is not None:
            loss = stage.step(x, y, loss_fn=worker.loss_fn("skippy"))
        else:
            loss = sum(worker.loss_fn("skippy")(model(a), b) * (len(a) / len(x))
                       for a, b in zip(x.tensor_split(4), y.tensor_split(4)))
            loss.backward()
        history.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history


def trains_like_the_source(model: torch.nn.Module, stage: sd.DistributedStage, steps: int = 3) -> None:
    """``steps`` SGD steps of ``stage`` (the first builds its programs, the others copy into them) give the
    losses and gradients of the source on the same micro-batches."""
    got = train(model, stage, steps=steps)
    want = train(worker.build("skippy").train(), None, steps=steps)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("schedule", ["interleaved", "gpipe"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_one_rank_of_four_partitions_as_programs_trains_like_the_source(schedule: str, checkpoint: str) -> None:
    model, stage = one_rank(schedule, checkpoint, graphs=True)
    trains_like_the_source(model, stage)
    stop = {"always": 4, "except_last": 3, "never": 0}[checkpoint]
    for prog in stage._programs.values():
        assert [p is not None and p.flat.checkpoint is not None for p in prog.programs] == [i < stop for i in range(4)]
    # input and output-gradient buffers sized to what the schedule keeps in flight: interleaved on one rank
    # lets micro-batches of a partition take turns (fill-drain keeps one set per micro-batch)
    distinct = [len({id(t) for p in prog.programs if p is not None for t in (*p.inputs, *p.out_grads) if t is not None})
                for prog in stage._programs.values()]
    per = [len([t for t in (*prog.programs[0].inputs, *prog.programs[0].out_grads) if t is not None])
           for prog in stage._programs.values()]
    if schedule == "interleaved":
        assert all(d < 4 * n for d, n in zip(distinct, per)), (distinct, per)
    else:
        assert distinct == [4 * n for n in per]


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_zero_bubble_programs_run_b_and_w_apart_and_train_like_the_source(checkpoint: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # a split schedule's programs: B sends input gradients on, W adds the weights' gradients when the
    # schedule says (not inside B), each its own graph once captured
    walks: list[str] = []
    for name in ("_grads", "_grads_weight"):
        def counted(self: Program, _run: Any = getattr(Program, name), _name: str = name) -> None:
            walks.append(_name)
            _run(self)

        monkeypatch.setattr(Program, name, counted)
    captured: dict[int, list[tuple[str, int]]] = {}

    def record(programs: dict[int, RankPrograms], order: list[tuple[str, int, int]]) -> None:
        for j, prog in programs.items():  # CUDA is not here: what would be captured, in which order
            captured[j] = [(kind, i) for kind, p, i in order if p == j]
            prog.captured = True

    monkeypatch.setattr(dist_replay, "capture", record)
    model, stage = one_rank(worker.one_rank_zb(4, 4), checkpoint, graphs=True)
    for prog in stage._programs.values():
        prog.graphs = True  # as on CUDA
    trains_like_the_source(model, stage)
    assert all(p is not None and p.split for prog in stage._programs.values() for p in prog.programs)
    assert walks == ["_grads_weight"] * (3 * 4 * 4)  # one W per (step, partition, micro-batch), no whole backward
    plan = stage.plan(4)
    assert captured == {p: _partition_order(plan, p) for p in range(4)}  # each partition's W steps in place
    assert all(sorted(i for kind, i in order if kind == "W") == [0, 1, 2, 3] for order in captured.values())


def test_programs_are_captured_once_per_rank_in_the_order_the_schedule_issues_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a graph pool reuses memory in capture order: a rank's programs, all its partitions' in one pool, must
    # be captured as the rank's schedule runs them (CUDA is not here: record what would be captured instead)
    calls: list[tuple[list[int], list[tuple[str, int, int]]]] = []

    def record(programs: dict[int, RankPrograms], order: list[tuple[str, int, int]]) -> None:
        calls.append((sorted(programs), list(order)))
        for prog in programs.values():
            prog.captured = True

    monkeypatch.setattr(dist_replay, "capture", record)
    model, stage = one_rank("interleaved", "always", graphs=True)
    for prog in stage._programs.values():
        prog.graphs = True  # as on CUDA
    train(model, stage)
    plan = stage.plan(4)
    # once, all four partitions in one pool, in the rank's own order (partitions interleaved)
    assert len(calls) == 1 and calls[0][0] == [0, 1, 2, 3]
    assert calls[0][1] == [(a.kind, a.partition, a.microbatch) for a in plan.per_device()[0]]
    captured = [(p, [(k, i) for k, j, i in calls[0][1] if j == p], 4) for p in range(4)]
    assert captured == [(p, _partition_order(plan, p), 4) for p in range(4)]
    # the schedule's own interleaving of forwards and backwards, not every forward then every backward
    assert captured[0][1] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


class _Sizes(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x, x.size(0)


def test_a_partition_returning_a_python_value_says_to_use_graphs_false() -> None:
    stage = sd.DistributedStage(torch.nn.Sequential(_Sizes(), torch.nn.Identity()), [1, 1], index=0,
                                device=torch.device("cpu"), graphs=True, loops=2, schedule="interleaved")
    programs = stage._programs[0]
    programs.begin([2])
    with pytest.raises(seqify.GraphError, match="graphs=False"):
        programs.forward(0, torch.zeros(2, 3), {}, needs_grad=False)
    with pytest.raises(seqify.GraphError, match=r"^rank 0 \(stage 1/1, partitions \[0, 1\].*graphs=False"):
        stage.step(torch.zeros(2, 3), torch.zeros(2, 3), loss_fn=torch.nn.functional.mse_loss)  # names the rank


def test_checkpointed_programs_update_batch_norm_statistics_once() -> None:
    # a checkpointed program's backward recomputes its forward: the running statistics must still move
    # once per micro-batch, as in the source run over the same micro-batches
    def net() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                   torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)).double()

    source, piped = net(), net()
    stage = sd.DistributedStage(piped, [2, 2, 2], index=0, device=torch.device("cpu"), chunks=2, graphs=True,
                                loops=3, schedule="interleaved", checkpoint="always")
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        loss = stage.step(x, y, loss_fn=torch.nn.functional.cross_entropy)
        ref = sum(torch.nn.functional.cross_entropy(source(a), b) * 0.5 for a, b in zip(x.chunk(2), y.chunk(2)))
        ref.backward()
        assert loss is not None and float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for (n, b), want in zip(piped.named_buffers(), source.buffers()):
        torch.testing.assert_close(b, want, rtol=1e-12, atol=1e-14, msg=n)
    for (n, p), want in zip(piped.named_parameters(), source.parameters()):
        torch.testing.assert_close(p.grad, want.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_programs_hand_views_of_their_sums_as_grad_and_what_a_caller_keeps_holds_its_values() -> None:
    """After a step of programs ``.grad`` is their gradient sums, not a copy. A tensor a caller keeps from one
    step keeps its values through the next; a ``.grad`` left in place is added into, as autograd does."""
    model, stage = one_rank("interleaved", "never", graphs=True)
    source = worker.build("skippy").train()
    loss_fn = worker.loss_fn("skippy")

    def step(seed: int) -> None:
        x, y = worker.data("skippy", 8, seed)
        stage.step(x, y, loss_fn=loss_fn)

    def expected(*seeds: int) -> list[torch.Tensor]:
        source.zero_grad(set_to_none=True)
        for seed in seeds:
            x, y = worker.data("skippy", 8, seed)
            sum(loss_fn(source(a), b) * (len(a) / len(x))
                for a, b in zip(x.tensor_split(4), y.tensor_split(4))).backward()
        return [p.grad.clone() for p in source.parameters()]  # type: ignore[union-attr]

    def viewed() -> bool:
        own = {f.untyped_storage().data_ptr() for prog in stage._programs.values() for f in prog.sums()}
        return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in own for p in model.parameters())

    def grads_are(values: list[torch.Tensor]) -> None:
        for p, e in zip(model.parameters(), values):
            torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)

    step(0)
    assert viewed()
    grads_are(expected(0))
    kept = [p.grad for p in model.parameters()]
    values = [g.clone() for g in kept if g is not None]
    model.zero_grad(set_to_none=True)
    step(1)
    assert viewed()
    grads_are(expected(1))
    assert all(torch.equal(g, v) for g, v in zip(kept, values))
    step(2)  # no zero_grad: added into .grad
    grads_are(expected(1, 2))


@pytest.mark.parametrize("schedule", ["interleaved", "gpipe", "zb"])
def test_each_partitions_first_backward_writes_its_sums(schedule: str) -> None:
    """Once a step has built the programs, nothing zeroes a partition's sums before a step: its first backward
    (a zero-bubble first partition's first W) writes them. Steps whose sums held NaN before they ran give the
    source's gradients."""
    model, stage = one_rank(worker.one_rank_zb(4, 4) if schedule == "zb" else schedule, "never", graphs=True)
    source = worker.build("skippy").train()
    loss_fn = worker.loss_fn("skippy")
    for seed in range(3):
        model.zero_grad(set_to_none=True)
        source.zero_grad(set_to_none=True)
        for prog in stage._programs.values():
            for flat in prog.sums():
                flat.fill_(float("nan"))  # what a step must never read (the first step zeroes them: it builds)
        x, y = worker.data("skippy", 8, seed)
        stage.step(x, y, loss_fn=loss_fn)
        sum(loss_fn(source(a), b) * (len(a) / len(x)) for a, b in zip(x.tensor_split(4), y.tensor_split(4))).backward()
        for p, q in zip(model.parameters(), source.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    writers = {j: [p.writes_sums for p in prog.programs if p is not None and p.writes_sums]
               for j, prog in stage._programs.items() if prog.acc}
    assert writers and all(len(w) == 1 for w in writers.values()), writers
    if schedule == "zb":
        assert writers[0] == ["W"], writers


def test_a_captured_rank_captures_each_partitions_writer_as_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture (CUDA faked on the CPU) marks, before it captures, the part that writes each partition's sums,
    so the graph captured for it writes them; replayed steps then train like the source with nothing zeroing
    the sums before them."""
    captured: list[tuple[str, str | None]] = []  # (part, the program's writer part when it was captured)

    def spy(name: str, part: str) -> Any:
        real = getattr(Program, name)

        def run(self: Program) -> None:
            if FakeGraph.capturing is not None:
                FakeGraph.capturing.parts.append(lambda: real(self))
                captured.append((part, self.writes_sums))
            real(self)
        return run

    for name, part in (("_outputs", "F"), ("_grads", "B"), ("_grads_input", "B"), ("_grads_weight", "W")):
        monkeypatch.setattr(Program, name, spy(name, part))
    fake_cuda(monkeypatch)
    model, stage = one_rank("interleaved", "never", graphs=True)
    for prog in stage._programs.values():
        prog.graphs = True  # as on CUDA
    trains_like_the_source(model, stage)
    assert all(prog.captured for prog in stage._programs.values())
    writers = [w for part, w in captured if part == "B" and w == "B"]
    assert len(writers) == len([prog for prog in stage._programs.values() if prog.acc]), captured
