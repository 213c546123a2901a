"""seqify.measure (timelines of real pipeline runs, chunks sweeps) and seqify.plot (PNG and SVG files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision

import seqify
from seqify import measure, plot
from seqify.pipeline.stage import Stage


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
