"""Llama (``LlamaForCausalLM``): the standard layout, full attention in every layer.

Fused kernels (:mod:`roundpipe.models.kernels`): RMSNorm, rotary, SwiGLU.
"""

from __future__ import annotations

from torch import nn

from roundpipe.models.preset import CausalLMSpec, default_spec

MODEL_CLASS = "LlamaForCausalLM"


def build_spec(model: nn.Module) -> CausalLMSpec:
    return default_spec(model, fused_kernels=True)
