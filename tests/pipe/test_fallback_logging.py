"""The pipeline's executor fallbacks are logged on seqify.pipe: captured graphs at WARNING, fixed programs at INFO."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.executors import replayed
from seqify.pipe.executors.programs import Unreplayable
from seqify.pipe.executors.replayed import GraphWarning, Replayer
from seqify.pipe.transfer import Transfer

pytestmark = pytest.mark.timeout(60)


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "seqify.pipe"]


def test_a_step_that_cannot_run_as_fixed_programs_runs_eagerly_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = seqify.pipeline(source, devices=["cpu", "cpu"], balance=[2, 1], chunks=2, checkpoint="never")
    pipe._replay_eager = True

    def refuse(*args: object, **kwargs: object) -> None:
        raise Unreplayable("a partition returns a list")

    monkeypatch.setattr(replayed, "build", refuse)
    x = torch.randn(4, 4)
    with caplog.at_level(logging.INFO, logger="seqify"):
        out = pipe(x)
    assert torch.equal(out, torch.cat([source(c) for c in x.tensor_split(2)]))  # eagerly, as the source
    assert records(caplog) == [(logging.INFO, "the step cannot run as fixed programs (Unreplayable: a partition "
                                              "returns a list); it runs eagerly from now on")]


def test_failed_graph_capture_is_a_warning_on_the_logger_too(caplog: pytest.LogCaptureFixture) -> None:
    replayer = Replayer([], [], Transfer(), lambda: [], graphs=True)
    with caplog.at_level(logging.INFO, logger="seqify"), pytest.warns(GraphWarning, match="capturing CUDA graphs"):
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        except RuntimeError as e:
            replayer.fall_back(e)
    assert not replayer.graphs
    assert records(caplog) == [(logging.WARNING, "capturing CUDA graphs failed (RuntimeError: operation not permitted "
                                                 "when stream is capturing); the pipeline runs eagerly from now on")]
