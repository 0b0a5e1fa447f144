"""MXFP4 as the OCP Microscaling spec (v1.0) defines it and GPT-OSS ships its expert weights: FP4 E2M1 elements in
blocks of 32 along the reduction dimension, each block sharing one E8M0 scale (a power of two, ``2 ** (code - 127)``).

Packed like the GPT-OSS checkpoint's ``*_blocks`` / ``*_scales`` tensors, so a shipped checkpoint's bytes are
adopted as they are (``adopt_mxfp4``): a weight of ``rows`` outputs by ``cols`` inputs is ``blocks`` uint8
[..., rows, cols / 32, 16] (two elements a byte, the first in the low nibble) and ``scales`` uint8
[..., rows, cols / 32]: 4.25 bits per value. A transposed weight (``[..., in, out]``, GPT-OSS's
``gate_up_proj`` / ``down_proj`` parameters) is stored as its transpose, as in the checkpoint; ``dequantize``
writes it back in the logical layout, equal to transformers' ``convert_moe_packed_tensors``.

Quantization (a plain weight into MXFP4): the scale rule is the spec's, ``floor(log2(amax)) - 2`` (2: E2M1's
largest exponent) clamped to E8M0's range, a block of zeros scale code 0; each element divided by the scale is
rounded to the nearest E2M1 value, ties to the even code, and saturated at +-6 (the spec's floor rule puts a block's
largest value in [4, 8), so values above 6 saturate). Reduction dimensions not a multiple of 32 are zero-padded.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from roundpipe.host.formats import codecs
from roundpipe.host.formats.codecs import Format, Packed, ceil_to, dequant_target

BLOCK = 32  # elements per shared scale
E2M1_EMAX = 2  # exponent of E2M1's largest value, 6 = 1.5 * 2 ** 2
SCALE_BIAS = 127  # E8M0: value 2 ** (code - 127); code 255 is NaN

#: The 16 E2M1 values by code (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa): transformers' FP4_VALUES.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_QUANT_CHUNK = 1 << 22  # values quantized at a time


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The E2M1 codes (uint8, 0..15) of ``scaled`` (any shape, already divided by the block scale): round to the
    nearest magnitude, ties to the even code, saturated at 6; the sign in bit 3 (-0 keeps it). Each binade is a
    ``torch.round`` (half to even) at its step: 0.5 below 2 (codes 0 to 4), 1 in [2, 4) (codes 4 to 6), 2 from 4
    (codes 6, 7); the even integer of a tie is the even code."""
    a = scaled.abs().clamp_(max=6.0)
    above2, above4 = (a >= 2).to(a.dtype), (a >= 4).to(a.dtype)
    per_step = 2.0 / ((1 + above2) * (1 + above4))  # 2, 1 or 1/2: exact
    code = (a * per_step).round_().add_(above2 * 2).add_(above4 * 2)  # masks, not torch.where: twice as fast
    return code.to(torch.uint8) | torch.signbit(scaled).to(torch.uint8) << 3


def scale_codes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) of blocks with largest magnitude ``amax`` (any shape): ``floor(log2(amax)) - 2 + 127``
    clamped to [0, 254]; zero blocks get code 0."""
    _, exponent = torch.frexp(amax)  # amax = m * 2 ** exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    code = (exponent.to(torch.int32) - 1 - E2M1_EMAX + SCALE_BIAS).clamp_(0, 254)
    return torch.where(amax > 0, code, torch.zeros_like(code)).to(torch.uint8)


def scale_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** (codes - 127)`` in ``dtype`` (float32 or float64), built from the float32 bit pattern with plain integer
    ops (exact, capturable): code c in [1, 254] is the float32 with exponent field c, code 0 the subnormal 2 ** -127,
    code 255 infinity (NaN in E8M0: its blocks dequantize to inf or NaN)."""
    bits = codes.to(torch.int32) << 23
    bits = torch.where(codes == 0, torch.full_like(bits, 1 << 22), bits)
    return bits.view(torch.float32).to(dtype)


class Mxfp4Format(Format):
    """Packed: ``blocks`` uint8 [*lead, rows, cols / 32, 16] and ``scales`` uint8 [*lead, rows, cols / 32] (see the
    module docstring); ``table`` [16] float32, the E2M1 values by code, uploaded with the rest so an unpacking
    copies nothing from Python. ``transposed``: the logical weight is [*lead, in, out]
    and stored as its transpose (GPT-OSS's experts); otherwise [*lead, out, in]."""

    name = "mxfp4"

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed

    def __repr__(self) -> str:
        return f"Mxfp4Format(transposed={self.transposed})"

    def matrix_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
        """The stored layout [*lead, rows (outputs), cols (inputs)] of a logical ``shape``."""
        shape = tuple(int(s) for s in shape)
        if len(shape) < 2:
            raise ValueError(f"mxfp4: expected a weight of 2 or more dimensions, got shape {shape}")
        return shape[:-2] + (shape[-1], shape[-2]) if self.transposed else shape

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [*lead, out, in], or [*lead, in, out] when transposed
        m = w.detach().transpose(-1, -2) if self.transposed else w.detach()
        cdt = codecs._compute_dtype(m.dtype)
        *lead, rows, cols = m.shape
        groups = ceil_to(cols, BLOCK) // BLOCK
        flat = m.reshape(-1, cols)
        blocks = torch.empty((flat.shape[0], groups, BLOCK // 2), dtype=torch.uint8, device=m.device)
        scales = torch.empty((flat.shape[0], groups), dtype=torch.uint8, device=m.device)
        step = max(1, _QUANT_CHUNK // max(1, groups * BLOCK))
        with torch.no_grad():
            for a in range(0, flat.shape[0], step):
                chunk = flat[a : a + step].to(cdt)
                if cols % BLOCK:
                    chunk = torch.nn.functional.pad(chunk, (0, groups * BLOCK - cols))
                chunk = chunk.reshape(chunk.shape[0], groups, BLOCK)
                code = scale_codes(chunk.abs().amax(dim=-1))
                # a division by a power of two: exact, on a GPU as on the host
                q = e2m1_codes(chunk / scale_values(code, cdt)[..., None])
                blocks[a : a + step] = q[..., 0::2] | q[..., 1::2] << 4
                scales[a : a + step] = code
        return {
            "blocks": blocks.view(*lead, rows, groups, BLOCK // 2),
            "scales": scales.view(*lead, rows, groups),
            "table": torch.tensor(E2M1_VALUES, dtype=torch.float32, device=m.device),
        }

    def random(
        self,
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        std: float,
        generator: Optional[torch.Generator],
        device: Any = "cpu",
    ) -> Packed:
        """N(0, std) drawn a chunk of rows at a time and quantized (per-block scales: chunks of rows pack exactly as
        the whole would), so no more than a chunk is ever held in full precision."""
        m = self.matrix_shape(shape)
        *lead, rows, cols = m
        groups = ceil_to(cols, BLOCK) // BLOCK
        n_rows = int(torch.Size(lead).numel()) * rows
        blocks = torch.empty((n_rows, groups, BLOCK // 2), dtype=torch.uint8, device=device)
        scales = torch.empty((n_rows, groups), dtype=torch.uint8, device=device)
        plain = Mxfp4Format()
        step = max(1, codecs._RANDOM_CHUNK_ELEMENTS // max(1, cols))
        for a in range(0, n_rows, step):
            n = min(step, n_rows - a)
            chunk = torch.randn((n, cols), generator=generator, dtype=torch.float32, device=device) * std
            part = plain.quantize(chunk)
            blocks[a : a + n], scales[a : a + n] = part["blocks"], part["scales"]
        return {
            "blocks": blocks.view(*lead, rows, groups, BLOCK // 2),
            "scales": scales.view(*lead, rows, groups),
            "table": torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device),
        }

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        blocks, scales, table = packed["blocks"], packed["scales"], packed["table"]
        target = dequant_target(out, shape, dtype, blocks.device)
        cdt = codecs._compute_dtype(target.dtype)
        *_, rows, groups, half = blocks.shape
        cols = self.matrix_shape(shape)[-1]
        pairs = byte_pairs(table.to(cdt))  # [256, 2]
        flat_blocks = blocks.reshape(-1, rows, groups * half)  # [matrices, rows, cols / 2]
        flat_scales = scales.reshape(-1, rows, groups)
        # the target as [matrices, rows, cols] in the stored layout (a transposed view for a transposed weight)
        view = target.view(-1, *target.shape[-2:])
        if self.transposed:
            view = view.transpose(-1, -2)
        matrices = flat_blocks.shape[0]
        step = max(1, codecs.DEQUANT_CHUNK // max(1, groups * BLOCK))  # rows a chunk unpacks
        per = max(1, step // rows)  # whole matrices a chunk unpacks (several small experts at once: fewer kernels)
        step = rows if per > 1 else step
        for e in range(0, matrices, per):  # fixed loops: no data-dependent shapes, capturable
            for a in range(0, rows, step):
                index = flat_blocks[e : e + per, a : a + step].to(torch.int32).flatten()
                values = pairs.index_select(0, index).view(-1, groups, BLOCK)  # [chunk rows, groups, 32]
                values.mul_(scale_values(flat_scales[e : e + per, a : a + step], cdt).view(-1, groups, 1))
                n = min(per, matrices - e)
                view[e : e + per, a : a + step].copy_(values.view(n, -1, groups * BLOCK)[..., :cols])
        return target


def byte_pairs(table: torch.Tensor) -> torch.Tensor:  # table: [16]
    """[256, 2]: the values of byte b's low nibble, then its high nibble (both elements a byte holds, in order)."""
    return torch.stack([table[None, :].expand(16, 16), table[:, None].expand(16, 16)], dim=-1).reshape(256, 2)


def packed_nbytes(rows: int, cols: int, matrices: int = 1) -> int:
    """Host bytes of ``matrices`` MXFP4 weights of ``rows`` outputs by ``cols`` inputs: 17 bytes per block of 32
    (16 of elements, 1 of scale), and the 16 table values."""
    return matrices * rows * (ceil_to(cols, BLOCK) // BLOCK) * (BLOCK // 2 + 1) + 16 * 4


MXFP4 = Mxfp4Format()
MXFP4_TRANSPOSED = Mxfp4Format(transposed=True)
