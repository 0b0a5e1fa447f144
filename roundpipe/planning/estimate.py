"""Memory estimate of a training run before it starts: peak GPU and host bytes of a decoder-only causal
LM under RoundPipe, the bytes each token costs, and the longest context a machine fits.

The model of memory follows what the runtime keeps (see docs/resolve-oom.md):

* Host. Model weights (pinned, in the model dtype); per trainable parameter the optimizer's copies
  (fp32 master and Adam m, v: 12 bytes) and the host gradient buffers the asynchronous step rotates
  through (one more model-dtype buffer besides the weights by default); and the activation checkpoints:
  the input of every backward stage is kept from the forward to the backward, ``tokens x hidden``
  values (model dtype, or ``RPP_STAGE_INPUTS`` fp8 / int8) with the rotary tables handed along; on one GPU
  in the room the runtime's plan leaves (``RPP_DEBUG_DEVICE_SAVED_GB``, given ``gpu_bytes``), the rest on the host.
* GPU, the largest of: a backward stage (its layers' weights and the next stage's prefetched ones,
  gradients of the trainable ones, the tensors the recompute keeps for backward: with sequence tiling a
  decoder layer keeps its input, q, k, v and the attention output at full length, the rest one tile at
  a time; and the backward's own transients: the output gradient, the attention backward's gradients
  and fp32 accumulator, the input gradient); and the head (final norm and the chunked loss).

With FP8 GEMMs (``fp8``: ``roundpipe.planning.fp8_estimate``) a frozen fp8 base's layers stay on the GPU as
uploaded (not unpacked), trained weights in the model dtype, and one weight's fp8 copies are counted besides.

Sizes are counted exactly from the shapes (the terms: ``roundpipe.planning.memory_terms``); two constants,
fitted to measured peaks, cover what shapes do not tell (CUDA context and allocator slack; the interpreter and
libraries); ``bench/long_context.py`` prints estimate and measurement side by side.

    from roundpipe.planning.estimate import ModelShape, estimate
    e = estimate(ModelShape.builtin("qwen3-8b"), seq_len=262144, lora_rank=16)
    print(e.describe())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from roundpipe.planning import fp8_estimate, frozen_terms
from roundpipe.planning.memory_terms import (
    GPU_OVERHEAD_BYTES,
    HOST_OVERHEAD_BYTES,
    ModelShape,
    checkpoint_bytes_per_token,
    decoder_layer_bytes,
    device_keep_room,
    device_saved_room,
    fused_lora_bytes_per_token,
    fused_lora_kept_bytes_per_token,
    head_activation_bytes,
    job_io_bytes,
    lora_bytes_per_token,
    lora_pre_attention_bytes_per_token,
    lora_products_per_token,
    pinned_block,
    pinned_checkpoint_bytes,
    runtime_step_bytes,
    side_bytes_per_token,
)
from roundpipe.utils import GiB


@dataclass
class Estimate:
    """Peak memory of one training step and what it is made of (bytes)."""

    seq_len: int
    batch_size: int
    microbatches: int
    lora_rank: int
    layers_per_stage: int
    gpu_parts: Dict[str, float] = field(default_factory=dict)
    host_parts: Dict[str, float] = field(default_factory=dict)
    gpu_bytes_per_token: float = 0.0
    host_bytes_per_token: float = 0.0
    stage_inputs: str = "bf16"
    base_format: str = "bf16"
    upload_bytes_per_layer: float = 0.0
    """Bytes one decoder layer's weights take from host to GPU at each upload (packed, as held)."""
    dequantize_ms_per_layer: float = 0.0
    """Time to unpack one decoder layer's packed base on the GPU (``frozen_terms``' assumed rates)."""
    tile: int = 0
    """Tokens per sequence tile of the decoder layers (``RPP_SEQ_TILE``) the estimate counts (0: off)."""
    device_room: float = 0.0
    """GPU bytes a one-GPU step may keep on the device beyond its peak: saved inputs, or kept stages
    (``roundpipe.planning.keep_estimate``); 0 with several GPUs or no ``gpu_bytes``."""
    device_bytes_per_layer: float = 0.0
    """Bytes one decoder layer's weights take on the GPU once uploaded (plain, or an fp8 base's bytes under FP8)."""
    fp8: Optional[fp8_estimate.Fp8Terms] = None
    """What FP8 GEMMs change per decoder layer (``fp8=True``; None: off)."""
    keep_room: float = 0.0
    """GPU bytes a one-GPU step may keep stages' graphs and inputs in (``memory_terms.device_keep_room``)."""

    @property
    def peak_gpu_bytes(self) -> float:
        return sum(self.gpu_parts.values())

    @property
    def peak_host_bytes(self) -> float:
        return sum(self.host_parts.values())

    def describe(self) -> str:
        """A few lines for people: the peaks, their parts, the cost per token."""

        def parts(d: Dict[str, float]) -> str:
            return ", ".join(f"{k} {v / GiB:.1f}" for k, v in d.items() if v >= 0.05 * GiB)

        mode = f"LoRA r={self.lora_rank}" if self.lora_rank else "full fine-tune"
        base = []
        if self.base_format != "bf16" and self.fp8 is not None and not self.fp8.dequantize_ms:
            base = [
                f"frozen base in {self.base_format}: {self.host_parts['weights'] / GiB:.1f} GiB of host weights; "
                f"{fp8_estimate.mib(self.upload_bytes_per_layer)} uploaded per decoder layer and upload, no unpacking"
            ]
        elif self.base_format != "bf16":
            base = [
                f"frozen base in {self.base_format}: {self.host_parts['weights'] / GiB:.1f} GiB of host weights; "
                f"{self.upload_bytes_per_layer / 2**20:.0f} MiB uploaded and about "
                f"{self.dequantize_ms_per_layer:.2f} ms of unpacking per decoder layer and upload"
            ]
        return "\n".join(
            [
                f"{mode}, {self.batch_size} x {self.seq_len:,} tokens, {self.microbatches} microbatch(es), "
                f"{self.layers_per_stage} decoder layer(s) per backward stage"
                + (f", stage inputs in {self.stage_inputs}" if self.stage_inputs != "bf16" else ""),
                f"peak GPU  {self.peak_gpu_bytes / GiB:6.1f} GiB  ({parts(self.gpu_parts)}); "
                f"{self.gpu_bytes_per_token / 1024:.1f} KiB per token",
                f"peak host {self.peak_host_bytes / GiB:6.1f} GiB  ({parts(self.host_parts)}); "
                f"{self.host_bytes_per_token / 1024:.1f} KiB per token",
            ]
            + base
            + ([self.fp8.describe()] if self.fp8 is not None else [])
        )


def budgets(gpu_bytes: float, host_bytes: float) -> str:
    """``"80.0 GiB per GPU and 23.5 GiB of host memory"``: the budgets, written one way wherever they are
    printed (so one machine shows one host figure)."""
    return f"{gpu_bytes / GiB:.1f} GiB per GPU and {host_bytes / GiB:.1f} GiB of host memory"


def estimate(
    shape: ModelShape,
    seq_len: int,
    batch_size: int = 1,
    lora_rank: int = 0,
    microbatches: int = 1,
    dtype_bytes: int = 2,
    tile: Optional[int] = None,
    layers_per_stage: int = 1,
    recompute_grain: str = "stage",
    optimizer_bytes_per_param: float = 12,
    grad_buffers: Optional[int] = None,
    pinned: bool = True,
    devices: int = 1,
    gpu_bytes: Optional[float] = None,
    sequence_tiles: int = 1,
    stage_inputs: Optional[str] = None,
    base_format: str = "bf16",
    fused_lora: bool = False,
    fp8: bool = False,
) -> Estimate:
    """The peak GPU and host memory of one training step (see the module docstring).

    Args:
        shape: The model's dimensions.
        seq_len / batch_size: Tokens of one step (``batch_size`` rows of ``seq_len``).
        lora_rank: LoRA rank on all decoder projections (0: full fine-tune).
        microbatches: Microbatches per step (rows are split between them).
        dtype_bytes: Bytes of the model dtype (2 for bf16).
        tile: Sequence tile of the decoder layers (``RPP_SEQ_TILE``; None: the setting).
        layers_per_stage: Decoder layers per backward stage: more layers keep fewer checkpoints on the
            host and more activations on the GPU.
        recompute_grain: 'stage' keeps the recompute graph of the whole stage; 'layer' only the
            inputs of its layers and one layer's graph.
        optimizer_bytes_per_param: Optimizer state and master bytes per trainable parameter (12: fp32
            master + Adam m, v; :func:`optimizer_state_bytes` gives the compact states).
        grad_buffers: Host buffers per trainable parameter besides the weights (gradient download and
            staging). None: as the step mode makes it with one training call per step
            (``roundpipe.host.step_mode.StepMode.host_buffers_besides_weights``: 1, staged or streamed).
        pinned: Whether checkpoints come from the pinned caching allocator (GPU runs; CPU workers keep
            them unrounded).
        devices: GPUs of the process: with several (and several microbatches) the fused last stage runs
            in one part per device, and each part but the first hands its gradients of the stage over
            in host buffers of its own (``roundpipe.runtime.partial_grads``).
        gpu_bytes: Memory of the GPU. With one GPU, the backward stages' inputs the room
            (:func:`device_saved_room`) holds are counted there ("saved inputs") instead of on the host,
            as the runtime keeps them; None (or several GPUs): all on the host.
        sequence_tiles: Tiles of the sequence that flow as the microbatches (``roundpipe.runtime.sequence``;
            replaces ``microbatches``): a job holds one tile's activations and its layers' keys and values
            over the whole sequence (with float32 gradient accumulators in backward); the host keeps
            every attention layer's keys and values between forward and backward.
        stage_inputs: How the host keeps them: 'bf16' (``dtype_bytes`` per value), 'fp8' (1 byte and a
            float32 scale per 128 values) or 'int8' (1 byte and a float32 scale per 32 values); those on the
            GPU stay exact. None: ``RPP_STAGE_INPUTS``.
        base_format: How a LoRA run's frozen projections are held on the host (``roundpipe.utils.BASE_FORMATS``):
            packed ones take fewer host bytes and upload bytes, arrive on the GPU at the model dtype, and cost
            one weight's unpacking transient there (``frozen_terms.frozen_base``).
        fused_lora: Whether a tiled layer's LoRA projections run as the fused LoRA linear inside the fused ops (GPUs
            with Triton, ``RPP_DEBUG_FUSED_KERNELS``): their adapters keep the layer's own inputs and the rank-r
            products (:func:`memory_terms.fused_lora_bytes_per_token`) instead of PEFT's fp32 copies. False counts
            PEFT's modules, as the GPU peaks on record were measured.
        fp8: FP8 GEMMs in the decoder layers' projections (``fp8=True``, :mod:`fp8_estimate`): over a frozen base
            stored as fp8 (``lora_rank`` needs ``base_format='fp8'``) a layer's device weights are its uploaded
            bytes and it is not unpacked; trained weights stay in the model dtype. Either way the weights' fp8
            copies are counted ("fp8 casts"); FP8's GEMM speed is not (this estimates memory).
    """
    if seq_len < 1 or batch_size < 1 or microbatches < 1 or layers_per_stage < 1 or devices < 1 or sequence_tiles < 1:
        raise ValueError(
            "seq_len, batch_size, microbatches, layers_per_stage, devices and sequence_tiles must be positive"
        )
    if recompute_grain not in ("stage", "layer"):
        raise ValueError(f"recompute_grain={recompute_grain!r}: expected 'stage' or 'layer'")
    frozen_terms.check(base_format)
    if fp8:
        fp8_estimate.check(lora_rank, base_format)
    if base_format != "bf16" and not lora_rank:
        raise ValueError(
            f"base_format={base_format!r} packs the frozen base of a LoRA run: give lora_rank, or base_format='bf16'"
        )
    if tile is None or grad_buffers is None or stage_inputs is None:
        from roundpipe import settings
        from roundpipe.host.step_mode import StepMode

        if tile is None:
            tile = settings.SEQ_TILE.get()
        if grad_buffers is None:
            grad_buffers = StepMode.resolve().host_buffers_besides_weights
        if stage_inputs is None:
            stage_inputs = settings.STAGE_INPUTS.get()
    b = dtype_bytes
    tiled_sequence = sequence_tiles > 1
    if tiled_sequence:  # every row in each tile; the tiles are the microbatches
        microbatches, rows, mb_len = sequence_tiles, batch_size, math.ceil(seq_len / sequence_tiles)
    else:
        rows, mb_len = math.ceil(batch_size / microbatches), seq_len
    t = rows * mb_len  # tokens of one microbatch: what one job holds at once
    total_tokens = batch_size * seq_len
    h = shape.hidden
    tiled = bool(tile) and t > tile

    # ---- GPU ----------------------------------------------------------------------------------------
    layer_w = shape.layer_params() * b
    fp8_layer = fp8_estimate.fp8_terms(shape, lora_rank, base_format, b) if fp8 else None
    device_w = fp8_layer.device_layer_bytes if fp8_layer is not None else layer_w  # a layer's weights, uploaded
    trainable_layer = shape.lora_params(lora_rank) if lora_rank else shape.layer_params()
    g = layers_per_stage
    weights = 2 * g * device_w + g * trainable_layer * b  # the stage and the prefetched one; gradients
    # A LoRA model runs its layers module by module (PEFT's adapters), with fp32 adapters (PEFT's default).
    lora_extra = lora_bytes_per_token(shape, lora_rank, b) if lora_rank else 0.0
    lora_pre = lora_pre_attention_bytes_per_token(shape, lora_rank, b) if lora_rank else 0.0
    tiled_extra, tiled_pre = lora_extra, lora_pre
    if fused_lora and lora_rank and tiled:
        tiled_extra, tiled_pre = fused_lora_bytes_per_token(shape, lora_rank, b)
    kept, peak = decoder_layer_bytes(shape, t, tile, tiled, b, not lora_rank, tiled_extra, tiled_pre)
    io = job_io_bytes(shape, t, b)  # the stage input, output gradient, neighbours' in flight, side tensors
    side = t * side_bytes_per_token(shape, b)
    others = (g - 1) * (kept if recompute_grain == "stage" else t * h * b)
    stage = peak + others + io

    def sequence_kv(layers: int) -> float:
        """Tiles of one sequence: a job's keys and values of its ``layers`` over the whole sequence, their
        float32 gradient accumulators (backward), and one tile's attention inputs ([prefix, tile] keys
        and values and their gradients, repeated to the query heads)."""
        if not tiled_sequence:
            return 0.0
        whole = batch_size * seq_len
        return layers * whole * shape.kv_dim * 2 * (b + 4) + whole * 2 * (2 * shape.q_dim + shape.kv_dim) * b

    stage += sequence_kv(g)
    head_w = shape.vocab * h * b * (1 if shape.tied or lora_rank else 2) + (shape.vocab * h * b if not lora_rank else 0)
    # The fused last stage: the head (final norm, chunked loss) with, at long context, the last decoder
    # layer (the head is fast there, so the planner's time cap groups them): that layer's kept bytes.
    head = head_activation_bytes(shape, t, b) + kept + io + sequence_kv(1)
    head_w += device_w
    if stage + weights >= head + head_w:
        gpu = {"weights": float(weights), "activations": float(stage), "runtime": float(GPU_OVERHEAD_BYTES)}
    else:
        gpu = {"weights": float(head_w), "activations": float(head), "runtime": float(GPU_OVERHEAD_BYTES)}
    base = frozen_terms.frozen_base(shape, base_format, b)
    unpacking = base.gpu_transient_bytes if fp8_layer is None else fp8_layer.unpacking_bytes
    if unpacking:  # one packed weight being unpacked beside the plain copies
        gpu["unpacking"] = float(unpacking)
    if fp8_layer is not None and fp8_layer.cast_bytes:  # one weight's fp8 copies beside its GEMM
        gpu["fp8 casts"] = float(fp8_layer.cast_bytes)

    # ---- host --------------------------------------------------------------------------------------
    n = shape.params()
    trainable = shape.layers * shape.lora_params(lora_rank) if lora_rank else n
    boundaries = max(1, math.ceil(shape.layers / g))  # backward stages whose input waits on the host
    # One host tensor per stage and microbatch, from torch's pinned caching allocator, which rounds each
    # block up to a power of two (GPU runs; see roundpipe.devices.backend.empty_host_cache).
    raw_input = rows * mb_len * checkpoint_bytes_per_token(shape, b)
    host_input = rows * mb_len * checkpoint_bytes_per_token(shape, b, stage_inputs)
    per_microbatch = pinned_checkpoint_bytes(shape, rows * mb_len, b, stage_inputs) if pinned else host_input
    # On one GPU the inputs the room holds stay there, whole (exact size, no pinned rounding). The room is the
    # runtime's (its plan's count: this estimate's peak in its place kept two inputs too many at 262,144 tokens).
    room = keep_room = 0.0
    if devices == 1 and gpu_bytes is not None:  # a layer's weights and gradients (PEFT's adapters in fp32)
        layer_dev = device_w + (8 * shape.lora_params(lora_rank) if lora_rank else trainable_layer * b)
        # As the runtime's layer bytes count it (formats.module_device_bytes): a base computing from its fp8 bytes
        # (fp8=True) at those bytes and scales, with the unpacking transient of what is still unpacked only.
        layer_dev += unpacking
        kv, prefix = sequence_kv(1) - sequence_kv(0), sequence_kv(0)
        # A LoRA layer's kept bytes as the runtime plans a GPU's compiled whole-layer op (sequence tiles: modules).
        # With FP8 GEMMs over an fp8 base it saves the same (``causal_lm.activation_profile``).
        own = None
        if lora_rank and not tiled_sequence:
            own = fused_lora_kept_bytes_per_token(shape, lora_products_per_token(lora_rank), b)
        step = runtime_step_bytes(shape, t, tile, tiled, b, lora_rank, lora_extra, g, layer_dev, kv, prefix, own)
        # Where this estimate's count of the step is the larger, the inputs fill only what it leaves.
        room = min(device_saved_room(gpu_bytes, step), max(0.0, gpu_bytes - sum(gpu.values())))
        keep_room = min(device_keep_room(gpu_bytes, step), max(0.0, gpu_bytes - sum(gpu.values())))
    # The runtime charges each input the rotary tables and position ids it carries (shared by all stages).
    on_gpu = min(boundaries * microbatches, int(room // (raw_input + side))) if raw_input > 0 else 0
    gpu["saved inputs"] = float(on_gpu * raw_input)
    checkpoints = (boundaries * microbatches - on_gpu) * per_microbatch + total_tokens * side_bytes_per_token(shape, b)
    parts = 1 if tiled_sequence else max(1, min(devices, microbatches))
    fused_trainable = shape.lora_params(lora_rank) if lora_rank else shape.layer_params() + shape.vocab * h
    host = {
        "weights": float(n * b - shape.layers * base.saved_per_layer),
        "optimizer": float(
            trainable * (optimizer_bytes_per_param + grad_buffers * b) + (parts - 1) * fused_trainable * b
        ),
        "checkpoints": float(checkpoints),
        "runtime": float(HOST_OVERHEAD_BYTES),
    }
    if tiled_sequence:  # each attention layer's keys and values: two host tensors, pinned blocks
        per_tensor = batch_size * seq_len * shape.kv_dim * b
        host["keys/values"] = float(2 * shape.layers * (pinned_block(per_tensor) if pinned else per_tensor))
    per_token_gpu = gpu["activations"] / t
    per_token_host = checkpoints / total_tokens
    adapters = 4 * shape.lora_params(lora_rank) if lora_rank else 0  # PEFT's float32 adapters
    upload = layer_w - base.saved_per_layer + adapters
    return Estimate(
        seq_len,
        batch_size,
        microbatches,
        lora_rank,
        layers_per_stage,
        gpu,
        host,
        per_token_gpu,
        per_token_host,
        stage_inputs,
        base_format,
        float(upload),
        base.dequantize_ms if fp8_layer is None else fp8_layer.dequantize_ms,
        int(tile),
        room,
        float(device_w),
        fp8_layer,
        keep_room,
    )


def longest_context(
    shape: ModelShape,
    gpu_bytes: float,
    host_bytes: float,
    batch_size: int = 1,
    lora_rank: int = 0,
    max_layers_per_stage: int = 4,
    tiles: Optional[Sequence[int]] = None,
    **kwargs: Any,
) -> Tuple[int, Optional[Estimate]]:
    """The longest sequence (a multiple of 1024) whose step fits ``gpu_bytes`` per GPU and ``host_bytes``,
    over backward stages of 1 to ``max_layers_per_stage`` decoder layers and over the sequence tiles ``tiles``
    (``RPP_SEQ_TILE`` values; None: only ``kwargs['tile']``, else the setting); with the estimate that fits. Of
    equal lengths the larger tile wins (fewer, larger GEMMs), then the fewer layers per stage."""
    if tiles is None:
        tiles = [kwargs.pop("tile", None)]
    else:
        kwargs.pop("tile", None)
    best: Tuple[int, Optional[Estimate]] = (0, None)
    for tile in sorted(tiles, key=lambda t: -(t or 0)):
        for g in range(1, max_layers_per_stage + 1):

            def fits(seq: int, g: int = g, tile: Optional[int] = tile) -> Optional[Estimate]:
                e = estimate(
                    shape, seq, batch_size, lora_rank, layers_per_stage=g, gpu_bytes=gpu_bytes, tile=tile, **kwargs
                )
                return e if e.peak_gpu_bytes <= gpu_bytes and e.peak_host_bytes <= host_bytes else None

            lo, hi = 0, 1 << 10
            while fits(hi * 1024) is not None and hi < (1 << 14):
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid * 1024) is not None:
                    lo = mid
                else:
                    hi = mid
            if lo * 1024 > best[0]:
                best = (lo * 1024, fits(lo * 1024))
    return best


#: The smallest sequence tile ``roundpipe plan`` proposes: below it a tile's GEMMs are short of a GPU's rate.
MIN_TILE = 2048


def tile_choices(tile: Optional[int] = None) -> List[int]:
    """The sequence tiles ``roundpipe plan`` tries (``RPP_SEQ_TILE`` values): ``tile`` (None: the setting) and its
    halvings down to ``MIN_TILE``. A smaller tile holds fewer tokens of a wide MLP at once (a 70B layer's
    intermediate tensors are 28,672 wide) and, from ``PRE_TILES_IN_RECOMPUTE`` tiles, recomputes the pre-attention
    graph per tile instead of keeping it at full length; it costs more, smaller GEMMs."""
    if tile is None:
        from roundpipe import settings

        tile = settings.SEQ_TILE.get()
    if not tile:
        return [0]
    out = [tile]
    while out[-1] // 2 >= MIN_TILE:
        out.append(out[-1] // 2)
    return out


def describe_fit(shape: ModelShape, gpu_bytes: float, host_bytes: float, **kwargs: Any) -> List[str]:
    """Lines saying the longest context that fits these budgets and how (for ``roundpipe plan``)."""
    seq, e = longest_context(shape, gpu_bytes, host_bytes, **kwargs)
    if e is None:
        return [f"no sequence of 1,024 tokens or more fits {budgets(gpu_bytes, host_bytes)}"]
    how = f"{e.layers_per_stage} decoder layer(s) per backward stage"
    if kwargs.get("tiles") is not None and e.tile != max(kwargs["tiles"]):
        how += f", RPP_SEQ_TILE={e.tile}"
    return [f"longest context that fits {budgets(gpu_bytes, host_bytes)}: {seq:,} tokens ({how})"]
