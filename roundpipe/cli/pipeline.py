"""The causal LM of ``roundpipe train`` on RoundPipe: training calls, inference logits, and the fp32
masters by Hugging Face name (through the public ``optim_named_parameters``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from roundpipe import settings
from roundpipe.cli.config import ConfigError


class PipelineModel:
    """A causal LM on RoundPipe (``RoundPipeForCausalLM``), with the calls training needs.

    Attributes:
        hf_model: The Hugging Face model (inside PEFT when LoRA is on); its parameters are the ones
            RoundPipe streams, so it reflects training after ``synchronize()``.
        rp: The RoundPipe model (``optim_parameters``, ``step``, ``synchronize``).
    """

    def __init__(
        self,
        hf_model: nn.Module,
        num_microbatch: Optional[int],
        plan: str = "auto",
        master_dtype: Optional[torch.dtype] = torch.float32,
        stage_inputs: Optional[str] = None,
        base_format: str = "bf16",
        fp8: bool = False,
    ) -> None:
        """``master_dtype``: dtype of the optimizer's masters (None: the weights themselves, no copy);
        ``stage_inputs``: how backward-stage inputs are kept (``RoundPipeRunConfig.stage_inputs``; None: the
        setting); ``base_format``: how the frozen weights are kept on the host (``wrap_model_to_roundpipe``);
        ``fp8``: FP8 GEMMs in the decoder layers (``roundpipe.models.fp8``)."""
        import roundpipe
        from roundpipe import ModelExecutePlan, RoundPipeRunConfig

        self.hf_model = hf_model
        try:
            self.rp = roundpipe.wrap_model_to_roundpipe(
                hf_model,
                use_sequential_preset=True,
                optim_dtype=master_dtype,
                name="train",
                model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, stage_inputs=stage_inputs),
                base_format=base_format,
                fp8=fp8,
            )
        except NotImplementedError as exc:
            why = str(exc).splitlines()[0].split("; supported:")[0]  # the class and its model type: one short line
            fix = "use a decoder-only causal LM (Qwen3, Llama, Mistral, ...: roundpipe.models.SUPPORTED_MODELS)"
            raise ConfigError(f"this model is not supported by RoundPipe ({why})", fix) from None
        n = self.rp.num_layers
        if plan == "single":  # one stage: forward, loss and backward of the whole model in one job
            self.rp.model_run_config.execute_plan = ModelExecutePlan([range(0, n)], [range(0, n)])
        elif plan == "layerwise":
            self.rp.model_run_config.execute_plan = ModelExecutePlan.layerwise(n, "train")

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        weight: float,
        scale: Callable[[torch.Tensor], torch.Tensor],
        num_microbatch: Optional[int] = None,
    ) -> torch.Tensor:
        """Accumulate the gradients of ``scale(weight x batch-mean token loss)``; returns that
        (scaled, weighted) loss. ``weight`` = this batch's share of the step's loss tokens.

        ``weight`` 0 (rows without a trained token, e.g. a data-parallel rank's share) still runs the
        call, with a zero loss: a batch mean over no token would be 0/0, and with gradients reduced on
        the devices every rank must run every training call. ``num_microbatch`` overrides the model's
        microbatch count for this call.
        """
        from roundpipe import RoundPipeRunConfig

        preset = self.rp.preset
        kwargs = preset.forward_kwargs(input_ids=input_ids, labels=labels, return_logits=False)
        if weight == 0:
            loss_fn: Callable[[Any, Any], torch.Tensor] = lambda out, label: scale(out["loss_sum"] * 0.0)
        else:
            base = preset.microbatch_loss_fn(kwargs)
            loss_fn = lambda out, label: scale(base(out, label) * weight)
        return self.rp.forward_backward(
            input_kwargs=kwargs, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)
        )

    def _infer_config(self, batch_size: int) -> Any:
        """Inference run config: no more microbatches than rows."""
        from roundpipe import RoundPipeRunConfig, get_num_devices

        n = self.rp.model_run_config.num_microbatch or settings.default_num_microbatch(get_num_devices())
        return RoundPipeRunConfig(num_microbatch=max(1, min(n, batch_size)))

    @torch.no_grad()
    def last_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last position, ``[B, V]``."""
        return self.rp(
            input_ids=input_ids, logits_to_keep=1, roundpipe_run_config=self._infer_config(input_ids.shape[0])
        ).logits[:, -1]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of all positions, ``[B, T, V]``."""
        return self.rp(input_ids=input_ids, roundpipe_run_config=self._infer_config(input_ids.shape[0])).logits

    # ---- parameters by Hugging Face name -----------------------------------------------------------
    def masters(self) -> Dict[int, torch.Tensor]:
        """``id(model parameter) -> fp32 optimizer master`` for the trainable parameters (created on
        first call). RoundPipe names them after its own layer sequence; the parameters are the Hugging
        Face model's, so they are matched by identity."""
        own = dict(self.rp.model.named_parameters())
        return {id(own[name]): master for name, master in self.rp.optim_named_parameters()}

    def trainable_named(self) -> List[Tuple[str, nn.Parameter]]:
        """The trainable parameters by Hugging Face name (the weights the devices compute with)."""
        return [(n, p) for n, p in self.hf_model.named_parameters() if p.requires_grad]

    def master_named(self) -> List[Tuple[str, torch.Tensor]]:
        """The fp32 masters of :meth:`trainable_named`, in the same order and by the same names."""
        masters = self.masters()
        return [(n, masters[id(p)]) for n, p in self.trainable_named()]

    def current_weights(self, trainable_only: bool) -> Dict[str, torch.Tensor]:
        """Up-to-date weights by Hugging Face name: masters in the training dtype for trainable
        parameters (what ``synchronize`` would copy), the parameters themselves otherwise (and the
        persistent buffers, unless ``trainable_only``)."""
        masters = self.masters()
        out = {}
        for name, p in self.hf_model.named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            m = masters.get(id(p))
            out[name] = m.detach().to(p.dtype) if m is not None else p.detach()
        if not trainable_only:
            params = dict(self.hf_model.named_parameters(remove_duplicate=False))
            for name, t in self.hf_model.state_dict().items():
                if name not in params:
                    out[name] = t  # persistent buffers
        return out

    # ---- the optimizer thread ----------------------------------------------------------------------
    def wait_for_step(self) -> None:
        """Wait until every optimizer step handed to the optimizer thread has finished (raising the
        failure of one that failed), leaving the model's weights as they are.

        This is not ``synchronize()``: that also copies the updated masters into the model, so in
        async mode the next step would compute at newer weights than an uninterrupted run does, and a
        checkpoint would change the run's trajectory (test_resume_is_bitwise_exact catches it). Nor is
        it ``optim_updated.wait()``: with async steps, step k-1's kernel may finish (and set the event)
        after step k was launched, so the event can be set while step k still runs. The optimizer
        thread's wait (``RoundPipeBase.wait_optimizer``) means "no step in flight" without touching
        the weights.
        """
        self.rp.wait_optimizer()


__all__ = ["PipelineModel"]
