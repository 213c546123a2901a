"""User hooks under a replayed step: a parameter's gradient hook runs on each micro-batch's float32 gradient as it
does in an eager step (its weight keeps autocast's own cast), a hook added between steps rebuilds the programs,
and a hook the programs cannot run as an eager step does (a parameter's post-accumulate-grad hook, a layer's
hooks, a gradient hook a CUDA graph would capture) sends the step back to eager execution with the reason, never
ignored or run a different number of times."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers import replay_steps
from seqify.errors import GraphError
from seqify.pipe.executors.user_hooks import refusal


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def hooked_weight(seq: nn.Module) -> tuple[str, nn.Parameter]:
    return next((n, p) for n, p in seq.named_parameters() if p.shape == (8, 8))


def steps(replay: bool, autocast: bool, hook: str | None, *, hook_at: int = 0, count: int = 3,
          device: str = "cpu") -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], int, object]:
    """``count`` SGD steps of a 2-partition 1F1B pipeline of 2 micro-batches, replayed (fixed programs, eager on
    the CPU, captured on a GPU) or eager, under bfloat16 autocast or not; before step ``hook_at`` the middle
    weight gets a hook (``"gradient"``: doubles its gradient; ``"accumulated"``: counts). Returns the losses,
    each step's gradients, the hook's calls, and the pipeline."""
    seq = seqify.convert(net().to(device))
    pipe = replay_steps.pipeline(seq, [2, 3], replay, device)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    _, weight = hooked_weight(seq)
    calls = [0]

    def doubled(g: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return g * 2

    def counted(_: torch.Tensor) -> None:
        calls[0] += 1

    torch.manual_seed(1)
    x, target = torch.randn(4, 6, device=device), torch.randn(4, 3, device=device)
    losses, grads = [], []
    for step in range(count):
        if step == hook_at and hook == "gradient":
            weight.register_hook(doubled)
        elif step == hook_at and hook == "accumulated":
            weight.register_post_accumulate_grad_hook(counted)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            loss = pipe.step(x, target, lambda y, t: F.mse_loss(y.float(), t))
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
    return losses, grads, calls[0], pipe


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for got, want in zip(a[1], b[1]):
        for name, g in want.items():
            assert torch.equal(got[name], g), name


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("hook_at", [0, 1])
def test_a_gradient_hook_runs_in_replayed_programs_as_in_an_eager_step(autocast: bool, hook_at: int) -> None:
    """Bit-equal with the eager step, the hook run once per micro-batch from the step it was added at (added
    after the first step, the programs are built again: under autocast its weight was cast once before)."""
    replayed = steps(True, autocast, "gradient", hook_at=hook_at)
    eager = steps(False, autocast, "gradient", hook_at=hook_at)
    assert replayed[3].graph_error is None  # programs ran, not a fallback
    assert replayed[2] == eager[2] == 2 * (3 - hook_at)
    assert_same(replayed, eager)
    unhooked = steps(True, autocast, None)
    name, _ = hooked_weight(replayed[3])
    assert not torch.equal(replayed[1][-1][name], unhooked[1][-1][name])  # the hook changed what was trained


def test_a_post_accumulate_grad_hook_sends_the_step_back_to_eager_execution() -> None:
    """A replayed step sums gradients apart from .grad: the hook would never run, so the step runs eagerly
    (the reason kept in pipe.graph_error) and the hook runs after each micro-batch's backward."""
    replayed = steps(True, True, "accumulated", hook_at=1)
    eager = steps(False, True, "accumulated", hook_at=1)
    assert replayed[2] == eager[2] == 2 * 2
    assert_same(replayed, eager)
    error = replayed[3].graph_error
    assert error is not None and "post-accumulate-grad hook" in error and "partition 1" in error


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_layer_hook_sends_the_step_back_to_eager_execution(kind: str) -> None:
    """A converted layer's forward or full backward hook: called once per micro-batch, as in the eager step, not
    also by the forwards that building programs runs (nor once, at capture, on a GPU)."""
    def run(replay: bool) -> tuple[int, object, list[torch.Tensor]]:
        seq = seqify.convert(net())
        calls = [0]

        def count(*_: object) -> None:
            calls[0] += 1

        hook = seq[2].register_forward_hook if kind == "forward" else seq[2].register_full_backward_hook
        hook(count)
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[2, 3], chunks=2, checkpoint="never",
                               schedule="1f1b")
        pipe._replay_eager = replay
        torch.manual_seed(1)
        x, target = torch.randn(4, 6), torch.randn(4, 3)
        grads = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pipe.step(x, target, lambda y, t: F.mse_loss(y.float(), t))
            grads += [p.grad.clone() for p in pipe.parameters()]
        with torch.no_grad():  # inference programs too
            pipe(x)
        return calls[0], pipe, grads

    calls, pipe, grads = run(True)
    want, _, want_grads = run(False)
    assert calls == want == 2 * 3 + (2 if kind == "forward" else 0)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert pipe.graph_error is not None and f"{kind} hooks" in pipe.graph_error and "partition 1" in pipe.graph_error


def test_the_refusal_names_the_parameter_and_what_capturing_would_miss() -> None:
    layers = net()
    assert refusal(layers, 3, capturing=True) is None
    handle = layers[2].weight.register_hook(lambda g: g)
    assert refusal(layers, 3, capturing=False) is None  # eager programs run it
    why, eager_runs_it = refusal(layers, 3, capturing=True)
    assert "'2.weight' of partition 3" in why and "gradient hook" in why and eager_runs_it
    handle.remove()
    layers[0].bias.register_post_accumulate_grad_hook(lambda t: None)
    why, eager_runs_it = refusal(layers, 3, capturing=False)
    assert "'0.bias' of partition 3" in why and "post-accumulate-grad" in why and not eager_runs_it
    layers[0].bias.requires_grad_(False)  # a frozen parameter gets no gradient: nothing to run
    assert refusal(layers, 3, capturing=True) is None
    layers[4].register_forward_pre_hook(lambda m, i: None)
    why, eager_runs_it = refusal(layers, 3, capturing=False, training=False)
    assert "layer '4' of partition 3 has forward-pre hooks" in why and not eager_runs_it


def distributed(hook: str | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    """seqify.distributed's programs (one rank, four partitions, graphs=True: eager programs on the CPU) under
    bfloat16 autocast, three SGD steps, a gradient hook doubling one weight's gradient from the second."""
    from helpers import dist_worker as worker

    import seqify.distributed as sd

    torch.manual_seed(0)
    model = worker.build("skippy").float().train()
    stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=torch.device("cpu"), chunks=4,
                                schedule="interleaved", loops=4, checkpoint="never", graphs=hook is not None)
    weight = next(p for p in model.parameters() if p.dim() == 2)
    calls = [0]

    def doubled(g: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return g * 2

    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses = []
    for k in range(3):
        if k == 1:
            if hook == "accumulated":
                weight.register_post_accumulate_grad_hook(lambda t: None)
            elif hook == "layer":
                next(m for m in model.modules() if isinstance(m, nn.Linear)).register_forward_hook(lambda *a: None)
            else:
                weight.register_hook(doubled)
        x, y = (t.float() if t.is_floating_point() else t for t in worker.data("skippy", 8, k))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(stage.step(x, y, loss_fn=worker.loss_fn("skippy")).detach())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, calls[0]


def test_distributed_programs_run_a_gradient_hook_added_between_steps() -> None:
    losses, params, calls = distributed("gradient")
    want, want_params, want_calls = distributed(None)  # graphs=False: autograd's own backward
    assert calls == want_calls > 0
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    for name, value in want_params.items():
        assert torch.equal(params[name], value), name


@pytest.mark.parametrize("hook", ["accumulated", "layer"])
def test_distributed_programs_refuse_a_hook_they_would_not_run_as_an_eager_step_does(hook: str) -> None:
    with pytest.raises(GraphError, match=("post-accumulate-grad hook" if hook == "accumulated" else "forward hooks")
                       + ".*graphs=False"):
        distributed(hook)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gradient_hook_is_not_captured_the_step_runs_eagerly() -> None:
    """graphs=True with a hooked weight: capture is refused with a GraphWarning naming the parameter, and the step
    trains as the eager one, the hook run per micro-batch."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replayed = steps(True, True, "gradient", device="cuda:0")
    eager = steps(False, True, "gradient", device="cuda:0")
    assert any("gradient hook" in str(w.message) for w in caught)
    assert not replayed[3].graphs and replayed[2] == eager[2] == 6
    assert_same(replayed, eager)


def test_a_global_module_hook_sends_the_step_back_to_eager_execution() -> None:
    """torch's global module hooks run around every layer's call: as many calls as the eager step makes."""
    from torch.nn.modules.module import register_module_forward_hook

    def run(replay: bool) -> tuple[int, object]:
        pipe = seqify.pipeline(seqify.convert(net()), devices=["cpu", "cpu"], balance=[2, 3], chunks=2,
                               checkpoint="never", schedule="1f1b")
        pipe._replay_eager = replay
        calls = [0]

        def count(*_: object) -> None:
            calls[0] += 1

        handle = register_module_forward_hook(count)
        try:
            torch.manual_seed(1)
            x, target = torch.randn(4, 6), torch.randn(4, 3)
            for _ in range(2):
                pipe.step(x, target, lambda y, t: F.mse_loss(y, t))
        finally:
            handle.remove()
        return calls[0], pipe

    calls, pipe = run(True)
    want, _ = run(False)
    assert calls == want > 0
    assert pipe.graph_error is not None and "global module forward hooks" in pipe.graph_error
