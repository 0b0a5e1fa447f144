"""Memory estimate of a training run before it starts: peak GPU and host bytes of a decoder-only causal
LM under RoundPipe, the bytes each token costs, and the longest context a machine fits.

The model of memory follows what the runtime keeps (see docs/resolve-oom.md):

* Host. Model weights (pinned, in the model dtype); per trainable parameter the optimizer's copies
  (fp32 master and Adam m, v: 12 bytes) and the host gradient buffers the asynchronous step rotates
  through (one more model-dtype buffer besides the weights by default); and the activation checkpoints:
  the input of every backward stage is kept from the forward to the backward, ``tokens x hidden``
  values (model dtype, or ``RPP_STAGE_INPUTS`` fp8 / int8) with the rotary tables handed along; on one GPU
  in the room the runtime's plan leaves (``RPP_DEVICE_SAVED_GB``, given ``gpu_bytes``), the rest on the host.
* GPU, the largest of: a backward stage (its layers' weights and the next stage's prefetched ones,
  gradients of the trainable ones, the tensors the recompute keeps for backward: with sequence tiling a
  decoder layer keeps its input, q, k, v and the attention output at full length, the rest one tile at
  a time; and the backward's own transients: the output gradient, the attention backward's gradients
  and fp32 accumulator, the input gradient); and the head (final norm and the chunked loss).

Sizes are counted exactly from the shapes; two constants, fitted to measured peaks, cover what shapes do not
tell (CUDA context and allocator slack; the interpreter and libraries); ``bench/long_context.py`` prints estimate
and measurement side by side.

    from roundpipe import estimate
    e = estimate.estimate(estimate.ModelShape.builtin("qwen3-8b"), seq_len=262144, lora_rank=16)
    print(e.describe())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from roundpipe import flavors

GiB = float(1 << 30)

# What shapes do not tell, fitted to measured peaks (see the module docstring).
GPU_OVERHEAD_BYTES = int(1.0 * GiB)  # CUDA context, cuBLAS workspaces, allocator rounding
HOST_OVERHEAD_BYTES = int(3.0 * GiB)  # the interpreter, torch, transformers, CUDA host state

# Hidden-size tensors of neighbouring jobs alive beside a stage's own: the next stage's input uploading, the
# previous one's input gradient still downloading (without them the estimate was 13% below the H100 peaks at
# 262K / 524K tokens).
OVERLAP_TENSORS = 2


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked loss head: ``roundpipe.models.loss.default_chunk_size`` (repeated
    here so the estimate imports no torch; a test keeps the two equal)."""
    return max(256, min(8192, 1 << int(math.log2(2**30 / (4 * max(vocab, 1))))))


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide memory (a Hugging Face config's names in brackets)."""

    hidden: int
    """Model width (``hidden_size``)."""
    intermediate: int
    """MLP width (``intermediate_size``)."""
    layers: int
    """Decoder layers (``num_hidden_layers``)."""
    heads: int
    """Query heads (``num_attention_heads``)."""
    kv_heads: int
    """Key / value heads (``num_key_value_heads``)."""
    head_dim: int
    """Width of one head (``head_dim``, else hidden / heads)."""
    vocab: int
    """Vocabulary size (``vocab_size``)."""
    tied: bool = False
    """Whether the output head shares the embedding's weights (``tie_word_embeddings``)."""

    BUILTIN = flavors.QWEN3
    """The shapes known by name: the Qwen3 flavors (``roundpipe.flavors``)."""

    @classmethod
    def builtin(cls, name: str) -> "ModelShape":
        """One of the Qwen3 flavors (``roundpipe.flavors``: the sizes of ``bench/WORKLOADS.md`` and qwen3-32b)."""
        if name not in cls.BUILTIN:
            raise ValueError(
                f"unknown model shape {name!r}; built in: {sorted(cls.BUILTIN)} (or give a model directory)"
            )
        f = cls.BUILTIN[name]
        return cls(f.hidden, f.intermediate, f.layers, f.heads, f.kv_heads, f.head_dim, f.vocab, f.tied)

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a Hugging Face config of a decoder-only causal LM."""
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(
            hidden=hidden,
            intermediate=int(config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, norms incl. q/k norms)."""
        attn = self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + self.q_dim * self.hidden
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim

    def lora_params(self, rank: int) -> int:
        """LoRA parameters of one decoder layer with adapters on all seven projections."""
        shapes = [
            (self.hidden, self.q_dim),
            (self.hidden, self.kv_dim),
            (self.hidden, self.kv_dim),
            (self.q_dim, self.hidden),
            (self.hidden, self.intermediate),
            (self.hidden, self.intermediate),
            (self.intermediate, self.hidden),
        ]
        return sum(rank * (a + b) for a, b in shapes)

    def params(self) -> int:
        """All parameters (embedding, layers, final norm, output head unless tied)."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden


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
        )


def decoder_layer_bytes(
    shape: ModelShape,
    tokens: int,
    tile: int,
    tiled: bool,
    e: int = 2,
    whole_layer: bool = True,
    extra_per_token: float = 0.0,
    pre_extra_per_token: Optional[float] = None,
) -> Tuple[float, float]:
    """(kept, peak) GPU bytes of one decoder layer's recompute + backward for a microbatch of ``tokens``,
    beyond its weights, its input and its output gradient (those are counted by the caller).

    Tiled (``roundpipe.models.tiling``, measured on one Qwen3-8B layer within 0.1%: docs/models.md):
    the attention backward holds the layer input, q, k, v, the attention output, their gradients and
    sdpa's fp32 dq; an MLP tile holds one tile's graph; below 16 tiles the pre-attention graph stays.
    ``kept`` is what the layer's recompute leaves for the backward while a later layer of its stage
    runs. Untiled as one whole-layer op (``whole_layer``: the fused Qwen3 / Llama layer of a full
    fine-tune), the norms, projections and the MLP's ``tokens x intermediate`` tensors stay too.
    Untiled as separate modules (``whole_layer=False``: PEFT adapters, other families, fused layers
    off), what Hugging Face's modules save (:func:`module_layer_bytes_per_token`) plus
    ``extra_per_token``: what depends on the trainable parameters (the projections' inputs, LoRA
    adapters' inputs and outputs, the norms' outputs kept for their weights' gradients), which
    ``roundpipe.models.causal_lm`` finds on the layer.

    Below ``PRE_TILES_IN_RECOMPUTE`` tiles the recompute keeps the pre-attention graph at full length
    (``roundpipe.models.tiling``): the compiled op's (the normed input, q and k) for a whole-layer op; run
    as modules, the q / k / v projections' outputs and what the projections and the input norm save
    (``pre_extra_per_token``: PEFT's fp32 adapters keep one cast copy of the input each; None counts the
    compiled op's graph, as the runtime's own plan does). That graph's
    backward then holds the gradients of the same tensors beside it. Measured on one H200 (qwen3-8b
    LoRA r=16, 131,072 tokens, ``bench/memory_trace.py``): the adapters' three copies were 6.0 GiB of
    the 22.4 GiB peak, which the estimate had not counted.
    """
    n, h, q, k, i, a = tokens, shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads
    attention = n * (e * (h + 4 * q + 4 * k) + 4 * q + 2 * e * q + 8 * a)
    kept = n * (e * (h + 2 * q + 2 * k) + 4 * a)
    if not tiled and not whole_layer:
        saved = n * (module_layer_bytes_per_token(shape, e) + extra_per_token)
        # The backward's transients beside what is saved: the attention's input / output gradients and
        # sdpa's fp32 dq, or the MLP's three intermediate-sized gradients.
        transient = n * max(e * (h + 2 * q + 2 * k) + 4 * q, e * (h + 3 * i))
        return float(saved), float(saved + transient)
    if not tiled:
        full = n * e * (3 * i + 2 * h + q + k)
        return float(kept + full), float(attention + full)
    mlp_tile = n * (e * (h + 3 * q + 2 * k) + 4 * a) + min(tile, n) * e * (5 * i + 4 * h)
    if math.ceil(n / tile) >= PRE_TILES_IN_RECOMPUTE:
        return float(kept), float(max(attention, mlp_tile))
    if whole_layer or pre_extra_per_token is None:
        # The compiled op's graph; also what the runtime plans by (``pre_extra_per_token=None``, see
        # ``roundpipe.models.causal_lm``): its budget margins were fitted with this count.
        pre = n * e * (h + q + k)
    else:
        pre = n * (pre_extra_per_token + e * (q + 2 * k))
    return float(kept + pre), float(max(attention, mlp_tile) + pre)


#: ``tiling.PRE_TILES_IN_RECOMPUTE`` (copied so that the estimate imports no torch; a test keeps the two equal).
PRE_TILES_IN_RECOMPUTE = 16


def lora_pre_attention_bytes_per_token(shape: ModelShape, rank: int, e: int = 2, adapter_bytes: int = 4) -> float:
    """The q / k / v share of :func:`lora_bytes_per_token`: what those three adapters save (the pre-attention
    graph's part of it, see :func:`decoder_layer_bytes`)."""
    inputs = 3 * adapter_bytes * shape.hidden if adapter_bytes != e else e * shape.hidden
    return float(inputs + 3 * rank * adapter_bytes)


def module_layer_bytes_per_token(shape: ModelShape, e: int = 2) -> float:
    """Bytes per token that autograd saves for a Hugging Face Qwen3 / Llama decoder layer run module by
    module, not counting its input, its weights, the rotary tables and the projections' inputs (those
    depend on what is trainable: :func:`projection_inputs_per_token`): each RMSNorm its input upcast to
    fp32 and the inverse RMS (two layer norms, and per head the q / k norms), q and k after the rotary
    embedding, v, sdpa's output and its fp32 log-sum-exp, and the MLP's gate, up and activation. Counted
    from the saved-tensor hooks of a bf16 layer (tests/test_budget.py); fused kernels save less, so this
    bounds them."""
    h, q, k, i, a, kv = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads, shape.kv_heads
    return float(e * (2 * q + 2 * k + 3 * i) + 4 * (2 * h + q + k) + 8 * a + 4 * kv + 8)


def projection_inputs_per_token(shape: ModelShape, e: int = 2) -> float:
    """Bytes per token of the projections' inputs a layer with trainable projections saves for their
    weight gradients: the normed input of q / k / v, that of gate / up, the output projection's input
    and the down projection's."""
    return float(e * (2 * shape.hidden + shape.q_dim + shape.intermediate))


def lora_bytes_per_token(shape: ModelShape, rank: int, e: int = 2, adapter_bytes: int = 4) -> float:
    """Bytes per token a PEFT LoRA layer on all seven projections (frozen base weights) saves for its
    adapters: the output of each ``lora_A`` and its input: the projections' inputs as they are when the
    adapters have the layer's dtype, else each projection's own copy cast to the adapters' dtype (PEFT's
    default upcasts adapters to fp32, and ``lora_A`` saves the cast input)."""
    h, q, i = shape.hidden, shape.q_dim, shape.intermediate
    inputs = adapter_bytes * (5 * h + q + i) if adapter_bytes != e else projection_inputs_per_token(shape, e)
    return float(inputs + 7 * rank * adapter_bytes)


#: ``stage_codec.BLOCKS``, values per float32 scale of each compact stage-input format (copied so that the
#: estimate imports no torch; a test keeps the two equal).
STAGE_CODEC_BLOCKS = {"fp8": 128, "int8": 32}
STAGE_CODEC_BLOCK = STAGE_CODEC_BLOCKS["fp8"]


def checkpoint_bytes_per_token(shape: ModelShape, e: int = 2, stage_inputs: str = "bf16") -> float:
    """Host bytes per token of a decoder layer's input kept from the forward to the backward: the hidden
    states (the rotary tables, position ids and labels handed along with them keep one host copy per
    call, see ``roundpipe.runtime.jobs``); compact (``stage_inputs`` 'fp8' or 'int8', ``roundpipe.runtime.stage_codec``)
    one byte per value and a float32 scale per block of the format's ``STAGE_CODEC_BLOCKS`` values."""
    return float(sum(checkpoint_parts(shape, 1, e, stage_inputs)))


def checkpoint_parts(shape: ModelShape, tokens: int, e: int = 2, stage_inputs: str = "bf16") -> List[float]:
    """Bytes of the host tensors one stage input of ``tokens`` tokens is kept in: the hidden states, or
    (``fp8``, ``int8``) their one-byte payload and their scales."""
    if stage_inputs in STAGE_CODEC_BLOCKS:
        block = STAGE_CODEC_BLOCKS[stage_inputs]
        return [float(tokens * shape.hidden), float(tokens * 4 * math.ceil(shape.hidden / block))]
    if stage_inputs != "bf16":
        raise ValueError(f"stage_inputs={stage_inputs!r}: expected 'bf16', 'fp8' or 'int8'")
    return [float(tokens * shape.hidden * e)]


def pinned_checkpoint_bytes(shape: ModelShape, tokens: int, e: int = 2, stage_inputs: str = "bf16") -> float:
    """Host bytes one stage input of ``tokens`` tokens takes from torch's pinned caching allocator, which
    rounds each of its tensors up to a power of two (see :func:`checkpoint_parts`)."""
    return sum(_pinned_block(b) for b in checkpoint_parts(shape, tokens, e, stage_inputs))


def side_bytes_per_token(shape: ModelShape, e: int = 2) -> float:
    """Host bytes per token of what a causal LM hands along once per call: rotary cos / sin, position
    ids and labels (int64)."""
    return float(2 * shape.head_dim * e + 16)


def head_activation_bytes(shape: ModelShape, tokens: int, e: int = 2) -> float:
    """GPU bytes of the loss head's forward + backward for a microbatch of ``tokens``: the normed hidden
    states and their gradient, and two chunks of fp32 logits (the chunk and its gradient)."""
    return float(tokens * 3 * shape.hidden * e + 2 * min(tokens, loss_chunk_tokens(shape.vocab)) * shape.vocab * 4)


def optimizer_state_bytes(
    optim_state: str = "float32", master: str = "float32", master_rounding: str = "stochastic", block_size: int = 256
) -> float:
    """Host bytes per trainable parameter of ``roundpipe.optim.Adam``'s master and moments, for
    ``estimate(optimizer_bytes_per_param=...)``: the table of docs/optimizer.md ("Host bytes per
    parameter"), as ``roundpipe train --optim-state / --master / --master-rounding`` choose them. The
    default (fp32 master, fp32 moments) is 12; int8 moments with bfloat16 masters 4.03."""
    masters = {"float32": 4.0, "bfloat16": 2.0}
    moments = {"float32": 8.0, "bfloat16": 4.0, "int8": 2.0 + 2 * 4.0 / block_size}  # int8: an fp32 scale per block
    if master not in masters or optim_state not in moments:
        raise ValueError(f"optim_state={optim_state!r}, master={master!r}: expected {list(moments)}, {list(masters)}")
    kahan = 2.0 if master == "bfloat16" and master_rounding == "kahan" else 0.0
    return masters[master] + moments[optim_state] + kahan


def budgets(gpu_bytes: float, host_bytes: float) -> str:
    """``"80.0 GiB per GPU and 23.5 GiB of host memory"``: the budgets, written one way wherever they are
    printed (so one machine shows one host figure)."""
    return f"{gpu_bytes / GiB:.1f} GiB per GPU and {host_bytes / GiB:.1f} GiB of host memory"


def _pinned_block(nbytes: float) -> float:
    """The size torch's pinned caching allocator gives a request of ``nbytes``: the next power of two."""
    return float(1 << max(0, int(math.ceil(nbytes)) - 1).bit_length())


# budget.GPU_MARGIN_FRACTION, GPU_MARGIN_BYTES and DEVICE_SAVED_SHARE (copied so that the estimate imports
# no torch; a test keeps them equal): the room a one-GPU step keeps its stage inputs in.
GPU_MARGIN_FRACTION = 0.08
GPU_MARGIN_BYTES = 1 << 30
DEVICE_SAVED_SHARE = 0.75


def device_saved_room(gpu_bytes: float, step_gpu_bytes: float) -> float:
    """GPU bytes a one-GPU step may keep backward-stage inputs in (``RPP_DEVICE_SAVED_GB``: a number of
    GiB, or ``auto``: a share of the GPU budget less the step's own peak, as ``budget.device_saved_room``)."""
    from roundpipe import settings

    limit = settings.DEVICE_SAVED_GB.get()
    if limit is not None:
        return float(limit) * GiB
    return max(0.0, DEVICE_SAVED_SHARE * (gpu_bytes * (1 - GPU_MARGIN_FRACTION) - GPU_MARGIN_BYTES - step_gpu_bytes))


def job_io_bytes(shape: ModelShape, t: int, e: int = 2) -> float:
    """A job's bytes of ``t`` tokens besides its layers' activations: input, output gradient, the neighbours'
    hidden states in flight (``OVERLAP_TENSORS``), what passes along (rotary tables, position ids)."""
    return (2 + OVERLAP_TENSORS) * t * shape.hidden * e + t * side_bytes_per_token(shape, e)


def planned_layer_bytes(
    shape: ModelShape, t: int, tile: int, tiled: bool, e: int, whole: bool, extra: float, kv: float = 0.0,
    prefix: float = 0.0,
) -> Tuple[float, float]:
    """(kept, peak) of a decoder layer's job in the runtime's plan (``causal_lm.activation_profile``): the
    pre-attention graph as its margins were fitted (``pre_extra_per_token=None``), a tile's whole-sequence keys
    and values ``kv``, and at the peak ``prefix`` and :func:`job_io_bytes`."""
    kept, peak = decoder_layer_bytes(shape, t, tile, tiled, e, whole, extra, None)
    return kept + kv, peak + kv + prefix + job_io_bytes(shape, t, e)


def runtime_step_bytes(
    shape: ModelShape, t: int, tile: int, tiled: bool, b: int, lora_rank: int, lora_extra: float, g: int,
    layer_device: float, kv: float = 0.0, prefix: float = 0.0,
) -> float:
    """What the runtime takes from a GPU's budget before it keeps stage inputs there (``budget.device_saved_room``):
    twice the largest layer and its largest backward stage by :func:`planned_layer_bytes`, the first holding the
    embedding with ``g`` decoder layers (``planner.stage_weight_excess``)."""
    kept, peak = planned_layer_bytes(shape, t, tile, tiled, b, not lora_rank, lora_extra, kv, prefix)
    embed = shape.vocab * shape.hidden * b * (1 if lora_rank else 2)  # with its gradient in a full fine-tune
    largest = max(layer_device, embed)
    first = (g - 1) * kept + peak + 2 * max(0.0, g * layer_device + embed - largest)
    head = head_activation_bytes(shape, t, b) + job_io_bytes(shape, t, b)
    return 2 * largest + max(first, head)


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
    """
    if seq_len < 1 or batch_size < 1 or microbatches < 1 or layers_per_stage < 1 or devices < 1 or sequence_tiles < 1:
        raise ValueError(
            "seq_len, batch_size, microbatches, layers_per_stage, devices and sequence_tiles must be positive"
        )
    if recompute_grain not in ("stage", "layer"):
        raise ValueError(f"recompute_grain={recompute_grain!r}: expected 'stage' or 'layer'")
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
    trainable_layer = shape.lora_params(lora_rank) if lora_rank else shape.layer_params()
    g = layers_per_stage
    weights = 2 * g * layer_w + g * trainable_layer * b  # the stage and the prefetched one; gradients
    # A LoRA model runs its layers module by module (PEFT's adapters), with fp32 adapters (PEFT's default).
    lora_extra = lora_bytes_per_token(shape, lora_rank, b) if lora_rank else 0.0
    lora_pre = lora_pre_attention_bytes_per_token(shape, lora_rank, b) if lora_rank else 0.0
    kept, peak = decoder_layer_bytes(shape, t, tile, tiled, b, not lora_rank, lora_extra, lora_pre)
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
    head_w += layer_w
    if stage + weights >= head + head_w:
        gpu = {"weights": float(weights), "activations": float(stage), "runtime": float(GPU_OVERHEAD_BYTES)}
    else:
        gpu = {"weights": float(head_w), "activations": float(head), "runtime": float(GPU_OVERHEAD_BYTES)}

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
    room = 0.0
    if devices == 1 and gpu_bytes is not None:  # a layer's weights and gradients (PEFT's adapters in fp32)
        layer_dev = layer_w + (8 * shape.lora_params(lora_rank) if lora_rank else trainable_layer * b)
        kv, prefix = sequence_kv(1) - sequence_kv(0), sequence_kv(0)
        step = runtime_step_bytes(shape, t, tile, tiled, b, lora_rank, lora_extra, g, layer_dev, kv, prefix)
        # Where this estimate's count of the step is the larger, the inputs fill only what it leaves.
        room = min(device_saved_room(gpu_bytes, step), max(0.0, gpu_bytes - sum(gpu.values())))
    # The runtime charges each input the rotary tables and position ids it carries (shared by all stages).
    on_gpu = min(boundaries * microbatches, int(room // (raw_input + side))) if raw_input > 0 else 0
    gpu["saved inputs"] = float(on_gpu * raw_input)
    checkpoints = (boundaries * microbatches - on_gpu) * per_microbatch + total_tokens * side_bytes_per_token(shape, b)
    parts = 1 if tiled_sequence else max(1, min(devices, microbatches))
    fused_trainable = shape.lora_params(lora_rank) if lora_rank else shape.layer_params() + shape.vocab * h
    host = {
        "weights": float(n * b),
        "optimizer": float(
            trainable * (optimizer_bytes_per_param + grad_buffers * b) + (parts - 1) * fused_trainable * b
        ),
        "checkpoints": float(checkpoints),
        "runtime": float(HOST_OVERHEAD_BYTES),
    }
    if tiled_sequence:  # each attention layer's keys and values: two host tensors, pinned blocks
        per_tensor = batch_size * seq_len * shape.kv_dim * b
        host["keys/values"] = float(2 * shape.layers * (_pinned_block(per_tensor) if pinned else per_tensor))
    per_token_gpu = gpu["activations"] / t
    per_token_host = checkpoints / total_tokens
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
    )


def longest_context(
    shape: ModelShape,
    gpu_bytes: float,
    host_bytes: float,
    batch_size: int = 1,
    lora_rank: int = 0,
    max_layers_per_stage: int = 4,
    **kwargs: Any,
) -> Tuple[int, Optional[Estimate]]:
    """The longest sequence (a multiple of 1024) whose step fits ``gpu_bytes`` per GPU and ``host_bytes``,
    over backward stages of 1 to ``max_layers_per_stage`` decoder layers; with the estimate that fits."""
    best: Tuple[int, Optional[Estimate]] = (0, None)
    for g in range(1, max_layers_per_stage + 1):

        def fits(seq: int, g: int = g) -> Optional[Estimate]:
            e = estimate(shape, seq, batch_size, lora_rank, layers_per_stage=g, gpu_bytes=gpu_bytes, **kwargs)
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


def describe_fit(shape: ModelShape, gpu_bytes: float, host_bytes: float, **kwargs: Any) -> List[str]:
    """Lines saying the longest context that fits these budgets and how (for ``roundpipe plan``)."""
    seq, e = longest_context(shape, gpu_bytes, host_bytes, **kwargs)
    if e is None:
        return [f"no sequence of 1,024 tokens or more fits {budgets(gpu_bytes, host_bytes)}"]
    return [
        f"longest context that fits {budgets(gpu_bytes, host_bytes)}: {seq:,} tokens "
        f"({e.layers_per_stage} decoder layer(s) per backward stage)"
    ]
