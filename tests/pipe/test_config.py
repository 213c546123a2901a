"""PipeConfig: seqify.pipeline's options as one value: every field round-trips through TOML and JSON, every entry
is checked, and seqify.pipeline builds what a hand-written one says."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.config import OPTIONS, PipeConfig, Trial

TRIAL = Trial(chunks=4, loops=2, by="time", checkpoint="never", graphs=True, schedule="interleaved",
              balance=(1, 2, 1, 1), predicted_s=0.125, measured_s=1e-05, memory_bytes=7, memory_per_device=(3, 4),
              measured_peak=(5, 6), measured_reserved=(8, 9), overlap=True, replicas=2)

#: Every field away from its default (the tuner's fields and the hand-written ones together).
EVERY = PipeConfig(chunks=4, loops=2, balance=(1, 2, 1, 1), by="time", checkpoint="never", graphs=True,
                   devices=("cuda:0", 'cuda:1 "x"\\'), batch=32, predicted_s=0.125, measured_s=0.25,
                   schedule="interleaved", memory_per_device=(3, 4), overlap=True, trials=(TRIAL, TRIAL),
                   key="k\u00e9y\n", memory_cap="40GiB", deferred_batch_norm=True, replicas=2)


def test_the_sample_config_sets_every_field() -> None:
    unset = [f.name for f in fields(PipeConfig) if getattr(EVERY, f.name) == f.default]
    assert unset == ["gpus"], f"EVERY leaves {unset} at their defaults: the round trip would not cover them"


@pytest.mark.parametrize("suffix", [".toml", ".json", ".cfg"])
@pytest.mark.parametrize("cfg", [EVERY, PipeConfig(), PipeConfig(chunks="auto", gpus=2, memory_cap=1.5e9)],
                         ids=["every", "defaults", "auto"])
def test_every_field_round_trips(tmp_path: Path, suffix: str, cfg: PipeConfig) -> None:
    path = tmp_path / f"cfg{suffix}"
    cfg.to_file(path)
    again = PipeConfig.from_file(path)
    assert again == cfg and again.to_dict() == cfg.to_dict()  # trials and key too (they do not compare)
    if suffix == ".toml":
        import tomllib

        assert tomllib.loads(path.read_text())  # it is TOML
    assert PipeConfig.load(path) == cfg


def test_the_options_are_pipeline_keywords() -> None:
    keywords = inspect.signature(seqify.pipeline).parameters
    options = EVERY.options()
    assert set(options) <= set(keywords)
    tuner = {"batch", "predicted_s", "measured_s", "memory_per_device", "trials", "key"}
    assert set(OPTIONS) == {f.name for f in fields(PipeConfig)} - tuner
    assert set(OPTIONS) - {"by"} == set(options)  # by is balance's strategy when balance is empty


@pytest.mark.parametrize(
    "data, phrases",
    [
        ({"chunk": 2}, ["unknown entries ['chunk']", "did you mean 'chunk' -> 'chunks'", "'schedule'"]),
        ({"chunks": "2"}, ["chunks = '2'", '"auto"']),
        ({"chunks": 0}, ["chunks = 0", ">= 1"]),
        ({"loops": True}, ["loops = True", "int"]),
        ({"balance": [2, 0]}, ["balance = [2, 0]", ">= 1"]),
        ({"balance": "fast"}, ["balance = 'fast'", "'time'"]),
        ({"balance": "time", "by": "flops"}, ["two strategies"]),
        ({"schedule": "fast"}, ["schedule = 'fast'", "'1f1b'"]),
        ({"checkpoint": "sometimes"}, ["checkpoint = 'sometimes'", "'never'"]),
        ({"devices": "cuda:0"}, ["devices = 'cuda:0'", "list"]),
        ({"devices": ["cpu"], "gpus": 2}, ["gpus = 2 and devices", "one of them"]),
        ({"memory_cap": "lots"}, ["memory_cap='lots'", "40GiB"]),
        ({"trials": [{"chunks": 2}]}, ["a trial lacks", "balance"]),
    ],
)
def test_a_wrong_entry_is_named(data: dict, phrases: list[str]) -> None:
    with pytest.raises(seqify.ConfigError) as info:
        PipeConfig.from_dict(data, "cfg.toml")
    text = str(info.value)
    assert text.startswith("cfg.toml: ") and all(p in text for p in phrases), text


def test_a_balance_strategy_is_by() -> None:
    assert PipeConfig(balance="flops") == PipeConfig(by="flops")  # type: ignore[arg-type]
    assert PipeConfig(balance=[1, 2]).balance == (1, 2)  # type: ignore[arg-type]


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(seqify.ConfigError, match="does not exist"):
        PipeConfig.from_file(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("chunks = ")
    with pytest.raises(seqify.ConfigError, match="not valid TOML"):
        PipeConfig.from_file(tmp_path / "bad.toml")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(seqify.ConfigError, match="table of entries"):
        PipeConfig.from_file(tmp_path / "list.json")


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_pipeline_builds_what_a_hand_written_config_says(tmp_path: Path) -> None:
    fixed = PipeConfig(devices=("cpu", "cpu"), balance=(2, 3), chunks=2, schedule="1f1b", checkpoint="never")
    assert fixed.fixed
    pipe = seqify.pipeline(net(), config=fixed)
    assert (pipe.balance, pipe.chunks, pipe.schedule, pipe.checkpoint, pipe.config) == ([2, 3], 2, "1f1b", "never",
                                                                                         fixed)
    (tmp_path / "open.toml").write_text('devices = ["cpu", "cpu"]\nchunks = 2\nbalance = "params"\nloops = 2\n')
    open_ = PipeConfig.from_file(tmp_path / "open.toml")
    assert not open_.fixed
    x = torch.randn(4, 3)
    pipe = seqify.pipeline(net(), config=tmp_path / "open.toml", sample=x)
    assert len(pipe.balance) == 4 and pipe.chunks == 2 and pipe.config == open_
    assert torch.allclose(pipe(x), net()(x))
    with pytest.raises(seqify.ConfigError, match="names no devices"):
        _ = PipeConfig().placement
    with pytest.raises(seqify.ConfigError, match="give 2 layer counts"):
        seqify.pipeline(net(), config=PipeConfig(devices=("cpu", "cpu"), balance=(1, 1, 3)))
