"""Fused kernels for the decoder layers of the Qwen3 and Llama presets (the families whose
``fused_kernels`` entry in :data:`roundpipe.models.families.FAMILIES` names their classes).

Hugging Face's eager decoder layer spends a large share of its GPU time outside the matmuls: its
RMSNorm upcasts to fp32 in about six separate kernels (four norms per Qwen3 layer, counting
``q_norm``/``k_norm``), rotary embeddings take five kernels per tensor (``rotate_half`` slices, negates
and concatenates), SwiGLU two, and the backward doubles all of it. This module replaces those pieces
with fused ones (:mod:`roundpipe.models.fused_ops`) **per module instance**: a supported module's class
is swapped for a subclass whose ``forward`` calls the fused op. Nothing in transformers is patched, so a
plain Hugging Face model in the same process is unaffected, and :func:`unfuse_layer` restores the
original classes. A whole decoder layer runs as one op (``fused_ops.decoder_layer``) for the calls
RoundPipe's training makes (causal attention, no mask, cache, dropout or hooks; other calls run the
per-module ops): one Python call and one autograd node instead of about twenty. PEFT LoRA projections
that the fused LoRA linear reproduces (:mod:`roundpipe.models.lora`) run inside that op too.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from roundpipe import settings
from roundpipe.models import families, lora
from roundpipe.models.fused_ops import (
    DECODER_LAYER,
    OPS,
    POST_ATTENTION,
    PRE_ATTENTION,
    QK_NORM_ROPE,
    RMS_NORM,
    ROPE,
    SWIGLU,
    FusedOp,
    LayerWeights,
    PostWeights,
    PreWeights,
    compile_enabled,
    decoder_layer,
    post_attention,
    pre_attention,
    qk_norm_rope,
    reset,
    rms_norm_eager,
    rms_norm_reference,
    rope,
    swiglu,
)
from roundpipe.runtime import sequence

logger = logging.getLogger("roundpipe")

FusedKernels = Union[bool, str, None]

# ---------------------------------------------------------------------------------------------------------
# Fused forwards (mixed into per-instance subclasses of the Hugging Face classes)
# ---------------------------------------------------------------------------------------------------------


class _RMSNormForward:
    """``forward`` of a fused ``*RMSNorm``."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return RMS_NORM(hidden_states, self.weight, self.variance_epsilon)


class _SwiGLUMLPForward:
    """``forward`` of a fused ``*MLP`` (``down_proj(silu(gate_proj(x)) * up_proj(x))``)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(SWIGLU(self.gate_proj(x), self.up_proj(x)))


class _AttentionForward:
    """``forward`` of a fused ``Qwen3Attention`` / ``LlamaAttention``: Hugging Face's forward (same
    signature in transformers 5.17 and 5.23) with the q/k norms and the rotary embedding fused; the
    projections and the attention function (``ALL_ATTENTION_FUNCTIONS``, sdpa by default) are its own."""

    _rpp_qk_norm: bool  # Qwen3: q_norm / k_norm on the head dim
    _rpp_sliding_window: bool  # Qwen3 passes sliding_window to the attention function
    _rpp_eager_attention: Callable[..., Any]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Any] = None,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        # The rotary tables are built under no_grad (Hugging Face's rotary embedding is a no_grad
        # forward), so no gradient of them is ever used; RoundPipe marks every float tensor it hands a
        # recompute as requiring grad, which would make the backward compute one for nothing.
        cos, sin = (t.detach() for t in position_embeddings)
        if self._rpp_qk_norm:
            q_norm, k_norm = self.q_norm, self.k_norm
            query_states, key_states = QK_NORM_ROPE(
                query_states,
                key_states,
                q_norm.weight,
                k_norm.weight,
                q_norm.variance_epsilon,
                k_norm.variance_epsilon,
                cos,
                sin,
            )
        else:
            query_states, key_states = ROPE(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        dropout = 0.0 if not self.training else self.attention_dropout
        if sequence.active() is not None:  # a tile of a longer sequence (roundpipe.runtime.sequence)
            if getattr(self, "sliding_window", None):
                raise ValueError("sequence tiles: sliding-window attention layers are not supported")
            attn_output = sequence.attend(self.layer_idx, query_states, key_states, value_states, self.scaling, dropout)
            return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), None
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._rpp_eager_attention
        )
        if self._rpp_sliding_window:
            kwargs["sliding_window"] = self.sliding_window
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


_gqa_cache: Dict[int, bool] = {}


def _sdpa_uses_gqa(head_dim: int) -> bool:
    """Whether Hugging Face's sdpa attention passes ``enable_gqa`` (rather than repeating the key/value
    heads) for an unmasked call with this head size: the same choice keeps the same kernel."""
    if head_dim not in _gqa_cache:
        try:
            from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

            k = torch.empty(1, 1, 1, head_dim, device="meta")
            try:
                _gqa_cache[head_dim] = bool(use_gqa_in_sdpa(None, k, k))
            except TypeError:  # transformers versions taking (mask, key)
                _gqa_cache[head_dim] = bool(use_gqa_in_sdpa(None, k))  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001 -- no such helper: repeat the heads, as older versions did
            _gqa_cache[head_dim] = False
    return _gqa_cache[head_dim]


def has_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward or backward hook (global, or on one of ``modules``) would run if the modules
    were called: the whole-layer op does not call them, and a tiled layer would call them per tile."""
    from torch.nn.modules import module as module_mod

    if (
        module_mod._global_forward_hooks
        or module_mod._global_forward_pre_hooks
        or module_mod._global_backward_hooks
        or module_mod._global_backward_pre_hooks
    ):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules)


class _DecoderLayerForward:
    """``forward`` of a fused ``Qwen3DecoderLayer`` / ``LlamaDecoderLayer``: the whole layer as one fused
    op (:data:`DECODER_LAYER`) when the call is what RoundPipe's training runs - causal attention without
    mask, cache or dropout, bias-free projections (plain or fusable LoRA), sdpa, no hooks on the
    submodules -, else Hugging Face's forward over the fused submodules. One op per layer matters on several GPUs, where
    the device threads share one interpreter lock and the Python issued per layer bounds the speed."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def _whole_layer_weights(self) -> Optional[LayerWeights]:
        """The layer's weights in :func:`decoder_layer`'s order, or None when the whole-layer op does not
        compute what Hugging Face's forward would."""
        attn, mlp = self.self_attn, self.mlp
        if not (is_fused(attn) and is_fused(mlp)):
            return None
        if (
            (attn.training and attn.attention_dropout > 0)
            or attn.config._attn_implementation != "sdpa"
            or not getattr(attn, "is_causal", True)
        ):
            return None
        pre, post = pre_attention_weights(self), post_attention_weights(self)
        if pre is None or post is None:
            return None
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        qk = (attn.q_norm, attn.k_norm) if attn._rpp_qk_norm else ()
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if has_hooks((*norms, attn, mlp, *(m for p in linears for m in lora.projection_modules(p)), *qk)):
            return None
        return pre + post

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values: Optional[Any] = None,
        use_cache: Optional[bool] = False,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        weights = None
        if (
            attention_mask is None
            and past_key_values is None
            and position_embeddings is not None
            and not kwargs
            and sequence.active() is None  # a tile's attention reads the earlier tiles' (roundpipe.runtime.sequence)
        ):
            weights = self._whole_layer_weights()
        if weights is None:
            return super().forward(  # type: ignore[misc]
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        attn = self.self_attn
        # The rotary tables carry no gradient (see _AttentionForward.forward).
        cos, sin = (t.detach() for t in position_embeddings)
        qk = (attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon) if attn._rpp_qk_norm else (0.0, 0.0)
        eps = (self.input_layernorm.variance_epsilon, *qk, self.post_attention_layernorm.variance_epsilon)
        groups = attn.num_key_value_groups
        return DECODER_LAYER(
            hidden_states,
            cos,
            sin,
            weights,
            eps,
            attn.head_dim,
            attn.scaling,
            hidden_states.shape[1] > 1,
            groups,
            groups > 1 and _sdpa_uses_gqa(attn.head_dim),
        )


def pre_attention_weights(layer: nn.Module) -> Optional[PreWeights]:
    """The weights :func:`pre_attention` takes for ``layer`` (input norm, q / k / v projections, q / k
    norms), or None when it would not compute what the modules do (norms not fused, a projection neither a
    bias-free ``nn.Linear`` (or torchao ``Float8Linear``) nor a fusable LoRA one:
    :func:`roundpipe.models.lora.projection`). The one place these tuples are built: the whole-layer op and
    the sequence tiles read them from here."""
    lay: Any = layer
    attn: Any = lay.self_attn
    qk = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else ()
    if not all(is_fused(n) for n in (lay.input_layernorm, *qk)):
        return None
    projs = tuple(lora.projection(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    if any(p is None for p in projs):
        return None
    qn_w, kn_w = (qk[0].weight, qk[1].weight) if qk else (None, None)
    return (lay.input_layernorm.weight, *projs, qn_w, kn_w)


def post_attention_weights(layer: nn.Module) -> Optional[PostWeights]:
    """The weights :func:`post_attention` takes for ``layer`` (o projection, post-attention norm, gate / up /
    down projections), or None as :func:`pre_attention_weights` (and for an MLP that is not fused: SwiGLU)."""
    lay: Any = layer
    mlp: Any = lay.mlp
    if not (is_fused(lay.post_attention_layernorm) and is_fused(mlp)):
        return None
    o = lora.projection(lay.self_attn.o_proj)
    gate_up_down = tuple(lora.projection(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    if o is None or any(p is None for p in gate_up_down):
        return None
    return (o, lay.post_attention_layernorm.weight, *gate_up_down)


# ---------------------------------------------------------------------------------------------------------
# Swapping classes per instance
# ---------------------------------------------------------------------------------------------------------

_registry_cache: Optional[Dict[type, Tuple[type, Dict[str, Any]]]] = None
_fused_classes: Dict[type, type] = {}
_registry_lock = threading.Lock()


def _registry() -> Dict[type, Tuple[type, Dict[str, Any]]]:
    """Hugging Face class -> (fused forward mixin, class attributes), from the ``fused_kernels`` entries of
    the family table (:data:`roundpipe.models.families.FAMILIES`). Exact classes only: a subclass or
    another family's look-alike may compute something else."""
    global _registry_cache
    if _registry_cache is None:
        registry: Dict[type, Tuple[type, Dict[str, Any]]] = {}
        for family in families.FAMILIES:
            classes = family.fused_kernels
            if classes is None:
                continue
            module = importlib.import_module(classes.module)
            attention_attrs = dict(
                _rpp_qk_norm=classes.qk_norm,
                _rpp_sliding_window=classes.sliding_window,
                _rpp_eager_attention=staticmethod(getattr(module, classes.eager_attention)),
            )
            registry[getattr(module, classes.norm)] = (_RMSNormForward, {})
            registry[getattr(module, classes.mlp)] = (_SwiGLUMLPForward, {})
            registry[getattr(module, classes.attention)] = (_AttentionForward, attention_attrs)
            registry[getattr(module, classes.decoder_layer)] = (_DecoderLayerForward, {})
        _registry_cache = registry
    return _registry_cache


def fused_base_classes() -> Tuple[type, ...]:
    """The Hugging Face classes that get fused kernels (those the family table names)."""
    return tuple(_registry())


def _fused_class(base: type) -> type:
    """The fused subclass of ``base`` (made once; registered in this module so instances pickle)."""
    with _registry_lock:
        cls = _fused_classes.get(base)
        if cls is None:
            mixin, attrs = _registry()[base]
            name = f"RoundPipeFused{base.__name__}"
            cls = type(
                name, (mixin, base), {"__module__": __name__, "__qualname__": name, "_rpp_base_class": base, **attrs}
            )
            setattr(sys.modules[__name__], name, cls)
            _fused_classes[base] = cls
        return cls


def base_class(module: nn.Module) -> type:
    """The Hugging Face class of ``module`` (its own class when it is not fused)."""
    return getattr(type(module), "_rpp_base_class", type(module))


def is_fused(module: nn.Module) -> bool:
    return "_rpp_base_class" in type(module).__dict__


def runs_whole_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` runs as the whole-layer op in RoundPipe's training calls (fused, plain or fusable
    LoRA projections, sdpa, no hooks): the activation estimate of such a layer differs from one run module by
    module (``roundpipe.planning.memory_terms.decoder_layer_bytes``)."""
    weights = getattr(layer, "_whole_layer_weights", None)
    return is_fused(layer) and callable(weights) and weights() is not None


def _is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and _registry().get(base_class(module), (None,))[0] is _RMSNormForward


def _can_fuse(module: nn.Module) -> bool:
    """Whether ``module`` is a supported Hugging Face class in a configuration the fused forward covers."""
    entry = _registry().get(base_class(module))
    if entry is None:
        return False
    mixin, attrs = entry
    if mixin is _SwiGLUMLPForward:
        from transformers.activations import SiLUActivation

        return isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU))
    if mixin is _AttentionForward and attrs["_rpp_qk_norm"]:
        return _is_rms_norm(getattr(module, "q_norm", None)) and _is_rms_norm(getattr(module, "k_norm", None))
    return True


def fuse_layer(layer: nn.Module) -> List[str]:
    """Swap the supported submodules of ``layer`` (a decoder layer) to their fused classes, in place.

    Parameters, buffers, hooks and submodules stay as they are (the object is the same, only its
    class changes). Returns the names of the modules swapped; modules already fused are skipped.
    """
    swapped = []
    for name, module in layer.named_modules():
        if not is_fused(module) and _can_fuse(module):
            module.__class__ = _fused_class(type(module))
            swapped.append(name)
    return swapped


def unfuse_layer(layer: nn.Module) -> int:
    """Restore the Hugging Face classes of ``layer``'s fused submodules; returns how many there were."""
    n = 0
    for module in layer.modules():
        if is_fused(module):
            module.__class__ = type(module)._rpp_base_class
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------
# The option
# ---------------------------------------------------------------------------------------------------------

ENV = "RPP_DEBUG_FUSED_KERNELS"


def has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton as _has_triton

        return bool(_has_triton())
    except Exception:  # noqa: BLE001
        return False


def auto_enabled() -> bool:
    """``"auto"``: on when every RoundPipe device is a GPU and torch.compile can build Triton kernels
    (CPU workers: off, compiling costs more than it saves there)."""
    from roundpipe.devices import backend

    if not compile_enabled():
        return False
    try:
        devices = backend.parse_devices(settings.DEVICES.get())
    except (ValueError, RuntimeError):
        return False
    return bool(devices) and all(d.type == "cuda" for d in devices) and has_triton()


def resolve(mode: FusedKernels) -> bool:
    """Whether fused kernels are on for ``mode``: True / False, ``"auto"`` (see :func:`auto_enabled`), or
    None for ``$RPP_DEBUG_FUSED_KERNELS`` (``auto`` when unset; also ``1``/``0``)."""
    if mode is None:
        mode = settings.DEBUG_FUSED_KERNELS.get()
    if isinstance(mode, str):
        word = mode.strip().lower()
        if word in ("1", "true", "on", "yes"):
            return True
        if word in ("0", "false", "off", "no"):
            return False
        if word != "auto":
            raise ValueError(f"fused_kernels={mode!r}: expected True, False or 'auto'")
        return auto_enabled()
    return bool(mode)


__all__ = [
    "DECODER_LAYER",
    "ENV",
    "FusedKernels",
    "FusedOp",
    "OPS",
    "POST_ATTENTION",
    "PRE_ATTENTION",
    "QK_NORM_ROPE",
    "RMS_NORM",
    "ROPE",
    "SWIGLU",
    "auto_enabled",
    "base_class",
    "decoder_layer",
    "fuse_layer",
    "fused_base_classes",
    "has_hooks",
    "is_fused",
    "post_attention",
    "post_attention_weights",
    "pre_attention",
    "pre_attention_weights",
    "qk_norm_rope",
    "reset",
    "resolve",
    "rms_norm_eager",
    "rms_norm_reference",
    "rope",
    "swiglu",
    "unfuse_layer",
]
