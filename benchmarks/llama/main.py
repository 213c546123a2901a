"""Llama benchmark: a transformers Llama converted by seqify's export frontend, on one device and pipelined over two.

    python benchmarks/llama/main.py --out results/llama.json            # 2 GPUs: the full table
    python benchmarks/llama/main.py --size 8b --out results/llama8b.json  # ~8B params, fp32 Adam, over 2 GPUs
    python benchmarks/llama/main.py --tiny --device cpu --out /tmp/l.json # CPU smoke test

Rows: the source on one device; the converted model on one device (ratio to the source, target >= 0.98);
seqify.pipeline over two devices at 4 and 8 chunks, eager and CUDA graphs, loops 1 and 2. Each row gives
tokens/s, the ratio to one device, and peak allocated and reserved GiB per device. bf16 autocast, fp32
weights, SGD (Adam for --size 8b).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import seqify
from seqify.pipe.executors.options import ReplayOptions


def config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    if args.tiny:
        return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq,
                           use_cache=False)
    if args.size == "8b":
        return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=args.seq,
                           use_cache=False)
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, use_cache=False)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def devices_of(args: argparse.Namespace) -> list[torch.device]:
    if args.device == "cpu":
        return [torch.device("cpu")] * 2
    if torch.cuda.device_count() < 2:  # one GPU: both partitions share it (memory and exactness, not speed-up)
        print("# one GPU: the pipeline rows put both partitions on cuda:0", flush=True)
        return [torch.device("cuda:0")] * 2
    return [torch.device(f"cuda:{i}") for i in range(2)]


def sync(devs: list[torch.device]) -> None:
    for d in set(devs):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def memory(devs: list[torch.device]) -> dict[str, list[float]]:
    gib = 2**30
    cuda = sorted({d.index for d in devs if d.type == "cuda"})
    return {
        "peak_allocated_gib": [round(torch.cuda.max_memory_allocated(i) / gib, 2) for i in cuda],
        "peak_reserved_gib": [round(torch.cuda.max_memory_reserved(i) / gib, 2) for i in cuda],
    }


def timed(name: str, step: Callable[[], torch.Tensor], devs: list[torch.device], args: argparse.Namespace) -> dict[str, Any]:
    for d in {d for d in devs if d.type == "cuda"}:
        torch.cuda.reset_peak_memory_stats(d)
    loss = torch.tensor(float("nan"))
    for _ in range(args.warmup):
        loss = step()
    sync(devs)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(devs)
    sec = (time.perf_counter() - start) / args.steps
    row = {"name": name, "sec_per_step": round(sec, 4), "tokens_per_s": round(args.batch * args.seq / sec),
           "loss": float(loss), "loss_finite": math.isfinite(float(loss)), **memory(devs)}
    print(json.dumps(row), flush=True)
    return row


PRECISION = "bf16"


def trainer(model: nn.Module, ids: torch.Tensor, devs: list[torch.device], adam: bool) -> Callable[[], torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-5) if adam else torch.optim.SGD(params, lr=1e-3)
    autocast = devs[0].type == "cuda" and PRECISION == "bf16"
    out_device = devs[-1]
    owns_step = isinstance(model, seqify.Pipeline)  # the pipeline's schedule runs the loss per micro-batch

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(devs[0].type, dtype=torch.bfloat16, enabled=autocast):
            if owns_step:
                loss = model.step(ids, ids, lambda out, t: loss_of(out.logits, t))
            else:
                logits = model(input_ids=ids).logits
        if not owns_step:
            loss = loss_of(logits, ids.to(out_device))
            loss.backward()
        opt.step()
        return loss.detach()

    return step


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = config(args)
    with torch.device(device):
        lm = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    return lm, ids


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    devs = devices_of(args)
    rows: list[dict[str, Any]] = []
    adam = args.size == "8b"
    # The 8B model does not train on one device: it is built on the CPU and only pipelined.
    lm, ids = build(args, torch.device("cpu") if adam else devs[0])
    if not adam:
        rows.append(timed("source, one device", trainer(lm, ids, devs[:1], adam), devs[:1], args))
    start = time.perf_counter()
    # The self-check is bit-for-bit on the CPU (tests/convert/test_hf.py); on a GPU, kernels chosen for the converted
    # layers' shapes round differently, so here the first steps' losses are printed side by side instead.
    seq = seqify.convert(lm, example_inputs={"input_ids": ids[:2]}, frontend="export",
                         verify=args.device == "cpu" and not adam)
    print(f"# converted in {time.perf_counter() - start:.1f} s: {len(seq)} layers, frontend {seq.frontend}", flush=True)
    if not adam:
        rows.append(timed("seqify converted, one device", trainer(seq, ids, devs[:1], adam), devs[:1], args))
    for d in {d for d in devs if d.type == "cuda"}:  # the one-device rows' cache is not the pipeline's
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    start = time.perf_counter()
    micro = {"input_ids": ids[: max(1, args.batch // max(args.chunks))]}
    plans = {loops: seqify.balance(seq, 2 * loops, micro, by=args.balance, progress=False).balance for loops in args.loops}
    print(f"# balance by {args.balance} in {time.perf_counter() - start:.1f} s: {plans}", flush=True)
    modes = {"eager": [False], "graphs": [True], "both": [False, True]}[args.graphs]
    cast_modes = {"once": [True], "per-micro-batch": [False], "both": [False, True]}[args.cast]
    settings = [(c, s, g, loops, shift, once) for c in args.chunks for s in args.schedules for g in modes
                for loops in args.loops for shift in (args.shift if loops == 1 else [0])
                for once in (cast_modes if g else [True])
                if not (loops == 1 and s == "interleaved")]
    if args.device == "cpu" or args.size == "8b":
        settings = settings[:1]
    for chunks, schedule, graphs, loops, shift, once in settings:
        cut = list(plans[loops])
        if shift:  # move the cut by `shift` layers (positive: more on the first device) to check the balance
            cut = [cut[0] + shift, cut[1] - shift]
        name = (f"seqify.pipeline 2 devices, {schedule}, chunks={chunks}, {'graphs' if graphs else 'eager'}, "
                f"loops={loops}{f', balance {cut}' if shift else ''}{'' if once else ', casts per micro-batch'}")
        options = ReplayOptions(cast_once=once)  # cast once per step under autocast (default), or per program
        try:
            pipe = seqify.pipeline(seq, devices=devs, balance=cut,
                                   chunks=chunks, graphs=graphs, loops=loops, schedule=schedule,
                                   example_inputs={"input_ids": ids}, checkpoint="never", replay_options=options)
            rows.append(timed(name, trainer(pipe, ids.to(devs[0]), devs, adam), devs, args))
            if pipe.graph_error:
                rows[-1]["graph_error"] = pipe.graph_error.strip().splitlines()[-1]
        except Exception as e:  # one setting failing (e.g. out of memory) still reports the others
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            pipe = None
            for d in {d for d in devs if d.type == "cuda"}:
                with torch.cuda.device(d):
                    torch.cuda.empty_cache()
    base = next((r["tokens_per_s"] for r in rows if r["name"].startswith("source") and "tokens_per_s" in r), None)
    for r in rows:
        if base and "tokens_per_s" in r:
            r["ratio_to_one_device"] = round(r["tokens_per_s"] / base, 3)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'setting':<64} {'tokens/s':>10} {'ratio':>6}  peak alloc GiB / reserved GiB per device"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<64} {r['error']}")
            continue
        mem = " ".join(f"{a}/{b}" for a, b in zip(r["peak_allocated_gib"], r["peak_reserved_gib"])) or "-"
        lines.append(f"{r['name']:<64} {r['tokens_per_s']:>10} {r.get('ratio_to_one_device', '-'):>6}  {mem}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke test)")
    parser.add_argument("--size", choices=["default", "8b"], default="default")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe"], choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
    parser.add_argument("--graphs", choices=["eager", "graphs", "both"], default="both")
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shift", type=int, nargs="+", default=[0],
                        help="also run loops=1 with the cut moved by these many layers (balance check)")
    parser.add_argument("--balance", choices=["params", "time", "memory", "flops"], default="params",
                        help="how seqify.balance cuts the converted model (time and memory measure it on cuda:0)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="bf16 autocast (default) or fp32 throughout")
    parser.add_argument("--cast", choices=["once", "per-micro-batch", "both"], default="once",
                        help="graphs rows under autocast: weights cast once per step (seqify's default), in every "
                             "micro-batch's program (as before 2026-11-24), or both side by side")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    global PRECISION
    PRECISION = args.precision
    if args.tiny:
        args.batch, args.seq, args.chunks, args.steps, args.warmup = 4, 16, [2], 1, 1
    if args.size == "8b" and not args.tiny:
        args.batch = min(args.batch, 4)
    rows = run(args)
    print(table(rows), flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
