"""The main job, ``seqify demo``: convert a real net, prove it exact, balance it, train it pipelined."""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from seqify.convert import convert
from seqify.convert.verify import bit_equal
from seqify.tools.console import NOT_EXACT, OK, gpu_count, restart_clock, section

__all__ = ["demo", "OK", "NOT_EXACT"]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient the demo's loss gave ``p`` (every parameter of its net takes part in the loss)."""
    assert p.grad is not None
    return p.grad


def _leaves_match(a: object, b: object, same: Callable[[torch.Tensor, torch.Tensor], bool]) -> bool:
    la = torch.utils._pytree.tree_leaves(a)
    lb = torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        same(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def _close(a: object, b: object) -> bool:
    return _leaves_match(
        a, b, lambda x, y: torch.allclose(x.float().cpu(), y.float().cpu(), rtol=1e-3, atol=1e-4)
    )


def _check_exact(model: torch.nn.Module, reference: torch.nn.Module, seq: Any, x: torch.Tensor) -> bool:
    """Eval and train forward bit-equal, gradients, BatchNorm statistics: ``model`` (which ``seq`` shares)
    against ``reference``, an untouched copy of the source."""
    model.eval()
    reference.eval()
    with torch.no_grad():
        want = _source_output(reference, x)
        ok_eval = bit_equal(seq(x), want)
    print(f"  eval forward bit-equal (torch.equal):      {ok_eval}")
    model.train()
    reference.train()
    seq.train()
    torch.manual_seed(1)
    out_ref = reference(x)
    out_ref.square().mean().backward()
    torch.manual_seed(1)
    out_seq = seq(x)
    out_seq.square().mean().backward()
    ok_train = bit_equal(out_seq, out_ref)
    grads = dict(reference.named_parameters())
    pairs = [(_grad(p), _grad(grads[n])) for n, p in model.named_parameters()]
    worst = max((a - b).abs().max().item() for a, b in pairs)
    ok_grad = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in pairs)
    ref_buffers = dict(reference.named_buffers())
    ok_bn = all(torch.equal(b, ref_buffers[n]) for n, b in model.named_buffers())
    print(f"  train forward bit-equal:                   {ok_train}")
    print(f"  parameter gradients allclose(1e-5):        {ok_grad} (largest difference {worst:.1e})")
    print(f"  BatchNorm running statistics identical:    {ok_bn}")
    model.zero_grad(set_to_none=True)
    return ok_eval and ok_train and ok_grad and ok_bn


def _fixed_size(model: torch.nn.Module, name: str, sizes: dict[str, int | None]) -> int | None:
    """The one image side ``model`` takes (ViT's ``image_size``), checked against the sizes given as options."""
    from seqify.errors import SampleError

    fixed = getattr(model, "image_size", None)
    if not isinstance(fixed, int):
        return None
    for option, side in sizes.items():
        if side is not None and side != fixed:
            raise SampleError(f"{name} takes {fixed}x{fixed} images only (its image_size), not {side}x{side}: "
                              f"the image size must be {fixed}; use {option} {fixed}")
    return fixed


def _check_micro_batches(model: torch.nn.Module, batch: int, chunks: list[int]) -> None:
    """BatchNorm in training mode cannot normalise a micro-batch of one sample: refuse such chunk counts."""
    from seqify.errors import SampleError

    if max(chunks) * 2 <= batch or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                           for m in model.modules()):
        return
    raise SampleError(f"{max(chunks)} micro-batches of a training batch of {batch} leave some with 1 sample, which "
                      f"BatchNorm cannot normalise in training mode: use --chunks and --sweep of at most "
                      f"{max(1, batch // 2)}, or a --train-batch of at least {2 * max(chunks)}")


def _source_output(source: torch.nn.Module, x: torch.Tensor) -> Any:
    """The source model's output on ``x``; a model that refuses the input is the user's --size or --batch."""
    from seqify.errors import SampleError

    try:
        return source(x)
    except Exception as e:
        raise SampleError(f"the source {type(source).__name__} fails on a random {'x'.join(map(str, x.shape))} "
                          f"batch ({type(e).__name__}: {e}); give an input it takes with --size and --batch") from e


def _demo_devices(args: argparse.Namespace) -> list[torch.device]:
    if args.devices:
        from seqify.pipe.pipeline import resolve_devices

        return resolve_devices(None, [d.strip() for d in args.devices.split(",") if d.strip()], None)
    n = gpu_count()
    if n:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * 2


@dataclass(frozen=True)
class _Run:
    """The demo's choices on this machine: the options given, else defaults for GPUs or for the CPU."""

    devices: list[torch.device]
    on_gpu: bool
    train_batch: int
    chunks: int  # micro-batches of the timeline
    runs: list[int]  # micro-batch counts the sweep measures
    by: str  # the balance's cost model


def _choices(args: argparse.Namespace) -> _Run:
    devices = _demo_devices(args)
    on_gpu = devices[0].type == "cuda"
    chunks = args.chunks or (8 if on_gpu else 4)
    sweep_chunks = args.sweep or ([2, 4, 8, 16] if on_gpu else [1, 2, 4])
    return _Run(devices, on_gpu, train_batch=args.train_batch or (64 if on_gpu else 8), chunks=chunks,
                runs=sorted(set(sweep_chunks) | {chunks}), by=args.by or ("time" if on_gpu else "flops"))


def demo(args: argparse.Namespace) -> int:
    """``seqify demo``: convert a torchvision model, prove it exact, balance it, train it pipelined, plot it;
    exit code 1 where anything is not exact."""
    import torchvision

    run = _choices(args)
    began = restart_clock()
    torch.manual_seed(args.seed)
    where = ", ".join(str(d) for d in run.devices)
    note = "" if run.on_gpu or args.devices else " (no GPU here: 2 partitions on the CPU)"
    print(f"seqify demo: torchvision {args.model} over {len(run.devices)} partitions on {where}{note}", flush=True)
    model = torchvision.models.get_model(args.model, weights=None)
    fixed = _fixed_size(model, args.model, {"--size": args.size, "--train-size": args.train_size})
    train_size = args.train_size or fixed or (224 if run.on_gpu else 64)
    reference = copy.deepcopy(model)
    _check_micro_batches(model, run.train_batch, run.runs)
    seq = _converted(model, args.show)
    section(f"2. exactness against the source model (random batch {args.batch}x3x{args.size}x{args.size}, CPU)",
            clock=True)
    exact = _check_exact(model, reference, seq, torch.randn(args.batch, 3, args.size, args.size))
    print("exact: yes" if exact else "exact: NO")
    plan = _balanced(seq, run, train_size)
    sweep, timeline, matches = _trained(args, run, model, reference, seq, plan, train_size)
    section("5. plots", clock=True)
    if args.no_plots:
        print("plots: skipped (--no-plots)")
    else:
        _demo_plots(args.plots, seq, plan, timeline, sweep, args.model)
    ok = exact and matches
    print(f"\n{'exact: yes' if ok else 'exact: NO'} (demo took {time.perf_counter() - began:.1f} s)")
    return OK if ok else NOT_EXACT


def _converted(model: torch.nn.Module, show: int) -> Any:
    """Step 1: convert ``model`` and show what the conversion made (its summary, the first ``show`` skips)."""
    section("1. convert", clock=True)
    start = time.perf_counter()
    seq = convert(model)
    print(f"converted in {time.perf_counter() - start:.2f} s")
    print(seq.summary())
    shown = seq.skips[:show]
    if shown:
        print(f"first {len(shown)} of {len(seq.skips)} skips (name: stashing layer -> popping layer):")
        for s in shown:
            print(f"  {s}")
    names = list(seq._modules)
    print(f"layers: {', '.join(names[:6])}, ..., {', '.join(names[-3:])}")
    return seq


def _balanced(seq: Any, run: _Run, train_size: int) -> Any:
    """Step 3: the partition plan over the devices, by measured time for one micro-batch or by FLOPs."""
    from seqify.partition import balance

    section(f"3. balance: {len(run.devices)} partitions by {run.by}", clock=True)
    if run.by == "time":
        probe = torch.randn(max(1, run.train_batch // run.chunks), 3, train_size, train_size)
    else:
        probe = torch.randn(1, 3, 224, 224)
    measured = run.by in ("time", "memory")
    plan = balance(seq, len(run.devices), probe, by=run.by, device=run.devices[0] if measured else None)
    print(f"sample {'x'.join(map(str, probe.shape))}{' on ' + str(run.devices[0]) if measured else ''}")
    print(plan)
    return plan


def _trained(args: argparse.Namespace, run: _Run, model: torch.nn.Module, reference: torch.nn.Module, seq: Any,
             plan: Any, train_size: int) -> tuple[Any, Any, bool]:
    """Step 4: train pipelined at each micro-batch count against one device, record a timeline of one step,
    and check the trained pipeline against the source; the sweep, the timeline, and whether it matched."""
    from seqify import measure
    from seqify.api import pipeline

    section(f"4. pipelined training: batch {run.train_batch}x3x{train_size}x{train_size}, SGD, "
            f"{args.steps} timed step(s) after 1 warm-up per configuration", clock=True)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randn(run.train_batch, 3, train_size, train_size, generator=gen)
    target = torch.randint(0, 1000, (run.train_batch,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # no per-parameter state: partitions move
    checkpoint = "never" if run.on_gpu else "except_last"
    sweep = measure.sweep(seq, data, target, devices=run.devices, balance=plan.balance, chunks=run.runs,
                          steps=args.steps, warm=1, checkpoint=checkpoint, optimizer=optimizer, on_step=_report,
                          show=False, label=args.model, graphs=run.on_gpu)
    print(sweep)
    _print_throughput(sweep, run)
    pipe = pipeline(seq, devices=run.devices, balance=plan.balance, chunks=run.chunks, checkpoint=checkpoint)
    pipe.train()
    with measure.record(pipe, label=args.model) as timeline:
        measure.train_step(pipe, data.to(run.devices[0]), target.to(run.devices[-1]),
                           torch.nn.functional.cross_entropy, optimizer)
    print(timeline)
    matches = _matches_source(pipe, model, reference, data, run)
    return sweep, timeline, matches


def _report(c: int, step: int, loss: float, took: float) -> None:
    """One line per training step of the sweep (``c`` = 0: one device, no pipeline; ``step`` < 0: warm-up)."""
    what = "one device, no pipeline" if c == 0 else f"{c} micro-batch{'es' if c > 1 else ''}"
    tag = "warm-up" if step < 0 else f"step {step + 1}"
    print(f"  {what:24s} {tag:8s} loss {loss:.4f}  {took:6.2f} s", flush=True)


def _print_throughput(sweep: Any, run: _Run) -> None:
    best = sweep.best()
    base = sweep.baseline.samples_per_s if sweep.baseline else float("nan")
    chosen = next(p for p in sweep.points if p.chunks == run.chunks)
    print(f"throughput at {run.chunks} micro-batches: {chosen.samples_per_s:.2f} samples/s "
          f"({chosen.samples_per_s / base:.2f}x one device); best: {best.chunks} micro-batches, "
          f"{best.samples_per_s:.2f} samples/s")
    if not run.on_gpu:
        print("(on a CPU the partitions share the same cores, so pipelining adds overhead and no speed-up; "
              "on GPUs every partition has its own device)")


def _matches_source(pipe: Any, model: torch.nn.Module, reference: torch.nn.Module, data: torch.Tensor,
                    run: _Run) -> bool:
    """The pipeline's eval forward against the source run on each micro-batch (the pipeline splits with
    tensor_split): bit-equal on the CPU, allclose on GPUs, where the source's modules are spread over the
    devices, so its trained copy runs on the first."""
    pipe.eval()
    if run.on_gpu:
        reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        source = reference.to(run.devices[0])
    else:
        source = model
    source.eval()
    check = data[: max(2, min(run.chunks, run.train_batch))].to(run.devices[0])
    with torch.no_grad():
        got = pipe(check)
        want = torch.cat([source(c) for c in check.tensor_split(min(pipe.chunks, check.shape[0]))])
    matches = _close(got, want) if run.on_gpu else bit_equal(got, want)
    print(f"pipeline eval forward {'allclose to' if run.on_gpu else 'bit-equal to'} the source run on each "
          f"micro-batch: {matches}")
    return matches


def _demo_plots(folder: str, seq: Any, plan: Any, timeline: Any, sweep: Any, name: str) -> None:
    from seqify import plot

    if not plot.available():
        print("plots: skipped: matplotlib is not installed (pip install 'seqify[plot]' or pip install matplotlib)")
        return
    made = []
    made += plot.save(plot.plot_plan(plan, title=f"{name}: partition plan by {plan.by}, {len(plan)} stages, "
                                             f"imbalance {plan.imbalance:.3f}"), os.path.join(folder, "plan"))
    made += plot.save(plot.plot_skips(seq, plan), os.path.join(folder, "skips"))
    made += plot.save(plot.plot_timeline(timeline), os.path.join(folder, "timeline"))
    made += plot.save(plot.plot_sweep(sweep), os.path.join(folder, "sweep"))
    import matplotlib.pyplot as plt

    plt.close("all")
    print(f"plots written to {folder}/: " + ", ".join(sorted({p.name for p in made})))
