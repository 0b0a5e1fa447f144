"""Generic preset: any decoder-only causal LM laid out ``model.embed_tokens -> model.layers ->
model.norm -> lm_head`` (see :mod:`roundpipe.models.preset`).

Families differ from the standard forward in a few places only; the hooks below cover the ones
transformers 5.x has. ``VERIFIED_MODEL_TYPES`` lists the model types whose loss and gradients were
checked against transformers; other types with the same layout still get this preset, with a warning.
"""

from __future__ import annotations

from typing import Any, Dict

from torch import nn

from roundpipe.models.preset import CausalLMSpec, default_spec, unwrap_peft

MODEL_CLASS = None  # any class with the standard layout

# Loss and every parameter gradient checked against transformers 5.17 and 5.23 (tests/test_models.py).
VERIFIED_MODEL_TYPES = (
    "qwen2",
    "qwen2_moe",
    "mistral",
    "mixtral",
    "ministral",
    "phi3",
    "phimoe",
    "gemma",
    "gemma2",
    "cohere",
    "cohere2",
    "granite",
    "olmo",
    "olmo2",
    "olmoe",
    "starcoder2",
    "smollm3",
    "glm",
    "glm4",
    "helium",
    "stablelm",
    "nemotron",
    "seed_oss",
    "ernie4_5",
    "exaone4",
)

# Same layout, different computation (checked): these must not silently get the generic preset.
INCOMPATIBLE_MODEL_TYPES = ("nanochat", "jetmoe", "doge", "diffllama")


def family_overrides(model_type: str, config: Any) -> Dict[str, Any]:
    """Spec fields that differ from the standard forward, by ``config.model_type``."""
    if model_type in ("cohere", "cohere2", "cohere2_moe"):
        return {"logit_scale": float(config.logit_scale)}
    if model_type in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared"):
        return {"embedding_multiplier": float(config.embedding_multiplier), "logit_scale": 1.0 / config.logits_scaling}
    if model_type == "hyperclovax":
        return {"embedding_multiplier": float(config.embedding_multiplier), "logit_scale": float(config.logits_scaling)}
    return {}


def build_spec(model: nn.Module) -> CausalLMSpec:
    model = unwrap_peft(model)
    return default_spec(model, **family_overrides(model.config.model_type, model.config))
