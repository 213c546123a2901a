"""Sweep: Hugging Face transformers decoder language models that no test names, from tiny configs (no download).

    PYTHONPATH=tests python -m helpers.hf_decoders [names...] [--trace]

Each builder returns ``(model, kwargs)``; ``harness.check`` converts it with ``frontend="auto"`` and checks it
against its source (eval, a batch one larger, a 2-stage CPU pipeline, train with gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from helpers import sweep as harness

import transformers

B, T, V = 2, 8, 64
Built = tuple[nn.Module, dict[str, Any]]


def ids(batch: int = B, low: int = 0) -> torch.Tensor:
    return torch.randint(low, V, (batch, T), generator=torch.Generator().manual_seed(batch))


# the fields most Llama-shaped configs share (hidden 16, 2 heads of 8, 1 KV head, 2 layers)
LLAMA_LIKE = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32, use_cache=False)


def causal(model_cls: str, config_cls: str, **fields: Any) -> Callable[[], Built]:
    def build() -> Built:
        cfg = getattr(transformers, config_cls)(**fields)
        return getattr(transformers, model_cls)(cfg), {"input_ids": ids()}
    build.__name__ = model_cls
    return build


def llama_cfg(**extra: Any) -> Any:
    return transformers.LlamaConfig(**{**LLAMA_LIKE, **extra})


def llama_padded() -> Built:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T // 2:] = 0  # one row half padded (right padding)
    return transformers.LlamaForCausalLM(llama_cfg()), {"input_ids": ids(), "attention_mask": mask}


def llama_left_padded() -> Built:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :T // 2] = 0  # one row half padded on the left (as for generation)
    return transformers.LlamaForCausalLM(llama_cfg()), {"input_ids": ids(), "attention_mask": mask}


def padded(build: Callable[[], Built]) -> Callable[[], Built]:
    """``build`` with an attention mask whose second row is half padded."""
    def with_mask() -> Built:
        model, kwargs = build()
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, T // 2:] = 0
        return model, {**kwargs, "attention_mask": mask}
    return with_mask


def no_pipeline(build: Callable[[], Built]) -> Callable[[], Built]:
    """A model that returns its loss (a 0-dim tensor): micro-batches' losses do not join, so seqify.pipeline
    refuses it (BoundaryError naming pipe.step); the other checks run."""
    build.pipeline = False  # type: ignore[attr-defined]
    return build


def mixtral_eager_experts() -> Built:
    """Mixtral with transformers' eager experts (a Python loop over the experts the tokens hit): data-dependent
    routing torch.export cannot capture; expected to be refused (ExportError at the loop), never a wrong model.
    The default experts implementation (grouped_mm) converts."""
    cfg = transformers.MixtralConfig(**LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    return transformers.MixtralForCausalLM(cfg), {"input_ids": ids()}


def llama_labels() -> Built:
    x = ids()
    return transformers.LlamaForCausalLM(llama_cfg()), {"input_ids": x, "labels": x}


def llama_seq_cls() -> Built:
    cfg = llama_cfg(num_labels=3, pad_token_id=0)
    return transformers.LlamaForSequenceClassification(cfg), {"input_ids": ids(low=1)}


def gpt2_cfg(**extra: Any) -> Any:
    return transformers.GPT2Config(**{**dict(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                             bos_token_id=0, eos_token_id=0, use_cache=False), **extra})


def gpt2_labels() -> Built:
    x = ids()
    return transformers.GPT2LMHeadModel(gpt2_cfg(tie_word_embeddings=False)), {"input_ids": x, "labels": x}


def gpt2_tied() -> Built:
    return transformers.GPT2LMHeadModel(gpt2_cfg(tie_word_embeddings=True)), {"input_ids": ids()}


REGISTRY: dict[str, Callable[[], Built]] = {}
REGISTRY.update({
    "mistral": causal("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE, sliding_window=4),
    "mixtral": causal("MixtralForCausalLM", "MixtralConfig", **LLAMA_LIKE, num_local_experts=4,
                      num_experts_per_tok=2),
    "mixtral_eager_experts": mixtral_eager_experts,
    "phi": causal("PhiForCausalLM", "PhiConfig", **LLAMA_LIKE),
    "phi3": causal("Phi3ForCausalLM", "Phi3Config", **LLAMA_LIKE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma": causal("GemmaForCausalLM", "GemmaConfig", **LLAMA_LIKE, head_dim=8),
    "gemma2": causal("Gemma2ForCausalLM", "Gemma2Config", **LLAMA_LIKE, head_dim=8, sliding_window=4,
                     query_pre_attn_scalar=8),
    "gemma3": causal("Gemma3ForCausalLM", "Gemma3TextConfig", **LLAMA_LIKE, head_dim=8, sliding_window=4,
                     query_pre_attn_scalar=8, sliding_window_pattern=2),
    "falcon": causal("FalconForCausalLM", "FalconConfig", vocab_size=V, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, use_cache=False),
    "falcon_new_arch_alibi": causal("FalconForCausalLM", "FalconConfig", vocab_size=V, hidden_size=16,
                                    num_hidden_layers=2, num_attention_heads=2, num_kv_heads=1,
                                    new_decoder_architecture=True, alibi=True, use_cache=False),
    "opt": causal("OPTForCausalLM", "OPTConfig", vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                  num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False),
    "bloom": causal("BloomForCausalLM", "BloomConfig", vocab_size=V, hidden_size=16, n_layer=2, n_head=2,
                    use_cache=False),
    "gpt_neo": causal("GPTNeoForCausalLM", "GPTNeoConfig", vocab_size=V, hidden_size=16, num_layers=2, num_heads=2,
                      intermediate_size=32, max_position_embeddings=32, window_size=4,
                      attention_types=[[["global", "local"], 1]], use_cache=False),
    "gpt_neox": causal("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, max_position_embeddings=32, use_cache=False),
    "gptj": causal("GPTJForCausalLM", "GPTJConfig", vocab_size=V, n_embd=16, n_layer=2, n_head=2, rotary_dim=4,
                   n_positions=32, use_cache=False),
    "stablelm": causal("StableLmForCausalLM", "StableLmConfig", **LLAMA_LIKE),
    "starcoder2": causal("Starcoder2ForCausalLM", "Starcoder2Config", **LLAMA_LIKE),
    "olmo": causal("OlmoForCausalLM", "OlmoConfig", **LLAMA_LIKE, pad_token_id=0),
    "olmo2": causal("Olmo2ForCausalLM", "Olmo2Config", **LLAMA_LIKE, pad_token_id=0),
    "qwen3": causal("Qwen3ForCausalLM", "Qwen3Config", **LLAMA_LIKE, head_dim=8),
    "qwen2_moe": causal("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **LLAMA_LIKE, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3_moe": causal("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **LLAMA_LIKE, head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16),
    "codegen": causal("CodeGenForCausalLM", "CodeGenConfig", vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                      rotary_dim=4, n_positions=32, n_ctx=32, use_cache=False),
    "cohere": causal("CohereForCausalLM", "CohereConfig", **LLAMA_LIKE, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2),
    "gpt_bigcode": causal("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=V, n_embd=16, n_layer=2, n_head=2,
                          n_positions=32, use_cache=False),
    "granite": causal("GraniteForCausalLM", "GraniteConfig", **LLAMA_LIKE),
    "llama_seq_cls": llama_seq_cls,
    "llama_padded": llama_padded,
    "llama_left_padded": llama_left_padded,
    "llama_labels": no_pipeline(llama_labels),
    "gpt2_labels": no_pipeline(gpt2_labels),
    "gpt2_tied": gpt2_tied,
})
REGISTRY.update({f"{name}_padded": padded(REGISTRY[name]) for name in
                 ("mistral", "gemma2", "phi3", "qwen2_moe", "opt", "bloom", "falcon", "gpt_neox")})


if __name__ == "__main__":
    raise SystemExit(harness.main(REGISTRY))
