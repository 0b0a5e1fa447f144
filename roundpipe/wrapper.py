"""Wrap user models into RoundPipe: a sequential preset when one exists, otherwise by module size.

``wrap_model_to_roundpipe(model)`` returns something that is called like ``model``:

* a Hugging Face causal LM with a preset (see :mod:`roundpipe.models`) becomes a
  ``RoundPipeForCausalLM`` whose layers are the embedding, each decoder layer and the loss head;
* any other model is walked top-down (``wrap_model_recursive``):

  - a module that fits ``upper_threshold`` bytes becomes one RoundPipe (an ``nn.Sequential`` one
    streams its children as layers); a module with children that does not fit is recursed into, and a
    childless one that does not fit becomes one RoundPipe anyway (the planner warns when a layer is
    larger than half the device budget);
  - chains, the elements of an ``nn.ModuleList`` and the children of an ``nn.Sequential`` too large
    to be one RoundPipe, are wrapped element by element whatever their size, so small and
    parameter-free elements run on the devices in the pipeline too; an element followed by another
    RoundPipe gets ``merge_output=False``: its microbatches flow into the next one without a host
    merge (the parent's forward must pass the output straight on, as decoder-layer loops do; give an
    element ``override_config`` with ``merge_output=True`` otherwise);
  - the other children of a module with its own forward become RoundPipes from ``lower_threshold``
    bytes up; smaller ones are not worth a device round trip of their own and run where their parent
    runs (``lower_threshold=0`` wraps them too); ``skip_modules`` stay untouched;
  - a Hugging Face model's causal-LM ``loss_function`` becomes a RoundPipe as well, so the loss over
    the logits runs on the devices per microbatch (exact: token-loss sums and counts are merged).

  The root is then wrapped in an ``AutoRoundPipe`` so that ``optim_parameters()``, ``step()`` and
  ``synchronize()`` cover every RoundPipe inside.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Container, Dict, List, Optional, Tuple

import torch
from torch import nn

from roundpipe.host.formats import quantize_base
from roundpipe.roundpipe import AutoRoundPipe, RoundPipe, RoundPipeBase
from roundpipe.runtime.run_config import RoundPipeRunConfig
from roundpipe.utils import get_call_location, get_model_size


def _is_skipped(module: nn.Module, skip_modules: Container[nn.Module]) -> bool:
    return any(m is module for m in skip_modules) if isinstance(skip_modules, (list, tuple)) else module in skip_modules


def _subtree_has(module: nn.Module, skip_modules: Container[nn.Module]) -> bool:
    """Whether ``module`` or a descendant must stay untouched (skipped or already a RoundPipe)."""
    return any(_is_skipped(m, skip_modules) or isinstance(m, RoundPipeBase) for m in module.modules())


@dataclasses.dataclass
class _Wrapping:
    """The arguments of one ``wrap_model_recursive`` walk, shared by its recursion."""

    lower: int
    """``lower_threshold``: bytes below which a child stays where its parent runs (chain elements aside)."""
    upper: int
    """``upper_threshold``: modules up to this many bytes become one RoundPipe; larger ones are recursed into."""
    skip: Container[nn.Module]
    """Modules left untouched, neither wrapped nor recursed into."""
    override: Dict[nn.Module, RoundPipeRunConfig]
    """A run configuration of their own for these modules."""
    config: RoundPipeRunConfig
    """The run configuration of every other wrapped module."""
    kwargs: Dict[str, Any]
    """Passed on to each ``RoundPipe``."""

    def roundpipe(self, module: nn.Module, name: str) -> RoundPipe:
        config = self.override.get(module, self.config)
        return RoundPipe(module, model_run_config=config, name=name, **self.kwargs)

    def fits(self, module: nn.Module) -> bool:
        """Whether ``module`` can be one RoundPipe: small enough (a Sequential: each child, as it streams
        them one by one), not a bare container, nothing inside to leave alone."""
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or _subtree_has(module, self.skip):
            return False
        if isinstance(module, nn.Sequential) and len(module) > 0:
            return all(get_model_size(c) <= self.upper for c in module.children())
        return get_model_size(module) <= self.upper

    def wrap(self, module: nn.Module, name: str, in_chain: bool = False) -> nn.Module:
        """``module`` wrapped (a RoundPipe) or with its children wrapped in place. ``in_chain``: it is an
        element of a chain, so it runs on the devices even when smaller than ``lower_threshold``."""
        if _is_skipped(module, self.skip) or isinstance(module, RoundPipeBase):
            return module
        size = get_model_size(module)
        if not in_chain and size < self.lower:
            return module
        children = list(module.named_children())
        if self.fits(module) or (not children and not _subtree_has(module, self.skip)):
            return self.roundpipe(module, name)
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            self.wrap_chain(module, name)
        else:
            for child_name, child in children:
                wrapped = self.wrap(child, f"{name}.{child_name}")
                if wrapped is not child:
                    setattr(module, child_name, wrapped)
        return module

    def wrap_chain(self, container: nn.Module, name: str) -> None:
        """Wrap each element of a Sequential / ModuleList in place; an element followed by another
        RoundPipe hands its microbatches on unmerged (``merge_output=False``)."""
        keys = list(container._modules.keys())
        wrapped: List[nn.Module] = []
        for key in keys:
            child = container._modules[key]
            assert child is not None
            new = self.wrap(child, f"{name}.{key}", in_chain=True)
            if new is not child:
                container._modules[key] = new
            wrapped.append(new)
        for current, following in zip(wrapped, wrapped[1:]):
            if isinstance(current, RoundPipe) and isinstance(following, RoundPipe):
                own = self.override.get(current.model)
                if own is None or own.merge_output is None:
                    current.model_run_config = dataclasses.replace(current.model_run_config, merge_output=False)


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
    """Recursively wrap ``model`` and its submodules in RoundPipe by size (the rules in the module
    docstring).

    Args:
        model: Module to consider.
        lower_threshold: Children of a module with its own forward smaller than this (bytes of
            parameters + buffers) stay where their parent runs; chain elements are wrapped regardless.
        upper_threshold: Modules up to this size become one RoundPipe; larger ones are recursed into.
        skip_modules: Modules to leave untouched (neither wrapped nor recursed into).
        override_config: Module -> run config used instead of ``model_run_config`` for that module.
        model_run_config: Default run config of the RoundPipe instances.
        name: Name of ``model`` (children are named ``name.child``).
        **roundpipe_kwargs: Forwarded to RoundPipe (``optim_dtype``, ``pin_model``).

    Returns:
        A RoundPipe wrapping ``model``, or ``model`` itself with its children replaced in place.
    """
    walk = _Wrapping(
        lower_threshold, upper_threshold, skip_modules, override_config, model_run_config, roundpipe_kwargs
    )
    if _is_skipped(model, skip_modules) or isinstance(model, RoundPipeBase):
        return model
    if walk.fits(model):
        return walk.roundpipe(model, name)
    # The root itself is always considered (it is what the caller asked to wrap), whatever its size.
    return walk.wrap(model, name, in_chain=True)


# ---------------------------------------------------------------------------------------------------------
# A Hugging Face model's loss function on the devices
# ---------------------------------------------------------------------------------------------------------


class CausalLMLossSums(nn.Module):
    """transformers' ``ForCausalLMLoss`` for one microbatch as sums: ``{"sum": [1], "count": [1],
    "divisor": [1]}`` (the token-loss sum, the counted tokens, and ``num_items_in_batch`` or 0), which
    :func:`merge_causal_lm_loss` turns into the whole batch's loss. Parameter-free."""

    def __init__(self, loss_function: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.loss_function = loss_function

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: Optional[Any] = None,
        ignore_index: int = -100,
        shift_labels: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> Dict[str, torch.Tensor]:
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device).contiguous()
        # num_items_in_batch=1 makes the loss a plain sum (the function's own "sum" reduction).
        total = self.loss_function(
            logits,
            None,
            vocab_size,
            num_items_in_batch=1,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )
        count = (shift_labels != ignore_index).sum().to(torch.float32)
        divisor = float(
            num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else (num_items_in_batch or 0)
        )
        return {
            "sum": total.reshape(1),
            "count": count.reshape(1),
            "divisor": torch.full((1,), divisor, device=logits.device),
        }


def _check_labels_first(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Forward pre-hook of a causal LM whose ``loss_function`` runs on the devices: its ``labels`` /
    ``shift_labels`` are checked (``check_label_range``) before any of its RoundPipes runs, so an
    out-of-range label is a ValueError on the caller's thread, not a failure inside a worker's loss kernel
    (a GPU's device-side assert) after the forward has half run."""
    from roundpipe.models.loss import check_label_range

    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    vocab = head.weight.shape[0] if isinstance(getattr(head, "weight", None), torch.Tensor) else vocab
    if vocab is None:
        return
    for name, shifted in (("labels", False), ("shift_labels", True)):
        if isinstance(kwargs.get(name), torch.Tensor):
            check_label_range(kwargs[name], vocab, shifted=shifted, name=name)


def _no_cache_across_microbatches(
    module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Forward pre-hook of a model wrapped by size whose forward takes ``use_cache``: off unless the caller
    sets it. A Hugging Face model builds one key / value cache per forward and hands it to every layer,
    and a layer wrapped on its own runs once per microbatch: microbatch 1 would attend to microbatch 0's
    keys (wrong outputs) and its backward would run through microbatch 0's graph."""
    kwargs.setdefault("use_cache", False)
    return args, kwargs


def merge_causal_lm_loss(outputs: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
    """The batch loss from per-microbatch ``CausalLMLossSums`` outputs: the sum of the token losses
    over ``num_items_in_batch`` when it was given, over the counted tokens otherwise (the mean)."""
    total = torch.cat([o["sum"] for o in outputs]).sum()
    divisor = outputs[0]["divisor"].detach().reshape(())
    if float(divisor) > 0:
        return total / divisor
    return total / torch.cat([o["count"] for o in outputs]).sum()


def wrap_loss_function(
    model: nn.Module, model_run_config: RoundPipeRunConfig, name: str, **roundpipe_kwargs: Any
) -> bool:
    """Put a Hugging Face model's causal-LM ``loss_function`` on the devices: a RoundPipe over
    :class:`CausalLMLossSums` (merged exactly by :func:`merge_causal_lm_loss`) replaces it through
    the model's ``loss_function`` setter. Other loss functions stay as they are. Returns whether it
    was wrapped."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers without the loss mapping
        return False
    prop = getattr(type(model), "loss_function", None)
    if (
        getattr(model, "loss_function", None) is not ForCausalLMLoss
        or not isinstance(prop, property)
        or prop.fset is None
    ):
        return False
    config = dataclasses.replace(model_run_config, merge_output=merge_causal_lm_loss)
    loss = CausalLMLossSums(ForCausalLMLoss)
    if config.fp8:  # part of a model set up for FP8 GEMMs (the loss itself stays in its dtype)
        from roundpipe.models.fp8 import mark_prepared

        mark_prepared(loss)
    # Through the property's setter: a plain attribute write of a module would register a submodule
    # named ``loss_function`` that the property (a class attribute) hides.
    prop.fset(model, RoundPipe(loss, model_run_config=config, name=f"{name}.loss_function", **roundpipe_kwargs))
    model.register_forward_pre_hook(_check_labels_first, with_kwargs=True)
    return True


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: Optional[bool] = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: Optional[int] = None,
    skip_modules: Container[nn.Module] = [],  # noqa: B006 - the spec's signature; never mutated
    override_config: Dict[nn.Module, RoundPipeRunConfig] = {},  # noqa: B006 - the spec's signature; never mutated
    model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    name: Optional[str] = None,
    base_format: str = "bf16",
    fp8: Optional[bool] = None,
    **roundpipe_kwargs: Any,
) -> RoundPipeBase:
    """Wrap ``model`` into RoundPipe, with its sequential preset when one exists.

    Args:
        model: Root module (on the host).
        use_sequential_preset: None: use a preset if there is one, else wrap by size. True: a preset is
            required. False: always wrap by size.
        lower_threshold: Minimum size (bytes) of a module wrapped on its own (chain elements are
            wrapped whatever their size; see the module docstring).
        upper_threshold: Maximum size (bytes) of one RoundPipe before splitting into submodules.
            Default: model size / (number of devices + 1).
        skip_modules: Modules that stay untouched.
        override_config: Module -> run config for that module's RoundPipe.
        model_run_config: Default run config.
        name: Name of the root; default: the caller's file:line.
        base_format: How frozen ``nn.Linear`` weights (a LoRA base) and frozen expert weights are stored in host
            memory: ``roundpipe.host.formats.BASE_FORMATS`` (``"bf16"``: as they are; ``"fp8"``, ``"int8"``,
            ``"nf4"``, ``"mxfp4"``: packed, uploaded packed and dequantized on the device; ``"mxfp4"`` packs a
            mixture of experts' experts only, as GPT-OSS ships). Packed once, before the model is split,
            so the split sizes count the packed bytes.
        fp8: FP8 GEMMs in the decoder layers' projections (``roundpipe.models.fp8``): over a frozen base
            stored with ``base_format="fp8"``, and torchao's float8 training recipe for trained ones. Default:
            ``model_run_config.fp8`` (False).
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
    quantize_base(model, base_format)
    from roundpipe.models import fp8 as fp8_gemms

    use_fp8 = fp8_gemms.wants_fp8(fp8, model_run_config)
    fp8_gemms.prepare(model, use_fp8)
    if use_fp8 and not model_run_config.fp8:
        model_run_config = dataclasses.replace(model_run_config, fp8=True)
    if use_sequential_preset is not False:
        try:
            wrap = models.preset_wrapper(model)
        except NotImplementedError:
            if use_sequential_preset:
                raise
        else:
            return wrap(model_run_config=model_run_config, name=name, **roundpipe_kwargs)
    if upper_threshold is None:
        from roundpipe.devices.device import get_num_devices

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
    if "use_cache" in inspect.signature(wrapped.forward).parameters:
        wrapped.register_forward_pre_hook(_no_cache_across_microbatches, with_kwargs=True)
    wrap_loss_function(wrapped, model_run_config, name, **roundpipe_kwargs)
    return AutoRoundPipe(wrapped, name=name, optim_dtype=roundpipe_kwargs.get("optim_dtype"))


__all__ = [
    "CausalLMLossSums",
    "merge_causal_lm_loss",
    "wrap_loss_function",
    "wrap_model_recursive",
    "wrap_model_to_roundpipe",
]
