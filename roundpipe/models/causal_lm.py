"""``RoundPipeForCausalLM``: a Hugging Face causal LM run through a RoundPipe sequential preset."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from roundpipe import settings
from roundpipe.models import fused_ops, kernels, lora, sequence_inputs, tiling
from roundpipe.models.inputs import CausalLMInputs, takes_inputs
from roundpipe.models.kernels import FusedKernels
from roundpipe.models.preset import CausalLMPreset
from roundpipe.planning import budget, estimate, memory_terms
from roundpipe.roundpipe import RoundPipe
from roundpipe.runtime.batch import Batch
from roundpipe.runtime.run_config import RoundPipeRunConfig

_KW = inspect.Parameter.KEYWORD_ONLY
# RoundPipe's per-call run configuration, after the causal-LM arguments.
_RUN_CONFIG = inspect.Parameter(
    "roundpipe_run_config", _KW, default=RoundPipeRunConfig(), annotation=RoundPipeRunConfig
)
_RUN_CONFIG_TRAIN = inspect.Parameter("run_config", _KW, default=RoundPipeRunConfig(), annotation=RoundPipeRunConfig)
# train_step's hook on each microbatch loss before backward (e.g. GradScaler.scale).
_SCALE_LOSS = inspect.Parameter(
    "scale_loss", _KW, default=None, annotation=Optional[Callable[[torch.Tensor], torch.Tensor]]
)
# Hugging Face arguments accepted and ignored when unset (use_cache=False, return_dict, ...).
_HF_ONLY = inspect.Parameter("unused", inspect.Parameter.VAR_KEYWORD, annotation=Any)
# Hugging Face flags that change nothing here when off (no cache, no attentions or hidden states kept);
# return_dict changes nothing either way (the output is always a ModelOutput).
_HF_FLAGS = ("use_cache", "output_attentions", "output_hidden_states")
# train_step's positional order (labels third, as `train_step(ids, mask, labels)` calls pass them); it
# always computes the loss without logits, so return_logits and logits_to_keep are not among them.
_TRAIN_STEP_ARGS = (
    "input_ids",
    "attention_mask",
    "labels",
    "position_ids",
    "inputs_embeds",
    "shift_labels",
    "output_router_logits",
    "loss_chunk_size",
    "num_items_in_batch",
)


@takes_inputs(extra=(_HF_ONLY,))
def _bind_hf_call(_owner: Any, inputs: CausalLMInputs, unused: Dict[str, Any]) -> CausalLMInputs:
    """The :class:`CausalLMInputs` of a Hugging Face style call (positional or keyword arguments)."""
    if unused.get("past_key_values") is not None or unused.get("use_cache"):
        raise NotImplementedError("RoundPipeForCausalLM does not support a KV cache (use_cache / past_key_values)")
    extra = {k for k, v in unused.items() if v is not None and k != "return_dict" and not (k in _HF_FLAGS and not v)}
    if extra:
        raise TypeError(f"RoundPipeForCausalLM: unsupported arguments {sorted(extra)}")
    return inputs


def _default_loss(output: Any, _label: Any) -> torch.Tensor:
    """``forward_backward``'s default ``loss_fn``: the microbatch's Hugging Face loss."""
    if output.loss is None:
        raise ValueError(
            "forward_backward: no labels in input_kwargs, so the model computes no loss; pass labels there or a loss_fn"
        )
    return output.loss


class RoundPipeForCausalLM(RoundPipe):
    """A ``*ForCausalLM`` (or a PEFT model around one) as a RoundPipe over its preset layers.

    The layers are ``prefix (embedding, rotary, masks) -> decoder layers -> head (norm, chunked loss)``
    and share the model's parameters. Attribute access falls through to the original model, so
    ``config``, ``generation_config``, ``loss_function``, ``vocab_size`` and ``save_pretrained`` (of the
    adapter, for a PEFT model) work.

    Build it with :func:`roundpipe.models.wrap_model` (or ``wrap_model_to_roundpipe``).

    ``fused_kernels`` (True, False, ``"auto"``; None: ``$RPP_DEBUG_FUSED_KERNELS``, default ``auto`` = on for
    GPUs with torch.compile) turns on the fused norm / rotary / SwiGLU kernels of
    :mod:`roundpipe.models.kernels` for presets that support them (Qwen3, Llama); when given, it
    overrides the choice the preset was built with.
    """

    def __init__(
        self,
        model: nn.Module,
        preset: Optional[CausalLMPreset] = None,
        fused_kernels: FusedKernels = None,
        **roundpipe_kwargs: Any,
    ) -> None:
        if preset is None:
            from roundpipe.models.registry import build_preset

            preset = build_preset(model)
        if fused_kernels is not None:
            preset.set_fused_kernels(fused_kernels)
        roundpipe_kwargs.setdefault("name", type(preset.model).__name__)
        super().__init__(preset.layers, **roundpipe_kwargs)
        self._preset = preset
        self.set_original_model(model)

    @property
    def preset(self) -> CausalLMPreset:
        return self._preset

    def activation_profile(self, batch: Batch, recompute_grain: str) -> Optional[budget.ActivationProfile]:
        """What a training call over ``batch`` keeps per layer (``roundpipe.planning.budget``), from the model's
        dimensions (``roundpipe.planning.estimate``): the prefix and the head keep little, each decoder layer
        what its (tiled) recompute and backward hold; the host keeps every backward stage's input.
        None when the batch has no ``[rows, seq]`` token input to size it by."""
        sizes = []
        for m in range(batch.num_microbatch):
            args, kwargs = batch.stage_input(m)
            x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
            if not isinstance(x, torch.Tensor) or x.dim() < 2:
                return None
            sizes.append((int(x.shape[0]), int(x.shape[1])))
        rows, seq = max(sizes)
        total = sum(r * s for r, s in sizes)
        try:
            shape = estimate.ModelShape.from_config(self.preset.model.config)
        except (AttributeError, TypeError, ValueError):  # not a layout the estimate models
            return None
        tile = settings.SEQ_TILE.get()
        decoder = [i for i, layer in enumerate(self.layers) if hasattr(layer, "layer")]
        tileable = {i: tiling.tileable(self.layers[i].layer) for i in decoder}
        # A layer whose LoRA adapters run fused inside the whole-layer op is still planned as run module by
        # module (with what its adapters save) at its peak: measured on one H200 (qwen3-1.7b-shaped layer, LoRA
        # r16 on every projection, 16K tokens), the compiled fused layer's forward + backward peaked at 3.36 GiB
        # against 2.74 GiB module by module, above the whole-layer count (fitted to full fine-tunes). What it
        # keeps for its backward is the op's own count (``memory_terms.fused_lora_kept_bytes_per_token``: a third
        # of the modules' compiled, two thirds eager), which sizes the stages a call keeps.
        # With FP8 GEMMs over an fp8 base the op saves the same: its inputs' quantization keeps no float32 copy,
        # and the transposed fp8 weight of its input-gradient GEMM is made in the backward (``fp8.grad_input_mm``).
        adapted = {
            i: kernels.runs_whole_layer(self.layers[i].layer) and lora.has_adapters(self.layers[i].layer)
            for i in decoder
        }
        whole = {i: kernels.runs_whole_layer(self.layers[i].layer) and not adapted[i] for i in decoder}
        compiled = _whole_layer_compiled()
        # What the layers' trainable parts save: a walk over every module (~0.5 ms a layer), done once
        # per model, as ``layer_device_bytes`` counts gradients once (what trains is fixed by then).
        walked = self.__dict__.get("_trainable_parts")
        if walked is None:
            walked = self.__dict__["_trainable_parts"] = {i: _extra_parts(self.layers[i].layer, shape) for i in decoder}
        extra = {i: w[0] for i, w in walked.items()}  # _module_extra_per_token
        adapters = {i: (w[2], w[3]) for i, w in walked.items()}  # _fused_adapter_bytes
        e = next((p.element_size() for p in self.preset.model.parameters() if p.is_floating_point()), 2)
        mode = getattr(batch, "stage_inputs", "bf16")  # the call's RoundPipeRunConfig.stage_inputs

        def profile(seq_len: int) -> budget.ActivationProfile:
            t = rows * seq_len
            tokens = total * seq_len // seq
            kept, peak, checkpoint = [0.0] * self.num_layers, [0.0] * self.num_layers, [0.0] * self.num_layers
            io = memory_terms.job_io_bytes(shape, t, e)  # input, output gradient, neighbours' in flight, side tensors
            # Tiles of one sequence: each layer's keys and values over the whole sequence stay on the job's
            # device (with float32 gradient accumulators in backward), and a tile's attention reads
            # [prefix, tile] keys and values repeated to the query heads (``roundpipe.runtime.sequence``).
            kv = prefix = 0.0
            if batch.sequence_tiles > 1:
                whole_tokens = rows * seq_len * len(sizes)
                kv = whole_tokens * shape.kv_dim * 2 * (e + 4)
                prefix = whole_tokens * 2 * (2 * shape.q_dim + shape.kv_dim) * e
            for i in decoder:
                tiled = tileable[i] and tile > 0 and t > tile
                # The pre-attention graph as the runtime's budget margins were fitted, not what PEFT's adapters
                # add to it (``memory_terms.planned_layer_bytes``; ``roundpipe plan`` counts that).
                # Sequence tiles run the layer's modules (a tile's attention reads the earlier tiles'), not the op.
                own = None
                if adapted[i] and batch.sequence_tiles <= 1:
                    own = memory_terms.fused_lora_kept_bytes_per_token(
                        shape, adapters[i][0], e, compiled, adapters[i][1]
                    )
                kept[i], peak[i] = memory_terms.planned_layer_bytes(
                    shape, t, tile, tiled, e, whole[i], extra[i], kv, prefix, own
                )
                # The host copy of a stage input per microbatch (bf16, or a compact payload and scales) from torch's
                # pinned caching allocator, which rounds each block up to a power of two.
                checkpoint[i] = len(sizes) * memory_terms.pinned_checkpoint_bytes(shape, rows * seq_len, e, mode)
            head = self.num_layers - 1
            peak[head] = memory_terms.head_activation_bytes(shape, t, e) + io
            checkpoint[head] = checkpoint[decoder[-1]] if decoder else 0.0
            peak[0] = io
            return budget.ActivationProfile(kept, peak, checkpoint, tokens, seq_len, profile)

        return profile(seq)

    @takes_inputs(extra=(_RUN_CONFIG, _HF_ONLY))
    def forward(self, inputs: CausalLMInputs, roundpipe_run_config: RoundPipeRunConfig, unused: Dict[str, Any]) -> Any:
        """Like the Hugging Face model's forward (arguments: :class:`~roundpipe.models.inputs.CausalLMInputs`);
        returns ``CausalLMOutputWithPast`` (MoE: ``MoeCausalLMOutputWithPast``) whose loss equals the
        unsplit model's (normalised by ``num_items_in_batch`` when given, as Hugging Face does).

        Differences: ``return_logits`` defaults to False when labels are given (the loss never needs
        full logits); no KV cache (``use_cache`` and ``past_key_values`` must be unset). With gradients
        enabled, ``output.loss.backward()`` runs the pipelined backward.
        """
        _bind_hf_call(None, **unused)  # the checks of the Hugging Face-only arguments
        kwargs = self._preset.layer_kwargs(inputs)
        tiles = sequence_inputs.tiles_of(roundpipe_run_config, self.model_run_config)
        if tiles > 1:  # one sequence over the pool (roundpipe.runtime.sequence)
            kwargs, roundpipe_run_config = sequence_inputs.tile_call(
                kwargs, roundpipe_run_config, tiles, self._preset.model.config
            )
        merged = super().forward(roundpipe_run_config=roundpipe_run_config, **kwargs)
        return self._preset.build_output(merged, inputs.loss_divisor())

    def forward_backward(
        self,
        input_args: Tuple[Any, ...] = (),
        input_kwargs: Dict[str, Any] = {},  # noqa: B006 - the spec's signature; never mutated
        label: Any = None,
        loss_fn: Optional[Callable[[Any, Any], Union[Sequence[torch.Tensor], torch.Tensor]]] = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    ) -> Any:
        """Forward, loss and backward in one pipelined pass, called with the Hugging Face model's
        arguments (``input_kwargs={"input_ids": ..., "attention_mask": ..., "labels": ...,
        "num_items_in_batch": ...}``).

        ``loss_fn(output, label_m)`` receives each microbatch's Hugging Face output
        (``CausalLMOutputWithPast``; see :meth:`CausalLMPreset.build_output`): ``output.loss`` when
        labels are in ``input_kwargs`` (that microbatch's mean loss, or its loss sum over
        ``num_items_in_batch``), ``output.logits`` when ``return_logits`` is set or no labels are
        given. The default ``loss_fn`` returns ``output.loss``. Returns the sum of the microbatch losses
        (and the whole batch's output when ``return_outputs``). :meth:`train_step` is the faster path
        for the usual loss (no logits).

        ``input_kwargs`` made by ``preset.forward_kwargs`` (the first layer's arguments, with
        ``options``) run as a plain :meth:`RoundPipe.forward_backward`: ``loss_fn`` gets the head's dict.
        """
        if "options" in input_kwargs and not input_args:
            return super().forward_backward(
                input_kwargs=input_kwargs,
                label=label,
                loss_fn=loss_fn or (lambda out, _: out),
                return_outputs=return_outputs,
                run_config=run_config,
            )
        if not isinstance(input_args, tuple):
            input_args = (input_args,)
        inputs = _bind_hf_call(None, *input_args, **input_kwargs)
        preset, divisor = self._preset, inputs.loss_divisor()
        user_fn = loss_fn if loss_fn is not None else _default_loss

        def hf_loss_fn(outputs: Dict[str, torch.Tensor], label_m: Any) -> Any:
            return user_fn(preset.build_output(outputs, divisor), label_m)

        result = super().forward_backward(
            input_kwargs=preset.layer_kwargs(inputs),
            label=label,
            loss_fn=hf_loss_fn,
            return_outputs=return_outputs,
            run_config=run_config,
        )
        if return_outputs:
            loss, merged = result
            return loss, preset.build_output(merged, divisor) if isinstance(merged, dict) else merged
        return result

    @takes_inputs(_TRAIN_STEP_ARGS, extra=(_RUN_CONFIG_TRAIN, _SCALE_LOSS))
    def train_step(
        self,
        inputs: CausalLMInputs,
        run_config: RoundPipeRunConfig,
        scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]],
    ) -> torch.Tensor:
        """Forward + backward of the batch loss in one pipelined pass (``forward_backward``), without
        logits (the chunked loss of :mod:`roundpipe.models.loss`).

        Gradients accumulate into ``.grad`` like ``loss.backward()``; the (detached) loss is returned.
        Each microbatch's loss sum is divided by the token count of the whole batch (or by
        ``num_items_in_batch``: the sum over a gradient accumulation step's batches, as Hugging Face
        normalises), so loss and gradients equal the unsplit model's. ``scale_loss`` is applied to each
        microbatch's loss before its backward (``scale_loss=scaler.scale`` with a
        :class:`roundpipe.GradScaler`, or a factor for gradient accumulation); the return value is then
        the sum of the scaled losses. MoE: the router aux loss is per microbatch here (see
        :meth:`CausalLMPreset.microbatch_loss_fn`); ``forward(labels=...).loss.backward()`` uses the
        whole batch's.
        """
        if inputs.labels is None and inputs.shift_labels is None:
            raise ValueError("train_step needs labels (or shift_labels)")
        kwargs = self._preset.layer_kwargs(dataclasses.replace(inputs, return_logits=False, logits_to_keep=0))
        tiles = sequence_inputs.tiles_of(run_config, self.model_run_config)
        if tiles > 1:
            # Tiles of one sequence: every tile's forward before any backward (roundpipe.runtime.sequence), so the
            # forward, then the backward of the whole loss.
            kwargs, cfg = sequence_inputs.tile_call(kwargs, run_config, tiles, self._preset.model.config)
            merged = RoundPipe.forward(self, roundpipe_run_config=cfg, **kwargs)
            loss = self._preset.build_output(merged, inputs.loss_divisor()).loss
            if scale_loss is not None:
                loss = scale_loss(loss)
            loss.backward()
            return loss.detach()
        base = self._preset.microbatch_loss_fn(kwargs, inputs.loss_divisor())
        loss_fn = base if scale_loss is None else (lambda outputs, label: scale_loss(base(outputs, label)))
        return self.forward_backward(input_kwargs=kwargs, loss_fn=loss_fn, run_config=run_config)


__all__ = ["RoundPipeForCausalLM"]


def _module_extra_per_token(layer: nn.Module, shape: estimate.ModelShape) -> float:
    """Bytes per token a decoder layer run module by module saves beyond
    ``memory_terms.module_layer_bytes_per_token``, from what is trainable: a projection's input when its
    weight is trainable or a PEFT LoRA adapter of the layer's dtype reads it (q / k / v share one input,
    gate / up another); an adapter of another dtype (PEFT upcasts adapters to fp32 by default) saves its
    own cast copy instead; each adapter's ``lora_A`` output; with trainable norm weights, each norm's
    normed output (kept for the weight's gradient)."""
    return _extra_parts(layer, shape)[0]


def _whole_layer_compiled() -> bool:
    """Whether the whole-layer op runs compiled: compiling is on, it has compiled for a device and never failed.
    Before its first call (the plan of the first training call) it counts as eager, which keeps more: a compile
    that fails there falls back to eager inside a plan sized for it; a later call plans by the compiled count."""
    op = fused_ops.DECODER_LAYER
    return fused_ops.compile_enabled() and bool(op.compiled) and not op.failed


def _fused_adapter_bytes(layer: nn.Module, shape: estimate.ModelShape) -> Tuple[float, bool]:
    """(bytes per token of what a layer's trainable parts add to the whole-layer op's saved tensors, whether an
    adapter has the layer's dtype), see ``memory_terms.fused_lora_kept_bytes_per_token``: each active LoRA
    adapter's rank-r product ``x A^T`` in its dtype, and each trainable norm's normed output (kept for the
    weight's gradient). From the same walk as ``_module_extra_per_token``."""
    parts = _extra_parts(layer, shape)
    return parts[2], parts[3]


def _pre_attention_extra_per_token(layer: nn.Module, shape: estimate.ModelShape) -> float:
    """The part of ``_module_extra_per_token`` that the q / k / v projections and the input norm save: what
    the pre-attention graph a tiled recompute keeps holds besides q, k and v (``memory_terms.decoder_layer_bytes``)."""
    return _extra_parts(layer, shape)[1]


def _extra_parts(layer: nn.Module, shape: estimate.ModelShape) -> Tuple[float, float, float, bool]:
    """(the whole layer's extra bytes per token, the pre-attention part's), see ``_module_extra_per_token``; then
    what the whole-layer op adds to its saved tensors and whether an adapter has the layer's dtype, see
    ``_fused_adapter_bytes``."""
    shared = {
        "q_proj": "attention input",
        "k_proj": "attention input",
        "v_proj": "attention input",
        "gate_proj": "mlp input",
        "up_proj": "mlp input",
    }
    inputs: Dict[str, float] = {}  # input group -> bytes per token of the one saved copy
    extra = pre = fused = 0.0
    layer_dtype = False
    for name, module in layer.named_modules():
        parts = name.split(".")
        if any(p.startswith("lora_") or p == "base_layer" for p in parts):
            continue  # inside a PEFT wrapper: counted with the wrapper
        group = shared.get(parts[-1], name)
        lora_a = getattr(module, "lora_A", None)
        base_weight = getattr(getattr(module, "base_layer", None), "weight", None)
        if isinstance(lora_a, nn.ModuleDict) and isinstance(base_weight, torch.Tensor):
            width, size = base_weight.shape[1], base_weight.element_size()
            if base_weight.requires_grad:
                inputs[group] = float(width * size)
            for adapter in getattr(module, "active_adapters", list(lora_a.keys())):
                a = lora_a[adapter] if adapter in lora_a else None
                if not isinstance(a, nn.Linear):
                    continue
                own = a.out_features * a.weight.element_size()
                fused += own
                layer_dtype |= a.weight.dtype == base_weight.dtype
                if a.weight.dtype != base_weight.dtype and getattr(module, "cast_input_dtype_enabled", True):
                    own += a.in_features * a.weight.element_size()
                else:
                    inputs[group] = float(width * size)
                extra += own
                pre += own if group == "attention input" else 0.0
        elif isinstance(module, nn.Linear) and module.weight.requires_grad:
            inputs[group] = float(module.in_features * module.weight.element_size())
    attn = getattr(layer, "self_attn", None)
    norms = [
        (getattr(layer, "input_layernorm", None), shape.hidden),
        (getattr(layer, "post_attention_layernorm", None), shape.hidden),
    ]
    norms += [(getattr(attn, "q_norm", None), shape.q_dim), (getattr(attn, "k_norm", None), shape.kv_dim)]
    for k, (norm, width) in enumerate(norms):
        w = getattr(norm, "weight", None)
        if isinstance(w, torch.Tensor) and w.requires_grad:
            extra += width * w.element_size()
            fused += width * w.element_size()
            pre += width * w.element_size() if k != 1 else 0.0
    return extra + sum(inputs.values()), pre + inputs.get("attention input", 0.0), fused, layer_dtype
