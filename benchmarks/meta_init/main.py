"""Peak memory per torchrun rank staging a large model: built whole on every rank, or on the meta device with
each rank filling only its partitions from a checkpoint (``seqify.distributed.stage(..., weights=)``).

    python benchmarks/meta_init/main.py --write CKPT            # once: the checkpoint (the whole model, one process)
    torchrun --nproc-per-node 2 benchmarks/meta_init/main.py --weights CKPT            # meta build, per-rank share
    torchrun --nproc-per-node 2 benchmarks/meta_init/main.py --weights CKPT --real     # every rank builds it whole
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import seqify
import seqify.distributed as sd


class Stack(nn.Module):
    """``layers`` square Linear layers of ``width``: weights dominate memory."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def peak_mib() -> float:
    """This process's peak resident memory so far (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--write", help="write the checkpoint folder of a seeded model here and exit")
    p.add_argument("--weights", help="the checkpoint folder (or safetensors file) each rank reads")
    p.add_argument("--real", action="store_true", help="every rank builds the whole model (the usual way)")
    args = p.parse_args()
    if args.write:
        torch.manual_seed(0)
        seqify.checkpoint.save(Stack(args.layers, args.width), args.write, rng_state=False)
        return
    torch.set_num_threads(1)
    sd.init()
    from seqify.checkpoint import store  # noqa: F401  (torch.distributed.checkpoint: an import, not the model's memory)

    before = peak_mib()
    whole = args.layers * args.width * args.width * 4 / 2**20
    if args.real:
        stage = sd.stage(Stack(args.layers, args.width), balance="params")
    else:
        with torch.device("meta"):
            model = Stack(args.layers, args.width)
        stage = sd.stage(model, balance="params", weights=args.weights)
    mine = sum(t.numel() * t.element_size() for t in stage.parameters()) / 2**20
    row = {"rank": torch.distributed.get_rank(), "build": "real" if args.real else "meta", "model_mib": round(whole),
           "own_mib": round(mine), "peak_growth_mib": round(peak_mib() - before)}
    print(json.dumps(row), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
