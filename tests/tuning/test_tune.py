"""seqify.tune on CPU partitions: valid choices, the cache, saved configurations, chunks='auto', memory caps,
and the step-time model's bubble. No timing is asserted: only that predictions and measurements are made."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify
from seqify.pipe.microbatch import scatter
from seqify.pipe.config import Trial
from seqify.tuning.predict import Calibration, Candidate, LayerModel, predict
from seqify.tuning.choice import TIE, steady

from helpers.exactness import assert_unchanged, loss_of, snapshot

from seqify import tuning  # the module; seqify.tune is its function
CPU2 = ["cpu", "cpu"]


class Residual(nn.Module):
    """A small net with a skip, so conversion makes a stash/pop pair the tuner must keep exact."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(torch.tanh(self.b(torch.relu(self.a(h)))) + h)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQIFY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def source_and_seq() -> tuple[nn.Module, seqify.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    source = Residual().double()
    seq = seqify.convert(copy.deepcopy(source))
    return source, seq, torch.randn(8, 6, dtype=torch.float64)


def assert_pipe_exact(source: nn.Module, pipe: nn.Module, x: torch.Tensor) -> None:
    """The pipeline against the source model run on the same micro-batches: forward equal, gradients allclose.
    (The source itself is not bit-equal across batch sizes on CPU: MKL's float64 matmul of 2 rows differs
    from the same rows inside 8 in the last bit, so a tuned choice of 4 chunks is compared piece by piece.)"""
    ref = copy.deepcopy(source)
    want = torch.cat([ref(part) for part in scatter(x, pipe.chunks)])  # the pipeline's own split
    got = pipe(x)
    assert torch.equal(got, want)
    loss_of(want).backward()
    loss_of(got).backward()
    mine = dict(pipe.model.named_parameters())
    for name, p in seqify.convert(ref).named_parameters():
        torch.testing.assert_close(mine[name].grad, p.grad)


def counting(monkeypatch) -> dict[str, int]:
    """Count the tuner's measurements: per-layer profiles and timed pipeline steps."""
    calls = {"profile": 0, "steps": 0}
    profile, steps = tuning.profile.layer_model, tuning.measure.step_seconds

    def count_profile(*a, **k):
        calls["profile"] += 1
        return profile(*a, **k)

    def count_steps(*a, **k):
        calls["steps"] += 1
        return steps(*a, **k)

    monkeypatch.setattr(tuning.profile, "layer_model", count_profile)
    monkeypatch.setattr(tuning.measure, "step_seconds", count_steps)
    return calls


def test_tune_returns_a_valid_config_and_leaves_the_model_alone() -> None:
    source, seq, x = source_and_seq()
    before = snapshot(seq)
    cfg = seqify.tune(seq, x, devices=CPU2, top=2, steps=1, show=False)
    assert_unchanged(seq, before)
    assert sum(cfg.balance) == len(seq) and all(b >= 1 for b in cfg.balance)
    assert len(cfg.balance) == 2 * cfg.loops and cfg.devices == ("cpu", "cpu")
    assert 1 <= cfg.chunks <= 8 and cfg.checkpoint in ("never", "except_last", "always") and not cfg.graphs
    assert cfg.batch == 8 and cfg.predicted_s > 0 and cfg.measured_s is not None
    pipe = seqify.pipeline(seq, config=cfg)
    assert (pipe.chunks, pipe.balance, pipe.checkpoint) == (cfg.chunks, list(cfg.balance), cfg.checkpoint)
    assert_pipe_exact(source, pipe, x)


def test_predicted_next_to_measured() -> None:
    _, seq, x = source_and_seq()
    cfg = seqify.tune(seq, x, devices=CPU2, top=2, steps=1, show=False)
    confirmed = [t for t in cfg.trials if t.measured_s is not None]
    assert len(confirmed) == 2 and all(t.predicted_s > 0 and t.measured_s > 0 for t in confirmed)
    assert any(t.measured_s is None for t in cfg.trials)  # rejected on prediction alone, still reported
    text = str(cfg)
    assert "predicted ms" in text and "measured ms" in text
    chosen = [line for line in text.splitlines() if line.startswith("*")]
    assert len(chosen) == 1 and f"{cfg.measured_s * 1e3:.2f}" in chosen[0] and f"{cfg.predicted_s * 1e3:.2f}" in chosen[0]
    # the fastest confirmed one wins, or one timed within noise of it that comes first in a fixed order
    assert cfg.measured_s <= (1 + TIE) * min(t.measured_s for t in confirmed)


def test_candidates_that_run_alike_are_weighed_once(monkeypatch) -> None:
    """ZB-H2 with no more micro-batches than devices runs ZB-H1's actions: one of the two is a candidate (the
    pair took two of the three timed places on 2x H200 for ResNet-101), while with more micro-batches both are."""
    _, seq, x = source_and_seq()
    seen: list[tuple[str, int]] = []
    real = tuning.search.predict

    def spy(c, *a, **k):  # type: ignore[no-untyped-def]
        seen.append((c.schedule, c.chunks))
        return real(c, *a, **k)

    monkeypatch.setattr(tuning.search, "predict", spy)
    seqify.tune(seq, x, devices=CPU2, top=0, loops=1, graphs=False, show=False, cache=False)
    assert ("zb-h1", 2) in seen and ("zb-h2", 2) not in seen
    assert ("zb-h1", 8) in seen and ("zb-h2", 8) in seen


def test_cache_hits_on_the_second_call(monkeypatch, cache_dir) -> None:
    _, seq, x = source_and_seq()
    calls = counting(monkeypatch)
    first = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    assert calls == {"profile": 1, "steps": 3}  # executor, model alone, best candidate
    assert (cache_dir / "tune.json").is_file() and first.key in json.loads((cache_dir / "tune.json").read_text())
    again = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    assert calls == {"profile": 1, "steps": 3}  # nothing measured again
    assert again.to_dict() == first.to_dict()
    seqify.tune(seq, x[:4], devices=CPU2, top=1, steps=1, show=False)  # another input shape: a new choice
    assert calls == {"profile": 2, "steps": 6}
    seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, cache=False)
    assert calls == {"profile": 3, "steps": 9}


def test_the_tuner_logs_its_choice_and_the_cache(caplog, cache_dir) -> None:
    _, seq, x = source_and_seq()

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "seqify.tuning" and r.levelno == logging.INFO]

    with caplog.at_level(logging.INFO, logger="seqify"):
        first = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    miss, chose = logged()
    assert miss == f"tune: cache miss (key {first.key} in {cache_dir / 'tune.json'}): measuring"
    assert chose.startswith(f"tune: chose {first.without_trials()} (of ") and chose.endswith(", 1 timed)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="seqify"):
        again = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    assert logged() == [f"tune: cache hit (key {first.key} in {cache_dir / 'tune.json'}): {again.without_trials()}"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="seqify"):
        seqify.tune(seq, x, devices=CPU2, top=0, show=False, cache=False)
    assert [m.split(" ")[1] for m in logged()] == ["chose"]  # no cache read or written: nothing said of it


def test_saved_config_round_trips_and_rebuilds_the_same_pipeline(tmp_path) -> None:
    source, seq, x = source_and_seq()
    cfg = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, loops=2)
    path = tmp_path / "cfg.json"
    cfg.save(path)
    loaded = seqify.PipeConfig.load(path)
    assert loaded.to_dict() == cfg.to_dict() and loaded == cfg
    a = seqify.pipeline(seq, config=cfg)
    b = seqify.pipeline(seq, config=str(path))
    assert (a.balance, [str(d) for d in a.devices], a.chunks, a.checkpoint) == \
        (b.balance, [str(d) for d in b.devices], b.chunks, b.checkpoint)
    assert len(b.devices) == 4 and b.config == cfg
    assert_pipe_exact(source, b, x)
    # overlap (two streams per GPU) travels with a configuration; files from before it load without it
    lanes = replace(cfg, overlap=True, graphs=True)
    lanes.save(path)
    assert seqify.PipeConfig.load(path).overlap and "graphs True, overlap" in str(lanes)
    assert lanes.options()["overlap"] is True and cfg.options()["overlap"] is False
    old = {k: v for k, v in cfg.to_dict().items() if k != "overlap"}
    assert seqify.PipeConfig.from_dict(old) == cfg and not cfg.overlap


def test_chunks_auto_is_the_default_with_devices_and_a_sample(monkeypatch) -> None:
    source, seq, x = source_and_seq()
    calls = counting(monkeypatch)
    pipe = seqify.pipeline(seq, devices=CPU2, sample=x)
    assert calls["profile"] == 1 and pipe.config is not None
    assert pipe.chunks == pipe.config.chunks and pipe.balance == list(pipe.config.balance)
    assert "tuned: PipeConfig" in repr(pipe)
    assert_pipe_exact(source, pipe, x)
    hand = seqify.pipeline(seq, devices=CPU2, balance=[2, len(seq) - 2])  # chosen by hand: not tuned
    assert hand.config is None and hand.chunks == 1 and calls["profile"] == 1
    fixed = seqify.pipeline(seq, devices=CPU2, sample=x, chunks="auto", balance=[2, len(seq) - 2])
    assert fixed.balance == [2, len(seq) - 2] and fixed.config is not None


def test_auto_without_a_sample_says_what_to_pass() -> None:
    _, seq, _ = source_and_seq()
    with pytest.raises(seqify.TuneError, match="sample="):
        seqify.pipeline(seq, devices=CPU2, chunks="auto")


def test_memory_cap_is_respected_or_refused() -> None:
    _, seq, x = source_and_seq()
    with pytest.raises(seqify.MemoryCapError, match="raise memory_cap"):
        seqify.tune(seq, x, devices=CPU2, memory_cap=16, top=0, show=False)
    with pytest.raises(seqify.MemoryCapError, match="raise memory_cap"):  # chunks='auto' hands the cap to the tuner
        seqify.pipeline(seq, devices=CPU2, sample=x, memory_cap="16B")
    x = torch.randn(64, 6, dtype=torch.float64)  # activations outweigh parameters: checkpointing matters
    free = seqify.tune(seq, x, devices=CPU2, top=0, show=False, cache=False)
    cap = free.trials[0].memory_bytes - 1  # the fastest prediction no longer fits
    capped = seqify.tune(seq, x, devices=CPU2, memory_cap=cap, top=0, show=False, cache=False)
    assert capped.trials and all(t.memory_bytes <= cap for t in capped.trials)
    assert capped.without_trials() != free.without_trials()


def test_config_for_another_model_is_refused() -> None:
    _, seq, x = source_and_seq()
    cfg = seqify.tune(seq, x, devices=CPU2, top=0, show=False)
    with pytest.raises(seqify.TuneError, match="tuned for another model"):
        seqify.pipeline(nn.Sequential(nn.Linear(6, 6), nn.ReLU()), config=cfg)
    with pytest.raises(seqify.ConfigError, match=r"unknown entries \['chunk'\]"):
        seqify.PipeConfig.from_dict({"chunk": 2})


def uniform(layers: int, seconds: float) -> LayerModel:
    return LayerModel((0.0,) * layers, (seconds,) * layers, (0.0,) * layers, (0,) * layers, (0.0,) * layers)


IDEAL = Calibration(task_s=0.0, launch_s=0.0, copy_latency_s=0.0, copy_bytes_per_s=float("inf"), host_serial=False)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("p", [2, 4])
def test_gpipe_bubble_comes_out_of_the_schedule(m: int, p: int) -> None:
    """Equal stages, no overheads: fill-drain takes (m + p - 1) slots forward and again backward."""
    layers = uniform(4 * p, 1e-3)
    c = Candidate((4,) * p, tuple(f"cuda:{j}" for j in range(p)), m, "never")
    work = 4 * p * 1e-3 * 16  # forward+backward of the whole mini-batch of 16 on one device
    got = predict(c, layers, IDEAL, 16).seconds
    assert got == pytest.approx(work / p * (m + p - 1) / m)
    serial = predict(c, layers, replace_serial(IDEAL), 16).seconds
    assert serial == pytest.approx(work)  # CPU partitions share the host: no overlap, no bubble either


def test_looped_breadth_first_shrinks_the_bubble() -> None:
    layers = uniform(16, 1e-3)
    plain = predict(Candidate((8, 8), ("cuda:0", "cuda:1"), 4, "never", graphs=True), layers, IDEAL, 16).seconds
    looped = predict(Candidate((4,) * 4, ("cuda:0", "cuda:1") * 2, 4, "never", graphs=True), layers, IDEAL, 16).seconds
    assert looped < plain
    recompute = predict(Candidate((8, 8), ("cuda:0", "cuda:1"), 4, "always"), layers, IDEAL, 16).seconds
    assert recompute > predict(Candidate((8, 8), ("cuda:0", "cuda:1"), 4, "never"), layers, IDEAL, 16).seconds


def replace_serial(cal: Calibration) -> Calibration:
    from dataclasses import replace

    return replace(cal, host_serial=True)


NETS = '''
from torch import nn


def build(width=16):
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))
'''


def test_bench_spec_on_cpu_shows_baseline_tuned_and_alternatives(tmp_path, capsys) -> None:
    from seqify import plot
    from seqify.tools.cli import main

    (tmp_path / "nets.py").write_text(NETS)
    out = tmp_path / "bench.png"
    code = main(["bench", f"{tmp_path / 'nets.py'}:build", "--shape", "8x6", "--devices", "cpu,cpu", "--steps", "1",
                 "--warm", "0", "--top", "1", "--alternatives", "2", "--plot", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms" not in line and "---" not in line]
    assert rows[0].startswith("|  | one device (cpu) | - | - |")  # measured, not predicted
    assert sum(r.startswith("| * |") for r in rows) == 1  # the tuned one
    assert len(rows) == 4  # baseline, tuned, two timed alternatives
    for r in rows[1:]:  # schedule, predicted and measured milliseconds side by side, peak MiB per device
        schedule, predicted, measured, _, peak, measured_peak = (c.strip() for c in r.split("|")[3:9])
        assert schedule in ("gpipe", "1f1b", "interleaved", "zb-h1")
        assert float(predicted) > 0 and float(measured) > 0
        assert len(peak.split(" / ")) == 2 and all(float(v) >= 0 for v in peak.split(" / "))
        assert measured_peak == "-"  # the CPU has no allocator peaks to read
    assert out.with_suffix(".png").is_file() == plot.available()


def test_inspect_tune_prints_the_choice(tmp_path, capsys) -> None:
    from seqify.tools.cli import main

    (tmp_path / "nets.py").write_text(NETS)

    def inspect(*options: str) -> int:
        return main(["inspect", f"{tmp_path / 'nets.py'}:build", "--shape", "8x6", "--devices", "cpu,cpu", "--tune",
                     "--no-layers", *options])

    code = inspect("--top", "1")
    text = capsys.readouterr().out
    assert code == 0 and "PipeConfig: 2 devices (cpu, cpu)" in text and "predicted ms" in text
    assert "schedule" in text and "peak MiB per device" in text
    code = inspect("--top", "1", "--no-cache", "--schedule", "1f1b")
    assert code == 0 and "schedule '1f1b'" in capsys.readouterr().out
    code = inspect("--top", "0", "--no-cache", "--memory-cap", "16B")
    assert code == 2 and "smallest cap that works" in capsys.readouterr().err
    code = inspect("--top", "0", "--no-cache", "--optimizer", "adamw")
    assert code == 0 and "PipeConfig: 2 devices (cpu, cpu)" in capsys.readouterr().out
    code = inspect("--top", "0", "--no-cache", "--optimizer", "adamm")
    assert code == 2 and "--optimizer adamm: name a torch.optim optimizer (ASGD, Adadelta" in capsys.readouterr().err
    code = inspect("--top", "0", "--no-cache", "--replicas", "2")
    assert code == 0 and "2 replicas" in capsys.readouterr().out


def test_fixed_balance_strategy_is_kept() -> None:
    _, seq, x = source_and_seq()
    cfg = seqify.tune(seq, x, devices=CPU2, balance="params", top=0, show=False, cache=False)
    want = seqify.balance(seq, 2 * cfg.loops, x, by="params", progress=False).balance
    assert cfg.by == "params" and list(cfg.balance) == want
    with pytest.raises(seqify.TuneError, match="balance='fast'"):
        seqify.tune(seq, x, devices=CPU2, balance="fast", top=0, show=False, cache=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tune_on_two_gpus_is_exact_and_reports_predictions() -> None:
    """On GPUs (CUDA graphs among the candidates) the chosen pipeline computes what the source does."""
    source, seq, _ = source_and_seq()
    x = torch.randn(64, 6, dtype=torch.float64)
    cfg = seqify.tune(seq, x, gpus=2, top=3, show=False, cache=False)
    assert cfg.devices == ("cuda:0", "cuda:1")
    assert all(t.measured_s > 0 for t in cfg.trials if t.measured_s is not None)
    pipe = seqify.pipeline(seq, config=cfg)
    source = source.to("cuda:0")
    want = torch.cat([source(part) for part in x.to("cuda:0").tensor_split(cfg.chunks)])
    got = pipe(x)
    torch.testing.assert_close(got.to("cuda:0"), want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tuning_gives_back_the_memory_pools_of_the_graphs_it_timed() -> None:
    """The timed candidates' captured graphs keep their activations in private memory pools; once seqify.tune
    returns none is left on a GPU (they would hold memory beside the chosen pipeline for the whole training)."""
    _, seq, _ = source_and_seq()
    x = torch.randn(64, 6, dtype=torch.float64)
    cfg = seqify.tune(seq, x, gpus=2, graphs=True, top=2, show=False, cache=False)
    assert any(t.graphs and t.measured_s for t in cfg.trials)
    pooled = [(s["device"], s["total_size"]) for s in torch.cuda.memory_snapshot()
              if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    assert not pooled, f"graph pools left after tuning (device, bytes): {pooled}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tune_inside_autocast_places_every_candidate_on_its_devices() -> None:
    """Inside the caller's torch.autocast region the tuner places candidates one after another: a weight's cast
    that autocast cached on one GPU is not read after the weight moved to the other, and the chosen pipeline
    computes, under autocast, what the source does."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(8)]
    source = torch.nn.Sequential(*blocks, torch.nn.Linear(256, 10)).cuda()
    x = torch.randn(64, 256, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pipe = seqify.pipeline(copy.deepcopy(source), gpus=2, sample=x)
        with torch.no_grad():
            got = pipe(x).to("cuda:0")
            want = torch.cat([source(part) for part in x.tensor_split(pipe.chunks)])
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tune_times_candidates_from_the_first_gpu(monkeypatch) -> None:
    """A sample given on the host is moved to the first GPU once: every timed candidate starts from it there,
    as the one-device anchor does (a host batch's copy would be in the measured times and no prediction)."""
    import seqify.tuning as tuning

    seen: list[str] = []
    real = tuning.measure.step_seconds

    def spy(model, sample, devices, **kw):  # type: ignore[no-untyped-def]
        seen.extend(str(t.device) for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor))
        return real(model, sample, devices, **kw)

    monkeypatch.setattr(tuning.measure, "step_seconds", spy)
    _, seq, _ = source_and_seq()
    x = torch.randn(64, 6, dtype=torch.float64)
    cfg = seqify.tune(seq, x, gpus=2, top=2, show=False, cache=False)
    assert sum(t.measured_s is not None for t in cfg.trials) >= 1
    assert seen and set(seen) == {"cuda:0"}, seen
    assert x.device.type == "cpu"  # the caller's sample is left where it was


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_on_two_gpus_measures_memory_for_every_row() -> None:
    """Every row that ran (the one-GPU baseline, the tuned pipeline, the alternatives) has measured peaks:
    one device for the baseline, two for pipelines, reserved at least allocated."""
    from seqify.tools.bench import bench

    _, seq, _ = source_and_seq()
    x = torch.randn(64, 6, dtype=torch.float64)
    result = bench(seq, x, ["cuda:0", "cuda:1"], top=1, alternatives=1, steps=1, warm=0, cache=False, show=False)
    ran = [r for r in result.rows if r.measured_s is not None]
    assert len(ran[0].allocated_per_device) == 1 and all(len(r.allocated_per_device) == 2 for r in ran[1:])
    assert all(0 < a <= b for r in ran for a, b in zip(r.allocated_per_device, r.reserved_per_device))
    baseline = [c.strip() for c in str(result).splitlines()[4].split("|")]
    assert baseline[2].startswith("one device") and baseline[8] != "-"  # the baseline row shows its measured peaks


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tune_times_its_best_graphed_step_with_two_lanes_on_gpus() -> None:
    """On GPUs the best timed candidate with graphs and a step schedule is built and timed again with
    overlap=True (real pipelines, peaks measured); the choice is the faster of the two, and it trains exactly."""
    source, seq, _ = source_and_seq()
    x = torch.randn(64, 6, dtype=torch.float64)
    cfg = seqify.tune(seq, x, gpus=2, graphs=True, schedule="1f1b", chunks=4, checkpoint="never", top=1, show=False,
                      cache=False)
    ran = [t for t in cfg.trials if t.measured_s is not None]  # the best, the next where the best was not lean
    (twin,) = [t for t in ran if t.overlap]
    (base,) = [t for t in ran if not t.overlap and replace(t, overlap=True) == replace(
        twin, predicted_s=t.predicted_s, measured_s=t.measured_s, memory_bytes=t.memory_bytes,
        memory_per_device=t.memory_per_device, measured_peak=t.measured_peak, measured_reserved=t.measured_reserved)]
    assert ran[-1] is twin and all(t.measured_peak for t in ran)
    if cfg.overlap:
        assert twin.measured_s < base.measured_s
    pipe = seqify.pipeline(seq, config=cfg)
    assert pipe.overlap == cfg.overlap
    target = torch.randint(0, 3, (64,), device="cuda:1")
    ref = copy.deepcopy(source).to("cuda:0")
    want = nn.functional.cross_entropy(torch.cat([ref(p) for p in x.to("cuda:0").tensor_split(4)]), target.to("cuda:0"))
    want.backward()
    got = pipe.step(x, target, nn.functional.cross_entropy)
    torch.testing.assert_close(got.to("cuda:0"), want.detach())
    mine = dict(pipe.model.named_parameters())
    for name, p in seqify.convert(ref).named_parameters():
        torch.testing.assert_close(mine[name].grad.to("cuda:0"), p.grad, msg=name)
    assert pipe._graphed is not None and (pipe._graphed[1].lanes is not None) == cfg.overlap


def test_the_tuner_module_is_importable_under_its_own_name() -> None:
    """``seqify.tune`` is the function; the module is ``seqify.tuning``, so ``import seqify.tuning as m`` and
    ``mock.patch('seqify.tuning.measure.step_seconds')`` reach the module, not the function."""
    import types

    import seqify.tuning as module

    assert isinstance(module, types.ModuleType) and seqify.tune is module.tune
    assert callable(module.step_seconds)


# -- schedules among the candidates ----------------------------------------------------------------------

from seqify.schedule.actions import make, round_robin, v_shape  # noqa: E402


def layout(schedule: str, loops: int, devices: int = 2) -> tuple[tuple[str, ...], tuple[int, ...]]:
    slots = v_shape(devices) if schedule == "zb-h1" and loops == 2 else round_robin(devices, loops)
    return tuple(f"cuda:{d}" for d in slots), slots


def balanced(schedule: str, loops: int, m: int, *, layers: int = 8, saved: float = 1e3, checkpoint: str = "never",
             graphs: bool = False, weight_share: float = 0.5, batch: int | None = None, cal: Calibration = IDEAL):
    """Equal partitions, no overheads: 1 ms of forward+backward per layer and sample."""
    names, slots = layout(schedule, loops)
    p = len(slots)
    model = LayerModel((0.0,) * layers, (1e-3,) * layers, (saved,) * layers, (0,) * layers, (saved / 2,) * layers)
    c = Candidate((layers // p,) * p, names, m, checkpoint, graphs, schedule, slots)
    return predict(c, model, cal, batch or m, weight_share=weight_share)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("schedule, loops, graphs", [("gpipe", 1, True), ("gpipe", 2, True), ("1f1b", 1, False),
                                                     ("interleaved", 2, False), ("zb-h1", 1, False),
                                                     ("zb-h2", 1, False)])
def test_predicted_time_simulates_the_schedule(schedule: str, loops: int, graphs: bool, m: int) -> None:
    """With unit costs (F = 1, B = 2, or B = W = 1 split) the predicted step is the schedule's own length in
    ticks: the prediction runs the schedule's actions, it is no fill-drain formula."""
    names, slots = layout(schedule, loops)
    forward = 8 // len(slots) * 1e-3 / 3  # one partition's forward on a micro-batch of one sample
    got = balanced(schedule, loops, m, graphs=graphs).seconds / forward
    assert got == pytest.approx(make(schedule, slots, m).ticks)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_zb_h2_hides_the_copy_latency_zb_h1_waits_for(m: int) -> None:
    """Two devices, a copy latency of a tenth of a partition's forward on one sample: ZB-H1 waits for it
    as the step goes on, ZB-H2 (more forwards ahead) hides all but the pipeline's ends; without latency
    they tie. It holds more: 3 micro-batches on the first device against 2."""
    lat = replace(IDEAL, copy_latency_s=1e-4)
    assert balanced("zb-h2", 1, m).seconds == pytest.approx(balanced("zb-h1", 1, m).seconds)
    h1, h2 = balanced("zb-h1", 1, m, cal=lat), balanced("zb-h2", 1, m, cal=lat)
    assert h2.seconds < h1.seconds - (m - 4) * 0.5e-4
    assert h2.per_device[0] == pytest.approx(h1.per_device[0] * 3 / 2) and h2.per_device[1] == h1.per_device[1]


@pytest.mark.parametrize("schedule, loops", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h1", 2),
                                             ("zb-h2", 1)])
def test_predicted_memory_is_what_the_schedule_keeps_in_flight(schedule: str, loops: int) -> None:
    """No parameters, no checkpointing: each device's predicted peak is Schedule.peak_activations weighed by
    one partition's activations for one micro-batch."""
    names, slots = layout(schedule, loops)
    per_partition = 1e3 * 8 // len(slots)  # saved bytes per layer and sample, layers per partition, batch 1
    want = make(schedule, slots, 6).peak_activations([per_partition] * len(slots))
    assert balanced(schedule, loops, 6).per_device == pytest.approx(tuple(want))


def test_1f1b_and_zero_bubble_hold_less_than_gpipe_with_many_micro_batches() -> None:
    gpipe = balanced("gpipe", 1, 16).per_device
    for schedule in ("1f1b", "zb-h1"):
        lean = balanced(schedule, 1, 16).per_device
        assert len(lean) == len(gpipe) == 2
        assert all(a <= b for a, b in zip(lean, gpipe)) and max(lean) < max(gpipe) / 4
    assert max(balanced("interleaved", 2, 16).per_device) < max(balanced("gpipe", 2, 16).per_device)
    # checkpointing keeps stage inputs instead of activations: less again
    assert balanced("gpipe", 1, 16, checkpoint="always").memory_bytes < balanced("gpipe", 1, 16).memory_bytes


@pytest.mark.parametrize("share", [0.5, 0.7])
def test_zero_bubble_is_faster_than_1f1b_when_weight_gradients_are_a_large_share(share: float) -> None:
    one = balanced("1f1b", 1, 8, weight_share=share).seconds
    zb = balanced("zb-h1", 1, 8, weight_share=share).seconds
    assert zb < one
    assert balanced("interleaved", 2, 8).seconds < balanced("1f1b", 1, 8).seconds  # loops shrink the bubble


def test_a_costly_split_backward_makes_zero_bubble_lose() -> None:
    """pipe.step's W walks the graph again: when the calibration measures splitting at 1.5 backwards, the
    bubble ZB-H1 fills is worth less than the work it adds, and the prediction says so."""
    costly = replace_split(IDEAL, 1.5)
    assert balanced("zb-h1", 1, 8, cal=costly).seconds > balanced("1f1b", 1, 8, cal=costly).seconds
    assert balanced("1f1b", 1, 8, cal=costly).seconds == balanced("1f1b", 1, 8).seconds  # unsplit: unchanged
    measured = tuning.measure.split_backward(torch.device("cpu"), width=32, depth=2, batch=4)
    assert 1.0 <= measured <= 2.0


def test_eager_steps_are_bound_by_the_hosts_profiled_issue_time_and_replayed_ones_are_not() -> None:
    """One thread issues an eager step: with 1 ms of host time per layer call (the profile's ``host_s``)
    and little GPU work, pipe.step's 1F1B takes every action's issue time in turn, m x all layers, and
    pipe(x)'s fill-drain its forwards in turn plus one device's backwards (autograd's thread per device);
    captured graphs issue nothing per layer."""
    from dataclasses import replace

    layers = replace(uniform(8, 1e-5), host_s=(1e-3,) * 8)
    two = ("cuda:0", "cuda:1")
    one_f1b = predict(Candidate((4, 4), two, 4, "never", schedule="1f1b"), layers, IDEAL, 16).seconds
    assert one_f1b == pytest.approx(4 * 8 * 1e-3, rel=0.02)
    fill_drain = predict(Candidate((4, 4), two, 4, "never"), layers, IDEAL, 16).seconds
    assert fill_drain == pytest.approx(4 * 8 * 1e-3 / 3 + 4 * 4 * 1e-3 * 2 / 3, rel=0.02)
    replayed = predict(Candidate((4, 4), two, 4, "never", graphs=True, schedule="1f1b"), layers, IDEAL, 16).seconds
    assert replayed == pytest.approx(predict(Candidate((4, 4), two, 4, "never", graphs=True, schedule="1f1b"),
                                             uniform(8, 1e-5), IDEAL, 16).seconds)
    assert replayed < one_f1b / 10
    # without a profiled issue time (CPU profiles), the calibrated launch cost per layer call stands
    launched = replace(IDEAL, launch_s=1e-3)
    assert predict(Candidate((4, 4), two, 4, "never", schedule="1f1b"), uniform(8, 1e-5), launched, 16).seconds \
        == pytest.approx(one_f1b, rel=0.02)


def test_replayed_zero_bubble_is_weighed_with_the_replayed_split() -> None:
    """Eager W walks the graph again (split_backward); a captured W starts where B stopped
    (split_replayed): each candidate is predicted with its own."""
    from dataclasses import replace

    cal = replace(IDEAL, split_backward=1.6, split_replayed=1.0)
    eager = balanced("zb-h1", 1, 8, cal=cal).seconds
    replayed = balanced("zb-h1", 1, 8, cal=cal, graphs=True).seconds
    assert replayed == pytest.approx(balanced("zb-h1", 1, 8, graphs=True).seconds)
    assert eager > balanced("zb-h1", 1, 8).seconds and replayed < eager


def test_the_best_eager_and_replayed_candidates_are_both_timed() -> None:
    from seqify.pipe.config import Trial

    def trial(ms: float, graphs: bool) -> Trial:
        return Trial(chunks=4, loops=1, by="time", checkpoint="never", graphs=graphs, schedule="1f1b",
                     balance=(4, 4), predicted_s=ms / 1e3, memory_bytes=0, memory_per_device=(0, 0))

    fits = [trial(200, False), trial(210, False), trial(220, False), trial(300, True), trial(310, True)]
    got = tuning.choice.to_time(fits, 2)
    assert got == fits[:2] + [fits[3]]  # the two best, and the best replayed one beside them
    assert tuning.choice.to_time(fits, 1) == fits[:1]  # one to time: the best prediction
    mixed = [fits[0], fits[3], fits[1]]
    assert tuning.choice.to_time(mixed, 2) == mixed[:2]  # both kinds among the best already
    assert tuning.choice.to_time(fits[:3], 2) == fits[:2]  # no other kind to add


def test_each_schedule_within_the_band_gets_a_timing() -> None:
    """Beyond the top, the best candidate of each other schedule predicted within BAND of the best is timed
    (the predictions err more than schedules differ); one per schedule, none past the band, none with top < 2."""
    from dataclasses import replace as rep

    from seqify.pipe.config import Trial

    def trial(ms: float, schedule: str, chunks: int = 4) -> Trial:
        return Trial(chunks=chunks, loops=1, by="time", checkpoint="never", graphs=True, schedule=schedule,
                     balance=(4, 4), predicted_s=ms / 1e3, memory_bytes=0, memory_per_device=(0, 0))

    edge = 100 * (1 + tuning.choice.BAND)
    fits = [trial(100, "zb-h1", 2), trial(100.5, "gpipe"), trial(101, "zb-h1"), trial(102, "interleaved"),
            trial(103, "zb-h2"), trial(104, "zb-h2", 8), trial(edge + 0.5, "1f1b"), rep(trial(150, "gpipe"), graphs=False)]
    got = tuning.choice.to_time(fits, 3)
    assert got[:3] == fits[:3] and fits[-1] in got  # the top, the other kind
    assert [t.schedule for t in got[4:]] == ["interleaved", "zb-h2"]  # each once, within the band
    assert not any(t.schedule == "1f1b" for t in got)  # past the band
    assert tuning.choice.to_time(fits, 1) == fits[:1]


def test_split_backward_at_the_boundary_is_measured_too(monkeypatch) -> None:
    """boundary=True splits as replay does (B keeps the boundary gradients, W starts there), on a chain and on the
    model itself; the eager split does not. (The ratio is clamped to [1, 2], so its range proves nothing.)"""
    calls = []
    real = tuning.measure.input_grads

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tuning.measure, "input_grads", counted)
    tuning.measure.split_backward(torch.device("cpu"), width=32, depth=2, batch=4)
    assert not calls
    tuning.measure.split_backward(torch.device("cpu"), width=32, depth=2, batch=4, boundary=True)
    assert calls
    calls.clear()
    _, seq, _ = source_and_seq()
    before = snapshot(seq)
    own = tuning.measure.model_split(seq, torch.randn(8, 6, dtype=torch.float64), torch.device("cpu"))
    assert own is not None and calls
    assert tuning.measure.model_split(seq, torch.zeros(8, 6, dtype=torch.long), torch.device("cpu")) is None  # tokens
    assert_unchanged(seq, before)


def replace_split(cal: Calibration, factor: float) -> Calibration:
    from dataclasses import replace

    return replace(cal, split_backward=factor)


def tune_small(x: torch.Tensor, **options):
    """Fixed chunks, loops and a deterministic balance: the candidates differ in schedule and checkpointing."""
    _, seq, _ = source_and_seq()
    base = dict(devices=CPU2, chunks=8, loops=1, balance="params", top=0, show=False, cache=False)
    return seq, seqify.tune(seq, x, **{**base, **options})


def test_memory_cap_picks_a_leaner_schedule_or_checkpointing_and_names_the_smallest_cap() -> None:
    x = torch.randn(64, 6, dtype=torch.float64)  # activations outweigh parameters
    _, gpipe = tune_small(x, schedule="gpipe", checkpoint="never")
    (only,) = gpipe.trials
    cap = only.memory_bytes - 1
    seq, capped = tune_small(x, memory_cap=cap, top=1, steps=1, warm=0)
    assert (capped.schedule, capped.checkpoint) != ("gpipe", "never")
    assert max(capped.memory_per_device) <= cap and all(t.memory_bytes <= cap for t in capped.trials)
    assert capped.measured_s is not None  # confirmed with timed steps (pipe.step for other schedules)
    with pytest.raises(seqify.MemoryCapError, match="smallest cap that works is ([0-9]+) bytes") as info:
        tune_small(x, memory_cap=64)
    import re

    smallest = int(re.search(r"smallest cap that works is ([0-9]+) bytes", str(info.value)).group(1))
    assert smallest > 64
    _, tight = tune_small(x, memory_cap=smallest)
    assert tight.memory_per_device and max(tight.memory_per_device) == smallest
    with pytest.raises(seqify.MemoryCapError):
        tune_small(x, memory_cap=smallest - 1)


def test_scheduled_candidates_are_timed_with_pipe_step(monkeypatch) -> None:
    from seqify.pipe.pipeline import Pipeline

    calls = {"step": 0}
    step = Pipeline.step

    def counted(self, *a, **k):
        calls["step"] += 1
        return step(self, *a, **k)

    monkeypatch.setattr(Pipeline, "step", counted)
    x = torch.randn(16, 6, dtype=torch.float64)
    _, cfg = tune_small(x, chunks=4, schedule="1f1b", top=1, steps=2, warm=1)
    assert cfg.schedule == "1f1b" and cfg.measured_s is not None
    assert calls["step"] == 3  # one warm-up and two timed steps, each a scheduled step
    calls["step"] = 0
    tune_small(x, chunks=4, schedule="gpipe", top=1, steps=2, warm=1)
    assert calls["step"] == 0  # fill-drain is timed as pipe(x) and loss.backward()


def one_device_grads(source: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
    ref = copy.deepcopy(source)
    loss = nn.functional.mse_loss(ref(x), target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in seqify.convert(ref).named_parameters()}


@pytest.mark.parametrize("schedule, loops", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-h1", 2)])
def test_tuned_schedule_round_trips_and_trains_like_one_device(tmp_path, schedule: str, loops: int) -> None:
    source, seq, _ = source_and_seq()
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 3, dtype=torch.float64)
    cfg = seqify.tune(seq, x, devices=CPU2, chunks=4, loops=loops, schedule=schedule, top=1, steps=1, warm=0,
                      show=False, cache=False)
    assert cfg.schedule == schedule and cfg.measured_s is not None and len(cfg.memory_per_device) == 2
    cfg.save(tmp_path / "cfg.json")
    loaded = seqify.PipeConfig.load(tmp_path / "cfg.json")
    assert loaded == cfg and loaded.trials == cfg.trials
    pipe = seqify.pipeline(seq, config=tmp_path / "cfg.json")
    want_slots = v_shape(2) if (schedule, loops) == ("zb-h1", 2) else round_robin(2, loops)
    assert pipe.schedule == schedule and pipe.placement == want_slots and pipe.chunks == 4
    assert pipe.schedule_for(4).name == schedule
    want_loss, want = one_device_grads(source, x, target)
    loss = pipe.step(x, target, nn.MSELoss())
    torch.testing.assert_close(loss, want_loss)
    got = dict(pipe.model.named_parameters())
    for name, g in want.items():
        torch.testing.assert_close(got[name].grad, g)
    pipe.zero_grad(set_to_none=True)  # pipe(x) and loss.backward() still train (fill-drain)
    out = pipe(x)
    nn.functional.mse_loss(out, target).backward()
    torch.testing.assert_close(out, copy.deepcopy(source)(x))  # micro-batches round differently: close, not equal
    for name, g in want.items():
        torch.testing.assert_close(got[name].grad, g)


def test_auto_tunes_the_schedule_unless_one_is_given() -> None:
    _, seq, x = source_and_seq()
    auto = seqify.pipeline(seq, devices=CPU2, sample=x)
    assert auto.config is not None and auto.schedule == auto.config.schedule
    assert auto.config.schedule in ("gpipe", "1f1b", "zb-h1", "interleaved")
    fixed = seqify.pipeline(seq, devices=CPU2, sample=x, schedule="1f1b")
    assert fixed.config is not None and fixed.config.schedule == "1f1b" and fixed.schedule == "1f1b"
    with pytest.raises(seqify.TuneError, match="schedule='fast'"):
        seqify.tune(seq, x, devices=CPU2, schedule="fast", show=False)
    with pytest.raises(seqify.TuneError, match="schedule='1f1b' applies to loops=1"):
        seqify.tune(seq, x, devices=CPU2, schedule="1f1b", loops=2, top=0, show=False)


def test_bench_reads_each_cuda_devices_peaks_from_an_emptied_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from seqify.tools import bench

    calls: list[tuple[str, Any]] = []
    peaks = {0: (5, 7), 1: (2, 3)}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty", None)))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d.index)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[d.index][0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks[d.index][1])
    monkeypatch.setattr(tuning.measure.gc, "collect", lambda: calls.append(("collect", None)))
    devices = [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cpu")]
    with tuning.measure.peaks(devices) as got:  # pipelines left in reference cycles are collected first
        assert calls == [("collect", None), ("empty", None), ("empty", None), ("reset", 0), ("reset", 1)]
    assert got() == ((5, 2), (7, 3))
    row = bench.Row("x", 0.1, 0.1, allocated_per_device=(5 * 2**20, 2 * 2**20), reserved_per_device=(7 * 2**20, 3 * 2**20))
    table = str(bench.Bench("m", 8, ["cuda:0", "cuda:1"], None, [bench.Row("one", None, 0.2), row]))  # type: ignore[arg-type]
    assert "| 5 / 7; 2 / 3 |" in table


def test_layer_times_profiled_at_several_sizes_are_kept_not_fitted_by_one_line() -> None:
    """A GPU is not linear in the batch: times profiled at the micro-batch sizes are the model's times there,
    straight lines between two sizes, the nearest two's line beyond them (never falling with more samples)."""
    sizes = {4: (1.0, 2.0), 16: (2.0, 6.0), 64: (8.0, 10.0)}  # two layers; layer 0 grows faster past 16
    model = LayerModel.through(list(sizes.items()), (0, 0), (0, 0), (0, 0), 64)
    for b, times in sizes.items():
        assert model.seconds(0, 2, b) == pytest.approx(sum(times))
        assert model.seconds(1, 2, b) == pytest.approx(times[1])
    assert model.seconds(0, 2, 40) == pytest.approx(8.0 + (18.0 - 8.0) * (40 - 16) / (64 - 16))
    line = LayerModel.fit((4, sizes[4]), (64, sizes[64]), (0, 0), (0, 0), (0, 0), 64)
    assert line.seconds(0, 2, 16) < model.seconds(0, 2, 16)  # the line through the ends misses the middle
    assert model.seconds(0, 2, 128) == pytest.approx(18.0 + (18.0 - 8.0) / 48 * 64)  # the last segment, on
    assert model.seconds(0, 1, 2) == pytest.approx(1.0 - (2.0 - 1.0) / 12 * 2)  # the first segment, back
    assert model.scaled(2.0).seconds(0, 2, 40) == pytest.approx(2 * model.seconds(0, 2, 40))
    flat = LayerModel.through([(4, (3.0,)), (8, (2.0,)), (16, (2.5,))], (0,), (0,), (0,), 16)
    assert flat.seconds(0, 1, 2) == pytest.approx(3.0)  # noise made 4 slower than 8: no faster below 4
    two = LayerModel.through([(4, sizes[4]), (64, sizes[64])], (0, 0), (0, 0), (0, 0), 64)
    assert two == line  # two sizes are the line of fit()


def test_the_tuner_profiles_every_micro_batch_size_it_predicts(monkeypatch) -> None:
    """Each candidate's micro-batch (batch / chunks) is a profiled size; fixed chunks profile only theirs."""
    _, seq, x = source_and_seq()
    seen: list[int] = []
    real = tuning.profile.time_costs

    def recording(model, sample, *a, **k):
        seen.append(int(sample.shape[0]))
        return real(model, sample, *a, **k)

    monkeypatch.setattr(tuning.profile, "time_costs", recording)
    seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, cache=False)
    assert sorted(set(seen)) == [2, 4, 8]  # batch 8: chunks 1, 2, 4; 8 chunks of 1 are extrapolated from 2 and 4
    seen.clear()
    seqify.tune(seq, x, devices=CPU2, chunks=2, top=1, steps=1, show=False, cache=False)
    assert sorted(set(seen)) == [4, 8]


def test_a_bf16_step_is_tuned_and_cached_apart_from_float32(monkeypatch) -> None:
    """Under autocast the tuner measures the mixed-precision step, and its choice is cached under its own key."""
    _, seq, x = source_and_seq()
    seq, x = seq.float(), x.float()  # autocast lowers float32
    calls = counting(monkeypatch)
    plain = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    assert mixed.key != plain.key and calls["profile"] == 2  # measured again, not read from float32's entry
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False)
    assert again.key == mixed.key and calls["profile"] == 2


def test_bench_spec_under_bf16_says_so(tmp_path, capsys) -> None:
    from seqify.tools.cli import main

    (tmp_path / "nets.py").write_text(NETS)
    code = main(["bench", f"{tmp_path / 'nets.py'}:build", "--shape", "8x6", "--devices", "cpu,cpu", "--steps", "1",
                 "--warm", "0", "--top", "1", "--alternatives", "0", "--bf16"])
    text = capsys.readouterr().out
    assert code == 0 and "one device (cpu) against a pipeline over cpu, cpu, under bfloat16 autocast;" in text


def test_a_device_listed_twice_is_one_device_to_the_tuner() -> None:
    """devices=['cuda:0', 'cuda:0'] (one GPU, two partitions) runs the partitions one after another: the
    tuner predicts it so, not as two devices (it predicted half the step on one H200 and measured 0.93x)."""
    from seqify.tuning.space import layout

    one = [torch.device("cuda", 0)] * 2
    two = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert layout("gpipe", one, 2) == (("cuda:0",) * 4, (0, 0, 0, 0))
    assert layout("gpipe", two, 2) == (("cuda:0", "cuda:1") * 2, (0, 1, 0, 1))
    assert layout("zb-h1", two, 2) == (("cuda:0", "cuda:1", "cuda:1", "cuda:0"), (0, 1, 1, 0))
    layers = uniform(8, 1e-3)
    shared = Candidate((4, 4), ("cuda:0", "cuda:0"), 4, "never", placement=layout("gpipe", one, 1)[1])
    apart = Candidate((4, 4), ("cuda:0", "cuda:1"), 4, "never", placement=layout("gpipe", two, 1)[1])
    assert predict(shared, layers, IDEAL, 16).seconds == pytest.approx(8 * 1e-3 * 16)  # all the work, in turn
    assert predict(apart, layers, IDEAL, 16).seconds < 0.7 * predict(shared, layers, IDEAL, 16).seconds


def fake_gpu_readings(monkeypatch, seq: nn.Module, over: set[int], alone: int = 100) -> list[float]:
    """Stand-ins for a GPU's clock and allocator on CPU partitions: the one-device step of ``seq`` allocates
    ``alone`` bytes; timed candidate k (in timing order) measures 10 ms less than the one before it (from the
    4th on, timed when the CPU's predictions put another schedule within ``BAND``, 300 ms), and
    allocates ``5 * alone`` bytes per device when k is in ``over``, else ``alone // 2`` (reserving as much;
    one device reserves ``2 * alone``). Calibration runs as it does. Returns the candidates' seconds."""
    seen: list[float] = []  # the timed candidates' seconds
    real = tuning.measure.step_seconds

    def seconds(model, sample, devices, **kw) -> float:
        if model is seq:  # the model alone on one device
            return 0.5
        if getattr(model, "model", None) is not seq:  # calibration's own pipelines
            return real(model, sample, devices, **kw)
        seen.append(0.2 - 0.01 * len(seen) if len(seen) < 3 else 0.3)  # a 4th (BAND's) is slowest
        return seen[-1]

    @contextlib.contextmanager
    def peaks(devices):
        def got() -> tuple[tuple[int, ...], tuple[int, ...]]:  # allocated, reserved
            if len(devices) == 1:
                return (alone,), (2 * alone,)
            held = tuple((5 * alone if len(seen) - 1 in over else alone // 2) for _ in devices)
            return held, held

        yield got

    monkeypatch.setattr(tuning.measure, "step_seconds", seconds)
    monkeypatch.setattr(tuning.measure, "peaks", peaks)
    return seen


def test_a_pipeline_holding_more_than_one_device_is_not_chosen_while_a_lean_one_is_timed(monkeypatch) -> None:
    _, seq, x = source_and_seq()
    fake_gpu_readings(monkeypatch, seq, over={2})  # the last timed candidate is the fastest, but holds 5x one device
    cfg = seqify.tune(seq, x, devices=CPU2, top=3, steps=1, show=False, cache=False)
    confirmed = [t for t in cfg.trials if t.measured_s is not None]
    assert len(confirmed) >= 3 and confirmed[2].measured_peak == (500, 500)
    assert cfg.measured_s == confirmed[1].measured_s  # the fastest one that stays under one device's 100 bytes
    assert "measured peak MiB" in str(cfg)

    fake_gpu_readings(monkeypatch, seq, over=set(), alone=100)  # control: every candidate lean, the fastest wins
    cfg = seqify.tune(seq, x, devices=CPU2, top=3, steps=1, show=False, cache=False)
    confirmed = [t for t in cfg.trials if t.measured_s is not None]
    assert cfg.measured_s == min(t.measured_s for t in confirmed) == confirmed[2].measured_s


def test_a_batch_one_device_cannot_take_whole_is_bounded_by_one_device_accumulating_it(monkeypatch) -> None:
    """Weak scaling's batches do not fit one GPU whole: the bound is then one device training the batch as
    the fewest accumulated micro-batches that fit (8 samples as 4 of 2 here), so a pipeline holding more than
    that on some GPU is still not chosen while a lean one is timed (on four H100s, AmoebaNet-D's batch 512
    ran at 67.5 GiB on a GPU with no bound; one GPU accumulating 4 x 128 holds about what its batch-128 step
    does, 48.7)."""
    _, seq, x = source_and_seq()
    fake_gpu_readings(monkeypatch, seq, over={2})
    whole = tuning.measure.step_seconds
    sizes: list[int] = []

    def too_big(model, sample, devices, **kw) -> float:
        if model is seq:
            raise torch.OutOfMemoryError("out of memory (test): the whole batch on one device")
        return whole(model, sample, devices, **kw)

    def fits(module: nn.Module, args: tuple[Any, ...]) -> None:
        sizes.append(len(args[0]))
        if len(args[0]) > len(x) // 4:
            raise torch.OutOfMemoryError("out of memory (test): a micro-batch over 2 samples")

    monkeypatch.setattr(tuning.measure, "step_seconds", too_big)
    hook = seq.register_forward_pre_hook(fits)
    try:
        cfg = seqify.tune(seq, x, devices=CPU2, top=3, steps=1, show=False, cache=False)
    finally:
        hook.remove()
    assert sizes[:5] == [4, 2, 2, 2, 2]  # 2 micro-batches of 4 ran out of memory, 4 of 2 fit
    confirmed = [t for t in cfg.trials if t.measured_s is not None]
    assert len(confirmed) >= 3 and confirmed[2].measured_peak == (500, 500)
    assert cfg.measured_s == confirmed[1].measured_s  # the fastest within one device's (accumulating) bytes
    assert all(p.grad is None for p in seq.parameters())


def test_when_every_timed_candidate_holds_too_much_the_next_best_are_timed(monkeypatch) -> None:
    _, seq, x = source_and_seq()
    fake_gpu_readings(monkeypatch, seq, over={0})
    cfg = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, cache=False)
    confirmed = [t for t in cfg.trials if t.measured_s is not None]
    assert len(confirmed) == 2 and confirmed[0].measured_peak == (500, 500)
    assert cfg.measured_s == confirmed[1].measured_s  # slower than the first, but within one device's memory

    fake_gpu_readings(monkeypatch, seq, over=set())  # control: the first one stays under, nothing more is timed
    cfg = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, cache=False)
    assert len([t for t in cfg.trials if t.measured_s is not None]) == 1


class PooledNorm(nn.Module):
    """A BatchNorm after global pooling: one value per channel for a micro-batch of one sample, which torch
    refuses in training (the profile, at two samples or more, cannot see it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(nn.functional.adaptive_avg_pool2d(self.conv(x), 1)).flatten(1))


def test_candidates_whose_micro_batches_a_batchnorm_refuses_are_passed_over(monkeypatch) -> None:
    # The best predictions are of one-sample micro-batches: each is refused when timed, and the next best with
    # larger ones are timed and chosen; where every candidate is of one sample, the refusal itself is raised.
    torch.manual_seed(0)
    seq = seqify.convert(PooledNorm())
    x = torch.randn(4, 3, 8, 8)
    before = snapshot(seq)
    to_time = tuning.search.to_time
    monkeypatch.setattr(tuning.search, "to_time", lambda fits, top, gpus: to_time(
        sorted(fits, key=lambda t: -t.chunks), top, gpus=gpus))
    cfg = seqify.tune(seq, x, devices=CPU2, top=2, steps=1, show=False, cache=False)
    assert cfg.chunks <= 2 and cfg.measured_s is not None
    assert_unchanged(seq, before)
    with pytest.raises(seqify.errors.MicroBatchError, match="chunks=2 or fewer"):
        seqify.tune(seq, x, devices=CPU2, chunks=4, top=2, steps=1, show=False, cache=False)


def test_measured_peaks_survive_a_saved_config(tmp_path, monkeypatch) -> None:
    _, seq, x = source_and_seq()
    fake_gpu_readings(monkeypatch, seq, over=set())
    cfg = seqify.tune(seq, x, devices=CPU2, top=2, steps=1, show=False, cache=False)
    cfg.save(tmp_path / "c.json")
    again = seqify.PipeConfig.load(tmp_path / "c.json")
    assert [t.measured_peak for t in again.trials] == [t.measured_peak for t in cfg.trials]
    assert any(t.measured_peak == (50, 50) for t in again.trials)


def test_bench_rows_carry_the_peaks_the_tuner_measured(monkeypatch) -> None:
    """Every row that ran shows peaks per device, the tuner's extra timed candidates included (on two GPUs
    they ran without: a tiny model's pipelines all held more than it on one GPU, so more were timed)."""
    from seqify.tools.bench import bench

    _, seq, x = source_and_seq()
    fake_gpu_readings(monkeypatch, seq, over={0})
    result = bench(seq, x, CPU2, top=1, alternatives=1, steps=1, warm=0, cache=False, show=False)
    ran = [r for r in result.rows if r.measured_s is not None]
    assert len(ran) == 4  # one device, the choice, the first candidate (over the bound), one alternative
    assert ran[0].allocated_per_device == (100,) and all(len(r.allocated_per_device) == 2 for r in ran[1:])
    assert sorted(r.allocated_per_device for r in ran[1:3]) == [(50, 50), (500, 500)]


def test_lean_bounds_allocated_and_reserved_apart() -> None:
    """A candidate within one device's allocated bytes but over its reserved ones is not lean (LR-ASPP on two
    H200s: 8.9 GiB allocated against 13.3 on one GPU, 18.5 reserved against 15.1); unmeasured ones pass."""
    t = tuning.Trial(chunks=2, loops=1, by="time", checkpoint="never", graphs=True, schedule="gpipe", balance=(1, 1),
                     predicted_s=0.1, measured_s=0.1, measured_peak=(80, 90), measured_reserved=(100, 185))
    assert tuning.choice.lean([t], 133, 151) == []
    assert tuning.choice.lean([t], 133, 190) == [t]
    assert tuning.choice.lean([t], 85, None) == []  # the cap (or one device) bounds allocated bytes alone
    assert tuning.choice.lean([t], None, None) == [t]
    unmeasured = tuning.Trial(chunks=2, loops=1, by="time", checkpoint="never", graphs=False, schedule="gpipe",
                              balance=(1, 1), predicted_s=0.1)
    assert tuning.choice.lean([unmeasured], 1, 1) == [unmeasured]


def test_the_profile_prices_what_b_keeps_for_w_and_zero_bubble_holds_it() -> None:
    """layer_model prices what B keeps for W as pipe.plan_memory's measurement does (which
    tests/pipe/test_memory.py checks against the split backward itself): the same bytes for the second
    partition, none for weightless layers; a ZB-H1 prediction holds them from B to W on every partition
    but the first, 1F1B never."""
    from seqify.pipe import memory

    _, seq, x = source_and_seq()
    layers, _ = tuning.layer_model(seq, x, torch.device("cpu"), lo=2, show=False)
    assert any(layers.kept_per_sample) and not all(layers.kept_per_sample)
    parts = memory.measure(seqify.pipeline(seq, devices=CPU2, balance=[4, len(seq) - 4], chunks=1).stages, x)
    assert sum(layers.kept_per_sample[4:]) * 8 == parts[1].kept > 0
    none = replace(layers, kept_per_sample=())
    for schedule, more in (("zb-h1", True), ("1f1b", False)):
        names, slots = layout(schedule, 1)
        c = Candidate((4, len(seq) - 4), names, 4, "never", False, schedule, slots)
        with_kept, without = predict(c, layers, IDEAL, 8).per_device, predict(c, none, IDEAL, 8).per_device
        assert with_kept[0] == without[0]  # the first partition's B keeps nothing
        assert (with_kept[1] > without[1]) is more


def _hosted(gpu: tuple[float, ...], host: tuple[float, ...]) -> LayerModel:
    """A layer model with these GPU seconds and host issue seconds per layer (at micro-batch 8)."""
    n = len(gpu)
    return replace(LayerModel(tuple(gpu), (0.0,) * n, (0.0,) * n, (0,) * n, (0.0,) * n), host_s=tuple(host))


CUDA_CAL = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=0.0, copy_bytes_per_s=float("inf"), host_serial=False)


@pytest.mark.parametrize("measured", [0.012, 0.020, 0.035])
def test_fit_host_makes_the_eager_step_predict_what_it_measured(measured: float) -> None:
    """Host issue times profiled too high (each layer's own autograd call) or too low are scaled until the
    one-device eager step predicts its measured seconds; GPU times are left as they are."""
    layers = _hosted((0.002, 0.004, 0.004), (0.006, 0.006, 0.008))  # host-bound as profiled: 20 ms vs 10 of GPU
    alone = Candidate((3,), ("cuda:0",), 1, "never")
    assert predict(alone, layers, CUDA_CAL, 8).seconds == pytest.approx(0.020, rel=1e-2)
    fitted = tuning.fit_host(layers, alone, CUDA_CAL, 8, measured)
    assert predict(alone, fitted, CUDA_CAL, 8).seconds == pytest.approx(measured, rel=1e-3)
    assert fitted.fixed_s == layers.fixed_s
    graphs = replace(alone, graphs=True)  # replay issues nothing per layer: its prediction does not move
    assert predict(graphs, fitted, CUDA_CAL, 8).seconds == predict(graphs, layers, CUDA_CAL, 8).seconds


def test_fit_host_never_lets_a_gpu_bound_step_make_the_host_slower() -> None:
    """A step the GPU's work explains (measured at or under it) keeps the host no slower than profiled and
    trims it to where it stops binding; a host already under the GPU is kept exactly."""
    alone = Candidate((2,), ("cuda:0",), 1, "never")
    under = _hosted((0.010, 0.010), (0.002, 0.002))
    assert tuning.fit_host(under, alone, CUDA_CAL, 8, 0.020) is under
    assert tuning.fit_host(under, alone, CUDA_CAL, 8, 0.018) is under  # faster than the GPU's work: noise
    over = _hosted((0.010, 0.010), (0.030, 0.030))
    trimmed = tuning.fit_host(over, alone, CUDA_CAL, 8, 0.015)
    gpu = predict(alone, replace(over, host_s=(0.0, 0.0)), CUDA_CAL, 8).seconds
    assert predict(alone, trimmed, CUDA_CAL, 8).seconds == pytest.approx(gpu, rel=1e-3)
    assert 0 < sum(trimmed.host_s) < sum(over.host_s)
    assert tuning.fit_host(replace(over, host_s=()), alone, CUDA_CAL, 8, 0.015).host_s == ()


def test_the_gpu_anchor_scales_gpu_work_by_the_replayed_step_and_the_host_by_the_eager_one(monkeypatch) -> None:
    """On a GPU the layer times are scaled so the whole model replayed as graphs predicts its replayed step,
    then the host's issue so the eager step predicts its own; a model that cannot be replayed scales the
    layer and host times by one factor from the eager step. The GPU's readings are replaced here."""
    _, seq, x = source_and_seq()
    layers = _hosted((0.002,) * len(seq), (0.004,) * len(seq))
    alone = Candidate((len(seq),), ("cpu",), 1, "never")
    eager, replayed = 0.050, 0.030
    monkeypatch.setattr(tuning.measure, "step_seconds", lambda *a, **k: eager)
    monkeypatch.setattr(tuning.profile, "_replayed", lambda *a, **k: replayed)
    got, _ = tuning.profile.anchor(seq, x, torch.device("cpu"), layers, CUDA_CAL, 8, steps=1, warm=0)
    assert predict(replace(alone, graphs=True), got, CUDA_CAL, 8).seconds == pytest.approx(replayed, rel=1e-6)
    assert predict(alone, got, CUDA_CAL, 8).seconds == pytest.approx(eager, rel=1e-3)
    monkeypatch.setattr(tuning.profile, "_replayed", lambda *a, **k: None)
    got, _ = tuning.profile.anchor(seq, x, torch.device("cpu"), layers, CUDA_CAL, 8, steps=1, warm=0)
    assert got.host_s == pytest.approx(tuple(h * eager / 0.032 for h in layers.host_s), rel=1e-2)
    assert predict(alone, got, CUDA_CAL, 8).seconds == pytest.approx(eager, rel=1e-2)  # the task cost stays


def test_balance_by_time_cuts_at_the_times_of_each_candidates_micro_batch() -> None:
    """Layer times do not scale alike with the batch: the time balance of a candidate running m micro-batches
    is the cut of the layers' times at batch / m samples (ResNet-101's batch-256 times cut it 9 layers
    away from its micro-batches of 64, 1.62x against 1.64x one GPU on two H200s), not of the whole batch's."""
    from seqify.partition.balancer import split
    from seqify.partition.walk import layers as walk_layers

    _, seq, x = source_and_seq()
    n = len(seq)
    _, hi = tuning.layer_model(seq, x, torch.device("cpu"), lo=2, show=False)
    # at 8 samples the first layer is the heaviest, at 2 (4 micro-batches) the last one is
    big, small = tuple(5.0 if i == 0 else 1.0 for i in range(n)), tuple(5.0 if i == n - 1 else 1.0 for i in range(n))
    layers = LayerModel.through([(2, small), (4, small), (8, big)], hi.activation_bytes, hi.state_bytes, (0,) * n, 8)
    fixed = dict(chunks=None, loops=1, balance="time", checkpoint="never", graphs=False, schedule="gpipe",
                 memory_cap=None, top=1)
    cpus = [torch.device("cpu")] * 2
    found = tuning.space.candidates(seq, x, hi, cpus, fixed, float("inf"), layers)
    lays = walk_layers(seq)
    cut = {m: next(c.balance for c, _, _ in found if c.chunks == m) for m in (1, 4)}
    for m, times in ((1, big), (4, small)):
        assert cut[m] == tuple(split(replace(hi, cost=times), 2, lays.names, lays.routes).balance)
    assert cut[1] != cut[4]
    whole = tuning.space.candidates(seq, x, hi, cpus, fixed, float("inf"))  # no layer model: the whole batch's cut
    assert len({c.balance for c, _, _ in whole}) == 1


def test_a_batch_one_device_cannot_take_whole_is_anchored_on_one_micro_batch_that_fits(monkeypatch) -> None:
    """When the whole batch runs out of memory on one device, the layer times are anchored to the step of one
    micro-batch of the fewest that fit (weak scaling: ResNet-101's batch 1024 on one H100), not left as
    profiled; a micro-batch step that fails too leaves them as profiled."""
    _, seq, x = source_and_seq()
    layers, _ = tuning.layer_model(seq, x, torch.device("cpu"), lo=2, show=False)
    cal = Calibration(task_s=0.0, launch_s=0.0, copy_latency_s=0.0, copy_bytes_per_s=float("inf"), host_serial=True)
    timed: list[int] = []

    def seconds(model, sample, devices, **kw) -> float:
        timed.append(len(sample))
        if len(sample) > len(x) // 4:
            raise torch.OutOfMemoryError("out of memory (test): more than 2 samples on one device")
        return 0.05

    def fits(module: nn.Module, args: tuple[Any, ...]) -> None:
        if len(args[0]) > len(x) // 4:
            raise torch.OutOfMemoryError("out of memory (test): a micro-batch over 2 samples")

    monkeypatch.setattr(tuning.measure, "step_seconds", seconds)
    hook = seq.register_forward_pre_hook(fits)
    try:
        got, bounds = tuning.profile.anchor(seq, x, torch.device("cpu"), layers, cal, 8, steps=1, warm=0)
    finally:
        hook.remove()
    assert timed == [8, 2] and bounds is None  # the whole batch, then one of 4 micro-batches; no peaks on CPU
    alone = Candidate((len(seq),), ("cpu",), 1, "never")
    assert predict(alone, layers, cal, 2).seconds != pytest.approx(0.05)
    assert predict(alone, got, cal, 2).seconds == pytest.approx(0.05)
    monkeypatch.setattr(tuning.measure, "step_seconds",
                        lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    hook = seq.register_forward_pre_hook(fits)
    try:
        again, _ = tuning.profile.anchor(seq, x, torch.device("cpu"), layers, cal, 8, steps=1, warm=0)
    finally:
        hook.remove()
    assert again is layers
    assert all(p.grad is None for p in seq.parameters())


def test_every_candidate_the_tuner_weighs_is_exact() -> None:
    """Whatever the tuner picks is one of its candidates: each distinct one (balance, chunks, checkpointing,
    schedule, loops) on two CPU devices runs forward bit-equal to the source on the same micro-batches, and
    trains through ``pipe.step`` (its schedule's order, as the tuner times it) to the source's loss and
    gradients."""
    source, seq, x = source_and_seq()
    fixed = dict(chunks=None, loops=None, balance=None, checkpoint=None, graphs=None, schedule=None, memory_cap=None,
                 top=2)
    layers, hi = tuning.layer_model(seq, x, torch.device("cpu"), lo=1, sizes=[1, 2, 4], show=False)
    found = tuning.space.candidates(seq, x, hi, [torch.device("cpu")] * 2, fixed, float("inf"), layers)
    runs = {(c.balance, c.chunks, c.checkpoint, c.schedule, loops) for c, _, loops in found}
    assert len(runs) > 100 and {r[3] for r in runs} >= {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"}

    def loss_fn(out: torch.Tensor, _target: Any) -> torch.Tensor:
        return out.square().mean()

    expected: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}
    for balance, chunks, checkpoint, schedule, loops in sorted(runs):
        if chunks not in expected:  # the source over the same micro-batches (8 samples: equal sizes)
            ref = copy.deepcopy(source)
            out = torch.cat([ref(part) for part in scatter(x, chunks)])
            loss = loss_fn(out, None)
            loss.backward()
            grads = {n: p.grad for n, p in seqify.convert(ref).named_parameters()}
            expected[chunks] = (out.detach(), loss.detach(), grads)
        out, loss, grads = expected[chunks]
        pipe = seqify.pipeline(seq, devices=CPU2, loops=loops, balance=list(balance), chunks=chunks,
                               checkpoint=checkpoint, schedule=schedule)
        with torch.no_grad():
            assert torch.equal(pipe(x), out), (balance, chunks, checkpoint, schedule, loops)
        got = pipe.step(x, None, loss_fn)
        torch.testing.assert_close(got, loss, rtol=1e-12, atol=1e-14)
        for name, p in pipe.model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-10, atol=1e-12, msg=name)
        seq.zero_grad(set_to_none=True)


@pytest.mark.parametrize("gain", [0.8, 1.25])
def test_best_graphed_candidate_is_timed_again_with_two_lanes_and_kept_where_faster(monkeypatch, gain: float) -> None:
    """overlap=None: the fastest timed candidate with graphs and a schedule of pipe.step's is timed once more
    with two lanes per GPU (memory predicted for the micro-batch more they keep), and wins only by running
    faster. Graphs need GPUs, so the timed steps here are the tuner's bookkeeping, not pipelines: each
    trial's "measured" time is its prediction, times ``gain`` with lanes."""
    _, seq, x = source_and_seq()
    timed: list[Trial] = []

    def confirm(model, sample, placed, trials, **_):
        timed.extend(trials)
        return [replace(t, measured_s=t.predicted_s * (gain if t.overlap else 1.0)) for t in trials]

    monkeypatch.setattr(tuning.search, "_confirm", confirm)
    fixed = dict(devices=CPU2, schedule="1f1b", chunks=4, checkpoint="never", top=2, show=False, cache=False)
    cfg = seqify.tune(seq, x, graphs=True, **fixed)
    twins = [t for t in timed if t.overlap]
    assert len(twins) == 1 and len(timed) == 3
    first = steady(timed[:2])  # the fastest, or the first in order of those within timing noise of it
    twin = twins[0]
    assert replace(twin, overlap=False, memory_bytes=0, memory_per_device=()) == \
        replace(first, memory_bytes=0, memory_per_device=())
    assert twin.memory_bytes > first.memory_bytes  # 1F1B with a micro-batch more in flight
    assert cfg.overlap == (gain < 1) and cfg.schedule == "1f1b" and cfg.graphs
    assert any(t.overlap for t in cfg.trials)
    assert seqify.pipeline(seq, config=replace(cfg, graphs=False, overlap=False)).overlap is False
    with pytest.raises(seqify.BalanceError, match="overlap=True"):  # a config's choice, or the caller's, holds
        seqify.pipeline(seq, config=replace(cfg, graphs=False), overlap=True)
    assert seqify.pipeline(seq, config=replace(cfg, graphs=False, overlap=True), overlap=False).config.overlap is False

    timed.clear()  # fixed off: never timed with lanes; fixed on: every candidate has them
    off = seqify.tune(seq, x, graphs=True, overlap=False, **fixed)
    assert not off.overlap and not any(t.overlap for t in timed)
    timed.clear()
    on = seqify.tune(seq, x, overlap=True, **fixed)
    assert on.overlap and on.graphs and timed and all(t.overlap for t in timed)
    with pytest.raises(seqify.TuneError, match="overlap=True"):
        seqify.tune(seq, x, graphs=False, overlap=True, **fixed)


def test_bench_times_a_replicated_alternative_as_replicas(monkeypatch) -> None:
    """An alternative with replicas is timed as that layout (a pipeline per replica), not as one pipeline over
    every device with a balance cut for fewer stages."""
    from dataclasses import replace

    from seqify.pipe.replicated import ReplicatedPipeline
    from seqify.tools.bench import bench

    _, seq, x = source_and_seq()
    cfg = seqify.tune(seq, x, devices=CPU2, top=1, steps=1, show=False, cache=False)
    layout = replace(cfg.trials[0], replicas=2, balance=(len(seq),), measured_s=None, chunks=2, loops=1,
                     schedule="gpipe", overlap=False)
    monkeypatch.setattr(seqify.tuning, "tune", lambda *a, **k: replace(cfg, trials=(*cfg.trials, layout)))
    timed: list[type] = []
    real = tuning.measure.step_seconds

    def seconds(model, sample, devices, **kw) -> float:
        timed.append(type(model))
        return real(model, sample, devices, **kw)

    monkeypatch.setattr(tuning.measure, "step_seconds", seconds)
    result = bench(seq, x, CPU2, top=1, alternatives=len(cfg.trials) + 1, steps=1, warm=0, cache=False, show=False)
    assert ReplicatedPipeline in timed
    assert any(r.name == layout.layout() and r.measured_s is not None for r in result.rows)
