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

import math
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.host.formats import codecs
from roundpipe.host.formats.bnb import bnb_packed, is_linear4bit
from roundpipe.host.formats.codecs import Format, Fp8Format, Int8Format, Packed
from roundpipe.host.formats.mxfp4 import E2M1_VALUES, MXFP4, MXFP4_TRANSPOSED, Mxfp4Format
from roundpipe.host.formats.nf4 import Nf4Format
from roundpipe.utils import BASE_FORMATS, host_nbytes

_INNER = "packed_"  # prefix of the packed tensors' names in ``__tensor_flatten__``
_FORMATS: Dict[str, Format] = {f.name: f for f in (Fp8Format(), Int8Format(), Nf4Format(), MXFP4)}


def check_base_format(name: str) -> str:
    """``name`` if it is one of ``BASE_FORMATS``; otherwise a ValueError naming ``base_format``."""
    if name not in BASE_FORMATS:
        raise ValueError(f"base_format={name!r}: expected one of {', '.join(BASE_FORMATS)}")
    return name


def get_format(name: str, transposed: bool = False) -> Format:
    """The format object of a packed ``base_format`` (not ``bf16``, which is a plain tensor). ``transposed``: the
    weights are [..., in, out] (GPT-OSS's experts), which only mxfp4's packing (blocks along the inputs) tells apart."""
    check_base_format(name)
    if name == "bf16":
        raise ValueError("base_format='bf16' keeps frozen weights as plain tensors: there is no packed format")
    if name == "mxfp4":
        return MXFP4_TRANSPOSED if transposed else MXFP4
    return _FORMATS[name]


def packing_shape(fmt: Format, shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape ``fmt`` packs a weight of logical ``shape`` as: mxfp4 its own (blocks per matrix); the other
    formats a 2-D [rows, last dim] (per-row scales of the flattened rows; NF4's blocks of the flattened tensor),
    which for a 2-D weight is its shape."""
    shape = tuple(int(s) for s in shape)
    if isinstance(fmt, Mxfp4Format) or len(shape) == 2:
        return shape
    return (math.prod(shape[:-1]), shape[-1])


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
    def quantize(cls, w: torch.Tensor, fmt: str, transposed: bool = False) -> "FrozenWeight":
        """``w`` [out, in], or [experts, out, in] (float64, fp32 or bf16) packed in format ``fmt``; logical dtype
        ``w.dtype``. ``transposed``: ``w`` is [..., in, out] (GPT-OSS's expert weights; see ``get_format``). The
        packing runs where ``w`` is (a GPU packs a large weight in milliseconds, the host in seconds) and the packed
        tensors come back to the host."""
        if w.dim() not in (2, 3):
            raise ValueError(
                f"FrozenWeight.quantize: expected a 2-D weight [out, in] or a 3-D [experts, out, in], got shape "
                f"{tuple(w.shape)}"
            )
        if not w.is_floating_point():
            raise ValueError(f"FrozenWeight.quantize: expected a floating-point weight, got {w.dtype}")
        f = get_format(fmt, transposed)
        packed = {k: v.cpu() for k, v in f.quantize(w.detach().reshape(packing_shape(f, w.shape))).items()}
        return cls(packed, f, w.shape, w.dtype)

    @classmethod
    def random(
        cls,
        shape: Tuple[int, ...],
        fmt: str,
        dtype: torch.dtype = torch.bfloat16,
        std: float = 0.02,
        generator: Optional[torch.Generator] = None,
        device: Any = "cpu",
        transposed: bool = False,
    ) -> "FrozenWeight":
        """A random weight of ``shape`` [out, in] or [experts, out, in] ([..., in, out] when ``transposed``;
        standard deviation about ``std``) built packed: host memory never holds it in ``dtype``, so a large model's
        random base costs only its packed bytes. The numbers are drawn on ``device`` (``generator``'s, when given)
        and the packed tensors come to the host."""
        if len(shape) not in (2, 3):
            raise ValueError(f"FrozenWeight.random: expected a 2-D shape [out, in] or a 3-D one, got {tuple(shape)}")
        f = get_format(fmt, transposed)
        if generator is not None:
            device = generator.device
        packed = f.random(packing_shape(f, shape), dtype, std, generator, device=device)
        return cls({k: v.cpu() for k, v in packed.items()}, f, shape, dtype)

    def dequantize(self, device: Optional[Any] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The plain weight (its logical shape) in ``dtype`` (default: the logical one) on ``device`` (default
        cpu); the packed tensors are copied there first, so the unpacking runs on that device."""
        packed = self.packed if device is None else {k: v.to(device) for k, v in self.packed.items()}
        return self.format.dequantize(packed, self.shape, dtype or self.dtype)

    def dequantize_into(self, packed: Packed, out: torch.Tensor) -> torch.Tensor:
        """Unpack ``packed`` (these tensors, already on ``out``'s device) into ``out`` (a graph slot of the logical
        shape)."""
        return self.format.dequantize(packed, self.shape, out.dtype, out=out)

    def host_nbytes(self) -> int:
        """Bytes the packed host tensors hold."""
        return host_nbytes(self)

    def device_parts(self) -> Optional[Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]]:
        """The tensors this weight's device copy holds when its format keeps them packed there
        (``Format.keeps_packed``): each packed tensor's (name, shape, dtype), by name, which is what a graph slot
        allocates for it; None when the device copy is the dequantized weight of the logical shape and dtype."""
        if not self.format.keeps_packed:
            return None
        return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(self.packed.items()))

    def device_nbytes(self) -> int:
        """Bytes this weight's device copy holds: its packed bytes when its format keeps them packed there, else
        the logical size (the weight dequantized)."""
        return self.host_nbytes() if self.format.keeps_packed else self.numel() * self.element_size()

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
        isinstance(src, FrozenWeight)
        and src.format.name == dst.format.name
        and getattr(src.format, "transposed", None) == getattr(dst.format, "transposed", None)
        and src.packed.keys() == dst.packed.keys()
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


#: Parameters of an experts module (transformers' experts interface) that are expert weights [experts, ., .].
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj")


def expert_layout(mod: nn.Module, attr: str) -> Optional[bool]:
    """Whether ``mod.attr`` is stored transposed ([experts, in, out], GPT-OSS) if it is a 3-D expert weight of an
    experts module (transformers' experts interface sets ``is_transposed`` on it); None if it is no expert weight."""
    transposed = getattr(mod, "is_transposed", None)
    if attr not in EXPERT_WEIGHTS or not isinstance(transposed, bool):
        return None
    p = mod._parameters.get(attr)
    return transposed if p is not None and p.dim() == 3 else None


def _frozen_expert_weights(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, bool]]:
    for name, mod in module.named_modules():
        for attr in EXPERT_WEIGHTS:
            transposed = expert_layout(mod, attr)
            if transposed is not None and not mod._parameters[attr].requires_grad:
                yield name, mod, attr, transposed


def default_targets(module: nn.Module, base_format: str) -> Tuple[str, ...]:
    """What ``base_format`` packs by default: ``("linear",)``, the frozen ``nn.Linear`` weights; for ``mxfp4`` on a
    model with frozen expert weights ``("experts",)``, as GPT-OSS ships (experts in MXFP4; attention, router,
    embeddings and head in the model dtype)."""
    if base_format == "mxfp4" and next(_frozen_expert_weights(module), None) is not None:
        return ("experts",)
    return ("linear",)


def quantize_frozen(
    module: nn.Module,
    base_format: str,
    skip: Sequence[str] = ("lm_head",),
    targets: Optional[Sequence[str]] = None,
) -> int:
    """Replace, in place, each frozen (``requires_grad`` False) weight of ``targets`` in ``module`` by a FrozenWeight
    in ``base_format``; returns the host bytes saved. ``targets`` (default ``default_targets``): ``"linear"``, the
    2-D weight of each ``nn.Linear`` (PEFT's ``base_layer`` included); ``"experts"``, the 3-D expert weights of
    each experts module (``EXPERT_WEIGHTS``; their biases and the router stay). Embeddings, norms, trainable
    weights and modules named in ``skip`` keep their tensors; a weight shared by several modules is packed once.
    ``bf16`` changes nothing."""
    check_base_format(base_format)
    if base_format == "bf16":
        return 0
    targets = tuple(default_targets(module, base_format) if targets is None else targets)
    unknown = [t for t in targets if t not in ("linear", "experts")]
    if unknown:
        raise ValueError(f"quantize_frozen: targets={unknown[0]!r}: expected 'linear' or 'experts'")
    slots = []
    if "linear" in targets:
        for name, mod in module.named_modules():
            w = mod._parameters.get("weight") if isinstance(mod, nn.Linear) else None
            if w is not None and not w.requires_grad and w.dim() == 2 and not _skipped(name, skip):
                slots.append((name, mod, "weight", False))
    if "experts" in targets:
        slots += [s for s in _frozen_expert_weights(module) if not _skipped(s[0], skip)]
    done: Dict[int, nn.Parameter] = {}
    saved = 0
    for name, mod, attr, transposed in slots:
        w = mod._parameters[attr]
        if isinstance(w.data, FrozenWeight):
            continue
        if w.device.type == "meta":
            raise ValueError(f"quantize_frozen: {name}.{attr} is on the meta device; load its values first")
        if id(w) not in done:
            with torch.no_grad():
                fw = FrozenWeight.quantize(w.detach(), base_format, transposed=transposed)
                done[id(w)] = nn.Parameter(fw, requires_grad=False)
            saved += w.numel() * w.element_size() - host_nbytes(done[id(w)])
        mod._parameters[attr] = done[id(w)]
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


def adopt_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> FrozenWeight:
    """A GPT-OSS checkpoint's expert weight as it ships, without re-quantizing: ``blocks`` uint8 [experts, out,
    in / 32, 16] and ``scales`` uint8 [experts, out, in / 32] (its ``*_blocks`` / ``*_scales``) as a FrozenWeight of
    the parameter's logical shape [experts, in, out] and ``dtype``, which dequantizes to transformers'
    ``convert_moe_packed_tensors(blocks, scales)``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"adopt_mxfp4: expected uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"adopt_mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are no MXFP4 expert weight "
            "(blocks [experts, out, in / 32, 16], scales [experts, out, in / 32])"
        )
    experts, rows, groups, _ = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    packed = {
        "blocks": blocks.detach().cpu().contiguous(),
        "scales": scales.detach().cpu().contiguous(),
        "table": table,
    }
    return FrozenWeight(packed, MXFP4_TRANSPOSED, (experts, groups * 32, rows), dtype)


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
            f"base_format={base_format!r}: the model has no frozen nn.Linear or expert weight to store packed (only "
            "weights with requires_grad=False are packed: freeze the base, e.g. with a PEFT LoRA model), or pass "
            "base_format='bf16'"
        )
    return saved


def dequantize_transient_bytes(t: torch.Tensor) -> int:
    """Device bytes an upload of ``t`` holds besides its plain weight while it is unpacked: a FrozenWeight's
    packed bytes and, where its format unpacks in chunks (``Format.unpacks_in_chunks``), one chunk's
    intermediates (``codecs.DEQUANT_CHUNK`` elements: a float32 copy or an int32 index, and the values); 0 for a
    plain tensor, and for a FrozenWeight whose device copy keeps its packed tensors (``Format.keeps_packed``:
    never unpacked)."""
    if not isinstance(t, FrozenWeight) or t.format.keeps_packed:
        return 0
    chunk = min(t.numel(), codecs.DEQUANT_CHUNK) * (4 + t.element_size()) if t.format.unpacks_in_chunks else 0
    return t.host_nbytes() + chunk


def device_nbytes(t: torch.Tensor) -> int:
    """Bytes the device copy of parameter or buffer ``t`` holds once uploaded: ``FrozenWeight.device_nbytes`` (the
    logical size of a weight dequantized there, the packed bytes of one kept packed), the size of a plain tensor."""
    return t.device_nbytes() if isinstance(t, FrozenWeight) else t.numel() * t.element_size()


def module_device_bytes(module: nn.Module) -> int:
    """Bytes ``module``'s parameters and buffers take on a device while it runs: what each device copy holds
    (``device_nbytes``: a FrozenWeight dequantized there at its logical size, one computing from its packed
    bytes at those bytes) plus the largest unpacking transient (the transfer layer unpacks one weight at a time;
    a weight kept packed has none)."""
    seen: Dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[id(t)] = t
    held = sum(device_nbytes(t) for t in seen.values())
    return held + max((dequantize_transient_bytes(t) for t in seen.values()), default=0)
