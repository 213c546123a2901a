"""The zoo table: parameters, layers, skips and recommended balances of every model, as markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqify.progress import progress
from seqify.zoo.catalog import ENTRIES
from seqify.zoo.plans import GPUS, HINTS_FILE, facts, plan, versions

__all__ = ["rows", "markdown", "write_hints"]


def rows(names: Sequence[str] | None = None, *, show: bool = True) -> list[dict[str, Any]]:
    """One row per zoo model in its default configuration: facts from its conversion and the by-FLOPs
    plans for 2, 4 and 8 GPUs (a progress bar on stderr while it works, if ``show``)."""
    names = list(ENTRIES) if names is None else list(names)
    out = []
    for name in progress(names, len(names), desc="zoo: converting and planning", enabled=show):
        e = ENTRIES[name]
        f = facts(name)
        plans = {g: plan(name, g) for g in GPUS if g <= f.layers}
        out.append(
            {
                "name": name,
                "family": e.family,
                "source": e.source,
                "task": e.task,
                "input": (f"{f.batch}x{f.size} token ids" if e.tokens
                          else f"{f.batch}x{e.in_channels}x{f.size}x{f.size}"),
                "params": f.params,
                "layers": f.layers,
                "skips": f.skips,
                "opaque": f.opaque,
                "signature": f.signature,
                "balance": {str(g): p.balance for g, p in plans.items()},
                "imbalance": {str(g): round(p.imbalance, 3) for g, p in plans.items()},
            }
        )
    return out


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def markdown(table: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (balance lists, with the plan's imbalance in parentheses)."""
    head = "| model | source | params | layers | skips | input | 2 GPUs | 4 GPUs | 8 GPUs |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in table:
        cells = []
        for g in map(str, GPUS):
            b = r["balance"].get(g)
            cells.append(f"`{b}` ({r['imbalance'][g]:.2f})" if b else "-")
        opaque = f", {r['opaque']} opaque" if r["opaque"] else ""
        lines.append(
            f"| {r['name']} | `{r['source']}` | {_params(r['params'])} | {r['layers']}{opaque} | {r['skips']} | "
            f"{r['input']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def write_hints(table: list[dict[str, Any]], path: Path = HINTS_FILE) -> None:
    """Cache the plans for ``seqify.zoo.hints`` (keyed by the torch and torchvision that computed them)."""
    doc = {
        **versions(),
        "by": "flops",
        "sample": "batch 1 (2 where BatchNorm needs it) of each model's default input",
        # Models of optional extras (transformers) depend on their versions too: their hints are computed.
        "models": {
            r["name"]: {k: r[k] for k in ("layers", "skips", "params", "signature", "balance", "imbalance")}
            for r in table
            if not ENTRIES[r["name"]].extra
        },
    }
    head = json.dumps({k: v for k, v in doc.items() if k != "models"})[:-1]
    rows: dict[str, Any] = doc["models"]  # type: ignore[assignment]
    models = ",\n".join(f"  {json.dumps(name)}: {json.dumps(row)}" for name, row in rows.items())
    path.write_text(f'{head}, "models": {{\n{models}\n}}}}\n')  # one model per line
