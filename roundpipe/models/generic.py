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

VERIFIED_MODEL_TYPES = ("qwen2", "mistral", "phi3", "gemma", "gemma2")


def family_overrides(model_type: str, config: Any) -> Dict[str, Any]:
    """Spec fields that differ from the standard forward, by ``config.model_type``."""
    if model_type in ("cohere", "cohere2"):
        return {"logit_scale": float(config.logit_scale)}
    if model_type in ("gemma2", "gemma3_text"):
        return {"softcap": config.final_logit_softcapping}
    return {}


def build_spec(model: nn.Module) -> CausalLMSpec:
    model = unwrap_peft(model)
    return default_spec(model, **family_overrides(model.config.model_type, model.config))
