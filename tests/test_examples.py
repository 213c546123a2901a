"""Every example runs on a CPU with small sizes, as a user would start it, and says what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.timeout(300)


def run(*argv: str, timeout: float = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=EXAMPLES.parent)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_every_example_has_a_smoke_test() -> None:
    tested = {"train_resnet101.py", "unet_memory.py", "load_weights.py", "chunks_sweep.py", "resnet50_two_gpus.py",
              "torchrun_resnet.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_train_resnet101() -> None:
    out = run(str(EXAMPLES / "train_resnet101.py"), "--batch", "4", "--size", "32", "--steps", "1", "--chunks", "2")
    assert "ResNet: 345 layers" in out and "Pipeline([" in out
    assert "step 0: loss" in out


def test_unet_memory() -> None:
    out = run(str(EXAMPLES / "unet_memory.py"), "--depth", "3", "--channels", "8", "--size", "64", "--batch", "2",
              "--chunks", "2")
    assert "one device: no plan of 1 stages fits" in out
    assert "PartitionPlan by memory on cpu: 2 stages" in out and "trained one step over ['cpu', 'cpu']" in out


def test_load_weights() -> None:
    out = run(str(EXAMPLES / "load_weights.py"), "--model", "resnet18", "--size", "32")
    assert "outputs bit-equal to the trained model's: True" in out
    assert "round trip into a plain torchvision model bit-equal: True" in out


def test_chunks_sweep(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = run(str(EXAMPLES / "chunks_sweep.py"), "--model", "resnet18", "--batch", "4", "--size", "32", "--chunks", "1",
              "2", "--steps", "1", "--out", str(tmp_path))
    assert "chunks   2:" in out and "best:" in out
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "sweep.svg").exists()


def test_resnet50_two_gpus(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = run(str(EXAMPLES / "resnet50_two_gpus.py"), "--batch", "4", "--size", "32", "--batches", "1", "--repeats", "1",
              "--chunks", "2", "--plot", str(tmp_path / "mp_vs_rn.png"))
    assert "two CPU partitions" in out and "Pipeline (seqify)" in out and "Single device" in out
    assert (tmp_path / "mp_vs_rn.png").exists()


def test_torchrun_resnet() -> None:
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
              str(EXAMPLES / "torchrun_resnet.py"), "--model", "resnet18", "--batch", "4", "--size", "32", "--steps", "1",
              "--chunks", "2")
    assert "2 processes: 2 stages x 1 replicas" in out and "step 0: loss" in out
