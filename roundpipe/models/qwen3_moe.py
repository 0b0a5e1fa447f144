"""Qwen3-MoE (``Qwen3MoeForCausalLM``): standard layout plus the router load-balancing loss.

Router logits are captured from ``Qwen3MoeTopKRouter`` (found through the model's own output recorder);
layers listed in ``config.mlp_only_layers`` are dense and contribute nothing, as in transformers. All
layers use a sliding window when ``config.sliding_window`` is set.
"""

from __future__ import annotations

from torch import nn

from roundpipe.models.preset import CausalLMSpec, default_spec

MODEL_CLASS = "Qwen3MoeForCausalLM"


def build_spec(model: nn.Module) -> CausalLMSpec:
    spec = default_spec(model)
    if spec.moe is None:
        raise NotImplementedError(f"{type(model).__name__}: router logits recorder not found")
    return spec
