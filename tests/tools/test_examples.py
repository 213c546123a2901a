"""Every example runs on a CPU exactly as its docstring's quick command says, and prints what it promises."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
QUICK = "# a quick run on a CPU"
pytestmark = pytest.mark.timeout(300)


def quick_command(name: str) -> str:
    """The docstring line of ``examples/name`` marked as its quick CPU run (exactly one per example)."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text())) or ""
    lines = [line.split("#")[0].strip() for line in doc.splitlines() if line.rstrip().endswith(QUICK)]
    assert len(lines) == 1, f"examples/{name}: its docstring needs exactly one command line ending in {QUICK!r}"
    return lines[0]


def run_quick(name: str, cwd: Path, timeout: float = 240) -> str:
    """Run the docstring's command verbatim from a folder holding ``examples/`` (files it writes land in ``cwd``)."""
    argv = shlex.split(quick_command(name))
    launcher = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    assert argv[0] in launcher, f"examples/{name}: unexpected launcher {argv[0]!r}"
    (cwd / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
    done = subprocess.run([*launcher[argv[0]], *argv[1:]], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_every_example_has_a_quick_command() -> None:
    names = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert names == sorted(PROMISES)
    for name in names:
        assert quick_command(name).split()[0] in ("python", "torchrun")


PROMISES: dict[str, list[str]] = {
    "train_resnet101.py": ["ResNet: 345 layers", "Pipeline([", "step 0: loss", "step 1: loss",
                           "chunks: 2 instead of 8"],
    "unet_memory.py": ["one device: no plan of 1 stages fits", "PartitionPlan by memory on cpu: 2 stages",
                       "trained one step over ['cpu', 'cpu']"],
    "load_weights.py": ["outputs bit-equal to the trained model's: True",
                        "round trip into a plain torchvision model bit-equal: True"],
    "chunks_sweep.py": ["chunks   2:", "best:"],
    "resume_training.py": ["resumed at step 2 on balance", "losses bit-equal to the uninterrupted run: True",
                           "final weights bit-equal: True"],
    "resnet50_two_gpus.py": ["two CPU partitions", "Pipeline (seqify)", "Single device", "chunks: 4 instead of 6"],
    "torchrun_resnet.py": ["2 processes: 2 stages x 1 replicas", "step 0: loss", "chunks: 2 instead of 4"],
    "hf_trainer.py": ["Pipeline([", "step 2: loss",
                      "losses and gradient norms equal to the plain Trainer's (float32 rounding): True"],
    "train_llama.py": ["frontend export", "schedule zb-h1", "step 0: loss", "step 1: loss",
                       "round trip into a plain LlamaForCausalLM bit-equal: True"],
}


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_quick_command_from_the_docstring(name: str, tmp_path: Path) -> None:
    if name == "hf_trainer.py":  # transformers' Trainer needs accelerate (the test extra installs it)
        pytest.importorskip("accelerate")
    out = run_quick(name, tmp_path)
    assert "note:" not in out, f"examples/{name}: its quick command warns that it is slow:\n{out}"
    for text in PROMISES[name]:
        assert text in out, f"examples/{name}: {text!r} missing from its output:\n{out}"
    if name == "chunks_sweep.py" and "plot skipped" not in out:
        assert (tmp_path / "chunks-sweep" / "sweep.png").stat().st_size > 0
        assert (tmp_path / "chunks-sweep" / "sweep.svg").exists()
