"""``seqify run FILE``: build the pipeline a run file describes and run its input through it."""

from __future__ import annotations

import argparse
import time

import torch

from seqify.tools.console import OK

__all__ = ["run_cmd"]


def run_cmd(args: argparse.Namespace) -> int:
    from seqify.tools.run_file import Config

    config = Config.load(args.file)
    start = time.perf_counter()
    pipe, x = config.build_with_input()
    print(f"built in {time.perf_counter() - start:.2f} s\n{pipe!r}")
    if args.save_config:
        (pipe.config or config.pipeline).to_file(args.save_config)
        print(f"wrote its configuration to {args.save_config}")
    if x is None:
        print("no [input] table: nothing to run (add one to run a forward)")
        return OK
    start = time.perf_counter()
    with torch.no_grad():
        out = pipe(x)
    shapes = [tuple(t.shape) for t in _tensors(out)]
    print(f"forward of an input {tuple(x.shape)} ({x.dtype}): outputs {shapes} in {time.perf_counter() - start:.3f} s")
    return OK


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors in a model's output (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []
