"""GPU checks (marked gpu; skipped without CUDA): a converted ResNet-101 over 2 GPUs matches one GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import seqify
from helpers.exactness import loss_of
from helpers.procs import child_env
from helpers.gpu_checks import relative, strict_fp32  # noqa: F401  (strict_fp32: autouse fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.timeout(600),
]


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_resnet101_two_gpus_matches_one_gpu(checkpoint: str) -> None:
    torch.manual_seed(0)
    source = torchvision.models.resnet101().train()
    reference = copy.deepcopy(source).cuda(0)
    pipe = seqify.pipeline(source, gpus=2, balance="flops", sample=torch.randn(1, 3, 224, 224),
                           chunks=4, checkpoint=checkpoint)
    assert [str(d) for d in pipe.devices] == ["cuda:0", "cuda:1"]
    x = torch.randn(32, 3, 224, 224, device="cuda:0")
    out = pipe(x)
    assert out.device == torch.device("cuda:1")
    loss_of(out).backward()
    outs = [reference(c) for c in x.tensor_split(4)]
    expected = torch.cat(outs)
    loss_of(expected).backward()
    torch.testing.assert_close(out.cuda(0), expected, rtol=1e-4, atol=1e-4)
    grads = dict(reference.named_parameters())
    for name, p in source.named_parameters():
        torch.testing.assert_close(p.grad.cuda(0), grads[name].grad, rtol=1e-3, atol=1e-4, msg=name)
    for (name, b), r in zip(source.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b.cuda(0), r, rtol=1e-4, atol=1e-5, msg=name)


def test_resnet101_trains_over_two_gpus_like_one_gpu() -> None:
    """A few SGD steps over two GPUs follow the same loss curve as the same steps on one GPU."""
    torch.manual_seed(0)
    source = torchvision.models.resnet101(num_classes=10).train()
    reference = copy.deepcopy(source).cuda(0)
    pipe = seqify.pipeline(source, gpus=2, chunks=4, balance="params")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.001, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.001, momentum=0.9)
    x = torch.randn(32, 3, 64, 64, device=pipe.input_device)
    y = torch.randint(0, 10, (32,), device=pipe.output_device)
    losses, expected = [], []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(pipe(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        opt_ref.zero_grad(set_to_none=True)
        ref_loss = torch.nn.functional.cross_entropy(torch.cat([reference(c) for c in x.tensor_split(4)]), y.cuda(0))
        ref_loss.backward()
        opt_ref.step()
        expected.append(ref_loss.item())
    assert losses == pytest.approx(expected, rel=1e-3, abs=1e-4), (losses, expected)
    assert min(losses) < losses[0], losses


def test_skip_tensors_cross_gpus_directly_and_autocast_holds() -> None:
    seq = seqify.convert(seqify.zoo.unet(depth=3, blocks=1, channels=8))
    n = len(seq)
    pipe = seqify.pipeline(seq, devices=["cuda:0", "cuda:1", "cuda:0", "cuda:1"],
                           balance=[n // 4, n // 4, n // 4, n - 3 * (n // 4)], chunks=2)
    seen = []
    pipe.on_transfer = lambda *e: seen.append(e)
    x = torch.randn(4, 3, 32, 32, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(x)
    assert out.dtype == torch.bfloat16 and out.device == torch.device("cuda:1")
    out.float().sum().backward()
    for kind, name, a, b, _ in seen:
        if kind == "skip":
            assert b > a


@pytest.mark.parametrize("loops", [1, 2])
def test_graphed_stages_match_eager_fp32(loops: int) -> None:
    """CUDA-graph replay computes what eager execution computes, step after step (uneven micro-batches too),
    one partition per GPU (fill-drain) and two (looped, breadth-first)."""
    torch.manual_seed(0)
    source = torchvision.models.resnet50(num_classes=10).train()
    twin = copy.deepcopy(source)
    seq, seq2 = seqify.convert(source), seqify.convert(twin)
    n = len(seq)
    eager = seqify.pipeline(seq, gpus=2, balance=[n // 2, n - n // 2], chunks=3, checkpoint="never")
    cuts = [n // (2 * loops)] * (2 * loops - 1)
    graphed = seqify.pipeline(seq2, gpus=2, loops=loops, balance=cuts + [n - sum(cuts)], chunks=3,
                              checkpoint="never", graphs=True)
    opt_a = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(graphed.parameters(), lr=0.01, momentum=0.9)
    close = relative(1e-4)
    for step in range(3):
        x = torch.randn(14, 3, 64, 64, device="cuda:0")
        a, b = eager(x), graphed(x)
        close(b, a, f"step {step} output")
        for opt, out in ((opt_a, a), (opt_b, b)):
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing must keep graphed gradients right
            loss_of(out).backward()
        for (name, p), q in zip(source.named_parameters(), twin.parameters()):
            close(q.grad, p.grad, f"step {step} grad {name}")
        for (name, p), q in zip(source.named_buffers(), twin.buffers()):
            close(q.float(), p.float(), f"step {step} buffer {name}")
        opt_a.step()
        opt_b.step()
    assert graphed._graphed is not None and graphed.graph_error is None


def test_graphed_stages_under_bf16_autocast_err_like_eager() -> None:
    """Under bf16 autocast, graphs and eager differ from fp32 by the same rounding, not more."""
    torch.manual_seed(0)
    source = torchvision.models.resnet50(num_classes=10).train()
    copies = [copy.deepcopy(source) for _ in range(3)]
    x = torch.randn(14, 3, 64, 64, device="cuda:0")
    outs, grads = [], []
    for model, graphs, bf16 in ((copies[0], False, False), (copies[1], False, True), (copies[2], True, True)):
        seq = seqify.convert(model)
        n = len(seq)
        pipe = seqify.pipeline(seq, gpus=2, balance=[n // 2, n - n // 2], chunks=3, checkpoint="never", graphs=graphs)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = pipe(x)
        loss_of(out.float()).backward()
        assert pipe.graph_error is None
        outs.append(out.float().cuda(0))
        grads.append(torch.cat([p.grad.flatten().cuda(0) for p in model.parameters()]))

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    assert err(outs[2], outs[0]) <= 2 * err(outs[1], outs[0]) + 1e-3
    assert err(grads[2], grads[0]) <= 2 * err(grads[1], grads[0]) + 1e-3


def test_distributed_nccl_matches_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two processes on two GPUs over NCCL compute the loss and gradients of one process on one GPU."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import dist_worker as worker

    here = Path(__file__).parent
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(here.parent / "helpers" / "dist_worker.py"), "--out", str(tmp_path), "--model", "resnet18", "--balance", "params",
           "--chunks", "2", "--backend", "nccl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    model = worker.build("resnet18").train().cuda()
    x, y = worker.data("resnet18", 8)
    x, y = x.cuda(), y.cuda()
    loss = sum(worker.loss_fn("resnet18")(model(a), b) * (len(a) / 8) for a, b in zip(x.tensor_split(2), y.tensor_split(2)))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    last = next(r for r in results if r["stage"] == 1)
    assert abs(float(last["loss"]) - float(loss)) < 1e-4
    for r in results:
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, grads[n], rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.parametrize("schedule,loops", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h1", 2)])
def test_scheduled_step_on_two_gpus_matches_eager_gpipe(schedule: str, loops: int) -> None:
    """pipe.step under each schedule, across two GPUs (copies on copy streams, gradients sent back),
    leaves the gradients and loss GPipe's pipe(x) + loss.backward() leaves."""
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=10).train()
    twin = copy.deepcopy(source)
    seq, seq2 = seqify.convert(source), seqify.convert(twin)
    n = len(seq)
    cuts = [n // (2 * loops)] * (2 * loops - 1)
    reference = seqify.pipeline(seq, gpus=2, loops=loops, balance=cuts + [n - sum(cuts)], chunks=4,
                                checkpoint="never", schedule="interleaved" if loops > 1 else "gpipe")
    pipe = seqify.pipeline(seq2, gpus=2, loops=loops, balance=cuts + [n - sum(cuts)], chunks=4, checkpoint="never",
                           schedule=schedule)
    x = torch.randn(14, 3, 64, 64, device="cuda:0")
    y = torch.randint(0, 10, (14,), device="cuda:0")
    expected = torch.nn.functional.cross_entropy(reference(x), y.to(reference.devices[-1]))
    expected.backward()
    got = pipe.step(x, y, torch.nn.functional.cross_entropy)
    predicted = pipe.plan_memory(x).per_device  # measures one micro-batch through partitions on both GPUs
    assert len(predicted) == 2 and all(b > 0 for b in predicted)
    close = relative(1e-4)
    close(got, expected.detach(), "loss")
    for (name, p), q in zip(source.named_parameters(), twin.parameters()):
        close(q.grad, p.grad, f"grad {name}")


@pytest.mark.parametrize("schedule,bf16", [("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_distributed_graphs_match_eager(tmp_path, schedule: str, bf16: bool) -> None:  # type: ignore[no-untyped-def]
    """seqify.distributed with graphs=True (each rank's micro-batches replayed from CUDA graphs, NCCL sends
    and receives between them) trains like the eager ranks: in float32 three steps' losses and parameters; under
    bf16 autocast (captured without autocast's cache of weight casts, which a captured backward cannot use) two
    steps' losses and the replayed step's gradients, to bf16's rounding. Not bf16 parameters after more steps:
    this ResNet-18 normalizes 1x1 maps over micro-batches of 4, and a difference in one gradient's last bf16 bit
    moves its first convolution's weights by up to 0.09 within three steps (eager against eager, on the CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = child_env()
    runs = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs{graphs}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", str(here.parent / "helpers" / "dist_worker.py"), "--out", str(out),
               "--model", "resnet18", "--balance", "params", "--chunks", "4", "--batch", "16",
               "--steps", "2" if bf16 else "3", "--schedule", schedule, "--backend", "nccl",
               *(["--graphs"] if graphs else []), *(["--bf16", "--lr", "0.01"] if bf16 else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[graphs] = [torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(2)]
    for eager, graphed in zip(runs[False], runs[True]):
        assert eager["stage"] == graphed["stage"]
        tol = 1e-2 if bf16 else 1e-4
        for step, loss in eager["losses"].items():
            assert abs(graphed["losses"][step] - loss) < tol * max(1.0, abs(loss)), step
        if bf16:  # the second step replays the graphs captured after the first; its gradients are in .grad
            assert eager["grads"].keys() == graphed["grads"].keys() and eager["grads"]
            for n, g in eager["grads"].items():  # bf16's rounding through 20 layers: up to 2% of the norm
                assert float((graphed["grads"][n] - g).norm()) <= 5e-2 * float(g.norm()), n
            continue
        for n, p in eager["params"].items():
            torch.testing.assert_close(graphed["params"][n], p, rtol=tol, atol=tol / 10,
                                       msg=lambda m, n=n: f"{n}: {m}")
