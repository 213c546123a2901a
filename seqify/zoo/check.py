"""Zoo-wide checks: every model, in a small configuration, converts exactly and pipelines exactly on the CPU."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from seqify.convert.verify import bit_equal as _bit_equal
from seqify.progress import progress
from seqify.zoo.catalog import ENTRIES, entry, get, sample

__all__ = ["Check", "check", "check_all"]


@dataclass(frozen=True)
class Check:
    """``exact``: the converted model's eval forward is bit-equal to the source's; ``pipelined``: a
    2-partition CPU pipeline over 2 micro-batches is bit-equal to the source run on each micro-batch."""

    name: str
    layers: int
    skips: int
    exact: bool
    pipelined: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exact and self.pipelined


def check(name: str) -> Check:
    """Build ``name`` in its small configuration, convert it and check it (eval mode, no gradients)."""
    from seqify.api import pipeline

    start = time.perf_counter()
    e = entry(name)
    kwargs, side = e.small
    torch.manual_seed(0)
    x = sample(name, 2, side, **kwargs) if e.tokens else torch.randn(2, e.in_channels, side, side)
    example = {"input_ids": x} if e.tokens else None  # token models: convert for this sequence length
    seq, source = get(name, return_source=True, example_inputs=example, train=False, **kwargs)
    source.eval()
    seq.eval()
    with torch.no_grad():
        expected = source(x)
        exact = _bit_equal(seq(x), expected)
        pipe = pipeline(seq, devices=["cpu", "cpu"], balance="params", chunks=2)
        per_batch = [source(x[:1]), source(x[1:])]
        joined = pytree.tree_map(lambda a, b: torch.cat([a, b]), per_batch[0], per_batch[1])
        pipelined = _bit_equal(pipe(x), joined)
    return Check(name, len(seq), len(seq.skips), exact, pipelined, time.perf_counter() - start)


def check_all(names: Sequence[str] | None = None, *, show: bool = True) -> list[Check]:
    """:func:`check` every zoo model whose optional dependencies are installed (or ``names``), with a
    progress bar on stderr."""
    names = [n for n, e in ENTRIES.items() if e.available] if names is None else list(names)
    return [check(n) for n in progress(names, len(names), desc="zoo: checking", enabled=show)]
