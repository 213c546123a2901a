"""A pipeline trained, saved with seqify.checkpoint and resumed in a fresh process trains on exactly as the run
that never stopped: same losses, same parameters, bit for bit (float64, dropout, numpy and random data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import resume
from helpers.procs import child_env

pytestmark = pytest.mark.timeout(240)

TESTS = Path(__file__).resolve().parents[1]
FIRST, THEN = 3, 3


def child(tmp: Path, phase: str, kind: str, folder: Path, *more: str) -> dict[str, Any]:
    """Run ``helpers.resume`` in a fresh Python process; its results as it saved them."""
    out = tmp / f"{phase}-{kind.replace(':', '-').replace(',', '_')}.pt"
    argv = [sys.executable, "-m", "helpers.resume", phase, "--kind", kind, "--folder", str(folder), "--out", str(out),
            "--first", str(FIRST), "--then", str(THEN), *more]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(OMP_NUM_THREADS="1"), cwd=TESTS,
                          timeout=200)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(out, weights_only=True)


def assert_resumed_exactly(ref: dict[str, Any], got: dict[str, Any]) -> None:
    assert ref["first"] + got["losses"] == ref["losses"]  # the first steps, then the resumed ones
    assert got["step"] == FIRST and got["lr"] == ref["lr"]
    assert ref["state"].keys() == got["state"].keys()
    for k, v in ref["state"].items():
        assert torch.equal(got["state"][k], v), k


def test_resume_in_a_fresh_process_with_the_same_pipeline(tmp_path: Path) -> None:
    """Two partitions, two micro-batches under 1F1B, Adam with weight decay, StepLR."""
    ref = child(tmp_path, "reference", "pipe:6,7", tmp_path / "ckpt", "--chunks", "2")
    got = child(tmp_path, "resume", "pipe:6,7", tmp_path / "ckpt", "--chunks", "2")
    assert_resumed_exactly(ref, got)
    assert got["extra"] == {"kind": "pipe:6,7"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A two-partition run of one micro-batch (which the source computes bit for bit, dropout included) under
    SGD with Nesterov momentum, stopped and saved after FIRST steps, and its uninterrupted run."""
    tmp = tmp_path_factory.mktemp("saved")
    return tmp / "ckpt", child(tmp, "reference", "pipe:6,7", tmp / "ckpt", "--optim", "sgd")


@pytest.mark.parametrize("kind", ["pipe:4,4,5", "source"])
def test_resume_onto_another_balance_or_the_source_model(saved: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                         kind: str) -> None:
    folder, ref = saved
    assert_resumed_exactly(ref, child(tmp_path, "resume", kind, folder, "--optim", "sgd"))


def test_without_the_random_generators_the_run_goes_elsewhere(saved: tuple[Path, dict[str, Any]],
                                                              tmp_path: Path) -> None:
    """The control: dropout and the data draw from the generators, so not restoring them changes the losses."""
    folder, ref = saved
    resume.resume("pipe:6,7", 1, "sgd", THEN, str(folder), str(tmp_path / "out.pt"), rng=False)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert ref["first"] + got["losses"] != ref["losses"]
