"""seqify.distributed across 2 "nodes" on localhost (torchrun, c10d rendezvous, gloo): equal to one process,
a lost node ends the job with a PeerError, and a checkpointed run resumes to the same next step."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import dist_worker as worker
from helpers.procs import child_env
from torch import nn

from seqify import checkpoint

pytestmark = pytest.mark.timeout(240)
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "dist_worker.py"
TINY = ["--model", "tiny", "--balance", "3,3", "--chunks", "2", "--batch", "8", "--schedule", "zb-h1"]  # skip crosses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node(rank: int, port: int, out: Path, *args: str) -> subprocess.Popen[str]:
    """One "node": a torchrun agent with 2 processes, meeting the other node through c10d on localhost."""
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=seqify{port}",
           f"--rdzv-conf=is_host={int(rank == 0)}",  # node 0 hosts the rendezvous store, whoever starts first
           "--local-addr=127.0.0.1", "--max-restarts=0", str(WORKER), "--out", str(out), *args]
    log = open(out / f"node{rank}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun starts each worker in a session of its own)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parent.items() if p == pid]
        found += kids
        todo += kids
    return found


def kill_node(agent: subprocess.Popen[str]) -> None:
    """SIGKILL a node's agent and every process it started, as when the machine goes down."""
    for pid in [agent.pid, *descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def two_nodes(out: Path, *args: str, timeout: float = 150) -> None:
    port = free_port()
    first = node(0, port, out, *args)
    second = node(1, port, out, *args)
    try:
        codes = [first.wait(timeout), second.wait(timeout)]
    finally:
        for p in (first, second):
            kill_node(p)
    logs = "".join((out / f"node{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs


def standalone(out: Path, nproc: int, *args: str, timeout: float = 150) -> None:
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", str(WORKER), "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def one_process(steps: int, replicas: int = 2, chunks: int = 2, batch: int = 8) -> list[dict[str, object]]:
    """The source model trained in one process, as the job splits it: each replica's shard in micro-batches,
    losses weighted by size, gradients averaged over replicas; the same SGD. Per step: losses, grads, state."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = worker.build("tiny").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        history: list[dict[str, object]] = []
        for step in range(steps):
            x, y = worker.data("tiny", batch, step)
            opt.zero_grad()
            total, losses = 0.0, []
            for r in range(replicas):
                shard = slice(r * batch // replicas, (r + 1) * batch // replicas)
                xs, ys = x[shard], y[shard]
                loss = sum(nn.functional.cross_entropy(model(a), b) * (len(a) / len(xs))
                           for a, b in zip(xs.tensor_split(chunks), ys.tensor_split(chunks)))
                losses.append(float(loss.detach()))
                total = total + loss / replicas
            total.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            history.append({"losses": losses, "grads": grads,
                            "state": {k: v.clone() for k, v in model.state_dict().items()}})
        return history
    finally:
        torch.set_num_threads(threads)


def ranks(out: Path) -> list[dict[str, object]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    # All-reduce sums (g0 + g1) / 2 where one process sums g0 / 2 + g1 / 2: last-bit differences.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_two_nodes_train_like_one_process_and_resume_from_a_checkpoint(tmp_path: Path) -> None:
    """2 nodes x 2 processes = 2 stages x 2 replicas, 3 steps, saving after step 2; then a new job resumes
    from that checkpoint and runs step 3, which must equal the uninterrupted run's step 3."""
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full", tmp_path / "resumed"
    full.mkdir()
    resumed.mkdir()
    two_nodes(full, *TINY, "--steps", "3", "--save-after", "2", "--ckpt", str(ckpt))
    history = one_process(steps=3)
    results = ranks(full)
    assert sorted((r["stage"], r["replica"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        if r["stage"] == 1:
            for step in range(3):
                assert abs(r["losses"][step] - history[step]["losses"][r["replica"]]) < 1e-6, (step, r["replica"])
        for n, g in r["grads"].items():
            close(g, history[2]["grads"][n], n)
        for n, p in r["params"].items():
            close(p, history[2]["state"][n], n)
    assert {n for r in results for n in r["params"]} == {n for n, _ in worker.build("tiny").named_parameters()}

    # One folder of the in-process layout, each tensor written once (by replica 0): the source model's checkpoint
    # after step 2.
    assert sorted(os.listdir(ckpt)) == ["seqify.json", "state.pt", "tensors"]
    saved = torch.distributed.checkpoint.FileSystemReader(str(ckpt / "tensors")).read_metadata().state_dict_metadata
    assert all(len(m.chunks) == 1 for m in saved.values())
    source = worker.build("tiny")
    source.load_state_dict(checkpoint.load_state_dict(ckpt))  # strict: every key of the source, nothing else
    for k, v in source.state_dict().items():
        close(v, history[1]["state"][k], k)

    # A new job (one node this time) resumes: its step 3 is the uninterrupted run's step 3, to the bit.
    standalone(resumed, 4, *TINY, "--steps", "3", "--resume", "--ckpt", str(ckpt))
    again = {(r["stage"], r["replica"]): r for r in ranks(resumed)}
    for r in results:
        twin = again[(r["stage"], r["replica"])]
        assert twin["losses"] == {k: v for k, v in r["losses"].items() if k == 2}
        for n, p in r["params"].items():
            assert torch.equal(twin["params"][n], p), n
        assert str(twin["optimizer"]["state"]) == str(r["optimizer"]["state"])


def test_killing_a_node_ends_the_job_with_a_peer_error(tmp_path: Path) -> None:
    port = free_port()
    args = [*TINY, "--steps", "100000", "--timeout", "20"]
    first = node(0, port, tmp_path, *args)
    second = node(1, port, tmp_path, *args)
    try:
        deadline = time.monotonic() + 150
        while len(list(tmp_path.glob("started*"))) < 4:  # every rank has finished a step: training is under way
            assert first.poll() is None and second.poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        killed = time.monotonic()
        kill_node(second)  # node 1 goes down: its agent and both its processes
        code = first.wait(timeout=90)
        took = time.monotonic() - killed
    finally:
        for p in (first, second):
            kill_node(p)
    log = (tmp_path / "node0.log").read_text()
    assert code != 0
    assert "seqify.errors.PeerError" in log, log[-3000:]
    assert "lost rank" in log or "lost one of ranks" in log, log[-3000:]
    assert "seqify.checkpoint.load(stage, folder, optimizer, scheduler)" in log  # what to do
    assert took < 60, took  # within the 20 s process-group timeout plus torchrun's shutdown


def test_fixed_programs_per_micro_batch_train_like_one_process(tmp_path: Path) -> None:
    """graphs=True on CPU: each micro-batch's forward and backward as a fixed program (eager here, CUDA
    graphs on GPUs), reused step after step by copying received values in; equal to one process."""
    standalone(tmp_path, 2, *TINY[:-1], "1f1b", "--steps", "3", "--graphs")
    history = one_process(steps=3, replicas=1)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in results:
        if r["stage"] == 1:
            assert all(abs(r["losses"][step] - history[step]["losses"][0]) < 1e-6 for step in range(3))
        for n, g in r["grads"].items():
            close(g, history[2]["grads"][n], n)
        for n, p in r["params"].items():
            close(p, history[2]["state"][n], n)
    assert {n for r in results for n in r["grads"]} == {n for n, _ in worker.build("tiny").named_parameters()}
