"""A U-Net too large for one device, split by memory over two.

    python examples/unet_memory.py                                   # 2 GPUs, or 2 CPU "devices" without
    python examples/unet_memory.py --depth 3 --channels 8 --size 64  # a quick run on a CPU

seqify.balance(by="memory") measures what each layer needs (parameters, buffers and the activations
autograd keeps for backward; peak allocation on CUDA) for a sample batch. The example takes the memory
one device has (--device-mb, default: 60 % of what the whole model needs for one training step), shows
that no 1-stage plan fits it (NoPlanFitsError), asks for the 2-stage plan that fits, and trains a step
with it. On a CPU both partitions share one memory, so the numbers show what each GPU would hold.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import seqify

MB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--blocks", type=int, default=2, help="U-Net's B: conv units per level")
    p.add_argument("--channels", type=int, default=64, help="U-Net's C: width of the first level")
    p.add_argument("--size", type=int, default=512, help="image side (divisible by 2**depth)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--device-mb", type=float, help="memory one device has, in MB (default: 60%% of the need)")
    args = p.parse_args()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cpu", "cpu"]
    if gpus < 2 and args.batch * args.channels**2 * args.size**2 > 2 * 8**2 * 64**2 * 64:
        print(f"note: measuring and training U-Net(C={args.channels}) at {args.batch}x3x{args.size}x{args.size} on a "
              "CPU takes minutes; for a quick run: --depth 3 --channels 8 --size 64", flush=True)
    torch.manual_seed(0)
    seq = seqify.zoo.get("unet", depth=args.depth, blocks=args.blocks, channels=args.channels)
    params = sum(t.numel() * t.element_size() for t in seq.state_dict().values())
    print(f"U-Net(depth={args.depth}, B={args.blocks}, C={args.channels}): {len(seq)} layers, "
          f"{len(seq.skips)} long skips, {params / MB:.1f} MB of parameters and buffers")

    x = torch.randn(args.batch, 3, args.size, args.size)
    whole = seqify.balance(seq, 1, x, by="memory", device=devices[0])
    need = whole.stages[0].memory_bytes
    cap = args.device_mb * MB if args.device_mb else 0.6 * need
    print(f"one training step at batch {args.batch}x3x{args.size}x{args.size} needs {need / MB:.1f} MB "
          f"(parameters {whole.stages[0].param_bytes / MB:.1f} MB + activations {whole.stages[0].activation_bytes / MB:.1f} MB); "
          f"a device here has {cap / MB:.1f} MB")
    try:
        seqify.balance(seq, 1, x, by="memory", device=devices[0], memory_cap=cap)
    except seqify.NoPlanFitsError as e:
        print(f"one device: {e}")
    plan = seqify.balance(seq, 2, x, by="memory", device=devices[0], memory_cap=cap)
    print(plan)
    for s in plan.stages:
        print(f"  stage {s.index} holds {s.memory_bytes / MB:.1f} MB of {cap / MB:.1f} MB")

    pipe = seqify.pipeline(seq, devices=devices, balance=plan.balance, chunks=args.chunks, checkpoint="except_last")
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    masks = (torch.rand(args.batch, 1, args.size, args.size) > 0.5).float().to(pipe.output_device)
    loss = F.binary_cross_entropy_with_logits(pipe(x.to(pipe.input_device)), masks)
    loss.backward()
    opt.step()
    print(f"trained one step over {devices} with balance {plan.balance}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
