"""The frozen-weight formats: how each packs a 2-D weight into host tensors and unpacks it on a device.

A format is a small object with four operations on a dict of packed tensors ("packed"): ``quantize`` a
plain weight, ``random`` (packed built directly, never the full-precision weight: a 70B random base
fits its packed size; drawn on a given device, since a GPU draws in seconds what one host thread draws in
minutes), ``dequantize`` (plain torch ops, no host synchronisation and no data-dependent shapes, so it
runs inside a captured CUDA graph or on a parameter upload stream) and ``nbytes``. The per-output-channel
formats (fp8 e4m3, int8) keep one fp32 scale per row; NF4 (QLoRA's) lives in ``nf4.py``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

Packed = Dict[str, torch.Tensor]


class Format:
    """One frozen-weight format; subclasses implement the packing. ``name`` is the ``base_format`` string."""

    name = ""
    #: Whether a layer's device copy of a weight in this format holds its packed tensors as uploaded (its
    #: ``device_weight`` wraps them, for GEMMs that read the packed bytes) instead of the dequantized weight.
    keeps_packed = False
    #: Whether unpacking holds one chunk's intermediates (``DEQUANT_CHUNK`` elements: a float32 copy or an int32
    #: index, and the values) besides the packed bytes and the plain weight; a format unpacking in place does not.
    unpacks_in_chunks = True

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [out, in]
        raise NotImplementedError

    def random(
        self,
        shape: Tuple[int, int],
        dtype: torch.dtype,
        std: float,
        generator: Optional[torch.Generator],
        device: Any = "cpu",
    ) -> Packed:
        raise NotImplementedError

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def device_weight(self, packed: Packed, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """What a layer's device copy holds for a weight uploaded as ``packed`` (on that device): the plain
        weight, dequantized; a format whose GEMMs read the packed bytes (``keeps_packed``) returns a tensor
        holding those very tensors (a graph slot's, when the job is graphed)."""
        return self.dequantize(packed, shape, dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantize multiplies in: fp32, or fp64 for a float64 logical weight (exact tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Elements a dequantize unpacks at a time: its transients (a float32 copy of the chunk, an index) stay a
#: few hundred MiB for the largest weights instead of several bytes per parameter of the whole weight.
DEQUANT_CHUNK = 1 << 24


def dequant_target(out: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``out`` (a graph slot's storage) or a new tensor of ``shape`` / ``dtype`` on ``device``."""
    return out if out is not None else torch.empty(tuple(shape), dtype=dtype, device=device)


# Rows of random weights generated at a time (random() never holds more of the full-precision weight).
_RANDOM_CHUNK_ELEMENTS = 1 << 24


class ChannelFormat(Format):
    """Symmetric per-output-channel quantization: ``w[r] ~= data[r] * scale[r]``, ``scale = amax(|w[r]|) / qmax``.

    Packed: ``data`` [out, in] of ``storage_dtype``, ``scale`` [out] fp32. A zero row keeps scale 1. Unpacked in
    place, in two passes over the plain weight (the codes cast into it, then scaled in float32).
    """

    storage_dtype = torch.int8
    qmax = 127.0
    unpacks_in_chunks = False

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:  # scaled: [rows, in], within [-qmax, qmax]
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [out, in]
        if w.dim() != 2:
            raise ValueError(f"{self.name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
        cdt = _compute_dtype(w.dtype)
        wc = w.detach().to(cdt)
        amax = wc.abs().amax(dim=1)
        # A tensor divisor, not a Python scalar: a CUDA kernel turns division by a scalar into a multiply by its
        # reciprocal, which rounds differently, and a weight packed on a GPU must give the host's bytes.
        scale = torch.where(amax > 0, amax / torch.full_like(amax, self.qmax), torch.ones_like(amax)).to(torch.float32)
        data = self._encode(wc / scale.to(cdt)[:, None])
        return {"data": data.contiguous(), "scale": scale.contiguous()}

    def random(
        self,
        shape: Tuple[int, int],
        dtype: torch.dtype,
        std: float,
        generator: Optional[torch.Generator],
        device: Any = "cpu",
    ) -> Packed:
        rows, cols = shape
        data = torch.empty(shape, dtype=self.storage_dtype, device=device)
        scale = torch.empty(rows, dtype=torch.float32, device=device)
        step = max(1, _RANDOM_CHUNK_ELEMENTS // max(1, cols))
        for a in range(0, rows, step):  # per-row scales: quantizing rows in chunks is exact
            chunk = (
                torch.randn((min(step, rows - a), cols), generator=generator, dtype=torch.float32, device=device) * std
            )
            part = self.quantize(chunk)
            data[a : a + step], scale[a : a + step] = part["data"], part["scale"]
        return {"data": data, "scale": scale}

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        data, scale = packed["data"], packed["scale"]
        target = dequant_target(out, shape, dtype, data.device)
        rows_view = target.view(data.shape)  # a 3-D weight (experts) is packed as its rows flattened
        # The codes (int8, e4m3) are exact in every float dtype a weight takes; the in-place multiply computes in
        # float32 (float64 for a float64 weight) and rounds once, as ``(data.float() * scale).to(dtype)`` does,
        # moving 7 bytes a parameter (bf16) instead of the 19 of that expression's temporaries.
        rows_view.copy_(data)
        rows_view.mul_(scale[:, None])
        return target


class Int8Format(ChannelFormat):
    """int8, symmetric per output channel, round to nearest (``amax / 127``)."""

    name = "int8"

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp_(-127, 127).to(torch.int8)


class Fp8Format(ChannelFormat):
    """fp8 e4m3 (``torch.float8_e4m3fn``), per-output-channel fp32 scale ``amax / 448`` (e4m3's largest)."""

    name = "fp8"
    storage_dtype = torch.float8_e4m3fn
    qmax = 448.0

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def ceil_to(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)
