"""Fused LoRA linears: PEFT's LoRA projections inside the fused Qwen3 / Llama layer ops.

PEFT computes an adapted projection as ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: four module
calls, a dtype cast of the input per adapter, and separate passes over the output for the scaling and
the sum. A layer with such projections could not run as one fused op (:mod:`roundpipe.models.fused_ops`),
so it fell back to Hugging Face's per-module forward, which made LoRA slower per token than a full
fine-tune although it needs fewer FLOPs.

:func:`projection` reads a projection module as what the fused ops take: a plain ``nn.Linear``'s weight,
or for a PEFT LoRA ``Linear`` that the fused op computes exactly (one active adapter, dropout off or
``p == 0``, no DoRA or other variant, no LoRA bias, not merged, a bias-free ``nn.Linear`` base) a
:class:`LoraWeights`. Anything else gives None and the layer keeps the per-module path, so an adapter the
fused math would not reproduce stays correct. :func:`linear` applies either.

The fused LoRA linear is an autograd Function (:class:`_LoraLinear`) rather than the ops written out for
the compiler, for two reasons: its eager path (CPU workers, compilation off or failed) gets the same
saving as the compiled one, and what the backward keeps is decided here, not by the partitioner:

* forward ``y = x W^T + s (x A^T) B^T``: the base GEMM, the rank-``r`` product ``x A^T``, then one GEMM
  accumulating ``s (x A^T) B^T`` into the base output (``addmm_``: no extra pass for the scaling or the sum);
* saved: ``x`` in its own dtype (the tensor the layer already holds; the fp32 copy PEFT's cast keeps per
  adapter is made again in the backward) and the small ``x A^T``;
* backward, together: ``u = s (dy B)`` (``[tokens, r]``), ``dx = dy W + u A`` (the low-rank term
  accumulated into the base GEMM's output), ``dA = u^T x``, ``dB = s dy^T (x A^T)``, and ``dW = dy^T x``
  only when the base weight trains.

A frozen base kept as fp8 on the device (``fp8=True`` over ``base_format="fp8"``) is a :class:`Fp8Base`: the
base GEMM and the input-gradient GEMM are then FP8 ones (:mod:`roundpipe.models.fp8`), the adapter path as above.
A trained projection that ``fp8=True`` made a torchao ``Float8Linear`` is a :class:`Float8Trained`, computed
as that module computes it, so its layer still runs as one fused op.

Inside the compiled fused ops dynamo traces the Function (forward and backward) into the layer's graph.
Under autocast (which picks each GEMM's dtype) the adapter runs as PEFT's ops, unfused.

Dtype rule (PEFT's): the base GEMM runs in the input's dtype; the adapter path runs in the adapter
weights' dtype (the input cast to it, as PEFT's ``_cast_input_dtype``); the sum is formed in the wider
of the two and rounded to the base output's dtype. Fused are adapters of the base's dtype, and float32
adapters over a bf16 / fp16 base (PEFT's default upcast); other mixes, and PEFT's input cast switched
off, keep PEFT's own modules. In float64 the result equals PEFT's to rounding; in bf16 the sum is
rounded once where PEFT rounds the low-rank product, its scaling and the sum separately.

``RPP_DEBUG_LORA_COMPUTE=base`` computes float32 adapters over a bf16 / fp16 base in the base's dtype instead:
the adapter weights cast to it per call (``[r, in]`` and ``[out, r]``, small), the GEMMs on the tensor cores with
float32 accumulation, the adapter gradients returned in float32. PEFT's float32 path runs its rank-``r`` GEMMs
on CUDA cores while TF32 is off (a qwen3-1.7b LoRA iteration on one H200: 237 of its 875 ms); this one differs
from it within the base dtype's rounding.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import settings
from roundpipe.models import fp8


class Fp8Base(NamedTuple):
    """A frozen base weight kept as fp8 on the device (``fp8=True``): its GEMMs read these bytes
    (:mod:`roundpipe.models.fp8`)."""

    data: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32: row ``o`` of the weight is ``data[o] * scale[o]``


class Float8Trained(NamedTuple):
    """A trained projection under torchao's float8 training recipe (a ``Float8Linear``, ``fp8=True``): its
    weight and recipe, which :func:`linear` applies as the module's forward does."""

    weight: torch.Tensor  # [out, in]: the trained weight, in the model's dtype
    mm_config: Any  # torchao's LinearMMConfig
    config: Any  # torchao's Float8LinearConfig


class LoraWeights(NamedTuple):
    """What the fused ops take for a LoRA projection (all parameters of the PEFT module, not copies)."""

    weight: Union[torch.Tensor, Fp8Base]  # [out, in]: the frozen base weight
    a: torch.Tensor  # [r, in]: lora_A
    b: torch.Tensor  # [out, r]: lora_B
    scaling: float  # alpha / r, or alpha / sqrt(r) with rslora (PEFT's ``scaling[adapter]``)
    base_compute: bool = False  # float32 adapters computed in the input's dtype (``RPP_DEBUG_LORA_COMPUTE=base``)


Projection = Union[torch.Tensor, Fp8Base, Float8Trained, LoraWeights]
"""A projection as the fused ops take it: a plain weight ``[out, in]``, a frozen fp8 one (:class:`Fp8Base`),
a trained one under torchao's float8 recipe (:class:`Float8Trained`) or :class:`LoraWeights`."""

_FUSED_ADAPTER_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
    torch.float64: (torch.float64,),
    torch.bfloat16: (torch.bfloat16,),
    torch.float16: (torch.float16,),
}
"""Adapter dtype -> the base dtypes its fused path reproduces PEFT for (see the dtype rule above)."""


def _lora_linear_class() -> Optional[type]:
    """PEFT's LoRA ``Linear``, when PEFT is loaded (no module can be one otherwise)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None) if layer is not None else None


def _float8_linear_class() -> Optional[type]:
    """torchao's ``Float8Linear``, when torchao's float8 training is loaded (``fp8=True`` loads it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None) if module is not None else None


def _dropout_off(dropout: nn.Module) -> bool:
    return type(dropout) is nn.Identity or (type(dropout) is nn.Dropout and (dropout.p == 0 or not dropout.training))


def _active_adapter(module: nn.Module) -> Optional[str]:
    """The one adapter a PEFT LoRA ``Linear`` applies, when the fused linear computes what it would."""
    m: Any = module
    if m.disable_adapters or m.merged or len(m.active_adapters) != 1:
        return None
    name = m.active_adapters[0]
    if name not in m.lora_A or name in m.lora_variant or m.lora_bias.get(name, False):
        return None
    a, b, base = m.lora_A[name], m.lora_B[name], m.base_layer
    if not all(type(x) is nn.Linear and x.bias is None for x in (a, b, base)):
        return None
    if not _dropout_off(m.lora_dropout[name]) or getattr(m, "fan_in_fan_out", False):
        return None
    adapter, dtype = a.weight.dtype, getattr(base.weight, "dtype", None)  # a host-side packed weight: its own
    if b.weight.dtype != adapter or dtype not in _FUSED_ADAPTER_DTYPES.get(adapter, ()):
        return None
    if adapter != dtype and not getattr(m, "cast_input_dtype_enabled", True):
        return None  # PEFT would feed the base's dtype to the adapter: its own modules say what happens
    return name


def projection(module: nn.Module) -> Optional[Projection]:
    """``module`` as the fused ops take it: a bias-free ``nn.Linear``'s weight (:class:`Fp8Base` for a frozen
    fp8 one on the device), a bias-free torchao ``Float8Linear``'s :class:`Float8Trained`, a fusable PEFT LoRA
    ``Linear``'s :class:`LoraWeights`, or None (biases, quantized or other layers, adapters the fused
    linear would not reproduce: the caller keeps the module's own forward)."""
    if type(module) is nn.Linear:
        return _base(module.weight) if module.bias is None else None
    float8 = _float8_linear_class()
    if float8 is not None and type(module) is float8:
        m8: Any = module
        return Float8Trained(m8.weight, m8.linear_mm_config, m8.config) if m8.bias is None else None
    cls = _lora_linear_class()
    if cls is None or type(module) is not cls:
        return None
    name = _active_adapter(module)
    if name is None:
        return None
    m: Any = module
    a, b = m.lora_A[name].weight, m.lora_B[name].weight
    base_compute = a.dtype == torch.float32 and settings.DEBUG_LORA_COMPUTE.get() == "base"
    return LoraWeights(_base(m.base_layer.weight), a, b, float(m.scaling[name]), base_compute)


def _base(weight: torch.Tensor) -> Union[torch.Tensor, Fp8Base]:  # weight: [out, in]
    """A projection's weight as the fused ops take it: its fp8 bytes for a device :class:`fp8.Fp8Weight`."""
    return Fp8Base(weight.data_fp8, weight.scale) if isinstance(weight, fp8.Fp8Weight) else weight


def has_adapters(layer: nn.Module) -> bool:
    """Whether a projection in ``layer`` runs as the fused LoRA linear."""
    return any(isinstance(projection(m), LoraWeights) for m in layer.modules())


def projection_modules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """``module`` and, for a PEFT LoRA layer, the submodules its forward would call (whose hooks the
    fused op would skip)."""
    return tuple(module.modules())


def linear(
    x: torch.Tensor,  # [..., in]
    proj: Projection,
) -> torch.Tensor:
    """``x`` through a projection: ``F.linear`` for a plain weight, FP8 GEMMs for a frozen fp8 one, the
    fused LoRA linear otherwise (``[..., out]``)."""
    if isinstance(proj, Fp8Base):
        return fp8.linear(x, proj.data, proj.scale)
    if isinstance(proj, Float8Trained):
        return fp8.float8_trained_linear(x, proj.weight, proj.mm_config, proj.config)
    if not isinstance(proj, LoraWeights):
        return F.linear(x, proj)
    weight, w_scale = (proj.weight.data, proj.weight.scale) if isinstance(proj.weight, Fp8Base) else (proj.weight, None)
    if torch.is_autocast_enabled(x.device.type):
        # Autocast picks each GEMM's dtype, which the Function's backward would not see: PEFT's ops.
        base = F.linear(x, weight) if w_scale is None else fp8.linear(x, weight, w_scale)
        return (base + F.linear(F.linear(x.to(proj.a.dtype), proj.a), proj.b) * proj.scaling).to(base.dtype)
    # ``base_compute``: float32 adapters; they run in the input's dtype only where it is a narrower one.
    compute = x.dtype if proj.base_compute and x.dtype in (torch.bfloat16, torch.float16) else None
    return _LoraLinear.apply(x, weight, proj.a, proj.b, proj.scaling, w_scale, compute)


class _LoraLinear(torch.autograd.Function):
    """``y = x W^T + s (x A^T) B^T`` with the backward above (module header); with ``w_scale`` the base is
    frozen fp8 (``W = weight * w_scale[:, None]``) and its two GEMMs are FP8 ones (:mod:`roundpipe.models.fp8`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,  # [..., in]
        weight: torch.Tensor,  # [out, in]
        a: torch.Tensor,  # [r, in]
        b: torch.Tensor,  # [out, r]
        scaling: float,
        w_scale: Optional[torch.Tensor] = None,  # [out] float32, for an fp8 ``weight``
        compute: Optional[torch.dtype] = None,  # the adapter path's dtype when not the adapters' own
    ) -> torch.Tensor:
        ctx.adapter_dtype = a.dtype
        if compute is not None:  # the adapters cast to the base's dtype (small: [r, in] and [out, r])
            a, b = a.to(compute), b.to(compute)
        if w_scale is None:
            base = F.linear(x, weight)  # [..., out] in the input's dtype
        else:
            base = fp8.forward_mm(x.reshape(-1, x.shape[-1]), weight, w_scale).view(*x.shape[:-1], weight.shape[0])
        xa = F.linear(x.to(a.dtype), a)  # [..., r] in the adapter's dtype
        flat, xa2 = base.reshape(-1, base.shape[-1]), xa.reshape(-1, xa.shape[-1])
        if a.dtype == base.dtype:
            y = flat.addmm_(xa2, b.t(), alpha=scaling)
        else:  # PEFT: the sum in the wider dtype, rounded to the base's
            y = torch.addmm(flat.to(a.dtype), xa2, b.t(), alpha=scaling).to(base.dtype)
        ctx.save_for_backward(x, weight, a, b, xa, w_scale)
        ctx.scaling = scaling
        return y.view(base.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        x, weight, a, b, xa, w_scale = ctx.saved_tensors
        s = ctx.scaling
        need_x, need_w, need_a, need_b = ctx.needs_input_grad[:4]
        adapter = ctx.adapter_dtype  # what the adapter gradients are returned in
        x2, xa2 = x.reshape(-1, x.shape[-1]), xa.reshape(-1, xa.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])  # [tokens, out]
        dyl = dy2.to(a.dtype)  # the adapter path's gradient in its dtype (PEFT's casts, backward)
        u = (dyl @ b).mul_(s)  # [tokens, r]
        dx = dw = da = db = None
        if need_x:
            dx = dy2 @ weight if w_scale is None else fp8.grad_input_mm(dy2, weight, w_scale)  # [tokens, in]
            if a.dtype == dx.dtype:
                dx.addmm_(u, a)
            else:
                dx += (u @ a).to(dx.dtype)
            dx = dx.view(x.shape)
        if need_w:
            dw = dy2.t() @ x2.to(dy2.dtype)
        if need_a:
            da = (u.t() @ x2.to(a.dtype)).to(adapter)  # [r, in]
        if need_b:
            db = (dyl.t() @ xa2).mul_(s).to(adapter)  # [out, r]
        return dx, dw, da, db, None, None, None


__all__ = [
    "Float8Trained",
    "Fp8Base",
    "LoraWeights",
    "Projection",
    "has_adapters",
    "linear",
    "projection",
    "projection_modules",
]
