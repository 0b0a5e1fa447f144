"""What FP8 GEMMs (``fp8=True``, ``--fp8``: ``roundpipe.models.fp8``) change in a step's memory, from the shapes
alone: which projections run in FP8, the bytes a decoder layer's weights take on the GPU, and the transients of
the weights' fp8 copies. ``roundpipe.planning.estimate`` counts them when asked for ``fp8``.

Which projections: those of a decoder layer whose input and output features are both multiples of
:data:`GEMM_MULTIPLE` (``torch._scaled_mm``'s); the embedding, the LM head, the norms, an MoE router, the
attention itself and the loss stay in the model's dtype. That is the runtime's rule (``fp8.trained_filter`` and
``fp8.enable_fp8_base``), repeated here so that the estimate imports no torch; a test keeps the two equal.

* A frozen base stored as fp8 (LoRA, ``base_format="fp8"``): such a projection's device copy is what was uploaded
  (``fp8.Fp8Weight``: the e4m3 bytes and a float32 scale per row) instead of the dequantized weight, so a layer
  takes its upload's bytes on the GPU and is not unpacked; the input-gradient GEMM reads a column-major copy of
  the fp8 bytes (``fp8.grad_input_mm`` on a GPU), one weight at a time. A projection of other features is
  unpacked as without ``fp8``.
* Trained weights (a full fine-tune): torchao's float8 recipe (dynamic tensorwise scaling). The weights stay in
  the model's dtype on the host, in the upload and on the GPU; each GEMM casts its weight to fp8, and the
  input-gradient GEMM takes a column-major copy of that cast: two fp8 copies of one weight at a time.

Not counted: the fp8 casts of the activations and output gradients (a one-byte copy of a GEMM's operand, and
uncompiled its float32 intermediates). Nor is FP8's GEMM speed: ``roundpipe plan`` estimates memory, and the
runtime's planner times the layers on the device, FP8 GEMMs included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from roundpipe.planning import frozen_terms
from roundpipe.planning.memory_terms import ModelShape

#: Features of a projection that ``torch._scaled_mm`` takes are multiples of this (``fp8._gemm_shape``).
GEMM_MULTIPLE = 16
#: The names of ``ModelShape.projections()``, in its order.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: What stays in the model's dtype under ``fp8=True`` (besides a projection of other features).
UNCHANGED = "the embedding, the LM head, the norms, an MoE router, the attention and the loss"


def check(lora_rank: int, base_format: str) -> None:
    """Raise where ``fp8=True`` cannot run: LoRA over a base not stored as fp8 (the runtime's
    ``fp8.enable_fp8_base`` refuses it)."""
    if lora_rank and base_format != "fp8":
        raise ValueError(
            f"fp8=True with LoRA computes from a frozen base stored as fp8, and base_format={base_format!r}: "
            "give base_format='fp8', or fp8=False"
        )


def runs_fp8(in_features: int, out_features: int) -> bool:
    """Whether a decoder-layer projection of these features runs as an FP8 GEMM."""
    return in_features % GEMM_MULTIPLE == 0 and out_features % GEMM_MULTIPLE == 0


@dataclass(frozen=True)
class Fp8Terms:
    """One decoder layer of a step under ``fp8=True`` (bytes on the GPU, milliseconds)."""

    recipe: str
    """``"frozen fp8 base"`` (LoRA over ``base_format="fp8"``) or ``"torchao float8"`` (trained weights)."""
    fp8_projections: Tuple[str, ...]
    """The projections that run as FP8 GEMMs."""
    other_projections: Tuple[str, ...]
    """The projections whose features ``torch._scaled_mm`` does not take: they run as without ``fp8``."""
    device_layer_bytes: int
    """The layer's weights on the GPU once uploaded (the fp8 bytes and scales of a frozen fp8 base's projections)."""
    cast_bytes: int
    """The largest fp8 copies of a weight alive at once: the column-major copy of a frozen fp8 weight, or a trained
    weight's cast and its column-major copy."""
    unpacking_bytes: int
    """The unpacking transient of the largest frozen projection still unpacked (those of other features)."""
    dequantize_ms: float
    """Time to unpack those (``frozen_terms.DEQUANTIZE_PARAMS_PER_S``); 0 when all run in FP8."""
    layers: int
    """Decoder layers of the model, each alike."""

    def describe(self) -> str:
        """One line for ``roundpipe plan``: the choice, what stays in bf16, and what the estimate leaves out."""
        n = len(self.fp8_projections)
        which = "all 7 projections" if n == 7 else f"{n} of 7 projections ({', '.join(self.fp8_projections)})"
        how = (
            "over the frozen base's fp8 bytes and row scales, kept as uploaded (not unpacked)"
            if self.recipe == "frozen fp8 base"
            else "under torchao's float8 recipe (dynamic tensorwise scaling of the bf16 weights, cast on the GPU)"
        )
        other = (
            f"; {', '.join(self.other_projections)} too (features not multiples of 16)"
            if self.other_projections
            else ""
        )
        return (
            f"FP8 GEMMs (--fp8): {which} of each of the {self.layers} decoder layers, {how}; "
            f"{mib(self.device_layer_bytes)} of weights per decoder layer on the GPU, "
            f"{mib(self.cast_bytes)} of fp8 weight copies\n"
            f"  in bf16: {UNCHANGED}{other}; not in this estimate: FP8's GEMM speed (the runtime's planner times "
            "the layers on the device) and the activations' fp8 casts"
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "recipe": self.recipe,
            "fp8_projections": list(self.fp8_projections),
            "other_projections": list(self.other_projections),
            "unchanged": UNCHANGED,
            "device_layer_bytes": self.device_layer_bytes,
            "cast_bytes": self.cast_bytes,
            "unpacking_bytes": self.unpacking_bytes,
            "dequantize_ms": self.dequantize_ms,
            "gemm_speed_estimated": False,
        }


def fp8_terms(shape: ModelShape, lora_rank: int, base_format: str, e: int = 2) -> Fp8Terms:
    """One decoder layer of ``shape`` under ``fp8=True`` (``e`` bytes per element in the model dtype): over a
    frozen fp8 base (``lora_rank``) or with trained projections (see :class:`Fp8Terms` and the module docstring)."""
    check(lora_rank, base_format)
    projections = list(zip(PROJECTIONS, shape.projections()))
    fast = [(name, i, o) for name, (i, o) in projections if runs_fp8(i, o)]
    slow = [(name, i, o) for name, (i, o) in projections if not runs_fp8(i, o)]
    if not fast:  # as the runtime's fp8.prepare refuses it
        raise ValueError(
            "fp8=True: the model has no decoder-layer projection to run in FP8 (features multiples of "
            f"{GEMM_MULTIPLE}); remove fp8=True (--fp8)"
        )
    largest = max(i * o for _, i, o in fast)
    layer_bytes = shape.layer_params() * e
    if not lora_rank:  # trained: bf16 on the GPU; a weight's cast and the column-major copy of it
        return Fp8Terms("torchao float8", _names(fast), _names(slow), layer_bytes, 2 * largest, 0, 0.0, shape.layers)
    packed = sum(i * o * e - frozen_terms.packed_weight_bytes(o, i, "fp8", e) for _, i, o in fast)
    slow_params = [i * o for _, i, o in slow]
    unpacking = 0
    if slow_params:
        _, i, o = max(slow, key=lambda p: p[1] * p[2])
        unpacking = frozen_terms.packed_weight_bytes(o, i, "fp8", e) + frozen_terms.chunk_bytes(i * o, "fp8", e)
    ms = 1e3 * sum(slow_params) / frozen_terms.DEQUANTIZE_PARAMS_PER_S["fp8"]
    return Fp8Terms(
        "frozen fp8 base", _names(fast), _names(slow), layer_bytes - packed, largest, unpacking, ms, shape.layers
    )


def mib(nbytes: float) -> str:
    """``"184 MiB"``, ``"0.59 MiB"``: two decimals below 10 MiB."""
    return f"{nbytes / 2**20:.{0 if nbytes >= 10 * 2**20 else 2}f} MiB"


def _names(rows: Any) -> Tuple[str, ...]:
    return tuple(r[0] for r in rows)
