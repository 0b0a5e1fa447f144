"""The forward arguments of a Hugging Face causal LM, as RoundPipe's preset takes them: defined once.

:class:`CausalLMInputs` lists them (type, default, doc). :func:`takes_inputs` turns a function of a
``CausalLMInputs`` into a method that takes the arguments themselves, positionally or by keyword, and
carries their signature for ``inspect`` (Hugging Face's ``Trainer`` reads the signature of ``forward``
to decide which dataset columns to keep). ``RoundPipeForCausalLM.forward`` / ``train_step`` and
``CausalLMPreset.forward_kwargs`` are made this way, and the first pipeline layer receives the
:data:`BATCH_ARGS` among them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch

# Metadata of a per-sample tensor argument: split into microbatches and handed to the first pipeline layer.
_BATCH = {"batch": True}


@dataclass(frozen=True)
class CausalLMInputs:
    """The arguments of a causal LM's forward, in ``RoundPipeForCausalLM.forward``'s positional order."""

    input_ids: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """Token ids ``[batch, seq]``; exactly one of these and ``inputs_embeds``."""
    attention_mask: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """``[batch, seq]``, 0 on padding."""
    position_ids: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """``[batch, seq]``; default ``0 .. seq - 1``."""
    inputs_embeds: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """``[batch, seq, hidden]`` instead of ``input_ids``."""
    labels: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """Targets ``[batch, seq]``, shifted inside; -100 is ignored."""
    shift_labels: Optional[torch.Tensor] = field(default=None, metadata=_BATCH)
    """Targets already shifted (instead of ``labels``)."""
    return_logits: Optional[bool] = None
    """Return the logits; default: only without labels (a training forward needs the loss only)."""
    logits_to_keep: Union[int, torch.Tensor] = 0
    """Logits of the last ``n`` positions only (0: all), or of the positions in a 1-D tensor."""
    output_router_logits: Optional[bool] = None
    """MoE: add the router load-balancing loss; default ``config.output_router_logits``."""
    loss_chunk_size: Optional[int] = None
    """Tokens per chunk of the loss (:mod:`roundpipe.models.loss`); default: sized from the vocabulary."""
    num_items_in_batch: Optional[Union[int, float, torch.Tensor]] = None
    """Normaliser of the loss (Hugging Face's ``Trainer`` passes the label count of a whole gradient
    accumulation step): the loss is the sum of the token losses over it instead of their mean."""

    def loss_divisor(self) -> Optional[float]:
        """``num_items_in_batch`` as a host number (None when unset): the loss is computed on the
        devices, and a tensor on another device (the Trainer's) must not enter their kernels."""
        n = self.num_items_in_batch
        if n is None:
            return None
        return float(n.item() if isinstance(n, torch.Tensor) else n)

    def batch_kwargs(self) -> Dict[str, torch.Tensor]:
        """The :data:`BATCH_ARGS` that are set, by name."""
        return {name: getattr(self, name) for name in BATCH_ARGS if getattr(self, name) is not None}


FIELDS: Dict[str, "dataclasses.Field[Any]"] = {f.name: f for f in dataclasses.fields(CausalLMInputs)}

ALL_ARGS: Tuple[str, ...] = tuple(FIELDS)
"""Every argument, in positional order."""

BATCH_ARGS: Tuple[str, ...] = tuple(name for name, f in FIELDS.items() if f.metadata.get("batch"))
"""The per-sample tensors, split into microbatches: the keyword arguments of the first pipeline layer
(with ``options``, the others)."""


def _hints() -> Dict[str, Any]:
    """The evaluated annotations of :class:`CausalLMInputs` (this module uses postponed annotations)."""
    import typing

    return typing.get_type_hints(CausalLMInputs)


def parameters(names: Sequence[str] = ALL_ARGS) -> Tuple[inspect.Parameter, ...]:
    """``inspect.Parameter`` s of the named arguments (positional-or-keyword, with their defaults)."""
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise ValueError(f"not causal-LM arguments: {unknown}; known: {list(ALL_ARGS)}")
    hints = _hints()
    return tuple(
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=FIELDS[n].default, annotation=hints[n])
        for n in names
    )


def takes_inputs(
    names: Sequence[str] = ALL_ARGS, extra: Sequence[inspect.Parameter] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(self, inputs: CausalLMInputs, **extra)`` becomes ``method(self, <names>, <extra>)``.

    ``names`` are the causal-LM arguments the method takes, in its positional order (the others keep
    their defaults); ``extra`` are its own parameters after them, with their defaults (``fn`` receives
    each by name, defaults applied; a ``**kwargs`` one as a dict). Calls are bound with the signature,
    so a wrong argument raises the usual ``TypeError`` naming it.
    """
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([self_param, *parameters(names), *extra])
    own = tuple(names)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            self = values.pop("self")
            inputs = CausalLMInputs(**{n: values.pop(n) for n in own})
            return fn(self, inputs, **values)

        method.__signature__ = signature  # type: ignore[attr-defined]
        return method

    return decorate


__all__ = ["ALL_ARGS", "BATCH_ARGS", "CausalLMInputs", "parameters", "takes_inputs"]
