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
from roundpipe.memory import pinned_empty
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
        staged_valid: Whether ``staged`` holds the optimizer's current version (with ``in_place``: whether
            the weights do).
        in_place: The weights themselves hold (``staged_valid``) or will hold the optimizer's current
            version, so the next publish leaves them in place: a gradient download took the old weights
            buffer and moved the weights to ``staged`` (``roundpipe.host_buffers.StepCycle``), so the step
            that stages writes the weights themselves; or the optimizer copy was just made from them
            (``mark_current``: then only while neither was written since, see ``weights_current``).
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
        self.in_place = False
        # (weights, optimizer copy) version counters when ``mark_current`` ran; None after a move.
        self.marked: Optional[Tuple[int, int]] = None

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

    def trim_spare(self, keep: int = 1) -> None:
        """Keep at most ``keep`` spares (one: the next gradient download's buffer; none once downloads
        take the weights' buffer, see ``in_place``): an optimizer that kept its ``.grad`` for a step
        (gradient accumulation) leaves an extra one behind, which is freed here."""
        with _SPARE_LOCK:
            del self.spare[keep:]

    def choose_staging(self, param: torch.Tensor, buf: torch.Tensor) -> bool:
        """Make ``buf`` (the gradient buffer a staged asynchronous step has just taken) the parameter's
        staging buffer, if it can hold the weights (same shape and dtype, pinned if they are); a staging
        buffer left from before goes to the spares. Optimizer thread, before the layer's ``grad_copied``."""
        # Each is_pinned is a CUDA query (this line took 60 ms of a qwen3-4b step on an H100 with two per
        # parameter): a download buffer is pinned whenever pinning is on, so asking it first needs one.
        if buf.shape != param.shape or buf.dtype != param.dtype or (not buf.is_pinned() and param.data.is_pinned()):
            return False
        with _SPARE_LOCK:
            old, self.staged, self.staged_valid = self.staged, buf, False
            if old is not None and not same_storage(old, buf):
                self.spare.append((old, backend.pin_enabled() and old.is_pinned()))
        return True

    def staging_target(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the step stages the parameter: the weights buffer once a download moved the weights
        there (``in_place``), else the staging buffer (None if there is none yet)."""
        with _SPARE_LOCK:
            return param.data if self.in_place else self.staged

    def mark_staged(self, param: torch.Tensor, buf: torch.Tensor) -> None:
        """The step has written the optimizer's current version into ``buf``: valid wherever it is now
        (still the staging buffer, or the weights after a download moved them there meanwhile)."""
        with _SPARE_LOCK:
            if same_storage(self.staged, buf) or (self.in_place and same_storage(param.data, buf)):
                self.staged_valid = True

    def mark_current(self, param: torch.Tensor) -> None:
        """The weights equal the optimizer copy's version (it was just made from them, or both were just
        made current): the next publish may leave them, unless code writes either before it (a
        checkpoint restore copies in the optimizer copies, then the weights of an older version)."""
        self.in_place = self.staged_valid = True
        self.marked = (param._version, self.optim._version if self.optim is not None else 0)

    def weights_current(self, param: torch.Tensor) -> bool:
        """With ``in_place``: whether the weights hold the optimizer's current version (staged there, or
        marked current and neither tensor written since: writes through ``param.data`` are not seen)."""
        if not self.staged_valid:
            return False
        return self.marked is None or self.marked == (
            param._version,
            self.optim._version if self.optim is not None else 0,
        )

    def move_weights(self, param: torch.Tensor, dtype: torch.dtype, pinned: bool) -> Optional[torch.Tensor]:
        """Move ``param``'s weights to the staging buffer and return the old weights buffer (now the
        caller's, for a gradient download of ``dtype``), or None when there is no staging buffer of the
        same kind to move to. Called by a device thread when its call has read the weights for the last
        time before the next publish (``roundpipe.host_buffers.StepCycle``); the step that stages into
        that buffer makes the weights current (``staged_valid``), the next publish leaves them there."""
        with _SPARE_LOCK:
            new, old = self.staged, param.data
            if new is None or self.in_place or new.shape != old.shape or new.dtype != old.dtype or old.dtype != dtype:
                return None
            # The download needs the old buffer pinned; the staging buffer is pinned whenever the weights
            # are (``choose_staging`` and ``optim.step.stage_params`` make it so): one query, not two.
            if pinned and not old.is_pinned():
                return None
            param.data, self.staged, self.in_place, self.marked = new, None, True, None
            return old

    def shared_grad_buffer(
        self, layer_id: int, dev_grad: torch.Tensor, seed: Optional[torch.Tensor], moved: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """A host buffer for one layer's share of a shared parameter's gradient (a device thread, in the
        layer's download): the old weights buffer ``moved`` (``move_weights`` at the owner's download);
        else its upload's ``seed`` (the cycle's running sum, ``transfer.host_grad``, added in on the
        device) in place, or ``fold_shared_grads`` would add the seed twice; else the layer's buffer
        (none of the list is the optimizer's ``.grad``: the step takes the owner's out of it,
        ``forget_grad_buffer``, and hands the others' sum over in the owner's or a copy); else a spare
        (built ahead by ``host_buffers``), else a new one."""
        bufs = [
            b for b in self.grad_buffer.get(layer_id, []) if b.shape == dev_grad.shape and b.dtype == dev_grad.dtype
        ]
        buf = moved if moved is not None else next((b for b in bufs if b is seed), bufs[0] if bufs else None)
        if buf is None:
            buf = self.take_spare(dev_grad.shape, dev_grad.dtype, backend.pin_enabled())
            buf = pinned_empty(dev_grad.shape, dev_grad.dtype) if buf is None else buf
        if not any(b is buf for b in bufs):
            bufs.append(buf)
        self.grad_buffer[layer_id] = bufs
        return buf

    def forget_grad_buffer(self, buf: torch.Tensor) -> None:
        """The step has taken ``buf``, a shared parameter's gradient buffer, as the optimizer's ``.grad``:
        it leaves its layer's list and rotates like an unshared parameter's (held, staged, weights,
        spare), so a tied weight has two host copies in the model dtype, not three. Optimizer thread:
        only the list holding ``buf`` changes, the owner's, whose downloads wait for ``grad_copied``."""
        for layer_id, bufs in list(self.grad_buffer.items()):  # (a snapshot: a device thread may add a layer)
            if any(b is buf for b in bufs):
                self.grad_buffer[layer_id] = [b for b in bufs if b is not buf]

    def release_held(self, to_spare: bool = False) -> Optional[torch.Tensor]:
        """The buffer handed to the optimizer as its ``.grad``, once the optimizer no longer holds it
        (its ``zero_grad`` ran; ownership passes to the caller); None while it does or if none was.

        ``to_spare``: put it straight into the spares instead (and return None), appended there before
        ``held`` lets go of it, so a count of the host buffers made meanwhile on another thread
        (:meth:`host_buffers`, which reads ``held`` before the spares) sees it in one role or the other."""
        with _SPARE_LOCK:
            held = self.held
            if held is None:
                return None
            g = self.optim.grad if self.optim is not None else None
            if g is not None and g.numel() > 0 and g.data_ptr() == held.data_ptr():
                return None
            if to_spare:
                self.spare.append((held, backend.pin_enabled() and held.is_pinned()))
            self.held = None
            return None if to_spare else held

    def host_buffers(self, param: torch.Tensor) -> List[torch.Tensor]:
        """Every distinct host tensor of the parameter's shape this attribute knows (model data,
        staging, gradient, spare and per-layer buffers): what its host memory costs, for tests. May run
        while a step hands buffers on (optimizer thread): it reads the gradient roles first, so a buffer
        given its next role before its old one lets go of it (``optim.step.copy_grad_to_optim``) is seen."""
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


def same_storage(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` are the same host buffer (``param.data`` is a new tensor object at each
    access, so identity does not tell)."""
    return a is not None and b is not None and a.numel() > 0 and a.data_ptr() == b.data_ptr() and a.shape == b.shape


# Guards ``ParamAttribute.spare`` and ``held``: device threads take download buffers while the optimizer
# thread gives buffers back and takes staging buffers.
_SPARE_LOCK = threading.Lock()
