"""Replicated pipelines (stages x replicas): every layout trains like one device on the same micro-batches."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import seqify
from seqify.errors import BalanceError, ConfigError, DeviceError, MicroBatchError
from seqify.pipe.executors.replay import Replay
from seqify.pipe.partition_copies import PartitionCopies
from seqify.pipe.replicated import ReplicatedPipeline

from pipe.test_step import UNet, data, even
from pipe.test_tied import TinyGPT, loss_of

pytestmark = pytest.mark.timeout(120)


def setup(schedule: str, stages: int, replicas: int, chunks: int = 2, loops: int = 1
          ) -> tuple[nn.Module, ReplicatedPipeline]:
    torch.manual_seed(0)
    source = UNet().double()
    seq = seqify.convert(copy.deepcopy(source))
    pipe = seqify.pipeline(seq, devices=["cpu"] * (stages * replicas), loops=loops,
                           balance=even(len(seq), stages * loops), chunks=chunks, checkpoint="never",
                           schedule=schedule, replicas=replicas)
    assert isinstance(pipe, ReplicatedPipeline) and len(pipe.replicas) == replicas
    return source, pipe


def micro_batches(x: torch.Tensor, replicas: int, chunks: int) -> list[torch.Tensor]:
    """The micro-batches a replicated step runs, in replica order: each replica's share cut into ``chunks``."""
    return [c for share in x.tensor_split(replicas) for c in share.tensor_split(chunks)]


def assert_like_source(source: nn.Module, pipe: ReplicatedPipeline, rtol: float = 1e-12) -> None:
    """The first replica's gradients and buffers are the source's (float64 sums in another order: close; on
    GPUs, whose float64 reductions are ordered otherwise too, after Adam steps that magnify the difference,
    closer than ``rtol``)."""
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad.cpu(), a.grad.cpu(), rtol=max(rtol, 1e-10), atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    for (name, a), b in zip(source.named_buffers(), pipe.model.buffers()):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")


def train(source: nn.Module, pipe: ReplicatedPipeline, loss_fn: Any, x: torch.Tensor, y: torch.Tensor,
          steps: int = 3, accumulate: bool = False, rtol: float = 1e-12) -> None:
    """``steps`` optimizer steps on both; each checked against the source on the same micro-batches."""
    opt_s = torch.optim.Adam(source.parameters(), lr=1e-2)
    opt_p = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for _ in range(steps):
        for _ in range(2 if accumulate else 1):  # gradients accumulate over steps as autograd's do
            expected = loss_fn(torch.cat([source(c) for c in micro_batches(x, len(pipe.replicas), pipe.chunks)]), y)
            expected.backward()
            got = pipe.step(x, y, loss_fn)
            torch.testing.assert_close(got.cpu(), expected.detach().cpu(), rtol=rtol, atol=rtol)
        assert_like_source(source, pipe, rtol)
        opt_s.step()
        opt_p.step()
        opt_s.zero_grad()
        opt_p.zero_grad()


LAYOUTS = [("gpipe", 2, 2), ("1f1b", 2, 2), ("zb-h1", 2, 2), ("zb-h2", 2, 2), ("1f1b", 2, 3), ("gpipe", 1, 4),
           ("1f1b", 4, 2)]


@pytest.mark.parametrize("schedule,stages,replicas", LAYOUTS)
def test_every_layout_trains_like_one_device(schedule: str, stages: int, replicas: int) -> None:
    source, pipe = setup(schedule, stages, replicas)
    train(source, pipe, nn.CrossEntropyLoss(), *data(12))


def test_cumulative_batch_norm_statistics_add_over_replicas() -> None:
    """BatchNorm with ``momentum=None`` keeps a cumulative average: the replicas' updates add."""
    source, pipe = setup("1f1b", 2, 2)
    for m in [*source.modules(), *(m for r in pipe.replicas for m in r.model.modules())]:
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    train(source, pipe, nn.CrossEntropyLoss(), *data(12), steps=2)


def test_replicas_in_threads_train_like_one_device() -> None:
    """On GPUs each replica's part of a step runs in a thread of its own: the same on CPU devices."""
    source, pipe = setup("zb-h1", 2, 2)
    pipe._threads = True
    train(source, pipe, nn.CrossEntropyLoss(), *data(12), steps=2)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # the caller's modes reach the threads
        got = pipe._run([lambda: torch.ones(2, 2, requires_grad=True) @ torch.ones(2, 2)] * 2)
    assert all(t.dtype == torch.bfloat16 and not t.requires_grad for t in got)


@pytest.mark.parametrize("schedule,stages,replicas,loops", [("gpipe", 2, 2, 1), ("1f1b", 2, 2, 1), ("zb-h1", 2, 2, 1),
                                                            ("interleaved", 2, 2, 2), ("gpipe", 1, 3, 3),
                                                            ("interleaved", 1, 2, 3)])
def test_replayed_replicas_sum_each_partition_as_its_backward_ends(schedule: str, stages: int, replicas: int,
                                                                   loops: int, monkeypatch: Any) -> None:
    """Replicas that replay programs add each partition's gradient sums as soon as every replica's backward has
    passed it (on GPUs, beside the earlier partitions' backward), not after the step: the same gradients, the
    same BatchNorm statistics, over accumulated steps, in threads and with a probed loss function."""
    source, pipe = setup(schedule, stages, replicas, loops=loops)
    for r in pipe.replicas:
        r._replay_eager = True
    pipe._threads = True

    def after_the_step(params: Any) -> None:
        raise AssertionError("the gradients were summed after the step")

    monkeypatch.setattr("seqify.pipe.replicated.sum_gradients", after_the_step)
    # accumulated, the replicas' sum is added to the earlier gradient at once (g + (g0 + g1 + g2)), where autograd
    # adds each micro-batch's part in turn: float64 rounding that Adam's steps magnify, hence rtol
    train(source, pipe, nn.CrossEntropyLoss(), *data(12), steps=2, accumulate=True, rtol=1e-10)
    train(source, pipe, lambda out, t: nn.functional.cross_entropy(out, t), *data(12), steps=1, rtol=1e-10)
    assert all(p.grad is None for r in pipe.replicas[1:] for p in r.parameters())  # only the model holds them


def test_replayed_replicas_hand_views_of_their_sums_as_grad_and_what_a_caller_holds_keeps_its_values() -> None:
    """Where a step finds no ``.grad`` (``zero_grad()`` left None), ``.grad`` is views of the first replica's sums,
    summed in place (with the parameters' strides): no copy of them. A caller still holding an earlier step's
    tensor keeps its values: the next step gives it memory of its own before the sums are zeroed. Where ``.grad``
    is there (zeroed in place, or accumulating), the sum is added into that very tensor, as autograd does."""
    source, pipe = setup("interleaved", 2, 2, loops=2)
    for r in pipe.replicas:
        r._replay_eager = True
    x, y = data(12)
    loss_fn = nn.CrossEntropyLoss()
    params = list(pipe.model.parameters())

    def reference() -> list[torch.Tensor]:
        source.zero_grad()
        loss_fn(torch.cat([source(c) for c in micro_batches(x, 2, pipe.chunks)]), y).backward()
        return [p.grad.clone() for p in source.parameters()]  # type: ignore[union-attr]

    def over_sums() -> bool:
        graphed = pipe.replicas[0]._graphed
        assert graphed is not None and graphed[1].sums is not None
        own = {flat.untyped_storage().data_ptr() for flats in graphed[1].sums for flat in flats}
        return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in own for p in params)

    expected = reference()
    pipe.step(x, y, loss_fn)
    assert over_sums()
    kept = [p.grad for p in params]
    for p, g, e in zip(params, kept, expected):
        assert g is not None and g.stride() == p.stride()
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    values = [g.clone() for g in kept if g is not None]
    pipe.zero_grad(set_to_none=True)
    pipe.step(x, y, loss_fn)
    assert all(p.grad is not g for p, g in zip(params, kept)) and over_sums()
    assert all(torch.equal(g, v) for g, v in zip(kept, values))  # the earlier step's tensors are untouched
    assert all(  # ... and now hold memory of their own
        g.untyped_storage().data_ptr() != p.grad.untyped_storage().data_ptr() for p, g in zip(params, kept))
    del kept
    pipe.zero_grad(set_to_none=False)
    held = [p.grad for p in params]
    pipe.step(x, y, loss_fn)
    assert all(p.grad is g for p, g in zip(params, held))  # added into the zeroed tensors
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)



def test_replayed_replicas_of_tied_weights_sum_both_partitions_into_one_grad() -> None:
    """GPT-2's embedding and LM head, tied, on one GPU's two partitions (``zb-h1``, ``loops=2``): the weight's
    sums come out of both partitions, and ``.grad`` is the first's new sum with the second's added."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    idx = torch.randint(0, 11, (8, 6))
    pipe = seqify.pipeline(seqify.convert(copy.deepcopy(source), (idx,)), devices=["cpu"] * 4, replicas=2, loops=2,
                           schedule="zb-h1", chunks=2, checkpoint="never")
    assert isinstance(pipe, ReplicatedPipeline)
    for r in pipe.replicas:
        r._replay_eager = True
    for _ in range(2):
        source.zero_grad()
        for c in micro_batches(idx, 2, 2):
            (loss_of(source(c), c) / 4).backward()
        pipe.zero_grad()
        pipe.step(idx, idx, loss_of)
        for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    graphed = pipe.replicas[0]._graphed
    assert graphed is not None
    reached = [id(p) for params, _ in graphed[1].handoff for p in params]
    assert len(reached) == len(set(reached)) + 1  # the tied weight, in two partitions


@pytest.mark.parametrize("schedule,stages,replicas,loops", [("gpipe", 1, 3, 3), ("interleaved", 2, 2, 2),
                                                            ("zb-h1", 2, 2, 1)])
def test_replayed_replicas_take_the_first_state_partition_by_partition(schedule: str, stages: int, replicas: int,
                                                                       loops: int, monkeypatch: Any) -> None:
    """Replicas that replay programs take the first replica's parameters and buffers partition by partition,
    each only as the step reaches that partition's first forward (on GPUs the later partitions' copies run
    beside the earlier ones' forward), never all at once before the step: every step after an optimizer's
    trains like the source, in threads too."""
    source, pipe = setup(schedule, stages, replicas, loops=loops)
    for r in pipe.replicas:
        r._replay_eager = True
    pipe._threads = schedule != "zb-h1"
    events: list[tuple[str, int]] = []

    def all_at_once(*args: Any) -> None:
        raise AssertionError("the replicas took the first's whole state before the step")

    copy_partition = PartitionCopies._copy
    run_program = Replay._run

    def copied(self: PartitionCopies, j: int) -> None:
        events.append(("copy", j))
        copy_partition(self, j)

    def ran(self: Replay, i: int, j: int, backward: bool) -> None:
        if not backward:
            events.append(("forward", j))
        run_program(self, i, j, backward)

    monkeypatch.setattr("seqify.pipe.replicated.copy_state", all_at_once)
    monkeypatch.setattr(PartitionCopies, "_copy", copied)
    monkeypatch.setattr(Replay, "_run", ran)
    train(source, pipe, nn.CrossEntropyLoss(), *data(12), steps=3, rtol=1e-10)
    parts = stages * loops
    copies = [k for k, e in enumerate(events) if e[0] == "copy"]
    assert len(copies) == 3 * parts  # every step (an optimizer step changed every partition before it)
    for j in range(parts):  # partition j is copied before any replica's forward of it, after partition 0's began
        first = [k for k, e in enumerate(events) if e == ("copy", j)][0]
        assert first < events.index(("forward", j))
        assert j == 0 or first > events.index(("forward", 0))


def test_a_step_that_fails_before_a_partition_leaves_no_replica_behind(monkeypatch: Any) -> None:
    """A step that raises before it reaches a partition has not given the other replicas that partition's new
    state: the replicas still follow the first, and the next steps train like the source."""
    source, pipe = setup("gpipe", 1, 2, loops=2)
    for r in pipe.replicas:
        r._replay_eager = True
    x, y = data(12)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, y, nn.CrossEntropyLoss())
    opt.step()  # the first replica changes; the others take it at their next step
    opt.zero_grad()
    arrive = Replay._arrive

    def fails_at_the_second_partition(self: Replay, i: int, j: int) -> None:
        if j == 1:
            raise RuntimeError("a layer that fails")
        arrive(self, i, j)

    monkeypatch.setattr(Replay, "_arrive", fails_at_the_second_partition)
    with pytest.raises(RuntimeError, match="a layer that fails"):
        pipe.step(x, y, nn.CrossEntropyLoss())
    monkeypatch.setattr(Replay, "_arrive", arrive)
    for a, b in zip(pipe.replicas[0].parameters(), pipe.replicas[1].parameters()):
        assert torch.equal(a, b)
    opt.zero_grad()
    with torch.no_grad():
        for a, b in zip(source.parameters(), pipe.parameters()):
            a.copy_(b)
        for a, b in zip(source.buffers(), pipe.model.buffers()):
            a.copy_(b)
    train(source, pipe, nn.CrossEntropyLoss(), x, y, steps=2, rtol=1e-10)


def test_interleaved_replicas_and_accumulated_gradients() -> None:
    source, pipe = setup("interleaved", 2, 2, loops=2)
    train(source, pipe, nn.CrossEntropyLoss(), *data(12), steps=2, accumulate=True)


def test_padded_targets_are_weighed_over_the_whole_batch() -> None:
    """Ignored targets fall unevenly on the replicas: each micro-batch's loss is weighed by the whole batch's
    count, so the gradients are one device's mean over the kept targets."""
    source, pipe = setup("1f1b", 2, 2)
    x, y = data(12)
    y[:5] = -100  # the first replica's share keeps one target, the second all of its own
    train(source, pipe, nn.CrossEntropyLoss(ignore_index=-100), x, y, steps=2)


def test_a_plain_loss_function_and_uneven_shares() -> None:
    source, pipe = setup("1f1b", 2, 2, chunks=3)
    x, y = data(11)  # shares of 6 and 5 samples, micro-batches of 2-2-2 and 2-2-1
    train(source, pipe, lambda out, t: nn.functional.cross_entropy(out, t), x, y, steps=2)


def test_forward_and_backward_sum_gradients_when_backward_ends() -> None:
    """``loss_fn(pipe(x), y).backward()``: the outputs of every replica, and their gradients summed at the end."""
    source, pipe = setup("gpipe", 2, 2)
    x, y = data(12)
    loss_fn = nn.CrossEntropyLoss()
    expected = torch.cat([source(c) for c in micro_batches(x, 2, pipe.chunks)])
    loss_fn(expected, y).backward()
    out = pipe(x)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    loss_fn(out, y).backward()
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    for (name, a), b in zip(source.named_buffers(), pipe.model.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)
    assert all(p.grad is None or not p.grad.any() for r in pipe.replicas[1:] for p in r.model.parameters())


def test_eval_forward_is_the_source_and_the_replicas_follow_the_first() -> None:
    source, pipe = setup("1f1b", 2, 2)
    x, _ = data(12)
    with torch.no_grad():
        next(pipe.parameters()).add_(1.0)  # an optimizer's change: the other replica takes it before it runs
        next(source.parameters()).add_(1.0)
    source.eval()
    pipe.eval()
    with torch.no_grad():
        assert torch.equal(pipe(x), torch.cat([source(s) for s in x.tensor_split(2)]))


def test_the_model_is_the_first_replica() -> None:
    source, pipe = setup("1f1b", 2, 2)
    assert [p.data_ptr() for p in pipe.parameters()] == [p.data_ptr() for p in pipe.model.parameters()]
    assert len(list(pipe.parameters())) == len(list(source.parameters()))
    assert "2 replicas x 2 devices" in repr(pipe)
    # a training loop written for a Pipeline runs unchanged: the batch in, the loss out, where the first replica is
    assert pipe.input_device == pipe.replicas[0].input_device and pipe.output_device == pipe.replicas[0].output_device
    x, y = data(12)
    loss = pipe.step(x.to(pipe.input_device), y.to(pipe.output_device), nn.CrossEntropyLoss())
    assert loss.device == pipe.output_device


def test_bad_layouts_are_refused() -> None:
    seq = seqify.convert(UNet().double())
    with pytest.raises(BalanceError, match="does not divide the 3 devices"):
        seqify.pipeline(seq, devices=["cpu"] * 3, balance=[7, 7], chunks=2, replicas=2)
    with pytest.raises(BalanceError, match="deferred_batch_norm"):
        seqify.pipeline(seq, devices=["cpu"] * 4, balance=[7, 7], chunks=2, replicas=2, deferred_batch_norm=True)
    with pytest.raises(ConfigError, match="replicas = 3 does not divide"):
        seqify.PipeConfig(devices=("cpu",) * 4, replicas=3)
    _, pipe = setup("1f1b", 2, 2)
    x, y = data(1)
    with pytest.raises(MicroBatchError, match="2 replicas"):
        pipe.step(x, y, nn.CrossEntropyLoss())


def test_a_replaced_tensor_or_a_cast_is_refused() -> None:
    """The other replicas follow the first through its flat tensors: a tensor swapped out would leave them behind."""
    _, pipe = setup("1f1b", 2, 2)
    with pytest.raises(DeviceError, match="before seqify.pipeline"):
        pipe.float()
    x, y = data(12)
    first = next(pipe.parameters())
    first.data = first.data.clone()
    with pytest.raises(DeviceError, match="replaced, not updated in place"):
        pipe.step(x, y, nn.CrossEntropyLoss())


def test_a_configuration_keeps_the_layout(tmp_path: Any) -> None:
    _, pipe = setup("1f1b", 2, 2)
    cfg = seqify.PipeConfig(chunks=2, balance=tuple(pipe.balance), devices=("cpu",) * 4, schedule="1f1b",
                            checkpoint="never", replicas=2)
    assert "as 2 replicas of a pipeline" in str(cfg)
    cfg.to_file(tmp_path / "cfg.toml")
    again = seqify.PipeConfig.from_file(tmp_path / "cfg.toml")
    assert again == cfg
    torch.manual_seed(0)
    source = UNet().double()
    built = seqify.pipeline(seqify.convert(copy.deepcopy(source)), config=again)
    assert isinstance(built, ReplicatedPipeline) and len(built.replicas) == 2 and built.config == again
    train(source, built, nn.CrossEntropyLoss(), *data(12), steps=1)


def _gpu_setup(schedule: str, stages: int, replicas: int, graphs: bool) -> tuple[nn.Module, ReplicatedPipeline]:
    torch.manual_seed(0)
    source = UNet().double().cuda(0)
    seq = seqify.convert(copy.deepcopy(source).cpu())
    pipe = seqify.pipeline(seq, gpus=stages * replicas, balance=even(len(seq), stages), chunks=2, checkpoint="never",
                           schedule=schedule, replicas=replicas, graphs=graphs)
    assert isinstance(pipe, ReplicatedPipeline)
    return source, pipe


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("stages,replicas", [(1, 2), (2, 2)])
def test_replicas_on_gpus_sum_through_nccl(stages: int, replicas: int, graphs: bool) -> None:
    """On GPUs the gradients are reduced by NCCL within the process, eager and replayed as CUDA graphs."""
    if torch.cuda.device_count() < stages * replicas:
        pytest.skip(f"needs {stages * replicas} CUDA GPUs")
    source, pipe = _gpu_setup("1f1b" if stages > 1 else "gpipe", stages, replicas, graphs)
    x, y = (t.cuda(0) for t in data(12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # graphs that could not be captured would run eagerly with a warning
        # a plain function is probed on the first output, the replicas' targets being on their own GPUs
        loss_fn = nn.CrossEntropyLoss() if graphs else (lambda out, t: nn.functional.cross_entropy(out, t))
        train(source, pipe, loss_fn, x, y, steps=3, rtol=1e-9)
        train(source, pipe, loss_fn, x, y, steps=1, accumulate=True, rtol=1e-9)  # .grad there: added into it
    assert all(r.graph_error is None and r.graphs == graphs for r in pipe.replicas)
    pipe.step(x, y, loss_fn)  # replayed with no .grad, .grad is tensors over the sums NCCL reduced into
    graphed = pipe.replicas[0]._graphed
    sums = {f.untyped_storage().data_ptr() for flats in graphed[1].sums or () for f in flats} if graphed else set()
    assert all(p.grad is not None and (p.grad.untyped_storage().data_ptr() in sums) == graphs
               for p in pipe.model.parameters())
    # replayed, each partition was reduced beside the backward (the other replicas never hold gradients)
    assert all(p.grad is None for r in pipe.replicas[1:] for p in r.parameters()) == graphs


@pytest.mark.gpu
def test_replicas_on_gpus_take_each_partition_before_its_forward_under_autocast() -> None:
    """Two replicas of two partitions each (``loops=2``), replayed under bf16 autocast: each partition's
    weights reach the second GPU by broadcast beside the first partition's forward and are cast there after
    it. Over Adam steps, every step's loss, gradients and running statistics are those of one replayed
    pipeline on one GPU running the same micro-batches (the replicas' sums add in another order: fp32
    rounding; a weight taken or cast a step late would differ by the step's update)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    torch.manual_seed(0)
    source = UNet(c=8).float()
    x, y = (t.cuda(0) for t in data(12))
    x = x.float()
    pipes = []
    for gpus, replicas, chunks in ((1, 1, 4), (2, 2, 2)):
        seq = seqify.convert(copy.deepcopy(source))
        pipes.append(seqify.pipeline(seq, gpus=gpus, loops=2, balance=even(len(seq), 2), chunks=chunks,
                                     checkpoint="never", schedule="gpipe", graphs=True,
                                     **({"replicas": replicas} if replicas > 1 else {})))
    one, replicated = pipes
    assert isinstance(replicated, ReplicatedPipeline)
    opts = [torch.optim.Adam(p.parameters(), lr=1e-2) for p in pipes]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # graphs that could not be captured would run eagerly with a warning
        for step in range(4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                losses = [p.step(x, y, nn.CrossEntropyLoss()) for p in pipes]
            torch.testing.assert_close(losses[1].cpu(), losses[0].cpu(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
            for (name, a), b in zip(one.model.named_parameters(), replicated.model.parameters()):
                assert a.grad is not None and b.grad is not None, name
                torch.testing.assert_close(b.grad.cpu(), a.grad.cpu(), rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
            for (name, a), b in zip(one.model.named_buffers(), replicated.model.buffers()):
                torch.testing.assert_close(b.cpu(), a.cpu(), rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
            for opt in opts:
                opt.step()
                opt.zero_grad()
    assert all(r.graph_error is None for r in [one, *replicated.replicas])


def test_a_checkpoint_holds_the_model_once_and_resumes_every_replica(tmp_path: Any) -> None:
    """``seqify.checkpoint`` saves the first replica (the model); loading it reaches the others before their step."""
    _, pipe = setup("1f1b", 2, 2)
    x, y = data(12)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for _ in range(2):
        pipe.step(x, y, nn.CrossEntropyLoss())
        opt.step()
        opt.zero_grad()
    seqify.checkpoint.save(pipe, tmp_path / "ckpt", optimizer=opt, step=2)
    _, again = setup("1f1b", 2, 2)  # fresh weights, replicated
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    seqify.checkpoint.load(again, tmp_path / "ckpt", optimizer=opt2)
    for a, b in zip(pipe.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(pipe.step(x, y, nn.CrossEntropyLoss()), again.step(x, y, nn.CrossEntropyLoss()))
    for a, b in zip(pipe.parameters(), again.parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad)
