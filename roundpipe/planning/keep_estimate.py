"""What keeping activations (``roundpipe.planning.keep``) would do to a step, from the model's dimensions alone:
how many backward stages the room a one-GPU step leaves holds with their graphs kept, the GPU bytes that takes
and the recompute it saves. ``roundpipe plan`` prints it beside the memory estimate (``estimate.estimate``).

A kept stage holds, from its forward to its backward, its layers (weights and gradients) and per microbatch
its whole activation footprint: each decoder layer's kept bytes (what a recompute would keep,
``memory_terms.decoder_layer_bytes``; a LoRA layer's as the compiled whole-layer op saves them,
``memory_terms.fused_lora_kept_bytes_per_token``) and the stage's input. As the planner does, stages are kept only in
the room the saved inputs leave (``planning.keep``): the step's host memory never grows. The stages counted are the
decoder layers' in groups of the estimate's ``layers_per_stage``; the fused last stage (the head) recomputes
nothing. Only a one-GPU step without sequence tiles keeps, as the runtime does. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict

from roundpipe.planning.estimate import Estimate
from roundpipe.planning.memory_terms import (
    ModelShape,
    decoder_layer_bytes,
    fused_lora_kept_bytes_per_token,
    lora_bytes_per_token,
    lora_pre_attention_bytes_per_token,
    lora_products_per_token,
)
from roundpipe.utils import GiB


@dataclass(frozen=True)
class KeepEstimate:
    """The kept stages of one step (bytes, FLOPs)."""

    stages: int
    """Backward stages kept."""
    candidates: int
    """Backward stages that could be kept (0 where the step cannot keep: several GPUs, sequence tiles)."""
    stage_bytes: float
    """GPU bytes one kept stage takes, all microbatches."""
    room: float
    """The room the saved inputs leave of the step's (``Estimate.device_room``)."""
    saved_flops: float
    """Forward FLOPs of the kept stages' recompute, per step."""
    share: float
    """That recompute's share of the decoder layers' compute per step (forward, recompute, backward)."""
    peak_gpu_bytes: float
    """The step's GPU peak with the stages kept (an upper bound: a kept stage's saved input is freed)."""

    @property
    def kept_bytes(self) -> float:
        return self.stages * self.stage_bytes

    def describe(self) -> str:
        """One line for ``roundpipe plan``."""
        if not self.candidates:
            return "keep activations: none (a one-GPU step without sequence tiles keeps them)"
        if not self.stages:
            return (
                f"keep activations: none of {self.candidates} backward stages; one needs "
                f"{self.stage_bytes / GiB:.1f} GiB, the saved inputs leave {self.room / GiB:.1f} GiB"
            )
        return (
            f"keep activations: {self.stages} of {self.candidates} backward stages, "
            f"{self.kept_bytes / GiB:.1f} GiB of the {self.room / GiB:.1f} GiB the saved inputs leave (peak GPU "
            f"{self.peak_gpu_bytes / GiB:.1f} GiB); no recompute of them: {self.saved_flops / 1e12:.1f} TFLOP a step, "
            f"{100 * self.share:.0f}% of the decoder layers' compute"
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "stages": self.stages,
            "candidates": self.candidates,
            "gpu_bytes": self.kept_bytes,
            "stage_bytes": self.stage_bytes,
            "room": self.room,
            "saved_flops": self.saved_flops,
            "share": self.share,
            "peak_gpu_bytes": self.peak_gpu_bytes,
        }


def keep_estimate(
    shape: ModelShape, e: Estimate, devices: int = 1, sequence_tiles: int = 1, dtype_bytes: int = 2
) -> KeepEstimate:
    """The stages a step of estimate ``e`` keeps in its room (``e.device_room``), as the planner takes them."""
    b, g = dtype_bytes, e.layers_per_stage
    rows = math.ceil(e.batch_size / e.microbatches)
    t = rows * e.seq_len
    tiled = bool(e.tile) and t > e.tile
    lora = e.lora_rank
    extra = lora_bytes_per_token(shape, lora, b) if lora else 0.0
    pre = lora_pre_attention_bytes_per_token(shape, lora, b) if lora else 0.0
    # A LoRA layer runs as the compiled whole-layer op on a GPU (fused kernels on, their default there), which
    # saves less than its modules' count (its peak): the runtime's plan keeps by that op's count.
    # With FP8 GEMMs over an fp8 base it saves the same.
    own = fused_lora_kept_bytes_per_token(shape, lora_products_per_token(lora), b) if lora else None
    kept, _ = decoder_layer_bytes(shape, t, e.tile, tiled, b, not lora, extra, pre, own)
    # A layer's weights as uploaded (an fp8 base's bytes under FP8 GEMMs) and its gradients (PEFT's fp32 adapters)
    layer_dev = e.device_bytes_per_layer + (8 * shape.lora_params(lora) if lora else shape.layer_params() * b)
    stage_bytes = e.microbatches * g * kept + g * layer_dev  # its input has its place as a saved input
    saved_inputs = e.gpu_parts.get("saved inputs", 0.0)
    room = max(0.0, e.keep_room - saved_inputs)
    candidates = math.ceil(shape.layers / g) if devices == 1 and sequence_tiles == 1 else 0
    stages = min(candidates, int(room // stage_bytes)) if stage_bytes > 0 else 0
    layers = min(shape.layers, stages * g)
    tokens = e.batch_size * e.seq_len
    fwd = 2 * shape.layer_params() + 2 * e.seq_len * shape.q_dim  # a layer's forward FLOPs per token (causal)
    passes = 3 if lora else 4  # forward, recompute, input gradients (and weight gradients in a full fine-tune)
    return KeepEstimate(
        stages,
        candidates,
        float(stage_bytes),
        float(room),
        float(layers * fwd * tokens),
        layers / (shape.layers * passes),
        float(e.peak_gpu_bytes + stages * stage_bytes),
    )
