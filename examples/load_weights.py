"""Load a checkpoint written for the source model into its conversion, through load_original_state_dict.

    python examples/load_weights.py                       # ResNet-50
    python examples/load_weights.py --model resnet18 --size 64   # a quick run on a CPU

The converted model's layers are named after the source (layer1.0.conv1 becomes layer1_0_conv1), but
original_state_dict() and load_original_state_dict() speak the source's own keys, so checkpoints written
for torchvision models (or torchvision's published weights) load as they are, with strict key and shape
checks. Here the "pretrained" checkpoint is made locally (torch.save of a torchvision model's state_dict
in a temporary folder): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torchvision

import seqify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="torchvision model name")
    p.add_argument("--size", type=int, default=224, help="image side of the check")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        # 1. Somebody trained a torchvision model and saved its state_dict.
        torch.manual_seed(1)
        trained = torchvision.models.get_model(args.model, weights=None).eval()
        path = os.path.join(tmp, f"{args.model}.pth")
        torch.save(trained.state_dict(), path)
        print(f"checkpoint: {path} ({len(trained.state_dict())} tensors, keys like {next(iter(trained.state_dict()))!r})")

        # 2. Convert a freshly built model (other random weights), then load the checkpoint by the source's keys.
        torch.manual_seed(2)
        seq = seqify.convert(torchvision.models.get_model(args.model, weights=None)).eval()
        seq.load_original_state_dict(torch.load(path, weights_only=True))
        first = seq.original_keys()[0]
        print(f"loaded into {len(seq)} layers; {first!r} lives in layer {next(iter(seq._modules))!r}")

        # 3. The same in one call: seqify.zoo.get accepts a checkpoint path (or a torchvision weights enum).
        from_zoo = seqify.zoo.get(args.model, weights=path).eval()

        x = torch.randn(2, 3, args.size, args.size)
        with torch.no_grad():
            want = trained(x)
            same = torch.equal(seq(x), want) and torch.equal(from_zoo(x), want)
        print(f"outputs bit-equal to the trained model's: {same}")

        # 4. And back: save the converted model's weights in the source's format.
        back = os.path.join(tmp, "back.pth")
        torch.save(seq.original_state_dict(), back)
        again = torchvision.models.get_model(args.model, weights=None).eval()
        again.load_state_dict(torch.load(back, weights_only=True))
        with torch.no_grad():
            print(f"round trip into a plain torchvision model bit-equal: {torch.equal(again(x), want)}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
