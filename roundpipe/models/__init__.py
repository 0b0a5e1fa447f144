"""Sequential presets for RoundPipe-supported models.

A preset cuts a Hugging Face causal LM into pipeline layers (embedding prefix, one layer per decoder
layer, norm + loss head) that share the model's own parameters; :func:`wrap_model` returns it as a
:class:`~roundpipe.models.causal_lm.RoundPipeForCausalLM`. Which spec each family gets is one table,
:data:`roundpipe.models.families.FAMILIES`.

Attributes:
    SUPPORTED_MODELS: Model type (``config.model_type``) or model class name -> module holding its
        preset. Built from the family table (the verified types, each mapped to this package, whose
        preset is the table); add an entry to register a third-party preset module, which then wins
        over the table: one exposing ``build_spec(model) -> CausalLMSpec`` (and optionally
        ``MODEL_CLASS``), or ``wrap_model(model, **roundpipe_kwargs)`` returning a RoundPipe model.
        Model types not listed but laid out like Llama (``model.embed_tokens/layers/norm/rotary_emb`` +
        ``lm_head``) get the standard preset, with a warning that the family was not verified.
    with_rope_scaling / position_limit: :mod:`roundpipe.rope_scaling`: set a rotary scaling on a config
        (``with_rope_scaling(config, "yarn:4")`` before ``from_pretrained(..., config=config)``), and the
        longest sequence a config takes, its scaling counted (what the wrapped model checks its inputs against).
    DISABLE_TORCH_COMPILE: Whether torch.compile is off for the fused kernels and the chunked loss; a
        live view of ``roundpipe.settings.DISABLE_TORCH_COMPILE`` (assigning it calls
        ``roundpipe.configure(compile=not value)``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from torch import nn

from roundpipe import settings
from roundpipe.models.registry import (
    BUILTIN,
    SUPPORTED_MODELS,
    Registered,
    build_preset,
    build_spec,
    family_spec,
    preset_for,
    registered_module,
    resolve,
    table_family,
)
from roundpipe.rope_scaling import position_limit, with_rope_scaling


def preset_wrapper(model: nn.Module) -> Callable[..., Any]:
    """The function that wraps ``model`` with its preset: call it with RoundPipe's keyword arguments.

    The preset is built now, so a model without one fails here (``wrap_model_to_roundpipe`` then wraps
    it by size) and the call only builds the RoundPipe.

    Raises:
        NotImplementedError: No preset for this model class.
    """
    found = resolve(model)
    preset = preset_for(model, found)
    if preset is None:
        assert isinstance(found, Registered)
        return functools.partial(found.module.wrap_model, model)
    from roundpipe.models.causal_lm import RoundPipeForCausalLM

    return functools.partial(RoundPipeForCausalLM, model, preset)


def wrap_model(model: nn.Module, fp8: Optional[bool] = None, **roundpipe_kwargs: Any) -> Any:
    """Wrap a supported model with its sequential preset.

    Args:
        model: A Hugging Face ``*ForCausalLM``, or a PEFT model around one.
        fp8: FP8 GEMMs in the decoder layers' projections (:mod:`roundpipe.models.fp8`; default:
            ``model_run_config.fp8``). The frozen base is packed first (``base_format``, which must be
            ``"fp8"`` for a LoRA model), then the layers are converted.
        **roundpipe_kwargs: Forwarded to :class:`~roundpipe.models.causal_lm.RoundPipeForCausalLM`
            (``optim_dtype``, ``name``, ``model_run_config``, ``pin_model``, ``fused_kernels``), or to
            the ``wrap_model`` of a third-party preset module registered for the model.

    Returns:
        A ``RoundPipeForCausalLM`` (or what the registered module's ``wrap_model`` returns).

    Raises:
        NotImplementedError: The model type is not supported, or the class does not match its type's preset.
    """
    from roundpipe.models import fp8 as fp8_gemms

    config = roundpipe_kwargs.get("model_run_config")
    if fp8_gemms.wants_fp8(fp8, config):
        from roundpipe.host.formats import quantize_base
        from roundpipe.runtime.run_config import RoundPipeRunConfig

        quantize_base(model, roundpipe_kwargs.get("base_format", "bf16"))  # packed weights are not packed again
        fp8_gemms.prepare(model, True)
        roundpipe_kwargs["model_run_config"] = dataclasses.replace(config or RoundPipeRunConfig(), fp8=True)
    return preset_wrapper(model)(**roundpipe_kwargs)


class _ModelsModule(ModuleType):
    """The class of this package's module object: ``DISABLE_TORCH_COMPILE`` is a property, so reading
    and assigning it go to the setting (one switch, however it was set)."""

    @property
    def DISABLE_TORCH_COMPILE(self) -> bool:  # noqa: N802 -- the public attribute's name
        return settings.DISABLE_TORCH_COMPILE.get()

    @DISABLE_TORCH_COMPILE.setter
    def DISABLE_TORCH_COMPILE(self, value: bool) -> None:  # noqa: N802
        settings.configure(compile=not bool(value))


sys.modules[__name__].__class__ = _ModelsModule

__all__ = [
    "BUILTIN",
    "DISABLE_TORCH_COMPILE",
    "SUPPORTED_MODELS",
    "Registered",
    "build_preset",
    "build_spec",
    "family_spec",
    "position_limit",
    "preset_wrapper",
    "registered_module",
    "resolve",
    "table_family",
    "with_rope_scaling",
    "wrap_model",
]
