"""What one training step keeps, term by term: the dimensions of a decoder-only causal LM (``ModelShape``)
and the bytes each part of a step holds per layer and per token (a decoder layer's recompute and backward,
the checkpoints, the LoRA adapters, the loss head, the optimizer state, the room the runtime keeps stage
inputs in). ``roundpipe.planning.estimate`` adds them up into a step's peak GPU and host memory; the
constants fitted to measured peaks live here beside the terms they complete.

Nothing here imports torch: the terms repeat a few of the runtime's constants, and tests keep them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from roundpipe import flavors
from roundpipe.utils import GiB

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
    experts: int = 0
    """Experts per layer of a mixture of experts (``num_local_experts`` / ``num_experts``); 0: a dense MLP. A
    mixture's ``intermediate`` is then its routed width per token, ``top_k * expert_intermediate``: what its
    activations and FLOPs scale with, modelled as one dense MLP of that width."""
    expert_intermediate: int = 0
    """One expert's MLP width (``moe_intermediate_size``, GPT-OSS ``intermediate_size``)."""
    biases: bool = False
    """GPT-OSS's layout: biases on the attention projections, the router and the experts, one attention sink
    per head, and no q / k norms."""

    BUILTIN = flavors.BUILTIN
    """The shapes known by name: the flavors of ``roundpipe.flavors`` (Qwen3, Llama-3.1)."""

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
        intermediate, experts, expert_intermediate = int(config.intermediate_size), 0, 0
        n = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        if n:
            kind = getattr(config, "model_type", None)
            if kind not in ("qwen3_moe", "gpt_oss"):
                raise ValueError(f"model_type {kind!r}: the mixtures of experts modelled are Qwen3-MoE and GPT-OSS")
            if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", None) or 1) != 1:
                raise ValueError("dense MLP layers among the expert layers (mlp_only_layers, decoder_sparse_step)")
            experts = int(n)
            expert_intermediate = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
            intermediate = int(config.num_experts_per_tok) * expert_intermediate
        return cls(
            hidden=hidden,
            intermediate=intermediate,
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            experts=experts,
            expert_intermediate=expert_intermediate,
            biases=experts > 0 and getattr(config, "model_type", None) == "gpt_oss",
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP or router and experts, norms incl. q/k norms)."""
        attn = self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + self.q_dim * self.hidden
        if not self.experts:
            return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim
        e, w = self.experts, self.expert_intermediate
        moe = self.hidden * e + 3 * e * self.hidden * w  # the router, each expert's gate, up and down
        if self.biases:  # projection and router biases, sinks; each expert's gate / up and down biases
            attn += self.q_dim + 2 * self.kv_dim + self.hidden + self.heads
            moe += e + e * (2 * w + self.hidden)
        else:
            attn += 2 * self.head_dim  # q / k norms
        return attn + moe + 2 * self.hidden

    def projections(self) -> List[Tuple[int, int]]:
        """(in, out) features of a decoder layer's seven projections: q, k, v, o, gate, up, down."""
        return [
            (self.hidden, self.q_dim),
            (self.hidden, self.kv_dim),
            (self.hidden, self.kv_dim),
            (self.q_dim, self.hidden),
            (self.hidden, self.intermediate),
            (self.hidden, self.intermediate),
            (self.intermediate, self.hidden),
        ]

    def lora_params(self, rank: int) -> int:
        """LoRA parameters of one decoder layer with adapters on all seven projections; a mixture of experts: on
        q, k, v, o and every expert's two weights as PEFT's ``target_parameters`` adapts them (rank x experts
        rows: gate-up [hidden, 2 x width], down [width, hidden])."""
        if not self.experts:
            return sum(rank * (a + b) for a, b in self.projections())
        w = self.expert_intermediate
        attn = sum(rank * (a + b) for a, b in self.projections()[:4])
        return attn + rank * self.experts * ((self.hidden + 2 * w) + (w + self.hidden))

    def params(self) -> int:
        """All parameters (embedding, layers, final norm, output head unless tied)."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden


def decoder_layer_bytes(
    shape: ModelShape,
    tokens: int,
    tile: int,
    tiled: bool,
    e: int = 2,
    whole_layer: bool = True,
    extra_per_token: float = 0.0,
    pre_extra_per_token: Optional[float] = None,
    kept_per_token: Optional[float] = None,
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
    ``roundpipe.models.causal_lm`` finds on the layer. ``kept_per_token`` (untiled, ``whole_layer=False``
    only) replaces that count in ``kept`` where the layer saves less than its modules would: a LoRA layer run as
    the whole-layer op (:func:`fused_lora_kept_bytes_per_token`); the peak stays the modules' count.

    Below ``PRE_TILES_IN_RECOMPUTE`` tiles the recompute keeps the pre-attention graph at full length
    (``roundpipe.models.tiling``): the compiled op's (the normed input, q and k) for a whole-layer op; run
    as modules, the q / k / v projections' outputs and what the projections and the input norm save
    (``pre_extra_per_token``: PEFT's fp32 adapters keep one cast copy of the input each; None counts the
    compiled op's graph, as the runtime's own plan does). That graph's
    backward then holds the gradients of the same tensors beside it. Measured on one H200 (qwen3-8b
    LoRA r=16, 131,072 tokens, a memory snapshot of the step): the adapters' three copies were 6.0 GiB of
    the 22.4 GiB peak, which the estimate had not counted. Each MLP tile's graph holds the same of the o / gate /
    up / down adapters for one tile (``extra_per_token - pre_extra_per_token``): at a 16,384-token tile of a
    70B layer (intermediate 28,672) 3.3 GiB, 0.6x the tile's own tensors.
    """
    n, h, q, k, i, a = tokens, shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads
    # What a post-attention tile's graph saves for the o / MLP projections' adapters (PEFT's fp32 casts of their
    # inputs, the lora_A outputs); None counts the compiled op's graph, as the runtime plans by.
    post_extra = 0.0 if whole_layer or pre_extra_per_token is None else extra_per_token - pre_extra_per_token
    attention = n * (e * (h + 4 * q + 4 * k) + 4 * q + 2 * e * q + 8 * a)
    kept = n * (e * (h + 2 * q + 2 * k) + 4 * a)
    if not tiled and not whole_layer:
        saved = n * (module_layer_bytes_per_token(shape, e) + extra_per_token)
        # The backward's transients beside what is saved: the attention's input / output gradients and
        # sdpa's fp32 dq, or the MLP's three intermediate-sized gradients.
        transient = n * max(e * (h + 2 * q + 2 * k) + 4 * q, e * (h + 3 * i))
        kept_bytes = saved if kept_per_token is None else n * kept_per_token
        return float(kept_bytes), float(saved + transient)
    if not tiled:
        full = n * e * (3 * i + 2 * h + q + k)
        return float(kept + full), float(attention + full)
    mlp_tile = mlp_tile_bytes(shape, n, tile, e, post_extra)
    if math.ceil(n / tile) >= PRE_TILES_IN_RECOMPUTE:
        return float(kept), float(max(attention, mlp_tile))
    if whole_layer or pre_extra_per_token is None:
        # The compiled op's graph; also what the runtime plans by (``pre_extra_per_token=None``, see
        # ``roundpipe.models.causal_lm``): its budget margins were fitted with this count.
        pre = n * e * (h + q + k)
    else:
        pre = n * (pre_extra_per_token + e * (q + 2 * k))
    return float(kept + pre), float(max(attention, mlp_tile) + pre)


def mlp_tile_bytes(shape: ModelShape, tokens: int, tile: int, e: int = 2, post_extra_per_token: float = 0.0) -> float:
    """GPU bytes of a tiled layer's backward while it back-propagates one post-attention tile: the full-length
    tensors the attention's backward still needs (the input, q, k, v, its output and that output's gradient) and
    one tile's graph of the o projection, the norm and the MLP with its gradients; ``post_extra_per_token``: what
    the o / gate / up / down projections' adapters save per token of the tile (see :func:`decoder_layer_bytes`)."""
    h, q, k, i, a = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads
    full = tokens * (e * (h + 3 * q + 2 * k) + 4 * a)
    return float(full + min(tile, tokens) * (e * (5 * i + 4 * h) + post_extra_per_token))


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


def fused_lora_bytes_per_token(shape: ModelShape, rank: int, e: int = 2, adapter_bytes: int = 4) -> Tuple[float, float]:
    """(all seven, the q / k / v share) of what LoRA adapters save per token inside the fused layer ops (the fused
    LoRA linear, ``roundpipe.models.lora``; GPUs with Triton): each projection's input in the layer's dtype, the
    one tensor its projections share (the normed attention input, the normed MLP input, the down projection's
    input; the o projection's is the attention output the tiled part keeps anyway), and each adapter's rank-``r``
    product ``x A^T`` in the adapters' dtype; no fp32 copy (the backward casts again). The counterpart of
    :func:`lora_bytes_per_token` and :func:`lora_pre_attention_bytes_per_token`, for the tiled terms."""
    h, i = shape.hidden, shape.intermediate
    pre = e * h + 3 * rank * adapter_bytes
    return float(pre + e * (h + i) + 4 * rank * adapter_bytes), float(pre)


def fused_lora_kept_bytes_per_token(
    shape: ModelShape, adapters: float, e: int = 2, compiled: bool = True, layer_dtype_adapters: bool = False
) -> float:
    """Bytes per token a LoRA decoder layer run as the whole-layer op (``fused_ops.decoder_layer`` with the fused
    LoRA linear) saves for its backward, its weights and the rotary tables aside (its input included: a bound of
    the kept graph, which the stage's first layer shares with the stage input); ``adapters``: what its adapters'
    rank-``r`` products ``x A^T`` take per token (:func:`lora_products_per_token`) and the outputs of any trainable
    norms; ``layer_dtype_adapters``: some adapter has the layer's dtype (PEFT upcasts them to fp32 by default).

    Compiled, the op saves its input, the o projection's residual sum (``2*e*H``), q before and after its norm and
    rotary and the attention output (``3*e*Q``), k likewise and v (``3*e*K``), the gate and up projections' outputs
    (``2*e*I``), the norms' inverse RMS and sdpa's log-sum-exp (fp32), and the products; it recomputes the normed
    inputs and the SwiGLU product in the backward, except with adapters of the layer's dtype (then the two normed
    inputs and the down projection's input stay: ``e*(2H + I)`` more). Eager it saves each norm's input cast to
    fp32 instead (``4*(2H + Q + K)``), the normed inputs, the attention output, q / k once, v, and all four of the
    MLP's ``I``-wide tensors, not its own input. FP8 GEMMs over an fp8 base save the same, compiled and eager
    (``fp8.quantize_rows`` makes no float32 copy of a projection's input for the graph to keep).

    Counted with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages) over one forward of a bf16 Qwen3
    layer, r=16 on all seven projections, 256 and 512 tokens, CPU, torch 2.13, bytes per token (this formula gives
    each to the byte; the modules' count, PEFT's path, :func:`decoder_layer_bytes` with ``whole_layer=False``):

    ========================  ==========  =========  ======================  =============
    widths, adapters          compiled    eager      modules (PEFT), both    modules' term
    ========================  ==========  =========  ======================  =============
    qwen3-1.7b, fp32          51,816      98,920     152,168                 152,168
    qwen3-1.7b, bf16          72,072      98,696
    qwen3-8b, fp32            97,000      189,160    295,656                 295,656
    ========================  ==========  =========  ======================  =============

    Eager on CPU bounds eager on a GPU, where ``F.rms_norm`` saves its bf16 input and the inverse RMS instead of
    an fp32 copy. A full fine-tune's fused layer, by the same count: 71,848 / 137,512 compiled (its input
    included; :func:`decoder_layer_bytes`' whole-layer term, 67,648 / 129,152, leaves the input to the caller)."""
    h, q, k, i, a, kv = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate, shape.heads, shape.kv_heads
    small = 8 * a + 4 * kv + 8  # q / k norms' and the two layer norms' inverse RMS (fp32), sdpa's log-sum-exp
    if compiled:
        normed = e * (2 * h + i) if layer_dtype_adapters else 0
        return float(e * (2 * h + 3 * q + 3 * k + 2 * i) + normed + small + adapters)
    return float(e * (2 * h + 2 * q + 2 * k + 4 * i) + 4 * (2 * h + q + k) + small + adapters)


def lora_products_per_token(rank: int, adapter_bytes: int = 4, projections: int = 7) -> float:
    """Bytes per token of the rank-``rank`` products ``x A^T`` LoRA adapters on ``projections`` projections save
    (in the adapters' dtype: fp32 by PEFT's default)."""
    return float(projections * rank * adapter_bytes)


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
    return sum(pinned_block(b) for b in checkpoint_parts(shape, tokens, e, stage_inputs))


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


def pinned_block(nbytes: float) -> float:
    """The size torch's pinned caching allocator gives a request of ``nbytes``: the next power of two."""
    return float(1 << max(0, int(math.ceil(nbytes)) - 1).bit_length())


# budget.GPU_MARGIN_FRACTION, GPU_MARGIN_BYTES, DEVICE_SAVED_SHARE and KEEP_SHARE (copied so that the estimate imports
# no torch; a test keeps them equal): the room a one-GPU step keeps its stage inputs in.
GPU_MARGIN_FRACTION = 0.08
GPU_MARGIN_BYTES = 1 << 30
DEVICE_SAVED_SHARE = 0.75
KEEP_SHARE = 0.9


def device_saved_room(gpu_bytes: float, step_gpu_bytes: float) -> float:
    """GPU bytes a one-GPU step may keep backward-stage inputs in (``RPP_DEBUG_DEVICE_SAVED_GB``: a number of
    GiB, or ``auto``: a share of the GPU budget less the step's own peak, as ``budget.device_saved_room``)."""
    from roundpipe import settings

    limit = settings.DEBUG_DEVICE_SAVED_GB.get()
    if limit is not None:
        return float(limit) * GiB
    return _share_of_room(DEVICE_SAVED_SHARE, gpu_bytes, step_gpu_bytes)


def device_keep_room(gpu_bytes: float, step_gpu_bytes: float) -> float:
    """GPU bytes a one-GPU step may keep backward stages' graphs and inputs in (``budget.device_keep_room``, the
    forward groups taken as one layer each)."""
    return _share_of_room(KEEP_SHARE, gpu_bytes, step_gpu_bytes)


def _share_of_room(share: float, gpu_bytes: float, step_gpu_bytes: float) -> float:
    """``share`` of what a GPU of ``gpu_bytes`` leaves beside its margins and the step's own peak."""
    return max(0.0, share * (gpu_bytes * (1 - GPU_MARGIN_FRACTION) - GPU_MARGIN_BYTES - step_gpu_bytes))


def job_io_bytes(shape: ModelShape, t: int, e: int = 2) -> float:
    """A job's bytes of ``t`` tokens besides its layers' activations: input, output gradient, the neighbours'
    hidden states in flight (``OVERLAP_TENSORS``), what passes along (rotary tables, position ids)."""
    return (2 + OVERLAP_TENSORS) * t * shape.hidden * e + t * side_bytes_per_token(shape, e)


def planned_layer_bytes(
    shape: ModelShape,
    t: int,
    tile: int,
    tiled: bool,
    e: int,
    whole: bool,
    extra: float,
    kv: float = 0.0,
    prefix: float = 0.0,
    kept_per_token: Optional[float] = None,
) -> Tuple[float, float]:
    """(kept, peak) of a decoder layer's job in the runtime's plan (``causal_lm.activation_profile``): the
    pre-attention graph as its margins were fitted (``pre_extra_per_token=None``), a tile's whole-sequence keys
    and values ``kv``, and at the peak ``prefix`` and :func:`job_io_bytes`; ``kept_per_token`` as in
    :func:`decoder_layer_bytes`."""
    kept, peak = decoder_layer_bytes(shape, t, tile, tiled, e, whole, extra, None, kept_per_token)
    return kept + kv, peak + kv + prefix + job_io_bytes(shape, t, e)


def runtime_step_bytes(
    shape: ModelShape,
    t: int,
    tile: int,
    tiled: bool,
    b: int,
    lora_rank: int,
    lora_extra: float,
    g: int,
    layer_device: float,
    kv: float = 0.0,
    prefix: float = 0.0,
    kept_per_token: Optional[float] = None,
) -> float:
    """What the runtime takes from a GPU's budget before it keeps stage inputs there (``budget.device_saved_room``):
    twice the largest layer and its largest backward stage by :func:`planned_layer_bytes`; ``kept_per_token`` as in
    :func:`decoder_layer_bytes`.

    The runtime's planner makes as many backward stages as the host allows (``planner._activation_partition``).
    With one decoder layer per stage (``g == 1``) that is every layer alone, the embedding a stage of its own; with
    more the embedding joins the first stage, whose input then needs no checkpoint, and its weights count against
    that stage's activations (``planner.stage_weight_excess``)."""
    kept, peak = planned_layer_bytes(shape, t, tile, tiled, b, not lora_rank, lora_extra, kv, prefix, kept_per_token)
    embed = shape.vocab * shape.hidden * b * (1 if lora_rank else 2)  # with its gradient in a full fine-tune
    largest = max(layer_device, embed)
    with_embedding = embed if g > 1 else 0.0
    first = (g - 1) * kept + peak + 2 * max(0.0, g * layer_device + with_embedding - largest)
    head = head_activation_bytes(shape, t, b) + job_io_bytes(shape, t, b)
    return 2 * largest + max(first, head)
