"""The model before its weights: a Hugging Face causal LM built on the meta device, LoRA applied, and
the parts the loader fills one at a time.

Nothing here allocates a weight. Buffers that a model computes at construction (the rotary ``inv_freq``)
are the exception: they are small, and :func:`materialize_buffers` computes them as transformers does
after its own meta-device load (``_init_weights`` of the module that owns them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from roundpipe.loading.shards import LoadError

#: ``init_lora_weights`` values whose LoRA init the loader reproduces (PEFT's ``reset_lora_parameters``).
LORA_INITS = (True, False, "gaussian")


@dataclass
class Skeleton:
    """A meta-device model and its parts in loading order."""

    model: nn.Module
    """What the user gets: the PEFT model with LoRA, else the Hugging Face model."""
    hf: nn.Module
    """The Hugging Face causal LM (inside PEFT with LoRA): its parameter names are the checkpoint's."""
    parts: List[Tuple[str, nn.Module]]
    """(name prefix, module) in the model's module order: the embedding, each decoder layer, the final norm,
    the head. Every parameter of ``hf`` belongs to exactly one part."""


#: Mixtures of experts whose checkpoints store each layer's experts under the module's own names (GPT-OSS: fused
#: 3-D tensors, or their MXFP4 blocks and scales), so they load as they are; other ones store a tensor per expert,
#: which transformers fuses at load.
LOADABLE_MOE = ("gpt_oss",)


def check_supported(config: Any) -> None:
    """A dense decoder-only family of ``roundpipe.models`` (the layout the loader walks) or one of
    ``LOADABLE_MOE``; one line otherwise."""
    from roundpipe.models.families import family_of

    model_type = getattr(config, "model_type", None)
    family = family_of(model_type)
    if family is None or (family.moe and model_type not in LOADABLE_MOE) or family.incompatible:
        why = "a mixture of experts" if family is not None and family.moe else "not a dense family roundpipe presets"
        raise LoadError(
            f"model type {model_type!r} is {why}, so it cannot be loaded layer by layer; load it with "
            "transformers (AutoModelForCausalLM.from_pretrained) and wrap it with "
            "roundpipe.wrap_model_to_roundpipe(model, base_format=...)"
        )


def check_lora(lora: Any) -> None:
    """The LoRA settings whose init the loader reproduces exactly; one line naming the setting otherwise."""
    from peft import LoraConfig

    if not isinstance(lora, LoraConfig):
        raise LoadError(f"lora={type(lora).__name__} is not a peft.LoraConfig; pass LoraConfig(r=..., ...)")
    init = lora.init_lora_weights
    if not any(init is v or (isinstance(v, str) and init == v) for v in LORA_INITS):
        raise LoadError(
            f"LoraConfig(init_lora_weights={init!r}) initialises the adapters from the base weights, which the "
            "layer-by-layer loader does not hold in bf16; use init_lora_weights=True (the default) or 'gaussian', "
            "or load with transformers and PEFT and wrap the model"
        )
    for flag in ("use_dora", "use_qalora", "use_bdlora"):
        if getattr(lora, flag, False):
            raise LoadError(f"LoraConfig({flag}=True) is not supported by the loader; set {flag}=False")


def build_skeleton(config: Any, dtype: torch.dtype, lora: Optional[Any]) -> Skeleton:
    """The model of ``config`` on the meta device in ``dtype``, with ``lora``'s adapters (also on meta); the
    global random state is left as it was."""
    check_supported(config)
    if lora is not None:
        check_lora(lora)
    # PEFT builds the adapters on the host before moving them to the meta device: those draws are undone, so
    # the adapters' init (roundpipe.loading.fill) draws what get_peft_model on a materialized model would.
    rng = torch.get_rng_state()
    try:
        return _build(config, dtype, lora)
    finally:
        torch.set_rng_state(rng)


def _build(config: Any, dtype: torch.dtype, lora: Optional[Any]) -> Skeleton:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model: nn.Module = hf
    if lora is not None:
        from peft import get_peft_model

        with warnings.catch_warnings():  # transformers 5's deprecated alias read by PEFT: nothing to act on
            warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated")
            try:
                model = get_peft_model(hf, lora)
            except ValueError as exc:
                raise LoadError(
                    f"LoRA: {str(exc).splitlines()[0]}; set target_modules to names of this model"
                ) from None
        hf = model.get_base_model()
    return Skeleton(model, hf, parts_of(hf))


def parts_of(hf: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name prefix, module) of ``hf`` in module order: ``model``'s children with each decoder layer apart, then
    the head; every parameter of ``hf`` in exactly one part."""
    inner = getattr(hf, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LoadError(f"{type(hf).__name__} has no model.layers list; load it with transformers and wrap it")
    parts: List[Tuple[str, nn.Module]] = []
    for name, child in inner.named_children():  # embed_tokens, layers, norm, rotary_emb: the model's order
        if child is layers:
            parts.extend((f"model.layers.{i}.", layer) for i, layer in enumerate(layers))
        else:
            parts.append((f"model.{name}.", child))
    for name, child in hf.named_children():  # lm_head
        if child is not inner:
            parts.append((f"{name}.", child))
    own = [n for n, _ in inner.named_parameters(recurse=False)] + [n for n, _ in hf.named_parameters(recurse=False)]
    if own:
        raise LoadError(f"{type(hf).__name__} holds parameters outside its modules ({own[0]}); wrap it instead")
    return parts


def tied_names(hf: nn.Module) -> Dict[str, List[str]]:
    """Parameter name -> every name of the same tensor (the tied embedding and head), for tied ones only."""
    groups: Dict[int, List[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {n: names for names in groups.values() if len(names) > 1 for n in names}


def materialize_buffers(hf: nn.Module, module: nn.Module, prefix: str) -> None:
    """Compute ``module``'s buffers left on meta (``inv_freq``) on the host, as transformers' load does: a
    placeholder, then the model's ``_init_weights`` of the module owning them. A module holding both
    parameters and such buffers would have its loaded parameters re-initialised: refused."""
    for sub_name, sub in module.named_modules():
        meta = [n for n, b in sub.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not meta:
            continue
        if list(sub.parameters(recurse=False)):
            raise LoadError(f"{prefix}{sub_name} creates buffers {meta} at init besides its weights; wrap it instead")
        for n in meta:  # NaN until computed, so a buffer the init leaves alone is seen
            sub._buffers[n] = torch.full_like(sub._buffers[n], float("nan"), device="cpu")
        hf._init_weights(sub)
        left = [n for n in meta if sub._buffers[n].is_floating_point() and sub._buffers[n].isnan().any()]
        if left:
            raise LoadError(f"{prefix}{sub_name}: buffers {left} have no init; wrap the loaded model instead")


__all__ = [
    "LORA_INITS",
    "Skeleton",
    "build_skeleton",
    "check_lora",
    "check_supported",
    "materialize_buffers",
    "parts_of",
    "tied_names",
]
