"""Qwen3 (``Qwen3ForCausalLM``): the standard layout; sliding-window layers follow ``config.layer_types``.

Fused kernels (:mod:`roundpipe.models.kernels`): RMSNorm, q/k norm + rotary, SwiGLU.
"""

from __future__ import annotations

from torch import nn

from roundpipe.models.preset import CausalLMSpec, default_spec

MODEL_CLASS = "Qwen3ForCausalLM"


def build_spec(model: nn.Module) -> CausalLMSpec:
    return default_spec(model, fused_kernels=True)
