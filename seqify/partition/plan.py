"""PartitionPlan: the stages balance chose, with their costs, memory and the bytes crossing each cut."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Stage", "PartitionPlan", "UNITS", "show_cost"]

_MB = float(1 << 20)

#: How each cost model's numbers read: (scale, unit).
UNITS: dict[str, tuple[float, str]] = {
    "time": (1e-3, "ms"),
    "flops": (1e9, "GFLOP"),
    "params": (1e6, "M params"),
    "memory": (_MB, "MB"),
}


def show_cost(by: str, value: float) -> str:
    """``value`` of cost model ``by`` in its display unit, e.g. ``12.34 GFLOP``."""
    scale, unit = UNITS.get(by, (1.0, ""))
    return f"{value / scale:.4g} {unit}".strip()


@dataclass(frozen=True)
class Stage:
    """One stage: layers ``start..stop-1``, named ``names`` (``first``..``last``).

    ``cost`` = ``compute`` (its layers' costs) + ``transfer`` (its incoming cut's bytes times the
    transfer cost). ``param_bytes`` are its parameters and buffers, ``activation_bytes`` what autograd
    keeps for its backward, ``in_bytes`` the bytes crossing its incoming cut (0 for stage 0): the
    carried value plus ``in_skips``, the skips live across it. ``clean``: only the carried value crosses.
    """

    index: int
    start: int
    stop: int
    names: tuple[str, ...]
    cost: float
    compute: float
    transfer: float
    param_bytes: int
    activation_bytes: int
    in_bytes: int
    in_skips: tuple[str, ...]
    clean: bool

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def first(self) -> str:
        return self.names[0]

    @property
    def last(self) -> str:
        return self.names[-1]

    @property
    def memory_bytes(self) -> int:
        """What the memory cap bounds: parameter and buffer bytes plus activation bytes."""
        return self.param_bytes + self.activation_bytes


@dataclass(frozen=True)
class PartitionPlan:
    """How to split a model's layers into pipeline stages.

    ``balance``: layers per stage (``sum(balance) == len(model)``); ``stages``: per-stage detail;
    ``cut_bytes[i]``: bytes crossing the cut between stage ``i`` and ``i+1``; ``clean_cuts``: every
    layer index ``c`` where a cut before layer ``c`` would carry only the carried value (no skip);
    ``bottleneck``: the largest stage cost, the objective the solver minimised; ``by``: the cost
    model; ``transfer_cost``: cost per byte crossing a cut; ``memory_cap``: bytes per stage, if any;
    ``measured``: whether byte counts come from a sample (False: all zeros).
    """

    by: str
    balance: list[int]
    stages: tuple[Stage, ...]
    bottleneck: float
    cut_bytes: tuple[int, ...]
    clean_cuts: tuple[int, ...]
    transfer_cost: float
    memory_cap: float | None = None
    device: str | None = None
    measured: bool = True

    @property
    def imbalance(self) -> float:
        """Largest stage cost over mean stage cost (1.0 is perfectly balanced)."""
        mean = sum(s.cost for s in self.stages) / len(self.stages)
        return self.bottleneck / mean if mean > 0 else 1.0

    @property
    def cuts(self) -> tuple[int, ...]:
        """Index of the first layer of every stage after the first."""
        return tuple(s.start for s in self.stages[1:])

    @property
    def ranges(self) -> tuple[range, ...]:
        return tuple(s.layers for s in self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __str__(self) -> str:
        layers = sum(self.balance)
        where = f" on {self.device}" if self.device else ""
        head = (
            f"PartitionPlan by {self.by}{where}: {len(self.stages)} stages over {layers} layers, "
            f"bottleneck {show_cost(self.by, self.bottleneck)}, imbalance {self.imbalance:.3f}"
        )
        if self.memory_cap is not None:
            head += f", memory cap {self.memory_cap / _MB:.1f} MB"
        rows = [
            ("stage", "layers", "first", "last", "cost", "params MB", "activations MB", "in-cut MB", "in-cut skips")
        ]
        for s in self.stages:
            cut = "-" if s.index == 0 else f"{s.in_bytes / _MB:.3f}" if self.measured else "?"
            skips = "-" if s.index == 0 else "clean" if s.clean else f"{len(s.in_skips)}: " + ", ".join(s.in_skips)
            rows.append(
                (
                    str(s.index),
                    f"{s.start}-{s.stop - 1}",
                    _clip(s.first),
                    _clip(s.last),
                    show_cost(self.by, s.cost),
                    f"{s.param_bytes / _MB:.2f}",
                    f"{s.activation_bytes / _MB:.2f}" if self.measured else "?",
                    cut,
                    _clip(skips, 40),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        right = {0, 4, 5, 6, 7}
        lines = [head]
        for r in rows:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)


def _clip(text: str, width: int = 28) -> str:
    return text if len(text) <= width else text[: width // 2 - 1] + "..." + text[-(width - width // 2 - 2) :]
