"""What the runtime's modules use of a RoundPipe model, as typing protocols.

A call's state (``run``), its jobs (``jobs``, ``compute``, ``pipeline``), the plan choice
(``plan_choice``) and the host buffers (``host_buffers``) all read the model that owns them. Typing
that model as ``roundpipe.roundpipe.RoundPipe`` pointed those modules back up at the wrapper that
imports them, a loop of imports (even when annotation-only). They name these protocols instead, which
``RoundPipe`` satisfies structurally (it does not inherit them); ``tests/test_architecture.py`` checks
that every member declared here exists on a RoundPipe. What the planner alone reads of a model
(``ModelExecutePlan.auto``) is ``roundpipe.planning.plan.PlannedModel``, which this protocol extends.
"""

from __future__ import annotations

from typing import ClassVar, List, Optional, Protocol, Tuple

from torch import nn

from roundpipe.host.attribute import LayerAttribute
from roundpipe.host.protocol import HostModel
from roundpipe.planning.budget import ActivationProfile
from roundpipe.planning.plan import PlanCache, PlannedModel
from roundpipe.runtime.batch import Batch
from roundpipe.runtime.grad_sync import GradSync
from roundpipe.runtime.partial_grads import PartialGradStore


class WrappedModel(HostModel, Protocol):
    """What every RoundPipe wrapper (``RoundPipe``, ``AutoRoundPipe``) offers the host buffers and
    the optimizer step: a name, and the optimizer units of its trainable parameters."""

    name: str
    """Human-readable identifier shown in errors and traces."""

    def optim_units(self) -> List[Tuple[LayerAttribute, List[nn.Parameter]]]:
        """(layer events, trainable parameters) per layer, each parameter once."""
        ...


class PipelinedModel(WrappedModel, PlannedModel, Protocol):
    """A RoundPipe: one list of layers run as jobs, with its per-layer events, timer, gradient
    synchronisation and plan cache settings."""

    layers: List[nn.Module]
    """The layers (on the host)."""
    num_layers: int
    """``len(layers)``."""
    layer_attrs: List[LayerAttribute]
    """Per-layer events between the device threads and the optimizer thread (``roundpipe.host.attribute``)."""
    grad_sync: Optional[GradSync]
    """Gradient synchronisation across processes, or None (``roundpipe.runtime.grad_sync``)."""
    partial_grad_store: PartialGradStore
    """Host buffers of the fused group's gradient parts on other devices (``roundpipe.runtime.partial_grads``)."""
    plan_cache: PlanCache
    """The automatic plans chosen so far (``roundpipe.runtime.plan_choice``)."""
    REPLAN_EVERY: ClassVar[int]
    """Timer updates between two re-plans of the automatic plan (``roundpipe.runtime.plan_choice``)."""
    REPLAN_GAIN: ClassVar[float]
    """How much faster a re-plan must simulate to replace the plan in use."""

    def activation_profile(self, batch: Batch, recompute_grain: str) -> Optional[ActivationProfile]:
        """What a training call over ``batch`` keeps per layer, or None when the model cannot tell."""
        ...

    def reset_events(self) -> None:
        """Mark nothing pending on any layer (after a failed run)."""
        ...

    def reduce_shared_grads(self) -> None:
        """Fold the per-layer gradient shares of tied parameters into ``param.grad``."""
        ...


__all__ = ["PipelinedModel", "WrappedModel"]
