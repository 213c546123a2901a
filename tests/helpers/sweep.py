"""Sweep harness: convert a model the way a new user would and check it against its source, one line per model.

Each check builds the model from a tiny config (no download), converts it with ``frontend="auto"`` and the
example inputs (self-checked), then checks: eval forward bit-equal, a batch one larger (dynamic batch), a 2-stage
CPU pipeline over 2 micro-batches equal to the source run per micro-batch, a conversion on the example's first
sample alone run on a batch of three, train forward bit-equal with gradients allclose 1e-5, and that the source
was left alone. A failure is reported with its stage and first line.
"""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify
from helpers.exactness import assert_exact

Built = tuple[nn.Module, dict[str, Any]]


def bigger(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A batch one larger: every tensor (nested ones too, e.g. diffusers' ``added_cond_kwargs``) grows by one."""
    return pytree.tree_map(lambda v: torch.cat([v, v[:1]]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v,
                           kwargs)


def seeded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` run from the same RNG state each time: models that draw (ViTMAE's masking noise) compare equal."""
    torch.manual_seed(1)
    return fn(*args, **kwargs)


def two_stages(seq: seqify.Sequential) -> list[int]:
    layers = list(seq._modules.values())
    owned = [{id(p) for p in layer.parameters()} for layer in layers]
    # a cut near the middle that no shared parameter crosses; else the middle: seqify.pipeline ties a parameter
    # that layers of two stages use (an LM head tied to the token embedding)
    n = len(layers)
    cuts = [k for k in range(max(1, n // 4), max(2, n - n // 4))
            if not set().union(*owned[:k]) & set().union(*owned[k:])]
    k = min(cuts, key=lambda c: abs(c - n // 2)) if cuts else n // 2
    return [k, n - k]


def by_micro_batch(model: nn.Module, kwargs: dict[str, Any], chunks: int) -> Any:
    torch.manual_seed(1)
    outs = [model(**pytree.tree_map(lambda v: v.chunk(chunks)[i] if isinstance(v, torch.Tensor) and v.dim() > 0
                                    else v, kwargs)) for i in range(chunks)]
    leaves = [pytree.tree_flatten(o) for o in outs]
    joined = [torch.cat(xs) if isinstance(xs[0], torch.Tensor) else xs[0] for xs in zip(*(lv for lv, _ in leaves))]
    return pytree.tree_unflatten(joined, leaves[0][1])


def equal(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def check(name: str, build: Callable[[], Built], *, pipeline: bool = True, one_sample: bool = True) -> dict[str, Any]:
    """Run every check on one model; return a row (``ok`` or the failing ``stage`` and ``error``). Without
    ``one_sample``, the conversion from the example's first sample is left out (a third export)."""
    row: dict[str, Any] = {"model": name}
    stage = "build"
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model, kwargs = build()
        for m in model.modules():
            # in-place dropout after a softmax (timm's TNT) breaks the source's own backward once p > 0
            if isinstance(m, nn.Dropout) and not m.inplace:
                m.p = 0.25
        stage = "convert+eval"
        seq = assert_exact(model, (), kwargs=kwargs, train=False,
                           convert=lambda m: seqify.convert(m, example_inputs=kwargs))
        row["frontend"], row["layers"], row["opaque"] = seq.frontend, len(seq), len(seq.opaque)
        stage = "bigger batch"
        with torch.no_grad():
            assert equal(seeded(seq, **bigger(kwargs)), seeded(model, **bigger(kwargs))), "batch + 1 differs"
        if pipeline:
            stage = "pipeline"
            with torch.no_grad():
                pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=two_stages(seq), chunks=2)
                assert equal(seeded(pipe, **kwargs), by_micro_batch(model, kwargs, 2)), "pipeline differs"
        if one_sample:
            stage = "one-sample example"
            _one_sample(model, kwargs)
        stage = "train"
        again = seq.train() if not seq.mode_dependent else None
        assert_exact(model, (), kwargs=kwargs, train=True, convert=lambda m: again or seqify.convert(
            m, example_inputs=kwargs, check_modes=False))
        row["ok"] = True
    except Exception as e:
        row["ok"] = False
        row["stage"] = stage
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
        row["seqify_error"] = isinstance(e, seqify.SeqifyError)
        row["trace"] = traceback.format_exc()[-3000:]
    row["s"] = round(time.perf_counter() - start, 1)
    return row


def _one_sample(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Converted from the example's first sample (how people trace), the model runs a batch of three exactly.
    Whether the graph depends on the mode was found by the first conversion: not again (finding out exports
    the model a second time, in the other mode)."""
    one = pytree.tree_map(lambda v: v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v, kwargs)
    small = seqify.convert(model, example_inputs=one, check_modes=False)
    with torch.no_grad():
        assert equal(seeded(small, **bigger(kwargs)), seeded(model, **bigger(kwargs))), "batch 3 differs"


def main(registry: dict[str, Callable[[], Built]], argv: list[str] | None = None) -> int:
    """Run the checks of ``registry`` (names on the command line pick some); print one line per model. A builder
    with ``pipeline = False`` skips the pipeline check (a scalar loss from labels= has no batch to gather)."""
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*")
    p.add_argument("--trace", action="store_true", help="print the traceback of each failure")
    p.add_argument("--out", help="JSON rows here")
    args = p.parse_args(argv)
    rows = []
    for name in args.names or list(registry):
        row = check(name, registry[name], pipeline=getattr(registry[name], "pipeline", True))
        rows.append(row)
        status = "ok  " if row["ok"] else "FAIL"
        detail = "" if row["ok"] else f"[{row['stage']}] {row['error']}"
        print(f"{status} {name:40s} {row.get('frontend', ''):10s} {row['s']:6.1f}s {detail}", flush=True)
        if args.trace and not row["ok"]:
            print(row["trace"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{sum(r['ok'] for r in rows)} / {len(rows)} pass")
    return 0
