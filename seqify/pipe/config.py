"""PipeConfig: a pipeline's chosen layout and schedule (what seqify.tune picks), JSON in and out."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = ["Trial", "PipeConfig", "trial_table", "megabytes"]


@dataclass(frozen=True)
class Trial:
    """One candidate the tuner considered: its options (``schedule``: one of
    :data:`~seqify.schedule.actions.SCHEDULES`; ``None`` in files from before schedules were tuned means
    GPipe), predicted step seconds, measured step seconds (``None`` when it was not confirmed by timed
    steps), predicted peak bytes on the fullest device and on each pipeline device, and the peak bytes each
    CUDA device allocated and reserved while it was built and timed (empty where not measured);
    ``overlap``: ``pipe.step``'s graphs on two streams per GPU (``seqify.pipeline(overlap=True)``)."""

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
    memory_per_device: tuple[int, ...] = ()
    measured_peak: tuple[int, ...] = ()
    measured_reserved: tuple[int, ...] = ()
    overlap: bool = False

    def layout(self) -> str:
        """The options but the schedule: ``chunks 4, loops 1, by time, checkpoint never`` (plus graphs, overlap)."""
        text = f"chunks {self.chunks}, loops {self.loops}, by {self.by}, checkpoint {self.checkpoint}"
        return text + (", graphs" if self.graphs else "") + (", overlap" if self.overlap else "")

    def label(self) -> str:
        """A short name: :meth:`layout` and the schedule."""
        return f"{self.layout()}, {self.schedule or 'gpipe'}"


@dataclass(frozen=True)
class PipeConfig:
    """How to run a model as a pipeline: pass it back as ``seqify.pipeline(model, config=cfg)``.

    ``devices``: one per device (partitions are placed round-robin ``loops`` times over them);
    ``balance``: layers per partition (``len(devices) * loops`` entries); ``schedule``: the order
    ``pipe.step`` runs (``pipe(x)`` with ``loss.backward()`` always runs GPipe's); ``batch``: the
    mini-batch the choice was made for; ``predicted_s`` / ``measured_s``: the chosen candidate's step
    time; ``memory_per_device``: its predicted peak bytes per pipeline device;
    ``trials``: every candidate confirmed by timed steps plus the best predicted ones that were not
    (the chosen one included); ``key``: the cache key it is stored under; ``overlap``: ``pipe.step``'s
    graphs on two streams per GPU (``seqify.pipeline(overlap=True)``; the tuner keeps it where its best
    candidate ran faster with it).
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
    memory_per_device: tuple[int, ...] = ()
    overlap: bool = False
    trials: tuple[Trial, ...] = field(default=(), compare=False)
    key: str = field(default="", compare=False)

    @property
    def placement(self) -> tuple[int, ...]:
        """Each partition's device number: round-robin ``loops`` times over ``devices``, or a V (down the
        devices and back) for ZB-H1 with two partitions per device, as :func:`seqify.pipeline` places them."""
        from seqify.schedule.actions import round_robin, v_shape

        if self.schedule == "zb-h1" and self.loops == 2:
            return v_shape(len(self.devices))
        return round_robin(len(self.devices), self.loops)

    @property
    def partitions(self) -> list[str]:
        """The device of every partition (see :attr:`placement`)."""
        return [self.devices[d] for d in self.placement]

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``seqify.pipeline`` that build this configuration."""
        return dict(devices=list(self.devices), loops=self.loops, balance=list(self.balance), chunks=self.chunks,
                    checkpoint=self.checkpoint, graphs=self.graphs, schedule=self.schedule or "gpipe",
                    overlap=self.overlap)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipeConfig:
        """The inverse of :meth:`to_dict`; unknown keys are refused (a file from another tool)."""
        from seqify.errors import TuneError

        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        optional = ("trials", "key", "measured_s", "schedule", "memory_per_device", "overlap")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.name not in optional)
        if unknown or missing:
            raise TuneError(
                f"not a seqify pipeline configuration (unknown keys {unknown}, missing {missing}); save one with "
                "cfg.save(path) from seqify.tune(...) or pipe.config"
            )
        trials = tuple(Trial(**{**t, "balance": tuple(t["balance"]),
                                "memory_per_device": tuple(t.get("memory_per_device", ())),
                                "measured_peak": tuple(t.get("measured_peak", ())),
                                "measured_reserved": tuple(t.get("measured_reserved", ()))})
                       for t in data.get("trials", ()))
        return cls(**{**data, "balance": tuple(data["balance"]), "devices": tuple(data["devices"]), "trials": trials,
                      "memory_per_device": tuple(data.get("memory_per_device", ()))})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the configuration as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PipeConfig:
        """Read a configuration :meth:`save` wrote."""
        from seqify.errors import TuneError

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
                f"graphs {self.graphs}{', overlap' if self.overlap else ''}, schedule {self.schedule or 'gpipe'!r}; "
                f"batch {self.batch}: predicted "
                f"{self.predicted_s * 1e3:.2f} ms per step{measured}"
                + (f", peak {megabytes(self.memory_per_device)} MiB per device" if self.memory_per_device else ""))
        if not self.trials:
            return head
        return head + "\n" + trial_table(self.trials, chosen=self)


def trial_table(trials: tuple[Trial, ...] | list[Trial], chosen: PipeConfig | None = None) -> str:
    """The candidates as a table: options, schedule, predicted and measured ms per step, predicted peak
    MiB per pipeline device, and the peak MiB allocated in the timed steps where measured (CUDA)."""
    rows = [("", "candidate", "schedule", "predicted ms", "measured ms", "error", "peak MiB per device",
             "measured peak MiB")]
    for t in trials:
        mark = "*" if chosen is not None and _same(t, chosen) else ""
        measured = f"{t.measured_s * 1e3:.2f}" if t.measured_s is not None else "-"
        error = f"{(t.predicted_s / t.measured_s - 1) * 100:+.0f}%" if t.measured_s else "-"
        peak = megabytes(t.memory_per_device or (t.memory_bytes,))
        held = megabytes(t.measured_peak) if t.measured_peak else "-"
        rows.append((mark, t.layout(), t.schedule or "gpipe", f"{t.predicted_s * 1e3:.2f}", measured, error, peak,
                     held))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def megabytes(per_device: tuple[int, ...] | list[int]) -> str:
    """Bytes per device as MiB: ``12.3 / 4.5``."""
    return " / ".join(f"{b / 2**20:.1f}" for b in per_device)


def _same(t: Trial, c: PipeConfig) -> bool:
    return (t.chunks, t.loops, t.by, t.checkpoint, t.graphs, t.schedule or "gpipe", tuple(t.balance), t.overlap) == (
        c.chunks, c.loops, c.by, c.checkpoint, c.graphs, c.schedule or "gpipe", tuple(c.balance), c.overlap)
