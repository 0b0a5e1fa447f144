"""The fused ops of the Qwen3 / Llama decoder layers: pure functions of tensors, each run compiled with
an eager fallback (:class:`FusedOp`). :mod:`roundpipe.models.kernels` swaps module classes so their
``forward`` calls these.

Fused ops (each the same math, in the same order, as Hugging Face's code):

* :func:`rms_norm_reference` -- ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``; the fp32
  result is rounded to the input dtype *before* the weight multiply, as in ``Qwen3RMSNorm``.
* :func:`qk_norm_rope` (Qwen3) -- ``q_norm``/``k_norm`` and the rotary embedding of queries and keys in
  one function, so query and key each take one read and one write.
* :func:`rope` (Llama) -- the rotary embedding of queries and keys.
* :func:`swiglu` -- ``silu(gate) * up``.
* :func:`pre_attention` -- input norm, q/k/v projections, q/k norms and rotary;
  :func:`post_attention` -- o projection, residual, norm, SwiGLU MLP, residual. Both are position-wise:
  the tiled path (:mod:`roundpipe.models.tiling`) runs them per tile of tokens.
* :func:`decoder_layer` -- the whole decoder layer as one op (:func:`pre_attention`, sdpa,
  :func:`post_attention`), for the calls RoundPipe's training makes.

A projection among the weights is a plain weight or a PEFT LoRA projection's base weight and adapter,
which run as one fused LoRA linear (:func:`roundpipe.models.lora.linear`); with ``fp8=True`` a base weight
may be a frozen fp8 one and a plain projection torchao's float8 recipe, both FP8 GEMMs
(:mod:`roundpipe.models.fp8`).

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

import functools
import logging
import threading
import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from roundpipe import settings
from roundpipe.models.lora import linear

logger = logging.getLogger("roundpipe")

# ---------------------------------------------------------------------------------------------------------
# The math: pure functions of tensors
# ---------------------------------------------------------------------------------------------------------

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""An RMSNorm ``(x, weight, eps) -> normed x``: :func:`rms_norm_reference` (compiled) or :func:`rms_norm_eager`."""


def rms_norm_reference(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:
    """Hugging Face's RMSNorm (``Qwen3RMSNorm`` / ``LlamaRMSNorm``), written out: what gets compiled."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_eager(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
) -> torch.Tensor:
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


def rope(
    q: torch.Tensor,  # [batch, seq, heads, head_dim]
    k: torch.Tensor,  # [batch, seq, kv heads, head_dim]
    cos: torch.Tensor,  # [batch, seq, head_dim]
    sin: torch.Tensor,  # [batch, seq, head_dim]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of queries and keys given in the projection layout; returns them ``[batch, heads,
    seq, head_dim]`` like Hugging Face's ``apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos,
    sin)``."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def qk_norm_rope(
    q: torch.Tensor,  # [batch, seq, heads, head_dim]
    k: torch.Tensor,  # [batch, seq, kv heads, head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    q_eps: float,
    k_eps: float,
    cos: torch.Tensor,  # [batch, seq, head_dim]
    sin: torch.Tensor,  # [batch, seq, head_dim]
    norm: Norm = rms_norm_reference,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's ``q_norm``/``k_norm`` (RMSNorm over ``head_dim``) followed by :func:`rope`."""
    return rope(norm(q, q_weight, q_eps), norm(k, k_weight, k_eps), cos, sin)


def swiglu(
    gate: torch.Tensor,  # [..., intermediate]
    up: torch.Tensor,  # [..., intermediate]
) -> torch.Tensor:
    """``silu(gate) * up``: the elementwise part of the SwiGLU MLP."""
    return F.silu(gate) * up


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: ``[batch, kv heads, seq, dim]`` -> ``[batch, kv heads * n_rep, seq, dim]``."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


PreWeights = Tuple[Any, ...]
"""The weights before attention: input norm ``[hidden]``, q / k / v projections ``[heads * head_dim,
hidden]``, ``q_norm`` / ``k_norm`` ``[head_dim]`` (None without q/k norms: Llama). Each projection is a
:data:`roundpipe.models.lora.Projection`: a weight, or a LoRA projection's base weight and adapter."""
PostWeights = Tuple[Any, ...]
"""The weights after attention: o projection ``[hidden, heads * head_dim]``, post-attention norm
``[hidden]``, gate / up projections ``[intermediate, hidden]``, down projection ``[hidden, intermediate]``
(the projections as in :data:`PreWeights`)."""
LayerWeights = Tuple[Any, ...]
"""A whole layer's: :data:`PreWeights` then :data:`PostWeights` (11 entries), built in one place:
``roundpipe.models.kernels.pre_attention_weights`` / ``post_attention_weights``."""
PreEps = Tuple[float, float, float]
"""The epsilons of the input norm, ``q_norm`` and ``k_norm`` (the last two unused without q/k norms)."""
LayerEps = Tuple[float, float, float, float]
"""A whole layer's: :data:`PreEps`, then the post-attention norm's."""
PRE_WEIGHTS = 6  # how many of LayerWeights are PreWeights


def pre_attention(
    x: torch.Tensor,  # [batch, seq, hidden]
    cos: torch.Tensor,  # [batch, seq, head_dim]
    sin: torch.Tensor,  # [batch, seq, head_dim]
    weights: PreWeights,  # input norm, q, k, v projections, q_norm, k_norm
    eps: PreEps,  # input norm, q_norm, k_norm
    head_dim: int,
    norm: Norm = rms_norm_reference,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, q/k/v projections, q/k norms, rotary, op for op as Hugging Face's layer: ``q``, ``k``,
    ``v`` as ``[batch, seq, heads, head_dim]`` (``k``, ``v`` with the key/value heads). Position-wise:
    the tiled path applies it per tile of tokens."""
    ln1_w, q_w, k_w, v_w, qn_w, kn_w = weights
    eps1, q_eps, k_eps = eps
    b, s = x.shape[0], x.shape[1]
    h = norm(x, ln1_w, eps1)
    q = linear(h, q_w).view(b, s, -1, head_dim)
    k = linear(h, k_w).view(b, s, -1, head_dim)
    v = linear(h, v_w).view(b, s, -1, head_dim)
    if qn_w is not None:
        q, k = qk_norm_rope(q, k, qn_w, kn_w, q_eps, k_eps, cos, sin, norm)
    else:
        q, k = rope(q, k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v


def post_attention(
    x: torch.Tensor,  # [batch, seq, hidden]: the layer input (the residual)
    a: torch.Tensor,  # [batch, seq, heads * head_dim]: the attention output
    weights: PostWeights,
    eps: float,
    norm: Norm = rms_norm_reference,
) -> torch.Tensor:
    """``y = x + o_proj(a); y + down(silu(gate(norm(y))) * up(norm(y)))``: ``[batch, seq, hidden]``.
    Position-wise: the tiled path applies it per tile of tokens."""
    o_w, ln2_w, gate_w, up_w, down_w = weights
    y = x + linear(a, o_w)
    h = norm(y, ln2_w, eps)
    return y + linear(swiglu(linear(h, gate_w), linear(h, up_w)), down_w)


def decoder_layer(
    x: torch.Tensor,  # [batch, seq, hidden]
    cos: torch.Tensor,  # [batch, seq, head_dim]
    sin: torch.Tensor,  # [batch, seq, head_dim]
    weights: LayerWeights,
    eps: LayerEps,
    head_dim: int,
    scaling: float,
    is_causal: bool,
    kv_groups: int,
    gqa: bool,
    norm: Norm = rms_norm_reference,
) -> torch.Tensor:
    """A Qwen3 / Llama decoder layer without mask, cache or dropout, op for op as Hugging Face's
    ``*DecoderLayer.forward`` with sdpa attention: :func:`pre_attention`, sdpa over the whole sequence,
    :func:`post_attention` (one graph, one autograd node and one Python call per layer instead of about
    twenty). ``is_causal``, ``kv_groups`` (query heads per key/value head) and ``gqa`` (sdpa's
    ``enable_gqa``) are decided by the caller: computed here from shapes they would be symbolic once a
    shape is dynamic, which sdpa's flags do not accept."""
    b, s = x.shape[0], x.shape[1]
    q, k, v = pre_attention(x, cos, sin, weights[:PRE_WEIGHTS], eps[:3], head_dim, norm)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, head_dim]
    if kv_groups > 1 and not gqa:
        k, v = _repeat_kv(k, kv_groups), _repeat_kv(v, kv_groups)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=scaling, is_causal=is_causal, enable_gqa=gqa)
    a = a.transpose(1, 2).reshape(b, s, -1)  # [batch, seq, heads * head_dim]
    return post_attention(x, a, weights[PRE_WEIGHTS:], eps[3], norm)


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


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with :func:`rms_norm_eager` for its norms: the eager version of a compiled op."""
    return functools.partial(fn, norm=rms_norm_eager)


RMS_NORM = FusedOp(rms_norm_reference, rms_norm_eager)
QK_NORM_ROPE = FusedOp(qk_norm_rope, _eager(qk_norm_rope))
ROPE = FusedOp(rope, rope)
SWIGLU = FusedOp(swiglu, swiglu)
DECODER_LAYER = FusedOp(decoder_layer, _eager(decoder_layer))
PRE_ATTENTION = FusedOp(pre_attention, _eager(pre_attention))
"""One tile's pre-attention part of a tiled layer (:mod:`roundpipe.models.tiling`)."""
POST_ATTENTION = FusedOp(post_attention, _eager(post_attention))
"""One tile's post-attention part of a tiled layer."""
OPS = (RMS_NORM, QK_NORM_ROPE, ROPE, SWIGLU, DECODER_LAYER, PRE_ATTENTION, POST_ATTENTION)


def reset() -> None:
    """:meth:`FusedOp.reset` of every fused op."""
    for op in OPS:
        op.reset()
