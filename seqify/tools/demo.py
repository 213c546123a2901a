"""The main job, ``seqify demo``: convert a real net, prove it exact, balance it, train it pipelined."""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from seqify.convert import convert
from seqify.convert.verify import bit_equal

__all__ = ["demo", "OK", "NOT_EXACT"]

OK, NOT_EXACT = 0, 1


def _leaves_match(a: object, b: object, same: Callable[[torch.Tensor, torch.Tensor], bool]) -> bool:
    la = torch.utils._pytree.tree_leaves(a)
    lb = torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        same(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


_bit_equal = bit_equal  # one definition of "computes what the source computes": seqify.convert.verify


def _close(a: object, b: object) -> bool:
    return _leaves_match(
        a, b, lambda x, y: torch.allclose(x.float().cpu(), y.float().cpu(), rtol=1e-3, atol=1e-4)
    )


_STARTED = time.perf_counter()


def _section(title: str, clock: bool = False) -> None:
    when = f"  [{time.perf_counter() - _STARTED:.1f} s]" if clock else ""
    print(f"\n== {title}{when}", flush=True)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- demo -------------------------------------------------------------------------------------------------


def _check_exact(model: torch.nn.Module, reference: torch.nn.Module, seq: Any, x: torch.Tensor) -> bool:
    """Eval and train forward bit-equal, gradients, BatchNorm statistics: ``model`` (which ``seq`` shares)
    against ``reference``, an untouched copy of the source."""
    model.eval()
    reference.eval()
    with torch.no_grad():
        want = _source_output(reference, x)
        ok_eval = _bit_equal(seq(x), want)
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
    ok_train = _bit_equal(out_seq, out_ref)
    grads = dict(reference.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    ok_grad = all(
        torch.allclose(p.grad, grads[n].grad, rtol=1e-5, atol=1e-5) for n, p in model.named_parameters()
    )
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
    n = _gpus()
    if n:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * 2


def demo(args: argparse.Namespace) -> int:
    import torchvision

    from seqify import measure
    from seqify.api import pipeline
    from seqify.partition import balance

    devices = _demo_devices(args)
    on_gpu = devices[0].type == "cuda"
    where = ", ".join(str(d) for d in devices)
    train_batch = args.train_batch or (64 if on_gpu else 8)
    chunks = args.chunks or (8 if on_gpu else 4)
    sweep_chunks = args.sweep or ([2, 4, 8, 16] if on_gpu else [1, 2, 4])
    by = args.by or ("time" if on_gpu else "flops")
    global _STARTED
    began = _STARTED = time.perf_counter()
    torch.manual_seed(args.seed)
    note = "" if on_gpu or args.devices else " (no GPU here: 2 partitions on the CPU)"
    print(f"seqify demo: torchvision {args.model} over {len(devices)} partitions on {where}{note}", flush=True)
    model = torchvision.models.get_model(args.model, weights=None)
    fixed = _fixed_size(model, args.model, {"--size": args.size, "--train-size": args.train_size})
    train_size = args.train_size or fixed or (224 if on_gpu else 64)
    reference = copy.deepcopy(model)
    runs = sorted(set(sweep_chunks) | {chunks})
    _check_micro_batches(model, train_batch, runs)

    _section("1. convert", clock=True)
    start = time.perf_counter()
    seq = convert(model)
    print(f"converted in {time.perf_counter() - start:.2f} s")
    print(seq.summary())
    shown = seq.skips[: args.show]
    if shown:
        print(f"first {len(shown)} of {len(seq.skips)} skips (name: stashing layer -> popping layer):")
        for s in shown:
            print(f"  {s}")
    names = list(seq._modules)
    print(f"layers: {', '.join(names[:6])}, ..., {', '.join(names[-3:])}")

    _section(f"2. exactness against the source model (random batch {args.batch}x3x{args.size}x{args.size}, CPU)",
             clock=True)
    x = torch.randn(args.batch, 3, args.size, args.size)
    exact = _check_exact(model, reference, seq, x)
    print("exact: yes" if exact else "exact: NO")

    _section(f"3. balance: {len(devices)} partitions by {by}", clock=True)
    if by == "time":
        probe = torch.randn(max(1, train_batch // chunks), 3, train_size, train_size)
    else:
        probe = torch.randn(1, 3, 224, 224)
    measured = by in ("time", "memory")
    plan = balance(seq, len(devices), probe, by=by, device=devices[0] if measured else None)
    print(f"sample {'x'.join(map(str, probe.shape))}{' on ' + str(devices[0]) if measured else ''}")
    print(plan)

    _section(f"4. pipelined training: batch {train_batch}x3x{train_size}x{train_size}, SGD, "
             f"{args.steps} timed step(s) after 1 warm-up per configuration", clock=True)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randn(train_batch, 3, train_size, train_size, generator=gen)
    target = torch.randint(0, 1000, (train_batch,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # no per-parameter state: partitions move

    def report(c: int, step: int, loss: float, took: float) -> None:
        what = "one device, no pipeline" if c == 0 else f"{c} micro-batch{'es' if c > 1 else ''}"
        tag = "warm-up" if step < 0 else f"step {step + 1}"
        print(f"  {what:24s} {tag:8s} loss {loss:.4f}  {took:6.2f} s", flush=True)

    checkpoint = "never" if on_gpu else "except_last"
    sweep = measure.sweep(seq, data, target, devices=devices, balance=plan.balance, chunks=runs, steps=args.steps,
                          warm=1, checkpoint=checkpoint, optimizer=optimizer, on_step=report, show=False,
                          label=args.model, graphs=on_gpu)
    print(sweep)
    best = sweep.best()
    base = sweep.baseline.samples_per_s if sweep.baseline else float("nan")
    chosen = next(p for p in sweep.points if p.chunks == chunks)
    print(f"throughput at {chunks} micro-batches: {chosen.samples_per_s:.2f} samples/s "
          f"({chosen.samples_per_s / base:.2f}x one device); best: {best.chunks} micro-batches, "
          f"{best.samples_per_s:.2f} samples/s")
    if not on_gpu:
        print("(on a CPU the partitions share the same cores, so pipelining adds overhead and no speed-up; "
              "on GPUs every partition has its own device)")

    pipe = pipeline(seq, devices=devices, balance=plan.balance, chunks=chunks, checkpoint=checkpoint)
    pipe.train()
    with measure.record(pipe, label=args.model) as timeline:
        measure.train_step(pipe, data.to(devices[0]), target.to(devices[-1]), torch.nn.functional.cross_entropy,
                           optimizer)
    print(timeline)

    # The pipeline against the source run on each micro-batch (the pipeline splits with tensor_split).
    # On GPUs the source's modules are spread over the devices, so its trained copy runs on the first.
    pipe.eval()
    if on_gpu:
        reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        source = reference.to(devices[0])
    else:
        source = model
    source.eval()
    check = data[: max(2, min(chunks, train_batch))].to(devices[0])
    with torch.no_grad():
        got = pipe(check)
        want = torch.cat([source(c) for c in check.tensor_split(min(pipe.chunks, check.shape[0]))])
    matches = _close(got, want) if on_gpu else _bit_equal(got, want)
    print(f"pipeline eval forward {'allclose to' if on_gpu else 'bit-equal to'} the source run on each "
          f"micro-batch: {matches}")

    _section("5. plots", clock=True)
    if args.no_plots:
        print("plots: skipped (--no-plots)")
    else:
        _demo_plots(args.plots, seq, plan, timeline, sweep, args.model)
    ok = exact and matches
    print(f"\n{'exact: yes' if ok else 'exact: NO'} (demo took {time.perf_counter() - began:.1f} s)")
    return OK if ok else NOT_EXACT


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
