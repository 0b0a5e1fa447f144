"""What a device thread runs: the forward, backward and fused forward-backward jobs of one call.

One job is one layer group over all microbatches of the call, run by one device's controller thread:
upload the group's parameters (parameter stream), then per microbatch wait for the previous group's
result (``ModelTracker``), upload the activation (activation stream), compute, download the result
(download stream). Training forwards run without an autograd graph and keep only each backward stage's
input on the host; backward jobs recompute the stage from it and back-propagate. A kept stage
(``ModelExecutePlan.keep``, one device) instead keeps its forward's graph and layers on the device, and its
backward back-propagates through them (``roundpipe.runtime.kept``). What a microbatch
computes, eagerly or as one replay of a CUDA graph, is ``roundpipe.runtime.compute``; this module moves the
data around it. The main thread hands jobs to devices in ``roundpipe.runtime.pipeline``.

A graphed job uploads its layers into the device's slots (``graphs.LayerSlot``): its parameter stream
first waits for the slots' ``release`` event of the job that used them two jobs before (recorded on
the gradient stream after that job's compute and gradient downloads, ``transfer.release_layers``).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe.devices import backend
from roundpipe.host.attribute import layer_buffers_landed
from roundpipe.planning.fused_split import part_microbatches, part_of
from roundpipe.runtime import sequence, stage_codec
from roundpipe.runtime.compute import (
    BackwardInputs,
    GroupBackward,
    GroupForward,
    JobGroup,
    backward_by_layer,
    call_layer,
    grad_leaves,
    graph_signatures,
    input_grads,
    wrap,
)
from roundpipe.runtime.kept import KeptForward, drop_kept, kept_backward
from roundpipe.runtime.run import Leaves, MicrobatchState, Run
from roundpipe.runtime.transfer import (
    async_d2h,
    async_h2d,
    download_layer,
    peer_copy,
    release_layers,
    snapshot_buffers,
    upload_layers,
    wait_layer,
)

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager
    from roundpipe.devices.graphs import LayerSlot


class HostClock:
    """A job's host cost: its device thread's CPU time, less the compute on CPU workers (which run it on
    this thread) and the waits that spin on CUDA (``DeviceManager.spin_s``); noted with the job's
    microbatch and layer counts in the model's timer for the planner (``ModelTimer.note_job``)."""

    def __init__(self, device: "DeviceManager") -> None:
        self.device = device
        self.serial = not backend.is_cuda(device.device)
        self.start = time.thread_time()
        self.spin0 = device.spin_s
        self.compute_s = 0.0
        self.t = 0.0

    def __enter__(self) -> "HostClock":
        if self.serial:
            self.t = time.thread_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.serial:
            self.compute_s += time.thread_time() - self.t

    def note(self, run: Run, microbatches: int, layers: int) -> None:
        host = time.thread_time() - self.start - (self.device.spin_s - self.spin0) - self.compute_s
        run.model.model_timer.note_job(1e3 * max(0.0, host), microbatches, layers)


@contextlib.contextmanager
def _on_compute(device: "DeviceManager", run: Run) -> Iterator[None]:
    """Where every job computes a microbatch: the device's compute stream (current for this thread), the
    CPU workers' compute guard, and the run's autocast."""
    with backend.use_stream(device.compute_stream), backend.compute_guard(device.device), run.autocast_ctx(device):
        yield


def _take_activation(device: "DeviceManager", run: Run, m: int) -> Leaves:
    """Microbatch m's stage input on ``device``: handed over on the device by the previous job when it
    ran there or copied it here (no host round trip), else uploaded from the host copy."""
    handoff = run.act_handoff[m]
    run.act_handoff[m] = None
    if handoff is not None and handoff[0] is device:
        # A peer copy: the upload stream (which compute waits on next) waits for it to land.
        for ev in handoff[2]:
            device.upstream.wait_event(ev)
        return handoff[1]
    batch = run.batch
    return async_h2d(device, batch.forward_events[m], batch.flatten_states[m])


def _download_reusing(
    device: "DeviceManager",
    events: List[Any],
    leaves: Leaves,
    dev_inputs: Leaves,
    host_inputs: Leaves,
    input_events: List[Any],
) -> Leaves:
    """Host copies of a job's output ``leaves`` for the next job or a backward stage. A leaf that is one of
    the job's input tensors, passed through its layers unchanged (position ids, rotary tables, labels
    of a causal LM), reuses that input's host copy instead of a new download: one host copy per call,
    not one per backward stage (at long context the rotary tables alone are ~6% of a checkpoint).
    ``events`` gets the new downloads' events and, when a copy is reused, the input's (the reused copy
    may still be landing)."""
    by_id = {
        id(d): h for d, h in zip(dev_inputs, host_inputs) if isinstance(d, torch.Tensor) and isinstance(h, torch.Tensor)
    }
    reused = [by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves]
    if not any(r is not None for r in reused):
        return async_d2h(device, events, leaves)
    fresh = async_d2h(device, events, [t if r is None else None for t, r in zip(leaves, reused)])
    events.extend(input_events)
    return [r if r is not None else f for r, f in zip(reused, fresh)]


def _save_compact(
    device: "DeviceManager",
    run: Run,
    m: int,
    leaves: Leaves,
    spec: Any,
    inputs: Tuple[Leaves, Leaves, List[Any]],
) -> Tuple[Leaves, Any, List[Any]]:
    """A forward job's output ``leaves`` kept for the backward in the compact format (``stage_codec``): its
    hidden states encoded and downloaded; the other leaves reuse the host copies of the job's ``inputs``
    (device leaves, host leaves, their events) or of the output's exact download (``batch.flatten_states``,
    made when another device needs it); where there is none, the next job gets these (and reuses them)."""
    batch = run.batch
    dev_in, host_in, in_events = inputs
    fwd_host, fwd_events = batch.flatten_states[m], batch.forward_events[m]
    packed = stage_codec.compact(device, run.cfg.stage_inputs, leaves, spec, dev_in)
    events: List[Any] = []
    kept = _download_reusing(device, events, packed, dev_in + leaves, host_in + fwd_host, in_events + fwd_events)
    if any(f is None and isinstance(k, torch.Tensor) for f, k in zip(fwd_host, kept)):
        batch.flatten_states[m] = stage_codec.host_copies(fwd_host, kept)
        batch.forward_events[m] = fwd_events + events
    return kept, spec, events


def _next_forward_device(run: Run, group: int, m: int) -> Optional["DeviceManager"]:
    """The device of the job that consumes forward group ``group``'s output of microbatch ``m`` (None:
    the caller)."""
    if group + 1 < len(run.plan.fwd_plan):
        return run.job_device.get(("f", group + 1))
    return run.job_device.get(("fb", part_of(m, run.fused_parts, run.batch.num_microbatch)))


def _take_grads(device: "DeviceManager", ctx: MicrobatchState) -> List[Optional[torch.Tensor]]:
    """The gradients w.r.t. this stage's outputs on ``device``: handed over on the device (the previous
    backward job ran here, or peer-copied them here: the upload stream, which compute waits on next,
    waits for the copy), else uploaded from the host copy."""
    handoff = ctx.grad_handoff
    ctx.grad_handoff = None
    if handoff is not None and handoff[0] is device:
        for ev in handoff[2]:
            device.upstream.wait_event(ev)
        return handoff[1]
    return async_h2d(device, ctx.grad_events, ctx.grad_states)


def _give_grads(
    device: "DeviceManager", run: Run, ctx: MicrobatchState, group: int, in_grads: List[Optional[torch.Tensor]]
) -> None:
    """Input gradients of backward group ``group`` go to group - 1: on the device if it runs here, as a
    peer copy to its device (``RPP_DEBUG_PEER_HANDOFF``), else (and for the model input) to the host."""
    consumer = run.job_device.get(("b", group - 1)) if group > 0 else None
    if consumer is device:
        ctx.grad_handoff = (device, in_grads, [])
        ctx.grad_states, ctx.grad_events = [], []
        return
    if consumer is not None and run.peer_handoff:
        ctx.grad_handoff = (consumer, *peer_copy(device, consumer, in_grads))
        ctx.grad_states, ctx.grad_events = [], []
        return
    events: List[Any] = []
    ctx.grad_states = async_d2h(device, events, in_grads)
    ctx.grad_events = events


def _upload_group(
    device: "DeviceManager",
    run: Run,
    layers: range,
    with_grad: bool,
    for_recompute: bool,
    ready: Optional[List[Any]] = None,
    seed: bool = True,
    slots: Optional[List["LayerSlot"]] = None,
) -> List[torch.nn.Module]:
    """Upload a job's layers (into ``slots`` for a graphed job); with ``ready``, compute waits layer by
    layer (``transfer.wait_layer``). ``seed``: start device gradients from the host's (accumulated by
    earlier calls of this step)."""
    model = run.model
    sizes = model.layer_device_bytes("train" if with_grad else "infer")
    device.stage = (model.name, layers, sum(sizes[i] for i in layers))
    device.throttle_prefetch()
    return upload_layers(
        [model.layers[i] for i in layers],
        list(layers),
        [model.layer_attrs[i] for i in layers],
        device,
        with_grad=with_grad,
        saved_buffers=run.saved_buffers if for_recompute else None,
        ready=ready,
        seed_grads=[seed and run.reducers[i] is None for i in layers],
        slots=slots,
    )


def _graph_slots(
    device: "DeviceManager", run: Run, layers: range, backward: bool
) -> Tuple[int, Optional[List["LayerSlot"]]]:
    """This job's parity on its device and, when it may be graphed (``compute.graph_signatures``; never in a
    long-context call, ``Run.may_graph``), the slots its layers upload into; else None, and the
    layers upload as an eager job's do."""
    parity = device.graphs.begin_job()
    sigs = graph_signatures(run, device, layers, backward)
    return parity, (device.graphs.take_slots(sigs, parity) if sigs is not None else None)


def _hand_grads_back(
    device: "DeviceManager",
    run: Run,
    layers: range,
    gpu_layers: List[torch.nn.Module],
    part: int,
    with_buffer: bool,
    split: bool,
) -> None:
    """A backward job's parameter gradients to the host: a secondary part of a split group hands them
    to part 0 (``partial_grads``); part 0 (or an unsplit job) downloads them, the other parts' added in."""
    model = run.model
    for i, layer in zip(layers, gpu_layers):
        if part > 0:
            assert run.partial_grads is not None
            run.partial_grads.publish(part, i, model.layers[i], layer, device)
            continue
        download_layer(
            model.layers[i],
            layer,
            i,
            model.layer_attrs[i],
            device,
            with_buffer=with_buffer,
            with_grad=True,
            tied=run.tied,
            job_layers=layers,
            reducer=run.reducers[i],
            parts=run.partial_grads if split else None,
            into_weights=run.grad_into_weights,
        )


def run_forward(device: "DeviceManager", run: Run, layer_group_id: int) -> None:
    """Forward of one layer group for all microbatches (no autograd graph; see module docstring).

    Results replace ``batch.flatten_states[m]``; inputs of backward stages and recompute data go to the
    host; layers' buffers (e.g. running statistics) are downloaded once all microbatches ran.
    """
    model, batch, tracker = run.model, run.batch, run.tracker
    layers = run.plan.fwd_plan[layer_group_id]
    # A kept stage (``roundpipe.runtime.kept``): its layers upload with gradients, compute with autograd and stay
    # on the device for its backward job; no recompute, so no buffer snapshot, RNG state or saved input.
    kept = run.enable_grad and layers in run.plan.keep
    if run.enable_grad and not kept:
        for i in layers:
            if any(True for _ in model.layers[i].buffers()):
                # The previous forward's buffer download (of any wrapper) must land before we copy the host buffers.
                layer_buffers_landed(model.layers[i])
                run.saved_buffers[i] = snapshot_buffers(model.layers[i])
    clock = HostClock(device)
    parity, slots = (device.graphs.begin_job(), None) if kept else _graph_slots(device, run, layers, backward=False)
    # Per-layer upload events: the first microbatch starts on the first layer while the rest upload.
    ready: List[Any] = []
    gpu_layers = _upload_group(device, run, layers, with_grad=kept, for_recompute=False, ready=ready, slots=slots)
    if kept:
        compute: Any = KeptForward(run, device, layers, gpu_layers, ready)
    else:
        compute = GroupForward(JobGroup(run, device, layers, gpu_layers, ready, slots, parity))
    tiles = run.sequence.job_store(device, backward=False) if run.sequence is not None else None
    peer_handoff = run.peer_handoff
    saves_output = (
        run.enable_grad
        and tracker.backward_need_input(layers.stop)
        and not any(r.start == layers.stop for r in run.plan.keep)  # a kept stage's graph holds its input
        and not (
            run.run_type == "fused" and layers.stop == run.plan.bwd_plan[-1].start  # the fused job saves nothing
        )
    )
    for m in range(batch.num_microbatch):
        device.where = (_at_job, (run, "forward", layers, m))  # what a stalled wait names (threads watchdog)
        tracker.forward_wait_for(layer_group_id, m)
        ctx = run.contexts[m]
        host_leaves, spec, events = batch.flatten_states[m], batch.flatten_specs[m], batch.forward_events[m]
        dev_leaves = _take_activation(device, run, m)
        device.compute_stream.wait_stream(device.upstream)
        if run.enable_grad and tracker.backward_need_input(layers.start) and not kept:
            if layers.start in run.kept_inputs[m]:
                ctx.device_inputs[layers.start] = (dev_leaves, spec)  # the previous job kept no host copy
            elif layers.start not in ctx.flatten_inputs:  # the previous job kept a compact one (stage_codec)
                ctx.flatten_inputs[layers.start] = (host_leaves, spec, events)
        with _on_compute(device, run), torch.no_grad():
            with clock, sequence.tile(tiles, m):
                out_leaves, out_spec, saved = compute(ctx, m, dev_leaves, spec)
            # Backward stages starting inside the group: their inputs stay on the device or go to the host.
            for i, leaves, sp in saved:
                if run.keep_on_device(leaves):
                    ctx.device_inputs[i] = (leaves, sp)
                else:
                    evs: List[Any] = []
                    packed = stage_codec.compact(device, run.cfg.stage_inputs, leaves, sp, dev_leaves)
                    ctx.flatten_inputs[i] = (
                        _download_reusing(device, evs, packed, dev_leaves, host_leaves, events),
                        sp,
                        evs,
                    )
        consumer = _next_forward_device(run, layer_group_id, m)
        peer = peer_handoff and consumer is not None and consumer is not device
        if consumer is device:
            run.act_handoff[m] = (device, out_leaves, [])
        elif peer and consumer is not None:
            run.act_handoff[m] = (consumer, *peer_copy(device, consumer, out_leaves))
        # The host copy is needed by another device, by the caller, or as a saved backward-stage input.
        saved_for_backward = saves_output
        if consumer is device and saved_for_backward and run.keep_on_device(out_leaves):
            # The next job runs here and keeps this output, its stage input, on the device.
            run.kept_inputs[m].add(layers.stop)
            saved_for_backward = False
        compact = saved_for_backward and run.cfg.stage_inputs != "bf16"  # the backward's copy is its own
        if (consumer is not device and not peer) or (saved_for_backward and not compact):
            out_events: List[Any] = []
            batch.flatten_states[m] = _download_reusing(device, out_events, out_leaves, dev_leaves, host_leaves, events)
            batch.forward_events[m] = out_events
        else:
            batch.flatten_states[m] = [None if isinstance(t, torch.Tensor) else t for t in out_leaves]
            batch.forward_events[m] = []
        if compact:
            inputs = (dev_leaves, host_leaves, events)
            ctx.flatten_inputs[layers.stop] = _save_compact(device, run, m, out_leaves, out_spec, inputs)
        batch.flatten_specs[m] = out_spec
        device.mem_manager.free((dev_leaves, out_leaves, saved), device.compute_stream, device.downstream)
        del dev_leaves, out_leaves, saved
        tracker.forward_notify(layer_group_id, m)
    if tiles is not None:
        tiles.finish(keep=run.enable_grad)
    for i, layer in zip(layers, gpu_layers):
        download_layer(model.layers[i], layer, i, model.layer_attrs[i], device, with_buffer=True, with_grad=False)
    if kept:
        run.kept_layers[layers.start] = gpu_layers  # the stage's backward job downloads and releases them
    else:
        release_layers(gpu_layers, device, slots)
    device.job_done()
    clock.note(run, batch.num_microbatch, len(layers))


def run_backward(device: "DeviceManager", run: Run, layer_group_id: int, part: int = 0) -> None:
    """Recompute + backward of one layer group for all microbatches; parameter gradients accumulate on
    the device over microbatches and are downloaded once into the host gradient slots.

    The last group of a 'train' call (the first backward job) may run in ``run.fused_parts`` parts, as
    the fused job does (``run_forward_backward``): part ``part`` takes every ``parts``-th microbatch
    (``partial_grads.part_microbatches``); part 0 seeds and downloads, the others hand their gradients over
    (``partial_grads``)."""
    batch, tracker, cfg = run.batch, run.tracker, run.cfg
    layers = run.plan.bwd_plan[layer_group_id]
    split = layer_group_id == len(run.plan.bwd_plan) - 1 and run.fused_parts > 1
    kept = layers in run.plan.keep  # its forward left its layers and graphs here (``roundpipe.runtime.kept``)
    clock = HostClock(device)
    eager = split or kept
    parity, slots = _graph_slots(device, run, layers, backward=True) if not eager else (device.graphs.begin_job(), None)
    # Per-layer upload events: the first recompute starts on the first layer while the rest upload
    # (the backward itself runs after the recompute has waited for every layer).
    ready: List[Any] = []
    if kept:
        gpu_layers = run.kept_layers.pop(layers.start)  # uploaded by the forward, which waited for them
    else:
        gpu_layers = _upload_group(
            device, run, layers, with_grad=True, for_recompute=True, ready=ready, seed=part == 0, slots=slots
        )
    group = JobGroup(run, device, layers, gpu_layers, ready, slots, parity)
    by_stage = GroupBackward(group) if cfg.recompute_grain == "stage" and not kept else None
    first = True  # the first microbatch that computes waits for each layer; later ones find them there
    order = part_microbatches(part, run.fused_parts, batch.num_microbatch) if split else range(batch.num_microbatch)
    tiles = None
    if run.sequence is not None:
        # The tiles of one sequence, last first: tile t's key and value gradients come from tiles t..T-1.
        order, tiles = range(batch.num_microbatch - 1, -1, -1), run.sequence.job_store(device, backward=True)
    for m in order:
        device.where = (_at_job, (run, "backward", layers, m))
        tracker.backward_wait_for(layer_group_id, m)
        ctx = run.contexts[m]
        if all(g is None for g in ctx.grad_states) and ctx.grad_handoff is None:
            n_in = drop_kept(run, layers, m) if kept else run.drop_stage_input(ctx, layers.start)
            ctx.grad_states, ctx.grad_events = [None] * n_in, []
            tracker.backward_notify(layer_group_id, m)
            continue
        if kept:
            dev_grads = _take_grads(device, ctx)
            device.compute_stream.wait_stream(device.upstream)  # the output gradients' upload, if any
            with _on_compute(device, run), clock:
                in_grads = kept_backward(run, device, layers, m, dev_grads)
            first = False
            _give_grads(device, run, ctx, layer_group_id, in_grads)
            device.mem_manager.free((dev_grads, in_grads), device.compute_stream, device.downstream)
            del dev_grads, in_grads
            tracker.backward_notify(layer_group_id, m)
            continue
        dev_in, spec = run.take_stage_input(ctx, layers.start, device)
        dev_grads = _take_grads(device, ctx)
        recompute = {i: ctx.fetch_recompute_data(i, device) for i in layers}
        device.compute_stream.wait_stream(device.upstream)
        flags = ctx.input_requires_grad if layers.start == 0 else None
        inputs = BackwardInputs(ctx, m, dev_in, spec, dev_grads, recompute, flags)
        with _on_compute(device, run), clock, sequence.tile(tiles, m):
            if by_stage is not None:
                in_grads = by_stage(inputs)
            else:
                in_grads = backward_by_layer(run, device, layers, gpu_layers, ready, first, inputs)
        first = False
        _give_grads(device, run, ctx, layer_group_id, in_grads)
        device.mem_manager.free((dev_in, dev_grads, in_grads, recompute), device.compute_stream, device.downstream)
        del dev_in, dev_grads, in_grads, recompute, inputs  # (``inputs`` holds them too)
        tracker.backward_notify(layer_group_id, m)
    if first:
        # No microbatch computed (no gradient reached this stage): the downloads below still read the
        # gradients uploaded as seeds, so the compute stream (which the gradient stream follows) must
        # wait for the uploads.
        for k in range(len(ready)):
            wait_layer(device, ready, k)
    if by_stage is not None:
        by_stage.finish()
    if tiles is not None:
        tiles.finish(keep=False)
    _hand_grads_back(device, run, layers, gpu_layers, part, with_buffer=False, split=split)
    release_layers(gpu_layers, device, slots)
    device.job_done()
    clock.note(run, len(order), len(layers))


def _at_job(run: Run, what: str, layers: range, m: int) -> str:
    """A job waiting for its microbatch's input (the group before it, or after it in backward)."""
    span = f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else run.layer_name(layers.start)
    return f"model {run.model.name!r}: {what} job of {span}, before microbatch {m}"


def _at_fused(run: Run, what: str, i: int, m: int) -> str:
    return f"model {run.model.name!r}: {what} {run.layer_name(i)}, microbatch {m}"


def _at_loss(run: Run, m: int) -> str:
    return f"model {run.model.name!r}: loss_fn, microbatch {m}"


def _at_fused_backward(run: Run, layers: range, m: int) -> str:
    return (
        f"model {run.model.name!r}: fused backward of {run.layer_name(layers.start)}-{layers.stop - 1}, microbatch {m}"
    )


def _check_loss(loss: Any) -> List[torch.Tensor]:
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    for item in losses:
        if not isinstance(item, torch.Tensor) or item.numel() != 1:
            shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor or a sequence of scalar tensors; got {shape}. Reduce it, "
                "e.g. loss.mean() or loss.sum()"
            )
    return losses


def run_forward_backward(device: "DeviceManager", run: Run, part: int = 0) -> None:
    """The last backward group: forward, loss and backward in one job, with no recompute and no host
    round trip for the head. Losses (and outputs when asked) are downloaded per microbatch.

    Split over ``run.fused_parts`` devices, part ``part`` runs every ``parts``-th microbatch
    (``partial_grads.part_microbatches``, part 0 the last one); part 0 downloads the layers' gradients
    with the other parts' added in (``partial_grads``), the others only hand theirs over. Only part 0
    seeds its device gradients from the host (gradients accumulated by earlier calls), so the sum counts
    them once."""
    batch, tracker = run.batch, run.tracker
    gid = len(run.plan.bwd_plan) - 1
    layers = run.plan.bwd_plan[gid]
    assert run.loss_fn is not None
    clock = HostClock(device)
    device.graphs.begin_job()  # the fused job runs eagerly; it still takes its turn in the slot parity
    gpu_layers = _upload_group(device, run, layers, with_grad=True, for_recompute=False, seed=part == 0)
    mine = part_microbatches(part, run.fused_parts, batch.num_microbatch)
    for m in mine:
        device.where = (_at_job, (run, "fused forward-backward", layers, m))
        tracker.forward_wait_for(len(run.plan.fwd_plan), m)
        ctx = run.contexts[m]
        device.where = (_at_fused, (run, "fused forward-backward of", layers.start, m))
        spec = batch.flatten_specs[m]
        dev_in = _take_activation(device, run, m)
        label_leaves, label_spec = pytree.tree_flatten(batch.label_list[m])
        dev_label = pytree.tree_unflatten(async_h2d(device, [], label_leaves), label_spec)
        device.compute_stream.wait_stream(device.upstream)
        flags = ctx.input_requires_grad if layers.start == 0 else None
        with _on_compute(device, run), torch.enable_grad(), clock:
            leaves = grad_leaves(dev_in, flags)
            x = pytree.tree_unflatten(leaves, spec)
            for i, layer in zip(layers, gpu_layers):
                device.where = (_at_fused, (run, "fused forward of", i, m))
                with run.timer.time_fwd("fwd", i, device.compute_stream):
                    x = wrap(call_layer(layer, x))
            out = x[0][0]
            with run.timer.time_bwd(layers, device.compute_stream):
                device.where = (_at_loss, (run, m))
                raw_loss = run.loss_fn(out, dev_label)
                run.loss_is_sequence = isinstance(raw_loss, (list, tuple))
                losses = _check_loss(raw_loss)
                device.where = (_at_fused_backward, (run, layers, m))
                total = losses[0] if len(losses) == 1 else torch.stack([t.reshape(()) for t in losses]).sum()
                if total.requires_grad:
                    total.backward()
            in_grads = input_grads(leaves)
        events: List[Any] = []
        loss_host = async_d2h(device, events, [t.detach().reshape(()) for t in losses])
        batch.loss_list[m] = loss_host
        if run.return_outputs:
            out_leaves, out_spec = pytree.tree_flatten(out)
            run.outputs[m] = pytree.tree_unflatten(
                async_d2h(device, events, [t.detach() if isinstance(t, torch.Tensor) else t for t in out_leaves]),
                out_spec,
            )
        batch.forward_events[m] = events
        _give_grads(device, run, ctx, gid, in_grads)
        device.mem_manager.free((dev_in, dev_label, in_grads, out), device.compute_stream, device.downstream)
        del dev_in, dev_label, in_grads, out, x, leaves, total, losses
        tracker.backward_notify(gid, m)
    _hand_grads_back(device, run, layers, gpu_layers, part, with_buffer=True, split=run.partial_grads is not None)
    release_layers(gpu_layers, device)
    device.job_done()
    clock.note(run, len(mine), len(layers))
