"""What the host side needs of a model and of a gradient synchronisation, as typing protocols.

The host buffers, the step cycle and the step protocol read a model's name, its step mode and its optimizer
units (a layer's trainable parameters with the ``LayerAttribute`` whose events guard them), and call a
gradient synchronisation at three points of a step. The upper layers' protocols extend these
(``roundpipe.model_protocol.WrappedModel``, ``roundpipe.runtime.grad_sync.GradSync``); a RoundPipe
satisfies them structurally.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple, runtime_checkable

from torch import nn

from roundpipe.devices.threads import AnnotatedEvent
from roundpipe.host.attribute import LayerAttribute
from roundpipe.host.step_mode import StepMode

Units = List[Tuple[LayerAttribute, List[nn.Parameter]]]


@runtime_checkable
class StepSync(Protocol):
    """Optimizer-step hooks of a gradient synchronisation that shares the step across processes (data
    parallel with ``shard_optimizer=True``). ``units`` are the step's optimizer units."""

    def before_step_fn(self, units: List[Any], streamed: bool) -> None:
        """Optimizer thread: the gradients are handed over; ``step_fn`` runs next (``streamed``: a streamed
        asynchronous step, which publishes each layer as its optimizer steps it)."""

    def after_step_fn(self, units: List[Any]) -> None:
        """Optimizer thread: ``step_fn`` returned; the optimizer copies are read next."""

    def abort(self) -> None:
        """Optimizer thread: the step failed between ``before_step_fn`` and ``after_step_fn``."""


@runtime_checkable
class HostGradSync(Protocol):
    """What the step protocol calls of a model's ``grad_sync`` (at launch, then on the optimizer thread)."""

    step_sync: Optional[StepSync]
    """The optimizer step shared across processes, or None (each process steps all its parameters)."""

    def on_step_launch(self) -> None:
        """Main thread, at the start of ``model.step``: a step boundary."""

    def reduce_host(self, params: List[nn.Parameter]) -> None:
        """Optimizer thread: reduce one unit's host gradients before the optimizer reads them."""


class HostModel(Protocol):
    """What the host side reads of a RoundPipe wrapper (``RoundPipe``, ``AutoRoundPipe``)."""

    name: str
    """Human-readable identifier shown in errors and traces."""
    step_mode: StepMode
    """The buffer policy of its asynchronous steps, resolved when the model was built."""
    optim_updated: AnnotatedEvent
    """Set when no optimizer step of the model is in flight."""
    grad_sync: Optional[HostGradSync]
    """Gradient synchronisation across processes, or None."""

    def optim_units(self) -> Units:
        """(layer events, trainable parameters) per layer, each parameter once."""
        ...
