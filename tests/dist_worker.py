"""One rank of a distributed pipeline test: run one training step, save loss and gradients (torchrun)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import torchvision

import seqify
import seqify.distributed as sd


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    return seqify.zoo.unet(depth=3, blocks=1, channels=4, out_channels=2)


def data(name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "resnet18":
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randn(batch, 2, 16, 16, generator=g)


def loss_fn(name: str):  # type: ignore[no-untyped-def]
    return F.cross_entropy if name == "resnet18" else F.mse_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--balance", default="params")
    p.add_argument("--stages", type=int, default=0)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--checkpoint", default="never")
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--schedule", default="gpipe")
    args = p.parse_args()
    if args.backend == "nccl":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
    sd.init(args.backend, timeout_s=60)
    rank = torch.distributed.get_rank()
    model = build(args.model).train()
    seq = seqify.convert(model)
    if args.balance in ("params", "flops"):
        balance: list[int] | str = args.balance
    else:
        balance = [int(b) for b in args.balance.split(",")]
    stage = sd.stage(seq, balance=balance, chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule,
                     sample=torch.randn(2, 3, 32, 32) if args.balance == "flops" else None)
    if rank == args.fail_rank:
        raise RuntimeError(f"planned failure on rank {rank}")
    x, y = data(args.model, args.batch)
    if args.backend == "nccl":
        x, y = x.to(stage.device), y.to(stage.device)
    shard = slice(stage.replica * args.batch // stage.replicas, (stage.replica + 1) * args.batch // stage.replicas)
    loss = stage.step(x[shard] if stage.is_first else None, y[shard] if stage.is_last else None,
                      loss_fn=loss_fn(args.model))
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[id(p)]: p.grad.detach().cpu().clone() for p in stage.partition.parameters() if p.grad is not None}
    with torch.no_grad():
        out = stage(x[shard]) if stage.is_first else stage()
    loss = None if loss is None else loss.cpu()
    out = None if out is None else out.cpu()
    torch.save({"loss": loss, "grads": grads, "replica": stage.replica, "stage": stage.index,
                "balance": stage.balance, "output": out}, os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
