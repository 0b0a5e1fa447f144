"""The owner of every parameter's host buffers: which role each buffer has, and every change of role.

A trainable parameter has host buffers in the model dtype (pinned when pinning is on) that take turns
in five roles. Only this module moves a buffer from one role to another; the device threads
(``transfer``, ``tied_grads``), the main thread (``roundpipe``, ``step_cycle``) and the optimizer thread
(``step``) ask a :class:`ParamBuffers` for a buffer in a role and hand it back.

    WEIGHTS   ``param.data``: read by parameter uploads (device threads, parameter stream)
    GRAD      the download target, ``param.grad`` (tied weights: a share per layer, ``shares``): written by
              gradient downloads (gradient stream), read by the step's hand-over and by the next upload
              as its seed (gradient accumulation)
    HELD      the optimizer copy's ``.grad``: read by the optimizer until its ``zero_grad``
    STAGED    the optimizer's next version, written by an asynchronous step, published by the next one
    SPARE     nobody's: the next role takes it from there

Life cycle of one unshared parameter under staged asynchronous steps (the default step mode,
``step_mode.StepMode``; arrows: the thread
that moves the buffer, then the fence that makes the move safe):

    SPARE --(1) device thread: download_target--> GRAD --(2) optimizer thread: hand_over--> HELD+STAGED
      ^                                                                                       |
      | (4) optimizer thread: publish (old weights)        (3) optimizer thread: stage,        |
      |                                                        after step_fn let go of HELD    v
    WEIGHTS <---------------------------------------(4) publish, the next step----------- STAGED

 (1) The backward fence waited for the layer's ``grad_copied``, which the step sets after (2) and (4)
     of the previous step: the spare it takes (the old weights) is no longer read by any upload.
 (2) After ``grad_download_started`` and the device event ``grad_downloaded``: the download landed.
     The buffer becomes the optimizer's ``.grad`` and, at once, the staging buffer it will hold next;
     the main thread cleared ``grad_copied`` before queuing the step, so no download takes it meanwhile.
 (3) After ``step_fn``: ``zero_grad`` let go of HELD (an optimizer that keeps its ``.grad`` gets a copy
     of its own first, ``_keep_grad_apart``); the running call's uploads read WEIGHTS, not STAGED.
 (4) After ``wait_uploads`` (``param_upload_started`` then the device event ``param_uploaded``): no upload
     reads the old weights, which become the spare of (1); then the step sets ``param_copied``.

Variants, each a different path through the same roles:
- Staged mode, where ``step_cycle.StepCycle`` allows it: (1) takes WEIGHTS itself and the
  weights move into STAGED (``move_weights``, device thread, under the lock). Safe without a wait: the
  download follows the call's last upload of the layer on the same device (compute waited for the
  upload, the gradient stream for compute) and the step chose STAGED before ``grad_copied``; nothing
  reads the weights there before the next publish, which finds them current (``in_place``).
- A tied weight: layers above the owner (its lowest layer) download their shares into per-layer share
  buffers (or keep them on the device, ``tied_grads``); the main thread folds them into the owner's
  (``fold_shares``) after the call; the owner's buffer then rotates like an unshared one.
- Synchronous and streamed steps: no STAGED; HELD becomes SPARE after the step (``release_after_step``),
  publish copies. In streamed mode a download that finds no spare waits on its device thread for the
  optimizer thread (``_wait_for_release``, the one such wait) instead of making a second gradient buffer:
  the step holding the buffer waits only for downloads of earlier calls, so it finishes.

Locking: ``_LOCK`` guards the lists and fields that a device thread and the optimizer thread change at
once (spares, HELD, STAGED and the weights' move). Everything else is ordered by the events above.
Tests turn on ``enable_role_checks``: each transition then asserts its conditions (:class:`RoleError`).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.devices import backend
from roundpipe.devices.memory import pinned_empty
from roundpipe.host import optim_thread
from roundpipe.host.attribute import ParamAttribute

# Guards ``spare``, ``held``, ``staged`` and the weights' move: device threads take download buffers while
# the optimizer thread gives buffers back and chooses staging buffers.
_LOCK = threading.Lock()
_CREATE_LOCK = threading.Lock()  # guards the first ``ParamBuffers.of`` of a parameter
_checks = False  # role checks on every transition (tests only: ``enable_role_checks``)


class RoleError(AssertionError):
    """A buffer was found in a role it must not have at this transition (role checks on)."""


def enable_role_checks(on: bool = True) -> None:
    """Make every transition assert its role conditions (tests; a few tensor comparisons per call)."""
    global _checks
    _checks = on


def same_storage(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` are the same host buffer (``param.data`` is a new tensor object at each
    access, so identity does not tell)."""
    return a is not None and b is not None and a.numel() > 0 and a.data_ptr() == b.data_ptr() and a.shape == b.shape


class ParamBuffers:
    """One parameter's host buffers and their roles (the module docstring's diagram).

    Attributes:
        attr: The parameter's ``ParamAttribute`` (its layers and optimizer copy).
        shares: Tied weights: each layer's gradient share (GRAD) this call, until folded.
        share_buffers: Tied weights: reusable share buffers per layer (none of them HELD or STAGED).
        spare: SPARE buffers, with whether each is pinned.
        held: HELD: the buffer handed to the optimizer as its ``.grad``, until its ``zero_grad``.
        downloads_wait: A download finding no spare waits for HELD's release (streamed mode's one
            gradient buffer) instead of making another.
        staged: STAGED: the optimizer's next version in the model dtype (asynchronous steps).
        staged_valid: Whether ``staged`` (with ``in_place``: the weights) holds the optimizer's version.
        staged_of: The optimizer copy's version counter when ``staged`` was written from it: a publish
            swaps ``staged`` in only while the copy is unchanged (a checkpoint restore writes it).
        in_place: The weights hold (``staged_valid``) or will hold the optimizer's current version, so the
            next publish leaves them: a download moved them into STAGED, or ``mark_current`` ran.
        marked: (weights, optimizer copy) version counters at ``mark_current``; None after a move.
        optim_grad_buffer: The optimizer copy's gradient when it is copied (another dtype), reused.
    """

    ATTR = "_roundpipe_host_buffers"

    def __init__(self, attr: ParamAttribute) -> None:
        self.attr = attr
        self.shares: Dict[int, Optional[torch.Tensor]] = {}
        self.share_buffers: Dict[int, List[torch.Tensor]] = {}
        self.spare: List[Tuple[torch.Tensor, bool]] = []
        self.held: Optional[torch.Tensor] = None
        self.downloads_wait = False
        self.staged: Optional[torch.Tensor] = None
        self.staged_valid = False
        self.staged_of: Optional[int] = None
        self.in_place = False
        self.marked: Optional[Tuple[int, int]] = None
        self.optim_grad_buffer: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, p: torch.Tensor) -> "ParamBuffers":
        """The buffers of ``p`` (which has a ``ParamAttribute``), made at the first ask (under a lock:
        a device thread and the optimizer thread may ask first at once)."""
        bufs = getattr(p, cls.ATTR, None)
        if bufs is None:
            with _CREATE_LOCK:
                bufs = getattr(p, cls.ATTR, None)
                if bufs is None:
                    bufs = cls(ParamAttribute.get(p))
                    setattr(p, cls.ATTR, bufs)
        return bufs

    @property
    def optim(self) -> Optional[nn.Parameter]:
        return self.attr.optim

    # ---- SPARE ----------------------------------------------------------------------------------------
    def take_spare(self, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> Optional[torch.Tensor]:
        """A spare of ``shape`` and ``dtype`` (now the caller's), pinned if ``pinned``, or None. A pageable
        spare that cannot serve a pinned request is dropped (the caller allocates a pinned one: with
        ``pin_model='off'`` the first weights are pageable)."""
        with _LOCK:
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
        """``buf`` (no longer read or written by anything) becomes SPARE."""
        pinned = backend.pin_enabled() and buf.is_pinned()
        with _LOCK:
            self.spare.append((buf, pinned))

    def trim_spare(self, keep: int = 1) -> None:
        """Keep at most ``keep`` spares (one: the next download's; none once downloads take the weights'
        buffer): an optimizer that kept its ``.grad`` for a step leaves an extra one, freed here."""
        with _LOCK:
            del self.spare[keep:]

    def spares_to_build(self, p: torch.Tensor, want: int, sharers: int) -> int:
        """How many spares the background builder (``step_cycle``) should add so that the first downloads
        find ``want`` (plus one per other layer downloading its own share, ``sharers``)."""
        have = sum(1 for b, _ in list(self.spare) if b.shape == p.shape and b.dtype == p.dtype)
        if self.attr.shared:
            # (snapshots: the device threads may add a layer's list meanwhile)
            have += sum(len(bs) for bs in list(self.share_buffers.values())) + (self.staged is not None)
        return max(0, want + sharers - have)

    # ---- GRAD: device threads ----------------------------------------------------------------------------
    def seed(self, p: torch.Tensor, layer_id: int) -> Optional[torch.Tensor]:
        """The GRAD buffer of ``layer_id`` that its next upload adds in (gradients accumulate across calls
        until a step takes them), or None."""
        if not self.attr.shared:
            return p.grad
        g = self.shares.get(layer_id)
        if (
            g is None
            and layer_id == min(self.attr.layer_ids)
            and p.grad is not None
            and any(p.grad is b for b in self.share_buffers.get(layer_id, []))
        ):
            return p.grad  # fold_shares summed the shares into this layer's buffer: the running sum
        return g

    def download_target(
        self, p: torch.Tensor, layer_id: int, dev_grad: torch.Tensor, into_weights: bool = False
    ) -> torch.Tensor:
        """A host buffer for ``layer_id``'s download of ``dev_grad`` (device thread, in the layer's
        ``download_layer``): (1) of the diagram. The gradient still accumulating (the seed) is written in
        place; else, with ``into_weights``, the weights' buffer (``move_weights``); else a spare; else,
        in streamed mode, the buffer the step in flight releases; else a new one.
        Never a buffer the optimizer reads or writes: the backward fence waited for ``grad_copied``."""
        pinned = backend.pin_enabled()  # asynchronous downloads need pinned memory
        if self.attr.shared:
            buf = self._share_target(p, layer_id, dev_grad, into_weights, pinned)
        else:
            g = p.grad
            if g is not None and g.device.type == "cpu" and g.shape == dev_grad.shape and g.dtype == dev_grad.dtype:
                buf = g
            else:
                moved = self.move_weights(p, dev_grad.dtype, pinned) if into_weights and g is None else None
                buf = moved if moved is not None else self._spare_or_new(dev_grad, pinned)
        if _checks:
            self._check_download(p, buf)
        return buf

    def _spare_or_new(self, dev_grad: torch.Tensor, pinned: bool) -> torch.Tensor:
        buf = self.take_spare(dev_grad.shape, dev_grad.dtype, pinned)
        if buf is None and self.held is not None and self.downloads_wait:
            self._wait_for_release()
            buf = self.take_spare(dev_grad.shape, dev_grad.dtype, pinned)
        if buf is None:
            buf = pinned_empty(dev_grad.shape, dev_grad.dtype)  # exact size: it lives as long as the model
        return buf

    @staticmethod
    def _wait_for_release() -> None:
        """The one place a device thread waits for the optimizer thread: until the step kernels queued
        so far have run (their ``zero_grad`` and ``stage_params`` / ``release_after_step`` make HELD a
        spare). No deadlock: those kernels wait only for downloads of earlier calls (the next step is
        queued after every job of this call, ``pipeline.guarded``)."""
        optim_thread.synchronize()

    def _share_target(
        self, p: torch.Tensor, layer_id: int, dev_grad: torch.Tensor, into_weights: bool, pinned: bool
    ) -> torch.Tensor:
        """A tied weight's share buffer for ``layer_id``: the old weights (``move_weights`` at the owner's
        download, the call's last use of the weight); else its upload's seed in place (or the fold would
        add the seed twice); else the layer's share buffer; else a spare (built ahead by ``step_cycle``),
        else a new one. No share buffer is HELD: ``hand_over`` takes the owner's out of the list."""
        seed = self.seed(p, layer_id)
        moved = (
            self.move_weights(p, dev_grad.dtype, pinned)
            if into_weights and layer_id == min(self.attr.layer_ids) and seed is None
            else None
        )
        bufs = [
            b for b in self.share_buffers.get(layer_id, []) if b.shape == dev_grad.shape and b.dtype == dev_grad.dtype
        ]
        buf = moved if moved is not None else next((b for b in bufs if b is seed), bufs[0] if bufs else None)
        if buf is None:
            buf = self.take_spare(dev_grad.shape, dev_grad.dtype, pinned)
            buf = pinned_empty(dev_grad.shape, dev_grad.dtype) if buf is None else buf
        if not any(b is buf for b in bufs):
            bufs.append(buf)
        self.share_buffers[layer_id] = bufs
        return buf

    def download_issued(self, p: torch.Tensor, layer_id: int, buf: Optional[torch.Tensor]) -> None:
        """``buf`` (from :meth:`download_target`) is ``layer_id``'s GRAD now, its download issued; None: the
        share stays on the device (``tied_grads.TiedGrads.keep``)."""
        if self.attr.shared:
            self.shares[layer_id] = buf
        else:
            p.grad = buf

    def take_share(self, layer_id: int) -> Optional[torch.Tensor]:
        """A sharer's GRAD share for the owner's device to add in (``TiedGrads.fetch``, after the sharer's
        download was issued): it leaves GRAD, so the fold does not add it again."""
        share = self.shares.get(layer_id)
        if share is not None:
            self.shares[layer_id] = None
        return share

    def move_weights(self, p: torch.Tensor, dtype: torch.dtype, pinned: bool) -> Optional[torch.Tensor]:
        """WEIGHTS -> GRAD, STAGED -> WEIGHTS (staged mode): return the old weights buffer for a
        download of ``dtype``, or None when there is no staging buffer of the same kind (module docstring:
        why no wait is needed). The step staging into it makes the weights current (``staged_valid``)."""
        with _LOCK:
            new, old = self.staged, p.data
            if new is None or self.in_place or new.shape != old.shape or new.dtype != old.dtype or old.dtype != dtype:
                return None
            # The download needs the old buffer pinned; the staging buffer is pinned whenever the weights
            # are (``choose_staging`` and ``stage`` make it so): one query, not two.
            if pinned and not old.is_pinned():
                return None
            p.data, self.staged, self.in_place, self.marked = new, None, True, None
            return old

    # ---- GRAD: main thread ----------------------------------------------------------------------------
    def fold_shares(self, p: nn.Parameter) -> None:
        """Tied weight, after the call: add the layers' shares into ``p.grad``, which becomes the owner's
        share buffer (no copy: its optimizer unit and ``grad_copied`` guard the parameter); the owner's
        next upload is seeded from it. (A fresh clone cost ~45 ms of page faults per iteration on a
        151k x 2048 tied embedding.) Only the owner's buffer may be aliased: another layer's is
        overwritten by its next download, which does not wait for this parameter's step."""
        owner = min(self.attr.layer_ids)
        shares = [(lid, g) for lid, g in sorted(self.shares.items()) if g is not None]
        if not shares:
            return
        if p.grad is None:
            lid, g = shares.pop(0)
            p.grad = g if lid == owner else g.clone()
        for _, g in shares:
            if g is not p.grad:
                p.grad.add_(g)
        for lid in self.shares:
            self.shares[lid] = None

    def mark_current(self, p: torch.Tensor) -> None:
        """The weights equal the optimizer copy's version (it was just made from them, or both were just
        made current): the next publish may leave them, unless code writes either before it (a
        checkpoint restore copies in the optimizer copies, then the weights of an older version)."""
        self.in_place = self.staged_valid = True
        self.marked = (p._version, self.optim._version if self.optim is not None else 0)

    def weights_current(self, p: torch.Tensor) -> bool:
        """With ``in_place``: whether the weights hold the optimizer's current version (staged there, or
        marked current and neither tensor written since: writes through ``param.data`` are not seen)."""
        if not self.staged_valid:
            return False
        if self.marked is None:  # staged there: current while the optimizer copy is unchanged since
            return self._staged_current()
        return self.marked == (p._version, self.optim._version if self.optim is not None else 0)

    def _staged_current(self) -> bool:
        """Whether the optimizer copy is still the version ``stage`` wrote from (a restore bumps it)."""
        return self.staged_of is None or self.optim is None or self.staged_of == self.optim._version

    # ---- GRAD -> HELD, STAGED, WEIGHTS: optimizer thread -----------------------------------------------------
    def hand_over(
        self, p: nn.Parameter, stage_into_grad: bool, low_precision_ok: bool, downloads_wait: bool = False
    ) -> None:
        """(2): add GRAD into the optimizer copy's gradient and clear ``p.grad`` (the optimizer's ``.grad``
        accumulates until its ``zero_grad``). In the optimizer's dtype (or bfloat16 it reads as fp32:
        ``low_precision_ok``) the buffer itself becomes HELD, no copy (fp32 masters: 4 bytes per
        parameter and 6 of memory traffic). ``stage_into_grad`` (a staged asynchronous step): it becomes
        STAGED too, so a download of the next call may move the weights there before the step is done.
        ``downloads_wait`` (a streamed step): a download finding no spare waits for HELD's release."""
        optim, g = self.optim, p.grad
        if optim is None or g is None:
            return
        with torch.no_grad():
            widened = g.dtype is torch.bfloat16 and optim.dtype is torch.float32 and low_precision_ok
            if optim.grad is None and (widened or (g.dtype == optim.dtype and g.shape == optim.shape)):
                if widened:
                    optim.grad_dtype = None  # let .grad be bfloat16 on this fp32 parameter
                optim.grad = g
                self.downloads_wait = downloads_wait  # (before ``held``: a device thread reads them in that order)
                self.held = g  # released after the step (stage, release_after_step)
                if self.attr.shared:
                    self._forget_share_buffer(g)  # a tied weight's buffer rotates from here like any other
                if stage_into_grad:
                    self.choose_staging(p, g)
                g = None
            elif optim.grad is None:
                buf = self.optim_grad_buffer
                if buf is None or buf.shape != optim.shape or buf.dtype != optim.dtype:
                    buf = self.optim_grad_buffer = torch.empty_like(optim)
                buf.copy_(g)
                optim.grad = buf
            else:
                if optim.grad.dtype != optim.dtype:
                    # A handed-over gradient not yet cleared by zero_grad: accumulate in a copy of the
                    # optimizer's dtype, which also gives the buffer back to the downloads.
                    optim.grad = optim.grad.to(optim.dtype)
                    self.release_held(to_spare=True)
                optim.grad.add_(g.to(optim.dtype))
        # Copied: the buffer takes its next role (STAGED, else SPARE) before ``p.grad`` lets go of it, so it
        # always has one (``host_buffers`` may count on the main thread meanwhile, reading ``p.grad``
        # first). No download takes the spare before ``grad_copied``.
        if g is not None and not self.attr.shared and not (stage_into_grad and self.choose_staging(p, g)):
            self.give_spare(g)
        p.grad = None
        if _checks:
            self._check_disjoint(p, "hand_over", [("weights", p.data)], [("optimizer .grad", optim.grad)])

    def _forget_share_buffer(self, buf: torch.Tensor) -> None:
        """``buf``, a tied weight's share buffer, became HELD: it leaves its layer's list (only the owner's,
        whose downloads wait for ``grad_copied``, changes; a snapshot: a device thread may add a layer)."""
        for layer_id, bufs in list(self.share_buffers.items()):
            if any(b is buf for b in bufs):
                self.share_buffers[layer_id] = [b for b in bufs if b is not buf]

    def choose_staging(self, p: torch.Tensor, buf: torch.Tensor) -> bool:
        """Make ``buf`` (just handed over) STAGED if it can hold the weights (shape, dtype, pinned if they
        are); an older staging buffer becomes SPARE. Before the layer's ``grad_copied``."""
        # Each is_pinned is a CUDA query (60 ms of a qwen3-4b step on an H100 with two per parameter): a
        # download buffer is pinned whenever pinning is on, so asking it first needs one.
        if buf.shape != p.shape or buf.dtype != p.dtype or (not buf.is_pinned() and p.data.is_pinned()):
            return False
        with _LOCK:
            old, self.staged, self.staged_valid = self.staged, buf, False
            if old is not None and not same_storage(old, buf):
                self.spare.append((old, backend.pin_enabled() and old.is_pinned()))
        return True

    def release_held(self, to_spare: bool = False) -> Optional[torch.Tensor]:
        """HELD, once the optimizer let go of it (its ``zero_grad`` ran; now the caller's), else None.
        ``to_spare``: it becomes SPARE instead (appended before ``held`` lets go, so a count on another
        thread, :meth:`host_buffers`, which reads ``held`` first, sees it in one role or the other)."""
        with _LOCK:
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

    def stage(self, p: torch.Tensor, written: Optional[torch.Tensor] = None) -> None:
        """(3), the end of an asynchronous step: write the optimizer's version into STAGED (into the weights
        if a download moved them there: nothing reads them before the next publish), published by the
        next step. The running call's uploads read WEIGHTS, not STAGED: no event needed.
        ``written``: the buffer the optimizer already wrote this version into (:meth:`fused_target`)."""
        optim = self.optim
        with _LOCK:
            target = p.data if self.in_place else self.staged
        if target is not None and same_storage(self.held, target):
            self._keep_grad_apart(target)
        freed = self.release_held()
        if same_storage(freed, target):
            freed = None
        if optim is None:
            if freed is not None:
                self.give_spare(freed)
            return
        if target is None or target.shape != p.shape or target.dtype != p.dtype:
            pinned = p.data.is_pinned()  # uploads read the staged buffer once published
            if target is not None:
                self.give_spare(target)
            if (
                freed is not None
                and freed.shape == p.shape
                and freed.dtype == p.dtype
                and (not pinned or freed.is_pinned())
            ):
                target, freed = freed, None
            else:
                target = self.take_spare(p.shape, p.dtype, pinned)
                if target is None:
                    target = pinned_empty(p.shape, p.dtype, pin=pinned)
            self.staged = target
        if freed is not None:
            self.give_spare(freed)
        self.trim_spare()
        if _checks:
            self._check_stage(p, target)
        if not same_storage(written, target):
            target.copy_(optim.data)
        self.staged_of = optim._version
        with _LOCK:  # valid wherever it is now: STAGED, or the weights after a download moved them there
            if same_storage(self.staged, target) or (self.in_place and same_storage(p.data, target)):
                self.staged_valid = True

    def _keep_grad_apart(self, buf: torch.Tensor) -> None:
        """The optimizer still holds STAGED ``buf`` as its ``.grad`` (no ``zero_grad``): move that gradient
        into a tensor of its own, in the optimizer's dtype, so the buffer can take the new weights."""
        optim = self.optim
        g = optim.grad if optim is not None else None
        if optim is not None and g is not None and same_storage(g, buf):
            optim.grad = g.to(optim.dtype, copy=True)

    def publish(
        self, p: torch.Tensor, use_staged: bool, written: bool = False, downloads_into_weights: bool = False
    ) -> None:
        """(4): make the weights the optimizer's current version, after ``wait_uploads`` (the caller's,
        per layer). ``use_staged`` (an asynchronous step's publish): weights already current
        (``in_place``) stay, a valid STAGED becomes WEIGHTS and the old weights SPARE; else a copy, which
        makes any staged version obsolete. ``written``: the optimizer wrote the weights itself (a
        streamed step's fused conversion): no copy. ``downloads_into_weights`` (staged mode): weights left in
        place keep no spare, since the next downloads take their buffer."""
        optim = self.optim
        if optim is None:
            return
        if self.in_place:
            # A publish leaves current weights; a copy after a synchronous step does not.
            if not (use_staged and self.weights_current(p)) and not written:
                p.data.copy_(optim.data)
            if use_staged and downloads_into_weights:
                self.trim_spare(keep=0)  # downloads take the weights' buffer: no spare needed
        elif use_staged and self.staged_valid and self.staged is not None and self._staged_current():
            old, p.data, self.staged = p.data, self.staged, None
            self.give_spare(old)
        elif not written:
            p.data.copy_(optim.data)
        # Not "in place" after a copy outside a publish either: code that restores a checkpoint copies
        # the optimizer copies in, then the weights of the running (one step older) version.
        self.in_place = self.staged_valid = False
        if _checks:
            self._check_disjoint(p, "publish", [("weights", p.data)], [("optimizer .grad", optim.grad)])

    def release_after_step(self) -> None:
        """After a synchronous or streamed step: HELD the optimizer let go of becomes SPARE, and so does
        a STAGED an earlier asynchronous step left (this step made it obsolete)."""
        self.release_held(to_spare=True)
        if self.staged is not None:
            self.give_spare(self.staged)
            self.staged, self.staged_valid = None, False
        self.trim_spare()

    def fused_target(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The buffer :meth:`stage` will write, for an optimizer that writes it in its pass (fused staging)."""
        with _LOCK:
            target = p.data if self.in_place else self.staged
        return target if target is not None and target.shape == p.shape and target.dtype == p.dtype else None

    def direct_output(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The weights a streamed step's optimizer may write itself (its fused conversion), or None when
        a staged version exists (the publish must swap it in)."""
        return p.data if self.optim is not None and self.staged is None else None

    # ---- inspection and role checks -----------------------------------------------------------------------
    def host_buffers(self, p: torch.Tensor) -> List[torch.Tensor]:
        """Every distinct host tensor of the parameter's shape in any role: what its host memory costs
        (tests). Reads the gradient roles first (a buffer given its next role before its old one lets
        go of it, ``hand_over``, is seen)."""
        found: Dict[int, torch.Tensor] = {}
        grads = [p.grad, self.held, self.optim.grad if self.optim is not None else None]
        spare = [b for b, _ in self.spare]
        shares = [b for bufs in self.share_buffers.values() for b in bufs]
        for t in [p.data, self.staged, *grads, *spare, *shares]:
            if t is not None and t.device.type == "cpu" and t.shape == p.shape and t.numel() > 0:
                found.setdefault(t.data_ptr(), t)
        return list(found.values())

    def roles(self, p: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """Each host buffer with its role (a buffer in two roles appears twice)."""
        out: List[Tuple[str, Optional[torch.Tensor]]] = [("WEIGHTS", p.data), ("GRAD", p.grad)]
        out += [("GRAD", g) for g in self.shares.values()]
        out += [("GRAD", b) for bufs in self.share_buffers.values() for b in bufs]
        out += [("HELD", self.held), ("HELD", self.optim.grad if self.optim is not None else None)]
        out += [("STAGED", self.staged)] + [("SPARE", b) for b, _ in self.spare]
        return [(r, t) for r, t in out if t is not None and t.device.type == "cpu" and t.numel() > 0]

    def check_roles(self, p: torch.Tensor) -> None:
        """With no transition running (after ``synchronize``): no buffer has two owners. A buffer in
        several GRAD slots (a share, its layer's list, ``p.grad``) is one owner; so is HELD that is also
        STAGED (chosen at the hand-over, until ``zero_grad``); SPARE buffers appear once each."""
        seen: Dict[Tuple[int, torch.Size], str] = {}
        for role, t in self.roles(p):
            key = (t.data_ptr(), t.shape)
            other = seen.get(key)
            if other is None or (other == role and role != "SPARE") or {other, role} == {"HELD", "STAGED"}:
                seen[key] = role if other is None else other
                continue
            raise RoleError(f"host buffer {hex(t.data_ptr())} is {other} and {role} (layers {self.attr.layer_ids})")

    def _check_download(self, p: torch.Tensor, buf: torch.Tensor) -> None:
        """A download's target is no buffer the optimizer reads or writes, nor the weights, nor a spare."""
        with _LOCK:
            others = [("weights", p.data), ("STAGED", self.staged), ("HELD", self.held)]
            others += [("SPARE", b) for b, _ in self.spare]
        others.append(("optimizer .grad", self.optim.grad if self.optim is not None else None))
        self._check_disjoint(p, "download", [("GRAD", buf)], others)

    def _check_stage(self, p: torch.Tensor, target: torch.Tensor) -> None:
        """What a step stages into is no download target, spare or optimizer gradient (nor the weights,
        unless a download moved them there)."""
        grads = [("GRAD", p.grad)] + [("GRAD", g) for g in list(self.shares.values())]
        others = grads + [("SPARE", b) for b, _ in list(self.spare)]
        others.append(("optimizer .grad", self.optim.grad if self.optim is not None else None))
        with _LOCK:  # one snapshot: a download may move STAGED into the weights between two reads
            in_place, weights = self.in_place, p.data
        if not in_place:
            others.append(("weights", weights))
        self._check_disjoint(p, "stage", [("STAGED", target)], others)

    def _check_disjoint(
        self,
        p: torch.Tensor,
        where: str,
        mine: Sequence[Tuple[str, Optional[torch.Tensor]]],
        others: Sequence[Tuple[str, Optional[torch.Tensor]]],
    ) -> None:
        for role, t in mine:
            for other, u in others:
                if same_storage(t, u):
                    raise RoleError(f"{where}: the {role} buffer is also {other} (layers {self.attr.layer_ids})")


def host_grad(p: torch.Tensor, layer_id: int) -> Optional[torch.Tensor]:
    """``p``'s GRAD buffer that ``layer_id``'s next upload adds in (:meth:`ParamBuffers.seed`)."""
    return ParamBuffers.of(p).seed(p, layer_id)


def fold_shared_grads(shared: Sequence[nn.Parameter]) -> None:
    """Fold the per-layer gradient shares of tied parameters into ``param.grad`` (main thread, after a
    call; usually one share is left: ``tied_grads.TiedGrads`` summed the others on the device)."""
    for p in shared:
        ParamBuffers.of(p).fold_shares(p)
