"""The ``seqify`` command: demo, convert, inspect, bench, zoo and run, with exit codes scripts can trust."""


from __future__ import annotations

import argparse
import functools
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from seqify.errors import SeqifyError
from seqify.partition.cost import BY
from seqify.tools.advice import for_cli
from seqify.tools.bench_cmd import bench_cmd
from seqify.tools.demo import demo
from seqify.tools.model_cmds import convert_cmd, inspect_cmd
from seqify.tools.run_cmd import run_cmd
from seqify.tools.tuning_options import add_tune_options
from seqify.tools.zoo_cmd import zoo_cmd

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
  seqify run run.toml                           the pipeline a run file describes, on its [input]

{spec}

exit codes: 0 success; 1 an exactness check failed; 2 usage or input error (bad SPEC, bad option,
a model seqify cannot convert: the message says what to do); 3 an internal error (a bug: please report it).
"""


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

    p.add_argument("spec", metavar="SPEC",
                   help="the model: torchvision:NAME, zoo:NAME, FILE.py:FACTORY or MODULE:FACTORY")
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="keyword argument for the builder (repeatable)")
    p.add_argument("--size", type=POSITIVE,
                   help="input side: a BATCH x 3 x SIZE x SIZE input (default: the model's, else 224)")
    p.add_argument("--batch", type=POSITIVE, default=1, help="batch of the random input")
    p.add_argument("--shape", help="the input's full shape, e.g. 2x3x32x32 (overrides --size and --batch)")
    p.add_argument("--example", action="store_true",
                   help="convert with the input as example_inputs (for shape-dependent Python code)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    p.epilog = SPEC_HELP


class _Given(argparse.Action):
    """Store the value and remember it was given (CPU bench picks smaller defaults otherwise)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _demo_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify demo``: the whole tour on this machine."""
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


def _convert_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify convert SPEC -o FILE``: convert, check and save."""
    p = add("convert", help="convert the model SPEC names, check it and save its weights",
            description="Build the model, convert it, check the conversion on a random input (eval forward "
            "bit-equal; exit code 1 if not) and save the source model's weights under its own keys with how "
            "it was converted (SPEC, --arg values, input shape, layer names): torch.load(FILE) reads it "
            "(weights only); a FILE ending in .safetensors is written as safetensors. Load it back by building "
            "the model, model.load_state_dict(torch.load(FILE)['state_dict']) and seqify.convert(model).")
    _model_options(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="where to save, e.g. model.pt (torch.save) or model.safetensors")
    p.add_argument("--no-check", action="store_true", help="skip the exactness check")
    p.set_defaults(run=convert_cmd)


def _inspect_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify inspect SPEC``: what the conversion made, and a plan."""
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
    add_tune_options(p)
    p.add_argument("--tune", action="store_true", help="also tune a training pipeline for the input (seqify.tune)")
    p.set_defaults(run=inspect_cmd)


def _bench_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify bench [SPEC]``: measured pipelines."""
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
    add_tune_options(p)
    p.add_argument("--alternatives", type=int, default=4, help="with SPEC: rejected candidates to time as well")
    p.add_argument("--plot", metavar="FILE", help="with SPEC: write the predicted/measured plot (PNG and SVG)")
    p.set_defaults(run=bench_cmd, batch_given=False, size_given=False)


def _zoo_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify zoo [NAME ...]``: the zoo."""
    p = add("zoo", help="list the zoo, or check that every zoo model converts and pipelines exactly")
    p.add_argument("names", nargs="*", help="zoo names (default: all)")
    p.add_argument("--family", help="only this family, e.g. ResNet, ViT")
    p.add_argument("--check", action="store_true", help="convert and pipeline each model in a small configuration")
    p.set_defaults(run=zoo_cmd)


def _run_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """``seqify run FILE``: a run file."""
    p = add("run", help="build the pipeline a run file (TOML or JSON) describes and run its [input] through it once")
    p.add_argument("file", metavar="FILE", help="a .toml or .json run file: model, [input], [pipeline] (docs: Run "
                                                "files)")
    p.add_argument("--save-config", metavar="PATH",
                   help="write the pipeline's configuration (the tuner's choice with chunks = \"auto\") to PATH "
                        "(.toml or .json), for seqify.pipeline(model, config=PATH) or, under torchrun, "
                        "seqify.distributed.stage(model, config=PATH)")
    p.set_defaults(run=run_cmd)


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

    for subcommand in (_demo_parser, _convert_parser, _inspect_parser, _bench_parser, _zoo_parser, _run_parser):
        subcommand(add)
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
