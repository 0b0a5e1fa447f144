"""The interface through which the core synchronises gradients across processes.

The runtime knows nothing of torch.distributed: a model's ``grad_sync`` attribute (None for local
training) is an object with the four calls below, made at fixed points of an iteration. Data parallel
(``roundpipe.distributed``) implements it; so could any other scheme (a parameter server, gradient
compression). The core calls, and nothing else:

* ``on_step_launch()``: main thread, at the start of ``model.step``: a step boundary.
* ``reduce_host(params)``: optimizer thread, once per optimizer unit (a layer's trainable parameters,
  in the order the step visits them), after the unit's gradients have landed on the host and before
  they are copied into the optimizer's parameters. It may change ``p.grad`` in place.
* ``agree_plan(model, run_type, plan)``: main thread, before each call of a RoundPipe model: the plan
  to run instead of the local one (ranks reducing on the devices must run the same jobs), and it may
  move the dispatcher (``roundpipe.devices.dispatch.dispatcher.seek``) so every rank starts at the same device.
* ``layer_reducer(model, layer_id)``: main thread, once per call: a callable that reduces the layer's
  gradients on the device at the end of its backward job, or None (the host reduces them). The device
  thread calls it as ``reduce(host_layer, device_layer, layer_id, device)`` on the gradient stream,
  right after that stream waited for the compute, before the gradient download. A layer with a reducer
  gets no gradient seed on upload: the reducer adds the accumulated host gradient itself (after
  weighting this rank's share).

An implementation may also share the optimizer step itself across processes (data parallel with
``shard_optimizer=True``): its ``step_sync`` attribute (None when it does not) is a :class:`StepSync`,
which the step kernel (``roundpipe.optim.step``) calls on the optimizer thread right
before ``step_fn`` (``before_step_fn``), right after it (``after_step_fn``; before the updated
optimizer copies are staged or copied into the model) and, instead of ``after_step_fn``, when the step
failed (``abort``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, runtime_checkable

from torch import nn

from roundpipe.planning.plan import ModelExecutePlan, RunType

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager

LayerReducer = Callable[[nn.Module, nn.Module, int, "DeviceManager"], None]


@runtime_checkable
class GradSync(Protocol):
    """Gradient synchronisation hooks of a RoundPipe model (see the module docstring)."""

    step_sync: Optional["StepSync"]
    """The optimizer step shared across processes, or None (each process steps all its parameters)."""

    def on_step_launch(self) -> None:
        """Main thread, at the start of ``model.step``."""

    def reduce_host(self, params: List[nn.Parameter]) -> None:
        """Optimizer thread: reduce one unit's host gradients before the optimizer reads them."""

    def agree_plan(self, model: Any, run_type: RunType, plan: ModelExecutePlan) -> ModelExecutePlan:
        """Main thread, before a call of ``model``: the plan to run."""

    def layer_reducer(self, model: Any, layer_id: int) -> Optional[LayerReducer]:
        """Main thread: the device reduction of ``model``'s layer ``layer_id``, or None."""


@runtime_checkable
class StepSync(Protocol):
    """Optimizer-step hooks of a ``grad_sync`` that shares the step across processes (module docstring).
    ``units`` are the step's optimizer units (``RoundPipeBase.optim_units()``)."""

    def before_step_fn(self, units: List[Any], is_async: bool) -> None:
        """Optimizer thread: the gradients are handed over; ``step_fn`` runs next."""

    def after_step_fn(self, units: List[Any]) -> None:
        """Optimizer thread: ``step_fn`` returned; the optimizer copies are read next."""

    def abort(self) -> None:
        """Optimizer thread: the step failed between ``before_step_fn`` and ``after_step_fn``."""
