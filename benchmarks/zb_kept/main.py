"""What a zero-bubble B keeps for W, on the CPU, for the configurations a GPU families run chose.

    python benchmarks/zb_kept/main.py benchmarks/zb_kept/results/families-input.jsonl FCN VGG RegNet
    python benchmarks/zb_kept/main.py benchmarks/zb_kept/results/families-input.jsonl GPT-2 --no-check

For each family's chosen ZB-H1 configuration (model, batch, balance, loops, chunks from the JSONL rows of
benchmarks/families/main.py), on one micro-batch on the CPU: per partition, the bytes pipe.plan_memory now counts
as kept for W (its weighted layers' outputs) beside the gradients dist_backward.input_grads actually keeps
(the first partition's B computes nothing and keeps nothing); then the plan's per-device peak with and
without that term, and the GPU run's predicted peak plus the difference, beside what the GPU measured.
Bytes do not depend on the device; this probe times nothing. ``--no-check`` leaves out the input_grads
check (GPT-2's split backward at its micro-batch of 4 x 1024 tokens outgrows a 23 GiB CPU machine).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import torch

from seqify import convert, pipeline
from seqify.tools import spec
from seqify.pipe.split_backward import input_grads
from seqify.pipe import memory
from seqify.schedule.actions import make, round_robin, v_shape

GIB = 2**30


def split_kept(stages: list[Any], x: Any) -> list[int | None]:
    """Bytes input_grads keeps for W per partition (None where it falls back to walking the graph again)."""
    out: list[int | None] = []
    pending: dict[Any, Any] = {}
    for stage in stages:
        skips = {k: pending.pop(k) for k in stage.pops}
        skips = {k: v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                 for k, v in skips.items()}
        wants = stage is not stages[0]
        if isinstance(x, torch.Tensor):
            x = x.detach().requires_grad_(wants and x.is_floating_point())
        with torch.enable_grad():
            y, made = stage.fresh(x, skips)
        ins = [t for t in [x, *skips.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
        outs = [t for t in [y, *made.values()] if isinstance(t, torch.Tensor) and t.requires_grad]
        kept: int | None = 0
        if ins:
            groups = input_grads(outs, [torch.ones_like(o) for o in outs], ins, list(stage.layers.parameters()))[2].groups
            grads = {id(g): g for group in groups or [] for gs in group["grads"] for g in gs if isinstance(g, torch.Tensor)}
            kept = sum(g.numel() * g.element_size() for g in grads.values()) if groups is not None else None
        out.append(kept)
        pending.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in made.items()})
        x = y.detach() if isinstance(y, torch.Tensor) else y
    return out


def probe(row: dict[str, Any], check: bool) -> dict[str, Any]:
    c = row["config"]
    model = spec.load(f"zoo:{row['model']}", {"preset": "124m"} if row["family"] == "GPT-2" else {})
    micro = row["batch"] // c["chunks"]
    x = spec.random_input(spec.sample_shape(model, micro, row["side"], None), 0, model.vocab)
    seq = convert(model.module, (x[:2],) if model.example else None)
    pipe = pipeline(seq, devices=["cpu", "cpu"], balance=c["balance"], loops=c["loops"], chunks=1)
    parts = memory.measure(pipe.stages, x)
    slots = v_shape(2) if c["loops"] == 2 else round_robin(2, c["loops"])
    schedule = make("zb-h1", slots, c["chunks"])
    with_kept = memory.predict(parts, schedule, "never").per_device
    without = memory.predict([replace(p, kept=0) for p in parts], schedule, "never").per_device
    gpu = [p + a - b for p, a, b in zip(c["memory_per_device"], with_kept, without)]
    return {"family": row["family"], "placement": list(slots),
            "kept_counted_gib": [round(p.kept / GIB, 2) for p in parts],
            "kept_by_input_grads_gib": ([None if k is None else round(k / GIB, 2) for k in split_kept(pipe.stages, x)]
                                        if check else "not checked"),
            "gpu_predicted_gib": [round(v / GIB, 2) for v in c["memory_per_device"]],
            "gpu_predicted_with_kept_gib": [round(v / GIB, 2) for v in gpu],
            "gpu_measured_allocated_gib": row["allocated_gib"], "gpu_measured_reserved_gib": row["reserved_gib"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", help="a JSONL file of benchmarks/families/main.py")
    p.add_argument("families", nargs="*", help="only these families (default: every ZB-H1 choice)")
    p.add_argument("--no-check", action="store_true", help="do not run input_grads beside the count")
    args = p.parse_args()
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if row.get("schedule") == "zb-h1" and (not args.families or row["family"] in args.families):
            print(json.dumps(probe(row, not args.no_check)), flush=True)


if __name__ == "__main__":
    main()
