"""FP8 GEMMs for the decoder layers' projections (``fp8=True``).

Two cases, one switch:

* **A frozen base stored as fp8** (``base_format="fp8"``: e4m3 data, one fp32 scale per output row, fixed at
  load). Its upload stays packed on the device (:class:`Fp8Weight`, half the bytes of bf16) and the fused
  projection runs its forward and input-gradient GEMMs in FP8 from those bytes: the activation (forward) or
  the output gradient times the weight's row scales (backward) is quantized dynamically, one scale per
  token row, and multiplied with ``torch._scaled_mm``. There is no per-step weight quantization and no
  dequantize to bf16. The forward is ``y[t] = sx[t] sw[o] sum_i xq[t, i] wq[o, i]``; the input gradient
  contracts over the output rows that carry the weight's scales, so those fold into the gradient before
  it is quantized: ``dx = q(dy * sw) @ wq``.
* **Trained weights** (a full fine-tune): torchao's float8 training recipe (``Float8Linear``, dynamic
  tensorwise scaling of the input, weight and output gradient) on the decoder layers' ``nn.Linear``s,
  converted at wrap time; the weights stay bf16 in host memory and are cast per step on the device.

The embedding, the LM head, the norms, an MoE router and the loss stay in the model's dtype. On CPU
workers (no FP8 matmul hardware) the same path runs with the same casts (``float8_e4m3fn``) and the GEMM in
float32 over the values dequantized from fp8 (:func:`emulated_scaled_mm`, what ``torch._scaled_mm`` computes
on CPU), so the path is tested where the suite runs. A CUDA GPU below compute capability 8.9 (before Ada and
Hopper) has no FP8 GEMM: ``fp8=True`` there is an error naming the flag.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.host.formats import FrozenWeight
from roundpipe.host.formats.codecs import Fp8Format, Packed
from roundpipe.utils import FP8_PREPARED

#: The fp8 dtype of activations and gradients: e4m3 with a scale per row (torchao's rowwise recipe casts the
#: output gradient to e4m3 too: a scale per row gives it the range e5m2 would buy with two mantissa bits).
QUANT_DTYPE = torch.float8_e4m3fn
#: Smallest amax a row's scale is taken from (torchao's ``EPS``): an all-zero row quantizes to zeros.
AMAX_EPS = 1e-12
#: Compute capability from which CUDA GPUs have FP8 GEMMs (Ada 8.9, Hopper 9.0 and later).
MIN_CAPABILITY = (8, 9)
#: Whether ``torch._scaled_mm`` takes rowwise scales on this machine's GPUs (set by :func:`check_hardware`):
#: PyTorch's rowwise kernels are built for Hopper and datacenter Blackwell (majors 9 and 10). Elsewhere the
#: GEMM runs with unit scales into float32 and the row scales are applied after it: the same products and
#: sums, scaled in the same float32 epilogue, for one more pass over the output.
ROWWISE_GPU = True
_ROWWISE_MAJORS = (9, 10)


def check_capabilities(capabilities: Sequence[Tuple[int, int]]) -> None:
    """Raise if a CUDA GPU of compute capability ``capabilities[i]`` cannot run FP8 GEMMs (below 8.9)."""
    for i, cap in enumerate(capabilities):
        if tuple(cap) < MIN_CAPABILITY:
            raise ValueError(
                f"fp8=True: GPU {i} has compute capability {cap[0]}.{cap[1]}, and FP8 GEMMs need 8.9 or later "
                "(Ada, Hopper, Blackwell); remove fp8=True (--fp8 on the command line) to train in bf16"
            )


def check_hardware() -> None:
    """:func:`check_capabilities` of every visible CUDA GPU (nothing to check on CPU workers); sets
    :data:`ROWWISE_GPU` from them."""
    global ROWWISE_GPU
    if torch.cuda.is_available():
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        check_capabilities(caps)
        ROWWISE_GPU = all(cap[0] in _ROWWISE_MAJORS for cap in caps)


# ---------------------------------------------------------------------------------------------------------
# The GEMM: dynamic rowwise quantization, torch._scaled_mm on a GPU, its emulation on CPU
# ---------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the casts and the emulated GEMM compute in: float32, float64 for a float64 model (exact tests:
    e4m3 values times float32 scales are exact there, so a sum's order changes only its last bits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_rows(
    x: torch.Tensor,  # [rows, k]
    dtype: torch.dtype = QUANT_DTYPE,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` as fp8 ``q`` [rows, k] and a float32 scale [rows, 1] with ``x ~= q * scale`` (``amax / fmax``).

    The row maximum is taken in ``x``'s dtype (exact) and the division promotes ``x`` inside it: no float32 copy
    of ``x`` of its own, which a compiled layer would otherwise share with an fp32 adapter's ``x A^T`` and keep
    for the backward in place of the bf16 input (twice the bytes of every projection's input)."""
    fmax = torch.finfo(dtype).max
    cdt = _compute_dtype(x.dtype)
    scale = (x.abs().amax(dim=1, keepdim=True).to(cdt).clamp(min=AMAX_EPS) / fmax).to(torch.float32)
    return torch.div(x, scale.to(cdt)).clamp(-fmax, fmax).to(dtype), scale


def emulated_scaled_mm(
    a: torch.Tensor,  # [m, k] fp8
    b: torch.Tensor,  # [k, n] fp8
    scale_a: torch.Tensor,  # [m, 1] float32
    scale_b: torch.Tensor,  # [1, n] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm`` without FP8 hardware: the GEMM in float32 (float64 for a float64 ``out_dtype``)
    over the dequantized values, exactly what ``torch._scaled_mm`` computes on CPU, rounded to ``out_dtype``
    ([m, n])."""
    cdt = _compute_dtype(out_dtype)
    return ((a.to(cdt) * scale_a.to(cdt)) @ (b.to(cdt) * scale_b.to(cdt))).to(out_dtype)


def scaled_mm(
    a: torch.Tensor,  # [m, k] fp8, row-major
    b: torch.Tensor,  # [k, n] fp8, column-major on a GPU
    scale_a: torch.Tensor,  # [m, 1] float32
    scale_b: torch.Tensor,  # [1, n] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` [m, n]: ``torch._scaled_mm`` on a GPU (rowwise scales into bf16, or
    :func:`unit_scaled_mm` times the scales where :data:`ROWWISE_GPU` is off or the output is not bf16:
    PyTorch's rowwise kernels write bf16 only), emulated elsewhere."""
    if a.device.type != "cuda":
        return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    if ROWWISE_GPU and out_dtype == torch.bfloat16:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return (unit_scaled_mm(a, b) * scale_a * scale_b).to(out_dtype)


def unit_scaled_mm(
    a: torch.Tensor,  # [m, k] fp8, row-major
    b: torch.Tensor,  # [k, n] fp8, column-major on a GPU
) -> torch.Tensor:
    """``a @ b`` in float32 ([m, n]): ``torch._scaled_mm`` with unit tensorwise scales, which every FP8 GPU
    runs; the rowwise scales are then applied by the caller (the fallback of :func:`scaled_mm`)."""
    one = torch.ones((), dtype=torch.float32, device=a.device)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)


def forward_mm(
    x: torch.Tensor,  # [tokens, in]
    data: torch.Tensor,  # [out, in] e4m3
    scale: torch.Tensor,  # [out] float32
) -> torch.Tensor:
    """``x W^T`` [tokens, out] in ``x``'s dtype, ``W = data * scale[:, None]``: ``x`` quantized per row."""
    xq, sx = quantize_rows(x)
    return scaled_mm(xq, data.t(), sx, scale[None, :], x.dtype)


def grad_input_mm(
    dy: torch.Tensor,  # [tokens, out]
    data: torch.Tensor,  # [out, in] e4m3
    scale: torch.Tensor,  # [out] float32
) -> torch.Tensor:
    """``dy W`` [tokens, in] in ``dy``'s dtype: the weight's row scales folded into ``dy`` (they lie along
    the contraction), which is then quantized per row; the weight enters as its fp8 bytes."""
    gq, sg = quantize_rows(dy.to(_compute_dtype(dy.dtype)) * scale[None, :])
    return _grad_input_gemm(gq, sg, data, dy.dtype)


@torch.library.custom_op("roundpipe::fp8_grad_input_gemm", mutates_args=())
def _grad_input_gemm(
    gq: torch.Tensor,  # [tokens, out] e4m3
    sg: torch.Tensor,  # [tokens, 1] float32
    data: torch.Tensor,  # [out, in] e4m3
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(gq * sg) @ data`` [tokens, in]. ``torch._scaled_mm`` takes its second operand column-major, so a GPU
    makes a transposed copy of the fp8 bytes (1 byte a value) here. An opaque op, so that a compiled layer's
    partitioner cannot move that copy into the forward and keep it for the backward in place of ``data``,
    which the weight holds anyway: one more fp8 weight per kept layer."""
    ones = torch.ones((1, data.shape[1]), dtype=torch.float32, device=data.device)
    b = data.t().contiguous().t() if data.device.type == "cuda" else data
    return scaled_mm(gq, b, sg, ones, out_dtype)


@_grad_input_gemm.register_fake
def _(gq: torch.Tensor, sg: torch.Tensor, data: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return gq.new_empty((gq.shape[0], data.shape[1]), dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """``y = x W^T`` over a frozen fp8 weight: :func:`forward_mm`, and :func:`grad_input_mm` backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,  # [..., in]
        data: torch.Tensor,  # [out, in] e4m3
        scale: torch.Tensor,  # [out] float32
    ) -> torch.Tensor:
        ctx.save_for_backward(data, scale)
        ctx.x_shape = x.shape
        y = forward_mm(x.reshape(-1, x.shape[-1]), data, scale)
        return y.view(*x.shape[:-1], data.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        data, scale = ctx.saved_tensors
        dx = grad_input_mm(dy.reshape(-1, dy.shape[-1]), data, scale) if ctx.needs_input_grad[0] else None
        return (None if dx is None else dx.view(ctx.x_shape)), None, None


def linear(
    x: torch.Tensor,  # [..., in]
    data: torch.Tensor,  # [out, in] e4m3
    scale: torch.Tensor,  # [out] float32
) -> torch.Tensor:
    """``x`` through a frozen fp8 projection (``[..., out]``), FP8 GEMMs forward and backward."""
    return _Fp8Linear.apply(x, data, scale)


def float8_trained_linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    mm_config: Any,
    config: Any,
) -> torch.Tensor:
    """``x`` through a trained projection under torchao's float8 recipe (``[..., out]``): what a bias-free
    ``Float8Linear``'s forward computes, as a function of tensors (so the fused layer ops can take it)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())  # Float8Linear's own rule under autocast
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)


# ---------------------------------------------------------------------------------------------------------
# A frozen fp8 base kept packed on the device
# ---------------------------------------------------------------------------------------------------------


class Fp8Weight(torch.Tensor):
    """A frozen fp8 weight on a device: logical shape ``[out, in]`` and dtype, holding the packed ``data``
    (e4m3) and ``scale`` (fp32 per row) as uploaded. The fused projections read those
    (:func:`roundpipe.models.lora.projection`), and so does a module's ``F.linear(x, weight)`` without bias
    (a layer run module by module, PEFT's ``base_layer``); any other op sees the dequantized weight."""

    data_fp8: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "Fp8Weight":
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(data.shape), dtype=dtype, device=data.device)
        t.data_fp8, t.scale = data, scale
        return t

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        pass

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], Fp8Weight) and not isinstance(args[0], cls):
            if (args[2] if len(args) > 2 else kwargs.get("bias")) is None:
                return linear(args[0], args[1].data_fp8, args[1].scale)
        with torch._C.DisableTorchFunctionSubclass():  # results as they are (no conversion to this class)
            return func(*args, **kwargs)

    def dequantize(self) -> torch.Tensor:
        """The plain weight [out, in] in the logical dtype."""
        cdt = _compute_dtype(self.dtype)
        return (self.data_fp8.to(cdt) * self.scale[:, None].to(cdt)).to(self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"Fp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.alias):
            w = args[0]
            return Fp8Weight(w.data_fp8, w.scale, w.dtype)

        def plain(a: Any) -> Any:
            return a.dequantize() if isinstance(a, Fp8Weight) else a

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


class Fp8ComputeFormat(Fp8Format):
    """The fp8 format of a frozen base that computes from its packed bytes: its device copy is an
    :class:`Fp8Weight` instead of the dequantized weight (the packing, and every host-side use, unchanged)."""

    keeps_packed = True  # a graph slot holds the data and scales too (``roundpipe.runtime.transfer``)

    def device_weight(self, packed: Packed, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return Fp8Weight(packed["data"], packed["scale"], dtype)


FP8_COMPUTE = Fp8ComputeFormat()


def _frozen_linear_weights(model: nn.Module) -> Dict[int, Tuple[str, torch.Tensor]]:
    """The frozen ``nn.Linear`` weights of ``model`` (each shared one once), with their module's name."""
    found: Dict[int, Tuple[str, torch.Tensor]] = {}
    for name, mod in model.named_modules():
        w = mod._parameters.get("weight") if isinstance(mod, nn.Linear) else None
        if w is not None and not w.requires_grad:
            found.setdefault(id(w), (name, w))
    return found


def _gemm_shape(w: torch.Tensor) -> bool:  # w: [out, in]
    """Whether ``torch._scaled_mm`` takes ``w``'s features (multiples of 16 both)."""
    return w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def enable_fp8_base(model: nn.Module) -> int:
    """Make every frozen fp8 decoder-layer ``nn.Linear`` weight of ``model`` (features multiples of 16, not a
    router) compute from its packed bytes (:class:`Fp8ComputeFormat`); returns how many. A frozen weight kept in
    another format cannot: an error names ``base_format``."""
    count = 0
    for name, w in _frozen_linear_weights(model).values():
        if "layers." not in f".{name}" or name.endswith("lm_head") or _router(name):
            continue  # only the decoder layers' projections: the head and a router stay in the model's dtype
        if not isinstance(w, FrozenWeight) or w.format.name != "fp8":
            kind = w.format.name if isinstance(w, FrozenWeight) else str(w.dtype).replace("torch.", "")
            raise ValueError(
                f"fp8=True: the frozen weight {name}.weight is kept as {kind}; an FP8 GEMM over a frozen base reads "
                "it stored as fp8 with scales fixed at load: pass base_format='fp8' (--base-format fp8), or remove "
                "fp8=True"
            )
        if _gemm_shape(w):  # otherwise unpacked on the device as without fp8
            w.format = FP8_COMPUTE
            count += 1
    return count


def _router(fqn: str) -> bool:
    """Whether ``fqn`` names an MoE router (``mlp.gate`` in Qwen3-MoE, ``block_sparse_moe.gate`` in Mixtral)."""
    return fqn.rsplit(".", 1)[-1] == "gate"


def trained_filter(module: nn.Module, fqn: str) -> bool:
    """Which modules torchao's float8 training converts: a decoder layer's ``nn.Linear`` with a trained
    weight whose features are multiples of 16 (``torch._scaled_mm``'s), never the head, a router or a LoRA
    adapter (small GEMMs, which the fused LoRA linear computes in the adapter's dtype)."""
    if type(module) is not nn.Linear or not module.weight.requires_grad:
        return False
    if "layers." not in f".{fqn}" or fqn.endswith("lm_head") or _router(fqn):
        return False
    if any(part.startswith("lora_") for part in fqn.split(".")):
        return False
    return _gemm_shape(module.weight)


def convert_trained(model: nn.Module) -> int:
    """torchao's float8 training recipe (``Float8Linear``, dynamic tensorwise scaling) on the decoder layers'
    trained ``nn.Linear``s of ``model``, in place (:func:`trained_filter`); returns how many. torchao is imported
    only where there is one to convert: a LoRA over an fp8 base needs none."""
    if not any(trained_filter(m, fqn) for fqn, m in model.named_modules()):
        return 0
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise ImportError(
            f"fp8=True over trained weights (a full fine-tune) uses torchao's float8 training, which does not import "
            f"here ({e}): install torchao for this torch (pip install torchao), or remove fp8=True"
        ) from e

    convert_to_float8_training(model, module_filter_fn=trained_filter, config=Float8LinearConfig())
    return sum(1 for m in model.modules() if isinstance(m, Float8Linear))


def unconverted(model: nn.Module) -> List[str]:
    """Names of the decoder-layer projections of ``model`` that :func:`prepare` would convert (or refuse) and
    that are not converted: trained ``nn.Linear``s of :func:`trained_filter`, and frozen weights not yet
    computing from fp8 bytes."""
    names = [fqn for fqn, m in model.named_modules() if trained_filter(m, fqn)]
    for name, w in _frozen_linear_weights(model).values():
        if "layers." not in f".{name}" or name.endswith("lm_head") or _router(name) or not _gemm_shape(w):
            continue
        if not (isinstance(w, FrozenWeight) and w.format is FP8_COMPUTE):
            names.append(name)
    return names


def computes_in_fp8(layer: nn.Module) -> bool:
    """Whether some projection of ``layer`` runs FP8 GEMMs (a frozen base computing from its fp8 bytes, or a
    torchao ``Float8Linear``)."""
    for m in layer.modules():
        if type(m).__name__ == "Float8Linear":
            return True
        w = getattr(m, "weight", None)
        if isinstance(w, FrozenWeight) and w.format is FP8_COMPUTE:
            return True
    return False


def prepare(model: nn.Module, enabled: bool) -> None:
    """Set ``model`` up for ``fp8=True`` (at wrap time, before it is split): frozen fp8 bases compute from
    their bytes (:func:`enable_fp8_base`), trained projections become torchao ``Float8Linear``s
    (:func:`convert_trained`). Errors: a GPU without FP8, a frozen base not stored as fp8, a model with no
    decoder-layer projection to run in FP8."""
    if not enabled:
        return
    check_hardware()
    if enable_fp8_base(model) + convert_trained(model) == 0:
        raise ValueError(
            "fp8=True: the model has no decoder-layer nn.Linear to run in FP8 (a frozen base stored with "
            "base_format='fp8', or trained projections with features a multiple of 16); remove fp8=True"
        )
    mark_prepared(model)


def mark_prepared(module: nn.Module) -> None:
    """Mark ``module`` and everything in it as set up for ``fp8=True`` (``roundpipe.utils.FP8_PREPARED``, which a
    ``RoundPipe`` under ``RoundPipeRunConfig(fp8=True)`` checks); the wrappers also mark what they add (the loss)."""
    for m in module.modules():
        setattr(m, FP8_PREPARED, True)


def wants_fp8(fp8: Optional[bool], model_run_config: Any) -> bool:
    """The wrappers' ``fp8``: the keyword when given, else ``model_run_config.fp8``; both given and
    different is an error."""
    from_config = getattr(model_run_config, "fp8", None)
    if fp8 is not None and from_config is not None and bool(fp8) != bool(from_config):
        raise ValueError(f"fp8={fp8} and model_run_config.fp8={from_config} disagree: give one of them")
    return bool(fp8 if fp8 is not None else from_config)


__all__ = [
    "FP8_COMPUTE",
    "Fp8ComputeFormat",
    "Fp8Weight",
    "check_capabilities",
    "check_hardware",
    "convert_trained",
    "emulated_scaled_mm",
    "enable_fp8_base",
    "float8_trained_linear",
    "forward_mm",
    "grad_input_mm",
    "linear",
    "mark_prepared",
    "prepare",
    "unconverted",
    "quantize_rows",
    "scaled_mm",
    "trained_filter",
    "unit_scaled_mm",
    "wants_fp8",
]
