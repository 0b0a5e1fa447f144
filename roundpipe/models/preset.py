"""Sequential preset for decoder-only causal LMs laid out ``model.embed_tokens -> model.layers ->
model.norm -> lm_head`` (Llama, Qwen2/3, Qwen3-MoE, GPT-OSS, Mistral, Phi-3, Gemma, ...).

A preset turns a Hugging Face ``*ForCausalLM`` into a list of layers RoundPipe can stream:

* :class:`CausalLMPrefix` -- token embedding, rotary position embeddings and the attention masks, built
  with transformers' own mask utilities exactly as the model's forward does. Masks and rotary tables are
  computed once per microbatch and reused by the backward recompute (``save_for_recompute``).
* :class:`DecoderLayerStage` -- one per decoder layer; calls the Hugging Face layer module itself, so the
  parameters (and any PEFT adapters inside) are the model's own, never copies.
* :class:`CausalLMHead` -- final norm, then the memory-light chunked loss (:mod:`roundpipe.models.loss`)
  and, only when asked for, logits.

Stages pass one dict (the "state") to each other: hidden states plus the small per-microbatch data the
later stages need (masks, rotary tables, labels, MoE router statistics). The head returns per-microbatch
sums (loss sum, token count, router statistics) that RoundPipe merges, and :class:`CausalLMPreset` turns
the merged sums into the loss of the whole batch, identical to the unsplit Hugging Face model's.

This module does not depend on the RoundPipe runtime; :mod:`roundpipe.models.causal_lm` wraps a preset into
a RoundPipe, and :mod:`roundpipe.models.families` says which spec each family gets.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from roundpipe import rope_scaling
from roundpipe.models import kernels, tiling
from roundpipe.models.inputs import BATCH_ARGS, CausalLMInputs, takes_inputs
from roundpipe.models.loss import (
    IGNORE_INDEX,
    causal_lm_loss,
    check_label_range,
    count_loss_tokens,
    shift_causal_labels,
)
from roundpipe.models.moe import (
    MoESpec,
    accumulate_router_stats,
    hook_routers,
    moe_spec,
    router_aux_loss,
    router_sink,
)
from roundpipe.runtime import sequence
from roundpipe.runtime.context import doing_recompute, get_recompute_data, save_for_recompute
from roundpipe.runtime.transfer import HostScalar

State = Dict[str, Any]

logger = logging.getLogger("roundpipe")


@dataclass(frozen=True)
class CausalLMSpec:
    """The per-family differences the preset needs; build one with :func:`default_spec`.

    Attributes:
        layer_types: Attention type per decoder layer, a key of :data:`MASK_FUNCTIONS`.
        mask_uses_position_ids: Whether the model passes ``position_ids`` to the mask functions (it
            detects packed sequences from them); GPT-OSS does not.
        embedding_multiplier: Multiplier applied to the input embeddings (Granite).
        logit_scale: Multiplier applied to the logits (Cohere ``logit_scale``, Granite ``1/logits_scaling``).
        softcap: Final logit soft-capping, ``config.final_logit_softcapping`` (Gemma 2).
        moe: Router aux-loss description for MoE models, None for dense ones.
        fused_kernels: Whether the family's decoder layers can use :mod:`roundpipe.models.kernels`
            (the families with ``fused_kernels`` classes in :data:`roundpipe.models.families.FAMILIES`).
    """

    layer_types: Tuple[str, ...]
    mask_uses_position_ids: bool = True
    embedding_multiplier: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    moe: Optional[MoESpec] = None
    fused_kernels: bool = False


def _mask_functions() -> Dict[str, Callable[..., Any]]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


MASK_FUNCTIONS = ("full_attention", "sliding_attention")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face ``*ForCausalLM`` inside a PEFT ``PeftModel`` (the model itself otherwise).

    The LoRA modules stay where PEFT injected them, inside the decoder layers.
    """
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def has_standard_layout(model: nn.Module) -> bool:
    """Whether ``model`` is laid out ``model.embed_tokens -> model.layers -> model.norm -> lm_head``
    with a shared ``model.rotary_emb`` (what this preset supports)."""
    base = getattr(model, "model", None)
    config = getattr(model, "config", None)
    return (
        config is not None
        and not getattr(config, "is_encoder_decoder", False)
        and isinstance(base, nn.Module)
        and isinstance(getattr(base, "embed_tokens", None), nn.Module)
        and isinstance(getattr(base, "layers", None), nn.ModuleList)
        and isinstance(getattr(base, "norm", None), nn.Module)
        and isinstance(getattr(base, "rotary_emb", None), nn.Module)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


def default_layer_types(config: Any) -> Tuple[str, ...]:
    """Attention type per layer as transformers' models choose it.

    ``config.layer_types`` when the config has it (Qwen2/3, GPT-OSS, ...); otherwise every layer is
    sliding-window when ``config.sliding_window`` is set (Mistral, Phi-3, Qwen3-MoE) and full otherwise.
    """
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return tuple(layer_types[:n])
    if getattr(config, "sliding_window", None) is not None:
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def default_spec(model: nn.Module, **overrides: Any) -> CausalLMSpec:
    """Spec of a standard-layout ``*ForCausalLM``; ``overrides`` replace fields (family hooks)."""
    model = unwrap_peft(model)
    if not has_standard_layout(model):
        raise NotImplementedError(
            f"{type(model).__name__}: no RoundPipe preset; expected model.embed_tokens -> model.layers -> "
            "model.norm -> lm_head with model.rotary_emb"
        )
    rotary_params = inspect.signature(model.model.rotary_emb.forward).parameters
    if "layer_type" in rotary_params:
        raise NotImplementedError(f"{type(model).__name__}: per-layer-type rotary embeddings are not supported")
    fields_ = dict(
        layer_types=default_layer_types(model.config),
        moe=moe_spec(model),
        softcap=getattr(model.config, "final_logit_softcapping", None),
    )
    fields_.update(overrides)
    spec = CausalLMSpec(**fields_)
    unknown = set(spec.layer_types) - set(MASK_FUNCTIONS)
    if unknown:
        raise NotImplementedError(f"{type(model).__name__}: attention types {sorted(unknown)} are not supported")
    return spec


# ---------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------


def _call_mask_function(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call a transformers mask function, adapting to its signature across 4.5x/5.x releases."""
    params = inspect.signature(fn).parameters
    if "inputs_embeds" not in params and "input_embeds" in params:
        kwargs["input_embeds"] = kwargs.pop("inputs_embeds")
    if "cache" in params:  # transformers >= 5.24 renamed it (past_key_values stays a deprecated alias)
        kwargs["cache"] = kwargs.pop("past_key_values", None)
    if "cache_position" in params:
        embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
        kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _saved_for_recompute() -> Optional[Tuple[Any, ...]]:
    """This layer's data from ``save_for_recompute`` when recomputing, else None (nothing saved: the
    data is computed again, which gives the same values)."""
    if not doing_recompute():
        return None
    try:
        return get_recompute_data()
    except RuntimeError:
        return None


#: Rotary variants whose tables depend on the sequence length alone (their ``inv_freq`` never changes in forward),
#: so :class:`CausalLMPrefix` may keep them for the next microbatch of the same length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: The longest sequence whose rotary tables the prefix keeps (two ``tokens x head_dim`` tensors per device: 16 MiB
#: for a head_dim of 128 in bf16); longer ones are computed per microbatch, as their compute dwarfs it.
ROPE_CACHE_MAX_TOKENS = 32768


class CausalLMPrefix(nn.Module):
    """Embedding, rotary tables and attention masks: the first pipeline layer.

    Receives the (microbatch of the) model's keyword arguments and returns the state dict.

    The rotary tables of default positions are kept per device and length (``_rope_cache``, shared by the
    device copies a job makes of this module): computing them took about half the prefix's kernels, and
    on 4 GPUs, where each eager launch waits for the interpreter lock, the prefix's job paced the whole
    forward pipeline at about 10 ms per microbatch for 3 ms of kernels (docs/benchmarks.md).
    """

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module, config: Any, spec: CausalLMSpec) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config
        self.spec = spec
        # device -> ((tokens, dtype), (cos, sin)): the last tables made there (``_position_embeddings``).
        self._rope_cache: Dict[torch.device, Tuple[Tuple[int, torch.dtype], Tuple[torch.Tensor, ...]]] = {}

    def _position_embeddings(
        self, embeds: torch.Tensor, position_ids: torch.Tensor, given: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, ...]:
        """The rotary tables of ``position_ids``; for default positions (``given`` None) of a static rotary
        variant up to :data:`ROPE_CACHE_MAX_TOKENS`, the ones kept from an earlier microbatch of this length
        on this device. Consumers only read them (attention, hand-overs, saved for the recompute)."""
        tokens = embeds.shape[1]
        static = getattr(self.rotary_emb, "rope_type", None) in STATIC_ROPE_TYPES
        if given is not None or not static or tokens > ROPE_CACHE_MAX_TOKENS:
            return tuple(self.rotary_emb(embeds, position_ids))
        key = (tokens, embeds.dtype)
        kept = self._rope_cache.get(embeds.device)
        if kept is None or kept[0] != key:
            with torch.no_grad():
                kept = (key, tuple(t.detach() for t in self.rotary_emb(embeds, position_ids)))
            self._rope_cache[embeds.device] = kept
        return kept[1]

    def _masks(
        self, embeds: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor]
    ):
        """The attention masks per layer type. ``position_ids`` only when the caller gave them: with
        them and no attention mask, transformers looks for packed sequences, which reads a device value
        on the host (``if (...).all()``) and stalls the device thread; default positions are never
        packed, so leaving them out gives the same masks without the wait."""
        kwargs = dict(config=self.config, inputs_embeds=embeds, attention_mask=attention_mask, past_key_values=None)
        if self.spec.mask_uses_position_ids and position_ids is not None:
            kwargs["position_ids"] = position_ids
        fns = _mask_functions()
        return {t: _call_mask_function(fns[t], **kwargs) for t in dict.fromkeys(self.spec.layer_types)}

    def forward(self, options: Optional[Dict[str, Any]] = None, **batch: Any) -> State:
        """``batch``: a microbatch of the :data:`~roundpipe.models.inputs.BATCH_ARGS` (what
        :meth:`CausalLMPreset.forward_kwargs` returns, split); ``options``: the other arguments."""
        unknown = set(batch) - set(BATCH_ARGS)
        if unknown:
            raise TypeError(
                f"CausalLMPrefix.forward: unexpected arguments {sorted(unknown)}; takes {list(BATCH_ARGS)} and options"
            )
        inputs = CausalLMInputs(**batch)
        input_ids, attention_mask, position_ids = inputs.input_ids, inputs.attention_mask, inputs.position_ids
        inputs_embeds, labels, shift_labels = inputs.inputs_embeds, inputs.labels, inputs.shift_labels
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            inputs_embeds = inputs_embeds * self.spec.embedding_multiplier
        given_positions = position_ids
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        saved = _saved_for_recompute()
        if saved is not None:
            masks, position_embeddings = saved
        else:
            if sequence.active() is not None:  # a tile: causal over the sequence so far (roundpipe.runtime.sequence)
                masks = dict.fromkeys(self.spec.layer_types)
            else:
                masks = self._masks(inputs_embeds, attention_mask, given_positions)
            position_embeddings = self._position_embeddings(inputs_embeds, position_ids, given_positions)
            save_for_recompute(masks, position_embeddings)
        options = dict(options or {})
        router = None
        moe = self.spec.moe
        if moe is not None and options.get("output_router_logits", moe.output_router_logits):
            zeros = functools.partial(torch.zeros, dtype=torch.float32, device=inputs_embeds.device)
            router = (zeros(moe.num_experts), zeros(moe.num_experts), zeros(()))
        # The head needs the number of counted targets on the host to skip the ignored ones; counted
        # here and read stages later, it costs the device thread no wait (``HostScalar``).
        num_loss_tokens = None
        if labels is not None or shift_labels is not None:
            target = shift_labels if shift_labels is not None else shift_causal_labels(labels)
            num_loss_tokens = HostScalar((target != IGNORE_INDEX).sum())
        return {
            "hidden_states": inputs_embeds,
            "num_loss_tokens": num_loss_tokens,
            "position_ids": position_ids,
            "position_embeddings": position_embeddings,
            "masks": masks,
            "attention_mask": attention_mask,
            "labels": labels,
            "shift_labels": shift_labels,
            "router": router,
            "options": options,
        }


class DecoderLayerStage(nn.Module):
    """One Hugging Face decoder layer as a pipeline layer: ``state -> state`` with new hidden states."""

    def __init__(self, layer: nn.Module, attention_type: str, moe: Optional[MoESpec]) -> None:
        super().__init__()
        self.layer = layer
        self.attention_type = attention_type
        self.moe = moe
        self.num_routers = hook_routers(layer, moe) if moe is not None else 0

    def forward(self, state: State) -> State:
        collect = state["router"] is not None and self.num_routers > 0
        sink: List[torch.Tensor] = []
        if collect:
            router_sink.logits = sink
        try:
            # ---- sequence tiling (roundpipe.models.tiling): above RPP_SEQ_TILE tokens ----
            hidden = tiling.materialize(state["hidden_states"])
            mask = state["masks"][self.attention_type]
            out = tiling.maybe_tiled_forward(
                self.layer, hidden, mask, state["position_ids"], state["position_embeddings"]
            )
            # ---- end sequence tiling ----
            if out is None:
                out = self.layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=state["position_ids"],
                    use_cache=False,  # no cache argument: its default is None (and its name changed in 5.24)
                    position_embeddings=state["position_embeddings"],
                )
        finally:
            if collect:
                router_sink.logits = None
        state = dict(state, hidden_states=out[0] if isinstance(out, tuple) else out)
        if collect:
            stats = state["router"]
            for logits in sink:
                stats = accumulate_router_stats(stats, logits, state["attention_mask"], self.moe)
            state["router"] = stats
        return state


def _slice_positions(hidden: torch.Tensor, logits_to_keep: Union[int, Sequence[int]]) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:, :] if logits_to_keep > 0 else hidden
    return hidden[:, list(logits_to_keep), :]


class CausalLMHead(nn.Module):
    """Final norm + chunked loss (+ logits when asked): the last pipeline layer.

    Returns a dict of per-microbatch results: ``loss_sum`` and ``num_tokens`` (``[1]``, when labels are
    given), ``logits`` (when ``options["return_logits"]``), and the router sums ``router_tokens`` /
    ``router_probs`` (``[1, E]``) and ``router_rows`` (``[1]``, rows: the default merge averages 0-dim outputs).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module, spec: CausalLMSpec) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.spec = spec

    def forward(self, state: State) -> Dict[str, torch.Tensor]:
        hidden = self.norm(tiling.materialize(state["hidden_states"]))  # a tiled layer may have deferred it
        options = state["options"]
        out: Dict[str, torch.Tensor] = {}
        if state["labels"] is not None or state["shift_labels"] is not None:
            counted = state.get("num_loss_tokens")
            out["loss_sum"], out["num_tokens"] = (
                t.reshape(1)
                for t in causal_lm_loss(
                    hidden,
                    self.lm_head,
                    state["labels"],
                    shift_labels=state["shift_labels"],
                    num_valid=counted.item() if counted is not None else None,
                    chunk_size=options.get("loss_chunk_size"),
                    logit_scale=self.spec.logit_scale,
                    softcap=self.spec.softcap,
                )
            )
        if options.get("return_logits", True):
            logits = self.lm_head(_slice_positions(hidden, options.get("logits_to_keep", 0)))
            if self.spec.logit_scale != 1.0:
                logits = logits * self.spec.logit_scale
            if self.spec.softcap is not None:
                logits = torch.tanh(logits / self.spec.softcap) * self.spec.softcap
            out["logits"] = logits
        if state["router"] is not None:
            tokens, probs, rows = state["router"]
            out.update(router_tokens=tokens.unsqueeze(0), router_probs=probs.unsqueeze(0), router_rows=rows.reshape(1))
        return out


# ---------------------------------------------------------------------------------------------------------
# The preset
# ---------------------------------------------------------------------------------------------------------


class CausalLMPreset:
    """Pipeline layers of a ``*ForCausalLM`` plus the glue between them and the user-facing API.

    Attributes:
        model: The Hugging Face ``*ForCausalLM`` (inside the PEFT wrapper, if any).
        spec: The family's :class:`CausalLMSpec`.
        layers: ``nn.Sequential(prefix, decoder layer stages..., head)``; hand it to RoundPipe.
        fused_kernels: Whether the decoder layers use the fused kernels (:meth:`set_fused_kernels`).
    """

    def __init__(self, model: nn.Module, spec: CausalLMSpec, fused_kernels: kernels.FusedKernels = None) -> None:
        model = unwrap_peft(model)
        base = model.model
        n = model.config.num_hidden_layers
        self.model = model
        self.spec = spec
        self.layers = nn.Sequential(
            CausalLMPrefix(base.embed_tokens, base.rotary_emb, model.config, spec),
            *[DecoderLayerStage(layer, spec.layer_types[i], spec.moe) for i, layer in enumerate(base.layers[:n])],
            CausalLMHead(base.norm, model.lm_head, spec),
        )
        self.num_router_layers = sum(getattr(stage, "num_routers", 0) for stage in self.layers)
        self.fused_kernels = False
        self.set_fused_kernels(fused_kernels)

    def set_fused_kernels(self, mode: kernels.FusedKernels) -> bool:
        """Turn the fused kernels of :mod:`roundpipe.models.kernels` on or off for the decoder layers.

        ``mode``: True, False, ``"auto"`` (on when RoundPipe runs on GPUs and torch.compile can build
        Triton kernels) or None (``$RPP_DEBUG_FUSED_KERNELS``, default ``auto``). Families whose spec does
        not allow them stay off. Swaps the classes of the model's own norm, attention and MLP modules
        (see :func:`kernels.fuse_layer`); results equal Hugging Face's up to floating-point rounding.
        Returns whether they are on.
        """
        on = kernels.resolve(mode) and self.spec.fused_kernels
        stages = [s for s in self.layers if isinstance(s, DecoderLayerStage)]
        if on:
            swapped = [name for s in stages for name in kernels.fuse_layer(s.layer)]
            if swapped:
                kinds = sorted(
                    {kernels.base_class(m).__name__ for s in stages for m in s.layer.modules() if kernels.is_fused(m)}
                )
                logger.info(
                    "%s: fused kernels on for %d modules (%s)",
                    type(self.model).__name__,
                    len(swapped),
                    ", ".join(kinds),
                )
        else:
            for s in stages:
                kernels.unfuse_layer(s.layer)
        self.fused_kernels = bool(on)
        return self.fused_kernels

    @takes_inputs()
    def forward_kwargs(self, inputs: CausalLMInputs) -> Dict[str, Any]:
        """:meth:`layer_kwargs` from the causal-LM arguments themselves (positionally or by name)."""
        return self.layer_kwargs(inputs)

    def layer_kwargs(self, inputs: CausalLMInputs) -> Dict[str, Any]:
        """Keyword arguments for the first layer (what RoundPipe splits into microbatches): the
        :data:`~roundpipe.models.inputs.BATCH_ARGS` that are set, and ``options`` for the others.

        ``return_logits`` defaults to True without labels and False with them: a training forward needs
        the loss, and full logits are the largest tensor of the whole step. A sequence past the model's position
        limit (:func:`roundpipe.rope_scaling.position_limit`) raises ``SequenceTooLong``, a ``ValueError``.
        """
        tokens = inputs.input_ids if inputs.input_ids is not None else inputs.inputs_embeds
        if tokens is not None and tokens.dim() >= 2:  # the whole sequence, before any tiles: past the rotary limit?
            rope_scaling.check_length(self.model.config, int(tokens.shape[1]), python=True)
        has_labels = inputs.labels is not None or inputs.shift_labels is not None
        if has_labels:  # here, on the host: a bad label must not reach a loss kernel (check_label_range)
            vocab = self.model.get_output_embeddings().weight.shape[0]
            check_label_range(inputs.labels, vocab)
            check_label_range(inputs.shift_labels, vocab, shifted=True, name="shift_labels")
        attention_mask = inputs.attention_mask
        if (
            attention_mask is not None
            and inputs.position_ids is None
            and attention_mask.device.type == "cpu"
            and attention_mask.dim() == 2
            and bool(attention_mask.all())
        ):
            # An all-ones mask gives transformers' masks for no mask, after a check that reads the mask
            # back from the device once per microbatch (stalling the device thread); decided here, on
            # the host copy, for free. (Not with position ids: without a mask transformers would look
            # for packed sequences in them.)
            inputs = dataclasses.replace(inputs, attention_mask=None)
        logits_to_keep: Union[int, torch.Tensor, Tuple[int, ...]] = inputs.logits_to_keep
        if isinstance(logits_to_keep, torch.Tensor):
            if logits_to_keep.dim() != 1:
                raise NotImplementedError("logits_to_keep: an int or a 1-D tensor of positions")
            logits_to_keep = tuple(int(i) for i in logits_to_keep.tolist())
        options = {
            "return_logits": (not has_labels) if inputs.return_logits is None else bool(inputs.return_logits),
            "logits_to_keep": logits_to_keep,
            "loss_chunk_size": inputs.loss_chunk_size,
        }
        if self.spec.moe is not None:
            output_router_logits = inputs.output_router_logits
            options["output_router_logits"] = (
                self.spec.moe.output_router_logits if output_router_logits is None else bool(output_router_logits)
            )
        return dict(inputs.batch_kwargs(), options=options)

    def build_output(self, merged: Dict[str, torch.Tensor], num_items_in_batch: Optional[float] = None) -> Any:
        """Hugging Face output from the head outputs of all microbatches (merged) or of one. The loss is
        the sum of the token losses over their count (or over ``num_items_in_batch``, as Hugging Face
        normalises), plus, with the router loss on, the aux loss of their routing: the unsplit model's.
        """
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        loss = None
        if "loss_sum" in merged:
            divisor = merged["num_tokens"].sum() if num_items_in_batch is None else num_items_in_batch
            loss = merged["loss_sum"].sum() / divisor
        logits = merged.get("logits")
        if self.spec.moe is None:
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        aux = None
        if "router_rows" in merged:
            rows = merged["router_rows"].sum()
            aux = router_aux_loss(
                merged["router_tokens"].sum(0), merged["router_probs"].sum(0), rows, self.spec.moe.num_experts
            )
            if loss is not None:
                loss = loss + self.spec.moe.aux_loss_coef * aux
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits)

    def microbatch_loss_fn(
        self, forward_kwargs: Dict[str, Any], num_items_in_batch: Optional[float] = None
    ) -> Callable[[Dict[str, torch.Tensor], Any], torch.Tensor]:
        """``loss_fn`` for ``RoundPipe.forward_backward``: each microbatch's share of the batch loss.

        The cross-entropy of a microbatch is divided by the token count of the *whole* batch (or by
        ``num_items_in_batch``), so the sum over microbatches is exactly the batch loss. The MoE aux loss
        is not a sum over tokens (it multiplies two batch averages), so with ``forward_backward`` it is
        computed per microbatch and averaged with token weights, as gradient accumulation does;
        ``forward`` + ``backward`` gives the whole-batch aux loss instead.
        """
        if num_items_in_batch is None:
            num_items_in_batch = count_loss_tokens(forward_kwargs.get("labels"), forward_kwargs.get("shift_labels"))
        moe = self.spec.moe
        aux_on = moe is not None and forward_kwargs["options"].get("output_router_logits", False)
        total_rows = 0.0
        if aux_on:
            ref = forward_kwargs.get("input_ids", forward_kwargs.get("inputs_embeds"))
            mask = forward_kwargs.get("attention_mask")
            tokens = float(mask.sum()) if mask is not None else float(ref.shape[0] * ref.shape[1])
            total_rows = tokens * self.num_router_layers

        def loss_fn(outputs: Dict[str, torch.Tensor], _label: Any = None) -> torch.Tensor:
            loss = outputs["loss_sum"].reshape(()) / num_items_in_batch
            if aux_on:
                rows = outputs["router_rows"].reshape(())
                aux = router_aux_loss(outputs["router_tokens"][0], outputs["router_probs"][0], rows, moe.num_experts)
                loss = loss + moe.aux_loss_coef * aux * (rows / total_rows)
            return loss

        return loss_fn


__all__ = [
    "CausalLMHead",
    "CausalLMPrefix",
    "CausalLMPreset",
    "CausalLMSpec",
    "DecoderLayerStage",
    "MoESpec",
    "accumulate_router_stats",
    "default_layer_types",
    "default_spec",
    "has_standard_layout",
    "moe_spec",
    "router_aux_loss",
    "unwrap_peft",
]
