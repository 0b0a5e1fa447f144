"""Wrap user models into RoundPipe: a sequential preset when one exists, otherwise by module size.

``wrap_model_to_roundpipe(model)`` returns something that is called like ``model``:

* a Hugging Face causal LM with a preset (see :mod:`roundpipe.models`) becomes a
  ``RoundPipeForCausalLM`` whose layers are the embedding, each decoder layer and the loss head;
* any other model is walked top-down: a submodule that fits ``upper_threshold`` bytes becomes one
  RoundPipe (an ``nn.Sequential`` whose children all fit becomes one RoundPipe streaming its
  children), larger modules (and ModuleList / ModuleDict containers) are recursed into, modules under ``lower_threshold`` and ``skip_modules``
  stay on the host as they are. The root is then wrapped in an ``AutoRoundPipe`` so that
  ``optim_parameters()``, ``step()`` and ``synchronize()`` cover every RoundPipe inside.
"""

from __future__ import annotations

from typing import Any, Container, Dict, Optional

from torch import nn

from roundpipe.roundpipe import AutoRoundPipe, RoundPipe, RoundPipeBase
from roundpipe.run_config import RoundPipeRunConfig
from roundpipe.utils import get_call_location, get_model_size


def _is_skipped(module: nn.Module, skip_modules: Container[nn.Module]) -> bool:
    return any(m is module for m in skip_modules) if isinstance(skip_modules, (list, tuple)) else module in skip_modules


def _subtree_has(module: nn.Module, skip_modules: Container[nn.Module]) -> bool:
    """Whether ``module`` or a descendant must stay untouched (skipped or already a RoundPipe)."""
    return any(_is_skipped(m, skip_modules) or isinstance(m, RoundPipeBase) for m in module.modules())


def wrap_model_recursive(
    model: nn.Module,
    lower_threshold: int,
    upper_threshold: int,
    skip_modules: Container[nn.Module],
    override_config: Dict[nn.Module, RoundPipeRunConfig],
    model_run_config: RoundPipeRunConfig,
    name: str,
    **roundpipe_kwargs: Any,
) -> nn.Module:
    """Recursively wrap the submodules of ``model`` in RoundPipe by size.

    Args:
        model: Module to consider.
        lower_threshold: Modules smaller than this (bytes of parameters + buffers) stay on the host.
        upper_threshold: Modules up to this size become one RoundPipe; larger ones are recursed into.
        skip_modules: Modules to leave untouched (neither wrapped nor recursed into).
        override_config: Module -> run config used instead of ``model_run_config`` for that module.
        model_run_config: Default run config of the RoundPipe instances.
        name: Name of ``model`` (children are named ``name.child``).
        **roundpipe_kwargs: Forwarded to RoundPipe (``optim_dtype``, ``pin_model``).

    Returns:
        A RoundPipe wrapping ``model``, or ``model`` itself with its children replaced in place.
    """
    if _is_skipped(model, skip_modules) or isinstance(model, RoundPipeBase):
        return model
    size = get_model_size(model)
    if size < lower_threshold:
        return model
    children = list(model.named_children())
    # Containers have no forward of their own (the parent indexes them): always look inside.
    container = isinstance(model, (nn.ModuleList, nn.ModuleDict))
    fits = (not container and size <= upper_threshold) or (
        isinstance(model, nn.Sequential) and all(get_model_size(c) <= upper_threshold for _, c in children)
    )
    if fits and not _subtree_has(model, skip_modules):
        config = override_config.get(model, model_run_config)
        return RoundPipe(model, model_run_config=config, name=name, **roundpipe_kwargs)
    for child_name, child in children:
        wrapped = wrap_model_recursive(
            child,
            lower_threshold,
            upper_threshold,
            skip_modules,
            override_config,
            model_run_config,
            f"{name}.{child_name}",
            **roundpipe_kwargs,
        )
        if wrapped is not child:
            setattr(model, child_name, wrapped)
    return model


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: Optional[bool] = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: Optional[int] = None,
    skip_modules: Container[nn.Module] = [],
    override_config: Dict[nn.Module, RoundPipeRunConfig] = {},
    model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    name: Optional[str] = None,
    **roundpipe_kwargs: Any,
) -> RoundPipeBase:
    """Wrap ``model`` into RoundPipe, with its sequential preset when one exists.

    Args:
        model: Root module (on the host).
        use_sequential_preset: None: use a preset if there is one, else wrap by size. True: a preset is
            required. False: always wrap by size.
        lower_threshold: Minimum size (bytes) of a module worth wrapping.
        upper_threshold: Maximum size (bytes) of one RoundPipe before splitting into submodules.
            Default: model size / (number of devices + 1).
        skip_modules: Modules that stay untouched.
        override_config: Module -> run config for that module's RoundPipe.
        model_run_config: Default run config.
        name: Name of the root; default: the caller's file:line.
        **roundpipe_kwargs: Forwarded to RoundPipe (``optim_dtype``, ``pin_model``).

    Returns:
        A ``RoundPipeForCausalLM`` (preset), a ``RoundPipe`` (the whole model fits one), or an
        ``AutoRoundPipe`` around the model with RoundPipe submodules.

    Raises:
        NotImplementedError: ``use_sequential_preset=True`` and ``model`` has no preset.
    """
    from roundpipe import models

    if name is None:
        name = get_call_location(1)
    if use_sequential_preset is not False:
        try:
            wrap = models.preset_wrapper(model)
        except NotImplementedError:
            if use_sequential_preset:
                raise
        else:
            return wrap(model_run_config=model_run_config, name=name, **roundpipe_kwargs)
    if upper_threshold is None:
        from roundpipe.device import get_num_devices

        upper_threshold = get_model_size(model) // (get_num_devices() + 1)
    wrapped = wrap_model_recursive(
        model,
        lower_threshold,
        upper_threshold,
        skip_modules,
        override_config,
        model_run_config,
        name,
        **roundpipe_kwargs,
    )
    if isinstance(wrapped, RoundPipeBase):
        return wrapped
    return AutoRoundPipe(wrapped, name=name, optim_dtype=roundpipe_kwargs.get("optim_dtype"))


__all__ = ["wrap_model_recursive", "wrap_model_to_roundpipe"]
