"""seqify.distributed with several partitions per rank (interleaved, V) and zero-bubble's real B/W split:
real gloo processes in float64, losses, gradients, outputs and checkpoints equal to one-process training."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import dist_worker as worker
from helpers.procs import free_port, spawn
from seqify.distributed.link import SKIP, SKIP_GRAD
from seqify.schedule.actions import Action, Schedule, make, needs

pytestmark = pytest.mark.timeout(120)
BALANCE = [3, 3, 4, 4]  # Skippy's 14 layers: every skip crosses partitions (see dist_worker.Skippy)


def run(tmp: Path, world: int, balance: list[int], schedule: Any, loops: int, chunks: int = 4, batch: int = 8,
        checkpoint: str = "never", ckpt: str = "") -> list[dict[str, Any]]:
    spawn(worker.spawned, args=(world, free_port(), str(tmp), "skippy", balance, schedule, loops, chunks, batch,
                                   checkpoint, ckpt), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reference(chunks: int = 4, batch: int = 8, replicas: int = 1, name: str = "skippy") -> dict[str, Any]:
    """Two SGD steps in one process: each step's loss per replica shard (micro-batch losses weighted by
    size) and gradients (averaged over the shards), the parameters and momentum after the first step, the
    output of replica 0's shard after the second."""
    model = worker.build(name).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(2):
        x, y = worker.data(name, batch, step)
        opt.zero_grad()
        losses = []
        for r in range(replicas):
            xs, ys = (t[r * batch // replicas:(r + 1) * batch // replicas] for t in (x, y))
            loss = sum(worker.loss_fn(name)(model(a), b) * (len(a) / len(xs))
                       for a, b in zip(xs.tensor_split(chunks), ys.tensor_split(chunks)))
            (loss / replicas).backward()
            losses.append(float(loss.detach()))
        out["losses"].append(losses)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        if step == 0:
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            out["momentum"] = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out["output"] = model(worker.data(name, batch, 0)[0][:batch // replicas])
    return out


def check(results: list[dict[str, Any]], ref: dict[str, Any], replicas: int = 1) -> None:
    for step in range(2):
        for replica in range(replicas):
            mine = [r for r in results if r["replica"] == replica]
            losses = [r["losses"][step] for r in mine if r["losses"][step] is not None]
            assert len(losses) == 1  # one rank of each replica holds the last partition
            assert losses[0] == pytest.approx(ref["losses"][step][replica], rel=1e-12, abs=1e-12)
            seen: dict[str, torch.Tensor] = {}
            for r in mine:
                assert not set(seen) & set(r["grads"][step])  # each parameter lives on one rank
                seen.update(r["grads"][step])
            assert set(seen) == set(ref["grads"][step])
            for n, g in seen.items():
                torch.testing.assert_close(g, ref["grads"][step][n], rtol=1e-10, atol=1e-12, msg=n)
    outputs = [r["output"] for r in results if r["output"] is not None and r["replica"] == 0]
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0], ref["output"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("schedule", "loops", "owned"), [
    ("interleaved", 2, [[0, 2], [1, 3]]),  # round-robin: skip 0->2 stays on rank 0, 1->2 and 2->3 cross
    ("zb-h1", 2, [[0, 3], [1, 2]]),  # V: skip 1->2 stays on rank 1, 0->2 and 2->3 cross
    ("gpipe", 2, [[0, 2], [1, 3]]),
])
def test_two_partitions_per_rank_equal_one_process(tmp_path: Path, schedule: str, loops: int,
                                                   owned: list[list[int]]) -> None:
    results = run(tmp_path, 2, BALANCE, schedule, loops)
    assert [r["owned"] for r in results] == owned
    check(results, reference())


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_zero_bubble_one_partition_per_rank_with_checkpointing(tmp_path: Path, schedule: str) -> None:
    # 4 ranks x 1 partition: B sends input gradients on, W adds weight gradients later (recomputing
    # the checkpointed micro-batches); chunks=3 on a batch of 8 gives micro-batches of 3, 3, 2; zb-h2 runs
    # the first ranks further ahead, over the same messages
    results = run(tmp_path, 4, BALANCE, schedule, 1, chunks=3, checkpoint="except_last")
    check(results, reference(chunks=3))
    # skips go straight from the stashing rank to the popping one: skip 0 (partition 0 -> 2) and its
    # gradients never pass through rank 1; skip 2 (2 -> 3) leaves rank 2 for rank 3 only
    skips = {r: {(key[0], key[1], dst) for key, dst in results[r]["sent"] if key[0] in (SKIP, SKIP_GRAD)}
             for r in range(4)}
    assert skips == {0: {(SKIP, 0, 2)}, 1: {(SKIP, 1, 2)}, 2: {(SKIP, 2, 3), (SKIP_GRAD, 0, 0), (SKIP_GRAD, 1, 1)},
                     3: {(SKIP_GRAD, 2, 2)}}
    # nothing else crosses: per micro-batch 3 cuts and 3 skips, forward and back, in each of 2 training
    # steps, then forward only for the inference pass
    assert sum(len(r["sent"]) for r in results) == 2 * 3 * (6 + 6) + 3 * 6


def test_checkpoint_of_two_partitions_per_rank_loads_back(tmp_path: Path) -> None:
    results = run(tmp_path, 2, BALANCE, "interleaved", 2, ckpt=str(tmp_path / "ckpt"))
    ref = reference()
    state = __import__("seqify").distributed.merge(tmp_path / "ckpt")
    fresh = worker.build("skippy")
    fresh.load_state_dict(state)  # strict: the two stage files hold the whole source model
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p, ref["params"][n], rtol=1e-12, atol=1e-14, msg=n)
    for r in results:
        assert r["extra"] == 1
        for n, p in r["loaded"].items():
            torch.testing.assert_close(p, ref["params"][n], rtol=1e-12, atol=1e-14, msg=n)
            torch.testing.assert_close(r["momentum"][n], ref["momentum"][n], rtol=1e-12, atol=1e-14, msg=n)


def merged(per_device: list[list[Action]], like: Schedule) -> Schedule:
    """A schedule from per-rank lists: issue each rank's next action once what it needs has run."""
    todo = [list(work) for work in per_device]
    done: set[tuple[int, int, str]] = set()
    actions: list[Action] = []
    while any(todo):
        ready = [work for work in todo
                 if work and all(n in done for n in needs(work[0].partition, work[0].microbatch, work[0].kind,
                                                          like.partitions))]
        assert ready, "the lists deadlock"
        for work in ready:
            a = work.pop(0)
            actions.append(a)
            done.add((a.partition, a.microbatch, a.kind))
    return Schedule("by-hand", like.placement, like.microbatches, tuple(actions))


def test_a_schedule_object_with_ranks_in_different_orders(tmp_path: Path) -> None:
    # GPipe, but rank 0 runs its backwards in micro-batch order and rank 1 in reverse: messages are keyed,
    # so the ranks need not meet the micro-batches in the same order.
    plan = make("gpipe", (0, 1, 0, 1), 4)
    lists = plan.per_device()
    lists[0] = [a for a in lists[0] if a.kind == "F"] + sorted((a for a in lists[0] if a.kind == "B"),
                                                               key=lambda a: (-a.partition, a.microbatch))
    mine = merged(lists, plan)
    mine.check()
    assert [a.microbatch for a in mine.per_device()[0] if a.kind == "B"][:4] == [0, 1, 2, 3]
    assert [a.microbatch for a in mine.per_device()[1] if a.kind == "B"][:4] == [3, 2, 1, 0]
    check(run(tmp_path, 2, BALANCE, mine, 1), reference())


def test_replicas_of_a_pipeline_with_two_partitions_per_rank(tmp_path: Path) -> None:
    # 4 processes: 2 replicas of 2 ranks x 2 partitions (V); each rank's gradients averaged with its twin's
    results = run(tmp_path, 4, BALANCE, "zb-h1", 2)
    assert [(r["replica"], r["owned"]) for r in results] == [(0, [0, 3]), (0, [1, 2]), (1, [0, 3]), (1, [1, 2])]
    check(results, reference(replicas=2), replicas=2)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_dying_rank_ends_its_peer_with_a_peer_error(tmp_path: Path, graphs: bool) -> None:
    # rank 0 holds the V's last partition and dies computing the loss; rank 1, waiting for its
    # gradients, must raise PeerError rather than hang (also when it runs fixed programs)
    port = free_port()
    args = (2, port, str(tmp_path), "skippy", BALANCE, "zb-h1", 2, 4, 8, "never", "", 0, graphs)
    start = time.monotonic()
    ctx = spawn(worker.spawned, args=args, nprocs=2, join=False)
    for p in ctx.processes:
        p.join(90)
    took = time.monotonic() - start
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung after its peer died"
    assert [p.exitcode for p in ctx.processes][0] == 3
    error = (tmp_path / "error1.txt").read_text()
    assert error.startswith("PeerError: rank 1") and "lost rank 0" in error
    assert took < 60


@pytest.mark.parametrize(("schedule", "checkpoint", "owned"), [
    ("interleaved", "never", [[0, 2], [1, 3]]),
    ("zb-h1", "never", [[0, 3], [1, 2]]),  # each program's B and W apart
    ("interleaved", "always", [[0, 2], [1, 3]]),
    ("zb-h1", "except_last", [[0, 3], [1, 2]]),
])
def test_fixed_programs_with_two_partitions_per_rank_equal_one_process(tmp_path: Path, schedule: str,
                                                                       checkpoint: str, owned: list[list[int]]) -> None:
    # graphs=True on the CPU: each (partition, micro-batch) a fixed program (eager here, CUDA graphs on
    # GPUs) driven by the rank's schedule actions; a checkpointed program's backward recomputes its forward
    tmp = tmp_path
    spawn(worker.spawned, args=(2, free_port(), str(tmp), "skippy", BALANCE, schedule, 2, 4, 8, checkpoint, "",
                                   -1, True), nprocs=2, join=True)
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["owned"] for r in results] == owned
    stop = {"always": 4, "except_last": 3, "never": 0}[checkpoint]
    for r in results:  # every partition of the rank ran as programs, checkpointed below stop
        assert r["programs"] == {p: [i < stop for i in range(4)] for p in r["owned"]}
        assert r["split"] == {p: [schedule == "zb-h1"] * 4 for p in r["owned"]}
        # the second step sends what the first did: after its first message to a peer, without headers
        assert r["quiet"][0] == 0 and r["quiet"][1] > 0
    check(results, reference())


@pytest.mark.parametrize("graphs", [False, True])
def test_a_weight_tied_within_one_rank_trains_like_one_process(tmp_path: Path, graphs: bool) -> None:
    """GPT-2's LM head is tied to its token embedding. zb-h1 in a V over 2 ranks x 2 partitions puts the first
    partition (the embedding) and the last (the head) on rank 0, which holds the weight once for both, as the
    source does: two SGD steps' losses, gradients and output equal one process's (float64), eagerly and as
    fixed programs (graphs=True; eager programs on the CPU, each partition's share of the gradient summed)."""
    pytest.importorskip("transformers")
    n = len(worker.converted("gpt2", worker.build("gpt2")))
    q = n // 4
    balance = [q, q, q, n - 3 * q]
    ckpt = tmp_path / "ckpt"
    spawn(worker.spawned, args=(2, free_port(), str(tmp_path), "gpt2", balance, "zb-h1", 2, 4, 8, "never",
                                   str(ckpt), -1, graphs), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert "transformer.wte.weight" in results[0]["grads"][0]  # the tied weight and its gradient: rank 0's
    assert all(bool(r["programs"]) is graphs for r in results)  # graphs: each rank ran fixed programs
    ref = reference(name="gpt2")
    check(results, ref)
    # the checkpoint after the first step: the ranks' files load into the source (strict), still tied
    fresh = worker.build("gpt2")
    fresh.load_state_dict(__import__("seqify").distributed.merge(ckpt))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    for n, p in fresh.named_parameters():
        torch.testing.assert_close(p, ref["params"][n], rtol=1e-12, atol=1e-14, msg=n)
    for r in results:
        for n, p in r["loaded"].items():
            torch.testing.assert_close(p, ref["params"][n], rtol=1e-12, atol=1e-14, msg=n)
