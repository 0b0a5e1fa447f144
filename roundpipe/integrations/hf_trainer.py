"""Train a RoundPipe-wrapped model with Hugging Face's ``Trainer`` (or TRL's ``SFTTrainer``).

A normal Trainer script changes in two lines::

    model = roundpipe.wrap_model_to_roundpipe(model, optim_dtype=torch.float32)   # 1
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=ds)          # 2 (was Trainer)
    trainer.train()

``with_roundpipe(SFTTrainer)`` (or ``class MyTrainer(RoundPipeTrainerMixin, SFTTrainer)``) does the same
for another Trainer subclass. What the mixin changes, and why:

* The step. The optimizer is built on the model's optimizer copies (fp32 masters): RoundPipe's host
  ``Adam`` for the ``adamw*`` choices of ``args.optim`` (``decoupled_weight_decay=True``), the
  Trainer's own choice otherwise. It is handed to the Trainer inside a :class:`RoundPipeOptimizer`,
  whose ``step()`` queues the update on the optimizer thread (``model.step``, asynchronous by default)
  and returns at once; the learning-rate scheduler sets the learning rate the queued step uses.
* The training step. A causal LM with labels trains through ``model.train_step`` (the pipelined
  forward + loss + backward without logits); any other model through ``model(**inputs)`` and
  ``loss.backward()``. Gradient accumulation normalises as Hugging Face does: by ``num_items_in_batch``
  when the Trainer counts labels, else each batch's mean divided by the accumulation steps.
* Mixed precision. ``fp16=True`` scales the loss with :class:`roundpipe.GradScaler` (thread-safe with
  the asynchronous step) instead of accelerate's; autocast, when accelerate sets it up, is applied to
  the pipeline's devices. Low-precision weights with fp32 masters come from ``optim_dtype``.
* Gradient clipping (``max_grad_norm``) runs in the step, on the masters' gradients (after unscaling).
  The Trainer's ``grad_norm`` log is left out: the norm is computed on the optimizer thread later.
* Placement. The model and the batches stay in host memory (RoundPipe streams them to every GPU
  itself): no ``.to(device)``, no ``DataParallel``.
* Saving. ``model.synchronize()`` first, then ``save_pretrained`` of the original Hugging Face (or
  PEFT) model, so a checkpoint loads with ``from_pretrained``; with low-precision weights the fp32
  masters are saved next to it (``roundpipe_optim_params.safetensors``) so that a resume continues
  exactly; the optimizer state is the masters', the scaler's state is RoundPipe's GradScaler's.
  Evaluation synchronises first too (so the next training step uses the latest weights).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Type

import torch
from torch import nn

from roundpipe.host.step import step_fn_zeroes_grads
from roundpipe.optim.grad_scaler import GradScaler
from roundpipe.roundpipe import RoundPipeBase

logger = logging.getLogger("roundpipe")

OPTIM_PARAMS_NAME = "roundpipe_optim_params.safetensors"
"""Checkpoint file of the optimizer copies (masters), written when their dtype differs from the weights'."""
SCALER_NAME = "scaler.pt"
RNG_NAME = "roundpipe_rng_state.pth"


def roundpipe_model(model: Any) -> RoundPipeBase:
    """The RoundPipe model inside whatever the Trainer holds (accelerate may wrap it)."""
    seen = model
    while not isinstance(seen, RoundPipeBase) and hasattr(seen, "module"):
        seen = seen.module
    if not isinstance(seen, RoundPipeBase):
        raise TypeError(
            f"RoundPipeTrainer trains a RoundPipe model, got {type(model).__name__}; wrap it first: "
            "model = roundpipe.wrap_model_to_roundpipe(model, optim_dtype=torch.float32)"
        )
    return seen


def original_model(rp: RoundPipeBase) -> nn.Module:
    """The user's model behind ``rp``: the original Hugging Face / PEFT model of a preset, else the
    wrapped model (an ``AutoRoundPipe`` wraps the user's model itself)."""
    original = rp.__dict__.get("original_model")
    return original if original is not None else rp.model


def _base_model(model: nn.Module) -> nn.Module:
    """The model inside a PEFT wrapper (the model itself otherwise)."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        base: nn.Module = model.get_base_model()
        return base
    return model


def original_state_dict(rp: RoundPipeBase) -> Dict[str, torch.Tensor]:
    """State dict of :func:`original_model` with the names the model had before wrapping: the
    ``.model`` that each RoundPipe submodule inserts is taken out again."""
    target = original_model(rp)
    prefixes = sorted(
        (name + ".model." for name, m in target.named_modules() if isinstance(m, RoundPipeBase) and name),
        key=len,
        reverse=True,
    )
    out: Dict[str, torch.Tensor] = {}
    for key, value in target.state_dict().items():
        for prefix in prefixes:
            if key.startswith(prefix):
                key = prefix[: -len("model.")] + key[len(prefix) :]
                break
        out[key] = value
    return out


class RoundPipeOptimizer(torch.optim.Optimizer):
    """The Trainer's view of an optimizer over a RoundPipe model's optimizer copies.

    ``step()`` queues ``optimizer.step(); optimizer.zero_grad()`` on RoundPipe's optimizer thread
    (``model.step``) and returns. The main thread (the learning-rate scheduler) writes the
    hyperparameters of this object's ``param_groups``; each queued step first copies them into the
    wrapped optimizer's groups, which only the optimizer thread touches. So step k uses the learning
    rate set before it was queued, whatever the scheduler does meanwhile.

    Args:
        optimizer: An optimizer over ``model.optim_parameters()``.
        model: The RoundPipe model.
        scaler: A :class:`roundpipe.GradScaler` (fp16): the step unscales and skips inf/NaN steps,
            and ``update()`` runs after queueing it.
        max_grad_norm: Clip the masters' gradient norm to this in the step (None or <= 0: no clipping).
        is_async: ``model.step``'s ``is_async``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: RoundPipeBase,
        scaler: Optional[GradScaler] = None,
        max_grad_norm: Optional[float] = None,
        is_async: bool = True,
    ) -> None:
        masters = {id(p) for p in model.optim_parameters()}
        strays = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in masters]
        if strays:
            raise ValueError(
                f"the optimizer holds {len(strays)} tensors that are not the model's optimizer copies; build it on "
                "model.optim_parameters() (or inside roundpipe.OptimizerCtx(): model.parameters())"
            )
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.optimizer = optimizer
        self.model = model
        self.scaler = scaler
        self.max_grad_norm = max_grad_norm
        self.is_async = is_async

    def _hyperparameters(self) -> List[Dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        """Queue one step of the wrapped optimizer on the optimizer thread (see the class docstring)."""
        if closure is not None:
            raise ValueError("RoundPipeOptimizer.step: closures are not supported (the step runs on another thread)")
        hyper = self._hyperparameters()
        inner, scaler, max_norm = self.optimizer, self.scaler, self.max_grad_norm

        @step_fn_zeroes_grads  # zero_grad() right after the step: the optimizer may write the staging buffers
        def step_fn() -> None:
            for group, values in zip(inner.param_groups, hyper):
                group.update(values)
            if max_norm is not None and max_norm > 0:
                if scaler is not None:
                    scaler.unscale_(inner)
                torch.nn.utils.clip_grad_norm_([p for g in inner.param_groups for p in g["params"]], max_norm)
            if scaler is not None:
                scaler.step(inner)
            else:
                inner.step()
            inner.zero_grad(set_to_none=True)

        self.model.step(step_fn, is_async=self.is_async)
        if scaler is not None:
            scaler.update()  # main thread, after the step is queued (GradScaler's protocol)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do here: each queued step clears the optimizer's gradients after using them, and
        the model's gradients are moved into the optimizer copies by the step."""

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state once every queued step has run, with the hyperparameters of the
        main thread's view (what the next step would use)."""
        self.model.synchronize()
        state = self.optimizer.state_dict()
        for group, values in zip(state["param_groups"], self._hyperparameters()):
            group.update(values)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the wrapped optimizer's state (when no step is pending) and take its hyperparameters."""
        self.model.synchronize()
        self.optimizer.load_state_dict(state_dict)
        for group, loaded in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in loaded.items() if k != "params"})


def _one_process_for_all_gpus(args: Any) -> None:
    """RoundPipe drives every GPU from this process: the Trainer must not multiply the batch size by
    the GPU count, wrap the model in DataParallel or split the label count per GPU (``n_gpu`` 1)."""
    _ = args.n_gpu  # resolve the devices first (a cached property that sets _n_gpu)
    args._n_gpu = 1


def _is_adamw(name: str) -> bool:
    return name.startswith("adamw") and "8bit" not in name and "4bit" not in name


class RoundPipeTrainerMixin:
    """Mix into ``transformers.Trainer`` or a subclass of it (listed first), e.g.
    ``class MySFTTrainer(RoundPipeTrainerMixin, SFTTrainer)``; see the module docstring.

    Extra keyword argument: ``roundpipe_async_step`` (default True): ``model.step``'s ``is_async``.
    """

    def __init__(self, *args: Any, roundpipe_async_step: bool = True, **kwargs: Any) -> None:
        training_args = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if training_args is not None:
            _one_process_for_all_gpus(training_args)
            for flag in ("gradient_checkpointing", "activation_checkpointing"):
                if getattr(training_args, flag, False):
                    # RoundPipe recomputes every stage in backward already; the model's own
                    # checkpointing would recompute a second time.
                    logger.info("RoundPipeTrainer: %s turned off (RoundPipe recomputes activations itself)", flag)
                    setattr(training_args, flag, False)
        super().__init__(*args, **kwargs)
        self.roundpipe = roundpipe_model(self.model)  # type: ignore[attr-defined]
        self.roundpipe_async_step = roundpipe_async_step
        _one_process_for_all_gpus(self.args)  # type: ignore[attr-defined]
        if self.args.label_names is None:  # type: ignore[attr-defined]
            # The labels of the user's model class (a RoundPipe's forward also has e.g. shift_labels,
            # and an AutoRoundPipe's takes **kwargs: neither names what the batches carry).
            from transformers.utils import find_labels

            self.label_names = find_labels(type(_base_model(original_model(self.roundpipe)))) or ["labels"]
        # Neither the model nor the batches (nor the optimizer state) are moved to a device.
        self.accelerator.device_placement = False  # type: ignore[attr-defined]
        fp16 = self.args.fp16  # type: ignore[attr-defined]
        self.roundpipe_scaler: Optional[GradScaler] = GradScaler() if fp16 else None
        # accelerate's GradScaler would unscale and step on the main thread; RoundPipe's does it in the step.
        if getattr(self.accelerator, "scaler", None) is not None:  # type: ignore[attr-defined]
            self.accelerator.scaler = None  # type: ignore[attr-defined]

    # ---- placement -----------------------------------------------------------------------------------
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """RoundPipe keeps the model in host memory and streams it to the devices: nothing to move."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """No DataParallel or DDP around a RoundPipe model: RoundPipe uses every GPU itself."""
        return model

    def _prepare_input(self, data: Any) -> Any:
        """Batches stay in host memory: RoundPipe splits them into microbatches and uploads each one."""
        if isinstance(data, dict):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(v) for v in data)
        if isinstance(data, torch.Tensor):
            return data.cpu()
        return data

    def _set_signature_columns_if_needed(self) -> None:
        """Dataset columns kept: the user model's forward arguments (an ``AutoRoundPipe`` itself takes
        ``*args, **kwargs``, which would keep none)."""
        if getattr(self, "_signature_columns", None) is None:
            params = inspect.signature(self.roundpipe.forward).parameters.values()
            if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                names = list(inspect.signature(_base_model(original_model(self.roundpipe)).forward).parameters)
                label_names = list(self.label_names)  # type: ignore[attr-defined]
                self._signature_columns = names + sorted(set(["label", "label_ids"] + label_names))
        super()._set_signature_columns_if_needed()  # type: ignore[misc]

    # ---- optimizer -----------------------------------------------------------------------------------
    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The optimizer on the model's optimizer copies (see the module docstring), wrapped in a
        :class:`RoundPipeOptimizer`. An optimizer given to the Trainer is wrapped as it is."""
        rp = self.roundpipe
        optimizer = self.optimizer  # type: ignore[has-type]
        if isinstance(optimizer, RoundPipeOptimizer):
            return optimizer
        if optimizer is None:
            optimizer = self._create_host_optimizer(rp)
        self.optimizer = RoundPipeOptimizer(
            optimizer,
            rp,
            scaler=self.roundpipe_scaler,
            max_grad_norm=self.args.max_grad_norm,
            is_async=self.roundpipe_async_step,  # type: ignore[attr-defined]
        )
        return self.optimizer

    def _create_host_optimizer(self, rp: RoundPipeBase) -> torch.optim.Optimizer:
        from roundpipe.host.step import OptimizerCtx
        from roundpipe.optim import Adam

        args = self.args  # type: ignore[attr-defined]
        decay = set(self.get_decay_parameter_names(rp.model))  # type: ignore[attr-defined]
        named = list(rp.optim_named_parameters())
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        optim_name = str(getattr(args.optim, "value", args.optim))
        if _is_adamw(optim_name):
            return Adam(
                groups,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                decoupled_weight_decay=True,
            )
        with OptimizerCtx():
            cls, kwargs = self.get_optimizer_cls_and_kwargs(args, rp)  # type: ignore[attr-defined]
            kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
            return cls(groups, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """Clipping runs inside the step, on the masters' gradients (RoundPipeOptimizer)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """Not available on the main thread: the gradients are read by the step on the optimizer thread."""
        return None

    # ---- training step -------------------------------------------------------------------------------
    def _fast_path(self, inputs: Dict[str, Any]) -> bool:
        from roundpipe.models.causal_lm import RoundPipeForCausalLM

        return (
            isinstance(self.roundpipe, RoundPipeForCausalLM)
            and (inputs.get("labels") is not None or inputs.get("shift_labels") is not None)
            and getattr(self, "compute_loss_func", None) is None
            and getattr(self, "label_smoother", None) is None
        )

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward, loss and backward of one batch through the pipeline; returns the (unscaled) loss as
        the Trainer accounts it (see the module docstring)."""
        rp = self.roundpipe
        rp.train()
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        steps = steps or self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
        accepts = getattr(self, "model_accepts_loss_kwargs", True)
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = (accepts and num_items_in_batch is not None) or getattr(
                self, "compute_loss_func", None
            ) is not None
        factor = 1.0 if scaled_for_ga else 1.0 / steps
        scaler = self.roundpipe_scaler

        def scale_loss(loss: torch.Tensor) -> torch.Tensor:
            loss = loss * factor if factor != 1.0 else loss
            return scaler.scale(loss) if scaler is not None else loss  # type: ignore[return-value]

        with self.compute_loss_context_manager(), self._autocast():  # type: ignore[attr-defined]
            if self._fast_path(inputs):
                kwargs = {k: v for k, v in inputs.items() if k not in ("use_cache", "fused_lm_head")}
                if accepts and num_items_in_batch is not None:
                    kwargs["num_items_in_batch"] = num_items_in_batch
                loss = rp.train_step(**kwargs, scale_loss=scale_loss)  # type: ignore[operator]
            else:
                compute_loss = self.compute_loss  # type: ignore[attr-defined]
                loss = compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                loss = scale_loss(loss)
                loss.backward()
        loss = loss.detach()
        if scaler is not None:
            loss = loss / scaler.get_scale()
        return loss.to(self.args.device)  # type: ignore[attr-defined]

    def _autocast(self) -> contextlib.AbstractContextManager:
        """accelerate's autocast (bf16 / fp16 mixed precision), captured by RoundPipe for its devices."""
        accelerator = self.accelerator  # type: ignore[attr-defined]
        if getattr(accelerator, "native_amp", False):
            return accelerator.autocast()
        return contextlib.nullcontext()

    def compute_loss(
        self, model: nn.Module, inputs: Dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The base Trainer's loss from ``model(**inputs)`` (a subclass's own loss, e.g. TRL's fused
        LM head, would run the model outside the pipeline)."""
        from transformers import Trainer

        inputs = {k: v for k, v in inputs.items() if k != "fused_lm_head"}
        return Trainer.compute_loss(  # type: ignore[arg-type]
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def prediction_step(
        self,
        model: nn.Module,
        inputs: Dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: Optional[List[str]] = None,
    ) -> Any:
        """The base Trainer's prediction step; logits are asked for when predictions are wanted (the
        causal-LM preset computes only the loss when labels are given)."""
        from transformers import Trainer

        from roundpipe.models.causal_lm import RoundPipeForCausalLM

        if not prediction_loss_only and isinstance(self.roundpipe, RoundPipeForCausalLM):
            inputs = dict(inputs, return_logits=True)
        return Trainer.prediction_step(  # type: ignore[arg-type]
            self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        """Evaluate with the latest weights: pending steps are finished first."""
        self.roundpipe.synchronize()
        return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Predict with the latest weights: pending steps are finished first."""
        self.roundpipe.synchronize()
        return super().predict(*args, **kwargs)  # type: ignore[misc]

    # ---- saving and loading ----------------------------------------------------------------------------
    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[Dict[str, Any]] = None) -> None:
        """``save_pretrained`` of the original model after ``synchronize()``, plus the masters when their
        dtype differs from the weights' (the module docstring)."""
        from transformers.trainer import TRAINING_ARGS_NAME

        rp = self.roundpipe
        output_dir = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
        rp.synchronize()
        if not self.args.should_save:  # type: ignore[attr-defined]
            return
        os.makedirs(output_dir, exist_ok=True)
        target = original_model(rp)
        if hasattr(target, "save_pretrained"):
            if state_dict is None and not hasattr(target, "peft_config"):
                state_dict = original_state_dict(rp)
            target.save_pretrained(output_dir, state_dict=state_dict)
        else:
            import safetensors.torch

            safetensors.torch.save_file(
                {k: v.contiguous() for k, v in (state_dict or original_state_dict(rp)).items()},
                os.path.join(output_dir, "model.safetensors"),
            )
        masters = optim_params_to_save(rp)
        if masters:
            import safetensors.torch

            safetensors.torch.save_file(masters, os.path.join(output_dir, OPTIM_PARAMS_NAME))
        processing_class = getattr(self, "processing_class", None)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Load the weights into the original model, then the masters (saved ones, or the weights)."""
        from transformers import Trainer

        rp = self.roundpipe
        rp.synchronize()
        Trainer._load_from_checkpoint(self, resume_from_checkpoint, model=original_model(rp))  # type: ignore[arg-type]
        path = os.path.join(resume_from_checkpoint, OPTIM_PARAMS_NAME)
        saved = None
        if os.path.isfile(path):
            import safetensors.torch

            saved = safetensors.torch.load_file(path)
        rp.load_optim_params(saved)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights (and masters) as a resume loads them."""
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        logger.info("Loading best model from %s", best)
        self._load_from_checkpoint(best)

    def _save_scaler(self, output_dir: str) -> None:
        if self.roundpipe_scaler is not None and self.args.should_save:  # type: ignore[attr-defined]
            torch.save(self.roundpipe_scaler.state_dict(), os.path.join(output_dir, SCALER_NAME))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or self.roundpipe_scaler is None:
            return
        path = os.path.join(checkpoint, SCALER_NAME)
        if os.path.isfile(path):
            self.roundpipe_scaler.load_state_dict(torch.load(path, weights_only=True))

    def _save_rng_state(self, output_dir: str) -> None:
        """The Trainer's RNG states, plus every GPU's (RoundPipe runs layers on all of them)."""
        super()._save_rng_state(output_dir)  # type: ignore[misc]
        if torch.cuda.is_available() and self.args.should_save:  # type: ignore[attr-defined]
            torch.save({"cuda_all": torch.cuda.get_rng_state_all()}, os.path.join(output_dir, RNG_NAME))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        super()._load_rng_state(checkpoint)  # type: ignore[misc]
        path = os.path.join(checkpoint, RNG_NAME) if checkpoint is not None else ""
        if checkpoint is not None and torch.cuda.is_available() and os.path.isfile(path):
            torch.cuda.set_rng_state_all(torch.load(path, weights_only=True)["cuda_all"])


def optim_params_to_save(rp: RoundPipeBase) -> Dict[str, torch.Tensor]:
    """The optimizer copies by name when any differs in dtype from its model parameter (the weights
    alone then cannot restore them exactly); empty otherwise."""
    masters = rp.optim_param_state_dict()
    model_dtypes = {n: p.dtype for n, p in rp.model.named_parameters()}
    if all(model_dtypes.get(n) == t.dtype for n, t in masters.items()):
        return {}
    return {n: t.contiguous() for n, t in masters.items()}


def with_roundpipe(trainer_cls: Type[Any]) -> Type[Any]:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass such as TRL's ``SFTTrainer``) with
    :class:`RoundPipeTrainerMixin` mixed in: ``RoundPipeSFTTrainer = with_roundpipe(SFTTrainer)``."""
    return type(
        f"RoundPipe{trainer_cls.__name__}",
        (RoundPipeTrainerMixin, trainer_cls),
        {"__doc__": RoundPipeTrainerMixin.__doc__},
    )


def _make_trainer() -> Type[Any]:
    from transformers import Trainer

    return with_roundpipe(Trainer)


RoundPipeTrainer: Type[Any] = _make_trainer()
"""``transformers.Trainer`` for RoundPipe models (:class:`RoundPipeTrainerMixin` + ``Trainer``)."""


__all__ = [
    "RoundPipeOptimizer",
    "RoundPipeTrainer",
    "RoundPipeTrainerMixin",
    "original_model",
    "original_state_dict",
    "with_roundpipe",
]
