"""Probe: which skips of a converted Llama carry values that are not tensors, and which of those are sizes.

    python benchmarks/probe/skip_values.py --device cuda      # the benchmark's Llama (16 layers, 2048 wide)
    python benchmarks/probe/skip_values.py --device cpu --tiny

A captured-graph pipeline keeps size skips as constants of its programs and refuses any other non-tensor skip
(pipe.graph_error names it); this lists them per stashing layer for one forward on ``--device``.
"""

from __future__ import annotations

import argparse
import collections

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import seqify
from seqify.model import stash_sizes as sizes
from seqify.skip import tracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="convert and run under bf16 autocast")
    args = parser.parse_args()
    wide, layers = (32, 4) if args.tiny else (2048, 16)
    cfg = LlamaConfig(vocab_size=128 if args.tiny else 32000, hidden_size=wide, intermediate_size=wide * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=4 if args.tiny else 16, num_key_value_heads=2 if
                      args.tiny else 8, max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        lm = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16 if args.tiny else 2048), device=args.device)
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
        seq = seqify.convert(lm, example_inputs={"input_ids": ids}, frontend="export", verify=False)
    sized = sizes.size_skips(list(seq))
    seen: collections.Counter[tuple[str, str, bool]] = collections.Counter()
    original = tracker.SkipTracker.stash

    def stash(self: tracker.SkipTracker, key: tuple, value: object) -> None:
        if not isinstance(value, torch.Tensor):
            seen[(key[1].split("#")[0], type(value).__name__, key in sized)] += 1
            if key not in sized:
                print(f"not a size: {key[1]} = {value!r:.120}", flush=True)
        original(self, key, value)

    tracker.SkipTracker.stash = stash  # type: ignore[method-assign]
    with torch.no_grad(), torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
        seq(input_ids=ids)
    tracker.SkipTracker.stash = original  # type: ignore[method-assign]
    for (name, kind, is_size), n in sorted(seen.items()):
        print(f"{n:4d} x {name:<40} {kind:<10} {'size' if is_size else 'NOT A SIZE'}")


if __name__ == "__main__":
    main()
