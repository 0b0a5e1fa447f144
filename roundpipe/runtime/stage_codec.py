"""Compact stage inputs: the backward stages' inputs kept from the forward to the backward in one byte a
value with a float32 scale per block (``RPP_STAGE_INPUTS=fp8`` or ``int8``, or
``RoundPipeRunConfig(stage_inputs=...)``).

Why: a training call keeps every backward stage's input (``tokens x hidden`` values per stage) until the
backward recomputes the stage from it; at 512K tokens qwen3-8b's take ~150 GiB in bf16. Compact, they
take 1 byte per value plus a float32 scale per block: 1.03 bytes (fp8, blocks of 128) or 1.125 (int8,
blocks of 32).

What is approximated: the forward runs on exact values; only the copy kept for the backward is rounded.
The backward recomputes each stage from the decoded input, so its activations and gradients are those
of a slightly perturbed input. Deterministic: the same input gives the same bytes and decoded values.

Formats (:class:`Packed`): the tensor viewed as ``rows x last`` (``last`` its last dimension, the hidden
size of a hidden state), split along ``last`` into blocks of :data:`BLOCKS` values (the last block of a
row may be shorter). A block holding a non-finite value decodes as NaN.

* ``fp8``: per block a power-of-two scale ``s = 2**ceil(log2(amax / 448))`` (448: the largest
  float8_e4m3fn) and the payload ``round_to_fp8(x / s)``. A power of two makes ``x / s`` exact, so the
  payload is fp8's own rounding of ``x`` and decoding ``payload * s`` is exact in any wider dtype:
  ``|x - decoded| <= max(2**-4 |x|, 2**-10 s)`` (half an ulp of a normal, resp. subnormal, fp8 value),
  2.7% RMS on Gaussian values. Its error is relative to each value: an outlier costs its block nothing.
* ``int8``: per block ``s = amax / 127`` and the payload ``round(x / s)``: ``|x - decoded| <= s / 2``
  (and float32's rounding), 0.6% RMS on Gaussian values, a fifth of fp8's. But a large value coarsens
  its block's others (an LLM's "massive activations", 1e3x the median: 13% RMS on the rest of the block
  against fp8's 2.7%), so a block whose largest value exceeds :data:`FP8_BLOCK_RATIO` times the RMS of
  its other values is kept in fp8 instead: it stores its (power-of-two) scale negated and its fp8 bytes in
  the int8 payload.
  Measured on a GPU (qwen3-8b LoRA at 32K, every layer's input rounded): docs/long-context.md,
  "Compact stage inputs".

Which leaves (:func:`hidden_leaves`): floating tensors of two or more dimensions that the job did not
receive unchanged (those pass through and keep their one host copy per call: rotary tables, position
ids, labels; ``jobs._download_reusing``); where a leaf sits in a dict (the Hugging Face presets' state),
only the one under ``hidden_states``. The model's own input (the first stage's), what the fused job hands
to the loss and stage inputs kept on the device (``RPP_DEBUG_DEVICE_SAVED_GB``: they cost no host memory) stay
exact.

Where: :func:`compact` encodes on the device's compute stream, after the compute that made the values and
before their download (``transfer.async_d2h`` downloads a :class:`Packed` on the download stream);
``transfer.async_h2d`` uploads one on the upload stream and :func:`decode` runs there, so the compute
stream gets the decoded tensor like any uploaded one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe.settings import STAGE_INPUT_MODES

#: The accepted ``stage_inputs`` values: as today (the dtype the layers produce, bf16 in a bf16 run), or a
#: compact format (one of :data:`BLOCKS`).
MODES = STAGE_INPUT_MODES
#: Values per float32 scale of each compact format, along the last dimension (docs/long-context.md,
#: "Compact stage inputs").
BLOCKS = {"fp8": 128, "int8": 32}
BLOCK = BLOCKS["fp8"]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
_PAYLOAD = {"fp8": FP8, "int8": torch.int8}
#: An int8 block whose largest value is over this many times the RMS of its other values is kept in fp8:
#: int8's step (``amax / 127``) then rounds those others by more than fp8 does (RMS ``amax / (127 sqrt(12))``
#: against fp8's 2.7% of each value; equal at about 12).
FP8_BLOCK_RATIO = 12.0
#: Rows encoded or decoded at once hold at most this many values: bounds the float32 transients on the
#: device (a 512K-token hidden state is 2G values; one whole-tensor fp32 copy would be 8 GiB).
CHUNK_VALUES = 1 << 24
_HIDDEN_KEY = "hidden_states"


def check_mode(value: Any, name: str = "stage_inputs") -> str:
    """``value`` if it is one of :data:`MODES`, else a ValueError naming ``name`` and the choices."""
    if value not in MODES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(repr(m) for m in MODES)}")
    return str(value)


def bytes_per_value(block: Optional[int] = None, fmt: str = "fp8") -> float:
    """Bytes one value takes in a compact format: the one-byte payload and its share of a float32 scale
    (``block``: values per scale; None: the format's)."""
    return 1.0 + 4.0 / (block or BLOCKS[fmt])


@dataclass
class Packed:
    """One tensor in the compact format (see the module docstring); on the device or on the host."""

    payload: torch.Tensor
    """float8_e4m3fn (fp8) or int8, ``rows x last``."""
    scales: torch.Tensor
    """float32, ``rows x ceil(last / block)``: a power of two per block (fp8); ``amax / 127`` (int8), or a
    power of two negated for a block of an int8 tensor kept in fp8."""
    dtype: torch.dtype
    """The original dtype, restored by :func:`decode`."""
    shape: torch.Size
    """The original shape."""
    block: int = BLOCK
    fmt: str = "fp8"
    """The format: 'fp8' or 'int8'."""

    def tensors(self) -> List[torch.Tensor]:
        return [self.payload, self.scales]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Packed":
        """The same tensor with ``fn`` applied to its payload and scales (a copy to another device)."""
        return Packed(fn(self.payload), fn(self.scales), self.dtype, self.shape, self.block, self.fmt)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _rows(shape: torch.Size) -> int:
    last = shape[-1] if len(shape) else 1
    return math.prod(shape) // last if last else 0


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a float32 tensor of ``like``'s shape and device, to divide by: CUDA turns a division by a
    Python number into a multiplication by its reciprocal (one ulp off the CPU's quotient), a division by a
    tensor it rounds as the CPU does, so both devices encode the same bytes."""
    return torch.full(like.shape, float(value), dtype=torch.float32, device=like.device)


def _pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(amax / 448))`` per block, float32, at least 2**-126 (all-zero blocks); NaN for a
    block with a non-finite value (it decodes as NaN). Built from the exponent bits: exact everywhere."""
    v = (amax.float() / _full(amax, FP8_MAX)).clamp_min(2.0**-126)
    mantissa, exponent = torch.frexp(v)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scales = ((exponent.clamp(-126, 127) + 127).to(torch.int32) << 23).view(torch.float32)
    return torch.where(torch.isfinite(amax), scales, torch.full_like(scales, float("nan")))


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """``rows x last`` as ``rows x blocks x block``, the last block zero-padded."""
    pad = -x.shape[-1] % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[0], -1, block)


def _int8_scales(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 127`` per block, float32; 1 for an all-zero block, NaN for one with a non-finite value."""
    s = amax.float() / _full(amax, INT8_MAX)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def _int8_or_fp8(xb: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scales and int8 payload of float32 blocks ``xb`` (``rows x blocks x block``): per block int8, or fp8
    (scale negated, bytes reinterpreted) where its largest value dwarfs the others (:data:`FP8_BLOCK_RATIO`).
    A NaN block's payload is zeros and its scale NaN, which decodes it as NaN."""
    amax = amax.float()
    n = xb.shape[-1]
    # The mean square of the values below the largest (summed without it: subtracting its square from the
    # block's sum would lose the others to float32's rounding).
    others_sq = xb.square().masked_fill_(xb.abs() == amax.unsqueeze(-1), 0.0).sum(-1) / _full(amax, max(1, n - 1))
    # False for NaN blocks (NaN compares false) and for blocks with one nonzero value (int8 keeps it exactly).
    # The devices may sum in another order: a block within float32 rounding of the ratio may choose differently.
    use_fp8 = (others_sq > 0) & (amax.square() > FP8_BLOCK_RATIO**2 * others_sq)
    s_int = _int8_scales(amax)
    q_int = (xb / s_int.unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0)
    s_fp8 = _pow2_scales(amax)
    q_fp8 = (xb * s_fp8.reciprocal().unsqueeze(-1)).to(FP8)
    scales = torch.where(use_fp8, -s_fp8, s_int)
    payload = torch.where(use_fp8.unsqueeze(-1), q_fp8.view(torch.int8), q_int.to(torch.int8))
    return scales, payload


@torch.no_grad()
def encode(t: torch.Tensor, block: Optional[int] = None, fmt: str = "fp8") -> Packed:
    """``t`` (floating) in the compact format ``fmt`` (blocks of ``block`` values; None: the format's), on
    ``t``'s device and current stream."""
    if not t.is_floating_point():
        raise TypeError(f"stage_codec.encode takes a floating tensor, not {t.dtype}")
    if fmt not in BLOCKS:
        raise ValueError(f"stage_codec.encode: fmt={fmt!r}, expected one of {', '.join(map(repr, BLOCKS))}")
    block = block or BLOCKS[fmt]
    last = t.shape[-1] if t.dim() else 1
    rows = _rows(t.shape)
    x = t.detach().reshape(rows, last)
    nb = -(-last // block)
    payload = torch.empty((rows, last), dtype=_PAYLOAD[fmt], device=t.device)
    scales = torch.empty((rows, nb), dtype=torch.float32, device=t.device)
    step = max(1, CHUNK_VALUES // max(1, last))
    for r in range(0, rows, step):
        xb = _blocked(x[r : r + step], block)
        amax = xb.abs().amax(dim=-1)
        if fmt == "fp8":
            s = _pow2_scales(amax)
            q = (xb.float() * s.reciprocal().unsqueeze(-1)).to(FP8)
        else:
            s, q = _int8_or_fp8(xb.float(), amax)
        scales[r : r + step] = s
        payload[r : r + step] = q.reshape(q.shape[0], -1)[:, :last]
    return Packed(payload, scales, t.dtype, t.shape, block, fmt)


@torch.no_grad()
def decode(p: Packed) -> torch.Tensor:
    """The tensor ``p`` holds, in its original dtype and shape, on ``p``'s device and current stream."""
    rows, last = p.payload.shape
    out = torch.empty((rows, last), dtype=p.dtype, device=p.payload.device)
    step = max(1, CHUNK_VALUES // max(1, last))
    for r in range(0, rows, step):
        s = p.scales[r : r + step].unsqueeze(-1)
        if p.fmt == "int8":  # blocks kept in fp8: a negative scale, fp8 bytes
            raw = _blocked(p.payload[r : r + step], p.block)
            q = torch.where(s < 0, raw.view(FP8).float() * -s, raw.float() * s)
        else:  # widened before padding: float8 tensors take few kernels
            q = _blocked(p.payload[r : r + step].float(), p.block) * s
        x = q.reshape(q.shape[0], -1)[:, :last]
        out[r : r + step] = x.to(p.dtype)
    return out.reshape(p.shape)


def roundtrip(t: torch.Tensor, block: Optional[int] = None, fmt: str = "fp8") -> torch.Tensor:
    """``decode(encode(t))``: the values a backward recomputes from (tests and hand-made references)."""
    return decode(encode(t, block, fmt))


def _paths(spec: pytree.TreeSpec, n: int) -> List[Any]:
    """The key path of each of the ``n`` leaves of ``spec``."""
    tree = pytree.tree_unflatten(list(range(n)), spec)
    out: List[Any] = [()] * n
    for path, k in pytree.tree_flatten_with_path(tree)[0]:
        out[k] = path
    return out


def hidden_leaves(leaves: List[Any], spec: pytree.TreeSpec, passthrough: Iterable[Any] = ()) -> List[bool]:
    """Which of a stage input's ``leaves`` (flattened with ``spec``) the compact format takes: floating
    tensors of two or more dimensions that are not among ``passthrough`` (the job's inputs, by identity)
    and, inside a dict, sit under the key ``hidden_states``."""
    seen: Set[int] = {id(t) for t in passthrough if isinstance(t, torch.Tensor)}
    want = [
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != FP8 and t.dim() >= 2 and id(t) not in seen
        for t in leaves
    ]
    if not any(want):
        return want
    for k, path in enumerate(_paths(spec, len(leaves))):
        keys = [e.key for e in path if isinstance(e, pytree.MappingKey)]
        if want[k] and keys and _HIDDEN_KEY not in keys:
            want[k] = False
    return want


def compact(device: Any, mode: str, leaves: List[Any], spec: pytree.TreeSpec, passthrough: Iterable[Any]) -> List[Any]:
    """A stage input's ``leaves`` as they are kept for the backward: with a compact ``mode`` ('fp8', 'int8')
    its hidden leaves (:func:`hidden_leaves`) become :class:`Packed`, encoded on ``device``'s compute
    stream; the rest, and everything with 'bf16', unchanged."""
    if mode == "bf16":
        return leaves
    from roundpipe.devices import backend

    want = hidden_leaves(leaves, spec, passthrough)
    if not any(want):
        return leaves
    with backend.use_stream(device.compute_stream):
        return [encode(t, fmt=mode) if w else t for t, w in zip(leaves, want)]


def host_copies(forward: List[Any], kept: List[Any]) -> List[Any]:
    """The host leaves a forward job hands to the next one (``batch.flatten_states``) when only the compact
    stage input was downloaded: its other leaves' host copies (position ids, rotary tables), so that the
    next jobs reuse them instead of downloading their own; a leaf ``forward`` has keeps it."""
    return [k if f is None and not isinstance(k, Packed) else f for f, k in zip(forward, kept)]


__all__ = [
    "BLOCK",
    "BLOCKS",
    "FP8_BLOCK_RATIO",
    "MODES",
    "Packed",
    "bytes_per_value",
    "check_mode",
    "compact",
    "decode",
    "encode",
    "hidden_leaves",
    "host_copies",
    "roundtrip",
]
