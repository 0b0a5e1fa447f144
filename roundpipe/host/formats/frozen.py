"""``FrozenWeight``: a frozen parameter held on the host in a packed format, and the calls that make one.

A ``FrozenWeight`` is a wrapper tensor subclass with the weight's logical shape and dtype (bf16, say) on
the cpu device, holding only the packed host tensors (``.packed``) and its format (``.format``). It sits
inside an ``nn.Parameter(requires_grad=False)``, so PEFT modules, ``named_parameters()``, shapes and
dtypes look as they did; the transfer layer uploads the packed bytes and dequantizes them on the device
(``roundpipe.runtime.transfer``). On the host it supports only what module plumbing needs (detach,
alias, ``.data``, pinning, clone, an in-place copy from a FrozenWeight of the same format); any other
op raises an error that names ``.dequantize()``. Aliases share one ``packed`` dict, so pinning a
parameter's packed tensors in place is seen through every alias.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.host.formats import codecs
from roundpipe.host.formats.bnb import bnb_packed, is_linear4bit
from roundpipe.host.formats.codecs import Format, Fp8Format, Int8Format, Packed
from roundpipe.host.formats.nf4 import Nf4Format
from roundpipe.utils import BASE_FORMATS, host_nbytes

_INNER = "packed_"  # prefix of the packed tensors' names in ``__tensor_flatten__``
_FORMATS: Dict[str, Format] = {f.name: f for f in (Fp8Format(), Int8Format(), Nf4Format())}


def check_base_format(name: str) -> str:
    """``name`` if it is one of ``BASE_FORMATS``; otherwise a ValueError naming ``base_format``."""
    if name not in BASE_FORMATS:
        raise ValueError(f"base_format={name!r}: expected one of {', '.join(BASE_FORMATS)}")
    return name


def get_format(name: str) -> Format:
    """The format object of a packed ``base_format`` (not ``bf16``, which is a plain tensor)."""
    check_base_format(name)
    if name == "bf16":
        raise ValueError("base_format='bf16' keeps frozen weights as plain tensors: there is no packed format")
    return _FORMATS[name]


class FrozenWeight(torch.Tensor):
    """A frozen weight of logical ``shape`` / ``dtype`` stored as ``packed`` host tensors of ``format``."""

    packed: Packed
    format: Format

    @staticmethod
    def __new__(cls, packed: Packed, fmt: Format, shape: Sequence[int], dtype: torch.dtype) -> "FrozenWeight":
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device="cpu", requires_grad=False)
        t.packed, t.format = packed, fmt
        return t

    def __init__(self, packed: Packed, fmt: Format, shape: Sequence[int], dtype: torch.dtype) -> None:
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> "FrozenWeight":
        """``w`` [out, in] (float64, fp32 or bf16) packed in format ``fmt``; logical dtype ``w.dtype``. The packing
        runs where ``w`` is (a GPU packs a large weight in milliseconds, the host in seconds) and the packed
        tensors come back to the host."""
        if w.dim() != 2:
            raise ValueError(f"FrozenWeight.quantize: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
        if not w.is_floating_point():
            raise ValueError(f"FrozenWeight.quantize: expected a floating-point weight, got {w.dtype}")
        f = get_format(fmt)
        packed = {k: v.cpu() for k, v in f.quantize(w.detach()).items()}
        return cls(packed, f, w.shape, w.dtype)

    @classmethod
    def random(
        cls,
        shape: Tuple[int, int],
        fmt: str,
        dtype: torch.dtype = torch.bfloat16,
        std: float = 0.02,
        generator: Optional[torch.Generator] = None,
        device: Any = "cpu",
    ) -> "FrozenWeight":
        """A random weight of ``shape`` [out, in] (standard deviation about ``std``) built packed: host
        memory never holds it in ``dtype``, so a large model's random base costs only its packed bytes. The
        numbers are drawn on ``device`` (``generator``'s, when given) and the packed tensors come to the host."""
        if len(shape) != 2:
            raise ValueError(f"FrozenWeight.random: expected a 2-D shape [out, in], got {tuple(shape)}")
        f = get_format(fmt)
        if generator is not None:
            device = generator.device
        packed = f.random((int(shape[0]), int(shape[1])), dtype, std, generator, device=device)
        return cls({k: v.cpu() for k, v in packed.items()}, f, shape, dtype)

    def dequantize(self, device: Optional[Any] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The plain weight [out, in] in ``dtype`` (default: the logical one) on ``device`` (default cpu);
        the packed tensors are copied there first, so the unpacking runs on that device."""
        packed = self.packed if device is None else {k: v.to(device) for k, v in self.packed.items()}
        return self.format.dequantize(packed, self.shape, dtype or self.dtype)

    def dequantize_into(self, packed: Packed, out: torch.Tensor) -> torch.Tensor:
        """Unpack ``packed`` (these tensors, already on ``out``'s device) into ``out`` [out, in] (a graph slot)."""
        return self.format.dequantize(packed, self.shape, out.dtype, out=out)

    def host_nbytes(self) -> int:
        """Bytes the packed host tensors hold."""
        return host_nbytes(self)

    def _alias(self, packed: Optional[Packed] = None) -> "FrozenWeight":
        return FrozenWeight(self.packed if packed is None else packed, self.format, self.shape, self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FrozenWeight(shape={tuple(self.shape)}, dtype={self.dtype}, format={self.format.name!r})"

    def __tensor_flatten__(self) -> Tuple[list, Dict[str, Any]]:
        # Inner tensors named ``packed_<part>``: a part's own name may be a Tensor attribute (``mean``, ``data``).
        names = [_INNER + k for k in sorted(self.packed)]
        return names, {"format": self.format, "shape": tuple(self.shape), "dtype": self.dtype}

    def __getattr__(self, name: str) -> Any:
        # ``__tensor_flatten__``'s inner tensor names resolve to the packed tensors.
        packed = self.__dict__.get("packed")
        if packed is not None and name.startswith(_INNER) and name[len(_INNER) :] in packed:
            return packed[name[len(_INNER) :]]
        raise AttributeError(name)

    @staticmethod
    def __tensor_unflatten__(inner: Dict[str, torch.Tensor], meta: Dict[str, Any], size: Any, stride: Any) -> Any:
        packed = {k[len(_INNER) :]: v for k, v in inner.items()}
        return FrozenWeight(packed, meta["format"], meta["shape"], meta["dtype"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        raise NotImplementedError(
            f"FrozenWeight ({_describe(args)}) does not support {func} on the host: it holds packed bytes. "
            "Call .dequantize() for a plain tensor (the RoundPipe devices dequantize it themselves)."
        )


def _describe(args: Tuple) -> str:
    for a in args:
        if isinstance(a, FrozenWeight):
            return f"format {a.format.name!r}, shape {tuple(a.shape)}"
    return "packed"


def _h_alias(func: Any, args: Tuple, kwargs: Dict) -> Any:
    return args[0]._alias()


def _h_is_pinned(func: Any, args: Tuple, kwargs: Dict) -> bool:
    return all(t.is_pinned() for t in args[0].packed.values())


def _h_pin(func: Any, args: Tuple, kwargs: Dict) -> Any:
    return args[0]._alias({k: v.pin_memory() for k, v in args[0].packed.items()})


def _h_clone(func: Any, args: Tuple, kwargs: Dict) -> Any:
    return args[0]._alias({k: v.clone() for k, v in args[0].packed.items()})


def _h_copy(func: Any, args: Tuple, kwargs: Dict) -> Any:
    dst, src = args[0], args[1]
    same = (
        isinstance(src, FrozenWeight) and src.format.name == dst.format.name and src.packed.keys() == dst.packed.keys()
    )
    if not (same and src.shape == dst.shape):
        raise NotImplementedError(
            f"FrozenWeight.copy_: the source must be a FrozenWeight of format {dst.format.name!r} and shape "
            f"{tuple(dst.shape)}; quantize it first (FrozenWeight.quantize), or call .dequantize() for a plain tensor"
        )
    for k, v in dst.packed.items():
        v.copy_(src.packed[k])
    return dst


_HANDLERS: Dict[Any, Callable[[Any, Tuple, Dict], Any]] = {
    torch.ops.aten.detach: _h_alias,
    torch.ops.aten.alias: _h_alias,
    torch.ops.aten.is_pinned: _h_is_pinned,
    torch.ops.aten._pin_memory: _h_pin,
    torch.ops.aten.clone: _h_clone,
    torch.ops.aten.copy_: _h_copy,
}


def _skipped(name: str, skip: Sequence[str]) -> bool:
    parts = name.split(".")
    return any(s in parts or name == s or name.endswith("." + s) for s in skip)


def quantize_frozen(module: nn.Module, base_format: str, skip: Sequence[str] = ("lm_head",)) -> int:
    """Replace, in place, each frozen (``requires_grad`` False) 2-D weight of an ``nn.Linear`` in ``module``
    (PEFT's ``base_layer`` included) by a FrozenWeight in ``base_format``; returns the host bytes saved.
    Embeddings, norms, trainable weights and modules named in ``skip`` keep their tensors; a weight shared
    by several Linears is packed once. ``bf16`` changes nothing."""
    check_base_format(base_format)
    if base_format == "bf16":
        return 0
    done: Dict[int, nn.Parameter] = {}
    saved = 0
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.Linear) or _skipped(name, skip):
            continue
        w = mod._parameters.get("weight")
        if w is None or w.requires_grad or w.dim() != 2 or isinstance(w.data, FrozenWeight):
            continue
        if w.device.type == "meta":
            raise ValueError(f"quantize_frozen: {name}.weight is on the meta device; load its values first")
        if id(w) not in done:
            with torch.no_grad():
                done[id(w)] = nn.Parameter(FrozenWeight.quantize(w.detach(), base_format), requires_grad=False)
            saved += w.numel() * w.element_size() - host_nbytes(done[id(w)])
        mod._parameters["weight"] = done[id(w)]
    return saved


def frozen_weights(module: nn.Module) -> Dict[str, FrozenWeight]:
    """The FrozenWeight parameters of ``module`` by name."""
    return {n: p for n, p in module.named_parameters() if isinstance(p, FrozenWeight)}


def adopt_bnb_4bit(module: nn.Module) -> int:
    """Replace every bitsandbytes ``Linear4bit`` in ``module`` (PEFT's ``base_layer`` included) by an
    ``nn.Linear`` of the same features whose weight is a FrozenWeight of its packed bytes, in the weight's
    original dtype (the model's: bitsandbytes' ``compute_dtype``, float32 by default, would not match the
    activations of a bf16 model); the bias stays. Returns how many were adopted."""
    found = [(name, mod) for name, mod in module.named_modules() if is_linear4bit(mod)]
    for name, mod in found:
        packed, fmt = bnb_packed(mod.weight)
        dtype = fmt.dtype
        shape = mod.weight.quant_state.shape
        lin = nn.Linear(int(shape[1]), int(shape[0]), bias=False, device="meta")
        lin.weight = nn.Parameter(FrozenWeight(packed, fmt, tuple(shape), dtype), requires_grad=False)
        lin.bias = mod.bias
        lin.train(mod.training)
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, lin)
    return len(found)


def quantize_base(model: nn.Module, base_format: str) -> int:
    """``quantize_frozen`` for the wrappers' ``base_format=``: a packed format on a model with no frozen
    ``nn.Linear`` weight (nothing to pack) is an error naming what to change. Layers bitsandbytes quantized
    (``Linear4bit``) are adopted with their packing first (``bnb.adopt_bnb_4bit``). Returns the bytes saved
    by ``base_format``."""
    check_base_format(base_format)
    adopt_bnb_4bit(model)  # a bitsandbytes 4-bit base is kept as bitsandbytes packed it, whatever base_format
    if base_format == "bf16":
        return 0
    saved = quantize_frozen(model, base_format)
    if not frozen_weights(model):
        raise ValueError(
            f"base_format={base_format!r}: the model has no frozen nn.Linear weight to store packed (only weights "
            "with requires_grad=False are packed: freeze the base, e.g. with a PEFT LoRA model), or pass "
            "base_format='bf16'"
        )
    return saved


def dequantize_transient_bytes(t: torch.Tensor) -> int:
    """Device bytes an upload of ``t`` holds besides its plain weight while it is unpacked: a FrozenWeight's
    packed bytes and one chunk's intermediates (``codecs.DEQUANT_CHUNK`` elements: a float32 copy or an
    int32 index, and the values); 0 for a plain tensor."""
    if not isinstance(t, FrozenWeight):
        return 0
    return t.host_nbytes() + min(t.numel(), codecs.DEQUANT_CHUNK) * (4 + t.element_size())


def module_device_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s parameters and buffers take on a device while it runs: the logical sizes (a
    FrozenWeight arrives as a plain tensor of its dtype) plus the largest unpacking transient (the
    transfer layer unpacks one weight at a time)."""
    seen: Dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[id(t)] = t
    logical = sum(t.numel() * t.element_size() for t in seen.values())
    return logical + max((dequantize_transient_bytes(t) for t in seen.values()), default=0)
