"""What a layout row of main.py leaves on the GPU once it returns: the rows ``--layouts`` names run one after
another in one process (as main.py runs them), and after each, with garbage collected: the bytes still allocated
per pool, the CUDA tensors Python can still reach, the seqify objects still alive and, for each of those kinds,
the chain of objects that keeps one alive.

    python benchmarks/layouts/leftovers.py --model llama --per-gpu 4 --layouts 1x1:gpipe:1:graphs 1x1:gpipe:1
    python benchmarks/layouts/leftovers.py --tiny --layouts 1x1:gpipe:1:graphs 1x1:gpipe:1:graphs
    python benchmarks/layouts/leftovers.py --tiny --device cpu --layouts 1x1:gpipe:1
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import types
from typing import Any

import torch
from main import GIB, devices_of, layout_row, workload

import seqify  # noqa: F401  (the package whose objects are looked for)

SKIP = (types.FrameType,)


def pools(device: int) -> dict[str, float]:
    """GiB allocated and reserved on ``device``, in the default pool and in CUDA graphs' private pools."""
    out = collections.Counter[str]()
    if not torch.cuda.is_available():
        return {}
    for s in torch.cuda.memory_snapshot():
        if s["device"] == device:
            kind = "private" if tuple(s["segment_pool_id"]) != (0, 0) else "default"
            out[f"{kind}_allocated_gib"] += s["allocated_size"] / GIB
            out[f"{kind}_reserved_gib"] += s["total_size"] / GIB
    return {k: round(v, 3) for k, v in out.items()}


def cuda_storages() -> dict[int, torch.Tensor]:
    """The CUDA tensors the garbage collector tracks, one per storage (a parameter where one has it)."""
    by: dict[int, torch.Tensor] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                ptr = o.untyped_storage().data_ptr()
                if ptr not in by or isinstance(o, torch.nn.Parameter):
                    by[ptr] = o
        except Exception:  # noqa: BLE001 - tensors without storage (meta, fake)
            continue
    return by


def reachable_cuda() -> dict[str, Any]:
    """How many CUDA storages Python reaches, and their GiB."""
    sizes = [t.untyped_storage().nbytes() for t in cuda_storages().values()]
    return dict(tensors=len(sizes), gib=round(sum(sizes) / GIB, 3))


def largest(n: int) -> list[torch.Tensor]:
    """The ``n`` largest CUDA tensors the garbage collector tracks, one per storage, a parameter first."""
    ranked = sorted(cuda_storages().values(), key=lambda t: -t.untyped_storage().nbytes())
    params = [t for t in ranked if isinstance(t, torch.nn.Parameter)][:1]
    return params + [t for t in ranked if not isinstance(t, torch.nn.Parameter)][: n - len(params)]


def ours() -> collections.Counter[str]:
    """Live objects of seqify's classes, by class."""
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()
                               if str(getattr(type(o), "__module__", "")).startswith("seqify."))


def describe(o: Any) -> str:
    if isinstance(o, dict):
        return f"dict({len(o)} keys: {list(o)[:4]})"
    if isinstance(o, (list, tuple, set)):
        return f"{type(o).__name__}(len {len(o)})"
    if isinstance(o, types.CellType):
        return "cell"
    if isinstance(o, types.FunctionType):
        return f"function {o.__module__}.{o.__qualname__}"
    if isinstance(o, types.ModuleType):
        return f"module {o.__name__}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def holders(target: Any, depth: int, ignore: set[int], limit: int = 12) -> list[str]:
    """The chains of referrers that keep ``target`` alive, breadth first up to ``depth`` links, each ending at a
    module's globals or at an object no Python object refers to (held from C++). ``ignore``: ids of the caller's
    own containers."""
    objs: dict[int, Any] = {id(target): target}
    parent: dict[int, int | None] = {id(target): None}
    mine = {id(objs), id(parent)} | ignore
    frontier, ends = [id(target)], []
    for _ in range(depth):
        nxt: list[int] = []
        for i in frontier:
            found = gc.get_referrers(objs[i])
            mine.add(id(found))
            refs = [r for r in found if id(r) not in mine and not isinstance(r, SKIP)]
            del found
            if not refs or any(isinstance(r, dict) and "__builtins__" in r for r in refs):
                ends.append(i)
            for r in refs:
                if id(r) not in parent:
                    parent[id(r)], objs[id(r)] = i, r
                    nxt.append(id(r))
            del refs
        frontier = nxt
    out = []
    for i in [*ends, *frontier][:limit]:
        chain: list[str] = []
        k: int | None = i
        while k is not None:
            chain.append(describe(objs[k]))
            k = parent[k]
        out.append(" <- ".join(reversed(chain)) + (" <- (module globals or C++)" if i in ends else " <- ..."))
    return out


def report(name: str, depth: int) -> dict[str, Any]:
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    alive = ours()
    found: dict[str, list[str]] = {}
    wanted = ("Replay", "Pipeline", "ReplicatedPipeline", "Program", "GradViews", "Stage", "Tracer")
    for kind in [k for k in alive if k.rsplit(".", 1)[-1] in wanted]:
        obj = next(o for o in gc.get_objects() if f"{type(o).__module__}.{type(o).__qualname__}" == kind)
        found[kind] = holders(obj, depth, {id(alive), id(found)})
        del obj
    graphs = sum(isinstance(o, torch.cuda.CUDAGraph) for o in gc.get_objects()) if cuda else 0
    tops = largest(3)
    mine = {id(alive), id(found), id(tops)}
    found.update({f"{type(t).__name__} {tuple(t.shape)} {t.dtype}": holders(t, depth, mine) for t in tops})
    del tops
    allocated = round(torch.cuda.memory_allocated() / GIB, 3) if cuda else None
    return dict(after=name, cuda_graphs=graphs, allocated_gib=allocated, **pools(0),
                python_reaches=reachable_cuda(), seqify_objects=dict(alive.most_common(25)), holders=found)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet101", "llama", "llama8b"], default="llama")
    p.add_argument("--per-gpu", type=int, default=4)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: the objects still alive and their holders (no pools, no "
                   "graphs)")
    p.add_argument("--out", default=None, help="a JSON lines file to append the reports to")
    args = p.parse_args(argv)
    args.gpus = 1
    work = workload(args.model, args.tiny)
    devices = devices_of(args.device, 1)
    for spec in args.layouts:
        row = layout_row(args, work, devices, spec)
        assert row is not None
        got = dict(row=row["row"], peak_gib=row["peak_gib"], in_use_gib=row["in_use_gib"],
                   alive_before_gib=row["alive_before_gib"], **report(row["row"], args.depth))
        print(json.dumps(got, indent=1), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(got) + "\n")


if __name__ == "__main__":
    sys.exit(main())
