"""PipeConfig: a pipeline's chosen layout and schedule (what seqify.tune picks), JSON in and out."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["Trial", "PipeConfig", "trial_table"]


@dataclass(frozen=True)
class Trial:
    """One candidate the tuner considered: its options, predicted step seconds, measured step seconds
    (``None`` when it was not confirmed by timed steps) and predicted peak bytes on the fullest device."""

    chunks: int
    loops: int
    by: str
    checkpoint: str
    graphs: bool
    schedule: str | None
    balance: tuple[int, ...]
    predicted_s: float
    measured_s: float | None = None
    memory_bytes: int = 0

    def label(self) -> str:
        """A short name: ``chunks 4, loops 1, by time, checkpoint never`` (plus graphs and schedule)."""
        text = f"chunks {self.chunks}, loops {self.loops}, by {self.by}, checkpoint {self.checkpoint}"
        if self.graphs:
            text += ", graphs"
        if self.schedule:
            text += f", {self.schedule}"
        return text


@dataclass(frozen=True)
class PipeConfig:
    """How to run a model as a pipeline: pass it back as ``seqify.pipeline(model, config=cfg)``.

    ``devices``: one per device (partitions are placed round-robin ``loops`` times over them);
    ``balance``: layers per partition (``len(devices) * loops`` entries); ``batch``: the mini-batch the
    choice was made for; ``predicted_s`` / ``measured_s``: the chosen candidate's step time;
    ``trials``: every candidate confirmed by timed steps plus the best predicted ones that were not
    (the chosen one included); ``key``: the cache key it is stored under.
    """

    chunks: int
    loops: int
    balance: tuple[int, ...]
    by: str
    checkpoint: str
    graphs: bool
    devices: tuple[str, ...]
    batch: int
    predicted_s: float
    measured_s: float | None = None
    schedule: str | None = None
    trials: tuple[Trial, ...] = field(default=(), compare=False)
    key: str = field(default="", compare=False)

    @property
    def partitions(self) -> list[str]:
        """The device of every partition: ``devices`` repeated ``loops`` times."""
        return list(self.devices) * self.loops

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``seqify.pipeline`` that build this configuration."""
        out: dict[str, Any] = dict(devices=list(self.devices), loops=self.loops, balance=list(self.balance),
                                   chunks=self.chunks, checkpoint=self.checkpoint, graphs=self.graphs)
        if self.schedule is not None:
            out["schedule"] = self.schedule
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipeConfig:
        """The inverse of :meth:`to_dict`; unknown keys are refused (a file from another tool)."""
        from ..errors import TuneError

        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name not in ("trials", "key", "measured_s", "schedule"))
        if unknown or missing:
            raise TuneError(
                f"not a seqify pipeline configuration (unknown keys {unknown}, missing {missing}); save one with "
                "cfg.save(path) from seqify.tune(...) or pipe.config"
            )
        trials = tuple(Trial(**{**t, "balance": tuple(t["balance"])}) for t in data.get("trials", ()))
        return cls(**{**data, "balance": tuple(data["balance"]), "devices": tuple(data["devices"]), "trials": trials})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the configuration as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PipeConfig:
        """Read a configuration :meth:`save` wrote."""
        from ..errors import TuneError

        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise TuneError(f"cannot read a pipeline configuration from {os.fspath(path)!r} ({e}); pass the path "
                            "cfg.save(path) wrote, or a PipeConfig") from None
        if not isinstance(data, dict):
            raise TuneError(f"{os.fspath(path)!r} holds no pipeline configuration (a JSON object is expected)")
        return cls.from_dict(data)

    def without_trials(self) -> PipeConfig:
        return replace(self, trials=())

    def __str__(self) -> str:
        measured = f", measured {self.measured_s * 1e3:.2f} ms" if self.measured_s is not None else ""
        head = (f"PipeConfig: {len(self.devices)} devices ({', '.join(self.devices)}), chunks {self.chunks}, "
                f"loops {self.loops}, balance by {self.by} {list(self.balance)}, checkpoint {self.checkpoint!r}, "
                f"graphs {self.graphs}" + (f", schedule {self.schedule!r}" if self.schedule else "")
                + f"; batch {self.batch}: predicted {self.predicted_s * 1e3:.2f} ms per step{measured}")
        if not self.trials:
            return head
        return head + "\n" + trial_table(self.trials, chosen=self)


def trial_table(trials: tuple[Trial, ...] | list[Trial], chosen: PipeConfig | None = None) -> str:
    """The candidates as a table: options, predicted and measured ms per step, predicted peak MB."""
    rows = [("", "candidate", "predicted ms", "measured ms", "error", "peak MB")]
    for t in trials:
        mark = "*" if chosen is not None and _same(t, chosen) else ""
        measured = f"{t.measured_s * 1e3:.2f}" if t.measured_s is not None else "-"
        error = f"{(t.predicted_s / t.measured_s - 1) * 100:+.0f}%" if t.measured_s else "-"
        rows.append((mark, t.label(), f"{t.predicted_s * 1e3:.2f}", measured, error, f"{t.memory_bytes / 2**20:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def _same(t: Trial, c: PipeConfig) -> bool:
    return (t.chunks, t.loops, t.by, t.checkpoint, t.graphs, t.schedule, tuple(t.balance)) == (
        c.chunks, c.loops, c.by, c.checkpoint, c.graphs, c.schedule, tuple(c.balance))
