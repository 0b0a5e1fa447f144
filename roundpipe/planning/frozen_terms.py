"""What a frozen base in a packed host format (``roundpipe.host.formats``) changes in a LoRA step's memory and
time, from the shapes alone: the host bytes of the seven projections of each decoder layer, the bytes uploaded
per layer, the device transient of unpacking one weight, and the time to unpack a layer.

The byte counts repeat ``roundpipe.host.formats``' packings (so the estimate imports no torch; a test keeps
them equal to ``host_nbytes`` of real weights). The unpacking rates are measured on an H200 (2026-12-02, torch
2.11: the ops of ``roundpipe.host.formats`` on a 12288 x 4096 bf16 weight, mean of 50 after warm-up): nf4 0.36 ms
(torchao's ``get_original_weight``: 0.82 ms, measured 2026-12-01), int8 0.39 ms, fp8 0.41 ms; 120e9 to 140e9
parameters/s, memory bound (each moves ~10 to 19 bytes per parameter). int8 and fp8 were measured unpacking
through float32 temporaries (19 bytes a parameter); they now unpack in place (7), not yet timed, so the
planner keeps the measured, slower rates. Uploading that weight's NF4 codes (24 MiB, pinned) took 0.46 ms.

The unpacking runs on the parameter upload stream after the upload, so it delays compute only where uploads
already do (a qwen3-8b layer computes ~6 ms at 16K tokens against its ~1.4 ms of NF4 unpacking), but its
kernels take SMs and memory bandwidth from the compute stream's while they run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

from roundpipe.planning.memory_terms import ModelShape
from roundpipe.utils import BASE_FORMATS

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # ``roundpipe.host.formats.nf4``'s blocks
DEQUANT_CHUNK = 1 << 24  # ``roundpipe.host.formats.codecs.DEQUANT_CHUNK``
#: The formats that unpack in chunks (``Format.unpacks_in_chunks``); the per-channel ones (fp8, int8) unpack in place.
CHUNKED_FORMATS = frozenset({"nf4", "mxfp4"})
#: Unpacking rates measured on an H200, parameters per second (see the module docstring).
DEQUANTIZE_PARAMS_PER_S: Dict[str, float] = {
    "fp8": 12288 * 4096 / 0.41e-3,
    "int8": 12288 * 4096 / 0.39e-3,
    "nf4": 12288 * 4096 / 0.36e-3,
    # not measured: assumed nf4's (the same ops per byte: one table lookup of both elements, one multiply)
    "mxfp4": 12288 * 4096 / 0.36e-3,
}
MXFP4_BLOCK = 32  # ``roundpipe.host.formats.mxfp4``'s blocks


def check(base_format: str) -> str:
    if base_format not in BASE_FORMATS:
        raise ValueError(f"base_format={base_format!r}: expected one of {', '.join(BASE_FORMATS)}")
    return base_format


def packed_weight_bytes(rows: int, cols: int, base_format: str, e: int = 2) -> int:
    """Host bytes of a frozen ``rows`` x ``cols`` weight (``e`` bytes per element in the model dtype) stored in
    ``base_format``: fp8 / int8 a byte per element and a float32 scale per row; nf4 half a byte per element
    (blocks of 64), an int8 scale per block (padded to 256), a factor per 256 scales, the mean, the 16 levels;
    mxfp4 half a byte per element and a byte per 32 inputs, the 16 levels."""
    check(base_format)
    n = rows * cols
    if base_format == "bf16":
        return n * e
    if base_format in ("fp8", "int8"):
        return n + 4 * rows
    if base_format == "mxfp4":  # 16 bytes of elements and a 1-byte scale per 32 inputs, the 16 float32 levels
        return rows * math.ceil(cols / MXFP4_BLOCK) * (MXFP4_BLOCK // 2 + 1) + 16 * 4
    blocks = math.ceil(n / NF4_BLOCK)
    scales = math.ceil(blocks / NF4_SCALER_BLOCK) * NF4_SCALER_BLOCK
    return blocks * NF4_BLOCK // 2 + scales + (scales // NF4_SCALER_BLOCK) * e + e + 16 * e


@dataclass(frozen=True)
class FrozenBase:
    """A LoRA model's frozen projections in one format, per decoder layer (bytes and milliseconds)."""

    base_format: str
    layer_bf16_bytes: int
    """The seven projections in the model dtype."""
    layer_host_bytes: int
    """The same, as held on the host (and uploaded: the packed bytes go up as they are)."""
    gpu_transient_bytes: int
    """Device bytes of unpacking the largest projection beside its plain copy: its packed bytes and one chunk's
    intermediates (``roundpipe.host.formats.dequantize_transient_bytes``)."""
    dequantize_ms: float
    """Time to unpack one layer's projections at ``DEQUANTIZE_PARAMS_PER_S``."""

    @property
    def saved_per_layer(self) -> int:
        return self.layer_bf16_bytes - self.layer_host_bytes


def chunk_bytes(params: int, base_format: str, e: int = 2) -> int:
    """Device bytes of one chunk's intermediates while a weight of ``params`` unpacks (0 for a format unpacked in
    place): ``roundpipe.host.formats.dequantize_transient_bytes`` less the packed bytes."""
    return min(params, DEQUANT_CHUNK) * (4 + e) if base_format in CHUNKED_FORMATS else 0


def frozen_base(shape: ModelShape, base_format: str, e: int = 2) -> FrozenBase:
    """The frozen projections of one decoder layer of ``shape`` in ``base_format`` (see ``FrozenBase``)."""
    check(base_format)
    projections = shape.projections()
    bf16 = sum(i * o for i, o in projections) * e
    host = sum(packed_weight_bytes(o, i, base_format, e) for i, o in projections)
    if base_format == "bf16":
        return FrozenBase(base_format, bf16, host, 0, 0.0)
    largest = max(projections, key=lambda p: p[0] * p[1])
    n = largest[0] * largest[1]
    transient = packed_weight_bytes(largest[1], largest[0], base_format, e) + chunk_bytes(n, base_format, e)
    ms = 1e3 * sum(i * o for i, o in projections) / DEQUANTIZE_PARAMS_PER_S[base_format]
    return FrozenBase(base_format, bf16, host, transient, ms)
