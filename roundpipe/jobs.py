"""What a device thread runs: the forward, backward and fused forward-backward jobs of one call.

One job is one layer group over all microbatches of the call, run by one device's controller thread:
upload the group's parameters (parameter stream), then per microbatch wait for the previous group's
result (``ModelTracker``), upload the activation (activation stream), compute, download the result
(download stream). Training forwards run without an autograd graph and keep only each backward stage's
input on the host; backward jobs recompute the stage from it and back-propagate. The main thread
hands jobs to devices in ``roundpipe.pipeline``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe import backend, settings
from roundpipe.context import ForwardCtx, RecomputeCtx
from roundpipe.run import Leaves, MicrobatchState, Run, differentiable
from roundpipe.transfer import async_d2h, async_h2d, download_layer, peer_copy, release_layers, snapshot_buffers, upload_layers, wait_layer

if TYPE_CHECKING:
    from roundpipe.device import DeviceManager


def _call_layer(layer: torch.nn.Module, x: Tuple[Tuple[Any, ...], Dict[str, Any]]) -> Any:
    return layer(*x[0], **x[1])


def _wrap(out: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A layer's output as the next layer's (args, kwargs)."""
    return ((out,), {})


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


def _download_reusing(device: "DeviceManager", events: List[Any], leaves: Leaves, dev_inputs: Leaves, host_inputs: Leaves, input_events: List[Any]) -> Leaves:
    """Host copies of a job's output ``leaves`` for the next job or a backward stage. A leaf that is one of
    the job's input tensors, passed through its layers unchanged (position ids, rotary tables, labels
    of a causal LM), reuses that input's host copy instead of a new download: one host copy per call,
    not one per backward stage (at long context the rotary tables alone are ~6% of a checkpoint).
    ``events`` gets the new downloads' events and, when a copy is reused, the input's (the reused copy
    may still be landing)."""
    by_id = {id(d): h for d, h in zip(dev_inputs, host_inputs) if isinstance(d, torch.Tensor) and isinstance(h, torch.Tensor)}
    reused = [by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves]
    if not any(r is not None for r in reused):
        return async_d2h(device, events, leaves)
    fresh = async_d2h(device, events, [t if r is None else None for t, r in zip(leaves, reused)])
    events.extend(input_events)
    return [r if r is not None else f for r, f in zip(reused, fresh)]


def _next_forward_device(run: Run, group: int, m: int) -> Optional["DeviceManager"]:
    """The device of the job that consumes forward group ``group``'s output of microbatch ``m`` (None:
    the caller)."""
    if group + 1 < len(run.plan.fwd_plan):
        return run.job_device.get(("f", group + 1))
    return run.job_device.get(("fb", m % run.fused_parts))


def _take_grads(device: "DeviceManager", ctx: MicrobatchState) -> List[Optional[torch.Tensor]]:
    handoff = ctx.grad_handoff
    ctx.grad_handoff = None
    if handoff is not None and handoff[0] is device:
        return handoff[1]
    return async_h2d(device, ctx.grad_events, ctx.grad_states)


def _give_grads(device: "DeviceManager", run: Run, ctx: MicrobatchState, group: int, in_grads: List[Optional[torch.Tensor]]) -> None:
    """Input gradients of backward group ``group`` go to group - 1: on the device if it runs here, else
    (and for the model input) to the host."""
    if group > 0 and run.job_device.get(("b", group - 1)) is device:
        ctx.grad_handoff = (device, in_grads)
        ctx.grad_states, ctx.grad_events = [], []
        return
    events: List[Any] = []
    ctx.grad_states = async_d2h(device, events, in_grads)
    ctx.grad_events = events


def _upload_group(
    device: "DeviceManager", run: Run, layers: range, with_grad: bool, for_recompute: bool, ready: Optional[List[Any]] = None, seed: bool = True
) -> List[torch.nn.Module]:
    """Upload a job's layers; with ``ready``, compute waits layer by layer (``transfer.wait_layer``).
    ``seed``: start device gradients from the host's (accumulated by earlier calls of this step)."""
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
    )


def _hand_grads_back(device: "DeviceManager", run: Run, layers: range, gpu_layers: List[torch.nn.Module], part: int, with_buffer: bool, split: bool) -> None:
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
    model, batch, tracker, cfg = run.model, run.batch, run.tracker, run.cfg
    layers = run.plan.fwd_plan[layer_group_id]
    if run.enable_grad:
        for i in layers:
            if any(True for _ in model.layers[i].buffers()):
                # The previous forward's buffer download must land before we copy the host buffers.
                model.layer_attrs[i].buffer_downloaded.synchronize()
                run.saved_buffers[i] = snapshot_buffers(model.layers[i])
    # Per-layer upload events: the first microbatch starts on the first layer while the rest upload.
    ready: List[Any] = []
    gpu_layers = _upload_group(device, run, layers, with_grad=False, for_recompute=False, ready=ready)
    peer_handoff = settings.PEER_HANDOFF.get()
    for m in range(batch.num_microbatch):
        tracker.forward_wait_for(layer_group_id, m)
        ctx = run.contexts[m]
        device.location = f"model {model.name!r}: forward of {run.layer_name(layers.start)}, microbatch {m}"
        host_leaves, spec, events = batch.flatten_states[m], batch.flatten_specs[m], batch.forward_events[m]
        dev_leaves = _take_activation(device, run, m)
        device.compute_stream.wait_stream(device.upstream)
        with backend.use_stream(device.compute_stream), backend.compute_guard(device.device), torch.no_grad(), run.autocast_ctx(device):
            x = pytree.tree_unflatten(dev_leaves, spec)
            for k, (i, layer) in enumerate(zip(layers, gpu_layers)):
                device.location = f"model {model.name!r}: forward of {run.layer_name(i)}, microbatch {m}"
                if m == 0:
                    wait_layer(device, ready, k)
                if run.enable_grad and tracker.backward_need_input(i):
                    if i == layers.start and i in run.kept_inputs[m]:
                        ctx.device_inputs[i] = (dev_leaves, spec)  # the previous job kept no host copy
                    elif i == layers.start:
                        ctx.flatten_inputs[i] = (host_leaves, spec, events)
                    else:
                        leaves, sp = pytree.tree_flatten(x)
                        if run.keep_on_device(leaves):
                            ctx.device_inputs[i] = (leaves, sp)
                        else:
                            evs: List[Any] = []
                            ctx.flatten_inputs[i] = (_download_reusing(device, evs, leaves, dev_leaves, host_leaves, events), sp, evs)
                if run.enable_grad and cfg.preserve_rng_state:
                    ctx.rng_states[i] = backend.get_rng_state(device.device)
                save = functools.partial(ctx.save_for_recompute, i, device)
                with ForwardCtx(save) if run.enable_grad else contextlib.nullcontext(), run.timer.time_fwd("fwd", i, device.compute_stream):
                    x = _wrap(_call_layer(layer, x))
            out_leaves, out_spec = pytree.tree_flatten(x)
        consumer = _next_forward_device(run, layer_group_id, m)
        peer = peer_handoff and consumer is not None and consumer is not device
        if consumer is device:
            run.act_handoff[m] = (device, out_leaves, [])
        elif peer and consumer is not None:
            run.act_handoff[m] = (consumer, *peer_copy(device, consumer, out_leaves))
        # The host copy is needed by another device, by the caller, or as a saved backward-stage input.
        saved_for_backward = (
            run.enable_grad
            and tracker.backward_need_input(layers.stop)
            and not (
                run.run_type == "fused" and layers.stop == run.plan.bwd_plan[-1].start  # the fused job saves nothing
            )
        )
        if consumer is device and saved_for_backward and run.keep_on_device(out_leaves):
            # The next job runs here and keeps this output, its stage input, on the device.
            run.kept_inputs[m].add(layers.stop)
            saved_for_backward = False
        if (consumer is not device and not peer) or saved_for_backward:
            out_events: List[Any] = []
            batch.flatten_states[m] = _download_reusing(device, out_events, out_leaves, dev_leaves, host_leaves, events)
            batch.forward_events[m] = out_events
        else:
            batch.flatten_states[m] = [None if isinstance(t, torch.Tensor) else t for t in out_leaves]
            batch.forward_events[m] = []
        batch.flatten_specs[m] = out_spec
        device.mem_manager.free((dev_leaves, out_leaves), device.compute_stream, device.downstream)
        del dev_leaves, out_leaves, x
        tracker.forward_notify(layer_group_id, m)
    for i, layer in zip(layers, gpu_layers):
        download_layer(model.layers[i], layer, i, model.layer_attrs[i], device, with_buffer=True, with_grad=False)
    release_layers(gpu_layers, device)
    device.job_done()


def _backward_through(outputs: Leaves, grads: Sequence[Optional[torch.Tensor]], where: str) -> None:
    """Back-propagate ``grads`` into ``outputs`` (pairs without gradient are skipped)."""
    if len(outputs) != len(grads):
        raise RuntimeError(
            f"{where}: recompute produced {len(outputs)} outputs but forward produced {len(grads)}; "
            "a layer's output structure must not change between forward and recompute"
        )
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])


def _grad_leaves(leaves: Leaves, flags: Optional[List[bool]]) -> Leaves:
    """Fresh leaves that collect input gradients: every float tensor, or those ``flags`` marks."""
    out = []
    for k, t in enumerate(leaves):
        want = flags[k] if flags is not None else differentiable(t)
        out.append(t.detach().requires_grad_(True) if want and isinstance(t, torch.Tensor) else t)
    return out


def _input_grads(leaves: Leaves) -> List[Optional[torch.Tensor]]:
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]


class _RngFork:
    """Run recompute on the saved RNG states, then give the device its own RNG state back."""

    def __init__(self, run: Run, device: "DeviceManager", ctx: MicrobatchState) -> None:
        self.run, self.device, self.ctx = run, device, ctx
        self.enabled = run.cfg.preserve_rng_state

    def __enter__(self) -> "_RngFork":
        if self.enabled:
            self.own = backend.get_rng_state(self.device.device)
        return self

    def restore(self, layer_id: int) -> None:
        if self.enabled:
            state = self.ctx.rng_states.get(layer_id)
            if state is None:
                raise RuntimeError(f"no RNG state saved for layer {layer_id}; preserve_rng_state changed between forward and backward")
            backend.set_rng_state(self.device.device, state)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            backend.set_rng_state(self.device.device, self.own)


def run_backward(device: "DeviceManager", run: Run, layer_group_id: int, part: int = 0) -> None:
    """Recompute + backward of one layer group for all microbatches; parameter gradients accumulate on
    the device over microbatches and are downloaded once into the host gradient slots.

    The last group of a 'train' call (the first backward job) may run in ``run.fused_parts`` parts, as
    the fused job does (``run_forward_backward``): part ``part`` takes microbatches part, part + parts,
    ...; part 0 seeds and downloads, the others hand their gradients over (``partial_grads``)."""
    model, batch, tracker, cfg = run.model, run.batch, run.tracker, run.cfg
    layers = run.plan.bwd_plan[layer_group_id]
    split = layer_group_id == len(run.plan.bwd_plan) - 1 and run.fused_parts > 1
    # Per-layer upload events: the first recompute starts on the first layer while the rest upload
    # (the backward itself runs after the recompute has waited for every layer).
    ready: List[Any] = []
    gpu_layers = _upload_group(device, run, layers, with_grad=True, for_recompute=True, ready=ready, seed=part == 0)
    first = True  # the first microbatch that computes waits for each layer; later ones find them there
    for m in range(part, batch.num_microbatch, run.fused_parts if split else 1):
        tracker.backward_wait_for(layer_group_id, m)
        ctx = run.contexts[m]
        device.location = f"model {model.name!r}: backward of {run.layer_name(layers.stop - 1)}, microbatch {m}"
        if all(g is None for g in ctx.grad_states) and ctx.grad_handoff is None:
            ctx.grad_states, ctx.grad_events = [None] * run.drop_stage_input(ctx, layers.start), []
            tracker.backward_notify(layer_group_id, m)
            continue
        dev_in, spec = run.take_stage_input(ctx, layers.start, device)
        dev_grads = _take_grads(device, ctx)
        recompute = {i: ctx.fetch_recompute_data(i, device) for i in layers}
        device.compute_stream.wait_stream(device.upstream)
        flags = ctx.input_requires_grad if layers.start == 0 else None
        with backend.use_stream(device.compute_stream), backend.compute_guard(device.device), run.autocast_ctx(device), _RngFork(run, device, ctx) as rng:
            if cfg.recompute_grain == "stage":
                with torch.enable_grad():
                    leaves = _grad_leaves(dev_in, flags)
                    x = pytree.tree_unflatten(leaves, spec)
                    for k, (i, layer) in enumerate(zip(layers, gpu_layers)):
                        device.location = f"model {model.name!r}: recompute of {run.layer_name(i)}, microbatch {m}"
                        if first:
                            wait_layer(device, ready, k)
                        rng.restore(i)
                        with RecomputeCtx(recompute[i]), run.timer.time_fwd("re", i, device.compute_stream):
                            x = _wrap(_call_layer(layer, x))
                    device.location = f"model {model.name!r}: backward of {run.layer_name(layers.start)}-{layers.stop - 1}, microbatch {m}"
                    with run.timer.time_bwd(layers, device.compute_stream):
                        _backward_through(pytree.tree_leaves(x), dev_grads, device.location)
                    in_grads = _input_grads(leaves)
            else:
                # 'layer': recompute the stage without a graph to get each layer's input, then
                # recompute and back-propagate one layer at a time (one layer's graph alive at once).
                inputs: List[Tuple[Leaves, pytree.TreeSpec]] = []
                x_leaves, x_spec = dev_in, spec
                with torch.no_grad():
                    for k, (i, layer) in enumerate(zip(layers, gpu_layers)):
                        device.location = f"model {model.name!r}: recompute of {run.layer_name(i)}, microbatch {m}"
                        if first:
                            wait_layer(device, ready, k)
                        inputs.append((x_leaves, x_spec))
                        rng.restore(i)
                        with RecomputeCtx(recompute[i]):
                            x_leaves, x_spec = pytree.tree_flatten(_wrap(_call_layer(layer, pytree.tree_unflatten(x_leaves, x_spec))))
                grads = dev_grads
                for k in reversed(range(len(layers))):
                    i, layer = layers[k], gpu_layers[k]
                    device.location = f"model {model.name!r}: backward of {run.layer_name(i)}, microbatch {m}"
                    with torch.enable_grad():
                        leaves = _grad_leaves(inputs[k][0], flags if i == 0 else None)
                        rng.restore(i)
                        with RecomputeCtx(recompute[i]), run.timer.time_fwd("re", i, device.compute_stream):
                            out = _wrap(_call_layer(layer, pytree.tree_unflatten(leaves, inputs[k][1])))
                        with run.timer.time_bwd(range(i, i + 1), device.compute_stream):
                            _backward_through(pytree.tree_leaves(out), grads, device.location)
                        grads = _input_grads(leaves)
                    del out
                in_grads = grads
        first = False
        _give_grads(device, run, ctx, layer_group_id, in_grads)
        device.mem_manager.free((dev_in, dev_grads, in_grads, recompute), device.compute_stream, device.downstream)
        del dev_in, dev_grads, in_grads, recompute
        tracker.backward_notify(layer_group_id, m)
    if first:
        # No microbatch computed (no gradient reached this stage): the downloads below still read the
        # gradients uploaded as seeds, so the compute stream (which the gradient stream follows) must
        # wait for the uploads.
        for k in range(len(ready)):
            wait_layer(device, ready, k)
    _hand_grads_back(device, run, layers, gpu_layers, part, with_buffer=False, split=split)
    release_layers(gpu_layers, device)
    device.job_done()


def _check_loss(loss: Any) -> List[torch.Tensor]:
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    for item in losses:
        if not isinstance(item, torch.Tensor) or item.numel() != 1:
            shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(f"loss_fn must return a scalar tensor or a sequence of scalar tensors; got {shape}. Reduce it, e.g. loss.mean() or loss.sum()")
    return losses


def run_forward_backward(device: "DeviceManager", run: Run, part: int = 0) -> None:
    """The last backward group: forward, loss and backward in one job, with no recompute and no host
    round trip for the head. Losses (and outputs when asked) are downloaded per microbatch.

    Split over ``run.fused_parts`` devices, part ``part`` runs microbatches part, part + parts, ...;
    part 0 downloads the layers' gradients with the other parts' added in (``partial_grads``), the
    others only hand theirs over. Only part 0 seeds its device gradients from the host (gradients
    accumulated by earlier calls), so the sum counts them once."""
    model, batch, tracker = run.model, run.batch, run.tracker
    gid = len(run.plan.bwd_plan) - 1
    layers = run.plan.bwd_plan[gid]
    assert run.loss_fn is not None
    gpu_layers = _upload_group(device, run, layers, with_grad=True, for_recompute=False, seed=part == 0)
    for m in range(part, batch.num_microbatch, run.fused_parts):
        tracker.forward_wait_for(len(run.plan.fwd_plan), m)
        ctx = run.contexts[m]
        device.location = f"model {model.name!r}: fused forward-backward of {run.layer_name(layers.start)}, microbatch {m}"
        spec = batch.flatten_specs[m]
        dev_in = _take_activation(device, run, m)
        label_leaves, label_spec = pytree.tree_flatten(batch.label_list[m])
        dev_label = pytree.tree_unflatten(async_h2d(device, [], label_leaves), label_spec)
        device.compute_stream.wait_stream(device.upstream)
        flags = ctx.input_requires_grad if layers.start == 0 else None
        with backend.use_stream(device.compute_stream), backend.compute_guard(device.device), run.autocast_ctx(device), torch.enable_grad():
            leaves = _grad_leaves(dev_in, flags)
            x = pytree.tree_unflatten(leaves, spec)
            for i, layer in zip(layers, gpu_layers):
                device.location = f"model {model.name!r}: fused forward of {run.layer_name(i)}, microbatch {m}"
                with run.timer.time_fwd("fwd", i, device.compute_stream):
                    x = _wrap(_call_layer(layer, x))
            out = x[0][0]
            with run.timer.time_bwd(layers, device.compute_stream):
                device.location = f"model {model.name!r}: loss_fn, microbatch {m}"
                raw_loss = run.loss_fn(out, dev_label)
                run.loss_is_sequence = isinstance(raw_loss, (list, tuple))
                losses = _check_loss(raw_loss)
                device.location = f"model {model.name!r}: fused backward of {run.layer_name(layers.start)}-{layers.stop - 1}, microbatch {m}"
                total = losses[0] if len(losses) == 1 else torch.stack([t.reshape(()) for t in losses]).sum()
                if total.requires_grad:
                    total.backward()
            in_grads = _input_grads(leaves)
        events: List[Any] = []
        loss_host = async_d2h(device, events, [t.detach().reshape(()) for t in losses])
        batch.loss_list[m] = loss_host
        if run.return_outputs:
            out_leaves, out_spec = pytree.tree_flatten(out)
            run.outputs[m] = pytree.tree_unflatten(async_d2h(device, events, [t.detach() if isinstance(t, torch.Tensor) else t for t in out_leaves]), out_spec)
        batch.forward_events[m] = events
        _give_grads(device, run, ctx, gid, in_grads)
        device.mem_manager.free((dev_in, dev_label, in_grads, out), device.compute_stream, device.downstream)
        del dev_in, dev_label, in_grads, out, x, leaves, total, losses
        tracker.backward_notify(gid, m)
    _hand_grads_back(device, run, layers, gpu_layers, part, with_buffer=True, split=run.partial_grads is not None)
    release_layers(gpu_layers, device)
    device.job_done()
