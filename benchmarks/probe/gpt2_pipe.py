"""Probe: why the tuner's GPT-2 pipeline loses to one GPU: wall, host-issue and GPU-busy time per device of
one GPU and of fixed configurations over two, beside the tuner's prediction for each.

    python benchmarks/probe/gpt2_pipe.py                     # GPT-2 124M, batch 16 x 1024, fp32, 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_pipe_busy import busy, host  # noqa: E402

import seqify  # noqa: E402
from seqify.tools import spec  # noqa: E402
from seqify.tuning import tune  # noqa: E402
from seqify.tuning.measure import _scored  # noqa: E402
from seqify.tuning.measure import loss as _loss  # noqa: E402

CONFIGS = {  # name -> pipeline options (checkpoint never, as the tuner chose)
    "interleaved c4 L2 eager (tuner's choice)": dict(schedule="interleaved", chunks=4, loops=2, graphs=False),
    "gpipe c4 L1 eager": dict(schedule="gpipe", chunks=4, loops=1, graphs=False),
    "1f1b c4 L1 eager": dict(schedule="1f1b", chunks=4, loops=1, graphs=False),
    "zb-h1 c4 L2 graphs (V: embedding and head on cuda:0)": dict(schedule="zb-h1", chunks=4, loops=2, graphs=True),
    "zb-h1 c8 L2 graphs": dict(schedule="zb-h1", chunks=8, loops=2, graphs=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=".")
    p.add_argument("--only", nargs="*", help="config names containing these words")
    args = p.parse_args()
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    torch.manual_seed(0)
    model = spec.load("zoo:gpt2", {"preset": "124m"})
    x = spec.random_input(spec.sample_shape(model, args.batch, 1024, None), 0, model.vocab).to(devs[0])
    module = model.module.to(devs[0])
    seq = seqify.convert(module, (x[:2],))
    del module, model
    rows = []

    def one() -> None:
        _loss(seq(x)).backward()
        seq.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    wall, per = busy(one, devs[:1])
    rows.append({"name": "one GPU", "wall_ms": wall * 1e3, "host_ms": host(one, devs[:1]) * 1e3,
                 "busy_ms": {k: v * 1e3 for k, v in per.items()}, "peak_gib": torch.cuda.max_memory_allocated(0) / 2**30,
                 "reserved_gib": torch.cuda.max_memory_reserved(0) / 2**30})
    print(json.dumps(rows[-1]), flush=True)
    for name, opts in CONFIGS.items():
        if args.only and not any(w in name for w in args.only):
            continue
        try:
            cfg = tune(seq, x, devices=devs, balance="time", checkpoint="never", top=0, cache=False, show=False, **opts)
            seq.cpu()
            pipe = seqify.pipeline(seq, devices=devs, balance=list(cfg.balance), checkpoint="never", **opts)

            def step() -> None:
                pipe.step(x, None, _scored, reduction="mean")
                pipe.zero_grad(set_to_none=True)

            for d in devs:
                torch.cuda.reset_peak_memory_stats(d)
            for _ in range(3):
                step()
            wall, per = busy(step, devs)
            rows.append({"name": name, "balance": list(cfg.balance), "predicted_ms": cfg.predicted_s * 1e3,
                         "wall_ms": wall * 1e3, "host_ms": host(step, devs) * 1e3,
                         "busy_ms": {k: v * 1e3 for k, v in per.items()},
                         "peak_gib": [torch.cuda.max_memory_allocated(d) / 2**30 for d in devs],
                         "reserved_gib": [torch.cuda.max_memory_reserved(d) / 2**30 for d in devs]})
            del pipe
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        seq.to(devs[0])
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "gpt2_pipe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
