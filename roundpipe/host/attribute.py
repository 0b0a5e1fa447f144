"""Per-layer and per-parameter state shared by the device threads, the main thread and the optimizer thread.

Event protocol of one layer (W&C = wait, then clear). The dispatching thread fences before each job; the
device thread sets the "started" event once its device event is recorded; the optimizer thread fences
on those before touching the host tensors the device copies read or write:

    forward:   wait param_copied -> W&C param_upload_started -> job [upload; set param_upload_started]
    backward:  the forward fence, then wait grad_copied -> W&C grad_download_started
               -> job [... download grads; set grad_download_started]
    optimizer: (main) W&C param_copied, W&C grad_copied -> optimizer thread [wait param_upload_started,
               sync param_uploaded -> copy optimizer params into model params (an asynchronous step
               swaps in the version the previous one staged) -> set param_copied;
               wait grad_download_started, sync grad_downloaded -> copy grads -> set grad_copied
               -> step -> stage the new version in buffers no upload reads (the gradient buffers it
               has just released: host buffers rotate, see roundpipe.host.buffers)]

So an upload never reads host parameters the optimizer is writing, a gradient download never overwrites
a gradient the optimizer is still reading, and the optimizer never writes parameters an upload in
flight still reads. All "copied"/"started" events are set when nothing is pending.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from roundpipe.devices.backend import CpuEvent, Event
from roundpipe.devices.threads import AnnotatedEvent


class LayerAttribute:
    """Events that order one layer's parameter and gradient traffic between threads (module docstring).

    Attributes:
        param_copied: Set when the optimizer has finished writing this layer's model parameters.
        param_upload_started: Set when the latest upload was issued and ``param_uploaded`` recorded.
        param_uploaded: Device event: the latest parameter upload has finished reading host memory.
        grad_copied: Set when the optimizer has finished reading this layer's gradients.
        grad_download_started: Set when the latest gradient download was issued and recorded.
        grad_downloaded: Device event: the latest gradient download has landed in host memory.

    A layer's buffers (e.g. BatchNorm's running statistics) keep their download event on the host buffer
    itself (``buffer_downloaded``): two wrappers of one model share its buffers, not their layer attributes.
    """

    def __init__(self, layer_id: int, name: str = "") -> None:
        self.layer_id = layer_id
        self.param_copied = AnnotatedEvent(f"{name}.param_copied", set=True)
        self.param_upload_started = AnnotatedEvent(f"{name}.param_upload_started", set=True)
        self.param_uploaded: Event = CpuEvent()
        self.grad_copied = AnnotatedEvent(f"{name}.grad_copied", set=True)
        self.grad_download_started = AnnotatedEvent(f"{name}.grad_download_started", set=True)
        self.grad_downloaded: Event = CpuEvent()

    def forward_fence(self, clear: bool = True) -> None:
        """Before a job uploads this layer: the optimizer's writes are done and the previous upload was issued."""
        self.param_copied.wait()
        self.param_upload_started.wait()
        if clear:
            self.param_upload_started.clear()

    def backward_fence(self, clear: bool = True) -> None:
        """Before a backward job: parameters ready (as for forward) and the optimizer done reading gradients."""
        self.forward_fence(clear)
        self.grad_copied.wait()
        self.grad_download_started.wait()
        if clear:
            self.grad_download_started.clear()

    def forward_backward_fence(self) -> None:
        """Fence for the fused forward + backward job: the same as backward."""
        self.backward_fence(clear=True)

    def reset(self) -> None:
        """Mark nothing pending (after a failed run, so the next run's fences do not wait forever)."""
        self.param_upload_started.set()
        self.grad_download_started.set()


_BUFFER_EVENT = "_roundpipe_downloaded"
_LANDED: Event = CpuEvent()  # a buffer never downloaded into


def buffer_downloaded(buffer: torch.Tensor) -> Event:
    """Device event: the latest download into host ``buffer`` (a module's buffer, e.g. BatchNorm's running
    statistics) has landed, whichever wrapper of the module issued it. Each upload of the buffer and each
    host read of it waits for this event, so the next call (of any wrapper) reads what the previous wrote."""
    return getattr(buffer, _BUFFER_EVENT, _LANDED)


def note_buffer_download(buffer: torch.Tensor, event: Event) -> None:
    """Record ``event`` as the latest download into host ``buffer`` (``buffer_downloaded``); only the device
    thread of the job that downloads writes it."""
    setattr(buffer, _BUFFER_EVENT, event)


def layer_buffers_landed(layer: torch.nn.Module) -> None:
    """Block until every download into ``layer``'s host buffers has landed (before the host reads them)."""
    for b in layer.buffers():
        buffer_downloaded(b).synchronize()


class ParamAttribute:
    """Which layers use one parameter, and its optimizer copy; attached to the parameter tensor.

    A parameter may be shared by several layers (tied embeddings): each layer then downloads its share
    of the gradient, summed before the step. Its host buffers and their roles (weights, gradient,
    staged version, spares) belong to ``roundpipe.host.buffers.ParamBuffers``.

    Attributes:
        layer_ids: Layers (indices in the RoundPipe) that use this parameter.
        optim: The optimizer's copy of the parameter (``optim_dtype``), or None before it is made.
    """

    ATTR = "_roundpipe_param_attr"

    def __init__(self) -> None:
        self.layer_ids: List[int] = []
        self.optim: Optional[torch.nn.Parameter] = None

    @property
    def shared(self) -> bool:
        return len(self.layer_ids) > 1

    @classmethod
    def get(cls, t: torch.Tensor) -> "ParamAttribute":
        return getattr(t, cls.ATTR)

    @classmethod
    def has(cls, t: torch.Tensor) -> bool:
        return hasattr(t, cls.ATTR)

    @classmethod
    def set(cls, t: torch.nn.Parameter, layer_id: Optional[int]) -> "ParamAttribute":
        """Attach (or extend) the attribute of ``t`` and register ``layer_id`` as a user of it."""
        if not cls.has(t):
            setattr(t, cls.ATTR, cls())
        attr = cls.get(t)
        if layer_id is not None and layer_id not in attr.layer_ids:
            attr.layer_ids.append(layer_id)
        return attr
