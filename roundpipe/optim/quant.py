"""Compact number formats of the compact host Adam (``roundpipe.optim.compact``), in torch.

Everything here is the reference the C++ kernel (``csrc/compact_adam.cpp``) mirrors operation by
operation in float32 (no fused multiply-adds on either side), so the two agree to the last bit except
where a library ``sqrt`` or ``round`` differs:

* **Blockwise 8-bit moments** with square-root companding. A tensor is cut into blocks of
  ``block_size`` elements; each block keeps one fp32 scale. The first moment ``m`` is stored as signed
  int8 ``q = round(127 * sign(m) * sqrt(|m| / A))`` with ``A`` the block's absmax, decoded as
  ``m = q * |q| * (A / 127^2)``. The second moment is stored through ``r = sqrt(v)`` (the Adam
  denominator): unsigned ``q = round(255 * sqrt(r / R))`` with ``R`` the block's largest ``r``, decoded
  as ``r = q^2 * (R / 255^2)``, ``v = r^2``; a positive ``r`` never gets code 0 (it gets 1, an
  over-estimate), so a small denominator never collapses to ``eps``. Companding puts the codes densely
  near zero like the dynamic-tree map of bitsandbytes' 8-bit Adam, but costs a sqrt instead of a table
  search, so it vectorises. Error bounds per element (``s = sqrt(|x| / A)``): ``|m - m~| <= A / 254 *
  (2 s + 1 / 254)`` and ``|r - r~| <= R / 510 * (2 sqrt(r / R) + 1 / 510)`` (one code step in the
  companded domain), i.e. at most ``2 A / 254 + A / 254^2`` for the block's largest elements and about
  ``A / 254^2`` near zero.
* **bfloat16 rounding** of fp32 values: round to nearest even (as ``Tensor.to(torch.bfloat16)``) and
  stochastic rounding with a counter-based hash: the 16 low bits of the fp32 value plus 16 random bits,
  truncated, which rounds up with probability equal to the dropped fraction (unbiased). The random
  bits of element ``i`` of the optimizer's parameter number ``pid`` at Adam step ``step`` are
  ``mix32((i mod 2^32) xor base(seed, step, pid))``: a pure function, so a resumed run draws the same.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = [
    "M_LEVELS",
    "V_LEVELS",
    "dequantize_m",
    "dequantize_r",
    "mix32",
    "n_blocks",
    "quantize_m",
    "quantize_r",
    "rne_bf16",
    "sr_base",
    "sqrt32",
    "sr_bf16",
]

M_LEVELS = 127  # int8 codes of the first moment: -127..127
V_LEVELS = 255  # uint8 codes of sqrt(second moment): 0..255
_M_INV_SQ = torch.tensor(1.0 / (M_LEVELS * M_LEVELS), dtype=torch.float32)
_V_INV_SQ = torch.tensor(1.0 / (V_LEVELS * V_LEVELS), dtype=torch.float32)
_MASK32 = 0xFFFFFFFF


def n_blocks(numel: int, block_size: int) -> int:
    """Number of quantisation blocks (and scales) of a tensor of ``numel`` elements."""
    return (numel + block_size - 1) // block_size


def sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded fp32 square root (torch's vectorised float sqrt may be off by one ulp; the
    double sqrt rounded to float is exact, as the kernel's ``sqrtps``)."""
    return torch.sqrt(x.double()).float()


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """``x`` flattened, zero-padded to whole blocks, as a (blocks, block_size) fp32 view."""
    flat = x.reshape(-1)
    pad = n_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def _scale_inverse(absmax: Tensor) -> Tensor:
    """1 / absmax in fp32, 0 where the block is all zeros."""
    one = torch.ones((), dtype=torch.float32)
    return torch.where(absmax > 0, one / absmax, torch.zeros((), dtype=torch.float32))


def quantize_m(m: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """Signed companded int8 codes (flat, m's numel) and fp32 block absmaxes of an fp32 tensor."""
    numel = m.numel()
    b = _blocks(m.float(), block_size)
    absmax = b.abs().amax(dim=1) if b.numel() else b.new_zeros(b.shape[0])
    inv = _scale_inverse(absmax)
    s = sqrt32(b.abs() * inv[:, None]) * float(M_LEVELS)
    q = torch.round(s) * torch.sign(b)
    return q.to(torch.int8).reshape(-1)[:numel].clone(), absmax.contiguous()


def dequantize_m(codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """fp32 values (flat) of ``quantize_m`` codes."""
    numel = codes.numel()
    q = _blocks(codes.float(), block_size)
    d = absmax * _M_INV_SQ
    return ((q * q.abs()) * d[:, None]).reshape(-1)[:numel]


def quantize_r(r: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """Unsigned companded uint8 codes (flat) and fp32 block maxima of ``r = sqrt(v) >= 0``."""
    numel = r.numel()
    b = _blocks(r.float(), block_size)
    rmax = b.amax(dim=1) if b.numel() else b.new_zeros(b.shape[0])
    inv = _scale_inverse(rmax)
    q = torch.round(sqrt32(b * inv[:, None]) * float(V_LEVELS))
    q = torch.where((q == 0) & (b > 0), torch.ones((), dtype=torch.float32), q)
    return q.to(torch.uint8).reshape(-1)[:numel].clone(), rmax.contiguous()


def dequantize_r(codes: Tensor, rmax: Tensor, block_size: int) -> Tensor:
    """fp32 ``r = sqrt(v)`` values (flat) of ``quantize_r`` codes."""
    numel = codes.numel()
    q = _blocks(codes.float(), block_size)
    d = rmax * _V_INV_SQ
    return ((q * q) * d[:, None]).reshape(-1)[:numel]


def rne_bf16(x: Tensor) -> Tensor:
    """fp32 -> bfloat16, round to nearest even (NaN stays NaN)."""
    return x.to(torch.bfloat16)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 ``x`` in [0, 2^32): the 16-bit halves of ``c`` keep it below 2^63."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply finaliser) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """``mix32`` of one Python int."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def sr_base(seed: int, step: int, pid: int) -> int:
    """The per-(seed, step, parameter) key of the stochastic-rounding stream (a 32-bit int)."""
    h = _mix32_int(pid + 0x9E3779B9)
    h = _mix32_int(h ^ (step & _MASK32))
    return _mix32_int(h ^ (seed & _MASK32) ^ _mix32_int(seed >> 32))


def sr_bf16(x: Tensor, base: int) -> Tensor:
    """fp32 -> bfloat16 with stochastic rounding: element ``i`` (flat index) uses ``mix32(i ^ base)``."""
    flat = x.reshape(-1).float()
    idx = torch.arange(flat.numel(), dtype=torch.int64) & _MASK32
    rnd = mix32(idx ^ base) & 0xFFFF
    bits = flat.view(torch.int32).to(torch.int64) & _MASK32
    top = ((bits + rnd) >> 16) & 0xFFFF
    top = torch.where(top >= 0x8000, top - 0x10000, top)
    out = top.to(torch.int16).view(torch.bfloat16)
    # NaN keeps a NaN payload above (the carry cannot reach the sign); keep the rounding of torch for it.
    out = torch.where(torch.isnan(flat), flat.to(torch.bfloat16), out)
    return out.view(x.shape)
