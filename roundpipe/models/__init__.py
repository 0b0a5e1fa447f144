"""Sequential presets for RoundPipe-supported models.

A preset cuts a Hugging Face causal LM into pipeline layers (embedding prefix, one layer per decoder
layer, norm + loss head) that share the model's own parameters; :func:`wrap_model` returns it as a
:class:`~roundpipe.models.causal_lm.RoundPipeForCausalLM`.

Attributes:
    SUPPORTED_MODELS: ``config.model_type`` -> module holding that family's preset. Model types not
        listed but laid out like Llama (``model.embed_tokens/layers/norm/rotary_emb`` + ``lm_head``) use
        the generic preset, with a warning that the family was not verified.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Dict

from torch import nn

from roundpipe.models import generic

_GENERIC = "roundpipe.models.generic"

SUPPORTED_MODELS: Dict[str, str] = {
    "qwen3": "roundpipe.models.qwen3",
    "llama": "roundpipe.models.llama",
    "qwen3_moe": "roundpipe.models.qwen3_moe",
    "gpt_oss": "roundpipe.models.gpt_oss",
    **{model_type: _GENERIC for model_type in generic.VERIFIED_MODEL_TYPES},
}

logger = logging.getLogger("roundpipe")


def _preset_module(model: nn.Module) -> ModuleType:
    """The preset module for ``model`` (a Hugging Face causal LM, possibly inside PEFT)."""
    from roundpipe.models.preset import has_standard_layout, unwrap_peft

    base = unwrap_peft(model)
    name = type(base).__name__
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    path = SUPPORTED_MODELS.get(model_type)
    if path is None:
        if model_type in generic.INCOMPATIBLE_MODEL_TYPES or not has_standard_layout(base) or not name.endswith("ForCausalLM"):
            raise NotImplementedError(
                f"{name}: no RoundPipe sequential preset (model_type={model_type!r}); supported: "
                f"{sorted(SUPPORTED_MODELS)} and decoder-only causal LMs laid out model.embed_tokens -> "
                "model.layers -> model.norm -> lm_head"
            )
        logger.warning(
            "%s (model_type=%r) uses the generic causal-LM preset, which was not verified for this family; "
            "compare one forward with the Hugging Face model before training.",
            name,
            model_type,
        )
        path = _GENERIC
    module = importlib.import_module(path)
    expected = module.MODEL_CLASS
    if expected is None:
        if not name.endswith("ForCausalLM"):
            raise NotImplementedError(f"{name}: the {model_type!r} preset supports *ForCausalLM classes only")
    elif name != expected:
        raise NotImplementedError(f"{name}: the {model_type!r} preset supports {expected} only")
    return module


def build_preset(model: nn.Module) -> "CausalLMPreset":  # noqa: F821
    """The :class:`~roundpipe.models.preset.CausalLMPreset` (pipeline layers + glue) for ``model``.

    Raises:
        NotImplementedError: No preset for this model class.
    """
    from roundpipe.models.preset import CausalLMPreset

    return CausalLMPreset(model, _preset_module(model).build_spec(model))


def wrap_model(model: nn.Module, **roundpipe_kwargs: Any) -> "RoundPipeForCausalLM":  # noqa: F821
    """Wrap a supported model with its sequential preset.

    Args:
        model: A Hugging Face ``*ForCausalLM``, or a PEFT model around one.
        **roundpipe_kwargs: Forwarded to :class:`~roundpipe.roundpipe.RoundPipe` (``optim_dtype``,
            ``name``, ``model_run_config``, ``pin_model``).

    Raises:
        NotImplementedError: The model type is not supported, or the class does not match its type's preset.
    """
    from roundpipe.models.causal_lm import RoundPipeForCausalLM

    return RoundPipeForCausalLM(model, preset=build_preset(model), **roundpipe_kwargs)


__all__ = ["SUPPORTED_MODELS", "build_preset", "wrap_model"]
