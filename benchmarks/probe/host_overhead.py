"""Host cost of a converted model: forward and training-step time at tiny widths, where Python sets the pace.

    python benchmarks/probe/host_overhead.py              # T5 with 6 + 6 blocks, widths 32, one CPU thread

The model keeps the layer count of the one-GPU T5 row of ``families_speed.py`` but tiny widths, so a step's
time is the host's: module calls, op dispatch and skip bookkeeping. Source and converted run in alternating
rounds; the best round of each is printed (the least disturbed by the machine).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import seqify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    import transformers as tf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=4, d_ff=64, num_layers=args.layers, num_heads=8,
                      decoder_start_token_id=0, use_cache=False, tie_word_embeddings=False)
    source = tf.T5ForConditionalGeneration(cfg).train()
    inputs = {"input_ids": torch.randint(0, 64, (1, 4)), "decoder_input_ids": torch.randint(0, 64, (1, 4))}
    seq = seqify.convert(copy.deepcopy(source), example_inputs=inputs)

    def forward(model: torch.nn.Module) -> None:
        model(**inputs)

    def step(model: torch.nn.Module) -> None:
        model(**inputs).logits.float().pow(2).mean().backward()

    print(f"T5, {args.layers} + {args.layers} blocks, widths 32: {len(seq)} layers; best of {args.rounds} rounds")
    for name, work in (("forward", forward), ("forward + backward", step)):
        best = {"source": float("inf"), "converted": float("inf")}
        for r in range(args.rounds):
            for key, model in (("source", source), ("converted", seq))[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                for _ in range(args.steps):
                    work(model)
                best[key] = min(best[key], (time.perf_counter() - start) / args.steps * 1e3)
        print(f"{name:20s} source {best['source']:.3f} ms   converted {best['converted']:.3f} ms   "
              f"converted / source time {best['converted'] / best['source']:.3f}")


if __name__ == "__main__":
    main()
