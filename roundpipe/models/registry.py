"""Which preset a model gets: the ``SUPPORTED_MODELS`` registrations (third-party preset modules, by
class name or model type) over the family table (:data:`roundpipe.models.families.FAMILIES`). The
package ``roundpipe.models`` re-exports these names; ``SUPPORTED_MODELS`` is the same dict there.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, List, Optional, Union

from torch import nn

from roundpipe.models import families
from roundpipe.models.families import ModelFamily
from roundpipe.models.preset import (
    CausalLMPreset,
    CausalLMSpec,
    default_spec,
    has_standard_layout,
    unwrap_peft,
)

BUILTIN = "roundpipe.models"
"""The ``SUPPORTED_MODELS`` value of the built-in families: the package ``roundpipe.models`` (its
:func:`build_spec` reads the family table)."""

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
    keys: List[str] = [
        k
        for k in (type(base).__name__, getattr(getattr(base, "config", None), "model_type", None))
        if isinstance(k, str)
    ]
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
        if (
            (family is not None and family.incompatible)
            or not has_standard_layout(base)
            or not name.endswith("ForCausalLM")
        ):
            # One short line (the CLI prints it as is): the supported types are a dict away, not listed.
            raise NotImplementedError(
                f"{name}: no RoundPipe sequential preset (model_type={model_type!r}); supported: the "
                f"{len(SUPPORTED_MODELS)} types of roundpipe.models.SUPPORTED_MODELS (llama, qwen3, mistral, ...) "
                "and causal LMs laid out model.embed_tokens -> model.layers -> model.norm -> lm_head"
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


def preset_for(model: nn.Module, found: Union[ModelFamily, Registered]) -> Optional[CausalLMPreset]:
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
    preset = preset_for(model, found)
    if preset is None:
        assert isinstance(found, Registered)
        raise TypeError(
            f"{type(unwrap_peft(model)).__name__}: the preset registered in roundpipe.models.SUPPORTED_MODELS"
            f"[{found.key!r}] ({found.module.__name__}) wraps models itself; call roundpipe.models.wrap_model"
        )
    return preset
