"""The exact solver: contiguous stages minimising the largest stage cost, by dynamic programming."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from seqify.partition.errors import BalanceError, NoPlanFitsError

__all__ = ["Solution", "solve", "stage_cost"]

_INF = math.inf
_BLOCK = 1 << 22  # matrix entries per block of columns: bounds memory at O(n) columns of O(n)
_TIE = 1e-9  # relative slack under which two bottlenecks are one (float sums of the same costs)


@dataclass(frozen=True)
class Solution:
    """``balance``: layers per stage; ``costs``: each stage's cost; ``bottleneck``: the largest."""

    balance: tuple[int, ...]
    costs: tuple[float, ...]
    bottleneck: float


def stage_cost(cost: Sequence[float], cut_cost: Sequence[float], start: int, stop: int) -> float:
    """Cost of a stage of layers ``start..stop-1``: their costs plus the cost of its incoming cut."""
    return math.fsum(cost[start:stop]) + (cut_cost[start] if start > 0 else 0.0)


def solve(
    cost: Sequence[float],
    partitions: int,
    *,
    cut_cost: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    cap: float | None = None,
    clean: Sequence[bool] | None = None,
    cut_bytes: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    cuts: Collection[int] | None = None,
    slack: float = 0.0,
) -> Solution:
    """Split layers ``0..n-1`` into ``partitions`` non-empty contiguous stages, minimising the bottleneck.

    A stage ``[a, b)`` costs ``sum(cost[a:b]) + cut_cost[a]`` (``cut_cost[a]``: moving what crosses cut
    ``a`` into it; none for the first stage) and must hold ``sum(memory[a:b]) <= cap``. With ``cuts``,
    stages start only at layer 0 and at those indices (e.g. a transformer's block boundaries).

    Exact dynamic programming: ``f[k][b] = min_a max(f[k-1][a], cost(a, b))`` is the best bottleneck of
    ``k`` stages over layers ``0..b-1``; each step is one vectorised min-max over a matrix of candidate
    stage starts, so it takes O(P n^2) time and O(n) memory per column block. Ties among optimal plans
    are broken deterministically by a second DP over the same transitions restricted to stages within
    the optimum: most cuts marked ``clean``, then fewest ``cut_bytes`` crossing cuts, then earliest cuts.

    ``slack`` widens "within the optimum" to plans whose bottleneck is at most ``(1 + slack)`` times it. For
    measured costs, whose noise moves the exact optimum from run to run, the plan with the most clean cuts
    and the fewest bytes (both from the model's shapes, not from clocks) among those is more often the same
    plan run after run.

    Raises :class:`BalanceError` for bad sizes or costs and :class:`NoPlanFitsError` when no plan meets
    ``cap``.
    """
    n = len(cost)
    names = list(names) if names is not None else [str(i) for i in range(n)]
    _check(n, partitions, cost, cut_cost, memory, cap)
    if not (0.0 <= slack < 1.0):
        raise BalanceError(f"slack={slack}: give the relative room over the best bottleneck, 0 <= slack < 1")
    allowed = None
    if cuts is not None:
        allowed = sorted({c for c in cuts if 0 < c < n})
        if len(allowed) < partitions - 1:
            raise BalanceError(
                f"cannot split {n} layers into {partitions} partitions at {len(allowed)} allowed cuts; "
                f"use partitions <= {len(allowed) + 1}, or allow more cuts"
            )
    with _one_thread():
        return _solve(cost, partitions, cut_cost, memory, cap, clean, cut_bytes, names, allowed, slack)


def _solve(
    cost: Sequence[float],
    partitions: int,
    cut_cost: Sequence[float] | None,
    memory: Sequence[float] | None,
    cap: float | None,
    clean: Sequence[bool] | None,
    cut_bytes: Sequence[float] | None,
    names: Sequence[str],
    cuts: Sequence[int] | None = None,
    slack: float = 0.0,
) -> Solution:
    n = len(cost)
    stages = _Stages(cost, cut_cost, memory if cap is not None else None, cap, cuts)

    # Phase 1: the optimal bottleneck f[P][n].
    f = _filled(n, _INF)
    f[0] = 0.0
    for _ in range(partitions):
        g = _filled(n, _INF)
        for lo, hi, block in stages.blocks():
            g[lo:hi] = torch.maximum(f.unsqueeze(1), block).amin(0)
        f = g
    best = float(f[n])
    if best == _INF:
        raise _no_fit(memory, cap, partitions, names)

    # Phase 2: among plans within the optimum (and the slack), the most clean cuts, then fewest bytes, then
    # earliest cuts.
    limit = best + (_TIE + slack) * abs(best)
    bonus = _column([float(x) for x in clean] if clean is not None else None, n)
    moved = _column(cut_bytes, n)
    score = _filled(n, -_INF)  # clean cuts so far (maximised)
    score[0] = 0.0
    spent = _filled(n, 0.0)  # bytes crossing cuts so far (minimised)
    choices: list[torch.Tensor] = []
    for _ in range(partitions):
        new_score, new_spent = _filled(n, -_INF), _filled(n, _INF)
        choice = torch.full((n + 1,), -1, dtype=torch.long)
        for lo, hi, block in stages.blocks():
            ok = (block <= limit) & (score > -_INF).unsqueeze(1)
            s1 = torch.where(ok, score.unsqueeze(1) + bonus, -_INF)
            top = s1.amax(0)
            ok &= s1 == top
            s2 = torch.where(ok, spent.unsqueeze(1) + moved, _INF)
            low = s2.amin(0)
            ok &= s2 == low
            reachable = ok.any(0)
            new_score[lo:hi] = torch.where(reachable, top, -_INF)
            new_spent[lo:hi] = torch.where(reachable, low, _INF)
            choice[lo:hi] = torch.where(reachable, ok.to(torch.int8).argmax(0), -1)
        score, spent = new_score, new_spent
        choices.append(choice)
    stops = [n]
    for k in range(partitions - 1, -1, -1):
        start = int(choices[k][stops[-1]])
        if start < 0:  # unreachable: phase 1 found a plan, so this cannot happen
            raise AssertionError("partition tie-break lost the optimal plan")
        stops.append(start)
    bounds = stops[::-1]
    cut_costs = list(cut_cost) if cut_cost is not None else [0.0] * n
    costs = tuple(stage_cost(cost, cut_costs, a, b) for a, b in zip(bounds, bounds[1:]))
    return Solution(tuple(b - a for a, b in zip(bounds, bounds[1:])), costs, max(costs))


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run on one intra-op thread: the DP's element-wise passes are memory-bound, and thread hand-offs
    cost more than they save (up to 20x on small CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _vector(values: Sequence[float] | None, n: int) -> torch.Tensor:
    if values is None:
        return torch.zeros(n, dtype=torch.float64)
    if len(values) != n:
        raise BalanceError(f"expected {n} per-layer values, got {len(values)}")
    return torch.tensor([float(x) for x in values], dtype=torch.float64)


def _prefix(values: Sequence[float] | None, n: int) -> torch.Tensor:
    """Prefix sums 0, v0, v0+v1, ... (n+1 entries)."""
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(_vector(values, n), 0)])


def _column(values: Sequence[float] | None, n: int) -> torch.Tensor:
    """Per stage start a in 0..n as a column: values[a] for cuts 1..n-1, 0 for a = 0 and a = n."""
    v = torch.cat([_vector(values, n), torch.zeros(1, dtype=torch.float64)])
    v[0] = 0.0
    return v.unsqueeze(1)


def _filled(n: int, value: float) -> torch.Tensor:
    return torch.full((n + 1,), value, dtype=torch.float64)


class _Stages:
    """The cost of every candidate stage [a, b) as a matrix C[a, b] (inf where a >= b or over the cap),
    in blocks of columns; kept when it is small, recomputed per pass when it is not."""

    def __init__(
        self, cost: Sequence[float], cut_cost: Sequence[float] | None, memory: Sequence[float] | None,
        cap: float | None, cuts: Sequence[int] | None = None,
    ) -> None:
        n = len(cost)
        self.n = n
        self.barred: torch.Tensor | None = None  # stage starts that are not allowed cuts
        if cuts is not None:
            barred = torch.ones(n + 1, 1, dtype=torch.bool)
            barred[0] = False
            barred[list(cuts)] = False
            self.barred = barred
        self.prefix = _prefix(cost, n)
        self.incoming = _column(cut_cost, n)
        self.memory = _prefix(memory, n) if memory is not None else None
        self.cap = cap
        width = max(1, _BLOCK // (n + 1))
        self.bounds = [(lo, min(lo + width, n + 1)) for lo in range(1, n + 1, width)]
        self.cache = [self.block(lo, hi) for lo, hi in self.bounds] if len(self.bounds) == 1 else None

    def block(self, lo: int, hi: int) -> torch.Tensor:
        a = torch.arange(self.n + 1).unsqueeze(1)
        b = torch.arange(lo, hi).unsqueeze(0)
        c = self.prefix[lo:hi].unsqueeze(0) - self.prefix.unsqueeze(1) + self.incoming
        bad = a >= b
        if self.barred is not None:
            bad = bad | self.barred
        if self.memory is not None and self.cap is not None:
            bad |= (self.memory[lo:hi].unsqueeze(0) - self.memory.unsqueeze(1)) > self.cap
        return c.masked_fill(bad, _INF)

    def blocks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        for j, (lo, hi) in enumerate(self.bounds):
            yield lo, hi, self.cache[j] if self.cache is not None else self.block(lo, hi)


def _check(
    n: int,
    partitions: int,
    cost: Sequence[float],
    cut_cost: Sequence[float] | None,
    memory: Sequence[float] | None,
    cap: float | None,
) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise BalanceError(f"partitions={partitions!r}: ask for a whole number of stages, at least 1")
    if n == 0:
        raise BalanceError("there are no layers to partition")
    if partitions > n:
        raise BalanceError(
            f"cannot split {n} layers into {partitions} partitions: every stage needs at least one layer; "
            f"use partitions <= {n}, or convert into finer layers (no leaf_types/depth in seqify.convert)"
        )
    for what, values in (("cost", cost), ("cut_cost", cut_cost), ("memory", memory)):
        for i, x in enumerate(values or ()):
            if not math.isfinite(float(x)) or float(x) < 0:
                raise BalanceError(f"{what}[{i}] = {x}: costs must be finite and >= 0")
    if cap is not None and not (float(cap) >= 0):
        raise BalanceError(f"memory_cap={cap}: give the bytes a stage may hold (>= 0), or None for no cap")


def _no_fit(
    memory: Sequence[float] | None, cap: float | None, partitions: int, names: Sequence[str]
) -> NoPlanFitsError:
    assert memory is not None and cap is not None
    smallest = solve(memory, partitions).bottleneck
    largest = max(range(len(memory)), key=lambda i: memory[i])
    needed: int | None = None
    if memory[largest] <= cap:
        needed, held = 1, 0.0
        for m in memory:
            if held + m > cap:
                needed, held = needed + 1, 0.0
            held += m
    mb = 1 << 20
    message = (
        f"no plan of {partitions} stages fits memory_cap={cap / mb:.2f} MB per stage (parameters and "
        f"buffers plus activations); the smallest cap any {partitions}-stage plan meets is "
        f"{smallest / mb:.2f} MB: raise memory_cap to at least {math.ceil(smallest)} bytes"
    )
    if needed is not None:
        message += f", or use at least {needed} partitions"
    else:
        message += (
            f"; layer {largest} {names[largest]!r} alone needs {memory[largest] / mb:.2f} MB, so no number of "
            "partitions fits: shrink the sample batch or convert that layer into finer layers"
        )
    return NoPlanFitsError(message, cap=float(cap), smallest_cap=float(smallest), partitions_needed=needed)
