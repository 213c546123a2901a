"""CUDA graph capture faked on the CPU: what a capture records, run again on replay."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: remembers the program parts run while "capturing"
    and runs them again on replay, so the captured bookkeeping (which graph is F, B, W) is what runs."""

    capturing: FakeGraph | None = None

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def replay(self) -> None:
        for part in self.parts:
            part()


class FakeStream:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, _: Any) -> None:
        pass


@contextmanager
def _graph(g: FakeGraph, **_: Any) -> Iterator[None]:
    FakeGraph.capturing = g
    try:
        yield
    finally:
        FakeGraph.capturing = None


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.cuda's graphs, pools, devices and streams the CPU's stand-ins: a part a spy records into
    ``FakeGraph.capturing`` while it is set is what the fake graph replays."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda _: nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda _: nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: FakeStream())
