"""Probe: where a converted Llama's bf16 training step spends more GPU time than its source's (one GPU)."""
import torch, transformers, seqify
from torch.profiler import profile, ProfilerActivity
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=2048, use_cache=False)
torch.manual_seed(0)
with torch.device("cuda"):
    lm = LlamaForCausalLM(cfg)
ids = torch.randint(0, 32000, (8, 2048), device="cuda")
seq = seqify.convert(lm, example_inputs={"input_ids": ids[:2]}, frontend="export", verify=False)
calls = [(op.args[3:], op.kwargs) for layer in seq for op in getattr(layer, "ops", []) if "scaled_dot" in str(op.target)]
print("transformers", transformers.__version__, "sdpa calls", len(calls), "first", calls[:1])

def step(model):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()

for name, model in (("source", lm), ("converted", seq)):
    for _ in range(2):
        step(model)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model)
        torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
