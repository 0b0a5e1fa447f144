"""The model families RoundPipe's causal-LM preset knows: one record per family, one table.

Everything that differs between families is a field of :class:`ModelFamily`: the model types it covers,
the Hugging Face class it accepts, whether its loss and gradients were verified against transformers,
spec fields computed from the config, MoE, mask quirks, which Hugging Face classes get the fused
kernels of :mod:`roundpipe.models.kernels`, and whether its decoder layers run sequence-tiled
(:mod:`roundpipe.models.tiling`). ``roundpipe.models.SUPPORTED_MODELS``, the preset lookup, the
fused-kernel registry and the tileable classes are all derived from :data:`FAMILIES`; adding a family is
adding one entry.

This module is data only (no torch, no transformers): the kernel registry and the preset import it,
never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

ConfigOverrides = Callable[[Any], Dict[str, Any]]


def no_overrides(config: Any) -> Dict[str, Any]:
    """The standard forward: no spec field differs."""
    return {}


def cohere_overrides(config: Any) -> Dict[str, Any]:
    """Cohere multiplies the logits by ``config.logit_scale``."""
    return {"logit_scale": float(config.logit_scale)}


def granite_overrides(config: Any) -> Dict[str, Any]:
    """Granite multiplies the input embeddings by ``embedding_multiplier`` and divides the logits by
    ``logits_scaling``."""
    return {"embedding_multiplier": float(config.embedding_multiplier), "logit_scale": 1.0 / config.logits_scaling}


def hyperclovax_overrides(config: Any) -> Dict[str, Any]:
    """HyperCLOVA X multiplies the input embeddings by ``embedding_multiplier`` and the logits by
    ``logits_scaling``."""
    return {"embedding_multiplier": float(config.embedding_multiplier), "logit_scale": float(config.logits_scaling)}


@dataclass(frozen=True)
class FusedKernelClasses:
    """The Hugging Face classes of one family that :mod:`roundpipe.models.kernels` swaps for fused
    subclasses (exact classes only: a subclass or a look-alike of another family may compute something
    else). All names are attributes of :attr:`module`."""

    module: str
    """The transformers modeling module, e.g. ``"transformers.models.qwen3.modeling_qwen3"``."""
    decoder_layer: str
    """The decoder layer class; runs as one fused op when the call allows it."""
    attention: str
    """The attention class; its q/k norms (if any) and rotary embedding are fused."""
    mlp: str
    """The SwiGLU MLP class (``down_proj(silu(gate_proj(x)) * up_proj(x))``)."""
    norm: str
    """The RMSNorm class (Hugging Face's rounding order: fp32 normalisation, to the input dtype, times
    the weight)."""
    qk_norm: bool = False
    """The attention normalises queries and keys over the head dim (``q_norm`` / ``k_norm``, Qwen3)."""
    sliding_window: bool = False
    """The attention passes ``sliding_window`` to the attention function (Qwen3)."""
    eager_attention: str = "eager_attention_forward"
    """The module's eager attention function, used when ``config._attn_implementation`` is eager."""


@dataclass(frozen=True)
class ModelFamily:
    """One family of decoder-only causal LMs laid out ``model.embed_tokens -> model.layers -> model.norm
    -> lm_head`` with a shared ``model.rotary_emb``, and how the preset treats it."""

    name: str
    """Short name, for messages and tests."""
    model_types: Tuple[str, ...]
    """The ``config.model_type`` values this record covers (each appears in one record only)."""
    model_class: Optional[str] = None
    """The one Hugging Face class accepted (``"Qwen3ForCausalLM"``); None: any ``*ForCausalLM``."""
    verified: bool = False
    """Loss and every parameter gradient were checked against transformers (tests/test_models.py);
    verified model types are listed in ``SUPPORTED_MODELS``, the others get the preset with a warning."""
    incompatible: bool = False
    """Same layout, different computation: refused with ``NotImplementedError`` instead of given the
    preset."""
    config_overrides: ConfigOverrides = no_overrides
    """Spec fields that differ from the standard forward, computed from the config
    (``logit_scale``, ``embedding_multiplier``; see :class:`~roundpipe.models.preset.CausalLMSpec`)."""
    moe: bool = False
    """A mixture-of-experts family: the router load-balancing loss is reproduced, and a model whose router
    recorder is not found is refused. Other families get it only when the model has a recorder."""
    mask_uses_position_ids: bool = True
    """The model passes ``position_ids`` to transformers' mask functions (which then detect packed
    sequences); GPT-OSS does not."""
    fused_kernels: Optional[FusedKernelClasses] = None
    """The classes that get fused kernels; None: the family's modules run as Hugging Face wrote them."""
    tiles: bool = False
    """The decoder layer classes named in :attr:`fused_kernels` (layer, attention, MLP, RMSNorm) run
    sequence-tiled above ``RPP_SEQ_TILE`` tokens: :mod:`roundpipe.models.tiling` reproduces them op for op.
    Other families' layers always run untiled. Needs :attr:`fused_kernels` (the class names)."""
    doc: str = ""
    """What is particular about the family, in a sentence."""

    def __post_init__(self) -> None:
        """A record that tiles names its classes (``fused_kernels``): refused otherwise."""
        if self.tiles and self.fused_kernels is None:
            raise ValueError(f"family {self.name!r}: tiles=True needs fused_kernels (the classes that tile)")


def _fused(family: str, prefix: str, **quirks: Any) -> FusedKernelClasses:
    """The fused-kernel classes of a family whose classes are named like Llama's."""
    return FusedKernelClasses(
        module=f"transformers.models.{family}.modeling_{family}",
        decoder_layer=f"{prefix}DecoderLayer",
        attention=f"{prefix}Attention",
        mlp=f"{prefix}MLP",
        norm=f"{prefix}RMSNorm",
        **quirks,
    )


FAMILIES: Tuple[ModelFamily, ...] = (
    ModelFamily(
        "qwen3",
        ("qwen3",),
        "Qwen3ForCausalLM",
        verified=True,
        fused_kernels=_fused("qwen3", "Qwen3", qk_norm=True, sliding_window=True),
        tiles=True,
        doc="The standard layout; sliding-window layers follow config.layer_types.",
    ),
    ModelFamily(
        "llama",
        ("llama",),
        "LlamaForCausalLM",
        verified=True,
        fused_kernels=_fused("llama", "Llama"),
        tiles=True,
        doc="The standard layout, full attention in every layer.",
    ),
    ModelFamily(
        "qwen3_moe",
        ("qwen3_moe",),
        "Qwen3MoeForCausalLM",
        verified=True,
        moe=True,
        doc="Router logits from Qwen3MoeTopKRouter; config.mlp_only_layers are dense and add nothing to the "
        "router loss; every layer slides when config.sliding_window is set.",
    ),
    ModelFamily(
        "gpt_oss",
        ("gpt_oss",),
        "GptOssForCausalLM",
        verified=True,
        moe=True,
        mask_uses_position_ids=False,
        doc="Alternating sliding/full attention (config.layer_types), attention sinks inside the attention "
        "module, masks built without position_ids (no packed-sequence detection).",
    ),
    ModelFamily(
        "generic",
        (
            "qwen2",
            "mistral",
            "ministral",
            "phi3",
            "gemma",
            "gemma2",
            "olmo",
            "olmo2",
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
        ),
        verified=True,
        doc="Dense families that run the standard forward (Gemma 2: final logit soft-capping, from the config).",
    ),
    ModelFamily(
        "generic_moe",
        ("qwen2_moe", "mixtral", "phimoe", "olmoe"),
        verified=True,
        moe=True,
        doc="MoE families that run the standard forward, router logits from the model's recorder.",
    ),
    ModelFamily(
        "cohere",
        ("cohere", "cohere2"),
        verified=True,
        config_overrides=cohere_overrides,
        doc="Logits scaled by config.logit_scale.",
    ),
    ModelFamily(
        "cohere_moe",
        ("cohere2_moe",),
        config_overrides=cohere_overrides,
        doc="Cohere's logit scale; not verified.",
    ),
    ModelFamily(
        "granite",
        ("granite",),
        verified=True,
        config_overrides=granite_overrides,
        doc="Embeddings times embedding_multiplier, logits divided by logits_scaling.",
    ),
    ModelFamily(
        "granite_variants",
        ("granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared"),
        config_overrides=granite_overrides,
        doc="Granite's multipliers; not verified.",
    ),
    ModelFamily(
        "hyperclovax",
        ("hyperclovax",),
        config_overrides=hyperclovax_overrides,
        doc="Embeddings times embedding_multiplier, logits times logits_scaling; not verified.",
    ),
    ModelFamily(
        "incompatible",
        ("nanochat", "jetmoe", "doge", "diffllama"),
        incompatible=True,
        doc="The standard layout but another computation (checked): never the generic preset.",
    ),
)

GENERIC = ModelFamily(
    "unverified", (), doc="Any other *ForCausalLM with the standard layout: the standard forward, with a warning."
)
"""What a model type in no record gets (when its class and layout fit)."""


def _index(families: Tuple[ModelFamily, ...]) -> Dict[str, ModelFamily]:
    """``model_type`` -> its record; a type listed twice is a mistake in the table."""
    index: Dict[str, ModelFamily] = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in index:
                raise ValueError(
                    f"model type {model_type!r} is in families {index[model_type].name!r} and {family.name!r}"
                )
            index[model_type] = family
    return index


BY_MODEL_TYPE: Dict[str, ModelFamily] = _index(FAMILIES)


def family_of(model_type: Optional[str]) -> Optional[ModelFamily]:
    """The record covering ``model_type``, None for a type in no record."""
    return BY_MODEL_TYPE.get(model_type) if model_type is not None else None


def verified_model_types() -> Tuple[str, ...]:
    """Every model type of a verified family, in table order."""
    return tuple(t for f in FAMILIES if f.verified and not f.incompatible for t in f.model_types)


__all__ = [
    "BY_MODEL_TYPE",
    "FAMILIES",
    "GENERIC",
    "FusedKernelClasses",
    "ModelFamily",
    "cohere_overrides",
    "family_of",
    "granite_overrides",
    "hyperclovax_overrides",
    "no_overrides",
    "verified_model_types",
]
