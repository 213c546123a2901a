"""seqify.measure (timelines of real pipeline runs, chunks sweeps) and seqify.plot (PNG and SVG files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision

import seqify
from seqify import measure, plot
from seqify.pipe.stage import Stage


def small_pipe(chunks: int, checkpoint: str = "except_last", partitions: int = 2) -> tuple[seqify.Pipeline, seqify.Sequential]:
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet18(num_classes=10))
    pipe = seqify.pipeline(seq, devices=["cpu"] * partitions, balance="params", chunks=chunks, checkpoint=checkpoint)
    return pipe, seq


def test_timeline_of_a_training_step() -> None:
    pipe, _ = small_pipe(chunks=3)
    originals = list(pipe.stages)
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    with measure.record(pipe) as tl:
        F.cross_entropy(pipe(x), y).backward()
    assert pipe.stages == originals and all(type(s) is Stage for s in pipe.stages)
    assert tl.devices == ["cpu", "cpu"] and tl.chunks == 3
    for j in range(2):
        fwd = [b for b in tl.of("forward") if b.partition == j]
        bwd = {b.micro_batch: b for b in tl.of("backward") if b.partition == j}
        assert [b.micro_batch for b in fwd] == [0, 1, 2]  # fill: micro-batches in order
        assert sorted(bwd) == [0, 1, 2]
        # checkpoint='except_last': every micro-batch but the last is recomputed, inside its backward
        rec = {b.micro_batch: b for b in tl.of("recompute") if b.partition == j}
        assert sorted(rec) == [0, 1]
        for i, r in rec.items():
            assert bwd[i].start <= r.start and r.end <= bwd[i].end
        for b in fwd:
            assert b.end <= bwd[b.micro_batch].start
    # GPipe's order: forward i on partition 1 after forward i on partition 0; backward the other way round
    f = {(b.partition, b.micro_batch): b for b in tl.of("forward")}
    bw = {(b.partition, b.micro_batch): b for b in tl.of("backward")}
    for i in range(3):
        assert f[(0, i)].end <= f[(1, i)].start
        assert bw[(1, i)].start <= bw[(0, i)].start and bw[(1, i)].end <= bw[(0, i)].end
    assert max(b.end for b in tl.boxes) <= tl.seconds
    assert "partition 1 (cpu)" in str(tl)


def test_timeline_as_a_chrome_trace(tmp_path: Path) -> None:
    """One complete event per box, in microseconds, on one thread per partition: what chrome://tracing and
    Perfetto read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    pipe = seqify.pipeline(model, devices=["cpu", "cpu"], balance=[2, 1], chunks=3)
    with measure.record(pipe, label="a step") as tl:
        pipe(torch.randn(6, 8)).pow(2).sum().backward()
    assert tl.of("recompute")  # checkpoint='except_last': three kinds of box
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(tl.boxes)
    for e, b in zip(spans, tl.boxes):
        assert (e["name"], e["cat"], e["tid"], e["args"]["micro_batch"]) == (f"{b.kind} mb{b.micro_batch}", b.kind,
                                                                              b.partition, b.micro_batch)
        assert e["ts"] == pytest.approx(b.start * 1e6) and e["dur"] == pytest.approx((b.end - b.start) * 1e6)
        assert e["dur"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "partition 0 (cpu)", 1: "partition 1 (cpu)"}
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"] == ["a step"]


def test_recording_changes_nothing() -> None:
    """Same outputs and gradients with and without the recording's wrappers and hooks."""
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    results = []
    for recorded in (False, True):
        pipe, seq = small_pipe(chunks=2, checkpoint="never")
        if recorded:
            with measure.record(pipe) as tl:
                loss = F.cross_entropy(pipe(x), y)
                loss.backward()
            assert len(tl.of("backward")) == 4 and not tl.of("recompute")
        else:
            loss = F.cross_entropy(pipe(x), y)
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in seq.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_inference_timeline_has_no_backward() -> None:
    pipe, _ = small_pipe(chunks=2, partitions=3)
    pipe.eval()
    with torch.no_grad(), measure.record(pipe, label="eval") as tl:
        pipe(torch.randn(4, 3, 32, 32))
    assert len(tl.of("forward")) == 6 and not tl.of("backward") and tl.partitions == 3


def test_sweep_measures_and_trains_nothing_without_optimizer() -> None:
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet18(num_classes=10))
    before = [p.detach().clone() for p in seq.parameters()]
    steps = []
    result = measure.sweep(seq, torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)), devices=["cpu", "cpu"],
                           balance=[30, 39], chunks=[1, 2], steps=1, warm=0, show=False,
                           on_step=lambda c, k, loss, took: steps.append((c, k)))
    assert [p.chunks for p in result.points] == [1, 2] and result.baseline is not None
    assert all(p.samples_per_s > 0 and p.batch == 4 for p in result.points)
    assert steps == [(0, 0), (1, 0), (2, 0)]
    assert all(torch.equal(a, b) for a, b in zip(before, seq.parameters()))
    assert "chunks   2" in str(result)


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pipe, seq = small_pipe(chunks=2)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    with measure.record(pipe) as tl:
        F.cross_entropy(pipe(x), y).backward()
    plan = seqify.balance(seq, 3, torch.randn(1, 3, 64, 64), by="flops", progress=False)
    made = []
    made += plot.save(plot.plot_plan(plan), tmp_path / "plan")
    made += plot.save(plot.plot_skips(seq, plan), tmp_path / "skips.png")
    made += plot.save(plot.plot_skips(seq), tmp_path / "skips_unsplit")
    made += plot.save(plot.plot_timeline(tl), tmp_path / "timeline")
    sweep = measure.Sweep([measure.SweepPoint(1, 4, 0.5, 1), measure.SweepPoint(2, 4, 0.4, 1)], ["cpu", "cpu"], [30, 39])
    made += plot.save(plot.plot_sweep(sweep), tmp_path / "sweep")
    assert sorted(p.name for p in made) == sorted(
        f"{n}.{ext}" for n in ("plan", "skips", "skips_unsplit", "timeline", "sweep") for ext in ("png", "svg")
    )
    for p in made:
        assert _is_png(p) if p.suffix == ".png" else "<svg" in p.read_text()[:2000]
    plot.plot_plan(seqify.balance(seq, 2, by="params", progress=False))  # byte columns unknown: still draws
    with pytest.raises(plot.PlotError, match="sums to"):
        plot.plot_skips(seq, [1, 2])
    with pytest.raises(plot.PlotError, match="no boxes"):
        plot.plot_timeline(measure.Timeline(devices=["cpu"], chunks=1))
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plot_error_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert not plot.available()
    with pytest.raises(plot.PlotError, match="pip install"):
        plot.plot_sweep(measure.Sweep([measure.SweepPoint(1, 4, 0.5, 1)], ["cpu"], [1]))
    assert isinstance(plot.PlotError("x"), seqify.SeqifyError)


# -- what a reader sees: titles, units, legends ---------------------------------------------------------------


def test_timeline_time_unit_fits_the_step() -> None:
    """An 80 s CPU step reads in seconds, not as 80000 ms; a 5 ms step in ms."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    for seconds, unit, shown in ((80.0, "s", "80 s"), (0.005, "µs", "5e+03 µs"), (0.5, "ms", "500 ms")):
        boxes = [measure.Box(0, 0, "forward", 0.0, seconds / 2), measure.Box(1, 0, "forward", seconds / 2, seconds)]
        fig = plot.plot_timeline(measure.Timeline(devices=["cpu", "cpu"], chunks=1, boxes=boxes, seconds=seconds))
        ax = fig.axes[0]
        assert ax.get_xlabel() == f"time since the step began ({unit})"
        assert ax.get_title().endswith(f"one step {shown}")
        plt.close(fig)


def _plan_with_cuts(in_bytes: list[int]) -> seqify.PartitionPlan:
    import dataclasses

    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet18(num_classes=10))
    plan = seqify.balance(seq, len(in_bytes), torch.randn(1, 3, 64, 64), by="flops", progress=False)
    stages = tuple(dataclasses.replace(s, in_bytes=b) for s, b in zip(plan.stages, in_bytes))
    return dataclasses.replace(plan, stages=stages)


def test_plan_uses_one_byte_unit_and_neutral_legend_swatches() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    fig = plot.plot_plan(_plan_with_cuts([0, 512 * 1024, 3 * 2**20]))
    ax, mem = fig.axes[:2]
    cuts = [t.get_text() for t in ax.texts if "\n(" in t.get_text()]
    assert [c.split("\n")[0] for c in cuts] == ["0.5 MB", "3 MB"]  # not "512 KB" beside "3.0 MB"
    stage_colors = {to_rgba(c) for c in plot._colors(3)}
    for legend in (ax.get_legend(), mem.get_legend()):
        for text, patch in zip(legend.get_texts(), legend.get_patches()):
            if "colour: stage" in text.get_text():  # the bars' colour is the stage, so the swatch is neutral
                assert to_rgba(patch.get_facecolor()) not in stage_colors
    assert any("colour: stage" in t.get_text() for t in ax.get_legend().get_texts())
    assert mem.get_ylabel().split()[0] in ("B", "KB", "MB", "GB")
    plt.close(fig)


def test_example_bar_chart_has_a_title_and_no_error_bars_from_one_run() -> None:
    pytest.importorskip("matplotlib")
    import importlib.util

    import matplotlib.pyplot as plt

    path = Path(__file__).resolve().parents[2] / "examples" / "resnet50_two_gpus.py"
    spec = importlib.util.spec_from_file_location("resnet50_two_gpus_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    names = ["Pipeline (seqify)", "Single device"]
    one = example.bar_chart(names, [2.0, 1.5], [0.0, 0.0], 1, "ResNet-50 training").axes[0]
    assert "ResNet-50 training" in one.get_title() and "one run" in one.get_title()
    from matplotlib.container import ErrorbarContainer

    def error_bars(ax: object) -> bool:
        return any(isinstance(c, ErrorbarContainer) or getattr(c, "errorbar", None) for c in ax.containers)

    assert not error_bars(one)
    many = example.bar_chart(names, [2.0, 1.5], [0.1, 0.2], 10, "ResNet-50 training").axes[0]
    assert error_bars(many) and "10 runs" in many.get_title()
    plt.close("all")
