"""Past two devices on the CPU: 4- and 8-partition plans and pipelines (loops 1 and 2, and the tuner's
choice) compute what the source computes in float64, and the scaling benchmark's smoke mode runs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

import seqify

from helpers.exactness import loss_of
from helpers import benchmarks


def resnet() -> tuple[nn.Module, torch.Tensor]:
    """A ResNet with one BasicBlock per stage: every kind of skip a ResNet has, small enough for 8 cuts."""
    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10).double(), torch.randn(4, 3, 16, 16, dtype=torch.float64)


def unet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = seqify.zoo.build("unet", depth=2, blocks=1, channels=4).double()
    return model, torch.randn(4, 3, 16, 16, dtype=torch.float64)


MODELS = {"resnet": resnet, "unet": unet}


def check(source: nn.Module, model: nn.Module, pipe: seqify.Pipeline, x: torch.Tensor) -> None:
    """The pipeline (over ``model``, a copy of ``source`` it was converted from) against ``source`` on one
    device running the same micro-batches: outputs equal, every parameter's gradient allclose (float64)."""
    want = torch.cat([source(part) for part in x.tensor_split(pipe.chunks)])
    got = pipe(x)
    assert torch.equal(got, want), "pipeline output differs from the source's"
    loss_of(want).backward()
    loss_of(got).backward()
    mine = dict(model.named_parameters())
    for name, p in source.named_parameters():
        torch.testing.assert_close(mine[name].grad, p.grad, msg=f"gradient of {name}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("devices,loops", [(4, 1), (8, 1), (4, 2)])
def test_many_partitions_are_exact(name: str, devices: int, loops: int) -> None:
    """Eval mode (BatchNorm uses its running statistics, so micro-batches cannot change the result),
    forward and backward, 4 micro-batches, the plan balanced by FLOPs for devices x loops partitions."""
    source, x = MODELS[name]()
    source.eval()
    model = copy.deepcopy(source)
    seq = seqify.convert(model).eval()
    parts = devices * loops
    plan = seqify.balance(seq, parts, x, by="flops", progress=False)
    assert len(plan.balance) == parts and sum(plan.balance) == len(seq)
    pipe = seqify.pipeline(seq, devices=["cpu"] * devices, loops=loops, balance=plan.balance, chunks=4).eval()
    assert len(pipe.devices) == parts
    check(source, model, pipe, x)


@pytest.mark.parametrize("name", list(MODELS))
def test_eight_partitions_train_mode_one_micro_batch(name: str) -> None:
    """Training mode: BatchNorm normalises by the batch and updates its statistics exactly as one device."""
    source, x = MODELS[name]()
    source.train()
    model = copy.deepcopy(source)
    seq = seqify.convert(model).train()
    pipe = seqify.pipeline(seq, devices=["cpu"] * 8, balance=seqify.balance(seq, 8, x, by="flops", progress=False).balance,
                           chunks=1)
    check(source, model, pipe, x)
    buffers = dict(model.named_buffers())
    for key, value in source.named_buffers():
        assert torch.equal(buffers[key], value), f"buffer {key} differs"


def test_tuned_eight_partitions_are_exact(tmp_path, monkeypatch) -> None:
    """The tuner's choice over 4 CPU devices, 2 loops (8 partitions) builds an exact pipeline."""
    monkeypatch.setenv("SEQIFY_CACHE_DIR", str(tmp_path))
    source, x = unet()
    source.eval()
    model = copy.deepcopy(source)
    seq = seqify.convert(model).eval()
    cfg = seqify.tune(seq, x, devices=["cpu"] * 4, loops=2, top=1, steps=1, warm=0, show=False)
    assert cfg.loops == 2 and len(cfg.balance) == 8
    check(source, model, seqify.pipeline(seq, config=cfg).eval(), x)


@pytest.fixture(scope="module")
def scaling_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """benchmarks/scaling/main.py's CPU smoke run over 1 and 2 devices, once for the tests that read its rows
    (the smoke test and torch pipelining's anchor, which takes the 2-device rows): its file and its stdout."""
    import os

    where = tmp_path_factory.mktemp("scaling")
    out = where / "scaling.json"
    run = subprocess.run(
        [sys.executable, str(benchmarks.path("scaling/main.py")), "--tiny", "--device", "cpu", "--gpus", "1", "2",
         "--models", "unet", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=where,
        env={**os.environ, "SEQIFY_CACHE_DIR": str(where / "cache")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


def test_scaling_benchmark_smoke(scaling_rows: tuple[Path, str]) -> None:
    out, stdout = scaling_rows
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["model"] for r in rows} == {"unet"}
    for model in ("unet",):
        for scaling in ("strong", "weak"):
            mine = {r["gpus"]: r for r in rows if r["model"] == model and r["scaling"] == scaling and r["runner"] == "seqify"}
            assert set(mine) == {1, 2}
            assert all(r["samples_per_s"] > 0 and len(r["peak_allocated"]) == r["gpus"] for r in mine.values())
            assert mine[2]["config"]["chunks"] >= 1
    assert "speed-up" in stdout and "peak" in stdout


def test_families_benchmark_smoke(tmp_path) -> None:
    """benchmarks/families/main.py (every zoo family with the automatic configuration) in its CPU smoke
    mode: one JSON line per family with the tuner's choice, predicted and measured times and the ratio to one
    device; an unknown family is a usage error, not a silent empty run."""
    import os

    out = tmp_path / "families.jsonl"
    script = str(benchmarks.path("families/main.py"))
    env = {**os.environ, "SEQIFY_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, script, "--tiny", "--devices", "cpu,cpu", "--families", "U-Net", "GPT-2",
                          "--steps", "1", "--warm", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["family"] for r in rows] == ["U-Net", "GPT-2"]
    for r in rows:
        assert "error_text" not in r, r.get("error_text")
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["speedup"] > 0 and r["devices"] == ["cpu", "cpu"]
        assert r["rows"][0]["name"].startswith("one device") and any(row["chosen"] for row in r["rows"])
    assert "| U-Net | unet |" in run.stdout
    bad = subprocess.run([sys.executable, script, "--tiny", "--families", "Nope"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "unknown families" in bad.stderr


def test_stability_benchmark_smoke(tmp_path) -> None:
    """benchmarks/stability/main.py in its CPU smoke mode: per partitions, micro-batch count and slack, one cut
    per fresh profile, each covering every layer, the count of distinct ones, the profiles kept for study, and
    the tuner's choice per run."""
    import os

    import torch

    out, dump = tmp_path / "stability.jsonl", tmp_path / "profiles.pt"
    env = {**os.environ, "SEQIFY_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(benchmarks.path("stability/main.py")), "--tiny", "--device", "cpu",
                          "--devices", "cpu,cpu", "--runs", "2", "--tunes", "1", "--chunks", "1", "4", "--out",
                          str(out), "--dump", str(dump)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# environment: ")
    rows = [json.loads(line) for line in lines[1:]]
    cuts = [r for r in rows if r["kind"] == "cut"]
    assert {(r["partitions"], r["chunks"], r["slack"]) for r in cuts} == {
        (p, c, s) for p in (2, 4) for c in (1, 4) for s in (0.02, 0.0)}
    layers = sum(cuts[0]["balances"][0])
    for r in cuts:
        assert len(r["balances"]) == 2 and all(sum(b) == layers and len(b) == r["partitions"] for b in r["balances"])
        assert r["distinct"] == len({tuple(b) for b in r["balances"]})
    tune = next(r for r in rows if r["kind"] == "tune")
    assert tune["devices"] == ["cpu", "cpu"] and len(tune["choices"]) == 1
    choice = tune["choices"][0]
    assert choice["config"].startswith("PipeConfig") and choice["step_ms"] > 0
    assert choice["peak_gib"] == choice["reserved_gib"] == []  # per CUDA device: none on the CPU
    profiles = torch.load(dump, weights_only=False)
    assert len(profiles) == 2 and all(set(p) == {1, 4} and len(p[1]["cost"]) == layers for p in profiles)


def _bench(name: str) -> Any:
    """benchmarks/NAME/main.py, imported by its path."""
    return benchmarks.load(f"{name}/main.py")


def _anchor() -> Any:
    """benchmarks/scaling/torchpp.py, imported as its torchrun workers import it."""
    return benchmarks.load("scaling/torchpp.py")


def test_one_device_baseline_accumulates_when_the_batch_does_not_fit(monkeypatch) -> None:
    """scaling.py's one-device row: a batch that runs out of memory whole runs as 2, 4, ... accumulated
    micro-batches with the whole batch's gradient, the table says how many, and a model that fits no
    micro-batch still fails."""
    import argparse

    sc = _bench("scaling")

    class Small(nn.Module):
        def __init__(self, fits: int) -> None:
            super().__init__()
            self.fits = fits
            self.lin = nn.Linear(3, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(x) > self.fits:
                raise torch.OutOfMemoryError("out of memory (test)")
            return self.lin(x)

    torch.manual_seed(0)
    model, x = Small(fits=2), torch.randn(8, 3, dtype=torch.float64)
    reference = nn.Linear(3, 2).double()
    reference.load_state_dict(model.lin.state_dict())
    sc._loss(reference(x)).backward()
    monkeypatch.setattr(model, "zero_grad", lambda set_to_none=True: None)  # keep the timed step's gradients
    sec, k = sc.one_device(model, x, [torch.device("cpu")], argparse.Namespace(steps=1, warm=0))
    assert k == 4 and sec > 0
    torch.testing.assert_close(model.lin.weight.grad, reference.weight.grad)
    torch.testing.assert_close(model.lin.bias.grad, reference.bias.grad)
    row = dict(model="m", scaling="strong", gpus=1, batch=8, runner="seqify", accumulate=k, seconds=sec,
               samples_per_s=8 / sec, peak_allocated=[0.0], peak_reserved=[0.0], config=None)
    assert "one device, 4 micro-batches accumulated" in sc.table([row])
    with pytest.raises(torch.OutOfMemoryError):
        sc.one_device(Small(fits=0), x, [torch.device("cpu")], argparse.Namespace(steps=1, warm=0))


def test_a_row_no_configuration_fits_is_recorded_and_the_run_goes_on(monkeypatch) -> None:
    """scaling.py's pipelined row where the tuner finds no candidate that fits (MemoryCapError) is a row with
    that error, not the end of the model's rows."""
    import argparse

    sc = _bench("scaling")

    def full(*args: Any, **kwargs: Any) -> Any:
        raise seqify.MemoryCapError("each of the 4 best candidates ran out of memory in a timed step (test)")

    monkeypatch.setattr(seqify, "tune", full)
    m = sc.Model("m", lambda: nn.Linear(3, 2), lambda n: torch.randn(n, 3), 4)
    args = argparse.Namespace(tiny=False, top=1, steps=1, warm=0)
    row = sc.run_one(m, nn.Sequential(nn.Linear(3, 2)), 2, 4, "weak", args, [torch.device("cpu")] * 2)
    assert row["error"].startswith("no configuration fits: each of the 4 best") and "seconds" not in row
    assert "no configuration fits" in sc.table([row])


@pytest.mark.parametrize("name", list(MODELS))
def test_torchpp_anchor_stages_are_exact(name: str) -> None:
    """torch pipelining's anchor runs the tuner's cuts as stages that pass flat tensors (the crossing skips
    carried through the partitions in between): chained by hand over 4 partitions they compute the source's
    output bit-equal and its gradients (float64, eval mode), so the anchor is measured on the same function."""
    st = _anchor()
    source, x = MODELS[name]()
    source.eval()
    model = copy.deepcopy(source)
    seq = seqify.convert(model).eval()
    q = len(seq) // 4
    balance = [q, q, q, len(seq) - 3 * q]  # even layer counts: cuts inside the skips' spans
    cpu = torch.device("cpu")
    cuts = st.cuts(seq, list(balance), x, cpu)
    assert any(c.live for c in cuts), "no skip crosses a cut: the carrying is not exercised"
    stages = st.stages_of(seq, list(balance), list(range(4)), cpu, cuts)
    flat: tuple[torch.Tensor, ...] = (x,)
    for stage in stages:
        out = stage(*flat)
        flat = out if isinstance(out, tuple) else (out,)
        assert all(t.is_contiguous() and not t._is_view() for t in flat)
    (got,) = flat
    want = source(x)
    assert torch.equal(got, want)
    loss_of(got).backward()
    loss_of(want).backward()
    mine = dict(model.named_parameters())
    for key, p in source.named_parameters():
        torch.testing.assert_close(mine[key].grad, p.grad, msg=f"gradient of {key}")


def test_torchpp_anchor_runs_under_torchrun(tmp_path, scaling_rows: tuple[Path, str]) -> None:
    """The anchor itself on 2 gloo ranks over scaling.py's CPU smoke rows: torch pipelining's schedules for each
    row's placement (GPipe and 1F1B for one partition per rank, the looped ones for several) run the U-Net's cuts
    (skips cross them) and each writes a row with its speed; a schedule that cannot build
    (fewer micro-batches than stages) is a recorded error, not a hang."""
    import os

    env = {**os.environ, "SEQIFY_CACHE_DIR": str(tmp_path / "cache")}
    rows = scaling_rows[0]
    out = tmp_path / "torchpp.jsonl"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(benchmarks.path("scaling/torchpp.py")), "--rows", str(rows), "--out", str(out),
                          "--device", "cpu", "--steps", "1", "--warm", "0"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    ran = [r for r in got if "samples_per_s" in r]
    # the tuner's timed choice decides how many partitions a rank holds: each placement gets its own schedules
    torchpp = benchmarks.load("scaling/torchpp.py")
    expected = {s.__name__ for r in got for s in torchpp.schedules(tuple(r["placement"]), 2)}
    assert ran and {r["schedule"] for r in got} == expected
    assert {r["schedule"] for r in ran if len(r["placement"]) == 2} <= {"ScheduleGPipe", "Schedule1F1B"}
    assert {r["scaling"] for r in ran} == {"strong", "weak"}
    assert all(r["runner"] == "torchpp" and r["gpus"] == 2 and r["samples_per_s"] > 0 for r in ran)
    assert all("micro" in r["error"] for r in got if "error" in r)
    table = subprocess.run([sys.executable, str(benchmarks.path("scaling/main.py")), "--table", str(rows), str(out)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert table.returncode == 0 and "torch pipelining" in table.stdout and "same cuts" in table.stdout
