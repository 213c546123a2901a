"""The commands on one model SPEC, ``seqify convert`` and ``seqify inspect``: load the SPEC, convert it, check
it, save it or show what the conversion made."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from seqify._version import __version__
from seqify.convert import convert
from seqify.convert.verify import bit_equal
from seqify.errors import BalanceError, SampleError, SeqifyError, SpecError, UntraceableError
from seqify.tools.advice import DATA_DEPENDENT, costs_depend_on_data, data_dependent_advice, for_cli
from seqify.tools.console import NOT_EXACT, OK, section
from seqify.tools.tuning_options import tune_for

__all__ = ["load", "convert_spec", "converted_record", "convert_cmd", "inspect_cmd"]

def load(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
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


def convert_spec(module: torch.nn.Module, x: torch.Tensor, example: bool) -> Any:
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
    ok = bit_equal(got, want)
    print(f"eval forward on a random {'x'.join(map(str, x.shape))} input bit-equal to the source: {ok}")
    return ok


FORMAT = "seqify.convert/1"


def converted_record(args: argparse.Namespace, seq: Any, x: torch.Tensor, example: bool) -> dict[str, Any]:
    """What ``convert -o`` saves: the source model's state under its own keys and how the conversion was made,
    as plain values and tensors that ``torch.load(path)`` (weights only) reads."""
    return {
        "format": FORMAT,
        "seqify": __version__,
        "spec": args.spec,
        "args": list(args.arg or []),
        "input_shape": list(x.shape),
        "input_dtype": str(x.dtype).removeprefix("torch."),
        "example": example,
        "seed": args.seed,
        "source": seq.source,
        "frontend": seq.frontend,
        "layers": [name for name, _ in seq.named_layers()],
        "state_dict": seq.original_state_dict(),
    }


def _save(record: dict[str, Any], seq: Any, out: str) -> None:
    """``record`` to ``out``: a safetensors file (the rest of the record in its header) for a ``.safetensors``
    path, else ``torch.save`` of the record."""
    if out.endswith(".safetensors"):
        from seqify.checkpoint import export

        header = {k: json.dumps(v) for k, v in record.items() if k not in ("state_dict", "format")}
        header["convert"] = FORMAT  # the header's "format" is the export's
        export(seq, out, metadata=header)
    else:
        torch.save(record, out)


def convert_cmd(args: argparse.Namespace) -> int:
    model, x = load(args)
    example = bool(args.example or model.example)
    seq = convert_spec(model.module, x, example)
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
    _save(converted_record(args, seq, x, example), seq, out)
    how = (f"seqify.checkpoint.load_exported({out!r})" if out.endswith(".safetensors")
           else f"torch.load({out!r})['state_dict']")
    print(f"saved to {out} ({os.path.getsize(out) / 2**20:.1f} MB): the source model's weights under its own keys "
          f"and how it was converted. Load them back: build the model, model.load_state_dict({how}), then "
          f"seqify.convert(model{', example_inputs=...' if example else ''})")
    return OK


def _describe(layer: torch.nn.Module) -> str:
    from seqify.model.layer import Layer

    text = layer.extra_repr() if isinstance(layer, Layer) else repr(layer)
    text = " ".join(text.split())
    return text if len(text) <= 70 else text[:67] + "..."


def inspect_cmd(args: argparse.Namespace) -> int:
    model, x = load(args)
    seq = convert_spec(model.module, x, args.example or model.example)
    print(for_cli(seq.summary()))
    plan = None
    if args.stages:
        plan = _plan(seq, args, x)
    if not args.no_layers:
        section(f"layers ({len(seq)})")
        part_of = [str(j) for j, n in enumerate(plan.balance) for _ in range(n)] if plan else []
        rows: list[tuple[str, ...]] = [("#", "stage", "name", "type", "params", "what")]
        # by index, as the plan counts: a module used twice (ResNet's shared ReLU) is two layers, which
        # named_children() would list once
        for i, (name, layer) in enumerate(seq._modules.items()):
            params = sum(p.numel() for p in layer.parameters())
            stage = part_of[i] if plan else ""
            rows.append((str(i), stage, name, type(layer).__name__, f"{params:,}", _describe(layer)))
        if plan is None:  # no stage column
            rows = [(r[0], *r[2:]) for r in rows]
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    section(f"skips ({len(seq.skips)}): name: stashing layer -> popping layer")
    for s in seq.skips:
        print(f"  {s}")
    if not seq.skips:
        print("  none: a plain chain")
    section(f"opaque layers ({len(seq.opaque)})")
    for o in seq.opaque:
        print(f"  {for_cli(str(o))}")
    if not seq.opaque:
        print("  none: every module was split into layers")
    if seq.guards:
        section("valid for inputs where")
        for g in seq.guards:
            print(f"  {g}")
    if plan is not None:
        section(f"partition plan for {'x'.join(map(str, x.shape))}")
        print(plan)
        print(f"use it: seqify.pipeline(seq, gpus={args.stages}, balance={plan.balance}, chunks=...)")
    if args.tune:
        section(f"tuned pipeline for {'x'.join(map(str, x.shape))}")
        print(tune_for(seq, x, args))
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
        print(f"note: {for_cli(str(e)).split('; balance')[0]}; balancing by measured time on "
              f"{args.device or 'cpu'} instead "
              "(--by time)", flush=True)
        return balance(seq, args.stages, x, by="time", device=args.device)
