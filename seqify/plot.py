"""plot: matplotlib pictures of a partition plan, a model's skips, a pipeline timeline and a chunks sweep.

Needs matplotlib (``pip install 'seqify[plot]'``); every function returns the figure and, given a
path, saves it as PNG and SVG (``save``). Nothing here changes a model or a pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqify.errors import PlotError

__all__ = ["PlotError", "available", "save", "plot_plan", "plot_skips", "plot_timeline", "plot_sweep"]

_MB = float(1 << 20)


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib
    except ImportError:
        return False
    del matplotlib  # imported only to see that it can be
    return True


def _plt() -> Any:
    try:
        import matplotlib

        if "MPLBACKEND" not in os.environ:
            matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'seqify[plot]' (or pip install matplotlib)") from None
    return plt


def _colors(n: int) -> list[Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def save(fig: Any, path: str | os.PathLike[str], formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Write ``fig`` to ``path`` once per format (the suffix of ``path`` is replaced); returns the files."""
    base = Path(path)
    if base.suffix.lower() in (".png", ".svg", ".pdf"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        target = base.with_suffix(f".{fmt}")
        fig.savefig(target, dpi=150 if fmt == "png" else None, bbox_inches="tight")
        out.append(target)
    return out


def _finish(fig: Any, path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        save(fig, path)
    return fig


def byte_unit(largest: float) -> tuple[float, str]:
    """One unit for every byte count in a picture (``(bytes per unit, name)``), fitted to the largest."""
    for scale, name in ((_MB * 1024, "GB"), (_MB, "MB"), (1024.0, "KB")):
        if largest >= scale:
            return scale, name
    return 1.0, "B"


def time_unit(largest: float) -> tuple[float, str]:
    """A time unit fitted to ``largest`` seconds: ``(units per second, name)``; 80 s reads as s, not ms."""
    if largest >= 10.0:
        return 1.0, "s"
    if largest >= 0.01:
        return 1e3, "ms"
    return 1e6, "µs"


def _swatch(label: str, **style: Any) -> Any:
    """A legend entry with a neutral swatch, for bars whose colours mean the stage, not the series."""
    from matplotlib.patches import Patch

    return Patch(facecolor=style.pop("facecolor", "white"), edgecolor="black", label=label, **style)


# -- partition plan -------------------------------------------------------------------------------------


def plot_plan(plan: Any, path: str | os.PathLike[str] | None = None, *, title: str | None = None) -> Any:
    """Per-stage cost bars (compute and incoming-transfer share), the bytes crossing each cut, and each
    stage's parameter and activation memory. ``plan`` is a :class:`seqify.PartitionPlan`."""
    from seqify.partition.plan import UNITS

    plt = _plt()
    scale, unit = UNITS.get(plan.by, (1.0, ""))
    stages = plan.stages
    n = len(stages)
    colors = _colors(n)
    fig, (ax, mem) = plt.subplots(
        1, 2, figsize=(max(8.0, 2.2 + 1.5 * n), 4.6), gridspec_kw={"width_ratios": [3, 2]}, constrained_layout=True
    )
    xs = list(range(n))
    compute = [s.compute / scale for s in stages]
    transfer = [s.transfer / scale for s in stages]
    ax.bar(xs, compute, color=colors, edgecolor="black", linewidth=0.6)
    handles = [_swatch("layers' cost (colour: stage)", facecolor="darkgrey")]
    if any(transfer):
        ax.bar(xs, transfer, bottom=compute, color="lightgrey", edgecolor="black", hatch="//", linewidth=0.6)
        handles.append(_swatch("incoming cut (transfer)", facecolor="lightgrey", hatch="//"))
    mean = sum(s.cost for s in stages) / n / scale
    handles.append(ax.axhline(mean, color="black", linestyle=":", linewidth=1, label=f"mean {mean:.4g} {unit}"))
    cut_scale, cut_unit = byte_unit(max([s.in_bytes for s in stages[1:]] + [0]))
    top = max(s.cost for s in stages) / scale
    for s, x in zip(stages, xs):
        ax.text(x, s.cost / scale + top * 0.02, f"{s.cost / scale:.3g}", ha="center", va="bottom", fontsize=9)
    for k in range(1, n):  # the cut between stage k-1 and k
        s = stages[k]
        what = "clean" if s.clean else f"{len(s.in_skips)} skip{'s' if len(s.in_skips) != 1 else ''}"
        label = f"{s.in_bytes / cut_scale:.3g} {cut_unit}\n({what})" if plan.measured else f"cut\n({what})"
        ax.annotate(label, xy=(k - 0.5, top * 0.55), ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "grey"})
        ax.axvline(k - 0.5, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"stage {s.index}\nlayers {s.start}-{s.stop - 1}\n({s.stop - s.start})" for s in stages],
                       fontsize=8)
    ax.set_ylabel(f"cost per stage ({unit}, {plan.by})")
    ax.set_ylim(0, top * 1.5)
    ax.set_title("cost per stage; boxes: bytes crossing each cut", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper right", framealpha=0.95)

    mem_scale, mem_unit = byte_unit(max(s.param_bytes + (s.activation_bytes if plan.measured else 0) for s in stages))
    params = [s.param_bytes / mem_scale for s in stages]
    acts = [s.activation_bytes / mem_scale for s in stages]
    mem.bar(xs, params, color=colors, edgecolor="black", linewidth=0.6)
    mem_handles = [_swatch("parameters + buffers (colour: stage)", facecolor="darkgrey")]
    if plan.measured:
        mem.bar(xs, acts, bottom=params, color="white", edgecolor="black", hatch="..", linewidth=0.6)
        mem_handles.append(_swatch("activations kept for backward", hatch=".."))
    mem.set_xticks(xs)
    mem.set_xticklabels([f"stage {s.index}" for s in stages], fontsize=8)
    mem.set_ylabel(f"{mem_unit} per stage (for the sample batch)")
    mem.set_title("memory per stage", fontsize=10)
    mem.set_ylim(0, max(p + a for p, a in zip(params, acts if plan.measured else [0.0] * n)) * 1.35 or 1.0)
    mem.legend(handles=mem_handles, fontsize=8, loc="upper center", framealpha=0.95)
    where = f" on {plan.device}" if plan.device else ""
    fig.suptitle(title or f"Partition plan by {plan.by}{where}: {n} stages, imbalance {plan.imbalance:.3f}",
                 fontsize=12)
    return _finish(fig, path)


# -- skips ------------------------------------------------------------------------------------------------


def _balance_of(plan: Any, layers: int) -> list[int]:
    if plan is None:
        return [layers]
    balance = list(getattr(plan, "balance", plan))
    if sum(balance) != layers:
        raise PlotError(f"balance {balance} sums to {sum(balance)}, but the model has {layers} layers")
    return balance


def plot_skips(model: Any, plan: Any = None, path: str | os.PathLike[str] | None = None, *,
               title: str | None = None) -> Any:
    """The layer sequence as a coloured strip (one colour per partition of ``plan``: a PartitionPlan or
    a balance list), with an arc from the layer that stashes each skip to the layer that pops it.
    Arcs that cross a cut (skips that travel between devices) are drawn bold."""
    from matplotlib.patches import Arc, Rectangle

    from seqify.skip.layout import routes

    plt = _plt()
    names = list(model._modules)
    n = len(names)
    balance = _balance_of(plan, n)
    part_of = [j for j, count in enumerate(balance) for _ in range(count)]
    colors = _colors(len(balance))
    found = routes(model)
    fig, ax = plt.subplots(figsize=(12, 4.8), constrained_layout=True)
    tallest = max([(r.pop - r.stash) / 2 for r in found] + [n / 40])
    strip = 0.16 * tallest
    for j, count in enumerate(balance):
        start = sum(balance[:j])
        ax.add_patch(Rectangle((start - 0.5, -1.15 * strip), count, strip, color=colors[j], alpha=0.9))
        ax.text(start + count / 2 - 0.5, -0.65 * strip, f"partition {j}: {count} layers", ha="center", va="center",
                fontsize=8, color="white" if count > n / 12 else "black", fontweight="bold")
        if j:
            ax.axvline(start - 0.5, color="black", linestyle="--", linewidth=0.9)
    crossing = 0
    for r in found:
        span = r.pop - r.stash
        crosses = part_of[r.stash] != part_of[r.pop]
        crossing += crosses
        ax.add_patch(Arc(((r.stash + r.pop) / 2, 0), span, span, theta1=0, theta2=180,
                         color=colors[part_of[r.stash]], linewidth=2.4 if crosses else 0.9,
                         alpha=1.0 if crosses else 0.75))
    ax.set_xlim(-1, n)
    ax.set_ylim(-1.25 * strip, tallest * 1.45)
    ax.set_yticks([])
    ax.set_xlabel("layer index (stash at the left end of an arc, pop at the right end)")
    cuts = [sum(balance[:j]) for j in range(1, len(balance))]
    ticks = sorted({0, n - 1, *cuts})
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t}\n{names[t][:18]}" for t in ticks], fontsize=7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="grey", linewidth=0.9, label="skip inside a partition"),
               Line2D([], [], color="grey", linewidth=2.2, label="skip crossing a cut")]
    handles += [
        Line2D([], [], color=colors[j], linewidth=4, label=f"stashed in partition {j}") for j in range(len(balance))
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper center", ncol=min(6, len(handles)), framealpha=0.95)
    source = getattr(model, "source", type(model).__name__)
    cuts_text = f" in {len(balance)} partitions, {crossing} crossing a cut" if len(balance) > 1 else ""
    ax.set_title(title or f"Skips of {source}: {len(found)} skips over {n} layers{cuts_text}", fontsize=12)
    return _finish(fig, path)


# -- timeline ---------------------------------------------------------------------------------------------


def plot_timeline(timeline: Any, path: str | os.PathLike[str] | None = None, *, title: str | None = None) -> Any:
    """Device x time: one row per partition, a box per micro-batch's forward (solid), backward (light)
    and recomputation (hatched, at the start of the backward), labelled with the micro-batch number.
    ``timeline`` is a :class:`seqify.measure.Timeline`."""
    from matplotlib.patches import Patch

    plt = _plt()
    if not timeline.boxes:
        raise PlotError("the timeline has no boxes: record a pipeline call inside seqify.measure.record(pipe)")
    m = max(b.micro_batch for b in timeline.boxes) + 1
    colors = _colors(m)
    rows = timeline.partitions
    fig, ax = plt.subplots(figsize=(12, 1.3 + 1.0 * rows), constrained_layout=True)
    ms, unit = time_unit(max(timeline.seconds, max(b.end for b in timeline.boxes)))  # units per second
    end = max(b.end for b in timeline.boxes) * ms
    for b in timeline.boxes:
        color = colors[b.micro_batch % len(colors)] if b.micro_batch >= 0 else "grey"
        h = 0.35 if b.kind == "recompute" else 0.7
        y = rows - 1 - b.partition + 0.15
        style = {
            "forward": {"facecolors": color, "linewidth": 0.5},
            "backward": {"facecolors": color, "linewidth": 0.5, "alpha": 0.55},
            "recompute": {"facecolors": "none", "hatch": "///", "linewidth": 0.4},
        }[b.kind]
        ax.broken_barh([(b.start * ms, b.seconds * ms)], (y, h), edgecolors="black", **style)
        if b.kind != "recompute" and b.seconds * ms > end / 60:
            ax.text((b.start + b.seconds / 2) * ms, y + h / 2, f"{'F' if b.kind == 'forward' else 'B'}{b.micro_batch}",
                    ha="center", va="center", fontsize=7)
    ax.set_yticks([rows - 1 - j + 0.5 for j in range(rows)])
    ax.set_yticklabels([f"partition {j}\n{d}" for j, d in enumerate(timeline.devices)], fontsize=9)
    ax.set_ylim(0, rows)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel(f"time since the step began ({unit})")
    for j in range(1, rows):
        ax.axhline(j, color="grey", linewidth=0.5)
    handles = [Patch(facecolor="dimgrey", edgecolor="black", label="F: forward (colour: micro-batch)"),
               Patch(facecolor="dimgrey", edgecolor="black", alpha=0.55, label="B: backward (lighter)"),
               Patch(facecolor="none", edgecolor="black", hatch="///", label="recompute inside B\n(checkpointing)")]
    handles += [Patch(facecolor=colors[i], label=f"micro-batch {i}") for i in range(min(m, 8))]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    label = f"{timeline.label}: " if timeline.label else ""
    ax.set_title(title or f"{label}pipeline timeline, {rows} partitions x {timeline.chunks} micro-batches, "
                 f"one step {timeline.seconds * ms:.3g} {unit}", fontsize=12)
    return _finish(fig, path)


# -- chunks sweep -------------------------------------------------------------------------------------------


def plot_sweep(result: Any, path: str | os.PathLike[str] | None = None, *, title: str | None = None) -> Any:
    """Training throughput (samples/s) against the number of micro-batches, with the one-device
    baseline as a line. ``result`` is a :class:`seqify.measure.Sweep`."""
    plt = _plt()
    if not result.points:
        raise PlotError("the sweep has no points")
    fig, ax = plt.subplots(figsize=(7.5, 4.5), constrained_layout=True)
    xs = [p.chunks for p in result.points]
    ys = [p.samples_per_s for p in result.points]
    ax.plot(xs, ys, marker="o", linewidth=2, label=f"pipeline over {len(result.devices)} partitions {result.balance}")
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    if result.baseline is not None:
        ax.axhline(result.baseline.samples_per_s, color="grey", linestyle="--",
                   label=f"one device, no pipeline ({result.baseline.samples_per_s:.3g}/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("chunks (micro-batches per mini-batch)")
    ax.set_ylabel(f"training samples/s (batch {result.points[0].batch})")
    ax.set_ylim(0, max(ys + ([result.baseline.samples_per_s] if result.baseline else [])) * 1.2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    devices = ", ".join(sorted(set(result.devices)))
    label = f"{result.label}: " if result.label else ""
    note = ""
    if all(d.startswith("cpu") for d in result.devices):
        note = "\n(CPU partitions share the same cores: this shows pipelining's overhead, not its speed-up)"
    ax.set_title(title or f"{label}throughput vs micro-batches on {devices}{note}", fontsize=11)
    return _finish(fig, path)
