"""``RoundPipeForCausalLM``: a Hugging Face causal LM run through a RoundPipe sequential preset."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from roundpipe.models.kernels import FusedKernels
from roundpipe.models.preset import CausalLMPreset
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig


class RoundPipeForCausalLM(RoundPipe):
    """A ``*ForCausalLM`` (or a PEFT model around one) as a RoundPipe over its preset layers.

    The layers are ``prefix (embedding, rotary, masks) -> decoder layers -> head (norm, chunked loss)``
    and share the model's parameters. Attribute access falls through to the original model, so
    ``config``, ``generation_config`` and ``save_pretrained`` (of the adapter, for a PEFT model) work.

    Build it with :func:`roundpipe.models.wrap_model` (or ``wrap_model_to_roundpipe``).

    ``fused_kernels`` (True, False, ``"auto"``; None: ``$RPP_FUSED_KERNELS``, default ``auto`` = on for
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
            from roundpipe.models import build_preset

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

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        shift_labels: Optional[torch.Tensor] = None,
        return_logits: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_router_logits: Optional[bool] = None,
        loss_chunk_size: Optional[int] = None,
        roundpipe_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
        **unused: Any,
    ) -> Any:
        """Like the Hugging Face model's forward; returns ``CausalLMOutputWithPast`` (MoE:
        ``MoeCausalLMOutputWithPast``) whose loss equals the unsplit model's.

        Differences: ``return_logits`` defaults to False when labels are given (the loss never needs
        full logits); no KV cache (``use_cache`` and ``past_key_values`` must be unset). With gradients
        enabled, ``output.loss.backward()`` runs the pipelined backward.
        """
        if unused.get("past_key_values") is not None or unused.get("use_cache"):
            raise NotImplementedError("RoundPipeForCausalLM does not support a KV cache (use_cache / past_key_values)")
        extra = {k for k, v in unused.items() if v is not None and k not in ("use_cache", "past_key_values", "return_dict")}
        if extra:
            raise TypeError(f"RoundPipeForCausalLM.forward: unsupported arguments {sorted(extra)}")
        kwargs = self._preset.forward_kwargs(
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            labels,
            shift_labels,
            return_logits,
            logits_to_keep,
            output_router_logits,
            loss_chunk_size,
        )
        merged = super().forward(roundpipe_run_config=roundpipe_run_config, **kwargs)
        return self._preset.build_output(merged)

    def train_step(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        shift_labels: Optional[torch.Tensor] = None,
        output_router_logits: Optional[bool] = None,
        loss_chunk_size: Optional[int] = None,
        run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    ) -> torch.Tensor:
        """Forward + backward of the batch-mean token loss in one pipelined pass (``forward_backward``).

        Gradients accumulate into ``.grad`` like ``loss.backward()``; the (detached) loss is returned.
        Each microbatch's loss sum is divided by the token count of the whole batch, so loss and
        gradients equal the unsplit model's. MoE: the router aux loss is per microbatch here (see
        :meth:`CausalLMPreset.microbatch_loss_fn`); ``forward(labels=...).loss.backward()`` uses the
        whole batch's.
        """
        if labels is None and shift_labels is None:
            raise ValueError("train_step needs labels (or shift_labels)")
        kwargs = self._preset.forward_kwargs(
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            labels,
            shift_labels,
            False,
            0,
            output_router_logits,
            loss_chunk_size,
        )
        return self.forward_backward(
            input_kwargs=kwargs, loss_fn=self._preset.microbatch_loss_fn(kwargs), run_config=run_config
        )


__all__ = ["RoundPipeForCausalLM"]
