"""``python -m seqify.zoo``: print the zoo table; --write regenerates docs/zoo.md and the cached hints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seqify.zoo.catalog import ENTRIES
from seqify.zoo.plans import HINTS_FILE, versions
from seqify.zoo.table import markdown, rows, write_hints

DOC = Path(__file__).resolve().parents[2] / "docs" / "zoo.md"

INTRO = """# seqify.zoo

Every model below is `seqify.zoo.get(name)`: the source model converted into an exact, pipeline-ready
`seqify.Sequential`. The torchvision models are torchvision's own code by their torchvision names
(`weights=` loads torchvision's weights through `load_original_state_dict`; nothing downloads unless you
ask); `unet` and `amoebanet_d` are seqify's implementations of the GPipe literature's models; `llama`
and `gpt2` are Hugging Face transformers' LlamaForCausalLM and GPT2LMHeadModel built from a config (no
download; `pip install 'seqify[hf]'`), converted by the export frontend on token ids.

```python
import seqify
seq = seqify.zoo.get("resnet101")                              # random init, no download
seq = seqify.zoo.get("resnet50", weights="IMAGENET1K_V2")      # torchvision weights (downloads)
seq = seqify.zoo.get("resnet50", weights="resnet50.pth")       # a checkpoint of the source model
seq = seqify.zoo.get("amoebanet_d", layers=18, filters=256)    # GPipe's AmoebaNet-D(18, 256)
pipe = seqify.pipeline(seq, gpus=4, balance=seqify.zoo.hints("amoebanet_d", 4, layers=18, filters=256))
seq = seqify.zoo.get("llama", preset="0.89b")                  # hidden 2048, 16 layers, 16 heads, 8 KV heads
pipe = seqify.pipeline(seq, gpus=2, balance=seqify.zoo.hints("llama", 2, preset="0.89b"))
```

The language models take token ids (`seqify.zoo.sample("llama", batch=8)`: 8 x 128 `input_ids`); their rows
are the default `preset="tiny"` (4 decoder layers, CPU-sized). Presets: `llama` `"tiny"`, `"0.89b"`, `"8b"`;
`gpt2` `"tiny"`, `"124m"`, `"355m"`, `"774m"`, `"1.5b"`; any config field overrides them
(`num_hidden_layers=8`). The sequence length is fixed at conversion (pass `example_inputs={"input_ids":
ids}` for another); their hints cut only between decoder layers, where there are enough of them (8 GPUs
over 4 decoder layers cut anywhere).

Columns: parameters, layers and skips of the conversion; the default input the plans are computed on
(batch 1, or 2 where BatchNorm needs two values per channel); and the recommended balance (layers \
per stage) for 2, 4 and 8 GPUs: the exact by-FLOPs plan
from `seqify.balance(seq, n, sample, by="flops")` (fake tensors, no compute), with its imbalance (largest
stage cost / mean stage cost) in parentheses. `seqify.zoo.hints(name, n)` returns the same lists. FLOPs
miss memory-bound layers (BatchNorm, activations): on GPUs, `balance="time"` with a real sample usually
does better (README, Balance).

This file is generated: `python -m seqify.zoo --write` (also refreshes `zoo/hints.json`).
"""


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return ""
    return str(transformers.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqify.zoo", description=__doc__)
    p.add_argument("names", nargs="*", help="zoo models (default: all)")
    p.add_argument("--write", action="store_true", help=f"write {DOC} and {HINTS_FILE.name} (all models only)")
    p.add_argument("--check", action="store_true",
                   help="check every model converts and pipelines exactly (small sizes)")
    args = p.parse_args(argv)
    names = args.names or list(ENTRIES)
    from seqify.errors import ZooError
    from seqify.zoo import entry

    try:
        for n in names:
            entry(n)  # unknown names fail here, with close matches
    except ZooError as e:
        print(f"python -m seqify.zoo: error: {e}", file=sys.stderr)
        return 2  # a usage error, as for the seqify command
    missing = [n for n in names if not ENTRIES[n].available]
    if missing and args.write:
        print(f"python -m seqify.zoo: error: --write needs every model; {', '.join(missing)} need transformers: "
              "pip install 'seqify[hf]'", file=sys.stderr)
        return 2
    if missing and not args.names:  # the whole zoo: what needs an optional extra that is not installed is skipped
        print(f"skipped {', '.join(missing)}: they need transformers (pip install 'seqify[hf]')", file=sys.stderr)
        names = [n for n in names if n not in missing]
    if args.check:
        from seqify.zoo.check import check_all

        failed = [c for c in check_all(names) if not c.ok]
        for c in failed:
            print(f"{c.name}: exact={c.exact} pipelined={c.pipelined}")
        print(f"{len(names) - len(failed)} of {len(names)} zoo models convert and pipeline exactly")
        return 1 if failed else 0
    table = rows(names)
    text = markdown(table)
    if args.write:
        if args.names:
            p.error("--write regenerates the whole table; give no names")
        write_hints(table)
        v = versions()
        DOC.parent.mkdir(parents=True, exist_ok=True)
        extra = f", transformers {_transformers_version()}" if _transformers_version() else ""
        computed = f"\nComputed with torch {v['torch']}, torchvision {v['torchvision']}{extra}.\n\n"
        DOC.write_text(INTRO + computed + text + "\n")
        print(f"wrote {DOC} and {HINTS_FILE}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
