"""A training cycle (the calls between two steps) seen from the main thread: host buffers and optimizer
state built before the first step, in the background, and which calls' gradient downloads may take the
weights' host buffers. The buffers themselves, their roles and every change of role belong to
``roundpipe.host.buffers``; this module only decides, at a call's start, what that module is asked.

A model's first iterations would otherwise allocate on their critical path: the pinned spares that
the first gradient downloads take (the rotation of ``roundpipe.host.buffers``), and
the optimizer's zero moments (``roundpipe.host.state_reserve``). :class:`HostBufferPrep` starts both at the
model's first training call, while the devices run the first iteration, and its ``finish`` (the first
``step``, else the next training call) waits for them once: pinning holds the CUDA driver's lock, so a
thread still pinning would stall the device threads' copies and launches at random points of the next
iterations, and a first step still building its state would hold up the iteration after it.

The first step has nothing to convert either: an optimizer copy starts as the weights' version
(``RoundPipe._optim_param``), so its publish leaves the weights in place. Converting every optimizer copy
into the weights there, while the next forward waits for them layer by layer, makes the first timed
iteration after one warm-up take 1.19-1.41x the steady one (qwen3-1.7b on one H100); a buffer staged
ahead in the background instead would be a third buffer.

:class:`StepCycle` decides which calls' gradient downloads may take the weights' host buffers.

Life cycle: one per model, owned by the main thread (``start`` and ``finish`` run there); the builder
thread only adds spares (``host_buffers.ParamBuffers.give_spare``, under that module's lock).
Whatever changes the optimizer copies goes through ``sync_optim_param`` or ``load_optim_params``, which
copy them into the weights (``ParamBuffers.publish``: no longer "in place" then).

The first step is also where Python's full garbage collections are taken off the hot path
(:func:`freeze_garbage_collector`): a full collection scans every object alive, half a million after
importing torch and transformers, while holding the GIL, so every device thread stalls with it. On one
H200 it took 0.5-0.8 s, within the first 3-6 iterations after the warm-up in 3 of 4 runs (qwen3-4b
8 x 4096: a 2.9 s iteration against 2.14 s); with the freeze no timed iteration had one.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
import warnings
import weakref
from typing import List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from roundpipe.devices import backend
from roundpipe.devices import device as device_mod
from roundpipe.devices.memory import pinned_empty
from roundpipe.host import state_reserve
from roundpipe.host import step as host_step
from roundpipe.host.attribute import ParamAttribute
from roundpipe.host.buffers import ParamBuffers
from roundpipe.host.protocol import HostModel
from roundpipe.host.step_mode import StepMode


def preallocate_host_buffers(params: Sequence[nn.Parameter], name: str) -> threading.Thread:
    """Allocate, in a background thread, per trainable parameter the spare that its first gradient download
    takes, pinned and faulted in: later downloads take the weights' buffer (staged mode) or the buffer the step
    releases (streamed mode). A shared (tied) parameter's owner layer rotates its buffers like any parameter;
    on several devices each other layer sharing it downloads its own share (``buffers``): one spare more per
    such layer. (A tied embedding's buffers are a model's largest: pinning one in the first step held the
    driver's lock for 0.3 s of the next iteration on qwen3-1.7b.) A buffer the download needs before the
    thread reaches its parameter is allocated there (none is made here then for an unshared parameter); a
    failure to pin is left to that path, which reports it with advice. Not foreseen: a sharer in its owner's
    stage on one device, and data parallel reducing on the devices (both download every share): those
    buffers come in the first call."""
    one_device = device_mod.get_num_devices() == 1  # a tied weight's shares are summed on the device then

    def run() -> None:
        for p in params:
            if _exiting.is_set():
                return
            attr, bufs = ParamAttribute.get(p), ParamBuffers.of(p)
            if not p.requires_grad or (p.grad is not None and not attr.shared):
                continue  # (a download that came first took a buffer of its own: one more would be surplus)
            sharers = 0 if one_device or not attr.shared else len(attr.layer_ids) - 1
            for _ in range(bufs.spares_to_build(p, 1, sharers)):
                try:
                    buf = pinned_empty(p.shape, p.dtype)
                except RuntimeError:
                    return
                if not buf.is_pinned():
                    buf.zero_()  # fault the pages in now (pinning does that for pinned ones)
                bufs.give_spare(buf)

    thread = threading.Thread(target=run, name=f"roundpipe-host-buffers-{name}", daemon=True)
    thread.start()
    _builders.add(thread)
    return thread


_builders: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # host-buffer builders started
_exiting = threading.Event()  # set at interpreter exit: builders stop after their current buffer


@atexit.register
def _stop_builders() -> None:
    # A daemon builder still inside a torch op when the interpreter finalises aborts the process
    # ("terminate called without an active exception"); atexit runs before daemon threads are frozen.
    _exiting.set()
    deadline = time.monotonic() + 30.0
    for thread in list(_builders):
        thread.join(max(0.0, deadline - time.monotonic()))


_gc_frozen = False  # whether this process froze the garbage collector's survivors (once per process)


def freeze_garbage_collector() -> bool:
    """Collect garbage once and move every object alive now into the collector's permanent generation
    (``gc.freeze``), so that later full collections scan only newer objects; once per process. Returns
    whether it froze now.

    Called at a model's first step, on the main thread: the first iteration has built the long-lived
    state (plan, kernels, host buffers) and the optimizer thread has not started the step. The frozen
    objects are still freed by reference counting as usual; only a reference cycle among them that
    becomes garbage later is not collected."""
    global _gc_frozen
    if _gc_frozen:
        return False
    _gc_frozen = True
    gc.collect()  # what is garbage now would otherwise never be collected once frozen
    gc.freeze()
    return True


def check_host_room(params: Sequence[nn.Parameter], optim_params: Sequence[torch.Tensor], name: str) -> None:
    """Raise ``MemoryError`` before the first training call allocates what the host cannot hold: one gradient
    buffer per trainable parameter and the optimizers' zero states (those that say their size). Past that
    point the kernel's out-of-memory killer would end the process, mid-iteration and without a word."""
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
    state = state_reserve.planned_bytes_for(optim_params)
    room = backend.host_budget_bytes()
    if grads + state <= room:
        return
    gib = 2**30
    raise MemoryError(
        f"model {name!r}: the first training call needs {(grads + state) / gib:.1f} GiB more host memory "
        f"({grads / gib:.1f} GiB of gradient buffers, {state / gib:.1f} GiB of optimizer state) and "
        f"{room / gib:.1f} GiB is free (RPP_HOST_MEMORY, or the available memory less a margin). Shrink the "
        "optimizer state: roundpipe.optim.Adam(..., state_dtype='bfloat16') halves the moments and 'int8' quarters "
        "them, master='bfloat16' over a model wrapped without optim_dtype steps the bf16 weights with no fp32 "
        "copy (the CLI's --optim-state and --master); or train LoRA adapters; or set RPP_HOST_MEMORY to a larger "
        "size to allocate anyway."
    )


class HostBufferPrep:
    """One model's background preparation (see the module docstring)."""

    def __init__(self) -> None:
        self.started = False
        self.thread: Optional[threading.Thread] = None  # the builder, until ``finish`` joined it
        self._optim_params: List[nn.Parameter] = []

    def start(self, params: Sequence[nn.Parameter], name: str) -> None:
        """Start building for ``params`` (the model's parameters whose optimizer copies exist), once."""
        if self.started:
            return
        self._optim_params = [o for o in (ParamAttribute.get(p).optim for p in params) if o is not None]
        check_host_room(params, self._optim_params, name)
        # The optimizers' zero state (roundpipe.optim.Adam registers a reserve on its parameters).
        state_reserve.start_for(self._optim_params)
        if params:
            self.started = True
            self.thread = preallocate_host_buffers(params, name)

    def finish(self) -> None:
        """Wait for the builder and the optimizers' state reserves (once; later calls return at once)."""
        thread, self.thread = self.thread, None
        if thread is None:
            return
        thread.join()
        state_reserve.wait_for(self._optim_params)
        freeze_garbage_collector()


class StepCycle:
    """Which training calls may download gradients into the weight buffers (staged mode).

    Staged asynchronous steps keep a weight's host versions in rotating buffers: the weights the running
    call reads, the gradient the step reads (into which it then stages the next version), and the
    download target of the running call's gradient. That third buffer is not needed when the running
    call is the last reader of the weights before the next step publishes: its backward job has uploaded
    a layer for the last time when it downloads the layer's gradient, so the download takes the weights'
    buffer and the weights move to the buffer the step stages into (``buffers.ParamBuffers.move_weights``).
    Nothing reads them there before the next step's publish, which the optimizer thread runs after the staging
    step, so a weight has two host copies in the model dtype instead of three, with the same staleness.

    Whether a call is the last one before ``step`` is known only afterwards, so this predicts it from
    the previous cycle: a call may move weights if the previous step followed exactly one training call
    and this is the first call since. A call that finds weights moved earlier in its cycle (a second
    training call before ``step``: gradient accumulation after single-call steps; or an evaluation
    forward) reads the newer version: ``begin_call`` then asks the model to wait for the step and publish
    every layer first (``resync``), and warns once for a training call. The next cycle learns the new
    count. Life cycle: one per RoundPipe (its ``cycle``, made when it is built, with the background
    preparation of its first step, ``prep``), used only by the main thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.prep = HostBufferPrep()
        self.calls = 0  # training calls since the last step
        self.last_calls: Optional[int] = None  # training calls before the last step (None: no step yet)
        self.async_staged = False  # whether the last step was a staged asynchronous one
        self.moved = False  # whether a call of this cycle may have moved weights
        self.warned = False

    def begin_call(self, train: bool) -> Tuple[bool, bool]:
        """At the start of a call: ``(may this call download into the weights, must the model resync
        first)``."""
        resync = self.moved
        self.moved = False
        if resync and train and not self.warned:
            self.warned = True
            warnings.warn(
                f"model {self.name!r}: a second training call before step() after steps of one call each; it trains "
                "on the weights of the step in flight (one step newer than the call before it), since the call "
                "before moved the weights into the step's buffers. Keep the number of calls per step fixed (the "
                "next steps adapt to it).",
                stacklevel=4,  # the user's call (StepCycle.begin_call <- begin_call <- RoundPipe.forward*)
            )
        into = train and self.async_staged and self.last_calls == 1 and self.calls == 0
        if train:
            self.calls += 1
        self.moved = into
        return into, resync

    def on_step(self, is_async: bool, mode: StepMode) -> None:
        """At ``step`` (of ``mode``): the cycle ends (its count is the next prediction)."""
        self.last_calls, self.calls, self.moved = self.calls, 0, False
        self.async_staged = is_async and mode.staged

    def on_sync(self) -> None:
        """The model's weights were made current (``sync_optim_param``): nothing to resync."""
        self.moved = False


class CycledModel(HostModel, Protocol):
    """A model with a step cycle (``RoundPipe``)."""

    cycle: StepCycle
    """Its calls between two steps, and the preparation of its first step."""


def begin_call(model: CycledModel, train: bool) -> bool:
    """Start a call of ``model``: a training call starts building the host buffers and optimizer state
    of the first steps (the first call) or waits for them (the next call, when no ``step`` did); then
    whether the call's gradient downloads may take the weights' buffers, after settling weights that
    an earlier call of the cycle moved (``StepCycle``)."""
    if torch.is_grad_enabled():
        prep = model.cycle.prep
        if prep.started:
            prep.finish()
        else:
            params = [p for _, ps in model.optim_units() for p in ps if ParamAttribute.get(p).optim is not None]
            prep.start(params, model.name)
    into_weights, resync = model.cycle.begin_call(train)
    if resync:
        host_step.settle_params(model.optim_units(), model.step_mode)
    return into_weights
