"""seqify.checkpoint of a distributed pipeline: the ranks write one folder together, in the in-process layout, and
fresh processes resume from it bit for bit onto the same ranks, another number of ranks and balance, an in-process
pipeline, the source model and a one-rank job; seqify.distributed.save, load and merge go through it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import dist_resume as job
from helpers.dist_worker import Tiny
from helpers.procs import child_env, free_port
from helpers.procs import spawn as fork

import seqify
import seqify.distributed as sd
from seqify import checkpoint

pytestmark = pytest.mark.timeout(240)
TESTS = Path(__file__).resolve().parents[1]


def spawn(world: int, out: Path, phase: str, folder: Path, runs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out.mkdir()
    fork(job.job, (world, free_port(), str(out), phase, str(folder), list(runs)), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def joined(records: list[dict[str, Any]], run: str) -> dict[str, Any]:
    """One run's result over its ranks: the last rank's losses, every rank's parameters and buffers."""
    losses = [r[run]["losses"] for r in records if r[run]["losses"][0] is not None]
    state = {k: v for r in records for k, v in r[run]["params"].items()}
    return {**records[0][run], "losses": losses[0], "params": state}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Both runs on 2 ranks, FIRST + THEN steps uninterrupted, each saved after FIRST."""
    tmp = tmp_path_factory.mktemp("dist")
    return tmp / "ckpt", spawn(2, tmp / "reference", "reference", tmp / "ckpt")


def assert_resumed(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert ref["losses"][job.FIRST:] == got["losses"]
    assert ref["lr"] == got["lr"]
    assert got["params"].keys() == ref["params"].keys()
    for k, v in got["params"].items():
        assert torch.equal(v, ref["params"][k]), k


def test_resume_on_the_same_ranks(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """2 ranks, 1F1B over two micro-batches, dropout, Adam and StepLR: the same next steps, to the bit."""
    folder, ref = saved
    got = spawn(2, tmp_path / "out", "resumed", folder, ("same", "moved"))
    for run in job.RUNS:
        assert_resumed(joined(ref, run), joined(got, run))
        assert got[0][run]["step"] == job.FIRST and got[1][run]["extra"] == {"run": run}


def test_resume_onto_three_ranks(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    folder, ref = saved
    got = spawn(3, tmp_path / "out", "resumed", folder, ("moved",))
    assert_resumed(joined(ref, "moved"), joined(got, "moved"))


def test_resume_in_one_process(saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Into an in-process pipeline, the source model, and a job of one rank, in a fresh process."""
    folder, ref = saved
    out = tmp_path / "one.pt"
    argv = [sys.executable, "-m", "helpers.dist_resume", "--folder", str(folder), "--out", str(out), "--port",
            str(free_port())]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(OMP_NUM_THREADS="1"), cwd=TESTS,
                          timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    for where in ("pipeline", "source", "one rank"):
        assert_resumed(joined(ref, "moved"), got[where])


def test_the_folder_is_the_in_process_layout_each_tensor_once(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    folder, _ = saved
    same = folder / "same"
    assert sorted(os.listdir(same)) == ["seqify.json", "state.pt", "tensors"]
    assert sorted(os.listdir(same / "tensors")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    restored = checkpoint.load_state_dict(same)
    net = job.source("same", 0)
    assert list(restored) == list(net.state_dict())  # the source's keys, in its order
    chunks = torch.distributed.checkpoint.FileSystemReader(str(same / "tensors")).read_metadata().state_dict_metadata
    assert all(len(m.chunks) == 1 for m in chunks.values())  # the buffer two ranks hold: written once
    state = torch.load(same / "state.pt", weights_only=True)
    assert len(state["rng_ranks"]) == 2 and torch.equal(state["rng"]["torch"], state["rng_ranks"][0]["torch"])
    for k, v in sd.merge(same).items():  # the old name reads the new folder
        assert torch.equal(v, restored[k]), k


def test_a_stage_without_its_job_refuses(tmp_path: Path) -> None:
    seq = seqify.convert(Tiny())
    stage = sd.DistributedStage(seq, [3, 3], index=0, device=torch.device("cpu"))
    with pytest.raises(seqify.CheckpointError, match=r"pipeline of 2 process\(es\), and this job has 1.*every rank"):
        checkpoint.save(stage, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def stage_files(stages: list[sd.DistributedStage], path: Path, optimizers: list[torch.optim.Optimizer]) -> None:
    """A folder of stage{i}.pt files, seqify.distributed's own layout (which load and merge still read)."""
    from seqify.checkpoint.keys import rank_places

    path.mkdir()
    for s, opt in zip(stages, optimizers):
        places = rank_places(s.model, s.partition, s.is_first)
        keys = {id(t): k for k, ts in places.items() for t in ts}
        names = [keys[id(p)] for g in opt.param_groups for p in g["params"]]
        state = opt.state_dict()
        torch.save({"format": "seqify.distributed/1", "stage": s.index, "stages": s.stages, "balance": s.balance,
                    "state": {k: ts[0].detach().clone() for k, ts in places.items()}, "extra": 5,
                    "optimizer": {"state": {names[i]: v for i, v in state["state"].items()},
                                  "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                                                   for g in state["param_groups"]]}},
                   sd.checkpoint.stage_file(path, s.index))


def test_stage_files_still_load_and_merge(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Tiny()
    seq = seqify.convert(source)
    stages = [sd.DistributedStage(seq, [3, 3], index=i, device=torch.device("cpu")) for i in range(2)]
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    for s, o in zip(stages, opts):
        for p in s.parameters():
            p.grad = torch.randn_like(p)
        o.step()
    stage_files(stages, tmp_path / "old", opts)
    fresh = Tiny()
    fresh.load_state_dict(sd.merge(tmp_path / "old"))
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in fresh.state_dict().items())
    again = [sd.DistributedStage(seqify.convert(Tiny()), [3, 3], index=i, device=torch.device("cpu")) for i in range(2)]
    for s, before, o in zip(again, stages, opts):
        opt = torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9)
        assert sd.load(s, tmp_path / "old", opt) == 5
        assert all(torch.equal(p, q) for p, q in zip(s.parameters(), before.parameters()))
        assert all(torch.equal(opt.state[p]["momentum_buffer"], o.state[q]["momentum_buffer"])
                   for p, q in zip(s.parameters(), before.parameters()))
