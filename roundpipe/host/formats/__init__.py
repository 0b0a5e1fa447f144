"""Frozen-weight formats in host memory (bf16, fp8 e4m3, int8, NF4, MXFP4): a frozen parameter's host bytes,
uploaded as they are and dequantized on the device (see ``frozen.py`` for the tensor, ``codecs.py``, ``nf4.py``
and ``mxfp4.py`` for the packings)."""

from roundpipe.host.formats.codecs import Format
from roundpipe.host.formats.frozen import (
    BASE_FORMATS,
    FrozenWeight,
    adopt_bnb_4bit,
    adopt_mxfp4,
    check_base_format,
    default_targets,
    dequantize_transient_bytes,
    device_nbytes,
    expert_layout,
    frozen_weights,
    get_format,
    host_nbytes,
    module_device_bytes,
    quantize_base,
    quantize_frozen,
)

__all__ = [
    "BASE_FORMATS",
    "adopt_bnb_4bit",
    "adopt_mxfp4",
    "Format",
    "FrozenWeight",
    "check_base_format",
    "default_targets",
    "dequantize_transient_bytes",
    "device_nbytes",
    "expert_layout",
    "frozen_weights",
    "get_format",
    "host_nbytes",
    "module_device_bytes",
    "quantize_base",
    "quantize_frozen",
]
