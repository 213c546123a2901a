"""Sweep: recent Hugging Face decoder families no test names (2024-2025 releases: DeepSeek-V2/V3, gpt-oss,
Qwen3-Next, GLM-4 and its MoE, OLMoE, ERNIE 4.5, MiniMax), state-space and hybrid models (Mamba, Mamba-2,
Falcon-Mamba, Jamba, Zamba2, RecurrentGemma, LFM2), from tiny configs (no download).

    PYTHONPATH=tests python -m helpers.hf_recent [names...] [--trace]

Each builder returns ``(model, kwargs)``; ``harness.check`` converts it with ``frontend="auto"`` and checks it
against its source (eval, a batch one larger, a 2-stage CPU pipeline, a one-sample example, train with gradients).
A family the installed transformers lacks fails at "build" with an AttributeError (the test skips it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helpers import sweep as harness
from helpers.hf_decoders import LLAMA_LIKE, V, Built, causal

L: dict[str, Any] = dict(LLAMA_LIKE)
# DeepSeek-style multi-head latent attention and routed experts (one dense layer first, one MoE layer)
MLA = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=8, q_lora_rank=8)
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
              n_group=1, topk_group=1)
SSM = dict(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2,
           use_cache=False)

REGISTRY: dict[str, Callable[[], Built]] = {
    "deepseek_v2": causal("DeepseekV2ForCausalLM", "DeepseekV2Config", **L, **MLA, **ROUTED),
    "deepseek_v3": causal("DeepseekV3ForCausalLM", "DeepseekV3Config", **L, head_dim=4, **MLA, **ROUTED),
    "dots1": causal("Dots1ForCausalLM", "Dots1Config", **L, head_dim=8, **ROUTED, n_shared_experts=1),
    "gpt_oss": causal("GptOssForCausalLM", "GptOssConfig", **L, head_dim=8, num_local_experts=4,
                      num_experts_per_tok=2, sliding_window=4),
    "qwen3_next": causal("Qwen3NextForCausalLM", "Qwen3NextConfig", **L, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                         linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                         linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
    "glm": causal("GlmForCausalLM", "GlmConfig", **L, head_dim=8, pad_token_id=0, eos_token_id=1),
    "glm4": causal("Glm4ForCausalLM", "Glm4Config", **L, head_dim=8, pad_token_id=0, eos_token_id=1),
    "glm4_moe": causal("Glm4MoeForCausalLM", "Glm4MoeConfig", **L, head_dim=8, **ROUTED),
    "olmoe": causal("OlmoeForCausalLM", "OlmoeConfig", **L, num_experts=4, num_experts_per_tok=2),
    "granitemoe": causal("GraniteMoeForCausalLM", "GraniteMoeConfig", **L, num_local_experts=4,
                         num_experts_per_tok=2),
    "phimoe": causal("PhimoeForCausalLM", "PhimoeConfig", **L, num_local_experts=4, num_experts_per_tok=2),
    "minimax": causal("MiniMaxForCausalLM", "MiniMaxConfig", **L, head_dim=8, num_local_experts=4,
                      num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], block_size=4),
    "ernie4_5": causal("Ernie4_5ForCausalLM", "Ernie4_5Config", **L, head_dim=8),
    "ernie4_5_moe": causal("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", **L, head_dim=8, moe_num_experts=4,
                           moe_k=2, moe_intermediate_size=16, moe_layer_start_index=1),
    "exaone4": causal("Exaone4ForCausalLM", "Exaone4Config", **L, head_dim=8, sliding_window=4),
    "smollm3": causal("SmolLM3ForCausalLM", "SmolLM3Config", **L, pad_token_id=0),
    "helium": causal("HeliumForCausalLM", "HeliumConfig", **L, head_dim=8),
    "nemotron": causal("NemotronForCausalLM", "NemotronConfig", **L, head_dim=8),
    "persimmon": causal("PersimmonForCausalLM", "PersimmonConfig", vocab_size=V, hidden_size=16,
                        intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        max_position_embeddings=32, use_cache=False),
    "hunyuan_dense": causal("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", **L, head_dim=8),
    "seed_oss": causal("SeedOssForCausalLM", "SeedOssConfig", **L, head_dim=8),
    "apertus": causal("ApertusForCausalLM", "ApertusConfig", **L),
    "arcee": causal("ArceeForCausalLM", "ArceeConfig", **L),
    "bitnet": causal("BitNetForCausalLM", "BitNetConfig", **L),
    "mamba": causal("MambaForCausalLM", "MambaConfig", **SSM, use_mambapy=False),
    "mamba2": causal("Mamba2ForCausalLM", "Mamba2Config", **SSM, num_heads=4, head_dim=8, n_groups=1,
                     chunk_size=4),
    "falcon_mamba": causal("FalconMambaForCausalLM", "FalconMambaConfig", **SSM, use_mambapy=False),
    "jamba": causal("JambaForCausalLM", "JambaConfig", **L, num_experts=2, num_experts_per_tok=1,
                    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                    mamba_d_state=4, mamba_d_conv=2, mamba_expand=2),
    "zamba2": causal("Zamba2ForCausalLM", "Zamba2Config", vocab_size=V, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, mamba_d_state=4, mamba_ngroups=1, mamba_headdim=8, n_mamba_heads=4,
                     layers_block_type=["mamba", "hybrid"], use_cache=False, use_mem_rope=False),
    "recurrent_gemma": causal("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", vocab_size=V, hidden_size=16,
                              intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, lru_width=16, attention_window_size=4, conv1d_width=2,
                              block_types=["recurrent", "attention"], head_dim=8, use_cache=False),
    "lfm2": causal("Lfm2ForCausalLM", "Lfm2Config", **L, layer_types=["conv", "full_attention"]),
    "dbrx": causal("DbrxForCausalLM", "DbrxConfig", vocab_size=V, d_model=16, n_layers=2, n_heads=2,
                   max_seq_len=32, attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                   ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}, use_cache=False),
}


if __name__ == "__main__":
    raise SystemExit(harness.main(REGISTRY))
