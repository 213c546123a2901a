"""seqify.tune on CPU partitions: valid choices, the cache, saved configurations, chunks='auto', memory caps,
and the step-time model's bubble. No timing is asserted: only that predictions and measurements are made."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import seqify
from seqify.predict import Calibration, Candidate, LayerModel, predict

from exactness import assert_unchanged, loss_of, snapshot

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
    """The pipeline against the source model: forward equal, gradients allclose."""
    ref = copy.deepcopy(source)
    want = ref(x)
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
    profile, steps = tuning.layer_model, tuning.step_seconds

    def count_profile(*a, **k):
        calls["profile"] += 1
        return profile(*a, **k)

    def count_steps(*a, **k):
        calls["steps"] += 1
        return steps(*a, **k)

    monkeypatch.setattr(tuning, "layer_model", count_profile)
    monkeypatch.setattr(tuning, "step_seconds", count_steps)
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
    assert cfg.measured_s == min(t.measured_s for t in confirmed)  # the fastest confirmed one wins


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
    with pytest.raises(seqify.TuneError, match="not a seqify pipeline configuration"):
        seqify.PipeConfig.from_dict({"chunks": 2})


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
    from seqify.cli import main

    (tmp_path / "nets.py").write_text(NETS)
    out = tmp_path / "bench.png"
    code = main(["bench", f"{tmp_path / 'nets.py'}:build", "--shape", "8x6", "--devices", "cpu,cpu", "--steps", "1",
                 "--warm", "0", "--top", "1", "--alternatives", "2", "--plot", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms" not in line and "---" not in line]
    assert rows[0].startswith("|  | one device (cpu) | - |")  # measured, not predicted
    assert sum(r.startswith("| * |") for r in rows) == 1  # the tuned one
    assert len(rows) == 4  # baseline, tuned, two timed alternatives
    for r in rows[1:]:  # predicted and measured milliseconds side by side
        predicted, measured = r.split("|")[3:5]
        assert float(predicted) > 0 and float(measured) > 0
    assert out.with_suffix(".png").is_file() == plot.available()


def test_inspect_tune_prints_the_choice(tmp_path, capsys) -> None:
    from seqify.cli import main

    (tmp_path / "nets.py").write_text(NETS)
    code = main(["inspect", f"{tmp_path / 'nets.py'}:build", "--shape", "8x6", "--devices", "cpu,cpu", "--tune",
                 "--top", "1", "--no-layers"])
    text = capsys.readouterr().out
    assert code == 0 and "PipeConfig: 2 devices (cpu, cpu)" in text and "predicted ms" in text


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


def test_the_tuner_module_is_importable_under_its_own_name() -> None:
    """``seqify.tune`` is the function; the module is ``seqify.tuning``, so ``import seqify.tuning as m`` and
    ``mock.patch('seqify.tuning.step_seconds')`` reach the module, not the function."""
    import types

    import seqify.tuning as module

    assert isinstance(module, types.ModuleType) and seqify.tune is module.tune
    assert callable(module.step_seconds)
