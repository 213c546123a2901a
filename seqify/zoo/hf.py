"""Hugging Face transformers language models built from a config (no download): Llama and GPT-2, by preset."""

from __future__ import annotations

from typing import Any

from torch import nn

from seqify.errors import ZooError

__all__ = ["LLAMA_PRESETS", "GPT2_PRESETS", "llama", "gpt2", "config", "vocab_size"]

#: Llama sizes (LlamaConfig fields). ``tiny`` (the default) runs in seconds on a CPU; ``0.89b`` is the model
#: of README's GPU runs (hidden 2048, 16 layers, 16 heads, 8 KV heads, vocabulary 32000); ``8b`` has Llama
#: 3 8B's layer shapes with a 32000-token vocabulary (too large to train with Adam on one 141 GB GPU).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
    "0.89b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 4096},
    "8b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192},
}

#: GPT-2 sizes (GPT2Config fields): ``tiny`` (the default) for CPUs, and OpenAI's four published sizes.
GPT2_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 256, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256,
             "bos_token_id": 0, "eos_token_id": 0},  # GPT-2's 50256 lies outside a small vocabulary
    "124m": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
    "355m": {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024},
    "774m": {"vocab_size": 50257, "n_embd": 1280, "n_layer": 36, "n_head": 20, "n_positions": 1024},
    "1.5b": {"vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25, "n_positions": 1024},
}

_PRESETS = {"llama": LLAMA_PRESETS, "gpt2": GPT2_PRESETS}
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}


def config(family: str, preset: str = "tiny", **fields: Any) -> dict[str, Any]:
    """The config fields of ``family`` (``'llama'`` or ``'gpt2'``) at ``preset``, overridden by ``fields``;
    ``use_cache`` is off (a converted model runs whole sequences: training, prefill)."""
    presets = _PRESETS[family]
    if preset not in presets:
        raise ZooError(f"zoo model {family!r} has no preset {preset!r}; choose one of {', '.join(presets)} "
                       "(or give config fields, e.g. num_hidden_layers=8)")
    return {**presets[preset], "use_cache": False, **fields}


def vocab_size(family: str, preset: str = "tiny", **fields: Any) -> int:
    """The vocabulary size the model built with these arguments has: token ids for it are below this."""
    return int(config(family, preset, **fields)["vocab_size"])


def _build(family: str, preset: str, fields: dict[str, Any]) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ZooError(
            f"zoo model {family!r} is a Hugging Face transformers model, and transformers is not installed: "
            "pip install 'seqify[hf]'"
        ) from None
    config_name, model_name = _CLASSES[family]
    values = config(family, preset, **fields)
    try:
        cfg = getattr(transformers, config_name)(**values)
    except Exception as e:
        raise ZooError(f"zoo model {family!r}: {config_name}(**{values}) failed: {type(e).__name__}: {e}") from e
    return getattr(transformers, model_name)(cfg)


def llama(preset: str = "tiny", **fields: Any) -> nn.Module:
    """A ``transformers.LlamaForCausalLM`` at ``preset`` (``LLAMA_PRESETS``) with LlamaConfig ``fields``
    overridden, e.g. ``llama("0.89b")``, ``llama(num_hidden_layers=8, hidden_size=256)``. Random weights."""
    return _build("llama", preset, fields)


def gpt2(preset: str = "tiny", **fields: Any) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` at ``preset`` (``GPT2_PRESETS``) with GPT2Config ``fields``
    overridden, e.g. ``gpt2("124m")``, ``gpt2(n_layer=6)``. Random weights."""
    return _build("gpt2", preset, fields)
