"""One layout row under torchrun: the configuration a layout row ran in one process, run by
``seqify.distributed.stage(model, config=...)``, one process per device, timed as the in-process rows are.

    torchrun --nproc-per-node 4 benchmarks/layouts/torchrun_layout.py --config layout.toml --per-gpu 128
    torchrun --nproc-per-node 2 benchmarks/layouts/torchrun_layout.py --model llama --per-gpu 4 --config layout.toml

``main.py --torchrun`` runs it after each seqify row, with that row's configuration. Rank 0 prints one JSON row:
samples/s of the whole batch (``--per-gpu`` times the processes), every rank's peak allocated and reserved GiB.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from rank_common import arguments, layouts, peaks, timed

import seqify
import seqify.distributed as sd


def main() -> None:
    p = arguments(__doc__)
    p.add_argument("--name", default="seqify under torchrun")
    args = p.parse_args()
    work = layouts().workload(args.model, args.tiny)
    sd.init()
    x, y = work.data(args.per_gpu * dist.get_world_size())
    seq = seqify.convert(work.build(), (x[:2],) if work.example else None, verify=False)
    stage = sd.stage(seq, config=args.config)
    share = slice(stage.replica * len(x) // stage.replicas, (stage.replica + 1) * len(x) // stage.replicas)
    inputs = x[share].to(stage.device) if stage.is_first else None
    target = y[share].to(stage.device) if stage.is_last else None
    opt = stage.optimizer(work.optimizer)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(stage.device.type, dtype=torch.bfloat16, enabled=work.autocast):
            stage.step(inputs, target, loss_fn=work.loss if stage.is_last else None)
        opt.step()

    seconds = timed(step, stage.device, args.steps, args.warm)
    allocated, reserved, held = peaks(stage.device)
    if dist.get_rank() == 0:
        print(json.dumps(dict(row=args.name, batch=len(x), samples_per_s=len(x) / seconds, peak_gib=allocated,
                              reserved_gib=reserved, in_use_gib=held)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
