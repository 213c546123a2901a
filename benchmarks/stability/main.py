"""Whether the tuner's cuts and choices stay the same run after run: ResNet-101's layers profiled anew ``--runs``
times on one device, as the tuner profiles them (the whole batch, the smallest micro-batch and each candidate's,
two repeats each), and each profile cut into 2 and 4 partitions by time at each micro-batch count of ``--chunks``,
with the tuner's slack (``seqify.tuning.space.TIME_SLACK``) and with none (the exact optimum); then
``seqify.tune`` run ``--tunes`` times without its cache on ``--devices`` (a GPU named twice pipelines two
partitions on it), each choice printed. A row per cut: the balance of every run and how many distinct ones.

    python benchmarks/stability/main.py --runs 5 --tunes 3 --out stability.jsonl
    python benchmarks/stability/main.py --tiny --device cpu --devices cpu,cpu --runs 2 --tunes 1  # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import seqify
from seqify.partition import split
from seqify.partition.cost import LINK_BANDWIDTH, default_transfer_cost
from seqify.partition.walk import layers as walk_layers
from seqify.tuning import profile, space


def build(tiny: bool) -> tuple[nn.Sequential, torch.Tensor, int]:
    """ResNet-101 converted (a small ResNet with ``tiny``), a batch for it, and that batch's size."""
    from torchvision.models.resnet import Bottleneck, ResNet, resnet101

    torch.manual_seed(0)
    net = ResNet(Bottleneck, [1, 1, 2, 1], num_classes=10) if tiny else resnet101()
    batch, side = (16, 32) if tiny else (256, 224)
    x = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0))
    return seqify.convert(net), x, batch


def cuts(seq: nn.Sequential, x: torch.Tensor, batch: int, device: torch.device, runs: int,
         chunks: list[int], dump: str | None = None) -> list[dict[str, Any]]:
    """Per (partitions, micro-batch count, slack): the balance the tuner's time strategy picks from each of
    ``runs`` fresh profiles; ``dump``: a file to ``torch.save`` every profile's costs per micro-batch count into
    (to study cut rules on real noise without a GPU)."""
    lays = walk_layers(seq)
    found: dict[tuple[int, int, float], list[list[int]]] = {}
    kept: list[dict[int, Any]] = []
    sizes = sorted({batch // c for c in chunks})
    for _ in range(runs):
        layers, hi = profile.layer_model(seq, x, device, lo=min(sizes), sizes=sizes, show=False)
        timed = {m: space._at(hi, layers, batch, m) for m in chunks}
        kept.append({m: dataclasses.asdict(costs) for m, costs in timed.items()})
        for parts in (2, 4):
            for m, costs in timed.items():
                # the tuner's cut by time (at the default link bandwidth), and the exact optimum without its slack
                tuner = space.balances(seq, x, costs, parts, ["time"], LINK_BANDWIDTH)["time"]
                exact = split(costs, parts, lays.names, lays.routes, transfer_cost=default_transfer_cost("time"))
                found.setdefault((parts, m, space.TIME_SLACK), []).append(list(tuner))
                found.setdefault((parts, m, 0.0), []).append(list(exact.balance))
    if dump:
        torch.save(kept, dump)
    return [dict(kind="cut", partitions=p, chunks=m, slack=s, balances=b, distinct=len({tuple(v) for v in b}))
            for (p, m, s), b in found.items()]


def tunes(seq: nn.Sequential, x: torch.Tensor, devices: list[str], times: int) -> dict[str, Any]:
    """``seqify.tune``'s choice ``times`` over, each measured afresh: its step time and the peak allocated and
    reserved GiB per device of its timed step (empty on the CPU)."""
    chosen: list[dict[str, Any]] = []
    configs: set[str] = set()  # the choices without their measurements
    for _ in range(times):
        t0 = time.perf_counter()
        cfg = seqify.tune(seq, x.to(devices[0]), devices=devices, cache=False, show=False)
        text = str(cfg.without_trials())
        configs.add(text.split(";")[0])
        ran = next(t for t in cfg.trials if t.measured_s == cfg.measured_s)  # the choice's timed step
        chosen.append(dict(config=text, seconds=round(time.perf_counter() - t0, 1), step_ms=1e3 * (cfg.measured_s or 0),
                           peak_gib=[round(b / 2**30, 2) for b in ran.measured_peak],
                           reserved_gib=[round(b / 2**30, 2) for b in ran.measured_reserved]))
        print(json.dumps(chosen[-1]), flush=True)
    return dict(kind="tune", devices=devices, choices=chosen, distinct=len(configs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="where the layers are profiled")
    p.add_argument("--devices", default="cuda:0,cuda:0", help="the devices seqify.tune is given, comma-separated")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tunes", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--dump", default=None, help="a file to torch.save each profile's layer costs into")
    p.add_argument("--out", default=None, help="a JSON lines file to write the rows to")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    seq, x, batch = build(args.tiny)
    head = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, seqify=seqify.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", batch=batch,
                command="python benchmarks/stability/main.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    rows = cuts(seq, x.to(device), batch, device, args.runs, args.chunks, args.dump)
    if args.tunes:
        rows.append(tunes(seq, x, args.devices.split(","), args.tunes))
    with open(args.out, "w") if args.out else tempfile.TemporaryFile("w") as f:
        f.write("# environment: " + json.dumps(head) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
