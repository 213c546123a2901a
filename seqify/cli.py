"""The ``seqify`` command: ``seqify demo`` converts a real net and proves the result exact."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence

import torch

from .convert import convert
from .errors import SeqifyError

__all__ = ["main"]


def _bit_equal(a: object, b: object) -> bool:
    la = torch.utils._pytree.tree_leaves(a)
    lb = torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def demo(args: argparse.Namespace) -> int:
    import torchvision

    torch.manual_seed(args.seed)
    print(f"seqify demo: torchvision {args.model}, batch {args.batch}x3x{args.size}x{args.size}, CPU", flush=True)
    model = torchvision.models.get_model(args.model, weights=None)
    reference = copy.deepcopy(model)

    start = time.perf_counter()
    seq = convert(model)
    took = time.perf_counter() - start
    print(f"\nconverted in {took:.2f} s")
    print(seq.summary())
    shown = seq.skips[: args.show]
    if shown:
        print(f"first {len(shown)} of {len(seq.skips)} skips (name: stashing layer -> popping layer):")
        for s in shown:
            print(f"  {s}")
    names = list(seq._modules)
    print(f"layers: {', '.join(names[:6])}, ..., {', '.join(names[-3:])}")

    x = torch.randn(args.batch, 3, args.size, args.size)
    print("\nchecking exactness against the source model:")
    model.eval()
    reference.eval()
    with torch.no_grad():
        ok_eval = _bit_equal(seq(x), reference(x))
    print(f"  eval forward bit-equal (torch.equal):      {ok_eval}")

    model.train()
    reference.train()
    seq.train()
    torch.manual_seed(1)
    out_ref = reference(x)
    out_ref.square().mean().backward()
    torch.manual_seed(1)
    out_seq = seq(x)
    out_seq.square().mean().backward()
    ok_train = _bit_equal(out_seq, out_ref)
    grads = dict(reference.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
    ok_grad = all(
        torch.allclose(p.grad, grads[n].grad, rtol=1e-5, atol=1e-5) for n, p in model.named_parameters()
    )
    ref_buffers = dict(reference.named_buffers())
    ok_bn = all(torch.equal(b, ref_buffers[n]) for n, b in model.named_buffers())
    print(f"  train forward bit-equal:                   {ok_train}")
    print(f"  parameter gradients allclose(1e-5):        {ok_grad} (largest difference {worst:.1e})")
    print(f"  BatchNorm running statistics identical:    {ok_bn}")
    ok = ok_eval and ok_train and ok_grad and ok_bn
    print("\nexact: yes" if ok else "\nexact: NO")
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seqify",
        description="Turn PyTorch nets into exact, pipeline-ready nn.Sequentials.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="convert torchvision's resnet101 on the CPU and prove the result exact",
        description="Convert a torchvision model, print what the conversion made, and check it against "
        "the source on a random batch: eval and train forward bit-equal, gradients, BatchNorm statistics.",
    )
    p.add_argument("--model", default="resnet101", help="a torchvision classification model name (default: resnet101)")
    p.add_argument("--batch", type=int, default=2, help="batch size of the random batch (default: 2)")
    p.add_argument("--size", type=int, default=224, help="image side (default: 224)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=5, help="how many skips to list (default: 5)")
    p.set_defaults(run=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except SeqifyError as e:
        print(f"seqify: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
