"""Converted against source, one device: training speed of every transformers and diffusers family seqify converts.

    python benchmarks/conversion_speed/main.py --out results/families.json          # one GPU, realistic sizes
    python benchmarks/conversion_speed/main.py --tiny --device cpu --families bert    # smoke test

For each family (BERT, GPT-2, Llama, Qwen2, T5, ViT, CLIP vision, diffusers UNet2DModel,
UNet2DConditionModel, AutoencoderKL) a model from a config (no download), converted with example inputs
(``frontend="auto"``, self-checked), then trained side by side with its source on the same device: SGD
steps on the same batch, the two timed in alternating rounds so drift hits both, the median of the
per-round ratios reported (target >= 0.98: a converted model must train as fast as its source). Prints a
table with the conversion time, the frontend, the layer count, ms per step of each (medians), the ratio
and peak allocated / reserved GiB of one step of each after warm-up (both models' weights are resident
throughout: the memory columns differ by what a step adds); ``--out`` writes the rows as JSON, one row at a time (a timeout keeps
the rows done). A family whose package is missing is reported and skipped.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify

Built = tuple[nn.Module, dict[str, Any]]


def _ids(vocab: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), device=device)


def families(tiny: bool, device: torch.device, scale: int = 1) -> dict[str, Callable[[], Built]]:
    """Builders: realistic sizes for one GPU (batches times ``scale``), or tiny ones for a CPU smoke test."""
    import transformers as tf

    s = 1 if not tiny else 0  # size switch
    h, layers, heads, seq, batch = (768, 12, 12, 128, 32 * scale) if s else (32, 1, 2, 16, 2)

    def bert() -> Built:
        cfg = tf.BertConfig(vocab_size=30522 if s else 64, hidden_size=h, intermediate_size=4 * h,
                            num_hidden_layers=layers, num_attention_heads=heads)
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        mask[0, seq // 2:] = 0  # one padded sequence
        return tf.BertModel(cfg), {"input_ids": _ids(cfg.vocab_size, batch, seq, device), "attention_mask": mask}

    def gpt2() -> Built:
        cfg = tf.GPT2Config(vocab_size=50257 if s else 64, n_embd=h, n_layer=layers, n_head=heads,
                            n_positions=max(256, seq), use_cache=False)
        return tf.GPT2LMHeadModel(cfg), {"input_ids": _ids(cfg.vocab_size, batch // 2 or 1, 2 * seq, device)}

    def llama_like(kind: str) -> Built:
        config = tf.LlamaConfig if kind == "llama" else tf.Qwen2Config
        hid = 1024 if s else 32
        cfg = config(vocab_size=32000 if s else 64, hidden_size=hid, intermediate_size=hid * 11 // 4,
                     num_hidden_layers=8 if s else 1, num_attention_heads=16 if s else 2,
                     num_key_value_heads=8 if s else 1, max_position_embeddings=4 * seq, use_cache=False)
        model = tf.LlamaForCausalLM(cfg) if kind == "llama" else tf.Qwen2ForCausalLM(cfg)
        return model, {"input_ids": _ids(cfg.vocab_size, batch // 4 or 1, 4 * seq, device)}

    def t5() -> Built:
        cfg = tf.T5Config(vocab_size=32128 if s else 64, d_model=512 if s else 32, d_kv=64 if s else 8,
                          d_ff=2048 if s else 64, num_layers=6 if s else 1, num_heads=8 if s else 2,
                          decoder_start_token_id=0, use_cache=False, tie_word_embeddings=False)
        return tf.T5ForConditionalGeneration(cfg), {"input_ids": _ids(cfg.vocab_size, batch // 2 or 1, seq, device),
                                                   "decoder_input_ids": _ids(cfg.vocab_size, batch // 2 or 1, seq, device)}

    def vit() -> Built:
        size = 224 if s else 16
        cfg = tf.ViTConfig(image_size=size, patch_size=16 if s else 8, hidden_size=h, intermediate_size=4 * h,
                           num_hidden_layers=layers, num_attention_heads=heads, num_labels=1000 if s else 3)
        return tf.ViTForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, size, size, device=device)}

    def clip_vision() -> Built:
        size = 224 if s else 16
        cfg = tf.CLIPVisionConfig(image_size=size, patch_size=32 if s else 8, hidden_size=h, intermediate_size=4 * h,
                                  num_hidden_layers=layers, num_attention_heads=heads)
        return tf.CLIPVisionModel(cfg), {"pixel_values": torch.randn(2 * batch, 3, size, size, device=device)}

    def unet2d() -> Built:
        import diffusers

        size, b = (64, 16 * scale) if s else (8, 2)
        model = diffusers.UNet2DModel(
            sample_size=size, in_channels=3, out_channels=3, layers_per_block=2 if s else 1,
            block_out_channels=(64, 128, 256, 256) if s else (8, 16), norm_num_groups=32 if s else 4,
            down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D") if s
            else ("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D") if s
            else ("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8 if s else 4)
        return model, {"sample": torch.randn(b, 3, size, size, device=device),
                       "timestep": torch.randint(0, 1000, (b,), device=device)}

    def unet2d_condition() -> Built:
        import diffusers

        size, b, ctx = (32, 8 * scale, 768) if s else (8, 2, 8)
        model = diffusers.UNet2DConditionModel(
            sample_size=size, in_channels=4, out_channels=4, layers_per_block=2 if s else 1,
            block_out_channels=(128, 256, 512) if s else (8, 16), norm_num_groups=32 if s else 4,
            cross_attention_dim=ctx, attention_head_dim=8 if s else 4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D") if s
            else ("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D") if s
            else ("UpBlock2D", "CrossAttnUpBlock2D"))
        return model, {"sample": torch.randn(b, 4, size, size, device=device),
                       "timestep": torch.randint(0, 1000, (b,), device=device),
                       "encoder_hidden_states": torch.randn(b, 77 if s else 4, ctx, device=device)}

    def autoencoder_kl() -> Built:
        import diffusers

        size, b = (128, 4 * scale) if s else (8, 2)
        model = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512) if s else (8, 8),
            down_block_types=("DownEncoderBlock2D",) * (3 if s else 2),
            up_block_types=("UpDecoderBlock2D",) * (3 if s else 2), norm_num_groups=32 if s else 4,
            layers_per_block=2 if s else 1, sample_size=size)
        return model, {"sample": torch.randn(b, 3, size, size, device=device)}

    return {"bert": bert, "gpt2": gpt2, "llama": lambda: llama_like("llama"), "qwen2": lambda: llama_like("qwen2"),
            "t5": t5, "vit": vit, "clip_vision": clip_vision, "unet2d": unet2d,
            "unet2d_condition": unet2d_condition, "autoencoder_kl": autoencoder_kl}


def loss_of(out: Any) -> torch.Tensor:
    """A scalar from a model's first floating output (logits, last hidden state, sample)."""
    first = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().pow(2).mean()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stepper(model: nn.Module, inputs: dict[str, Any], precision: str, device: torch.device) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(**inputs)
        loss_of(out).backward()
        opt.step()

    return step


def timed(step: Callable[[], None], steps: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / steps


def peak(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Peak allocated and reserved GiB of one step (after the other model's memory went back)."""
    if device.type != "cuda":
        return 0.0, 0.0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return (round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            round(torch.cuda.max_memory_reserved(device) / 2**30, 2))


def kernels(step: Callable[[], None], device: torch.device) -> tuple[int, float]:
    """CUDA kernels one step launches and their summed GPU time in ms (the work, without the host's timing noise)."""
    if device.type != "cuda":
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), round(sum(e.device_time for e in events) / 1e3, 2)


def run(name: str, build: Callable[[], Built], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    source, inputs = build()
    source = source.to(device).train()
    twin = copy.deepcopy(source)
    start = time.perf_counter()
    seq = seqify.convert(twin, example_inputs=inputs)  # checked against the source on these inputs
    converted_s = time.perf_counter() - start
    steps = {"source": stepper(source, inputs, args.precision, device),
             "converted": stepper(seq, inputs, args.precision, device)}
    for s in steps.values():
        for _ in range(args.warm):
            s()
    memory = {}
    for k, s in steps.items():  # both models' weights stay resident; neither's gradients count for the other
        for p in [*source.parameters(), *seq.parameters()]:
            p.grad = None
        memory[k] = peak(s, device)
    work = {k: kernels(s, device) for k, s in steps.items()} if args.kernels else {}
    rounds: dict[str, list[float]] = {"source": [], "converted": []}
    for r in range(args.rounds):
        order = ["source", "converted"] if r % 2 == 0 else ["converted", "source"]
        for k in order:
            rounds[k].append(timed(steps[k], args.steps, device))
    ratios = [a / b for a, b in zip(rounds["source"], rounds["converted"])]
    row = {
        "family": name, "class": type(source).__name__, "params_m": round(sum(p.numel() for p in source.parameters()) / 1e6, 1),
        "precision": args.precision, "frontend": seq.frontend, "layers": len(seq), "convert_s": round(converted_s, 1),
        "source_ms": round(1e3 * statistics.median(rounds["source"]), 2),
        "converted_ms": round(1e3 * statistics.median(rounds["converted"]), 2),
        "ratio": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
        "source_gib": memory["source"], "converted_gib": memory["converted"],
    }
    if work:
        row.update({"source_kernels": work["source"][0], "converted_kernels": work["converted"][0],
                    "source_kernel_ms": work["source"][1], "converted_kernel_ms": work["converted"][1]})
    del source, twin, seq, steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=None, help="which families (default: all)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (median of the per-round ratios)")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test)")
    p.add_argument("--scale", type=int, default=1, help="multiply each family's batch (a larger batch is less launch-bound)")
    p.add_argument("--kernels", action="store_true",
                   help="also profile one step of each: CUDA kernels launched and their summed GPU time")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {datetime.date.today()} {name}, torch {torch.__version__}, {args.precision}, batch scale {args.scale}",
          flush=True)
    builders = families(args.tiny, device, args.scale)
    rows: list[dict[str, Any]] = []
    for fam in args.families or list(builders):
        try:
            row = run(fam, builders[fam], args, device)
        except ImportError as e:
            row = {"family": fam, "skipped": f"{type(e).__name__}: {e}"}
        except Exception as e:  # report and go on: one family's failure must not hide the others
            row = {"family": fam, "failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print("\n| family | class | params (M) | frontend | layers | convert s | source ms | converted ms | "
          "converted / source speed | GiB allocated / reserved (source; converted) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ratio" not in r:
            print(f"| {r['family']} | {r.get('skipped') or r.get('failed')} |||||||||")
            continue
        print(f"| {r['family']} | {r['class']} | {r['params_m']} | {r['frontend']} | {r['layers']} | {r['convert_s']} | "
              f"{r['source_ms']} | {r['converted_ms']} | {r['ratio']:.3f} | "
              f"{r['source_gib'][0]} / {r['source_gib'][1]}; {r['converted_gib'][0]} / {r['converted_gib'][1]} |")
    if any("source_kernels" in r for r in rows):
        print("\n| family | CUDA kernels per step (source; converted) | summed kernel ms (source; converted) |")
        print("|---|---|---|")
        for r in rows:
            if "source_kernels" in r:
                print(f"| {r['family']} | {r['source_kernels']}; {r['converted_kernels']} | "
                      f"{r['source_kernel_ms']}; {r['converted_kernel_ms']} |")
    return 0 if all("ratio" in r or "skipped" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
