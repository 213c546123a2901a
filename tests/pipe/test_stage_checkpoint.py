"""seqify.checkpoint's first call forms (save and load a pipeline's state under the source's keys, any balance)
and seqify.Config (a run in a file)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import seqify
from helpers.exactness import by_micro_batch
from seqify import checkpoint

pytestmark = pytest.mark.timeout(120)

CPU2 = ["cpu", "cpu"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.body = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)
        self.spare = nn.Linear(2, 2)  # never used by forward: still in the checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        return self.head((self.body(h) + h).mean((2, 3)))


def perturbed(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for t in net.state_dict().values():
            t.copy_(torch.rand_like(t) + 0.5 if t.is_floating_point() else t + seed)  # variances stay > 0
    return net.eval()


def test_save_keeps_the_source_keys_and_loads_back(tmp_path: Path) -> None:
    source = perturbed(1)
    x = torch.randn(2, 3, 8, 8)
    seq = seqify.convert(copy.deepcopy(source))
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[3, len(seq) - 3])
    files = checkpoint.save(pipe, tmp_path)
    assert sorted(os.path.basename(f) for f in files) == [".metadata", "__0_0.distcp", "seqify.json", "state.pt"]
    stages = checkpoint.stage_keys(pipe)
    assert set(stages[0]) | set(stages[1]) == set(source.state_dict()) and not set(stages[0]) & set(stages[1])
    assert {"stem.weight", "bn.running_mean", "spare.weight"} <= set(stages[0]) and "head.weight" in stages[1]
    state = checkpoint.load_state_dict(tmp_path)
    assert list(state) == list(source.state_dict())
    for k, v in state.items():
        assert torch.equal(v, source.state_dict()[k]), k

    # into the source model, and into a pipeline with another balance, from fresh weights
    fresh = perturbed(2)
    fresh.load_state_dict(checkpoint.load_state_dict(tmp_path))
    other = seqify.pipeline(perturbed(3), devices=CPU2, balance=[2, len(pipe.model) - 2])
    checkpoint.load(other, tmp_path)
    with torch.no_grad():
        expected = source(x)
        assert torch.equal(fresh(x), expected) and torch.equal(other(x), expected)


def test_a_tied_weight_goes_with_its_first_stage_and_stays_tied(tmp_path: Path) -> None:
    from test_tied import TinyGPT

    torch.manual_seed(0)
    source = TinyGPT()
    idx = torch.randint(0, 11, (2, 6))
    seq = seqify.convert(copy.deepcopy(source), (idx,))
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[3, len(seq) - 3])
    checkpoint.save(pipe, tmp_path)
    assert {"wte.weight", "lm_head.weight"} <= set(checkpoint.stage_keys(pipe)[0])
    torch.manual_seed(1)
    target = TinyGPT()
    target.load_state_dict(checkpoint.load_state_dict(tmp_path))
    assert target.lm_head.weight is target.wte.weight
    with torch.no_grad():
        assert torch.equal(target(idx), source(idx))


def test_a_plain_sequential_pipeline_saves_its_own_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    pipe = seqify.pipeline(copy.deepcopy(model), devices=CPU2, balance=[2, 1])
    checkpoint.save(pipe, tmp_path)
    assert checkpoint.stage_keys(pipe) == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    torch.manual_seed(1)
    other = seqify.pipeline(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)), devices=CPU2, balance=[1, 2])
    checkpoint.load(other, tmp_path)
    x = torch.randn(4, 3)
    assert torch.equal(other(x), model(x))


def test_missing_checkpoint_files_say_what_to_do(tmp_path: Path) -> None:
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), devices=CPU2, balance=[1, 1])
    with pytest.raises(seqify.StateDictError, match="seqify.checkpoint.save"):
        checkpoint.load(pipe, tmp_path)
    checkpoint.save(pipe, tmp_path)
    (tmp_path / "tensors" / ".metadata").unlink()
    with pytest.raises(seqify.CheckpointError, match="copy the whole checkpoint folder"):
        checkpoint.load(pipe, tmp_path)


FACTORY = '''
import torch
from torch import nn

def build(width=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))
'''


@pytest.mark.parametrize("kind", ["toml", "json"])
def test_pipeline_from_config(tmp_path: Path, kind: str) -> None:
    (tmp_path / "nets.py").write_text(FACTORY)
    spec = f"{tmp_path / 'nets.py'}:build"
    if kind == "toml":
        (tmp_path / "run.toml").write_text(
            f'model = "{spec}"\nmodel_args = {{ width = 6 }}\ndevices = ["cpu", "cpu"]\nbalance = [2, 3]\nchunks = 2\n'
            'checkpoint = "never"\n'
        )
        pipe = seqify.pipeline_from_config(tmp_path / "run.toml")
        assert pipe.balance == [2, 3]
    else:
        (tmp_path / "run.json").write_text(json.dumps(
            {"model": spec, "model_args": {"width": 6}, "devices": ["cpu", "cpu"], "by": "flops", "sample_shape": [4, 3],
             "chunks": 2, "checkpoint": "never"}
        ))
        pipe = seqify.pipeline_from_config(str(tmp_path / "run.json"))
        assert pipe.plan is not None and pipe.plan.by == "flops"
    assert (pipe.chunks, pipe.checkpoint, [str(d) for d in pipe.devices]) == (2, "never", ["cpu", "cpu"])
    namespace: dict = {}
    exec(FACTORY, namespace)
    source = namespace["build"](6)
    x = torch.randn(4, 3)
    assert torch.equal(pipe(x), by_micro_batch(source, (x,), pipe.chunks))


@pytest.mark.parametrize(
    "text, phrase",
    [
        ('model = "zoo:x"\nchunk = 2\n', "unknown entries ['chunk']"),
        ('chunks = 2\n', "no model"),
        ('model = "zoo:x"\nchunks = "2"\n', "chunks = '2': give micro-batches"),
        ('model = "zoo:x"\nbalance = "time"\nby = "params"\n', "two strategies"),
        ('model = "zoo:x"\nby = "time"\n', "add an [input] table"),
        ('model = "zoo:x\n', "not valid TOML"),
    ],
)
def test_bad_configs_name_the_entry(tmp_path: Path, text: str, phrase: str) -> None:
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(seqify.ConfigError) as info:
        seqify.Config.load(tmp_path / "run.toml")
    assert phrase in str(info.value) and "run.toml" in str(info.value)
