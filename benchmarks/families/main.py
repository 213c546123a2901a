"""Every zoo family pipelined with the automatic configuration: one GPU against ``seqify.tune``'s choice.

    python benchmarks/families/main.py --out results/families-pipeline.jsonl        # 2 GPUs, every family
    python benchmarks/families/main.py --families ResNet ViT --top 2 --alternatives 1
    python benchmarks/families/main.py --replicas 1                                 # pipelines only
    python benchmarks/families/main.py --tiny --devices cpu,cpu                     # smoke test (CPU)

For each family one representative at a batch that fills one H200 well (``FAMILIES`` below), converted
through the same path as ``seqify bench zoo:NAME`` and measured with :func:`seqify.tools.bench.bench`: the
one-device baseline, the tuned pipeline (predicted and measured step time) and up to ``--alternatives``
rejected candidates, each with measured peak allocated / reserved memory per GPU. One JSON line per
family goes to ``--out`` as soon as it is measured (a timeout keeps the families done); a family that
fails (out of memory, a conversion error) is written with its error and the run goes on. The summary
table at the end has the family, model, batch, the chosen configuration, predicted and measured ms, the
speed-up over one GPU and the memory per GPU beside one GPU's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
import traceback
from typing import Any

import torch

from seqify import convert
from seqify.tools import spec
from seqify.tools.bench import Bench, bench

# family -> (zoo name, batch, input side or sequence length, builder keyword arguments)
FAMILIES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "ResNet": ("resnet101", 256, 224, {}),
    "ResNeXt": ("resnext50_32x4d", 128, 224, {}),
    "Wide ResNet": ("wide_resnet50_2", 128, 224, {}),
    "VGG": ("vgg16", 128, 224, {}),
    "DenseNet": ("densenet121", 128, 224, {}),
    "MobileNet": ("mobilenet_v3_large", 256, 224, {}),
    "EfficientNet": ("efficientnet_b0", 256, 224, {}),
    "EfficientNetV2": ("efficientnet_v2_s", 128, 224, {}),
    "RegNet": ("regnet_y_8gf", 128, 224, {}),
    "ConvNeXt": ("convnext_base", 128, 224, {}),
    "ViT": ("vit_b_16", 128, 224, {}),
    "Swin": ("swin_t", 128, 224, {}),
    "MaxViT": ("maxvit_t", 64, 224, {}),
    "FCN": ("fcn_resnet50", 16, 520, {}),
    "DeepLabV3": ("deeplabv3_resnet50", 16, 520, {}),
    "LR-ASPP": ("lraspp_mobilenet_v3_large", 32, 520, {}),
    "U-Net": ("unet", 32, 256, {}),
    "AmoebaNet-D": ("amoebanet_d", 128, 224, {"layers": 18, "filters": 256}),
    "Llama": ("llama", 8, 1024, {"preset": "0.89b"}),
    "GPT-2": ("gpt2", 16, 1024, {"preset": "124m"}),
}


def _tiny(name: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """The zoo's small configuration of the same code: (kwargs, batch, side)."""
    from seqify.zoo import catalog

    small, side = catalog.entry(name).small
    return dict(small), 4, side


def _gib(values: tuple[int, ...]) -> list[float]:
    return [round(v / 2**30, 2) for v in values]


def _record(family: str, name: str, batch: int, side: int, result: Bench, convert_s: float) -> dict[str, Any]:
    base = result.baseline
    chosen = next(r for r in result.rows if r.chosen)
    cfg = result.config.without_trials().to_dict()
    ratio = base.measured_s / chosen.measured_s if base.measured_s and chosen.measured_s else None
    return {
        "family": family, "model": name, "batch": batch, "side": side, "devices": result.devices,
        "convert_s": round(convert_s, 2),
        "chosen": chosen.name, "schedule": chosen.schedule, "config": cfg,
        "one_gpu_ms": base.measured_s and base.measured_s * 1e3,
        "one_gpu_allocated_gib": _gib(base.allocated_per_device), "one_gpu_reserved_gib": _gib(base.reserved_per_device),
        "predicted_ms": chosen.predicted_s and chosen.predicted_s * 1e3,
        "measured_ms": chosen.measured_s and chosen.measured_s * 1e3,
        "error": (chosen.predicted_s / chosen.measured_s - 1) if chosen.predicted_s and chosen.measured_s else None,
        "speedup": ratio,
        "allocated_gib": _gib(chosen.allocated_per_device), "reserved_gib": _gib(chosen.reserved_per_device),
        "rows": [{"name": r.name, "schedule": r.schedule, "chosen": r.chosen,
                  "predicted_ms": r.predicted_s and r.predicted_s * 1e3, "measured_ms": r.measured_s and r.measured_s * 1e3,
                  "allocated_gib": _gib(r.allocated_per_device), "reserved_gib": _gib(r.reserved_per_device)}
                 for r in result.rows],
        "table": str(result),
    }


def run(family: str, name: str, batch: int, side: int, kwargs: dict[str, Any], devices: list[str], args: argparse.Namespace) -> dict[str, Any]:
    model = spec.load(f"zoo:{name}", kwargs)
    x = spec.random_input(spec.sample_shape(model, batch, side, None), 0, model.vocab)
    module = model.module
    first = torch.device(devices[0])
    start = time.perf_counter()
    # Convert on the first device: a token model is exported on its example (two rows of it), and the
    # self-check runs where it is fast; the batch is not fixed by the conversion.
    module.to(first)
    seq = convert(module, (x[:2].to(first),) if model.example else None)
    convert_s = time.perf_counter() - start
    del module, model
    result = bench(seq, x, devices, spec=f"zoo:{name}", top=args.top, alternatives=args.alternatives,
                   steps=args.steps, warm=args.warm, cache=False, show=False, replicas=args.replicas)
    return _record(family, name, batch, side, result, convert_s)


def _row(r: dict[str, Any]) -> str:
    if "error_text" in r:
        return f"| {r['family']} | {r['model']} | {r['batch']} | failed: {r['error_text'][:80]} | | | | | |"
    mem = " / ".join(f"{a:.1f}" for a in r["allocated_gib"]) or "-"
    one = " / ".join(f"{a:.1f}" for a in r["one_gpu_allocated_gib"]) or "-"
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (f"| {r['family']} | {r['model']} | {r['batch']} | {r['chosen']}, {r['schedule']} | "
            f"{fmt(r['predicted_ms'], '.1f')} | {fmt(r['measured_ms'], '.1f')} | "
            f"{fmt(r['error'] and r['error'] * 100, '+.0f')}% | {fmt(r['speedup'], '.2f')}x | {mem} | {one} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", help="family names (default: all), e.g. ResNet ViT U-Net")
    p.add_argument("--devices", default="cuda:0,cuda:1")
    p.add_argument("--top", type=int, default=3, help="tuner: best predicted candidates timed (the library's default)")
    p.add_argument("--alternatives", type=int, default=1, help="rejected candidates timed as well")
    p.add_argument("--replicas", type=int, help="fix the layout's data-parallel copies (1: pipelines only); "
                   "default: the tuner chooses among every stages x replicas")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="the zoo's small configurations (smoke test)")
    p.add_argument("--time-limit", type=float, default=0, help="seconds: start no family after this many (0: no limit)")
    p.add_argument("--batch", action="append", default=[], metavar="FAMILY=N",
                   help="another batch for a family (repeatable), e.g. --batch DenseNet=256")
    p.add_argument("--out", help="JSON lines, one per family")
    args = p.parse_args()
    devices = args.devices.split(",")
    chosen = args.families or list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    batches: dict[str, int] = {}
    for item in args.batch:
        family, eq, n = item.rpartition("=")
        if not eq or family not in FAMILIES or not n.isdigit():
            p.error(f"--batch {item!r}: write FAMILY=N with a known family, e.g. DenseNet=256")
        batches[family] = int(n)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"# benchmarks/families {when}, {len(devices)} devices ({', '.join(devices)}; {gpu}), torch {torch.__version__}",
          flush=True)
    begin = time.perf_counter()
    done: list[dict[str, Any]] = []
    for family in chosen:
        if args.time_limit and time.perf_counter() - begin > args.time_limit:
            print(f"{family}: not started (time limit of {args.time_limit:.0f} s reached)", flush=True)
            continue
        name, batch, side, kwargs = FAMILIES[family]
        batch = batches.get(family, batch)
        if args.tiny:
            kwargs, batch, side = _tiny(name, kwargs)
        t0 = time.perf_counter()
        try:
            r = run(family, name, batch, side, kwargs, devices, args)
            print(r.pop("table"), flush=True)
        except Exception as e:  # a family that fails is a row of the table, not the end of the run
            traceback.print_exc()
            r = {"family": family, "model": name, "batch": batch, "side": side, "error_text": f"{type(e).__name__}: {e}"}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["when"] = when
        r["device"] = gpu
        done.append(r)
        print(f"{family}: {r['seconds']} s", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\n| family | model | batch | automatic configuration | predicted ms | measured ms | error | x one GPU "
          "| peak GiB allocated per GPU | one GPU GiB |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in done:
        print(_row(r))


if __name__ == "__main__":
    main()
