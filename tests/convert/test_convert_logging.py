"""The seqify loggers: a NullHandler on the package's, and convert's frontend choices logged on seqify.frontend."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import seqify

pytestmark = pytest.mark.timeout(120)


class Picky(nn.Module):
    """A block fx cannot trace (torch.finfo of a traced dtype) and export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).clamp(min=torch.finfo(x.dtype).min / 2)


class Branchy(nn.Module):
    """A block neither frontend can capture: it branches on a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f(x)
        return y * 2 if y.sum() > 0 else y - 1


class Vision(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = block
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.relu(self.stem(x))).mean((2, 3)))


class Counter(nn.Module):
    """A buffer counter fx refuses and export records: 'auto' converts the whole model with export."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.l(x) * self.n


def messages(caplog: pytest.LogCaptureFixture, name: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


def test_the_package_logger_has_a_null_handler_and_stays_quiet() -> None:
    """Library convention: nothing is printed unless the application configures logging."""
    root = logging.getLogger("seqify")
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    assert logging.getLogger("seqify.frontend").parent is root
    assert root.level == logging.NOTSET  # the application's level decides


def test_an_fx_conversion_says_which_frontend_made_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="seqify"):
        seq = seqify.convert(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert messages(caplog, "seqify.frontend") == [(logging.INFO, f"converted Sequential: {len(seq)} layers, made "
                                                                   "by the fx frontend")]


def test_the_whole_model_falling_back_to_export(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="seqify"):
        seq = seqify.convert(Counter(), example_inputs=(x,))
    assert seq.frontend == "export"
    got = messages(caplog, "seqify.frontend")
    assert got[0][0] == logging.INFO and got[0][1].startswith("converting Counter: the fx frontend failed "
                                                              "(StatefulForwardError: ")
    assert got[0][1].endswith("; falling back to the export frontend")
    assert got[-1] == (logging.INFO, f"converted Counter: {len(seq)} layers, made by the export frontend")


def test_a_submodule_made_by_export_and_one_kept_whole(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(2, 3, 6, 6)
    with caplog.at_level(logging.INFO, logger="seqify"):
        seq = seqify.convert(Vision(Picky()), example_inputs=(x,))
    assert [e.path for e in seq.exported] == ["block"]
    got = [m for _, m in messages(caplog, "seqify.frontend")]
    assert any(m.startswith("converting Vision: block (Picky) is made by the export frontend") for m in got), got
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="seqify"):
        seq = seqify.convert(Vision(Branchy()).eval(), example_inputs=(x,))
    assert [o.path for o in seq.opaque] == ["block"]
    kept = [m for _, m in messages(caplog, "seqify.frontend") if "kept whole" in m]
    assert kept == [f"converted Vision: block kept whole as layer {seq.opaque[0].layer!r}: {seq.opaque[0].reason}"]


def test_fallbacks_are_not_logged_below_the_level_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="seqify"):
        seqify.convert(Counter(), example_inputs=(torch.randn(3, 8),))
    assert messages(caplog, "seqify.frontend") == []
