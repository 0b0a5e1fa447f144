"""Hugging Face configs of the model families RoundPipe presets, built from one place: tiny ones for tests
and smoke runs, and the named Qwen3 sizes of ``roundpipe.flavors`` for benchmarks.

    tiny_config("llama", num_hidden_layers=2)          # 2 layers, hidden 32, vocab 128
    flavor_config("qwen3-1.7b")                        # the benchmark workload's Qwen3Config

Every field can be overridden by keyword; a tiny config's sizes are small enough that a float64 forward
and backward of a few short sequences runs in milliseconds on one CPU core. MoE families get a few small
experts, and the families with sliding windows keep them off unless asked for.
"""

from __future__ import annotations

from typing import Any, Dict

from roundpipe import flavors

TINY: Dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
    initializer_range=0.1,
    use_cache=False,
)
"""The sizes every tiny config shares (any of them can be overridden)."""

TINY_MOE: Dict[str, Dict[str, Any]] = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
}
"""What a tiny mixture of experts adds per family: four small experts, two per token."""

CONFIG_CLASSES: Dict[str, str] = {
    "qwen3": "Qwen3Config",
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",
}
"""Family (``config.model_type``) -> the transformers config class."""


def config_class(family: str) -> Any:
    """The transformers config class of ``family``; a ``KeyError`` naming the known families otherwise."""
    import transformers

    if family not in CONFIG_CLASSES:
        raise KeyError(f"no config for family {family!r}; known: {sorted(CONFIG_CLASSES)}")
    return getattr(transformers, CONFIG_CLASSES[family])


def tiny_config(family: str = "qwen3", **overrides: Any) -> Any:
    """A small config of ``family`` (:data:`TINY`, plus :data:`TINY_MOE` for a mixture of experts) with
    ``overrides`` applied last."""
    fields = {**TINY, **TINY_MOE.get(family, {}), **overrides}
    return config_class(family)(**fields)


def flavor_config(name: str, **overrides: Any) -> Any:
    """The ``Qwen3Config`` of the named size in :data:`roundpipe.flavors.QWEN3` (``"qwen3-8b"``), as the
    benchmarks build it: sdpa attention, no KV cache, the 40,960-position limit of the released models."""
    fields = dict(
        flavors.QWEN3[name].config_fields(), max_position_embeddings=40960, use_cache=False, attn_implementation="sdpa"
    )
    return config_class("qwen3")(**{**fields, **overrides})


__all__ = ["CONFIG_CLASSES", "TINY", "TINY_MOE", "config_class", "flavor_config", "tiny_config"]
