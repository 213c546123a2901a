"""Scaling past two GPUs: one GPU against seqify's automatic configuration over 2, 4 and 8 GPUs.

    python benchmarks/scaling/main.py --out results/scaling.json
    torchrun --nproc-per-node 4 benchmarks/scaling/torchpp.py --rows results/scaling.json --out results/torchpp.jsonl
    python benchmarks/scaling/main.py --table results/scaling.json results/torchpp.jsonl --plot results/scaling.png
    python benchmarks/scaling/main.py --tiny --device cpu --gpus 1 2      # smoke mode (CPU partitions)

One invocation per machine: every model (ResNet-101, AmoebaNet-D (18, 256), the zoo U-Net, a
Llama-architecture model from a transformers config) on one GPU, then pipelined with
``seqify.tune``'s choice over each GPU count the machine has (of ``--gpus``), in strong scaling (the
global batch fixed at the model's ``batch``) and weak scaling (``batch`` per GPU, grown with the GPUs).
Prints a table with samples/s, the speed-up over one GPU, the chosen configuration, the tuner's
predicted and the measured step time, and peak allocated and reserved memory per GPU; writes JSON
(``--out``, rewritten after every row, so a run cut short keeps what it measured) and a plot of speed-up
against GPUs with the ideal line (``--plot``). The Llama row is skipped with a message when transformers
or its conversion is unavailable. torch.distributed.pipelining needs one process per rank: its rows come
from benchmarks/scaling/torchpp.py (torchrun) on the cuts recorded here, and ``--table`` merges them in
(the best of its schedules and chunk counts per model, scaling and GPU count).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify


@dataclass
class Model:
    """A model to scale: how to build it, a mini-batch of ``n`` samples, and the strong-scaling batch."""

    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[int], Any]
    batch: int
    convert_example: bool = False


def _images(side: int, channels: int = 3) -> Callable[[int], torch.Tensor]:
    return lambda n: torch.randn(n, channels, side, side)


def models(tiny: bool) -> dict[str, Model]:
    from torchvision.models.resnet import Bottleneck, ResNet, resnet101

    out = {
        "resnet101": Model("resnet101", (lambda: ResNet(Bottleneck, [1, 1, 2, 1], num_classes=10)) if tiny else resnet101,
                           _images(32 if tiny else 224), 8 if tiny else 256),
        "amoebanet_d": Model("amoebanet_d",
                             (lambda: seqify.zoo.build("amoebanet_d", layers=6, filters=16, num_classes=10)) if tiny
                             else (lambda: seqify.zoo.build("amoebanet_d", layers=18, filters=256)),
                             _images(32 if tiny else 224), 8 if tiny else 128),
        "unet": Model("unet", (lambda: seqify.zoo.build("unet", depth=2, blocks=1, channels=4)) if tiny
                      else (lambda: seqify.zoo.build("unet")), _images(16 if tiny else 256), 8 if tiny else 32),
    }
    seq_len, vocab = (16, 128) if tiny else (1024, 32000)
    out["llama"] = Model("llama", lambda: _llama(tiny), lambda n: torch.randint(0, vocab, (n, seq_len)),
                         8, convert_example=True)  # 16 ran out of memory on one 80 GB H100
    return out


def _llama(tiny: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    else:  # ~1.3B parameters: 24 layers of width 2048
        config = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)
    config.use_cache = False
    return LlamaForCausalLM(config)


def _loss(out: Any) -> torch.Tensor:
    parts = [t.float().square().mean() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack([p.to(parts[0].device) for p in parts]).sum()


def _sync(devices: list[torch.device]) -> None:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def timed(model: nn.Module, x: Any, devices: list[torch.device], steps: int, warm: int, accumulate: int = 1) -> float:
    """Median seconds of a training step; a pipeline the tuner gave another schedule than GPipe steps with
    ``pipe.step`` (``pipe(x)`` with ``backward()`` would run fill-drain, not what was tuned). ``accumulate``:
    one device runs the batch as that many micro-batches, accumulating their gradients (the same gradient,
    what one device does with a batch that does not fit it whole)."""
    scheduled = isinstance(model, seqify.Pipeline) and model.schedule != "gpipe"
    times = []
    for k in range(warm + steps):
        _sync(devices)
        start = time.perf_counter()
        if scheduled:
            model.step(x, None, lambda out, _: _loss(out), reduction="mean")
        else:
            for part in x.tensor_split(accumulate) if accumulate > 1 else (x,):
                loss = _loss(model(part))
                (loss * (len(part) / len(x)) if accumulate > 1 else loss).backward()
        _sync(devices)
        if k >= warm:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def peaks(devices: list[torch.device]) -> tuple[list[float], list[float]]:
    """Peak allocated and reserved GB per device since the last reset (zeros for CPU devices)."""
    if devices[0].type != "cuda":
        return [0.0] * len(devices), [0.0] * len(devices)
    return ([torch.cuda.max_memory_allocated(d) / 2**30 for d in devices],
            [torch.cuda.max_memory_reserved(d) / 2**30 for d in devices])


def reset(devices: list[torch.device]) -> None:
    gc.collect()
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)


def others_on_gpus() -> list[str]:
    """Processes other than this one using a GPU (``nvidia-smi``): a row measured beside one is marked, since
    its numbers are not the machine's alone. Empty where nvidia-smi is missing."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip() and line.split(",")[0].strip() != str(os.getpid())]


def one_device(seq: nn.Module, x: torch.Tensor, devices: list[torch.device], args: argparse.Namespace) -> tuple[float, int]:
    """Seconds of one device's step and the micro-batches it took: the batch whole, or, where that runs out
    of memory, accumulated over 2, 4, ... micro-batches (the baseline a user without a pipeline has)."""
    k = 1
    while True:
        try:
            return timed(seq, x, devices, args.steps, args.warm, accumulate=k), k
        except torch.OutOfMemoryError:
            seq.zero_grad(set_to_none=True)
            reset(devices)
            if 2 * k > len(x):
                raise
            k *= 2


def run_one(m: Model, seq: nn.Module, n: int, batch: int, scaling: str, args: argparse.Namespace,
            device_list: list[torch.device]) -> dict[str, Any]:
    devices = device_list[:n]
    # every row starts from the batch on the first device, as torch pipelining's rank 0 and seqify.tools.bench do:
    # a batch left on the host would be copied over each step, in the pipeline's time and not the baseline's
    x = m.sample(batch).to(devices[0])
    row: dict[str, Any] = dict(model=m.name, scaling=scaling, gpus=n, batch=batch, runner="seqify")
    reset(devices)
    try:
        if n == 1:
            seq.to(devices[0]).train()
            sec, k = one_device(seq, x, devices, args)
            row.update(config=None, predicted_ms=None, accumulate=k)
        else:
            quick = dict(top=1, steps=1, warm=0) if args.tiny else dict(top=args.top)
            cfg = seqify.tune(seq, x, devices=devices, show=not args.tiny, **quick)
            reset(devices)  # the timed candidates' memory (captured graphs' pools) goes before the chosen one is built
            pipe = seqify.pipeline(seq, config=cfg).train()
            sec = timed(pipe, x, devices, args.steps, args.warm + (1 if cfg.graphs else 0))
            row.update(config=cfg.to_dict(), predicted_ms=cfg.predicted_s * 1e3)
            del pipe
    except torch.OutOfMemoryError as e:
        row.update(error=f"out of memory: {str(e).splitlines()[0]}")
        return row
    except seqify.MemoryCapError as e:  # the tuner found no candidate that fits: a row of its own, not the end
        row.update(error=f"no configuration fits: {str(e).splitlines()[0]}")
        return row
    allocated, reserved = peaks(devices)
    if devices[0].type == "cuda" and (others := others_on_gpus()):
        row.update(contended=others)
    row.update(seconds=sec, samples_per_s=batch / sec, peak_allocated=allocated, peak_reserved=reserved)
    return row


def best_torchpp(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """torch pipelining's fastest run per (model, scaling, GPUs) among scaling_torchpp.py's rows."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("runner") == "torchpp" and "samples_per_s" in r:
            key = (r["model"], r["scaling"], r["gpus"])
            if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
                best[key] = r
    return best


def _gib(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def table(rows: list[dict[str, Any]]) -> str:
    """seqify's rows, each followed by torch pipelining's best on the same cuts where it ran."""
    base = {(r["model"], r["scaling"]): r for r in rows if r["gpus"] == 1 and "samples_per_s" in r}
    anchors = best_torchpp(rows)
    lines = ["| model | scaling | GPUs | batch | runner | samples/s | speed-up | configuration | predicted ms | "
             "measured ms | peak allocated GiB per GPU | peak reserved GiB per GPU |", "|" + "---|" * 12]
    for r in rows:
        if r.get("runner") == "torchpp":
            continue
        if "samples_per_s" not in r:
            lines.append(f"| {r['model']} | {r['scaling']} | {r['gpus']} | {r['batch']} | seqify | "
                         f"{r.get('error', 'skipped')} |" + " |" * 6)
            continue
        one = base.get((r["model"], r["scaling"]))
        r["speedup"] = r["samples_per_s"] / one["samples_per_s"] if one else None
        cfg = r.get("config")
        alone = f"one device{f', {k} micro-batches accumulated' if (k := r.get('accumulate', 1)) > 1 else ''}"
        what = alone if cfg is None else (f"{cfg.get('schedule') or 'gpipe'}, chunks {cfg['chunks']}, loops "
                                                 f"{cfg['loops']}, by {cfg['by']}, checkpoint {cfg['checkpoint']}"
                                                 f"{', graphs' if cfg['graphs'] else ''}")
        predicted = f"{r['predicted_ms']:.1f}" if r.get("predicted_ms") is not None else "-"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        busy = " (**another process on the GPUs**)" if r.get("contended") else ""
        lines.append(f"| {r['model']} | {r['scaling']} | {r['gpus']} | {r['batch']} | seqify{busy} | {r['samples_per_s']:.1f} | "
                     f"{speed} | {what} | {predicted} | {r['seconds'] * 1e3:.1f} | {_gib(r['peak_allocated'])} | "
                     f"{_gib(r['peak_reserved'])} |")
        t = anchors.get((r["model"], r["scaling"], r["gpus"]))
        if t is not None:
            t["speedup"] = t["samples_per_s"] / one["samples_per_s"] if one else None
            speed = f"{t['speedup']:.2f}x" if t["speedup"] is not None else "-"
            busy = " (**another process on the GPUs**)" if t.get("contended") else ""
            lines.append(f"| {r['model']} | {r['scaling']} | {r['gpus']} | {t['batch']} | torch pipelining{busy} | "
                         f"{t['samples_per_s']:.1f} | {speed} | {t['name']}, same cuts | - | {t['seconds'] * 1e3:.1f} | "
                         f"{_gib(t['peak_allocated'])} | {_gib(t['peak_reserved'])} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Speed-up against GPUs per model: seqify's strong and weak scaling, torch pipelining's, the ideal line."""
    from seqify import plot as seqify_plot

    if not seqify_plot.available():
        print("plot: skipped: matplotlib is not installed (pip install matplotlib)")
        return
    plt = seqify_plot._plt()
    table(rows)  # sets each row's speedup
    names = list(dict.fromkeys(r["model"] for r in rows if r.get("speedup")))
    if not names:
        print("plot: skipped: no speed-up to draw")
        return
    anchors = best_torchpp(rows)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        counts = sorted({r["gpus"] for r in rows if r["model"] == name and r["gpus"] >= 1})
        ax.plot(counts, counts, "k--", label="ideal")
        for scaling, style in (("strong", "o-"), ("weak", "s-")):
            mine = [r for r in rows if r["model"] == name and r["scaling"] == scaling and r.get("speedup")
                    and r.get("runner") != "torchpp"]
            if mine:
                ax.plot([r["gpus"] for r in mine], [r["speedup"] for r in mine], style, label=f"seqify, {scaling}")
            theirs = sorted((k[2], t["speedup"]) for k, t in anchors.items()
                            if k[0] == name and k[1] == scaling and t.get("speedup"))
            if theirs:
                ax.plot(*zip(*theirs), style.replace("-", ":"), label=f"torch pipelining, {scaling}")
        ax.set_title(name)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speed-up over one GPU")
        ax.set_xticks(counts)
        ax.legend(fontsize=7)
    made = seqify_plot.save(fig, path)
    print("plot written: " + ", ".join(map(str, made)))


def load(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows from scaling.py's JSON files and scaling_torchpp.py's JSON lines, and the first file's header."""
    rows: list[dict[str, Any]] = []
    header: dict[str, Any] = {}
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:  # JSON lines
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
            continue
        header = header or {k: v for k, v in data.items() if k != "rows"}
        rows += data["rows"]
    return rows, header


def save(path: str, rows: list[dict[str, Any]], header: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(dict(header, rows=rows), f, indent=1)
    os.replace(path + ".part", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["resnet101", "amoebanet_d", "unet", "llama"],
                   help="the models to run (with --table: to show)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts (those the machine has)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: CPU partitions (smoke mode)")
    p.add_argument("--tiny", action="store_true", help="tiny models and batches (a fast smoke run)")
    p.add_argument("--batch", type=int, help="strong-scaling global batch, and weak scaling's batch per GPU "
                   "(default: the model's: resnet101 256, amoebanet_d 128, unet 32, llama 8)")
    p.add_argument("--top", type=int, default=3, help="the tuner's candidates confirmed by timed steps (seqify.tune's top)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--out", help="write the rows as JSON here (rewritten after every row; rows already there from "
                   "another model are kept)")
    p.add_argument("--plot", help="write speed-up against GPUs here (PNG and SVG)")
    p.add_argument("--table", nargs="+", metavar="FILE", help="measure nothing: print the table (and --plot) of these "
                   "files (scaling.py's JSON, scaling_torchpp.py's JSON lines)")
    args = p.parse_args(argv)
    if args.table:
        rows, header = load(args.table)
        rows = [r for r in rows if r["model"] in args.models]
        print(f"# {header.get('device', '?')}; torch {header.get('torch', '?')}; {header.get('date', '?')}; "
              f"{header.get('command', '')}\n")
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    if args.tiny:
        args.steps, args.warm = min(args.steps, 1), min(args.warm, 0)
    if args.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not have:
            print("no GPU here: run with --device cpu (CPU partitions) or on a GPU machine", file=sys.stderr)
            return 2
        device_list = [torch.device("cuda", i) for i in range(have)]
        what = f"{have} x {torch.cuda.get_device_name(0)}"
    else:
        have = max(args.gpus)
        device_list = [torch.device("cpu")] * have
        what = f"CPU ({torch.get_num_threads()} threads) as {have} devices"
    counts = [n for n in sorted(set(args.gpus)) if n <= have]
    if 1 not in counts:
        counts = [1] + counts
    catalogue = models(args.tiny)
    header = dict(device=what, date=f"{datetime.date.today()}", command=" ".join(sys.argv), torch=torch.__version__,
                  tiny=args.tiny)
    rows: list[dict[str, Any]] = []
    if args.out and os.path.exists(args.out):  # one file per machine: keep the other models' rows
        rows = [r for r in load([args.out])[0] if r["model"] not in args.models]
    print(f"seqify scaling benchmark on {what}; torch {torch.__version__}; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    for name in args.models:
        m = catalogue[name]
        torch.manual_seed(0)
        try:
            source = m.build()
            example = (m.sample(2),) if m.convert_example else None
            seq = seqify.convert(source, example)
        except Exception as e:  # the Llama row needs transformers and a conversion that works
            if name != "llama":
                raise
            first = (str(e).splitlines() or [""])[0]
            print(f"llama: skipped: {type(e).__name__}: {first}")
            rows.append(dict(model=name, scaling="-", gpus=0, batch=0, runner="seqify", error=f"skipped: {first}"))
            continue
        per = args.batch or m.batch
        for scaling in ("strong", "weak"):
            for n in counts:
                batch = per if scaling == "strong" else per * n
                if scaling == "weak" and n == 1:  # the same run as strong scaling's one GPU
                    row = dict(next(r for r in rows if r["model"] == name and r["scaling"] == "strong" and r["gpus"] == 1),
                               scaling="weak")
                else:
                    row = run_one(m, seq, n, batch, scaling, args, device_list)
                rows.append(row)
                if args.out:
                    save(args.out, rows, header)
                print(f"{name} {scaling} {n} device(s), batch {batch}: "
                      + (f"{row['samples_per_s']:.1f} samples/s" if "samples_per_s" in row else row.get("error", "")),
                      flush=True)
        del seq, source
    print()
    print(table(rows))
    print("\nspeed-up: samples/s over one device at the same scaling; torch.distributed.pipelining: "
          "benchmarks/scaling/torchpp.py on these cuts, merged by --table")
    if args.out:
        save(args.out, rows, header)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
