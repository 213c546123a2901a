"""bench: one device against the tuned pipeline and its rejected alternatives, predicted and measured."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from seqify.pipe.config import PipeConfig, Trial, megabytes
from seqify.progress import progress

__all__ = ["Row", "Bench", "bench", "plot_bench"]


@dataclass(frozen=True)
class Row:
    """One measured configuration: ``name``, its schedule, predicted and measured seconds per step and
    predicted peak bytes per pipeline device (``predicted_s`` is None and ``memory_per_device`` empty for
    the one-device baseline, which the tuner does not model)."""

    name: str
    predicted_s: float | None
    measured_s: float | None  # None: out of memory
    chosen: bool = False
    schedule: str = "-"
    memory_per_device: tuple[int, ...] = ()
    # measured peaks per CUDA device the row ran on (empty on the CPU): the caching allocator's allocated
    # and reserved bytes, from an empty cache and reset peak counters
    allocated_per_device: tuple[int, ...] = ()
    reserved_per_device: tuple[int, ...] = ()


@dataclass
class Bench:
    """The baseline on one device, then the tuned pipeline, then the alternatives the tuner rejected."""

    spec: str
    batch: int
    devices: list[str]
    config: PipeConfig
    rows: list[Row] = field(default_factory=list)
    autocast: str | None = None  # the autocast dtype every row ran under (None: off)

    @property
    def baseline(self) -> Row:
        return self.rows[0]

    def __str__(self) -> str:
        base = self.baseline.measured_s  # None when the model does not fit one device
        lines = [f"seqify bench {self.spec}: batch {self.batch}, one device ({self.devices[0]}) against a pipeline "
                 f"over {', '.join(self.devices)}"
                 f"{f', under {self.autocast} autocast' if self.autocast else ''}; the tuned configuration is "
                 "marked *", "",
                 "| | configuration | schedule | predicted ms | measured ms | error | predicted peak MiB per device "
                 "| measured peak MiB allocated / reserved, per device | samples/s | vs one device |",
                 "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            predicted = f"{r.predicted_s * 1e3:.2f}" if r.predicted_s is not None else "-"
            peak = megabytes(r.memory_per_device) if r.memory_per_device else "-"
            measured = "; ".join(f"{a / 2**20:.0f} / {b / 2**20:.0f}" for a, b in
                                 zip(r.allocated_per_device, r.reserved_per_device)) or "-"
            head = f"| {'*' if r.chosen else ''} | {r.name} | {r.schedule} | {predicted}"
            if r.measured_s is None:
                lines.append(f"{head} | out of memory | - | {peak} | - | - | - |")
                continue
            error = f"{(r.predicted_s / r.measured_s - 1) * 100:+.0f}%" if r.predicted_s is not None else "-"
            ratio = f"{base / r.measured_s:.2f}x" if base else "-"
            lines.append(f"{head} | {r.measured_s * 1e3:.2f} | {error} | {peak} | {measured} | "
                         f"{self.batch / r.measured_s:.1f} | {ratio} |")
        return "\n".join(lines)


def bench(model: nn.Sequential, sample: torch.Tensor, devices: Sequence[Any], *, spec: str = "", top: int = 3,
          alternatives: int = 4, steps: int = 3, warm: int = 1, cache: bool = True, show: bool = True,
          memory_cap: float | None = None, schedule: str | None = None, optimizer: Any = None,
          replicas: int | None = None) -> Bench:
    """Time ``model`` (a Sequential) on ``devices[0]`` alone, tune it for ``devices``, then time every
    alternative the tuner reports but did not time (up to ``alternatives`` of them), so each row shows
    the tuner's prediction next to a measurement. ``memory_cap``, ``schedule``, ``optimizer`` and ``replicas``
    go to the tuner (``replicas=1``: pipelines only). The model is left where it was."""
    from seqify.tuning import measure, tune
    from seqify.tuning.search import build_trial

    placed = [torch.device(d) for d in devices]
    # Every row starts from the sample on the first device: a sample left on the CPU would make each
    # pipeline row (not the baseline) copy it over every step (77 MB for ResNet-101 at batch 128: ~10 ms).
    sample = sample.to(placed[0])
    base: float | None = None
    peaks: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # trial index (-1: one device) -> measured peaks
    with measure.kept(model):
        try:
            with measure.peaks(placed[:1]) as got:
                base = measure.step_seconds(model.to(placed[0]).train(), sample, placed[:1], steps=steps, warm=warm,
                                            update=True)
            peaks[-1] = got()
        except torch.OutOfMemoryError:  # what pipelines are for: the row says so
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    cfg = tune(model, sample, devices=placed, top=top, steps=steps, warm=warm, cache=cache, show=show,
               memory_cap=memory_cap, schedule=schedule, optimizer=optimizer, replicas=replicas)
    trials = list(cfg.trials)
    todo = [k for k, t in enumerate(trials) if t.measured_s is None][:alternatives]
    # The tuner's timed candidates carry the peaks it read (on CUDA; the cache key names that, so no cached
    # choice lacks them); the alternatives are timed here.
    peaks.update({k: (t.measured_peak, t.measured_reserved) for k, t in enumerate(trials) if t.measured_peak})
    oom: set[int] = set()
    with measure.kept(model):
        for k in progress(todo, len(todo), "seqify bench: timing the alternatives", show):
            t = trials[k]
            pipe = None
            try:
                with measure.peaks(placed) as got:
                    pipe = build_trial(model, t, placed, sample).train()
                    seconds = measure.step_seconds(pipe, sample, placed, steps=steps,
                                                   warm=warm + (1 if t.graphs else 0), update=True)
                peaks[k] = got()
                trials[k] = replace(t, measured_s=seconds)
            except torch.OutOfMemoryError:
                oom.add(k)
            del pipe
    one = peaks.get(-1, ((), ()))
    kind = placed[0].type
    dtype = str(torch.get_autocast_dtype(kind)).removeprefix("torch.") if torch.is_autocast_enabled(kind) else None
    result = Bench(spec, int(sample.shape[0]), [str(d) for d in placed], cfg,
                   [Row(f"one device ({placed[0]})", None, base, allocated_per_device=one[0],
                        reserved_per_device=one[1])],
                   autocast=dtype)
    chosen = [k for k, t in enumerate(trials) if _is(t, cfg)]
    others = [k for k, t in enumerate(trials) if not _is(t, cfg) and (t.measured_s is not None or k in oom)]
    for k in chosen + others:
        t = trials[k]
        allocated, reserved = peaks.get(k, ((), ()))
        result.rows.append(Row(t.layout(), t.predicted_s, t.measured_s, chosen=_is(t, cfg),
                               schedule=t.schedule or "gpipe",
                               memory_per_device=t.memory_per_device or (t.memory_bytes,),
                               allocated_per_device=allocated, reserved_per_device=reserved))
    return result


def _is(t: Trial, cfg: PipeConfig) -> bool:
    from seqify.pipe.config import _same

    return _same(t, cfg)


def plot_bench(result: Bench, path: str | os.PathLike[str] | None = None) -> Any:
    """Bars of predicted and measured ms per step for every row (needs matplotlib); saved as PNG and SVG
    when ``path`` is given."""
    from seqify.plot import _finish, _plt

    plt = _plt()
    names = [r.name if r.schedule == "-" else f"{r.name}, {r.schedule}" for r in result.rows]
    y = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    ax.barh([i - 0.2 for i in y], [(r.measured_s or 0.0) * 1e3 for r in result.rows], height=0.4, label="measured")
    ax.barh([i + 0.2 for i in y], [(r.predicted_s or 0.0) * 1e3 for r in result.rows], height=0.4, label="predicted")
    ax.set_yticks(list(y), [("* " if r.chosen else "") + n for r, n in zip(result.rows, names)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step")
    ax.set_title(f"{result.spec}: batch {result.batch} over {', '.join(result.devices)}")
    ax.legend()
    return _finish(fig, Path(path) if path is not None else None)
