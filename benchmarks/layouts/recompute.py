"""What recomputing the 0.89 B Llama's cheap layers in the backward saves on one GPU, and what it costs: the
transformers model trained as main.py's one-GPU row trains it (``--per-gpu`` sequences of 2048, bf16 autocast,
SGD), plain and with ``torch.utils.checkpoint`` around every RMSNorm (``norms``), around each MLP's SiLU and the
product after it (``mlp``), or both. Each row: samples/s, its ratio to the plain row of the same run, the peak
allocated and reserved GiB from the first timed step, and the first step's loss and gradient norm (recomputing
elementwise work changes no value).

    python benchmarks/layouts/recompute.py --per-gpu 4 --out recompute.jsonl
    python benchmarks/layouts/recompute.py --tiny --device cpu          # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

import torch
from main import cast, llama, peaks, reset, timed
from torch import nn
from torch.utils.checkpoint import checkpoint

VARIANTS = ("none", "norms", "mlp", "norms+mlp")


def recomputed(net: nn.Module, variant: str) -> nn.Module:
    """``net`` with the layers ``variant`` names run under a non-reentrant checkpoint (their inputs kept, their
    insides recomputed in the backward)."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    for m in net.modules():
        if "norms" in variant and isinstance(m, LlamaRMSNorm):
            m.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(m.forward)  # type: ignore[method-assign]
        if "mlp" in variant and isinstance(m, LlamaMLP):
            def forward(x: torch.Tensor, m: Any = m) -> torch.Tensor:
                gated = checkpoint(lambda g, u: m.act_fn(g) * u, m.gate_proj(x), m.up_proj(x), use_reentrant=False)
                return m.down_proj(gated)
            m.forward = forward  # type: ignore[method-assign]
    return net


def row(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One variant trained and timed on ``--device``."""
    work = llama(args.tiny)
    dev = torch.device(args.device)
    reset([dev])
    net = recomputed(work.build().to(dev), variant)
    x, y = (t.to(dev) for t in work.data(args.per_gpu))
    opt = work.optimizer(net.parameters())
    first: list[float] = []  # the first step's loss and gradient norm

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with cast(work, dev):
            loss = work.loss(net(x), y)
        loss.backward()
        if not first:
            grads = [p.grad.double().norm() for p in net.parameters() if p.grad is not None]
            first.extend((loss.item(), torch.stack(grads).norm().item()))
        opt.step()

    sec = timed(step, [dev], args.steps, args.warm)
    allocated, reserved, _ = peaks([dev])
    return dict(row=variant, batch=args.per_gpu, samples_per_s=args.per_gpu / sec, peak_gib=allocated,
                reserved_gib=reserved, first_loss=first[0], first_grad_norm=first[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-gpu", type=int, default=4)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    head = dict(model="llama", date=datetime.date.today().isoformat(), torch=torch.__version__,
                device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                command="python benchmarks/layouts/recompute.py " + " ".join(given))
    rows = []
    for variant in args.variants:
        rows.append(row(args, variant))
        base = rows[0]["samples_per_s"]
        rows[-1]["x_first"] = round(rows[-1]["samples_per_s"] / base, 3)
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# environment: " + json.dumps(head) + "\n")
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
