"""Probe: is a layer's time a line in the micro-batch? Why the tuner's step predictions run 5-20% fast.

First, per family, the anchor's readings: the eager and replayed one-device steps against the raw profile.

    python benchmarks/layer_lines/main.py --families ResNeXt VGG RegNet --out $OUT   # one GPU
    python benchmarks/layer_lines/main.py --tiny --device cpu --families ResNet     # smoke test

On one device, per family: the tuner's layer model (a line through the layers' times profiled at two
batch sizes, scaled so the whole model predicts its measured step: ``tuning._anchor``) against

* the one-device step measured at each micro-batch size a pipeline would run (``batch / m``), and the sum
  of the layers profiled at that size (scaled the same way): does profiling at the micro-batch fix it?
* a 2-partition pipeline on this one device (balanced by time, ``--chunks``, graphs on CUDA): predicted
  against measured, the executor's own share of the error.

One JSON line per (family, size) and per pipeline row; nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from seqify import convert, pipeline
from seqify.partition.cost import time_costs
from seqify.tools import spec
from seqify.tuning import calibrate, layer_model, step_seconds
from seqify.tuning.measure import head as _head
from seqify.tuning.predict import Candidate, predict
from seqify.tuning.profile import _replayed
from seqify.tuning.profile import anchor as _anchor
from seqify.tuning.space import balances as _plans

# the families and their sizes: benchmarks/families/main.py, imported by its path
_spec = importlib.util.spec_from_file_location("families_main", Path(__file__).resolve().parent.parent / "families" / "main.py")
_families = importlib.util.module_from_spec(_spec)
sys.modules["families_main"] = _families
_spec.loader.exec_module(_families)
FAMILIES, _tiny = _families.FAMILIES, _families._tiny


def emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(os.path.join(out, "layer-lines.jsonl"), "a") as f:
            f.write(line + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=["ResNeXt", "VGG", "RegNet", "ResNet", "ConvNeXt"])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", action="append", default=[], metavar="FAMILY=N")
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--time-limit", type=float, default=0)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device(args.device)
    batches = {k: int(v) for k, _, v in (b.partition("=") for b in args.batch)}
    begin = time.perf_counter()
    for family in args.families:
        if args.time_limit and time.perf_counter() - begin > args.time_limit:
            print(f"{family}: not started (time limit)", flush=True)
            continue
        name, batch, side, kwargs = FAMILIES[family]
        batch = batches.get(family, batch)
        if args.tiny:
            kwargs, batch, side = _tiny(name, kwargs)
            batch = 16
        model = spec.load(f"zoo:{name}", kwargs)
        x = spec.random_input(spec.sample_shape(model, batch, side, None), 0, model.vocab).to(dev)
        module = model.module.to(dev)
        seq = convert(module, (x[:2],) if model.example else None).to(dev).train()
        del module, model
        t0 = time.perf_counter()
        cal = calibrate([dev, dev], split=False)
        lo = max(2, batch // 16)
        layers, hi = layer_model(seq, x, dev, lo=lo, show=False)
        anchored, _ = _anchor(seq, x, dev, layers, cal, batch, steps=3, warm=1)
        sized, _ = layer_model(seq, x, dev, lo=lo, sizes=[batch // m for m in args.chunks], show=False)
        sized, _ = _anchor(seq, x, dev, sized, cal, batch, steps=3, warm=1)  # the tuner's model since this probe
        alone = Candidate((len(seq),), (str(dev),), 1, "never")
        factor = predict(alone, anchored, cal, batch).seconds / predict(alone, layers, cal, batch).seconds
        # the anchor's two readings against the raw profile: the eager step (GPU work or host issue, whichever
        # binds) and, on CUDA, the whole model replayed as graphs (GPU work alone)
        replay = replace(alone, graphs=True)
        emit({"family": family, "model": name, "batch": batch, "anchor_eager_ms": step_seconds(seq, x, [dev], steps=3, warm=1) * 1e3,
              "raw_eager_ms": predict(alone, layers, cal, batch).seconds * 1e3,
              "raw_host_ms": sum(layers.host_s) * 1e3, "raw_gpu_ms": predict(replay, layers, cal, batch).seconds * 1e3,
              "anchor_replayed_ms": (lambda r: r and r * 1e3)(_replayed(seq, x, dev, steps=3, warm=1)),
              "anchored_gpu_ms": predict(replay, anchored, cal, batch).seconds * 1e3,
              "anchored_host_ms": sum(anchored.host_s) * 1e3}, args.out)
        for m in sorted({1, 2, *args.chunks}):
            s = batch // m
            measured = step_seconds(seq, _head(x, s), [dev], steps=3, warm=1)
            line = predict(alone, anchored, cal, s).seconds
            prof = None
            if m > 1:
                raw = sum(time_costs(seq, _head(x, s), dev, repeats=2).cost)
                prof = raw * factor
            emit({"family": family, "model": name, "batch": batch, "micro": s, "chunks": m,
                  "measured_ms": measured * 1e3, "line_ms": line * 1e3,
                  "line_error": line / measured - 1, "profiled_ms": prof and prof * 1e3,
                  "profiled_error": prof and prof / measured - 1, "anchor": factor}, args.out)
        bal = _plans(seq, x, hi, 2, ["time"], cal.copy_bytes_per_s)["time"]
        for m in args.chunks:
            graphs = dev.type == "cuda"
            c = Candidate(tuple(bal), (str(dev), str(dev)), m, "never", graphs=graphs)
            pred = predict(c, anchored, cal, batch).seconds
            pred_sized = predict(c, sized, cal, batch).seconds
            pipe = pipeline(seq, devices=[dev, dev], balance=list(bal), chunks=m, checkpoint="never",
                            graphs=graphs).train()
            measured = step_seconds(pipe, x, [dev], steps=3, warm=2 if graphs else 1)
            del pipe
            emit({"family": family, "model": name, "batch": batch, "pipeline": list(bal), "chunks": m,
                  "graphs": graphs, "predicted_ms": pred * 1e3, "measured_ms": measured * 1e3,
                  "error": pred / measured - 1, "predicted_sized_ms": pred_sized * 1e3,
                  "error_sized": pred_sized / measured - 1}, args.out)
        print(f"{family}: {time.perf_counter() - t0:.0f} s", flush=True)
        del seq, x
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
