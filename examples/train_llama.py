"""Train a Hugging Face Llama over a pipeline: converted by seqify's export frontend, bf16 autocast on GPUs.

    python examples/train_llama.py                                  # the 0.89 B model over every GPU
    python examples/train_llama.py --preset tiny --steps 2 --seq 16   # a quick run on a CPU

The model is transformers' own LlamaForCausalLM built from a config (no download). ``seqify.convert`` turns
it into an exact seqify.Sequential (torch.fx cannot trace transformers 5, so the ``auto`` frontend takes
torch.export); ``seqify.pipeline`` cuts it by FLOPs into one partition per device and ``pipe.step`` runs
a zero-bubble schedule (ZB-H1) that owns the loss: forward, loss and backward per micro-batch, gradients
in ``.grad``. On GPUs the step replays captured CUDA graphs under bf16 autocast, with each weight cast to
bf16 once per step. At the end the trained weights go back into a plain LlamaForCausalLM through
``seq.original_state_dict()`` (the source's keys, as ``save_pretrained`` writes them), which computes
what the pipeline's model computes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import seqify

PRESETS = {
    "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "0.89b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8),
}


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="0.89b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--devices", help="comma-separated devices (default: every GPU, else cpu,cpu)")
    args = p.parse_args()

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(gpus)] or ["cpu", "cpu"]
    if len(devices) == 1:
        print(f"one device: both partitions on {devices[0]} (a pipeline, not a speed-up)")
        devices *= 2
    cuda = devices[0].startswith("cuda")
    if not cuda and args.preset != "tiny":
        print(f"no GPU: the {args.preset} preset on the CPU takes minutes a step (--preset tiny is quick)")
    torch.manual_seed(0)
    config = LlamaConfig(**PRESETS[args.preset], max_position_embeddings=args.seq, use_cache=False)
    with torch.device(devices[0]):
        source = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=devices[0])

    start = time.perf_counter()
    seq = seqify.convert(source, example_inputs={"input_ids": ids[:2]}, verify=not cuda)
    print(f"converted in {time.perf_counter() - start:.1f} s: {len(seq)} layers, frontend {seq.frontend}")
    pipe = seqify.pipeline(seq, devices=devices, balance="flops", example_inputs={"input_ids": ids},
                           chunks=args.chunks, schedule="zb-h1", graphs=cuda, checkpoint="never")
    print(f"balance {pipe.balance} over {devices}, {pipe.chunks} micro-batches, schedule {pipe.schedule}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(devices[0].split(":")[0], dtype=torch.bfloat16, enabled=cuda):
            loss = pipe.step(ids, ids, lambda out, target: next_token_loss(out.logits, target))
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        memory = " ".join(f"{torch.cuda.max_memory_allocated(d) / 2**30:.1f}" for d in dict.fromkeys(devices)) \
            if cuda else "-"
        print(f"step {step}: loss {float(loss):.4f}, {args.batch * args.seq / seconds:,.0f} tokens/s, "
              f"peak GiB allocated per device {memory}")

    # The trained weights under the source's keys load into a plain transformers model. On the CPU the
    # converted model is bit-equal to its source; on a GPU, kernels chosen per shape may round differently.
    del pipe, opt
    device = devices[-1]
    plain = LlamaForCausalLM(config).to(device).eval()
    plain.load_state_dict(seq.original_state_dict(), strict=True)
    seq = seq.to(device).eval()
    with torch.no_grad():
        want, got = plain(input_ids=ids[:1].to(device)).logits, seq(input_ids=ids[:1].to(device)).logits
    if cuda:
        diff = float((want - got).abs().max() / want.abs().max())
        print(f"round trip into a plain LlamaForCausalLM: logits within {diff:.1e} (relative) of the pipeline's model")
    else:
        print(f"round trip into a plain LlamaForCausalLM bit-equal: {torch.equal(want, got)}")

if __name__ == "__main__":
    main()
