"""The tuner's layouts (stages x replicas): which it considers, how it prices them, and what it builds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.replicated import ReplicatedPipeline
from seqify.tuning import space
from seqify.tuning.predict import Calibration, Candidate, LayerModel, predict

pytestmark = pytest.mark.timeout(300)


def test_every_divisor_of_distinct_gpus_is_a_layout() -> None:
    gpus = [torch.device(f"cuda:{i}") for i in range(4)]
    assert space.replica_counts(gpus, 64, {}) == [1, 2, 4]
    assert space.replica_counts(gpus, 2, {}) == [1, 2]  # each replica needs a sample
    assert space.replica_counts(gpus, 64, {"replicas": 2}) == [2]
    assert space.replica_counts([torch.device("cpu")] * 4, 64, {}) == [1]  # replicas on the host share it
    assert space.replica_counts([torch.device("cuda:0")] * 2, 64, {}) == [1]


def _layers(n: int = 4) -> LayerModel:
    return LayerModel(fixed_s=(1e-4,) * n, per_sample_s=(1e-4,) * n, saved_per_sample=(1e3,) * n,
                      state_bytes=(4 * 2**20,) * n, cut_per_sample=(1e3,) * n)


def test_replicas_are_priced_with_their_share_and_the_gradient_sum() -> None:
    layers = _layers()
    gpus = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=False)
    one = Candidate((4,), ("cuda:0",), 1, "never")
    alone = predict(one, layers, gpus, 64)
    half = predict(one, layers, gpus, 32)
    two = predict(one, layers, gpus, 64, replicas=2)
    summed = 2 * (gpus.copy_latency_s + 4 * 4 * 2**20 / gpus.copy_bytes_per_s)
    issue = gpus.task_s + 4 * gpus.launch_s  # the host's time to issue one replica's step (one partition)
    assert two.seconds == pytest.approx(half.seconds + summed + issue)  # the second replica starts that late
    assert two.seconds < alone.seconds and two.memory_bytes == half.memory_bytes
    host = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=True)
    assert predict(one, layers, host, 64, replicas=2).seconds >= 2 * predict(one, layers, host, 32).seconds


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_fixed_layout_is_tuned_saved_and_built() -> None:
    torch.manual_seed(0)
    source = Net()
    seq = seqify.convert(copy.deepcopy(source))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    cfg = seqify.tune(seq, x, devices=["cpu"] * 4, replicas=2, cache=False, show=False)
    assert cfg.replicas == 2 and all(t.replicas == 2 for t in cfg.trials)
    assert "as 2 replicas" in str(cfg) and "2 x 2," in str(cfg)
    assert seqify.PipeConfig.from_dict(cfg.to_dict()) == cfg
    pipe = seqify.pipeline(seq, config=cfg)
    assert isinstance(pipe, ReplicatedPipeline) and pipe.config == cfg and len(pipe.replicas) == 2
    loss = pipe.step(x, y, nn.CrossEntropyLoss())
    assert torch.isfinite(loss)
