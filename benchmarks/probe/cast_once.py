"""Probe: weights cast once per step under bf16 autocast, against casting in every program, on real models.

    python benchmarks/probe/cast_once.py --out $OUT                  # one or two GPUs
    python benchmarks/probe/cast_once.py --tiny --device cpu         # smoke test

Per model (zoo families, converted as ``seqify bench`` converts them): a 2-partition pipeline with graphs
(both partitions on cuda:0 when there is one GPU), 1F1B, under bf16 autocast, SGD; the same initial weights
and batches with ``ReplayOptions(cast_once=...)`` off and on. Prints whether the losses and every gradient
of the first steps are bit-equal, how many weights each partition casts once, and the step time and peak
allocated / reserved memory of each. ``--control`` runs the first setting twice: a model whose backward
kernels are not deterministic on the GPU (attention's atomics) differs from itself after the first step.
One JSON line per model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from families_pipeline import FAMILIES, _tiny  # noqa: E402

import seqify  # noqa: E402
from seqify import convert
from seqify.tools import spec  # noqa: E402
from seqify.pipe.executors.options import ReplayOptions  # noqa: E402


def loss_fn(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    out = out.logits if hasattr(out, "logits") else out
    return out.float().pow(2).mean()


def run(seq: nn.Module, x: torch.Tensor, devices: list[str], chunks: int, enabled: bool, steps: int,
        timed: int) -> dict:
    options = ReplayOptions(cast_once=enabled)
    try:
        cuda = devices[0].startswith("cuda")
        pipe = seqify.pipeline(seq, devices=devices, balance="params", chunks=chunks, schedule="1f1b",
                               graphs=cuda, checkpoint="never", replay_options=options)
        pipe._replay_eager = not cuda  # the CPU smoke test drives the same programs eagerly
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        losses, grads = [], {}
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for d in {torch.device(d) for d in devices if cuda}:
            torch.cuda.reset_peak_memory_stats(d)
        times = []
        for k in range(steps + timed):
            sync()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16):
                loss = pipe.step(x, x, loss_fn)
            if k < steps:
                losses.append(loss.detach().cpu())  # on the CPU: the next run's peak memory is its own
                grads = {n: p.grad.detach().cpu() for n, p in pipe.named_parameters() if p.grad is not None}
            opt.step()
            sync()
            if k >= steps:
                times.append(time.perf_counter() - start)
        replay = pipe._graphed[1] if pipe._graphed is not None else None
        cast = [len(c) if c is not None else 0 for c in replay.casts] if replay is not None else None
        gib = 2**30
        idx = sorted({torch.device(d).index or 0 for d in devices}) if cuda else []
        return {"losses": losses, "grads": grads, "cast": cast, "graph_error": pipe.graph_error,
                "ms": 1e3 * sorted(times)[len(times) // 2] if times else None,
                "allocated_gib": [round(torch.cuda.max_memory_allocated(i) / gib, 2) for i in idx],
                "reserved_gib": [round(torch.cuda.max_memory_reserved(i) / gib, 2) for i in idx]}
    finally:
        pass  # the option belongs to this run's pipeline: nothing to restore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["GPT-2", "ViT", "ResNet", "ConvNeXt"])
    p.add_argument("--batch", action="append", default=[], metavar="FAMILY=N")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="steps compared bit for bit")
    p.add_argument("--timed", type=int, default=4, help="steps timed after those")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--control", action="store_true",
                   help="compare casting in every program against itself (is the model deterministic here?)")
    p.add_argument("--out")
    args = p.parse_args()
    devices = (["cpu", "cpu"] if args.device == "cpu" else
               ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"])
    batches = {k: int(v) for k, _, v in (b.partition("=") for b in args.batch)}
    for family in args.families:
        name, batch, side, kwargs = FAMILIES[family]
        batch = batches.get(family, batch)
        if args.tiny:
            kwargs, batch, side = _tiny(name, kwargs)
        model = spec.load(f"zoo:{name}", kwargs)
        x = spec.random_input(spec.sample_shape(model, batch, side, None), 0, model.vocab).to(devices[0])
        module = model.module.to(devices[0]).train()
        seq = convert(module, (x[:2],) if model.example else None)
        start = copy.deepcopy(seq.state_dict())
        rows = {}
        for enabled in (False, True):
            seq.load_state_dict(start)
            torch.manual_seed(0)
            rows[enabled] = run(seq, x, devices, args.chunks, enabled and not args.control, args.steps, args.timed)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        a, b = rows[False], rows[True]
        same_loss = all(torch.equal(u, v) for u, v in zip(a["losses"], b["losses"]))
        differ = [n for n, g in a["grads"].items() if not torch.equal(g, b["grads"][n])]
        row = {"family": family, "model": name, "batch": batch, "chunks": args.chunks, "devices": devices,
               "control": args.control, "cast_per_partition": b["cast"], "losses_bit_equal": same_loss,
               "first_loss_bit_equal": bool(torch.equal(a["losses"][0], b["losses"][0])),
               "losses": [[float(v) for v in a["losses"]], [float(v) for v in b["losses"]]], "grads_differing": differ[:5],
               "grads_compared": len(a["grads"]), "ms_per_micro_batch_casts": a["ms"], "ms_cast_once": b["ms"],
               "allocated_gib": [a["allocated_gib"], b["allocated_gib"]],
               "reserved_gib": [a["reserved_gib"], b["reserved_gib"]],
               "graph_error": [a["graph_error"] and a["graph_error"].splitlines()[-1],
                               b["graph_error"] and b["graph_error"].splitlines()[-1]]}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(os.path.join(args.out, "cast-once.jsonl"), "a") as f:
                f.write(line + "\n")
        del seq, module, model, x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
