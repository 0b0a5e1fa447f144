"""NF4 as QLoRA defines it: 4-bit codes of the normal-float table in blocks of 64, the blocks' absmax
scales double-quantized (int8 per block of 256 scales, one factor per such block, minus their mean).

The codes and scales are torchao's (``to_nf4(w, 64, 256)``; ``nearest_codes`` looks a 16-bit value's code up in a
table of all 65,536, ten times faster than torchao on a bf16 weight, and picks a wider value's from two candidate
levels instead of sixteen), and ``dequantize`` reproduces torchao's
``NF4Tensor.get_original_weight`` bit for bit with plain torch ops that a CUDA graph can capture: one 256-entry
table lookup per packed byte (both nibbles at once, two bytes of index per weight instead of the sixteen of two
``long`` lookups) and one multiply by the block scales. Weights whose element count is not a multiple of 64 are
zero-padded to one; scales not a multiple of 256 are padded after the mean is taken, so they quantize as torchao
would the unpadded ones. torchao itself is not imported (the tests compare against it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence, Tuple

import torch

from roundpipe.host.formats import codecs
from roundpipe.host.formats.codecs import Format, Packed, ceil_to, dequant_target

BLOCK = 64  # weights per absmax scale
SCALER_BLOCK = 256  # scales per double-quantization factor


def nf4_table(dtype: torch.dtype) -> torch.Tensor:
    """The 16 NF4 levels (torchao's and QLoRA's table) in ``dtype``: [16]."""
    levels = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0]
    levels += [0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]
    return torch.tensor(levels, dtype=dtype)


def nearest_codes(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The NF4 codes of ``scaled`` (values in [-1, 1], flattened, even length), two a byte, high nibble first:
    the level nearest each value as torchao's ``quantize_tensor_nearest`` picks it (distances rounded to the
    values' dtype, the lower level on a tie), from two candidates instead of all sixteen: the exactly nearest
    level (``bucketize`` on the exact midpoints) and its neighbour across the nearer midpoint. Rounding keeps
    the order of distances, so only that neighbour can tie with it (or, rounded, come out nearer)."""
    if scaled.dtype in (torch.bfloat16, torch.float16):  # every 16-bit value's code, looked up
        lut = _codes_of_every_16bit_value(scaled.dtype).to(scaled.device)
        out = torch.empty(scaled.numel() // 2, dtype=torch.uint8, device=scaled.device)
        for a in range(0, scaled.numel(), _QUANT_CHUNK):
            bits = scaled[a : a + _QUANT_CHUNK].view(torch.int16).to(torch.int32) & 0xFFFF
            code = lut.index_select(0, bits)
            out[a // 2 : (a + _QUANT_CHUNK) // 2] = code[::2] << 4 | code[1::2]
        return out
    # Midpoints exact: float64 holds those of float32 levels (one more bit).
    exact = torch.float64
    mids = (table[1:].to(exact) + table[:-1].to(exact)) / 2  # [15]
    out = torch.empty(scaled.numel() // 2, dtype=torch.uint8, device=scaled.device)
    step = _QUANT_CHUNK
    for a in range(0, scaled.numel(), step):
        v = scaled[a : a + step]
        near = torch.bucketize(v.to(exact), mids)  # v in (mids[near - 1], mids[near]]: level ``near`` is nearest
        level = table[near]
        other = torch.where(v > level, near + 1, near - 1).clamp_(0, 15)
        d_near, d_other = (v - level).abs(), (v - table[other]).abs()
        # torchao's pick: the smaller rounded distance, the lower level on a tie
        take = (d_other < d_near) | ((d_other == d_near) & (other < near))
        code = torch.where(take, other, near).to(torch.uint8)
        out[a // 2 : (a + step) // 2] = code[::2] << 4 | code[1::2]
    return out


_QUANT_CHUNK = 1 << 22  # values quantized at a time (int64 and float64 intermediates of this many)


@functools.lru_cache(maxsize=None)
def _codes_of_every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    """The NF4 code of each of the 65,536 values of a 16-bit ``dtype`` (indexed by its bit pattern), [65536]
    uint8, by torchao's own rule (``quantize_tensor_nearest``'s ops: rounded distances, first minimum), computed
    once on the host: a bf16 weight's codes are then one lookup per value, whichever device packs it."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    codes = (values.unsqueeze(-1) - nf4_table(dtype)).abs().min(dim=-1).indices
    return codes.to(torch.uint8)


def _double_quantize(scalers: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's ``double_quantize_scalers`` on block absmaxes ``scalers`` [n_blocks]: int8 codes
    [n_blocks rounded up to 256], one factor per 256 [n_scaler_blocks], the mean []."""
    mean = scalers.mean()
    centred = scalers - mean
    pad = ceil_to(centred.numel(), SCALER_BLOCK) - centred.numel()
    if pad:
        centred = torch.cat([centred, centred.new_zeros(pad)])
    n = centred.numel() // SCALER_BLOCK
    blocks = centred.view(n, SCALER_BLOCK)
    absmax = blocks.abs().max(dim=1).values.unsqueeze(-1).expand(n, SCALER_BLOCK)
    factor = 256 / (2 * absmax)
    codes = (blocks * factor).round().clamp(-128, 127)
    return codes.flatten().to(torch.int8), factor[:, 0].contiguous(), mean


class Nf4Format(Format):
    """Packed: ``codes`` uint8 [ceil(numel / 64) * 32] (two 4-bit codes a byte, the first in the high
    nibble), ``scales`` int8 [n_blocks rounded up to 256], ``factors`` [n_blocks / 256] and ``mean`` []
    in the weight's dtype, ``table`` [16] the levels in that dtype (uploaded with the rest, so a
    dequantize on the device copies nothing from Python)."""

    name = "nf4"

    def quantize(self, w: torch.Tensor) -> Packed:  # w: [out, in] (any shape; flattened)
        flat = w.detach().contiguous().flatten()
        pad = ceil_to(flat.numel(), BLOCK) - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        n_blocks = flat.numel() // BLOCK
        table = nf4_table(flat.dtype)
        with torch.no_grad():
            absmax = flat.view(n_blocks, BLOCK).abs().max(dim=1).values
            codes = nearest_codes((flat.view(n_blocks, BLOCK) / absmax[:, None]).flatten(), table)
            scales, factors, mean = _double_quantize(absmax)
        return {"codes": codes, "scales": scales, "factors": factors, "mean": mean, "table": table}

    def random(
        self,
        shape: Tuple[int, int],
        dtype: torch.dtype,
        std: float,
        generator: Optional[torch.Generator],
        device: Any = "cpu",
    ) -> Packed:
        """Uniform codes (NF4's levels are normal quantiles, so a Gaussian weight's codes are near
        uniform) and block scales within 10% of the one that gives standard deviation ``std``."""
        numel = int(shape[0]) * int(shape[1])
        n_blocks = ceil_to(numel, BLOCK) // BLOCK
        table = nf4_table(dtype)
        scale = std / float(table.double().pow(2).mean().sqrt())
        codes = torch.randint(0, 256, (n_blocks * BLOCK // 2,), dtype=torch.uint8, generator=generator, device=device)
        scales = torch.randint(
            -128, 128, (ceil_to(n_blocks, SCALER_BLOCK),), dtype=torch.int8, generator=generator, device=device
        )
        n_factors = ceil_to(n_blocks, SCALER_BLOCK) // SCALER_BLOCK
        factors = torch.full((n_factors,), 128 / (0.1 * scale), dtype=dtype)
        return {
            "codes": codes,
            "scales": scales,
            "factors": factors,
            "mean": torch.tensor(scale, dtype=dtype),
            "table": table,
        }

    def dequantize(
        self, packed: Packed, shape: Sequence[int], dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        codes, table = packed["codes"], packed["table"]
        wdt = table.dtype  # the dtype torchao's get_original_weight computes in
        n_blocks = codes.numel() * 2 // BLOCK
        numel = math.prod(int(s) for s in shape)
        # pairs[b] = (table[b >> 4], table[b & 15]): both nibbles of byte b, in order   [256, 2]
        pairs = torch.stack([table[:, None].expand(16, 16), table[None, :].expand(16, 16)], dim=-1).reshape(256, 2)
        scales = packed["scales"].view(-1, SCALER_BLOCK) / packed["factors"].unsqueeze(-1)
        scales = (scales.flatten().to(wdt) + packed["mean"])[:n_blocks, None]  # [n_blocks, 1]
        target = dequant_target(out, shape, dtype, codes.device)
        direct = numel == n_blocks * BLOCK and target.dtype == wdt and target.is_contiguous()
        blocks = (
            target.view(n_blocks, BLOCK) if direct else torch.empty((n_blocks, BLOCK), dtype=wdt, device=codes.device)
        )
        step = max(1, codecs.DEQUANT_CHUNK // BLOCK)
        for a in range(0, n_blocks, step):  # a fixed loop: no data-dependent shapes, capturable
            index = codes[a * BLOCK // 2 : (a + step) * BLOCK // 2].to(torch.int32)
            values = pairs.index_select(0, index).view(-1, BLOCK)  # [blocks of the chunk, 64]
            torch.mul(values, scales[a : a + step], out=blocks[a : a + step])
        if not direct:
            target.copy_(blocks.view(-1)[:numel].view(target.shape))
        return target
