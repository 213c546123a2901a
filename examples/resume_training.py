"""Stop a pipelined training run, save it, and resume it in a new process with another balance, exactly.

    python examples/resume_training.py                                      # ResNet-50, 4 + 4 steps
    python examples/resume_training.py --model resnet18 --size 32 --steps 2   # a quick run on a CPU

The run trains on two CPU partitions under 1F1B with SGD (momentum), a StepLR schedule and random data,
saves with seqify.checkpoint.save (model, optimizer, scheduler, step and random generators, under the source
model's keys), then a fresh Python process builds a pipeline with another balance, loads the checkpoint
and trains on. Its losses and final weights are compared with the run that never stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
import torchvision

import seqify
from seqify import checkpoint


def build(args: argparse.Namespace, balance: str) -> tuple[Any, Any, Any]:
    """A pipeline (balance 'a,b', or 'params'), its optimizer and its scheduler: the same in every process."""
    torch.manual_seed(0)
    source = torchvision.models.get_model(args.model, weights=None, num_classes=10).double()
    seq = seqify.convert(source)
    cut = [int(b) for b in balance.split(",")] if balance != "params" else "params"
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=cut, chunks=2, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01, momentum=0.9)
    return pipe, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)


def train(args: argparse.Namespace, pipe: Any, opt: Any, sched: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 3, args.size, args.size, dtype=torch.float64)  # the data draws from torch's generator
        y = torch.randint(0, 10, (4,))
        opt.zero_grad()
        losses.append(pipe.step(x, y, F.cross_entropy).item())
        opt.step()
        sched.step()
    return losses


def weights(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.model.original_state_dict().items()}


def resume(args: argparse.Namespace) -> None:
    """The new process: another balance, the checkpoint loaded, ``steps`` more steps; results to a file."""
    pipe, opt, sched = build(args, args.balance)
    restored = checkpoint.load(pipe, args.resume, opt, sched)
    print(f"resumed at step {restored.step} on balance {pipe.balance} (saved with {restored.meta['balance']})")
    losses = train(args, pipe, opt, sched, args.steps)
    torch.save({"losses": losses, "weights": weights(pipe)}, os.path.join(args.resume, "..", "resumed.pt"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="torchvision model name")
    p.add_argument("--size", type=int, default=64, help="image side")
    p.add_argument("--steps", type=int, default=4, help="steps before the stop, and after it")
    p.add_argument("--resume", help=argparse.SUPPRESS)  # the child process: the checkpoint folder
    p.add_argument("--balance", default="params", help=argparse.SUPPRESS)  # and its balance
    args = p.parse_args()
    if args.resume:
        return resume(args)

    pipe, opt, sched = build(args, "params")
    balance = ",".join(str(b + d) for b, d in zip(pipe.balance, (-2, 2)))  # the new process cuts elsewhere
    whole = train(args, pipe, opt, sched, 2 * args.steps)
    want = weights(pipe)
    print(f"uninterrupted: {2 * args.steps} steps on balance {pipe.balance}, last loss {whole[-1]:.6f}")

    with tempfile.TemporaryDirectory() as tmp:
        pipe, opt, sched = build(args, "params")
        first = train(args, pipe, opt, sched, args.steps)
        folder = os.path.join(tmp, "ckpt")
        checkpoint.save(pipe, folder, opt, sched, step=args.steps)
        print(f"stopped after {args.steps} steps; saved {sorted(os.listdir(folder))} to {folder}")
        argv = [sys.executable, __file__, "--model", args.model, "--size", str(args.size), "--steps",
                str(args.steps), "--resume", folder]
        subprocess.run([*argv, "--balance", balance], check=True)
        got = torch.load(os.path.join(tmp, "resumed.pt"))
    same_losses = first + got["losses"] == whole
    same_weights = all(torch.equal(got["weights"][k], v) for k, v in want.items())
    print(f"resumed in a new process: losses bit-equal to the uninterrupted run: {same_losses}")
    print(f"final weights bit-equal: {same_weights}")
    if not (same_losses and same_weights):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
