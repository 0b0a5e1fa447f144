"""Host buffers and optimizer state built before the first step, in the background.

A model's first iterations would otherwise allocate on their critical path: the pinned spares that
the first gradient downloads and the first staging take (``transfer._grad_buffer``'s rotation), and
the optimizer's zero moments (``roundpipe.optim.reserve``). :class:`HostBufferPrep` starts both at the
model's first training call, while the devices run the first iteration, and its ``finish`` (the first
``step``, else the next training call) waits for them once: pinning holds the CUDA driver's lock, so a
thread still pinning would stall the device threads' copies and launches at random points of the next
iterations, and a first step still building its state would hold up the iteration after it.

It also stages the optimizer copies' current values in the model dtype (``prestage_params``): an
asynchronous step starts by publishing the staged version of each layer, and the first step had none,
so it converted every optimizer copy into the model while the next forward waited for it layer by
layer (qwen3-1.7b on one H100: the first timed iteration after one warm-up took 1.27-1.38x the steady
one; 1.04x with synchronous steps, 1.00x after two warm-ups).

Life cycle: one per model, owned by the main thread (``start`` and ``finish`` run there); the builder
thread writes the parameters' spare lists (``ParamAttribute.give_spare``, under its lock) and their
``staged`` buffers, which only the optimizer thread reads, and only in a step, which ``finish`` precedes.
Whatever changes the optimizer copies before the first step goes through ``sync_optim_param``, which
waits for ``finish`` and then invalidates the staged version (``optim.step.copy_params_to_model``).
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence

import torch
from torch import nn

from roundpipe import settings
from roundpipe.attribute import ParamAttribute
from roundpipe.memory import pinned_empty
from roundpipe.optim import reserve as state_reserve


def preallocate_host_buffers(params: Sequence[nn.Parameter], name: str) -> threading.Thread:
    """Allocate, in a background thread, per trainable unshared parameter the spares that the first
    gradient download and the first staging take (two besides the model buffer with staging on, one
    without), pinned and faulted in. A buffer the download needs before the thread reaches its
    parameter is allocated there as before (the extra spare is trimmed after the step); a failure to
    pin is left to that path, which reports it with advice."""
    want = 2 if settings.stage_params_enabled() else settings.grad_buffers_limit() - 1

    def run() -> None:
        for p in params:
            attr = ParamAttribute.get(p)
            if attr.shared or not p.requires_grad:
                continue
            have = sum(1 for b, _ in attr.spare if b.shape == p.shape and b.dtype == p.dtype)
            for _ in range(max(0, want - have)):
                try:
                    buf = pinned_empty(p.shape, p.dtype)
                except RuntimeError:
                    return
                if not buf.is_pinned():
                    buf.zero_()  # fault the pages in now (pinning does that for pinned ones)
                attr.give_spare(buf)
        if settings.stage_params_enabled():
            prestage_params(params)

    thread = threading.Thread(target=run, name=f"roundpipe-host-buffers-{name}", daemon=True)
    thread.start()
    return thread


def prestage_params(params: Sequence[nn.Parameter]) -> None:
    """Write each unshared trainable parameter's optimizer copy, in the model dtype, into a staging
    buffer (a spare, else a new one pinned like the parameter) and mark it current, so the first
    asynchronous step publishes it by a swap as later steps do (module docstring). Parameters that
    already have a staged version, or no optimizer copy, are left alone."""
    with torch.no_grad():
        for p in params:
            attr = ParamAttribute.get(p)
            if attr.shared or not p.requires_grad or attr.optim is None or attr.staged is not None:
                continue
            pinned = p.data.is_pinned()
            buf = attr.take_spare(p.shape, p.dtype, pinned)
            if buf is None:
                try:
                    buf = pinned_empty(p.shape, p.dtype, pin=pinned)
                except RuntimeError:  # out of pinnable memory: the first step copies instead
                    return
            buf.copy_(attr.optim.data)
            attr.staged, attr.staged_valid = buf, True


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
