"""What a user with two GPUs would pick instead of a pipeline: data parallelism. A Llama-architecture
causal LM (0.89 B parameters, the config below; batch B x sequence S in all, split over the ranks) trained with DDP and with
FSDP2 (fully_shard on every decoder layer and the root), bf16 autocast, fp32 weights, SGD.

    torchrun --nproc-per-node 2 benchmarks/data_parallel/fsdp.py            # prints JSON rows on rank 0
Rows: global tokens/s and every rank's peak allocated / reserved GiB.
"""
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

B = int(os.environ.get("B", 8))
S = int(os.environ.get("S", 2048))
STEPS = int(os.environ.get("STEPS", 5))
WARM = int(os.environ.get("WARM", 2))
MODES = os.environ.get("MODES", "ddp,fsdp").split(",")
SIZE = os.environ.get("SIZE", "0.89b")  # or 8b: the ~8 B config (fp32 weights; with OPT=adam it fits no one GPU)
OPT = os.environ.get("OPT", "sgd")
GIB = 2**30


def config():
    from transformers import LlamaConfig
    if SIZE == "8b":
        return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=S, use_cache=False)
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=S, use_cache=False)


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def main():
    from transformers import LlamaForCausalLM
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
    ids_all = torch.randint(0, 32000, (B, S), generator=torch.Generator().manual_seed(0))
    ids = ids_all.chunk(world)[rank].to(dev)
    for mode in MODES:
        torch.manual_seed(0)
        with torch.device(dev):
            lm = LlamaForCausalLM(config())
        if mode == "ddp":
            model = nn.parallel.DistributedDataParallel(lm, device_ids=[rank])
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in lm.model.layers:
                fully_shard(layer)
            fully_shard(lm)
            model = lm
        opt = (torch.optim.Adam(model.parameters(), lr=1e-5) if OPT == "adam"
               else torch.optim.SGD(model.parameters(), lr=1e-3))

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss = loss_fn(logits, ids)
            loss.backward()
            opt.step()
            return loss.detach()

        torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(WARM):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        sec = (time.perf_counter() - t) / STEPS
        mem = torch.tensor([torch.cuda.max_memory_allocated(dev) / GIB, torch.cuda.max_memory_reserved(dev) / GIB],
                           device=dev)
        every = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(every, mem)
        if rank == 0:
            print(json.dumps(dict(name=f"llama{SIZE}-{mode}-{OPT}-bf16", world=world, batch=B, seq=S,
                                  tokens_per_s=round(B * S / sec), sec_per_step=round(sec, 4),
                                  peak_gib=[round(float(m[0]), 2) for m in every],
                                  reserved_gib=[round(float(m[1]), 2) for m in every])), flush=True)
        del model, lm, opt, step
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
