"""torch.distributed.pipelining on the Llama of llama_bench.py, cut by hand at decoder-layer boundaries (as
torchtitan does): the anchor seqify's Llama rows are measured against, in the same device call.

    torchrun --nproc-per-node 2 benchmarks/llama_anchor.py --chunks 4 8 --out DIR    # rows: DIR/llama-torchpp.json
    python benchmarks/llama_anchor.py --table DIR/llama.json DIR/llama-torchpp.json   # one table, ratios to one GPU

The model and batch are llama_bench.py's defaults (0.89 B parameters, batch 8 x 2048 tokens, bf16 autocast,
fp32 weights, SGD). Two-stage schedules (GPipe, 1F1B) run with ``--cuts`` decoder layers on the first stage;
four-stage ones (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) with the layers in even quarters. Each
row has every rank's peak allocated and reserved GiB; a schedule this torch lacks or that fails is an error row.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import llama_bench
import ranks


class Part(nn.Module):
    """Decoder layers [lo, hi) of a LlamaForCausalLM; the first part embeds, the last normalises and projects."""

    def __init__(self, lm: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = lm.model.embed_tokens if first else None
        self.layers = nn.ModuleList(lm.model.layers[lo:hi])
        self.rotary = lm.model.rotary_emb
        self.norm = lm.model.norm if last else None
        self.head = lm.lm_head if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.head(self.norm(h))
        return h


def parts(lm: nn.Module, edges: list[int]) -> list[Part]:
    n = len(edges) - 1
    return [Part(lm, edges[i], edges[i + 1], i == 0, i == n - 1) for i in range(n)]


def stages_of(placement: str, rank: int) -> list[int]:
    """The stages a rank holds: one of two, looped (r and r + 2) or a V (r and 3 - r) of four."""
    return {"one": [rank], "loop": [rank, rank + 2], "v": [rank, 3 - rank]}[placement]


def settings(args: argparse.Namespace, layers: int) -> list[tuple[str, list[int], str, int]]:
    """(schedule class name, decoder-layer edges of the stages, placement, chunks) for every row."""
    quarters = [round(i * layers / 4) for i in range(5)]
    out = []
    for chunks in args.chunks:
        for name in ("GPipe", "1F1B"):
            out += [(name, [0, cut, layers], "one", chunks) for cut in args.cuts]
        out.append(("Interleaved1F1B", quarters, "loop", chunks))
        out.append(("InterleavedZeroBubble", quarters, "loop", chunks))
        out.append(("ZBVZeroBubble", quarters, "v", chunks))
    return out


def run(args: argparse.Namespace) -> None:
    import torch.distributed.pipelining as tpp
    from torch.distributed.pipelining import PipelineStage
    from transformers import LlamaForCausalLM

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    cfg = llama_bench.config(argparse.Namespace(tiny=False, size="default", vocab=32000, hidden=2048, layers=16,
                                                heads=16, kv_heads=8, seq=args.seq))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    rows: list[dict[str, Any]] = []
    for sname, edges, placement, chunks in settings(args, cfg.num_hidden_layers):
        n = len(edges) - 1
        cut = f"-cut{edges[1]}" if n == 2 and edges[1] != cfg.num_hidden_layers // 2 else ""
        name = f"llama-torchpp-{sname}{cut}-c{chunks}"
        try:
            torch.manual_seed(0)
            lm = LlamaForCausalLM(cfg)  # on the CPU: only this rank's stages move to its GPU
            every = parts(lm, edges)
            mine = stages_of(placement, rank)
            stages = [PipelineStage(every[i].to(device), i, n, device) for i in mine]
            lm = every = None
            sched = getattr(tpp, "Schedule" + sname)(stages if n > 2 else stages[0], n_microbatches=chunks,
                                                      loss_fn=llama_bench.loss_of)
            opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
            last = any(i == n - 1 for i in mine)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    kw: dict[str, Any] = dict(target=ids, losses=[]) if last else {}
                    sched.step(ids, **kw) if 0 in mine else sched.step(**kw)
                opt.step()

            sec, peaks = ranks.measure(step, args.warm, args.steps, device)
            r = ranks.row(name, args.batch, sec, peaks, reserved_gib=ranks.reserved(device),
                          tokens_per_s=round(args.batch * args.seq / sec), stages=mine, edges=edges)
        except Exception as e:  # noqa: BLE001 - one schedule failing still reports the others
            r = ranks.error_row(name, e)
        stages = sched = opt = None
        ranks.report(rows, r)  # (ranks.measure resets the peaks after each configuration's warm-up steps)
    ranks.finish(rows, os.path.join(args.out, "llama-torchpp.json"))


def table(bench: str, anchor: str) -> str:
    """seqify's rows (llama_bench.py) and the anchor's, each as a ratio to the one-GPU source row of `bench`."""
    with open(bench) as f:
        ours = json.load(f)["rows"]
    try:
        with open(anchor) as f:
            theirs = json.load(f)
    except (OSError, ValueError) as e:
        theirs = [{"name": anchor, "error": f"no rows ({type(e).__name__})"}]
    one = next((r["tokens_per_s"] for r in ours if r["name"].startswith("source") and "tokens_per_s" in r), None)
    lines = [f"{'configuration':<72} {'tokens/s':>9} {'x one GPU':>9}  {'allocated GiB':>13}  {'reserved GiB':>13}"]
    for r in ours + theirs:
        if "tokens_per_s" not in r:
            lines.append(f"{r.get('name', '?'):<72} {r.get('error', 'no result')}")
            continue
        alloc = r.get("peak_allocated_gib") or r.get("peak_gib")
        res = r.get("peak_reserved_gib") or r.get("reserved_gib")
        ratio = f"{r['tokens_per_s'] / one:.3f}" if one else "-"
        lines.append(f"{r['name']:<72} {r['tokens_per_s']:>9} {ratio:>9}  "
                     f"{' / '.join(f'{v:.1f}' for v in alloc):>13}  {' / '.join(f'{v:.1f}' for v in res):>13}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--cuts", type=int, nargs="+", default=[8, 9], help="decoder layers on the first of two stages")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--out", default=".")
    p.add_argument("--table", nargs=2, metavar=("LLAMA_JSON", "ANCHOR_JSON"))
    args = p.parse_args()
    if args.table:
        print(table(*args.table))
        return
    run(args)


if __name__ == "__main__":
    main()
