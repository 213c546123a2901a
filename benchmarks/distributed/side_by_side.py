"""One table from the rows of one machine's run: the in-process pipeline (benchmarks/two_gpus/main.py, whose
'single' row is the one-GPU baseline), seqify.distributed (benchmarks/distributed/main.py) and
torch.distributed.pipelining (benchmarks/two_gpus/torchpp.py), each ratio to the one-GPU row of its work and
precision ('single', 'single-bf16'; inference rows to 'infer-single', 'infer-single-bf16'), with memory per GPU.

    python benchmarks/distributed/side_by_side.py OUT/pipeline_bench_fp32.json OUT/distributed.json OUT/torchpp.json

benchmarks/distributed/README.md gives the three commands that write those files.
"""
from __future__ import annotations

import json
import sys
from typing import Any


def rows_of(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # a step that timed out wrote nothing: say so in its place
        return [{"name": path, "error": f"no rows ({type(e).__name__})"}]
    return data if isinstance(data, list) else data.get("rows", [])


def cells(values: Any) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "-"


def table(paths: list[str]) -> str:
    rows = [(path, r) for path in paths for r in rows_of(path)]
    # each row against the one-GPU row of its own precision ('single', 'single-bf16')
    base = {kind + tag: next((r["samples_per_s"] for _, r in rows if r.get("name") == kind + tag and "samples_per_s" in r),
                             None)
            for kind in ("single", "infer-single") for tag in ("", "-bf16")}
    lines = [f"{'configuration':<48} {'samples/s':>10} {'x one GPU':>10}  {'allocated GiB':>14}  {'reserved GiB':>14}",
             "-" * 104]
    for path, r in rows:
        if "samples_per_s" not in r:
            lines.append(f"{r.get('name', '?'):<48} {r.get('error', 'no result')}")
            continue
        one = base[("infer-single" if r["name"].startswith("infer-") else "single")
                   + ("-bf16" if r["name"].endswith("-bf16") else "")]
        ratio = f"{r['samples_per_s'] / one:.3f}" if one else "-"
        allocated = r.get("peak_allocated_gib") or r.get("peak_gib")
        reserved = r.get("reserved_gib") or (r.get("peak_gib") if "peak_allocated_gib" in r else None)
        lines.append(f"{r['name']:<48} {r['samples_per_s']:>10.1f} {ratio:>10}  {cells(allocated):>14}  {cells(reserved):>14}")
    if not any(base.values()):
        lines.append("(no 'single' row: ratios need the one-GPU baseline of the same run)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
