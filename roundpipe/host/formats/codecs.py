"""The frozen-weight formats: how each packs a 2-D weight into host tensors and unpacks it on a device.

A format is a small object with four operations on a dict of packed tensors ("packed"): ``quantize`` a
plain weight, ``random`` (packed built directly, never the full-precision weight: a 70B random base
fits its packed size), ``dequantize`` (plain torch ops, no host synchronisation and no data-dependent
shapes, so it runs inside a captured CUDA graph or on a parameter upload stream) and ``nbytes``. The
per-output-channel formats (fp8 e4m3, int8) keep one fp32 scale per row; NF4 (QLoRA's) lives in
``nf4.py``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

Packed = Dict[str, torch.Tensor]


class Format:
    """One frozen-weight format; subclasses implement the packing. ``name`` is the ``base_format`` string."""

    name = ""

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [out, in]
        raise NotImplementedError

    def random(
        self, shape: Tuple[int, int], dtype: torch.dtype, std: float, generator: Optional[torch.Generator]
    ) -> Packed:
        raise NotImplementedError

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantize multiplies in: fp32, or fp64 for a float64 logical weight (exact tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finish(w: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``w`` cast to ``dtype``, written into ``out`` when given (a graph slot's storage)."""
    if out is None:
        return w.to(dtype)
    out.copy_(w)
    return out


# Rows of random weights generated at a time (random() never holds more of the full-precision weight).
_RANDOM_CHUNK_ELEMENTS = 1 << 24


class ChannelFormat(Format):
    """Symmetric per-output-channel quantization: ``w[r] ~= data[r] * scale[r]``, ``scale = amax(|w[r]|) / qmax``.

    Packed: ``data`` [out, in] of ``storage_dtype``, ``scale`` [out] fp32. A zero row keeps scale 1.
    """

    storage_dtype = torch.int8
    qmax = 127.0

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:  # scaled: [rows, in], within [-qmax, qmax]
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [out, in]
        if w.dim() != 2:
            raise ValueError(f"{self.name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
        cdt = _compute_dtype(w.dtype)
        wc = w.detach().to(cdt)
        amax = wc.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / self.qmax, torch.ones_like(amax)).to(torch.float32)
        data = self._encode(wc / scale.to(cdt)[:, None])
        return {"data": data.contiguous(), "scale": scale.contiguous()}

    def random(
        self, shape: Tuple[int, int], dtype: torch.dtype, std: float, generator: Optional[torch.Generator]
    ) -> Packed:
        rows, cols = shape
        data = torch.empty(shape, dtype=self.storage_dtype)
        scale = torch.empty(rows, dtype=torch.float32)
        step = max(1, _RANDOM_CHUNK_ELEMENTS // max(1, cols))
        for a in range(0, rows, step):  # per-row scales: quantizing rows in chunks is exact
            chunk = torch.randn((min(step, rows - a), cols), generator=generator, dtype=torch.float32) * std
            part = self.quantize(chunk)
            data[a : a + step], scale[a : a + step] = part["data"], part["scale"]
        return {"data": data, "scale": scale}

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        cdt = _compute_dtype(dtype)
        w = packed["data"].to(cdt) * packed["scale"].to(cdt)[:, None]
        return _finish(w.view(tuple(shape)), dtype, out)


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
