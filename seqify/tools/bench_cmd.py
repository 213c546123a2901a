"""``seqify bench``: a SPEC's tuned pipeline against one device; without a SPEC, pipelined throughput of a
torchvision model on GPUs, or the CPU conversion-speed table."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from seqify.convert import convert
from seqify.errors import SampleError
from seqify.tools.console import OK, gpu_count
from seqify.tools.model_cmds import convert_spec, load
from seqify.tools.tuning_options import cap, devices_of, optimizer_of, precision

__all__ = ["bench_cmd"]

def _bench_spec(args: argparse.Namespace) -> int:
    from seqify import plot
    from seqify.tools.bench import bench as run_bench
    from seqify.tools.bench import plot_bench

    args.size = args.size if args.size_given else None  # the model's own input side unless --size is given
    model, x = load(args)
    seq = convert_spec(model.module, x, args.example or model.example)
    with precision(args):
        result = run_bench(seq, x, devices_of(args), spec=args.spec, top=args.top, alternatives=args.alternatives,
                           steps=args.steps, warm=args.warm, cache=not args.no_cache, memory_cap=cap(args),
                           schedule=args.schedule, optimizer=optimizer_of(args), replicas=args.replicas)
    print(result)
    print(f"\nuse it: seqify.pipeline(seq, config=cfg) with cfg = {result.config.without_trials().to_dict()}")
    if args.plot:
        if plot.available():
            made = plot.save(plot_bench(result), args.plot)
            print("plot written: " + ", ".join(str(p) for p in made))
        else:
            print("plot: skipped: matplotlib is not installed (pip install matplotlib)")
    return OK


def _timed_steps(model: torch.nn.Module, x: torch.Tensor, steps: int, devices: Sequence[torch.device],
                 desc: str) -> float:
    from seqify.measure import _sync
    from seqify.progress import progress

    times = []
    for _ in progress(range(steps), steps, desc=desc):
        _sync(devices)
        start = time.perf_counter()
        model(x).float().square().mean().backward()
        _sync(devices)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def bench_cmd(args: argparse.Namespace) -> int:
    import torchvision

    if args.spec:
        return _bench_spec(args)

    gpus = gpu_count()
    if gpus < 2:
        print(f"seqify bench measures pipeline training throughput across GPUs; this machine has {gpus} GPU"
              f"{'s' if gpus != 1 else ''}, so it shows the CPU conversion-speed table instead "
              "(benchmarks/convert_speed/main.py has the full version).")
        return _bench_cpu(args)
    from seqify import measure
    from seqify.partition import balance

    devices = [torch.device("cuda", i) for i in range(args.gpus or gpus)]
    torch.manual_seed(0)
    seq = convert(torchvision.models.get_model(args.model, weights=None))
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    chunks = args.chunks or [4, 8, 16]
    print(f"seqify bench: {args.model}, batch {args.batch}x3x{args.size}x{args.size}, {len(devices)} GPUs "
          f"({torch.cuda.get_device_name(0)}), balance by time, checkpoint='never'")
    parts = devices * args.loops
    plan = balance(seq, len(parts), x[: max(1, args.batch // max(chunks))], by="time", device=devices[0])
    print(plan)
    common = dict(devices=parts, balance=plan.balance, chunks=chunks, steps=args.steps, checkpoint="never",
                  label=args.model)
    eager = measure.sweep(seq, x, y, warm=args.warm, **common)
    print(eager)
    graphed = measure.sweep(seq, x, y, warm=args.warm + 1, graphs=True, baseline=False, **common)
    graphed.baseline = eager.baseline  # the first warm-up step captures the graphs
    print(graphed)
    return OK


def _bench_cpu(args: argparse.Namespace) -> int:
    import platform

    import torchvision

    batch = args.batch if args.batch_given else 2
    size = args.size if args.size_given else 128
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    start = time.perf_counter()
    seq = convert(model)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        convert(model)
        warm.append(time.perf_counter() - start)
    x = torch.randn(batch, 3, size, size)
    model.train()
    seq.train()
    cpu = [torch.device("cpu")]
    try:
        _timed_steps(model, x, 1, cpu, "warm-up")
    except Exception as e:
        raise SampleError(f"{args.model} fails to train on a {batch}x3x{size}x{size} batch ({type(e).__name__}: "
                          f"{e}); try a larger --batch or --size") from e
    src = _timed_steps(model, x, args.steps, cpu, "source forward+backward")
    conv = _timed_steps(seq, x, args.steps, cpu, "converted forward+backward")
    print(f"\nmodel {args.model}, {len(seq)} layers, {len(seq.skips)} skips; torch {torch.__version__}; "
          f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| convert, first call in process | {cold:.3f} s |")
    print(f"| convert, median of 3 more | {statistics.median(warm):.3f} s |")
    print(f"| source forward+backward, batch {batch}x3x{size}x{size}, median of {args.steps} | {src * 1e3:.1f} ms |")
    print(f"| converted forward+backward, same | {conv * 1e3:.1f} ms |")
    print(f"| converted speed / source speed | {src / conv:.3f}x |")
    return OK
