"""The patterns detection models are made of, each on a small net: methods the forward calls that fx cannot
trace, plain objects holding tensors, writes into dicts read later, checks of inputs, draws fx cannot record."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqify
from helpers.exactness import assert_exact


class Boxes:
    """A plain object holding tensors between parts of a forward (as torchvision's ``ImageList``)."""

    def __init__(self, tensors: torch.Tensor, sizes: list[tuple[int, int]]) -> None:
        self.tensors = tensors
        self.sizes = sizes


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, boxes: Boxes) -> torch.Tensor:
        return self.lin(boxes.tensors) * boxes.sizes[0][0]


class Detector(nn.Module):
    """Selects by score in a method of its own (data-dependent: fx cannot trace it), writes into the dicts it
    returns, and checks its input."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = Head()
        self.threshold = 0.0

    def select(self, scores: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        keep = scores > self.threshold
        if keep.sum() > 3:  # a branch on values
            keep = keep & (scores > scores.median())
        return [{"scores": s[k]} for s, k in zip(scores, keep)]

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        if (x != x).any():  # a check of the input
            raise ValueError("NaN in the input")
        features = self.body(x)
        scores = self.head(Boxes(features, [(x.shape[0], x.shape[1])]))
        result = self.select(scores)
        for r in result:
            r["scaled"] = r["scores"] * 2  # written in place, read by the caller
        for key in result[0]:  # iterating a dict: its keys
            result[0][key] = result[0][key] + 1
        return result


def test_a_method_fx_cannot_trace_is_kept_whole_where_it_runs() -> None:
    model = Detector().eval()
    x = torch.randn(3, 4)
    seq = assert_exact(model, (x,), train=False, backward=False, convert=lambda m: seqify.convert(m, (x,)))
    assert [o.path for o in seq.opaque] == ["select()"]
    assert "select()" in seq.summary() and "data-dependent" in seq.opaque[0].reason
    assert any(name.startswith("body") for name, _ in seq.named_children())  # the rest is fine layers
    other = torch.randn(3, 4)
    for a, b in zip(model(other), seq(other)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_input_check_becomes_a_guard() -> None:
    """``if (x != x).any(): raise`` holds on the example; an input failing it raises, as the source does."""
    model = Detector().eval()
    x = torch.randn(3, 4)
    seq = seqify.convert(model, (x,))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError):
        model(bad)
    with torch.no_grad(), pytest.raises(seqify.SeqifyError, match="any"):
        seq(bad)


class Jitter(nn.Module):
    """Draws from torch's generator on a tensor it makes itself (as torchvision's random resize choice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(torch.empty(1).uniform_(0.5, 1.5).item())
        return x * scale


class Jittered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.jitter = Jitter()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.lin(self.jitter(x)), 0.5, self.training)


def test_a_draw_fx_cannot_record_keeps_its_module_whole() -> None:
    """Traced, the draw would be made once and kept for every call; whole, it draws on every call, in the
    source's order (the dropout after it draws what the source's does)."""
    x = torch.randn(3, 4)
    seq = assert_exact(Jittered(), (x,), train=True, convert=lambda m: seqify.convert(m, (x,), frontend="fx"))
    assert [o.path for o in seq.opaque] == ["jitter"]
    assert "random generator" in seq.opaque[0].reason
