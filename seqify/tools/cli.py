"""The ``seqify`` command: demo, convert, inspect, bench and zoo, with exit codes scripts can trust."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqify.convert import convert
from seqify.errors import BalanceError, SampleError, SeqifyError, SpecError, UntraceableError
from seqify.partition.cost import BY
from seqify.schedule.actions import SCHEDULES
from seqify.tools.advice import DATA_DEPENDENT, costs_depend_on_data, data_dependent_advice, for_cli
from seqify.tools.demo import NOT_EXACT, OK, _bit_equal, _gpus, _section, demo

__all__ = ["main"]

USAGE = 2
INTERNAL = 3

EPILOG = """\
examples:
  seqify demo                                   convert ResNet-101, prove it exact, balance it, train it
                                                pipelined (2 CPU partitions without GPUs), write plots
  seqify demo --plots out/ --chunks 4           the same, plots into out/
  seqify inspect torchvision:resnet50 --stages 4
  seqify inspect zoo:unet --arg depth=5 --size 512 --stages 2 --by memory
  seqify convert torchvision:resnet101 -o resnet101.pt
  seqify convert models.py:build_net --arg width=64 --shape 1x3x32x32 -o net.pt
  seqify zoo                                    list the zoo; seqify zoo --check checks every model
  seqify bench                                  pipeline throughput on GPUs (CPU: conversion speed)

{spec}

exit codes: 0 success; 1 an exactness check failed; 2 usage or input error (bad SPEC, bad option,
a model seqify cannot convert: the message says what to do); 3 an internal error (a bug: please report it).
"""



def _load(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    from seqify.tools import spec

    kwargs = spec.parse_args(args.arg)
    try:
        model = spec.load(args.spec, kwargs)
    except SeqifyError:
        raise
    except Exception as e:  # the user's builder (or import) raised: their code, not a seqify bug
        raise SpecError(f"building the model {args.spec!r} failed: {type(e).__name__}: {e}\n"
                        "Fix the builder or its --arg values; seqify needs it to return an nn.Module.") from e
    shape = spec.sample_shape(model, args.batch, args.size, args.shape)
    return model, spec.random_input(shape, args.seed, model.vocab)


def _convert(module: torch.nn.Module, x: torch.Tensor, example: bool) -> Any:
    print(f"converting {type(module).__name__} ...", flush=True)  # large models take seconds: say so first
    start = time.perf_counter()
    try:
        seq = convert(module, (x,) if example else None)
    except UntraceableError as e:
        if DATA_DEPENDENT in str(e):
            raise UntraceableError(data_dependent_advice(str(e))) from e
        if example or "example_inputs" not in str(e):
            raise
        # Would the example input help? Only for branches on shapes: try it, and advise what fits.
        try:
            convert(module, (x,))
        except SeqifyError as again:
            if DATA_DEPENDENT in str(again):
                raise UntraceableError(data_dependent_advice(str(again))) from e
            raise e from None  # the example does not help either: the first message stands
        except Exception:
            raise e from None
        raise UntraceableError(f"{e}\nThis input's shape resolves it: add --example "
                               "(the conversion is then valid for inputs shaped like it).") from e
    print(f"converted in {time.perf_counter() - start:.2f} s{' (specialised to the example input)' if example else ''}")
    return seq


def _run_check(module: torch.nn.Module, seq: Any, x: torch.Tensor) -> bool:
    module.eval()
    seq.eval()
    try:
        with torch.no_grad():
            want = module(x)
            got = seq(x)
    except SeqifyError:
        raise
    except Exception as e:
        raise SampleError(
            f"the model fails on a random input of shape {tuple(x.shape)} ({type(e).__name__}: {e}); "
            "give the input it expects with --shape (e.g. --shape 1x3x32x32) or --size"
        ) from e
    ok = _bit_equal(got, want)
    print(f"eval forward on a random {'x'.join(map(str, x.shape))} input bit-equal to the source: {ok}")
    return ok


def convert_cmd(args: argparse.Namespace) -> int:
    model, x = _load(args)
    seq = _convert(model.module, x, args.example or model.example)
    print(for_cli(seq.summary()))
    ok = True
    if not args.no_check:
        ok = _run_check(model.module, seq, x)
    if not ok:
        print("seqify: not saved: the conversion is not exact on this input (a bug: please report it)", file=sys.stderr)
        return NOT_EXACT
    out = args.output
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise SeqifyError(f"cannot write {out}: folder {folder} does not exist")
    torch.save(seq, out)
    print(f"saved to {out} ({os.path.getsize(out) / 2**20:.1f} MB); load it with torch.load({out!r}, weights_only=False)")
    return OK


def _describe(layer: torch.nn.Module) -> str:
    from seqify.model.layer import Layer

    text = layer.extra_repr() if isinstance(layer, Layer) else repr(layer)
    text = " ".join(text.split())
    return text if len(text) <= 70 else text[:67] + "..."


def inspect_cmd(args: argparse.Namespace) -> int:
    model, x = _load(args)
    seq = _convert(model.module, x, args.example or model.example)
    print(for_cli(seq.summary()))
    plan = None
    if args.stages:
        plan = _plan(seq, args, x)
    if not args.no_layers:
        _section(f"layers ({len(seq)})")
        part_of = [str(j) for j, n in enumerate(plan.balance) for _ in range(n)] if plan else []
        rows = [("#", "stage", "name", "type", "params", "what")]
        # by index, as the plan counts: a module used twice (ResNet's shared ReLU) is two layers, which
        # named_children() would list once
        for i, (name, layer) in enumerate(seq._modules.items()):
            params = sum(p.numel() for p in layer.parameters())
            rows.append((str(i), part_of[i] if plan else "", name, type(layer).__name__, f"{params:,}", _describe(layer)))
        if plan is None:  # no stage column
            rows = [(r[0], *r[2:]) for r in rows]
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    _section(f"skips ({len(seq.skips)}): name: stashing layer -> popping layer")
    for s in seq.skips:
        print(f"  {s}")
    if not seq.skips:
        print("  none: a plain chain")
    _section(f"opaque layers ({len(seq.opaque)})")
    for o in seq.opaque:
        print(f"  {for_cli(str(o))}")
    if not seq.opaque:
        print("  none: every module was split into layers")
    if seq.guards:
        _section("valid for inputs where")
        for g in seq.guards:
            print(f"  {g}")
    if plan is not None:
        _section(f"partition plan for {'x'.join(map(str, x.shape))}")
        print(plan)
        print(f"use it: seqify.pipeline(seq, gpus={args.stages}, balance={plan.balance}, chunks=...)")
    if args.tune:
        _section(f"tuned pipeline for {'x'.join(map(str, x.shape))}")
        print(_tune_for(seq, x, args))
    if args.plots:
        from seqify import plot

        if not plot.available():
            print("plots: skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            made = plot.save(plot.plot_skips(seq, plan), os.path.join(args.plots, "skips"))
            if plan is not None:
                made += plot.save(plot.plot_plan(plan), os.path.join(args.plots, "plan"))
            print(f"plots written to {args.plots}/: " + ", ".join(p.name for p in made))
    return OK


def _plan(seq: Any, args: argparse.Namespace, x: torch.Tensor) -> Any:
    """The partition plan --stages asks for; by FLOPs unless --by says otherwise, falling back to measured
    time when a layer's FLOPs depend on the data (an opaque layer that branches on values)."""
    from seqify.partition import balance

    by = args.by or "flops"
    device = args.device if by in ("time", "memory") else None
    try:
        return balance(seq, args.stages, x, by=by, device=device)
    except BalanceError as e:
        if args.by is not None or not costs_depend_on_data(str(e)):
            raise
        print(f"note: {for_cli(str(e)).split('; balance')[0]}; balancing by measured time on {args.device or 'cpu'} instead "
              "(--by time)", flush=True)
        return balance(seq, args.stages, x, by="time", device=args.device)

# -- tune -------------------------------------------------------------------------------------------------


def _devices_of(args: argparse.Namespace) -> list[str]:
    """--devices cpu,cpu, else --gpus N, else every GPU (two CPU partitions without GPUs)."""
    if args.devices:
        return [d.strip() for d in args.devices.split(",") if d.strip()]
    gpus = getattr(args, "gpus", None) or _gpus()
    return [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu", "cpu"]


def _tune_for(seq: Any, x: torch.Tensor, args: argparse.Namespace) -> Any:
    from seqify.tuning import tune

    with _precision(args):
        return tune(seq, x, devices=_devices_of(args), top=args.top, cache=not args.no_cache, memory_cap=_cap(args),
                    schedule=args.schedule)


def _precision(args: argparse.Namespace) -> Any:
    """bf16 autocast on the devices' type with --bf16, else nothing."""
    kind = torch.device(_devices_of(args)[0]).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=bool(getattr(args, "bf16", False)))


def _cap(args: argparse.Namespace) -> float | None:
    """--memory-cap as bytes (None when not given)."""
    from seqify.pipe.memory import parse_bytes

    return None if args.memory_cap is None else float(parse_bytes(args.memory_cap))


def _bench_spec(args: argparse.Namespace) -> int:
    from seqify import plot
    from seqify.tools.bench import bench as run_bench
    from seqify.tools.bench import plot_bench

    args.size = args.size if args.size_given else None  # the model's own input side unless --size is given
    model, x = _load(args)
    seq = _convert(model.module, x, args.example or model.example)
    with _precision(args):
        result = run_bench(seq, x, _devices_of(args), spec=args.spec, top=args.top, alternatives=args.alternatives,
                           steps=args.steps, warm=args.warm, cache=not args.no_cache, memory_cap=_cap(args),
                           schedule=args.schedule)
    print(result)
    print(f"\nuse it: seqify.pipeline(seq, config=cfg) with cfg = {result.config.without_trials().to_dict()}")
    if args.plot:
        if plot.available():
            made = plot.save(plot_bench(result), args.plot)
            print("plot written: " + ", ".join(str(p) for p in made))
        else:
            print("plot: skipped: matplotlib is not installed (pip install matplotlib)")
    return OK


# -- bench ------------------------------------------------------------------------------------------------


def _timed_steps(model: torch.nn.Module, x: torch.Tensor, steps: int, devices: Sequence[torch.device], desc: str) -> float:
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


def bench(args: argparse.Namespace) -> int:
    import torchvision

    if args.spec:
        return _bench_spec(args)

    gpus = _gpus()
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
    eager = measure.sweep(seq, x, y, warm=args.warm, **common)  # type: ignore[arg-type]
    print(eager)
    graphed = measure.sweep(seq, x, y, warm=args.warm + 1, graphs=True, baseline=False, **common)  # type: ignore[arg-type]
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


# -- zoo --------------------------------------------------------------------------------------------------


def zoo_cmd(args: argparse.Namespace) -> int:
    from seqify import zoo

    names = args.names or zoo.list(args.family)
    for n in names:
        zoo.entry(n)  # unknown names fail here, with close matches
    if args.check:
        from seqify.zoo.check import check_all

        missing = [n for n in names if not zoo.entry(n).available]
        if missing and not args.names:  # checking the whole zoo: skip what needs an extra that is not installed
            print(f"skipped {', '.join(missing)}: they need transformers (pip install 'seqify[hf]')")
            names = [n for n in names if n not in missing]
        results = check_all(names)
        for c in results:
            mark = "ok  " if c.ok else "FAIL"
            print(f"{mark} {c.name:30s} {c.layers:5d} layers {c.skips:4d} skips  exact={c.exact} "
                  f"pipelined={c.pipelined}  {c.seconds:.1f} s")
        failed = [c for c in results if not c.ok]
        print(f"{len(results) - len(failed)} of {len(results)} zoo models convert and pipeline exactly "
              "(small configurations, eval mode, 2 CPU partitions)")
        return NOT_EXACT if failed else OK
    print(f"{'name':30s} {'family':14s} source")
    for n in names:
        e = zoo.entry(n)
        print(f"{n:30s} {e.family:14s} {e.source}")
    print(f"\n{len(names)} models: seqify.zoo.get(name) converts one; seqify.zoo.hints(name, gpus) gives its balance; "
          "docs/zoo.md has the table")
    return OK


# -- parser -----------------------------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least`` (a usage error, exit 2, otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {least}")
        return value

    parse.__name__ = "count"  # argparse names the type in "invalid count value"
    return parse


POSITIVE, NATURAL = _count(1), _count(0)


def _torchvision_model(name: str) -> str:
    """An argparse type: a torchvision model name, with close matches when it is not one."""
    import difflib

    from torchvision import models

    known = models.list_models()
    if name in known:
        return name
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    raise argparse.ArgumentTypeError(
        f"torchvision has no model {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
        + "; torchvision.models.list_models() lists them"
    )


def _model_options(p: argparse.ArgumentParser) -> None:
    from seqify.tools.spec import SPEC_HELP

    p.add_argument("spec", metavar="SPEC", help="the model: torchvision:NAME, zoo:NAME, FILE.py:FACTORY or MODULE:FACTORY")
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="keyword argument for the builder (repeatable)")
    p.add_argument("--size", type=POSITIVE, help="input side: a BATCH x 3 x SIZE x SIZE input (default: the model's, else 224)")
    p.add_argument("--batch", type=POSITIVE, default=1, help="batch of the random input")
    p.add_argument("--shape", help="the input's full shape, e.g. 2x3x32x32 (overrides --size and --batch)")
    p.add_argument("--example", action="store_true",
                   help="convert with the input as example_inputs (for shape-dependent Python code)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    p.epilog = SPEC_HELP


def _tune_options(p: argparse.ArgumentParser) -> None:
    if not any("--devices" in a.option_strings for a in p._actions):
        p.add_argument("--devices", help="tuning: comma-separated devices, e.g. cpu,cpu or cuda:0,cuda:1 "
                       "(default: every GPU, else cpu,cpu)")
    p.add_argument("--top", type=int, default=3, help="tuning: best predicted candidates to confirm with timed steps")
    p.add_argument("--no-cache", action="store_true", help="tuning: measure again instead of reading the cache")
    p.add_argument("--memory-cap", metavar="SIZE", help="tuning: bytes per device, e.g. 40GiB; candidates predicted "
                   "over it are rejected")
    p.add_argument("--schedule", choices=SCHEDULES,
                   help="tuning: fix the schedule (default: the tuner weighs every one that applies)")
    p.add_argument("--bf16", action="store_true", help="tuning: train under bf16 autocast (torch.autocast on the "
                   "devices' type), as mixed-precision training runs; the choice is cached apart from float32's")


class _Given(argparse.Action):
    """Store the value and remember it was given (CPU bench picks smaller defaults otherwise)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _parser() -> argparse.ArgumentParser:
    from seqify.tools.spec import SPEC_HELP

    parser = argparse.ArgumentParser(
        prog="seqify",
        description="Turn PyTorch nets into exact, pipeline-ready nn.Sequentials, balance them, run them across GPUs.",
        epilog=EPILOG.format(spec=SPEC_HELP),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from seqify import __version__

    parser.add_argument("--version", action="version", version=f"seqify {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = functools.partial(sub.add_parser, formatter_class=_Formatter)  # every subcommand: defaults shown

    p = add(
        "demo",
        help="convert ResNet-101, prove it exact, balance it, train it pipelined, plot it",
        description="The whole tour on this machine: convert a torchvision model and check it against the source "
        "(eval and train forward bit-equal, gradients, BatchNorm statistics); balance it over the devices (by "
        "FLOPs on CPU, by measured time on GPUs); train it pipelined for a few steps at several micro-batch "
        "counts (2 CPU partitions without GPUs, every GPU otherwise); record a timeline of one step; write "
        "plots. Exit code 1 if anything is not exact.",
    )
    p.add_argument("--model", default="resnet101", type=_torchvision_model, help="a torchvision classification model")
    p.add_argument("--batch", type=POSITIVE, default=2, help="batch of the exactness check")
    p.add_argument("--size", type=POSITIVE, default=224, help="image side of the exactness check")
    p.add_argument("--devices", help="comma-separated partition devices, e.g. cpu,cpu,cpu or cuda:0,cuda:1 "
                   "(default: every GPU, else cpu,cpu)")
    p.add_argument("--by", choices=BY,
                   help="balance cost model (default: time on GPUs, flops on CPU)")
    p.add_argument("--train-batch", type=POSITIVE, help="training batch (default: 64 on GPUs, 8 on CPU)")
    p.add_argument("--train-size", type=POSITIVE, help="training image side (default: 224 on GPUs, 64 on CPU)")
    p.add_argument("--chunks", type=POSITIVE, help="micro-batches of the timeline (default: 8 on GPUs, 4 on CPU)")
    p.add_argument("--sweep", type=POSITIVE, nargs="+", metavar="CHUNKS",
                   help="micro-batch counts to measure (default: 2 4 8 16 on GPUs, 1 2 4 on CPU)")
    p.add_argument("--steps", type=POSITIVE, default=1, help="timed training steps per configuration")
    p.add_argument("--plots", default="seqify-demo-plots", metavar="DIR", help="where to write the plots")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=NATURAL, default=5, help="how many skips to list")
    p.set_defaults(run=demo)

    p = add("convert", help="convert the model SPEC names and save it (torch.save)",
            description="Build the model, convert it, check the conversion on a random input (eval forward "
            "bit-equal; exit code 1 if not) and save the seqify.Sequential with torch.save. Load it with "
            "torch.load(path, weights_only=False) where seqify is installed.")
    _model_options(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to save, e.g. model.pt")
    p.add_argument("--no-check", action="store_true", help="skip the exactness check")
    p.set_defaults(run=convert_cmd)

    p = add("inspect", help="print a model's layers, skips, opaque parts and a partition plan",
            description="Convert the model SPEC names and print what the conversion made: every layer "
            "(with its partition), every skip, the opaque layers and the guards; with --stages, the "
            "optimal partition plan for the input.")
    _model_options(p)
    p.add_argument("--stages", type=NATURAL, default=0, help="partitions to plan for (0: no plan)")
    p.add_argument("--by", choices=BY, help="balance cost model (default: flops, or time where a layer's "
                   "flops depend on the data)")
    p.add_argument("--device", default=None, help="where --by time/memory measure (default: CPU)")
    p.add_argument("--no-layers", action="store_true", help="leave out the layer table")
    p.add_argument("--plots", metavar="DIR", help="also write skips (and plan) plots into DIR")
    _tune_options(p)
    p.add_argument("--tune", action="store_true", help="also tune a training pipeline for the input (seqify.tune)")
    p.set_defaults(run=inspect_cmd)

    p = add("bench", help="pipeline throughput on GPUs; without GPUs, the CPU conversion-speed table",
            description="With 2 or more GPUs: balance a torchvision model by time and measure pipelined "
            "training throughput against one GPU for several micro-batch counts, eager and with CUDA "
            "graphs (benchmarks/two_gpus/main.py adds torchgpipe and torch pipelining). Otherwise: how long "
            "conversion takes and the converted model's speed against its source on the CPU.")
    p.add_argument("--model", default="resnet101", type=_torchvision_model)
    p.add_argument("--batch", type=POSITIVE, default=128, action=_Given, help="batch (CPU table: 2 unless given)")
    p.add_argument("--size", type=POSITIVE, default=224, action=_Given, help="image side (CPU table: 128 unless given)")
    p.add_argument("--chunks", type=POSITIVE, nargs="+", help="micro-batch counts (default: 4 8 16)")
    p.add_argument("--gpus", type=POSITIVE, help="GPUs to use (default: all)")
    p.add_argument("--loops", type=POSITIVE, default=1, help="partitions per GPU (2: cuda:0, cuda:1, cuda:0, cuda:1)")
    p.add_argument("--steps", type=POSITIVE, default=3, help="timed steps per configuration")
    p.add_argument("--warm", type=NATURAL, default=1, help="untimed warm-up steps per configuration")
    p.add_argument("spec", nargs="?", metavar="SPEC",
                   help="any model SPEC: one device against the tuned pipeline and its rejected alternatives, "
                   "predicted and measured (--devices cpu,cpu without GPUs)")
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="with SPEC: keyword argument for the builder")
    p.add_argument("--shape", help="with SPEC: the input's full shape, e.g. 8x3x32x32")
    p.add_argument("--example", action="store_true", help="with SPEC: convert with the input as example_inputs")
    p.add_argument("--seed", type=int, default=0, help="with SPEC: seed of the random input")
    _tune_options(p)
    p.add_argument("--alternatives", type=int, default=4, help="with SPEC: rejected candidates to time as well")
    p.add_argument("--plot", metavar="FILE", help="with SPEC: write the predicted/measured plot (PNG and SVG)")
    p.set_defaults(run=bench, batch_given=False, size_given=False)

    p = add("zoo", help="list the zoo, or check that every zoo model converts and pipelines exactly")
    p.add_argument("names", nargs="*", help="zoo names (default: all)")
    p.add_argument("--family", help="only this family, e.g. ResNet, ViT")
    p.add_argument("--check", action="store_true", help="convert and pipeline each model in a small configuration")
    p.set_defaults(run=zoo_cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except SeqifyError as e:
        text = for_cli(str(e))
        hint = ""
        if "example_inputs" in text and getattr(args, "spec", None):
            hint = "\n(on the command line: add --example, with --shape or --size for the input)"
        print(f"seqify: error: {text}{hint}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("seqify: interrupted", file=sys.stderr)
        return 130
    except Exception:  # not a user mistake (those raise SeqifyError): a bug, so show where
        traceback.print_exc()
        print(f"seqify: internal error in 'seqify {args.command}' (a bug: please report it with the traceback "
              "above)", file=sys.stderr)
        return INTERNAL


if __name__ == "__main__":
    sys.exit(main())
