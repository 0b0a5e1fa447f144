"""Fused kernels for the decoder layers of the Qwen3 and Llama presets (the families whose
``fused_kernels`` entry in :data:`roundpipe.models.families.FAMILIES` names their classes).

Hugging Face's eager decoder layer spends a large share of its GPU time outside the matmuls: its
RMSNorm upcasts to fp32 in about six separate kernels (four norms per Qwen3 layer, counting
``q_norm``/``k_norm``), rotary embeddings take five kernels per tensor (``rotate_half`` slices, negates
and concatenates), SwiGLU two, and the backward doubles all of it. This module replaces those pieces
with fused ones **per module instance**: a supported module's class is swapped for a subclass whose
``forward`` calls the fused op. Nothing in transformers is patched, so a plain Hugging Face model in
the same process is unaffected, and :func:`unfuse_layer` restores the original classes.

Fused ops (each the same math, in the same order, as Hugging Face's code):

* :func:`rms_norm_reference` -- ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``; the fp32
  result is rounded to the input dtype *before* the weight multiply, as in ``Qwen3RMSNorm``.
* :func:`qk_norm_rope` (Qwen3) -- ``q_norm``/``k_norm`` and the rotary embedding of queries and keys in
  one function, so query and key each take one read and one write.
* :func:`rope` (Llama) -- the rotary embedding of queries and keys.
* :func:`swiglu` -- ``silu(gate) * up``.
* :func:`decoder_layer` -- the whole decoder layer (norms, projections, q/k norms and rotary, sdpa,
  SwiGLU MLP, residuals) as one op, for the calls RoundPipe's training makes (causal attention, no
  mask, cache, dropout or hooks; ``RPP_FUSED_LAYERS=0`` keeps the per-module ops). A layer then costs
  one Python call and one autograd node instead of about twenty: what bounds several GPUs is the
  Python that issues each layer's kernels, and the device threads share one interpreter lock.

Each op runs compiled (``torch.compile``, one fused Triton kernel forward and a few backward; inductor
is told to round intermediates to bf16/fp16 where eager does, ``emulate_precision_casts``) unless
compilation is off (``RPP_DISABLE_TORCH_COMPILE=1``) or failed; the eager version then runs, which is
Hugging Face's math with ``torch.nn.functional.rms_norm`` (a fused kernel on CUDA) for the norm. A
compile failure logs one warning and switches that op to eager for the rest of the process.

Compilation never repeats per layer or per upload: the compiled functions take tensors (the device
copies RoundPipe makes at every upload are new modules with new parameter tensors, which guards on
tensor metadata do not distinguish), and each device gets its own compiled copy of a function (dynamo
guards on the device index, so GPUs sharing one copy would exhaust its recompile limit). What remains
is one graph per op per grad mode (forward under ``no_grad``, recompute with grad) and per input shape
family; ``dynamic=None`` makes a dimension that changes (sequence length) dynamic on its first change
instead of recompiling for every length.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import settings
from roundpipe.models import families

logger = logging.getLogger("roundpipe")

FusedKernels = Union[bool, str, None]

# ---------------------------------------------------------------------------------------------------------
# The math: pure functions of tensors
# ---------------------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (``Qwen3RMSNorm`` / ``LlamaRMSNorm``), written out: what gets compiled."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same with ``F.rms_norm`` (fused on CUDA) for the normalisation; the weight multiply stays
    separate so the rounding order is Hugging Face's. Inputs other than fp32/bf16/fp16 (fp64) are
    normalised in fp32, as Hugging Face does."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        normed = F.rms_norm(x, (x.shape[-1],), None, eps)
    else:
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)
    return weight * normed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys given as ``[batch, seq, heads, head_dim]`` (the projection
    layout); returns them ``[batch, heads, seq, head_dim]`` like Hugging Face's
    ``apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)``."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's ``q_norm``/``k_norm`` (RMSNorm over ``head_dim``) followed by :func:`rope`."""
    return rope(rms_norm_reference(q, q_weight, q_eps), rms_norm_reference(k, k_weight, k_eps), cos, sin)


def _qk_norm_rope_eager(q, k, q_weight, k_weight, q_eps, k_eps, cos, sin):  # type: ignore[no-untyped-def]
    return rope(rms_norm_eager(q, q_weight, q_eps), rms_norm_eager(k, k_weight, k_eps), cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the elementwise part of the SwiGLU MLP."""
    return F.silu(gate) * up


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: ``[batch, kv heads, seq, dim]`` -> ``[batch, kv heads * n_rep, seq, dim]``."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


LayerWeights = Tuple[Optional[torch.Tensor], ...]
LayerEps = Tuple[float, float, float, float]


def _decoder_layer_math(
    norm: Callable[..., torch.Tensor],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: LayerWeights,
    eps: LayerEps,
    head_dim: int,
    scaling: float,
    is_causal: bool,
    kv_groups: int,
    gqa: bool,
) -> torch.Tensor:
    """A Qwen3 / Llama decoder layer without mask, cache or dropout, op for op as Hugging Face's
    ``*DecoderLayer.forward`` with sdpa attention; ``norm`` is the RMSNorm to use. ``is_causal``,
    ``kv_groups`` (query heads per key/value head) and ``gqa`` (sdpa's ``enable_gqa``) are decided by
    the caller: computed here from shapes they would be symbolic once a shape is dynamic, which sdpa's
    flags do not accept."""
    ln1_w, q_w, k_w, v_w, o_w, qn_w, kn_w, ln2_w, gate_w, up_w, down_w = weights
    eps1, eps2, q_eps, k_eps = eps
    b, s = x.shape[0], x.shape[1]
    h = norm(x, ln1_w, eps1)
    q = F.linear(h, q_w).view(b, s, -1, head_dim)
    k = F.linear(h, k_w).view(b, s, -1, head_dim)
    v = F.linear(h, v_w).view(b, s, -1, head_dim).transpose(1, 2)
    if qn_w is not None:
        q, k = norm(q, qn_w, q_eps), norm(k, kn_w, k_eps)
    q, k = rope(q, k, cos, sin)
    if kv_groups > 1 and not gqa:
        k, v = _repeat_kv(k, kv_groups), _repeat_kv(v, kv_groups)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=scaling, is_causal=is_causal, enable_gqa=gqa)
    a = a.transpose(1, 2).reshape(b, s, -1)
    x = x + F.linear(a, o_w)
    h = norm(x, ln2_w, eps2)
    return x + F.linear(swiglu(F.linear(h, gate_w), F.linear(h, up_w)), down_w)


def decoder_layer(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: LayerWeights, eps: LayerEps,
    head_dim: int, scaling: float, is_causal: bool, kv_groups: int, gqa: bool,
) -> torch.Tensor:
    """The whole decoder layer with :func:`rms_norm_reference` (what gets compiled: one graph, one
    autograd node and one Python call per layer instead of about twenty)."""
    return _decoder_layer_math(rms_norm_reference, x, cos, sin, weights, eps, head_dim, scaling, is_causal, kv_groups, gqa)


def _decoder_layer_eager(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: LayerWeights, eps: LayerEps,
    head_dim: int, scaling: float, is_causal: bool, kv_groups: int, gqa: bool,
) -> torch.Tensor:
    return _decoder_layer_math(rms_norm_eager, x, cos, sin, weights, eps, head_dim, scaling, is_causal, kv_groups, gqa)


# ---------------------------------------------------------------------------------------------------------
# Compiled, with an eager fallback
# ---------------------------------------------------------------------------------------------------------


def compile_enabled() -> bool:
    """Whether fused ops may compile now (``RPP_DISABLE_TORCH_COMPILE`` / ``roundpipe.configure(compile=)``,
    read per call)."""
    return not settings.DISABLE_TORCH_COMPILE.get()


def _copy_function(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: dynamo keeps its cache (and recompile limit) per code
    object, so each copy compiles and guards independently."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


# torch.compile backend of the fused ops ("aot_eager" compiles the same graphs without code generation:
# useful to debug, and in tests of the compile behaviour).
COMPILE_BACKEND = "inductor"


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` of one fused op: whole graph, shapes static until one changes."""
    # Device threads call compiled ops concurrently. While one thread compiles (FX-traces), torch's
    # "FX tracing is active" flag is process-wide, and dynamo would raise in every other thread that
    # enters a compiled function ("Detected that you are using FX to symbolically trace a
    # dynamo-optimized function", seen with 2 GPUs). With this off, those calls run the function's
    # eager code instead: the same math, for the few calls that overlap a compilation.
    torch._dynamo.config.error_on_nested_fx_trace = False
    if COMPILE_BACKEND != "inductor":
        return torch.compile(fn, fullgraph=True, dynamic=None, backend=COMPILE_BACKEND)
    import torch._inductor.config as inductor_config

    options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
    return torch.compile(fn, fullgraph=True, dynamic=None, options=options)


class FusedOp:
    """A pure tensor function, compiled once per device, falling back to its eager version.

    Attributes:
        fn: The function compiled (Hugging Face's math written out).
        eager_fn: What runs when compilation is off or failed.
        failed: Set after a compile failure: this op runs eagerly from then on.
        copies: ``(device type, index)`` -> the copy of ``fn`` compiled for that device.
        compiled: ``(device type, index)`` -> its ``torch.compile`` wrapper.
    """

    def __init__(self, fn: Callable[..., Any], eager_fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.eager_fn = eager_fn
        self.failed = False
        self.copies: Dict[Tuple[str, Optional[int]], Callable[..., Any]] = {}
        self.compiled: Dict[Tuple[str, Optional[int]], Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget compiled copies and failures (the next call compiles again)."""
        with self._lock:
            self.failed = False
            self.copies.clear()
            self.compiled.clear()

    def compiled_for(self, device: torch.device) -> Callable[..., Any]:
        key = (device.type, device.index)
        fn = self.compiled.get(key)
        if fn is None:
            with self._lock:
                fn = self.compiled.get(key)
                if fn is None:
                    tag = device.type if device.index is None else f"{device.type}{device.index}"
                    self.copies[key] = _copy_function(self.fn, tag)
                    fn = self.compiled[key] = _compile(self.copies[key])
        return fn

    def __call__(self, *args: Any) -> Any:
        if not self.failed and compile_enabled():
            try:
                return self.compiled_for(args[0].device)(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 -- any compiler failure: fall back, never stop training
                self._fail(exc)
        return self.eager_fn(*args)

    def _fail(self, exc: Exception) -> None:
        """Switch to eager for good, with one warning."""
        with self._lock:
            if self.failed:
                return
            self.failed = True
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        logger.warning(
            "roundpipe fused kernels: torch.compile of %s failed (%s: %s); using the eager kernels from now on",
            self.fn.__name__,
            type(exc).__name__,
            message,
        )


RMS_NORM = FusedOp(rms_norm_reference, rms_norm_eager)
QK_NORM_ROPE = FusedOp(qk_norm_rope, _qk_norm_rope_eager)
ROPE = FusedOp(rope, rope)
SWIGLU = FusedOp(swiglu, swiglu)
DECODER_LAYER = FusedOp(decoder_layer, _decoder_layer_eager)
OPS = (RMS_NORM, QK_NORM_ROPE, ROPE, SWIGLU, DECODER_LAYER)


def reset() -> None:
    """:meth:`FusedOp.reset` of every fused op."""
    for op in OPS:
        op.reset()


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
                query_states, key_states, q_norm.weight, k_norm.weight, q_norm.variance_epsilon, k_norm.variance_epsilon, cos, sin
            )
        else:
            query_states, key_states = ROPE(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._rpp_eager_attention)
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


def whole_layer_enabled() -> bool:
    """Whether fused decoder layers run as one op (``$RPP_FUSED_LAYERS``, default on; ``0`` keeps the
    per-module fused ops, to compare)."""
    return settings.FUSED_LAYERS.get()


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


def _has_hooks(modules: Tuple[nn.Module, ...]) -> bool:
    """Whether a forward or backward hook (global, or on one of ``modules``) would run if the modules
    were called: the whole-layer op does not call them."""
    from torch.nn.modules import module as module_mod

    if (module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks
            or module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules)


class _DecoderLayerForward:
    """``forward`` of a fused ``Qwen3DecoderLayer`` / ``LlamaDecoderLayer``: the whole layer as one fused
    op (:data:`DECODER_LAYER`) when the call is what RoundPipe's training runs - causal attention without
    mask, cache or dropout, plain bias-free projections, sdpa, no hooks on the submodules -, else
    Hugging Face's forward over the fused submodules. One op per layer matters on several GPUs, where
    the device threads share one interpreter lock and the Python issued per layer bounds the speed."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def _whole_layer_weights(self) -> Optional[LayerWeights]:
        """The layer's weights in :func:`decoder_layer`'s order, or None when the whole-layer op does not
        compute what Hugging Face's forward would."""
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if not (is_fused(attn) and is_fused(mlp) and all(is_fused(n) for n in norms)):
            return None
        if (attn.training and attn.attention_dropout > 0) or attn.config._attn_implementation != "sdpa" or not getattr(attn, "is_causal", True):
            return None
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
            return None  # PEFT adapters, biases, quantized layers: the submodules' own forwards
        qk = (attn.q_norm, attn.k_norm) if attn._rpp_qk_norm else ()
        if _has_hooks((*norms, attn, mlp, *linears, *qk)):
            return None
        qn_w, kn_w = (attn.q_norm.weight, attn.k_norm.weight) if qk else (None, None)
        return (self.input_layernorm.weight, *(m.weight for m in linears[:4]), qn_w, kn_w,
                self.post_attention_layernorm.weight, *(m.weight for m in linears[4:]))

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
        if attention_mask is None and past_key_values is None and position_embeddings is not None and not kwargs and whole_layer_enabled():
            weights = self._whole_layer_weights()
        if weights is None:
            return super().forward(  # type: ignore[misc]
                hidden_states, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
            )
        attn = self.self_attn
        # The rotary tables carry no gradient (see _AttentionForward.forward).
        cos, sin = (t.detach() for t in position_embeddings)
        qk = (attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon) if attn._rpp_qk_norm else (0.0, 0.0)
        eps = (self.input_layernorm.variance_epsilon, self.post_attention_layernorm.variance_epsilon, *qk)
        groups = attn.num_key_value_groups
        return DECODER_LAYER(hidden_states, cos, sin, weights, eps, attn.head_dim, attn.scaling,
                             hidden_states.shape[1] > 1, groups, groups > 1 and _sdpa_uses_gqa(attn.head_dim))


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
            cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, "_rpp_base_class": base, **attrs})
            setattr(sys.modules[__name__], name, cls)
            _fused_classes[base] = cls
        return cls


def base_class(module: nn.Module) -> type:
    """The Hugging Face class of ``module`` (its own class when it is not fused)."""
    return getattr(type(module), "_rpp_base_class", type(module))


def is_fused(module: nn.Module) -> bool:
    return "_rpp_base_class" in type(module).__dict__


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

ENV = "RPP_FUSED_KERNELS"


def has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton as _has_triton

        return bool(_has_triton())
    except Exception:  # noqa: BLE001
        return False


def auto_enabled() -> bool:
    """``"auto"``: on when every RoundPipe device is a GPU and torch.compile can build Triton kernels
    (CPU workers: off, compiling costs more than it saves there)."""
    from roundpipe import backend

    if not compile_enabled():
        return False
    try:
        devices = backend.parse_devices(settings.DEVICES.get())
    except (ValueError, RuntimeError):
        return False
    return bool(devices) and all(d.type == "cuda" for d in devices) and has_triton()


def resolve(mode: FusedKernels) -> bool:
    """Whether fused kernels are on for ``mode``: True / False, ``"auto"`` (see :func:`auto_enabled`), or
    None for ``$RPP_FUSED_KERNELS`` (``auto`` when unset; also ``1``/``0``)."""
    if mode is None:
        mode = settings.FUSED_KERNELS.get()
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
    "COMPILE_BACKEND",
    "DECODER_LAYER",
    "ENV",
    "FusedKernels",
    "FusedOp",
    "OPS",
    "QK_NORM_ROPE",
    "RMS_NORM",
    "ROPE",
    "SWIGLU",
    "auto_enabled",
    "base_class",
    "decoder_layer",
    "fuse_layer",
    "fused_base_classes",
    "is_fused",
    "qk_norm_rope",
    "reset",
    "resolve",
    "rms_norm_eager",
    "rms_norm_reference",
    "rope",
    "swiglu",
    "unfuse_layer",
    "whole_layer_enabled",
]
