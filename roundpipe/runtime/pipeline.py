"""The main thread's side of a RoundPipe call: hand the call's jobs to devices, wait for them, and the
autograd node that connects the pipelined backward to PyTorch's graph.

A call assigns all its jobs (``roundpipe.devices.dispatch``) before it launches any, fences each job's layers
against the optimizer thread (the ``attribute`` event protocol), then waits on the tracker for the
last microbatch. ``guarded`` turns any failure, here or on a device thread, into one exception.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch

from roundpipe.devices import device as device_mod
from roundpipe.devices import profile
from roundpipe.devices.cpu_streams import host_checked
from roundpipe.devices.dispatch import dispatcher
from roundpipe.devices.threads import RoundPipeAborted, current_failure, raise_if_failed, report_failure
from roundpipe.runtime.jobs import run_backward, run_forward, run_forward_backward
from roundpipe.runtime.run import Run, differentiable

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager


def guarded(run: Run, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (dispatch and waits) so that any failure, in this thread or a worker, ends in one clear
    exception here: workers are let go idle, layer events reset, and the first error re-raised."""
    try:
        result = fn()
        device_mod.wait_all_idle()
        raise_if_failed(what)
        return result
    except BaseException as exc:
        if not isinstance(exc, RoundPipeAborted):
            report_failure(exc)  # make every waiting worker abort (a no-op if a worker failed first)
        for d in device_mod.device_list:
            # Workers abort their waits within a poll interval; wait for them without aborting.
            _wait_plain(d)
        run.model.reset_events()
        try:
            # The failed call's downloads may still be landing in host buffers (gradients, layer buffers)
            # that the next call uploads and the user may read: no later event orders them.
            device_mod.synchronize_devices()
        except Exception:  # noqa: BLE001 - a broken device context: the original error is the one to raise
            pass
        if isinstance(exc, torch.OutOfMemoryError) or isinstance(current_failure(), torch.OutOfMemoryError):
            # Give the failed run's memory back so the next call (e.g. with more microbatches) fits.
            run.release()
            device_mod.gc_collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        raise_if_failed(what)
        raise


def _wait_plain(d: "DeviceManager") -> None:
    """Wait, without aborting, until ``d`` has no job queued or running."""
    threading.Event.wait(d.drained)


def _assign(run: Run, jobs: Sequence[Tuple[str, int]]) -> List[Tuple[str, int, "DeviceManager"]]:
    """Give each job its device (``roundpipe.devices.dispatch``), fixed before any launch so that every job
    knows where its consumer runs."""
    devices = dispatcher.assign(len(jobs))
    for (kind, gid), dev in zip(jobs, devices):
        run.job_device[(kind, gid)] = dev
    return [(kind, gid, dev) for (kind, gid), dev in zip(jobs, devices)]


def _launch(run: Run, jobs: List[Tuple[str, int, "DeviceManager"]]) -> None:
    """Fence each job's layers (attribute.py protocol), then hand the job to its device."""
    attrs = run.model.layer_attrs
    kept = run.plan.keep if run.enable_grad else ()
    for kind, gid, dev in jobs:
        if kind == "f":
            for i in run.plan.fwd_plan[gid]:
                # A kept stage's forward uploads its gradients too (seeded from the host) and is its layers'
                # only upload of the call: it takes the backward's fence (the optimizer done reading them).
                if run.plan.fwd_plan[gid] in kept:
                    attrs[i].backward_fence()
                else:
                    attrs[i].forward_fence()
            dev.launch(run_forward, run, gid, label=_job_label(run, "forward", run.plan.fwd_plan[gid]))
        elif kind == "b":
            for i in run.plan.bwd_plan[gid] if run.plan.bwd_plan[gid] not in kept else ():  # fenced at forward
                attrs[i].backward_fence()
            dev.launch(run_backward, run, gid, label=_job_label(run, "backward", run.plan.bwd_plan[gid]))
        elif kind == "bp":  # part gid > 0 of the last backward group: part 0 ("b") fenced its layers
            last = len(run.plan.bwd_plan) - 1
            dev.launch(
                run_backward, run, last, gid, label=_job_label(run, f"backward part {gid}", run.plan.bwd_plan[last])
            )
        else:
            if gid == 0:  # the parts of a split fused job share one fence (their uploads are one use)
                for i in run.plan.bwd_plan[-1]:
                    attrs[i].forward_backward_fence()
            what = "fused forward-backward" if run.fused_parts == 1 else f"fused forward-backward part {gid}"
            dev.launch(run_forward_backward, run, gid, label=_job_label(run, what, run.plan.bwd_plan[-1]))


def _job_label(run: Run, what: str, layers: range) -> str:
    """The profiler label of a job, e.g. ``roundpipe model 'qwen' forward layers 3-4``; empty (not built)
    when no profiler is selected."""
    if profile.PROFILER_TYPE is None:
        return ""
    span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"
    return f"roundpipe model {run.model.name!r} {what} {span}"


def dispatch_forward(run: Run) -> None:
    """Dispatch every forward group round robin, then wait until all microbatches are through."""
    _launch(run, _assign(run, [("f", g) for g in range(len(run.plan.fwd_plan))]))
    run.tracker.forward_wait_complete(run.batch.num_microbatch)


def dispatch_backward(run: Run) -> None:
    """Dispatch the backward groups, last first (in ``run.fused_parts`` parts), round robin, then wait
    for group 0."""
    last = len(run.plan.bwd_plan) - 1
    jobs = (
        [("b", last)]
        + [("bp", part) for part in range(1, run.fused_parts)]
        + [("b", b) for b in range(last - 1, -1, -1)]
        if last >= 0
        else []
    )
    _launch(run, _assign(run, jobs))
    run.tracker.backward_wait_complete(run.batch.num_microbatch)


def dispatch_fused(run: Run) -> None:
    """forward_backward: forward groups, the fused last group (in ``run.fused_parts`` parts, on
    consecutive devices), then the other backward groups. A kept stage's backward must run where its
    forward ran (its graph and layers are there): the planner keeps only on a pool of one device."""
    if run.plan.keep and device_mod.get_num_devices() != 1:
        raise RuntimeError(
            f"model {run.model.name!r}: the plan keeps stages {list(run.plan.keep)} on a pool of "
            f"{device_mod.get_num_devices()} devices; a kept stage needs one device (or RPP_DEBUG_KEEP_ACTIVATIONS=0)"
        )
    n_bwd = len(run.plan.bwd_plan)
    fused = [("fb", part) for part in range(run.fused_parts)]
    jobs = [("f", g) for g in range(len(run.plan.fwd_plan))] + fused + [("b", b) for b in range(n_bwd - 2, -1, -1)]
    _launch(run, _assign(run, jobs))
    run.tracker.backward_wait_complete(run.batch.num_microbatch)


def finish_backward(run: Run) -> None:
    """After all backward jobs: wait for the gradient downloads (one fence) and fold shared-parameter
    gradient shares into ``param.grad``; then wait for the input gradients' downloads."""
    for i in range(run.model.num_layers):
        run.model.layer_attrs[i].grad_downloaded.synchronize()
    run.model.reduce_shared_grads()
    # The input gradients go to the caller's graph as host tensors, with no event: the caller (autograd
    # accumulating ``x.grad``, an upstream RoundPipe's upload) reads them at once. Their downloads (the
    # first group's, on ``downstream``) are ordered after none of the events above (those are on the
    # gradient stream), so wait for them here; they were issued with the last microbatch's backward.
    for ctx in run.contexts:
        for ev in ctx.grad_events:
            ev.synchronize()


class RoundPipeBatchedBackward(torch.autograd.Function):
    """Autograd node of a whole RoundPipe call: its forward runs the pipelined forward of all
    microbatches; its backward runs the pipelined backward and returns the input gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, run: Run, tag: torch.Tensor, *all_inputs: torch.Tensor
    ) -> Tuple[torch.Tensor, ...]:
        ctx.run = run
        ctx.set_materialize_grads(False)
        guarded(run, f"model {run.model.name!r} forward", lambda: dispatch_forward(run))
        outs: List[torch.Tensor] = [
            t for leaves in run.batch.flatten_states for t in leaves if isinstance(t, torch.Tensor)
        ]
        nondiff = [t for t in outs if not differentiable(t)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    @staticmethod
    @host_checked
    def backward(  # type: ignore[override]
        ctx: Any, *grad_outputs: Optional[torch.Tensor]
    ) -> Tuple[Optional[torch.Tensor], ...]:
        run: Run = ctx.run
        if run.backward_done:
            raise RuntimeError(
                f"RoundPipe model {run.model.name!r}: backward through the same forward a second time; "
                "RoundPipe frees the saved activations after the first backward (retain_graph is not "
                "supported). Run forward again."
            )
        run.backward_done = True
        it = iter(grad_outputs)
        for ctx_m, leaves in zip(run.contexts, run.batch.flatten_states):
            ctx_m.grad_states = [next(it) if isinstance(t, torch.Tensor) else None for t in leaves]
            ctx_m.grad_events = []

        guarded(run, f"model {run.model.name!r} backward", lambda: dispatch_backward(run))
        finish_backward(run)
        grads: List[Optional[torch.Tensor]] = []
        for ctx_m, original in zip(run.contexts, run.input_leaves):
            for g, t, want in zip(ctx_m.grad_states, original, ctx_m.input_requires_grad):
                if want:
                    grads.append(None if g is None else g.to(t.device))
        run.release()
        return (None, None, *grads)
