"""Runtime configuration: a model-level default and per-call overrides, merged per call."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Optional

import torch

_RECOMPUTE_GRAINS = ("stage", "layer")

#: How backward-stage inputs are kept (``roundpipe.runtime.stage_codec.MODES``).
StageInputs = Literal["bf16", "fp8", "int8"]


@dataclass
class RoundPipeRunConfig:
    """Configuration for running a RoundPipe model; every field left None falls back to the model's
    config, then to the default.

    Attributes:
        requires_grad: Build the backward graph. Default: ``torch.is_grad_enabled()``.
        output_device: Device for the merged outputs. Default: CPU.
        preserve_rng_state: Restore RNG state for recompute so dropout masks match. Default: True.
        recompute_grain: 'stage' recomputes a backward stage at once; 'layer' recomputes and back-propagates
            one layer at a time (less activation memory). Default: 'stage'.
        num_microbatch: Number of microbatches. Default: number of devices + 1, at most the batch size
            (a smaller batch runs in fewer microbatches; a count chosen here larger than the batch is an error).
        split_input: How to split (args, kwargs): a callable ``(args, kwargs, n)`` returning
            ``(args_list, kwargs_list)`` (or a list of ``(args_m, kwargs_m)`` pairs), or a spec tree
            ``(args_spec, kwargs_spec)`` of ``TensorChunkSpec(dim)`` / ``_Replicate`` entries where None
            (at any depth) means automatic. Default: automatic.
        split_label: How to split labels: a callable ``(label, n) -> [label_m]`` or a spec tree. Default: automatic.
        merge_output: True / None (default merge: concatenate on dim 0, average 0-dim tensors), False
            (return ``RoundPipePackedData`` so that a downstream RoundPipe consumes microbatches without
            a host merge), a callable ``([out_m]) -> out``, or a spec tree choosing per output leaf
            (``TensorChunkSpec``, ``_Replicate``, a ``_CustomReducer``, True / False, a callable).
        execute_plan: A ``scheduler.ModelExecutePlan``. Default: automatic.
        sequence_tiles: Cut the batch along the sequence into this many tiles, which flow through the
            pool as the call's microbatches in causal order, so that one long sequence uses every device
            (``roundpipe.runtime.sequence``). For causal LMs (``RoundPipeForCausalLM``'s ``train_step`` and
            ``forward`` without logits); replaces ``num_microbatch``. Default: 1 (off).
        stage_inputs: How backward-stage inputs are kept from the forward to the backward: 'bf16' (as the
            layers produce them), 'fp8' (a float32 scale per 128 values) or 'int8' (one per 32 values, a fifth of
            fp8's rounding error; both about half the host memory; the backward recomputes from the
            rounded values: ``roundpipe.runtime.stage_codec``). Default: ``RPP_STAGE_INPUTS`` (else 'bf16').
        fp8: Run the decoder layers' projections as FP8 GEMMs (``roundpipe.models.fp8``): a frozen base stored
            as fp8 computes from its bytes, trained projections take torchao's float8 recipe. Read when the
            model is wrapped (``wrap_model_to_roundpipe``, ``roundpipe.models.wrap_model``), which converts the
            layers (a ``RoundPipe`` built directly with it needs ``roundpipe.models.fp8.prepare`` first): a call
            cannot change it. Default: False.
    """

    requires_grad: Optional[bool] = None
    output_device: Optional[torch.device] = None
    preserve_rng_state: Optional[bool] = None
    recompute_grain: Optional[Literal["stage", "layer"]] = None
    num_microbatch: Optional[int] = None
    split_input: Any = None
    split_label: Any = None
    merge_output: Any = None
    execute_plan: Any = None
    sequence_tiles: Optional[int] = None
    stage_inputs: Optional[StageInputs] = None
    fp8: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.recompute_grain is not None and self.recompute_grain not in _RECOMPUTE_GRAINS:
            raise ValueError(f"recompute_grain={self.recompute_grain!r}: expected 'stage' or 'layer'")
        if self.num_microbatch is not None and (
            isinstance(self.num_microbatch, bool) or not isinstance(self.num_microbatch, int) or self.num_microbatch < 1
        ):
            raise ValueError(f"num_microbatch={self.num_microbatch!r}: expected a positive integer")
        if self.sequence_tiles is not None and (
            isinstance(self.sequence_tiles, bool) or not isinstance(self.sequence_tiles, int) or self.sequence_tiles < 1
        ):
            raise ValueError(f"sequence_tiles={self.sequence_tiles!r}: expected a positive integer")
        if self.stage_inputs is not None:
            from roundpipe.runtime.stage_codec import check_mode

            check_mode(self.stage_inputs)
        for name in ("requires_grad", "preserve_rng_state", "fp8"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r:.60}: expected True, False or None (inherit)")
        if self.output_device is not None:
            try:
                self.output_device = torch.device(self.output_device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"output_device={self.output_device!r:.60}: expected a torch.device or a device string "
                    f"such as 'cpu' or 'cuda:0'"
                ) from None
        from roundpipe.runtime.batch import check_spec_tree

        for name in ("split_input", "split_label", "merge_output"):
            check_spec_tree(getattr(self, name), name)
        if self.execute_plan is not None:
            from roundpipe.planning.plan import ModelExecutePlan

            if not isinstance(self.execute_plan, ModelExecutePlan):
                raise ValueError("execute_plan: expected a roundpipe.ModelExecutePlan")


def check_model_run_config(model_run_config: Any) -> None:
    """A wrapper's ``model_run_config``, checked where it is given rather than at the first call."""
    if not isinstance(model_run_config, RoundPipeRunConfig):
        kind = type(model_run_config).__name__
        raise ValueError(f"model_run_config must be a roundpipe.RoundPipeRunConfig, not {kind}")


class ResolvedRunConfig:
    """A per-call config merged with the model's config and the defaults: every field resolved (the
    spec's ``FullRoundPipeRunConfig``)."""

    def __init__(self, function_run_config: RoundPipeRunConfig, model_run_config: RoundPipeRunConfig) -> None:
        from roundpipe import settings
        from roundpipe.devices.device import get_num_devices

        if function_run_config.fp8 is not None and bool(function_run_config.fp8) != bool(model_run_config.fp8):
            raise ValueError(
                f"fp8={function_run_config.fp8} in a call's run config: fp8 is chosen when the model is wrapped "
                "(fp8=True, or model_run_config=RoundPipeRunConfig(fp8=True)), which converts its layers; leave it "
                "out of the call"
            )
        for f in fields(RoundPipeRunConfig):
            val = getattr(function_run_config, f.name)
            if val is None:
                val = getattr(model_run_config, f.name)
            setattr(self, f.name, val)
        self.requires_grad: bool = torch.is_grad_enabled() if self.requires_grad is None else bool(self.requires_grad)
        self.output_device: torch.device = torch.device("cpu") if self.output_device is None else self.output_device
        self.preserve_rng_state: bool = True if self.preserve_rng_state is None else bool(self.preserve_rng_state)
        self.recompute_grain: Literal["stage", "layer"] = self.recompute_grain or "stage"
        # The count the call asks for, and whether it was chosen (per call or per model): the default
        # (devices + 1) is fitted to a smaller batch, where a chosen one is an error. The call's count is
        # computed once from this and the inputs, by its ``Batch`` (``Batch.num_microbatch``).
        self.num_microbatch_chosen: bool = self.num_microbatch is not None
        self.num_microbatch: int = self.num_microbatch or settings.default_num_microbatch(get_num_devices())
        self.merge_output: Any = True if self.merge_output is None else self.merge_output
        self.stage_inputs: StageInputs = self.stage_inputs or settings.STAGE_INPUTS.get()  # type: ignore
        self.sequence_tiles: int = self.sequence_tiles or 1
        self.fp8: bool = bool(self.fp8)
        self.split_input: Optional[Callable[..., Any]]
        self.split_label: Optional[Callable[..., Any]]


FullRoundPipeRunConfig = ResolvedRunConfig  # the spec's name
