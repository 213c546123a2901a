"""seqify.distributed on CPU, gloo processes: equal to one process; a failing rank ends a real torchrun job.

The equality checks fork their ranks from a server that has imported torch once (``procs.spawn``), each with
the environment torchrun gives it; torchrun itself is run here for a failing rank, and by test_dist_nodes.py
across two nodes."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import seqify

from helpers import dist_worker as worker
from helpers.procs import child_env, free_port, spawn

pytestmark = pytest.mark.timeout(300)
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dist_worker.py"


def torchrun(nproc: int, tmp: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", str(WORKER), "--out", str(tmp), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ranks(nproc: int, tmp: Path, *args: str) -> None:
    """The worker's ``main`` in ``nproc`` ranks on this machine, as ``torchrun --standalone`` would start it."""
    spawn(worker.as_torchrun, (nproc, free_port(), ["--out", str(tmp), *args]), nprocs=nproc)


def reference(name: str, chunks: int, batch: int, replicas: int) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """One process: each replica's shard in micro-batches, losses weighted by size, gradients averaged.

    Computed with one thread, like the workers (OMP_NUM_THREADS=1), so results agree to the last bit
    rather than to the summation order of a multi-threaded convolution."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(name, chunks, batch, replicas)
    finally:
        torch.set_num_threads(threads)


def _reference(name: str, chunks: int, batch: int, replicas: int) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    model = worker.build(name).train()
    eval_model = copy.deepcopy(model)
    x, y = worker.data(name, batch)
    losses = []
    total = 0.0
    for r in range(replicas):
        xs = x[r * batch // replicas:(r + 1) * batch // replicas]
        ys = y[r * batch // replicas:(r + 1) * batch // replicas]
        loss = sum(worker.loss_fn(name)(model(a), b) * (len(a) / len(xs))
                   for a, b in zip(xs.tensor_split(chunks), ys.tensor_split(chunks)))
        losses.append(float(loss.detach()))
        total = total + loss / replicas
    total.backward()
    with torch.no_grad():
        out = torch.cat([eval_model(c) for c in x[: batch // replicas].tensor_split(chunks)])
    return losses, {n: p.grad for n, p in model.named_parameters()}, out


@pytest.mark.parametrize(
    ("name", "nproc", "balance", "checkpoint", "schedule", "loops"),
    [
        ("resnet18", 2, "params", "never", "gpipe", 1),
        ("resnet18", 3, "flops", "except_last", "1f1b", 1),
        ("resnet18", 2, "time", "never", "gpipe", 1),  # rank 0 times the layers on its own device, then broadcasts
        ("unet", 2, "params", "always", "1f1b", 1),
        ("unet", 3, "params", "never", "gpipe", 1),
        # BatchNorm, in-place ReLUs and long skips, 2 partitions per rank in a V, split backward, recompute
        ("unet", 2, "params", "except_last", "zb-h1", 2),
    ],
)
def test_pipeline_over_processes_equals_one_process(
    tmp_path: Path, name: str, nproc: int, balance: str, checkpoint: str, schedule: str, loops: int
) -> None:
    ranks(nproc, tmp_path, "--model", name, "--balance", balance, "--chunks", "4", "--checkpoint", checkpoint,
          "--schedule", schedule, "--loops", str(loops))
    losses, grads, out = reference(name, chunks=4, batch=8, replicas=1)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(nproc)]
    assert sorted(r["stage"] for r in results) == list(range(nproc))
    assert len(results[0]["balance"]) == nproc * loops
    (last,) = [r for r in results if r["loss"] is not None]  # the rank of the last partition
    assert abs(float(last["loss"]) - losses[0]) < 1e-5
    seen = {}
    for r in results:
        seen.update(r["grads"])
    assert set(seen) == {n for n, g in grads.items() if g is not None}
    for n, g in seen.items():
        # 1F1B adds micro-batch gradients in another order than one backward does: last-bit differences.
        scale = max(1.0, grads[n].abs().max().item())
        torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-6 * scale, msg=n)
    # Inference over the processes matches too (train-mode BatchNorm: micro-batch statistics as above).
    assert last["output"] is not None and last["output"].shape[0] == 8


@pytest.mark.parametrize(("name", "schedule", "loops", "graphs"), [("resnet18", "1f1b", 1, False),
                                                                    ("unet", "zb-h1", 2, False),
                                                                    ("unet", "zb-h1", 2, True)])
def test_an_input_that_wants_a_gradient_gets_the_source_models(tmp_path: Path, name: str, schedule: str,
                                                              loops: int, graphs: bool) -> None:
    """The rank of the first partition hands each micro-batch's input gradient back to the caller's input: the
    gradient one process gives it on the same micro-batches (skips across ranks, a split backward too; with
    ``graphs``, from fixed programs)."""
    ranks(2, tmp_path, "--model", name, "--balance", "params", "--chunks", "4", "--schedule", schedule,
          "--loops", str(loops), "--input-grad", *(["--graphs"] if graphs else []))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = worker.build(name).train()
        x, y = worker.data(name, 8)
        x.requires_grad_()
        sum(worker.loss_fn(name)(model(a), b) * (len(a) / len(x))
            for a, b in zip(x.tensor_split(4), y.tensor_split(4))).backward()
    finally:
        torch.set_num_threads(threads)
    (first,) = [r for r in (torch.load(tmp_path / f"rank{k}.pt") for k in range(2)) if r["stage"] == 0]
    assert first["input_grad"] is not None
    torch.testing.assert_close(first["input_grad"], x.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("graphs,loops", [(False, 1), (True, 1), (True, 2)])
def test_data_parallel_replicas_of_a_pipeline(tmp_path: Path, graphs: bool, loops: int) -> None:
    """Two replicas of a two-rank pipeline average their gradients: eagerly after the step, and with fixed
    programs (graphs=True; eager programs on the CPU) by all-reducing each partition's flat sums in place as
    soon as its last backward is issued (with two partitions per rank, one beside the other's backward),
    before they become ``.grad``."""
    balance = "30,39" if loops == 1 else "15,15,20,19"
    ranks(4, tmp_path, "--model", "resnet18", "--balance", balance, "--chunks", "2", "--batch", "8",
          "--loops", str(loops), "--schedule", "interleaved" if loops > 1 else "gpipe",
          *(["--graphs"] if graphs else []))
    two_replicas_like_one_process(tmp_path)


def two_replicas_like_one_process(tmp_path: Path) -> None:
    """The 4 ranks' results (2 replicas of resnet18 over 2 ranks, chunks 2, batch 8) against one process on the
    same micro-batches: each replica's loss, every rank's averaged gradients."""
    losses, grads, _ = reference("resnet18", chunks=2, batch=8, replicas=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert sorted((r["stage"], r["replica"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        if r["stage"] == 1:
            assert abs(float(r["loss"]) - losses[r["replica"]]) < 1e-5
        for n, g in r["grads"].items():
            # All-reduce sums (g0 + g1) / 2 where one process sums g0 / 2 + g1 / 2: last-bit differences.
            scale = max(1.0, grads[n].abs().max().item())
            torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-6 * scale, msg=n)


def test_a_tuned_configuration_runs_as_the_same_layout_under_torchrun(tmp_path: Path) -> None:
    """A configuration for 4 devices as 2 replicas of a 2-stage pipeline (what seqify.tune returns, saved to
    a file) gives a 4-process job its balance, chunks, schedule, loops and graphs, and its replicas: the
    gradients are those of one process over both replicas' shards."""
    cfg = seqify.PipeConfig(chunks=2, loops=2, balance=(15, 15, 20, 19), checkpoint="never", graphs=True,
                            devices=("cpu",) * 4, schedule="interleaved", replicas=2)
    cfg.save(tmp_path / "layout.toml")
    ranks(4, tmp_path, "--model", "resnet18", "--batch", "8", "--config", str(tmp_path / "layout.toml"))
    two_replicas_like_one_process(tmp_path)


def test_a_configuration_that_does_not_fit_the_job_is_refused() -> None:
    """A configuration for two devices, one that leaves the balance open, or options passed beside
    it, each raise an error that says what to do, before anything is built."""
    from seqify.distributed.configured import stage_options

    two = seqify.PipeConfig(chunks=2, balance=(3, 4), devices=("cpu", "cpu"))
    with pytest.raises(seqify.DeviceError, match=r"for 2 devices \(2 pipeline ranks x 1 replicas\) but this job has 1"):
        stage_options(two, 1, {})
    with pytest.raises(seqify.ConfigError, match="leaves chunks, balance or devices open"):
        stage_options(seqify.PipeConfig(chunks="auto"), 1, {})
    with pytest.raises(seqify.ConfigError, match="chunks, loops would change it"):
        stage_options(two, 2, dict(chunks=4, loops=2, graphs=False))
    assert stage_options(two, 2, dict(chunks=1)) == dict(balance=[3, 4], chunks=2, checkpoint="except_last",
                                                         schedule="gpipe", loops=1, graphs=False)


def test_a_failing_rank_ends_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    done = torchrun(2, tmp_path, "--model", "unet", "--fail-rank", "1", timeout=200)
    took = time.monotonic() - start
    assert done.returncode != 0
    assert "planned failure on rank 1" in done.stderr + done.stdout
    assert took < 120
