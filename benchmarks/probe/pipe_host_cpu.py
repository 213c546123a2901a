"""Probe: the pipeline executor's own cost on the CPU, where compute is tiny and Python dominates: a 16-layer tiny
Llama (262 converted layers) trained by `pipe.step` over two CPU partitions at 8 chunks, against its source run as
the same 8 accumulated micro-batches; `--profile` adds the hottest functions of the pipelined step.

    python benchmarks/probe/pipe_host_cpu.py [--schedule 1f1b] [--profile]

One thread (torch.set_num_threads(1)); the mean of 10 steps after 3 warm ones, in milliseconds per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import seqify


def ms(step, n: int = 10, warm: int = 3) -> float:
    for _ in range(warm):
        step()
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=16,
                      num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (8, 16))

    def loss_fn(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    def source() -> None:
        for part in ids.chunk(8):
            loss_fn(lm(part), part).backward()
        lm.zero_grad(set_to_none=True)

    base = ms(source)
    seq = seqify.convert(lm, example_inputs={"input_ids": ids[:2]}, frontend="export")
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], chunks=8, schedule=args.schedule,
                           example_inputs={"input_ids": ids}, checkpoint="never")

    def pipelined() -> None:
        pipe.step(ids, ids, loss_fn)
        pipe.zero_grad(set_to_none=True)

    took = ms(pipelined)
    print(f"{len(seq)} layers; source, 8 accumulated micro-batches: {base:.1f} ms; seqify.pipeline {args.schedule} "
          f"over 2 CPU partitions, 8 chunks: {took:.1f} ms ({took / base:.2f}x)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            pipelined()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
