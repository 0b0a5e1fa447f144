"""GPT-OSS (``GptOssForCausalLM``): alternating sliding/full attention (``config.layer_types``),
attention sinks (inside the attention module), and the router load-balancing loss.

Unlike most families, GPT-OSS builds its masks without ``position_ids`` (so no packed-sequence
detection); the preset does the same.
"""

from __future__ import annotations

from torch import nn

from roundpipe.models.preset import CausalLMSpec, default_spec

MODEL_CLASS = "GptOssForCausalLM"


def build_spec(model: nn.Module) -> CausalLMSpec:
    spec = default_spec(model, mask_uses_position_ids=False)
    if spec.moe is None:
        raise NotImplementedError(f"{type(model).__name__}: router logits recorder not found")
    return spec
