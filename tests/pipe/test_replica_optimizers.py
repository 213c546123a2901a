"""pipe.optimizer: every replica steps its own copy, and trains as the source does with one optimizer."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import seqify
from seqify.errors import OptionError
from seqify.pipe.replica_optimizers import ReplicaOptimizers
from seqify.pipe.replicated import ReplicatedPipeline

from pipe.test_replicas import micro_batches, setup
from pipe.test_step import UNet, data, even
from pipe.test_tied import TinyGPT, loss_of

pytestmark = pytest.mark.timeout(120)

Adam = functools.partial(torch.optim.Adam, lr=1e-2)


def assert_replicas_equal(pipe: ReplicatedPipeline) -> None:
    """Every replica holds the first's parameters, bit for bit (the same gradients, the same steps)."""
    first = list(pipe.model.parameters())
    for r, other in enumerate(pipe.replicas[1:], 1):
        for k, (a, b) in enumerate(zip(first, other.partitions.parameters())):
            assert torch.equal(a.cpu(), b.cpu()), f"replica {r}, parameter {k}"


def assert_source_equal(source: nn.Module, pipe: ReplicatedPipeline, rtol: float = 1e-9, grads: bool = True) -> None:
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), rtol=rtol, atol=1e-11, msg=name)
        if grads:
            assert a.grad is not None and b.grad is not None, name
            torch.testing.assert_close(b.grad.cpu(), a.grad.cpu(), rtol=rtol, atol=1e-11, msg=name)
    for (name, a), b in zip(source.named_buffers(), pipe.model.buffers()):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=rtol, atol=1e-11, msg=name)


def source_step(source: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, replicas: int,
                chunks: int) -> torch.Tensor:
    """The source's loss over the micro-batches a replicated step runs, its gradients left in ``.grad``."""
    loss = loss_fn(torch.cat([source(c) for c in micro_batches(x, replicas, chunks)]), y)
    loss.backward()
    return loss.detach()


def update_and_compare(source: nn.Module, pipe: ReplicatedPipeline, opt_s: torch.optim.Optimizer,
                       opt_p: torch.optim.Optimizer, rtol: float = 1e-9, grads: bool = True) -> None:
    """Both optimizers step; the pipeline's model is the source's (its gradients too, with ``grads``), every
    replica bit-equal to the first; then both zero their gradients."""
    opt_s.step()
    opt_p.step()
    assert_source_equal(source, pipe, rtol=rtol, grads=grads)
    assert_replicas_equal(pipe)
    opt_s.zero_grad()
    opt_p.zero_grad()


def gpt(replicas: int = 2, loops: int = 2, schedule: str = "zb-h1", devices: list[str] | None = None
        ) -> tuple[nn.Module, ReplicatedPipeline, torch.Tensor]:
    """TinyGPT (its embedding and head tied; no buffers that change) and its replicated pipeline."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    idx = torch.randint(0, 11, (8, 6))
    pipe = seqify.pipeline(seqify.convert(copy.deepcopy(source), (idx,)), devices=devices or ["cpu"] * 4,
                           replicas=replicas, loops=loops, schedule=schedule, chunks=2, checkpoint="never")
    assert isinstance(pipe, ReplicatedPipeline)
    return source, pipe, idx


def gpt_loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return loss_of(out, idx)


def count_copies(pipe: ReplicatedPipeline, monkeypatch: Any) -> list[int]:
    """A list that grows by one each time the replicas take the first's whole state (at once or partition by
    partition)."""
    copies: list[int] = []
    original = ReplicatedPipeline._taken
    monkeypatch.setattr(pipe, "_taken", lambda: (copies.append(1), original(pipe)))
    return copies


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("schedule,stages,replicas,loops", [("gpipe", 1, 2, 1), ("1f1b", 2, 2, 1),
                                                            ("interleaved", 2, 2, 2), ("gpipe", 1, 3, 3)])
def test_every_replica_steps_its_own_copy_like_the_source(schedule: str, stages: int, replicas: int, loops: int,
                                                          replay: bool) -> None:
    """Adam on each replica, from the gradients every replica received: the source's parameters, gradients and
    running statistics after every step, and every replica bit-equal to the first, replayed (each partition
    summed into every replica beside the backward) or eager (summed into the first after the step, copied to
    the others before theirs)."""
    source, pipe = setup(schedule, stages, replicas, loops=loops)
    for r in pipe.replicas:
        r._replay_eager = replay
    pipe._threads = True
    x, y = data(12)
    loss_fn = nn.CrossEntropyLoss()
    opt_s, opt_p = Adam(source.parameters()), pipe.optimizer(Adam)
    assert isinstance(opt_p, ReplicaOptimizers) and len(opt_p.optimizers) == replicas
    for step in range(3):
        expected = source_step(source, loss_fn, x, y, replicas, pipe.chunks)
        torch.testing.assert_close(pipe.step(x, y, loss_fn), expected, rtol=1e-12, atol=1e-12)
        if replay:  # every replica received the sums as its own new tensors
            for other in pipe.replicas[1:]:
                for a, b in zip(pipe.model.parameters(), other.partitions.parameters()):
                    assert b.grad is not None and a.grad is not None and b.grad is not a.grad
                    assert torch.equal(a.grad, b.grad)
        update_and_compare(source, pipe, opt_s, opt_p)
        assert all(p.grad is None for r in pipe.replicas for p in r.partitions.parameters()), step


def test_nothing_is_copied_between_steps_where_nothing_else_changes(monkeypatch: Any) -> None:
    """Tied weights, no running statistics: after the first step's copy, the replicas never take the first's
    state again, and stay bit-equal to it, trained as the source is."""
    source, pipe, idx = gpt()
    for r in pipe.replicas:
        r._replay_eager = True
    copies = count_copies(pipe, monkeypatch)

    def shared(replicas: Any) -> None:
        raise AssertionError("the gradients were copied to the replicas, not all-reduced into them")

    monkeypatch.setattr("seqify.pipe.replicated.share_gradients", shared)
    opt_s, opt_p = Adam(source.parameters()), pipe.optimizer(Adam)
    for _ in range(3):
        source_step(source, gpt_loss, idx, idx, 2, 2)
        pipe.step(idx, idx, gpt_loss)
        update_and_compare(source, pipe, opt_s, opt_p)
    assert len(copies) == 1  # the first step's; no later step changed the first alone


def test_a_scheduler_clipping_and_accumulation_reach_every_replica(monkeypatch: Any) -> None:
    """The learning rate a scheduler sets in the first's groups steps every replica; gradients clipped after
    the step (the first's changed: copied to the others), accumulated over two steps into ``.grad`` kept with
    ``zero_grad(set_to_none=False)``, and from ``loss_fn(pipe(x), y).backward()`` train as the source does."""
    source, pipe, idx = gpt()
    for r in pipe.replicas:
        r._replay_eager = True
    opt_s, opt_p = Adam(source.parameters()), pipe.optimizer(Adam)
    sched_s, sched_p = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_s, opt_p))
    copies = count_copies(pipe, monkeypatch)
    for step in range(4):
        for _ in range(2 if step == 2 else 1):
            source_step(source, gpt_loss, idx, idx, 2, 2)
            if step == 3:
                gpt_loss(pipe(idx), idx).backward()
            else:
                pipe.step(idx, idx, gpt_loss)
        torch.nn.utils.clip_grad_norm_(source.parameters(), 0.05)
        seqify.clip_grad_norm_(pipe, 0.05)
        for opt, sched in ((opt_s, sched_s), (opt_p, sched_p)):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=step != 1)
        assert_source_equal(source, pipe, grads=False)
        assert_replicas_equal(pipe)
        # the other replicas stepped with the rate the scheduler had set, and follow the next at the next step
        assert opt_p.optimizers[1].param_groups[0]["lr"] == 1e-2 * 0.5 ** step
        assert opt_p.param_groups[0]["lr"] == 1e-2 * 0.5 ** (step + 1)
    assert len(copies) == 1


def test_a_gradient_scaler_unscales_what_every_replica_steps_with() -> None:
    """``pipe.step(..., loss_scale=scaler)`` and ``scaler.step(opt)``: the scaler unscales the first replica's
    gradients through a kernel that leaves them no new version, yet every replica steps with the unscaled ones
    (scaled ones would move Adam's steps by its eps: close to the source, not bit-equal between replicas)."""
    source, pipe, idx = gpt()
    for r in pipe.replicas:
        r._replay_eager = True
    opt_s, opt_p = Adam(source.parameters()), pipe.optimizer(Adam)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for _ in range(3):
        loss = gpt_loss(torch.cat([source(c) for c in micro_batches(idx, 2, 2)]), idx)
        scalers[0].scale(loss).backward()
        pipe.step(idx, idx, gpt_loss, loss_scale=scalers[1])
        for scaler, opt in zip(scalers, (opt_s, opt_p)):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert_source_equal(source, pipe, grads=False)
        assert_replicas_equal(pipe)
    assert scalers[1].get_scale() == scalers[0].get_scale()


def test_the_state_saved_is_the_first_replicas_and_loads_into_every_one(tmp_path: Any) -> None:
    """``state_dict()`` is the model's optimizer's, keyed as an optimizer of ``pipe.parameters()`` keys it; loading
    it (directly or through ``seqify.checkpoint``) gives every replica tensors of its own, and training resumes
    exactly."""
    _, pipe, idx = gpt()
    opt = pipe.optimizer(Adam)
    for _ in range(2):
        pipe.step(idx, idx, gpt_loss)
        opt.step()
        opt.zero_grad()
    plain = Adam(pipe.parameters())
    assert opt.state_dict()["param_groups"][0]["params"] == plain.state_dict()["param_groups"][0]["params"]
    seqify.checkpoint.save(pipe, tmp_path / "ckpt", optimizer=opt, step=2)
    for load in ("state_dict", "checkpoint"):
        _, again, _ = gpt()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in again.model.parameters():
                p.normal_()
        opt2 = again.optimizer(Adam)
        if load == "state_dict":
            again.model.load_state_dict(pipe.model.state_dict())
            opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch keeps the tensors it is given
        else:
            seqify.checkpoint.load(again, tmp_path / "ckpt", optimizer=opt2)
        held = [id(t) for o in opt2.optimizers for s in o.state.values() for t in s.values()]
        assert len(held) == len(set(held))  # no state tensor shared by two replicas (all on the CPU here)
        for _ in range(2):
            for p in (pipe, again):
                p.step(idx, idx, gpt_loss)
            for o in (opt, opt2):
                o.step()
                o.zero_grad()
        for a, b in zip(pipe.parameters(), again.parameters()):
            assert torch.equal(a, b), load
        assert_replicas_equal(again)
        _, pipe, _ = gpt()  # the second comparison starts over from the saved state
        opt = pipe.optimizer(Adam)
        seqify.checkpoint.load(pipe, tmp_path / "ckpt", optimizer=opt)


def test_a_plain_pipeline_builds_its_optimizer_on_its_parameters() -> None:
    source, pipe, _ = gpt()
    one = seqify.pipeline(seqify.convert(copy.deepcopy(source), (torch.zeros(2, 6, dtype=torch.long),)),
                          devices=["cpu"] * 2, chunks=2)
    opt = one.optimizer(Adam)
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["params"] == list(one.parameters())


def test_bad_factories_and_uses_are_refused() -> None:
    _, pipe, idx = gpt()
    kept = list(pipe.parameters())
    with pytest.raises(OptionError, match="not a function that builds"):
        pipe.optimizer(torch.optim.SGD(kept, lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="not a torch.optim.Optimizer"):
        pipe.optimizer(lambda params: list(params))  # type: ignore[arg-type, return-value]
    with pytest.raises(OptionError, match="parameters it was not given .replica 1"):
        pipe.optimizer(lambda params: torch.optim.SGD(kept, lr=0.1))
    built: list[int] = []

    def differs(params: Any) -> torch.optim.Optimizer:
        built.append(1)
        return torch.optim.SGD(list(params)[:3 if len(built) > 1 else None], lr=0.1)

    with pytest.raises(OptionError, match="same optimizer"):
        pipe.optimizer(differs)
    opt = pipe.optimizer(Adam)
    with pytest.raises(OptionError, match="no closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(OptionError, match="factory"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(OptionError, match="values inside"):
        opt.param_groups = []
    assert "ReplicaOptimizers(2 x Adam" in repr(opt)


def test_a_replica_that_fails_its_step_takes_the_first_state_again() -> None:
    """A replica's failed step leaves nothing half-updated across replicas: the next step copies the first's
    state to all of them again."""
    source, pipe = setup("1f1b", 2, 2)
    opt = pipe.optimizer(Adam)
    x, y = data(12)
    pipe.step(x, y, nn.CrossEntropyLoss())
    broken = opt.optimizers[1]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("out of memory (simulated)")

    broken.step = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    assert pipe._versions is None
    del broken.step
    opt.zero_grad()
    pipe.step(x, y, nn.CrossEntropyLoss())
    opt.step()
    assert_replicas_equal(pipe)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("stages", [1, 2])
def test_replicas_on_gpus_all_reduce_and_step_their_own_copies(stages: int, graphs: bool) -> None:
    """On GPUs every replica steps its own copy: as CUDA graphs each receives the sums by NCCL all-reduce beside
    the backward, eagerly the first's sums are broadcast to the others before they step. The source's training
    in float64 (within GPU rounding), every replica bit-equal to the first after every step."""
    if torch.cuda.device_count() < 2 * stages:
        pytest.skip(f"needs {2 * stages} CUDA GPUs")
    torch.manual_seed(0)
    source = UNet().double().cuda(0)
    seq = seqify.convert(copy.deepcopy(source).cpu())
    pipe = seqify.pipeline(seq, gpus=2 * stages, balance=even(len(seq), stages), chunks=2, checkpoint="never",
                           schedule="1f1b" if stages > 1 else "gpipe", replicas=2, graphs=graphs)
    assert isinstance(pipe, ReplicatedPipeline)
    x, y = (t.cuda(0) for t in data(12))
    loss_fn = nn.CrossEntropyLoss()
    opt_s, opt_p = Adam(source.parameters()), pipe.optimizer(Adam)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # graphs that could not be captured would run eagerly with a warning
        for _ in range(3):
            source_step(source, loss_fn, x, y, 2, 2)
            pipe.step(x, y, loss_fn)
            for a, b in zip(pipe.model.parameters(), pipe.replicas[1].partitions.parameters()):
                # replayed, every replica received the sums; eagerly, only the first has them until opt.step()
                assert a.grad is not None and (not graphs or b.grad is not None and torch.equal(a.grad, b.grad.to(a.grad.device)))
            update_and_compare(source, pipe, opt_s, opt_p, rtol=1e-8, grads=False)
    assert all(r.graph_error is None and r.graphs == graphs for r in pipe.replicas)
