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
``shard_optimizer=True``): its ``step_sync`` attribute (None when it does not) is a
``roundpipe.host.protocol.StepSync``,
which the step kernel (``roundpipe.host.step``) calls on the optimizer thread right
before ``step_fn`` (``before_step_fn``), right after it (``after_step_fn``; before the updated
optimizer copies are staged or copied into the model) and, instead of ``after_step_fn``, when the step
failed (``abort``). What the step kernel calls (``reduce_host``, ``step_sync``) is the host side's own
protocol, ``roundpipe.host.protocol.HostGradSync``, which :class:`GradSync` extends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

from torch import nn

from roundpipe.host.protocol import HostGradSync
from roundpipe.planning.plan import ModelExecutePlan, RunType

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager

LayerReducer = Callable[[nn.Module, nn.Module, int, "DeviceManager"], None]


@runtime_checkable
class GradSync(HostGradSync, Protocol):
    """Gradient synchronisation hooks of a RoundPipe model (see the module docstring)."""

    def agree_plan(self, model: Any, run_type: RunType, plan: ModelExecutePlan) -> ModelExecutePlan:
        """Main thread, before a call of ``model``: the plan to run."""

    def layer_reducer(self, model: Any, layer_id: int) -> Optional[LayerReducer]:
        """Main thread: the device reduction of ``model``'s layer ``layer_id``, or None."""


__all__ = ["GradSync", "LayerReducer"]
