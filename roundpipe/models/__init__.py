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
    DISABLE_TORCH_COMPILE: Whether torch.compile is off for the fused kernels and the chunked loss; a
        live view of ``roundpipe.settings.DISABLE_TORCH_COMPILE`` (assigning it calls
        ``roundpipe.configure(compile=not value)``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Union

from torch import nn

from roundpipe import settings
from roundpipe.models import families
from roundpipe.models.families import ModelFamily
from roundpipe.models.preset import (
    CausalLMPreset,
    CausalLMSpec,
    default_spec,
    has_standard_layout,
    unwrap_peft,
)

BUILTIN = __name__
"""The ``SUPPORTED_MODELS`` value of the built-in families: this package (its :func:`build_spec` reads
the family table)."""

SUPPORTED_MODELS: Dict[str, str] = {model_type: BUILTIN for model_type in families.verified_model_types()}

logger = logging.getLogger("roundpipe")


@dataclass(frozen=True)
class Registered:
    """A third-party preset module registered in ``SUPPORTED_MODELS``."""

    key: str
    """The entry's key: the model's class name or model type."""
    module: ModuleType
    """The module: it exposes ``build_spec(model)`` (and optionally ``MODEL_CLASS``) or
    ``wrap_model(model, **roundpipe_kwargs)``."""


def registered_module(model: nn.Module) -> Optional[Registered]:
    """The third-party module registered for ``model``: the ``SUPPORTED_MODELS`` entry under its class
    name, else under its model type, when it names another module than this package."""
    base = unwrap_peft(model)
    keys: List[str] = [k for k in (type(base).__name__, getattr(getattr(base, "config", None), "model_type", None)) if isinstance(k, str)]
    for key in keys:
        path = SUPPORTED_MODELS.get(key)
        if path is not None and path != BUILTIN:
            try:
                return Registered(key, importlib.import_module(path))
            except ImportError as exc:
                raise ImportError(f"roundpipe.models.SUPPORTED_MODELS[{key!r}] = {path!r}: {exc}") from exc
    return None


def resolve(model: nn.Module) -> Union[ModelFamily, Registered]:
    """Where the preset of ``model`` (a Hugging Face causal LM, possibly inside PEFT) comes from: a
    registered third-party module (:func:`registered_module`), else the family table (:func:`table_family`).

    Raises:
        NotImplementedError: No preset for this model (the message names the class).
    """
    return registered_module(model) or table_family(model)


def table_family(model: nn.Module) -> ModelFamily:
    """The family record of ``model`` in the table, ignoring third-party registrations.

    A type in no record, or in an unverified one, gets the standard preset when its class and layout
    fit, with a warning unless it is registered in ``SUPPORTED_MODELS`` (under its type or class name)
    as using this package.

    Raises:
        NotImplementedError: No preset for this model (the message names the class).
    """
    base = unwrap_peft(model)
    name = type(base).__name__
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    family = families.family_of(model_type)
    registered = any(SUPPORTED_MODELS.get(k) == BUILTIN for k in (name, model_type) if k is not None)
    if family is None or family.incompatible or not (family.verified or registered):
        if (family is not None and family.incompatible) or not has_standard_layout(base) or not name.endswith("ForCausalLM"):
            raise NotImplementedError(
                f"{name}: no RoundPipe sequential preset (model_type={model_type!r}); supported: "
                f"{sorted(SUPPORTED_MODELS)} and decoder-only causal LMs laid out model.embed_tokens -> "
                "model.layers -> model.norm -> lm_head"
            )
        if not registered:
            logger.warning(
                "%s (model_type=%r) uses the generic causal-LM preset, which was not verified for this family; "
                "compare one forward with the Hugging Face model before training.",
                name,
                model_type,
            )
        family = family or families.GENERIC
    if name not in SUPPORTED_MODELS:  # a class registered by its name is accepted as it is
        _check_class(name, model_type, family.model_class)
    return family


def _check_class(name: str, model_type: Optional[str], expected: Optional[str], where: str = "") -> None:
    """Refuse a class the preset was not made for (``expected`` None: any ``*ForCausalLM``)."""
    if expected is None:
        if not name.endswith("ForCausalLM"):
            raise NotImplementedError(f"{name}: the {model_type!r} preset{where} supports *ForCausalLM classes only")
    elif name != expected:
        raise NotImplementedError(f"{name}: the {model_type!r} preset{where} supports {expected} only")


def family_spec(model: nn.Module, family: ModelFamily) -> CausalLMSpec:
    """The :class:`CausalLMSpec` of ``model`` as ``family``'s record describes it."""
    base = unwrap_peft(model)
    spec = default_spec(
        base,
        mask_uses_position_ids=family.mask_uses_position_ids,
        fused_kernels=family.fused_kernels is not None,
        **family.config_overrides(base.config),
    )
    if family.moe and spec.moe is None:
        raise NotImplementedError(f"{type(base).__name__}: router logits recorder not found")
    return spec


def build_spec(model: nn.Module) -> CausalLMSpec:
    """The spec of ``model`` from the family table: what a ``SUPPORTED_MODELS`` entry naming this package
    means. Third-party ``build_spec`` functions may start from it (it ignores their registrations).

    Raises:
        NotImplementedError: No preset for this model class.
    """
    return family_spec(model, table_family(model))


def _module_spec(model: nn.Module, found: Registered) -> CausalLMSpec:
    """The spec a registered module following the preset layout (``build_spec``) builds."""
    name = type(unwrap_peft(model)).__name__
    if found.key != name:  # registered by model type: the module may name its class
        _check_class(name, found.key, getattr(found.module, "MODEL_CLASS", None), f" ({found.module.__name__})")
    spec = found.module.build_spec(model)
    if not isinstance(spec, CausalLMSpec):
        raise TypeError(f"{found.module.__name__}.build_spec returned {type(spec).__name__}, expected a CausalLMSpec")
    return spec


def _no_layout(found: Registered) -> TypeError:
    return TypeError(
        f"roundpipe.models.SUPPORTED_MODELS[{found.key!r}] = {found.module.__name__!r}: the module exposes neither "
        "build_spec(model) -> CausalLMSpec nor wrap_model(model, **roundpipe_kwargs)"
    )


def _preset(model: nn.Module, found: Union[ModelFamily, Registered]) -> Optional[CausalLMPreset]:
    """The preset ``found`` builds for ``model``; None for a module that wraps models itself."""
    if isinstance(found, ModelFamily):
        return CausalLMPreset(model, family_spec(model, found))
    if hasattr(found.module, "build_spec"):
        return CausalLMPreset(model, _module_spec(model, found))
    if hasattr(found.module, "wrap_model"):
        return None
    raise _no_layout(found)


def build_preset(model: nn.Module) -> CausalLMPreset:
    """The :class:`~roundpipe.models.preset.CausalLMPreset` (pipeline layers + glue) for ``model``.

    Raises:
        NotImplementedError: No preset for this model class.
        TypeError: The registered module builds no spec (it wraps models itself: use :func:`wrap_model`).
    """
    found = resolve(model)
    preset = _preset(model, found)
    if preset is None:
        assert isinstance(found, Registered)
        raise TypeError(
            f"{type(unwrap_peft(model)).__name__}: the preset registered in roundpipe.models.SUPPORTED_MODELS"
            f"[{found.key!r}] ({found.module.__name__}) wraps models itself; call roundpipe.models.wrap_model"
        )
    return preset


def preset_wrapper(model: nn.Module) -> Callable[..., Any]:
    """The function that wraps ``model`` with its preset: call it with RoundPipe's keyword arguments.

    The preset is built now, so a model without one fails here (``wrap_model_to_roundpipe`` then wraps
    it by size) and the call only builds the RoundPipe.

    Raises:
        NotImplementedError: No preset for this model class.
    """
    found = resolve(model)
    preset = _preset(model, found)
    if preset is None:
        assert isinstance(found, Registered)
        return functools.partial(found.module.wrap_model, model)
    from roundpipe.models.causal_lm import RoundPipeForCausalLM

    return functools.partial(RoundPipeForCausalLM, model, preset)


def wrap_model(model: nn.Module, **roundpipe_kwargs: Any) -> Any:
    """Wrap a supported model with its sequential preset.

    Args:
        model: A Hugging Face ``*ForCausalLM``, or a PEFT model around one.
        **roundpipe_kwargs: Forwarded to :class:`~roundpipe.models.causal_lm.RoundPipeForCausalLM`
            (``optim_dtype``, ``name``, ``model_run_config``, ``pin_model``, ``fused_kernels``), or to
            the ``wrap_model`` of a third-party preset module registered for the model.

    Returns:
        A ``RoundPipeForCausalLM`` (or what the registered module's ``wrap_model`` returns).

    Raises:
        NotImplementedError: The model type is not supported, or the class does not match its type's preset.
    """
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
    "preset_wrapper",
    "registered_module",
    "resolve",
    "table_family",
    "wrap_model",
]
