"""Run files (seqify.Config, `seqify run`): a [pipeline] table that is a PipeConfig, token or float [input]s, the
flat form of older files, and errors that name the entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import seqify
from seqify.pipe.config import PipeConfig
from seqify.tools.cli import main
from seqify.tools.run_file import Config, Input

NETS = '''
import torch
from torch import nn


def mlp(width=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def tokens(vocab=50, width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, vocab))
'''


@pytest.fixture
def nets(tmp_path: Path) -> str:
    (tmp_path / "nets.py").write_text(NETS)
    return str(tmp_path / "nets.py")


def test_the_pipeline_table_is_a_pipe_config(tmp_path: Path, nets: str) -> None:
    (tmp_path / "run.toml").write_text(f'''
model = "{nets}:mlp"
model_args = {{ width = 6 }}

[input]
shape = [4, 3]

[pipeline]
devices = ["cpu", "cpu"]
balance = [2, 3]
chunks = 2
schedule = "1f1b"
checkpoint = "never"
''')
    config = Config.load(tmp_path / "run.toml")
    assert config.pipeline == PipeConfig(devices=("cpu", "cpu"), balance=(2, 3), chunks=2, schedule="1f1b",
                                         checkpoint="never")
    assert PipeConfig.from_file(tmp_path / "run.toml") == config.pipeline  # the table alone, as a PipeConfig
    assert config.input == Input((4, 3))
    pipe = config.build()
    assert (pipe.balance, pipe.schedule, pipe.chunks) == ([2, 3], "1f1b", 2)
    loss = pipe.step(torch.randn(4, 3), torch.randn(4, 2), torch.nn.functional.mse_loss)
    assert torch.isfinite(loss)


def test_chunks_auto_tunes_on_the_input(tmp_path: Path, nets: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEQIFY_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "run.json").write_text(json.dumps({
        "model": f"{nets}:mlp", "input": {"shape": [8, 3]},
        "pipeline": {"devices": ["cpu", "cpu"], "chunks": "auto", "schedule": "gpipe"},
    }))
    pipe = seqify.pipeline_from_config(tmp_path / "run.json")
    assert pipe.config is not None and pipe.config.batch == 8 and pipe.config.schedule == "gpipe"


def test_token_inputs(tmp_path: Path, nets: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.toml").write_text(f'''
model = "{nets}:tokens"
[input]
kind = "tokens"
batch = 4
length = 6
vocab_size = 50
[pipeline]
devices = ["cpu", "cpu"]
balance = [1, 3]
chunks = 2
''')
    config = Config.load(tmp_path / "run.toml")
    x = config.input.tensor()
    assert x.dtype == torch.long and x.shape == (4, 6) and 0 <= int(x.min()) and int(x.max()) < 50
    code = main(["run", str(tmp_path / "run.toml"), "--save-config", str(tmp_path / "chosen.toml")])
    out = capsys.readouterr().out
    assert code == 0 and "outputs [(4, 6, 50)]" in out and "torch.int64" in out, out
    assert PipeConfig.from_file(tmp_path / "chosen.toml") == config.pipeline


def test_a_token_zoo_model_takes_its_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "run.toml").write_text('''
model = "zoo:gpt2"
model_args = { n_layer = 2, n_embd = 16, n_head = 2, vocab_size = 64 }
[input]
kind = "tokens"
shape = [2, 8]
[pipeline]
devices = ["cpu", "cpu"]
''')
    code = main(["run", str(tmp_path / "run.toml")])
    out = capsys.readouterr().out
    assert code == 0 and "(2, 8, 64)" in out, out


def test_the_flat_form_still_reads(tmp_path: Path, nets: str) -> None:
    (tmp_path / "run.toml").write_text(f'model = "{nets}:mlp"\ndevices = ["cpu", "cpu"]\nby = "flops"\n'
                                       'sample_shape = [4, 3]\nchunks = 2\n')
    config = Config.load(tmp_path / "run.toml")
    assert config.pipeline == PipeConfig(devices=("cpu", "cpu"), by="flops", chunks=2)
    assert config.input == Input((4, 3))


@pytest.mark.parametrize(
    "text, phrases",
    [
        ('model = "zoo:x"\n[pipeline]\nschedul = "1f1b"\n', ["[pipeline]: unknown entries ['schedul']",
                                                            "'schedule'"]),
        ('model = "zoo:x"\nchunk = 2\n', ["unknown entries ['chunk']", "did you mean 'chunk' -> 'chunks'"]),
        ('model = "zoo:x"\nchunks = 2\n[pipeline]\nchunks = 3\n', ["['chunks'] given at the top level and in"]),
        ('model = "zoo:x"\n[pipeline]\nchunks = "auto"\n', ['chunks = "auto" measures', "[input]"]),
        ('model = "zoo:x"\n[input]\nkind = "words"\nshape = [1]\n', ["kind = 'words'", '"tokens"']),
        ('model = "zoo:x"\n[input]\nkind = "tokens"\n', ["no shape", "length"]),
        ('model = "zoo:x"\n[input]\nshape = [2, 0]\n', ["shape = [2, 0]", ">= 1"]),
        ('model = "zoo:x"\n[input]\nshape = [2]\ndtype = "long"\n', ["dtype = 'long' for float", "'float32'"]),
        ('model = "zoo:x"\n[input]\nshape = [2]\nvocab_size = 9\n', ["vocab_size applies to token inputs"]),
        ('model = "zoo:x"\npipeline = 3\n', ["should be a table"]),
    ],
)
def test_a_wrong_entry_is_named(tmp_path: Path, text: str, phrases: list[str]) -> None:
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(seqify.ConfigError) as info:
        Config.load(tmp_path / "run.toml")
    message = str(info.value)
    assert "run.toml" in message and all(p in message for p in phrases), message


def test_seqify_run_reports_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.toml").write_text('model = "zoo:x"\n[pipeline]\nschedule = "fast"\n')
    assert main(["run", str(tmp_path / "run.toml")]) == 2
    assert "schedule = 'fast'" in capsys.readouterr().err
