"""The optimizer of ``roundpipe train``: AdamW on the host's fp32 masters, the warmup + cosine learning
rate schedule, the GradScaler of float16 runs, and the step function that runs on the optimizer thread.

One optimizer step (``HostOptimizer.step_fn``, called by ``RoundPipe.step`` on the optimizer thread
once the gradients are on the host): unscale (float16), clip the global gradient norm to
``max_grad_norm``, step, advance the schedule, zero the gradients. A non-finite gradient norm drops
the step's gradients instead (no update, no schedule step).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from roundpipe.cli.config import TrainConfig
from roundpipe.host.step import step_fn_zeroes_grads


def make_optimizer(masters: List[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (RoundPipe's host Adam, decoupled weight decay) on the masters (fp32 copies, or the bf16
    weights with ``--master bfloat16``; moments as ``--optim-state`` says); no weight decay on vectors
    (norm weights, biases)."""
    from roundpipe.optim import Adam

    decay = [p for p in masters if p.ndim >= 2]
    no_decay = [p for p in masters if p.ndim < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    return Adam(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        decoupled_weight_decay=True,
        state_dtype=cfg.optim_state,
        master=cfg.master,
        master_rounding=cfg.master_rounding,
        seed=cfg.seed,
    )


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps.

    A class (not a lambda) so that ``LambdaLR.state_dict()`` saves it.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class HostOptimizer:
    """Optimizer, LR schedule and (float16) GradScaler of a run, and its optimizer-thread step.

    Attributes:
        optimizer: AdamW over the masters (see :func:`make_optimizer`).
        scheduler: ``LambdaLR`` with :class:`WarmupCosine`.
        scaler: RoundPipe's ``GradScaler`` for float16 runs, else None.
        grad_norms: ``step -> global gradient norm before clipping``, filled by the optimizer thread;
            the training loop pops them into its metrics rows.
        nonfinite: ``step -> gradient norm`` of the steps whose gradient norm was NaN or infinite
            (without a GradScaler): their gradients were dropped, no update, no schedule step.
    """

    def __init__(
        self,
        masters: List[torch.Tensor],
        clip_params: List[nn.Parameter],
        cfg: TrainConfig,
        total_steps: int,
        warmup_steps: int,
        float16: bool,
    ) -> None:
        """``masters`` in the order the optimizer holds them (its state_dict depends on it);
        ``clip_params``: the same tensors in the order their norms are summed for clipping."""
        self.cfg = cfg
        self.clip_params = clip_params
        self.optimizer = make_optimizer(masters, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(warmup_steps, total_steps, cfg.min_lr_ratio)
        )
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.scaler: Any = None
        if float16:
            from roundpipe import GradScaler

            self.scaler = GradScaler()
        self.grad_norms: Dict[int, float] = {}
        self.nonfinite: Dict[int, float] = {}

    def lr_at(self, step: int) -> float:
        """The learning rate of the step after ``step`` steps."""
        return float(self.scheduler.lr_lambdas[0](step) * self.cfg.lr)

    @property
    def scale(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The loss scaling of backward: the GradScaler's (float16), else none."""
        return self.scaler.scale if self.scaler is not None else (lambda t: t)

    @step_fn_zeroes_grads  # zero_grad() ends every path: the optimizer may write the staging buffers itself
    def step_fn(self, step: int) -> None:
        """Optimizer-thread body of one step: clip the host gradients' global norm, step, schedule."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.clip_params, max_norm))
        self.grad_norms[step] = norm
        if self.scaler is None and not math.isfinite(norm):
            # Dropped before any update, so the weights never see them (with a GradScaler the scaler
            # skips such steps itself). The training loop stops the run or counts the step as skipped
            # (on_nonfinite) once it learns of it, see Recipe._check_gradients.
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite[step] = norm
            return
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dicts(self) -> Dict[str, Any]:
        """``{"optimizer", "scheduler", "scaler"}`` states (call with no step in flight)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dicts(
        self, optimizer: Dict[str, Any], scheduler: Dict[str, Any], scaler: Optional[Dict[str, Any]]
    ) -> None:
        """Restore the states :meth:`state_dicts` saved.

        The schedule is a function of the config and the step: this run's (steps, lr and warmup may
        have been changed on resume) is kept, and only the step count comes from the checkpoint.
        """
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        groups = self.optimizer.param_groups
        self.scheduler.lr_lambdas = [
            WarmupCosine(self.warmup_steps, self.total_steps, self.cfg.min_lr_ratio) for _ in groups
        ]
        self.scheduler.base_lrs = [self.cfg.lr] * len(groups)
        for group in groups:
            group["initial_lr"] = self.cfg.lr
            group["lr"] = self.cfg.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in groups]
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)


__all__ = ["HostOptimizer", "WarmupCosine", "make_optimizer"]
