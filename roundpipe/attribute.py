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
               has just released: host buffers rotate, see transfer._grad_buffer)]

So an upload never reads host parameters the optimizer is writing, a gradient download never overwrites
a gradient the optimizer is still reading, and the optimizer never writes parameters an upload in
flight still reads. All "copied"/"started" events are set when nothing is pending.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

from roundpipe import backend
from roundpipe.backend import CpuEvent, Event
from roundpipe.threads import AnnotatedEvent


class LayerAttribute:
    """Events that order one layer's parameter and gradient traffic between threads (module docstring).

    Attributes:
        param_copied: Set when the optimizer has finished writing this layer's model parameters.
        param_upload_started: Set when the latest upload was issued and ``param_uploaded`` recorded.
        param_uploaded: Device event: the latest parameter upload has finished reading host memory.
        grad_copied: Set when the optimizer has finished reading this layer's gradients.
        grad_download_started: Set when the latest gradient download was issued and recorded.
        grad_downloaded: Device event: the latest gradient download has landed in host memory.
        buffer_downloaded: Device event: the latest buffer download has landed in host memory.
    """

    def __init__(self, layer_id: int, name: str = "") -> None:
        self.layer_id = layer_id
        self.param_copied = AnnotatedEvent(f"{name}.param_copied", set=True)
        self.param_upload_started = AnnotatedEvent(f"{name}.param_upload_started", set=True)
        self.param_uploaded: Event = CpuEvent()
        self.grad_copied = AnnotatedEvent(f"{name}.grad_copied", set=True)
        self.grad_download_started = AnnotatedEvent(f"{name}.grad_download_started", set=True)
        self.grad_downloaded: Event = CpuEvent()
        # Device event: the latest forward's buffer download (e.g. BatchNorm running stats) has landed.
        # Owned by the device thread that downloads; the next upload of the layer waits for it.
        self.buffer_downloaded: Event = CpuEvent()

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


class ParamAttribute:
    """Host-side state of one parameter, attached to the parameter tensor.

    A parameter may be shared by several layers (tied embeddings). Each layer then downloads its share
    of the gradient into ``grad_cpu[layer_id]``; the main thread adds the shares into ``param.grad``
    when backward completes. A parameter used by a single layer downloads straight into ``param.grad``.

    Attributes:
        layer_ids: Layers (indices in the RoundPipe) that use this parameter.
        grad_cpu: Per-layer gradient shares for shared parameters.
        grad_buffer: Reusable pinned gradient buffers of a *shared* parameter, per layer; a second
            one only while the optimizer reads the first as its ``.grad`` (``transfer._grad_buffer``).
        spare: Host buffers of the parameter's shape and dtype that no role uses now, with whether
            each is pinned. An unshared parameter's
            host buffers rotate through three roles (``transfer._grad_buffer`` explains the cycle):
            gradient download target, the optimizer's ``.grad`` (``held``), staging buffer, model
            parameter; a buffer leaves a role into ``spare`` and the next role takes it from there.
        held: The gradient buffer handed to the optimizer as its ``.grad``, until its ``zero_grad``
            lets go of it (``release_held``).
        optim: The optimizer's copy of the parameter (``optim_dtype``), or the parameter itself.
        optim_grad_buffer: Reusable buffer for the optimizer copy's gradient.
        staged: The optimizer's newest version in the parameter's dtype, written at the end of an
            asynchronous step and swapped in as the model parameter by the next one (optimizer
            thread only; see ``roundpipe.optim.step.stage_params``).
        staged_valid: Whether ``staged`` holds the optimizer's current version.
    """

    ATTR = "_roundpipe_param_attr"

    def __init__(self) -> None:
        self.layer_ids: List[int] = []
        self.grad_cpu: Dict[int, Optional[torch.Tensor]] = {}
        self.grad_buffer: Dict[int, List[torch.Tensor]] = {}
        self.optim: Optional[torch.nn.Parameter] = None
        self.optim_grad_buffer: Optional[torch.Tensor] = None
        self.spare: List[Tuple[torch.Tensor, bool]] = []  # (buffer, whether pinned)
        self.held: Optional[torch.Tensor] = None
        self.staged: Optional[torch.Tensor] = None
        self.staged_valid = False

    @property
    def shared(self) -> bool:
        return len(self.layer_ids) > 1

    def take_spare(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> Optional[torch.Tensor]:
        """A spare buffer of ``shape`` and ``dtype`` (now owned by the caller), pinned if ``pinned``,
        or None. A pageable spare that cannot serve a pinned request is dropped (the caller allocates a
        pinned one instead: with ``pin_model='off'`` the first model buffer is pageable)."""
        with _SPARE_LOCK:
            keep: List[Tuple[torch.Tensor, bool]] = []
            found: Optional[torch.Tensor] = None
            for b, is_pinned in self.spare:
                if found is None and b.shape == shape and b.dtype == dtype:
                    if is_pinned or not pinned:
                        found = b
                    continue  # taken, or a pageable one that cannot serve: dropped
                keep.append((b, is_pinned))
            self.spare = keep
        return found

    def give_spare(self, buf: torch.Tensor) -> None:
        """Return ``buf`` (no longer read or written by anything) for the next role to take."""
        pinned = backend.pin_enabled() and buf.is_pinned()
        with _SPARE_LOCK:
            self.spare.append((buf, pinned))

    def trim_spare(self) -> None:
        """Keep at most one spare (the next gradient download's buffer): an optimizer that kept its
        ``.grad`` for a step (gradient accumulation) leaves an extra one behind, which is freed here."""
        with _SPARE_LOCK:
            del self.spare[1:]

    def release_held(self) -> Optional[torch.Tensor]:
        """The buffer handed to the optimizer as its ``.grad``, once the optimizer no longer holds it
        (its ``zero_grad`` ran; ownership passes to the caller); None while it does or if none was."""
        with _SPARE_LOCK:
            held = self.held
            if held is None:
                return None
            g = self.optim.grad if self.optim is not None else None
            if g is not None and g.numel() > 0 and g.data_ptr() == held.data_ptr():
                return None
            self.held = None
            return held

    def host_buffers(self, param: torch.Tensor) -> List[torch.Tensor]:
        """Every distinct host tensor of the parameter's shape this attribute knows (model data,
        staging, gradient, spare and per-layer buffers): what its host memory costs, for tests."""
        found: Dict[int, torch.Tensor] = {}
        grads = [param.grad, self.held, self.optim.grad if self.optim is not None else None]
        spare = [b for b, _ in self.spare]
        for t in [param.data, self.staged, *grads, *spare, *(b for bufs in self.grad_buffer.values() for b in bufs)]:
            if t is not None and t.device.type == "cpu" and t.shape == param.shape and t.numel() > 0:
                found.setdefault(t.data_ptr(), t)
        return list(found.values())

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


# Guards ``ParamAttribute.spare`` and ``held``: device threads take download buffers while the optimizer
# thread gives buffers back and takes staging buffers.
_SPARE_LOCK = threading.Lock()
