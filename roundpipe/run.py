"""The runtime of one RoundPipe call: forward, backward and fused jobs on device threads, the main-thread
dispatch, and the autograd node that connects the pipelined backward to PyTorch's graph.

One job is one layer group over all microbatches of the call, run by one device's controller thread:
upload the group's parameters (parameter stream), then per microbatch wait for the previous group's
result (``ModelTracker``), upload the activation (activation stream), compute, download the result
(download stream). Training forwards run without an autograd graph and keep only each backward stage's
input on the host; backward jobs recompute the stage from it and back-propagate.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe import backend, device as device_mod
from roundpipe.batch import Batch
from roundpipe.context import ForwardCtx, RecomputeCtx
from roundpipe.scheduler import ModelExecutePlan, ModelTracker, RunType
from roundpipe.threads import RoundPipeAborted, raise_if_failed, report_failure
from roundpipe.transfer import (
    TiedGrads,
    async_d2h,
    async_h2d,
    device_saved_limit,
    download_layer,
    release_layers,
    snapshot_buffers,
    tensor_bytes,
    upload_layers,
    wait_layer,
)

if TYPE_CHECKING:
    from roundpipe.device import DeviceManager
    from roundpipe.roundpipe import RoundPipe

Leaves = List[Any]


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class RoundPipeRunContext:
    """Per-microbatch state shared between the forward and backward jobs of one call.

    Attributes:
        microbatch_id: Index of this microbatch.
        flatten_inputs: Host copies of each backward stage's input: layer id -> (leaves, spec, events).
        device_inputs: Backward-stage inputs kept on the device instead (``RPP_DEVICE_SAVED_GB``, one
            device only): layer id -> (leaves, spec).
        input_requires_grad: For the model input: which leaves the caller wants gradients for.
        recompute_data: Data layers saved for recompute: layer id -> (host leaves, spec, events).
        rng_states: Device RNG state captured before each layer's forward (``preserve_rng_state``).
        grad_states: Host gradients w.r.t. the outputs of the next backward group to run.
        grad_events: Events marking ``grad_states`` on the host.
    """

    def __init__(self, microbatch_id: int) -> None:
        self.microbatch_id = microbatch_id
        self.flatten_inputs: Dict[int, Tuple[Leaves, pytree.TreeSpec, List[Any]]] = {}
        self.device_inputs: Dict[int, Tuple[Leaves, pytree.TreeSpec]] = {}
        self.input_requires_grad: List[bool] = []
        self.recompute_data: Dict[int, Tuple[Leaves, pytree.TreeSpec, List[Any]]] = {}
        self.rng_states: Dict[int, torch.Tensor] = {}
        self.grad_states: List[Optional[torch.Tensor]] = []
        self.grad_events: List[Any] = []
        self.grad_handoff: Optional[Tuple[Any, List[Optional[torch.Tensor]]]] = None

    def save_for_recompute(self, layer_id: int, device: "DeviceManager", *data: Any) -> None:
        """Download data a layer saved in forward; it is uploaded again for the layer's recompute."""
        if layer_id in self.recompute_data:
            raise RuntimeError(f"save_for_recompute called twice by layer {layer_id}; call it at most once per forward")
        leaves, spec = pytree.tree_flatten(data)
        events: List[Any] = []
        host = async_d2h(device, events, leaves)
        self.recompute_data[layer_id] = (host, spec, events)

    def fetch_recompute_data(self, layer_id: int, device: "DeviceManager") -> Optional[Tuple[Any, ...]]:
        """Upload the data ``layer_id`` saved in forward (None if it saved nothing)."""
        saved = self.recompute_data.get(layer_id)
        if saved is None:
            return None
        host, spec, events = saved
        dev = async_h2d(device, events, host)
        device.compute_stream.wait_stream(device.upstream)
        return pytree.tree_unflatten(dev, spec)


class Run:
    """State of one RoundPipe call, shared by the main thread and the jobs it dispatches."""

    def __init__(
        self,
        model: "RoundPipe",
        run_config: Any,
        batch: Batch,
        run_type: RunType,
        plan: ModelExecutePlan,
        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
        return_outputs: bool = False,
    ) -> None:
        self.model = model
        self.cfg = run_config
        self.batch = batch
        self.run_type = run_type
        self.enable_grad = run_type != "infer"
        self.plan = plan
        self.tracker = ModelTracker(plan)
        self.contexts = [RoundPipeRunContext(m) for m in range(batch.num_microbatch)]
        self.saved_buffers: Dict[int, Dict[str, torch.Tensor]] = {}
        self.loss_fn = loss_fn
        self.return_outputs = return_outputs
        self.outputs: List[Any] = [None] * batch.num_microbatch
        self.timer = model.model_timer.new_iter()
        # Which device runs each job ('f', g) / ('b', b) / ('fb', 0), fixed at dispatch (round robin).
        self.job_device: Dict[Tuple[str, int], "DeviceManager"] = {}
        # Activations and gradients handed to the next job on the same device stay there: (device, leaves).
        self.act_handoff: List[Optional[Tuple["DeviceManager", Leaves]]] = [None] * batch.num_microbatch
        self.backward_done = False
        self.loss_is_sequence = False
        # Bytes of backward-stage inputs this call may still keep on the device (one device only: there
        # every job runs on the same device thread, the only one that reserves from this budget). The
        # budget is per call: every call awaiting its backward may hold this much.
        self.device_saved_left = device_saved_limit() if self.enable_grad and device_mod.get_num_devices() == 1 else 0
        # Gradient shares of tied parameters, summed into the owner layer's share on its device.
        self.tied = TiedGrads(model.layer_attrs, device_mod.get_num_devices() == 1) if self.enable_grad else None
        # Per microbatch: group boundaries whose output the producing job left on the device for the
        # next job to keep as its saved stage input (no host copy was made).
        self.kept_inputs: List[Set[int]] = [set() for _ in range(batch.num_microbatch)]
        # Autocast is thread-local: carry the caller's settings into the device threads.
        self.autocast: List[Tuple[str, torch.dtype]] = [
            (dt, torch.get_autocast_dtype(dt)) for dt in ("cuda", "cpu") if torch.is_autocast_enabled(dt)
        ]
        # The model input per microbatch (the batch's states are replaced by each group's outputs).
        self.input_leaves: List[Leaves] = [list(leaves) for leaves in batch.flatten_states]
        for ctx, leaves in zip(self.contexts, batch.flatten_states):
            ctx.input_requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]

    def keep_on_device(self, leaves: Leaves) -> bool:
        """Reserve room to keep a backward-stage input on the device (instead of a host copy); the
        room is not given back within the call (all its forward jobs run before its backward jobs)."""
        nbytes = tensor_bytes(leaves)
        if nbytes == 0 or nbytes > self.device_saved_left:
            return False
        self.device_saved_left -= nbytes
        return True

    def take_stage_input(self, ctx: RoundPipeRunContext, layer_id: int, device: "DeviceManager") -> Tuple[Leaves, pytree.TreeSpec]:
        """Backward stage ``layer_id``'s saved input of ``ctx``'s microbatch on ``device``: kept there in
        forward, or uploaded from its host copy."""
        kept = ctx.device_inputs.pop(layer_id, None)
        if kept is not None:
            return kept
        host_in, spec, in_events = ctx.flatten_inputs.pop(layer_id)
        return async_h2d(device, in_events, host_in), spec

    def drop_stage_input(self, ctx: RoundPipeRunContext, layer_id: int) -> int:
        """Drop backward stage ``layer_id``'s saved input of ``ctx``'s microbatch (no gradient reached
        the stage, so nothing is recomputed) and return how many leaves it had: the stage then hands
        that many empty gradients on."""
        kept = ctx.device_inputs.pop(layer_id, None)
        if kept is not None:
            return len(kept[0])
        host_in, _, _ = ctx.flatten_inputs.pop(layer_id)
        return len(host_in)

    def release(self) -> None:
        """Drop what backward needed (saved inputs, gradients, recompute data) once it has run."""
        self.contexts = []
        self.input_leaves = []
        self.saved_buffers = {}
        self.timer.finish()

    def autocast_ctx(self, device: "DeviceManager") -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for dt, dtype in self.autocast:
            if dt == device.device.type:
                stack.enter_context(torch.autocast(dt, dtype=dtype))
        return stack

    def layer_name(self, i: int) -> str:
        return f"layer {i} ({type(self.model.layers[i]).__name__})"


# ---- device jobs ---------------------------------------------------------------------------------------


def _call_layer(layer: torch.nn.Module, x: Tuple[Tuple[Any, ...], Dict[str, Any]]) -> Any:
    return layer(*x[0], **x[1])


def _wrap(out: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A layer's output as the next layer's (args, kwargs)."""
    return ((out,), {})


def _take_activation(device: "DeviceManager", run: Run, m: int) -> Leaves:
    """Microbatch m's stage input on ``device``: handed over on the device by the previous job when it
    ran there (no host round trip), else uploaded from the host copy."""
    handoff = run.act_handoff[m]
    run.act_handoff[m] = None
    if handoff is not None and handoff[0] is device:
        return handoff[1]
    batch = run.batch
    return async_h2d(device, batch.forward_events[m], batch.flatten_states[m])


def _next_forward_device(run: Run, group: int) -> Optional["DeviceManager"]:
    """The device of the job that consumes forward group ``group``'s output (None: the caller)."""
    if group + 1 < len(run.plan.fwd_plan):
        return run.job_device.get(("f", group + 1))
    return run.job_device.get(("fb", 0))


def _take_grads(device: "DeviceManager", ctx: RoundPipeRunContext) -> List[Optional[torch.Tensor]]:
    handoff = ctx.grad_handoff
    ctx.grad_handoff = None
    if handoff is not None and handoff[0] is device:
        return handoff[1]
    return async_h2d(device, ctx.grad_events, ctx.grad_states)


def _give_grads(device: "DeviceManager", run: Run, ctx: RoundPipeRunContext, group: int, in_grads: List[Optional[torch.Tensor]]) -> None:
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
    device: "DeviceManager", run: Run, layers: range, with_grad: bool, for_recompute: bool, ready: Optional[List[Any]] = None
) -> List[torch.nn.Module]:
    """Upload a job's layers; with ``ready``, compute waits layer by layer (``transfer.wait_layer``)."""
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
    for m in range(batch.num_microbatch):
        tracker.forward_wait_for(layer_group_id)
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
                            ctx.flatten_inputs[i] = (async_d2h(device, evs, leaves), sp, evs)
                if run.enable_grad and cfg.preserve_rng_state:
                    ctx.rng_states[i] = backend.get_rng_state(device.device)
                save = (lambda i: lambda *d: ctx.save_for_recompute(i, device, *d))(i)
                with ForwardCtx(save) if run.enable_grad else contextlib.nullcontext(), run.timer.time_fwd("fwd", i, device.compute_stream):
                    x = _wrap(_call_layer(layer, x))
            out_leaves, out_spec = pytree.tree_flatten(x)
        consumer = _next_forward_device(run, layer_group_id)
        if consumer is device:
            run.act_handoff[m] = (device, out_leaves)
        # The host copy is needed by another device, by the caller, or as a saved backward-stage input.
        saved_for_backward = run.enable_grad and tracker.backward_need_input(layers.stop) and not (
            run.run_type == "fused" and layers.stop == run.plan.bwd_plan[-1].start  # the fused job saves nothing
        )
        if consumer is device and saved_for_backward and run.keep_on_device(out_leaves):
            # The next job runs here and keeps this output, its stage input, on the device.
            run.kept_inputs[m].add(layers.stop)
            saved_for_backward = False
        if consumer is not device or saved_for_backward:
            out_events: List[Any] = []
            batch.flatten_states[m] = async_d2h(device, out_events, out_leaves)
            batch.forward_events[m] = out_events
        else:
            batch.flatten_states[m] = [None if isinstance(t, torch.Tensor) else t for t in out_leaves]
            batch.forward_events[m] = []
        batch.flatten_specs[m] = out_spec
        device.mem_manager.free((dev_leaves, out_leaves), device.compute_stream, device.downstream)
        del dev_leaves, out_leaves, x
        tracker.forward_notify(layer_group_id)
    for i, layer in zip(layers, gpu_layers):
        download_layer(model.layers[i], layer, i, model.layer_attrs[i], device, with_buffer=True, with_grad=False)
    release_layers(gpu_layers, device)
    device.job_done()


def _backward_through(outputs: Leaves, grads: Sequence[Optional[torch.Tensor]], where: str) -> None:
    """Back-propagate ``grads`` into ``outputs`` (pairs without gradient are skipped)."""
    if len(outputs) != len(grads):
        raise RuntimeError(f"{where}: recompute produced {len(outputs)} outputs but forward produced {len(grads)}; "
                           "a layer's output structure must not change between forward and recompute")
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])


def _grad_leaves(leaves: Leaves, flags: Optional[List[bool]]) -> Leaves:
    """Fresh leaves that collect input gradients: every float tensor, or those ``flags`` marks."""
    out = []
    for k, t in enumerate(leaves):
        want = flags[k] if flags is not None else _differentiable(t)
        out.append(t.detach().requires_grad_(True) if want and isinstance(t, torch.Tensor) else t)
    return out


def _input_grads(leaves: Leaves) -> List[Optional[torch.Tensor]]:
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]


class _RngFork:
    """Run recompute on the saved RNG states, then give the device its own RNG state back."""

    def __init__(self, run: Run, device: "DeviceManager", ctx: RoundPipeRunContext) -> None:
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


def run_backward(device: "DeviceManager", run: Run, layer_group_id: int) -> None:
    """Recompute + backward of one layer group for all microbatches; parameter gradients accumulate on
    the device over microbatches and are downloaded once into the host gradient slots."""
    model, batch, tracker, cfg = run.model, run.batch, run.tracker, run.cfg
    layers = run.plan.bwd_plan[layer_group_id]
    # Per-layer upload events: the first recompute starts on the first layer while the rest upload
    # (the backward itself runs after the recompute has waited for every layer).
    ready: List[Any] = []
    gpu_layers = _upload_group(device, run, layers, with_grad=True, for_recompute=True, ready=ready)
    first = True  # the first microbatch that computes waits for each layer; later ones find them there
    for m in range(batch.num_microbatch):
        tracker.backward_wait_for(layer_group_id)
        ctx = run.contexts[m]
        device.location = f"model {model.name!r}: backward of {run.layer_name(layers.stop - 1)}, microbatch {m}"
        if all(g is None for g in ctx.grad_states) and ctx.grad_handoff is None:
            ctx.grad_states, ctx.grad_events = [None] * run.drop_stage_input(ctx, layers.start), []
            tracker.backward_notify(layer_group_id)
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
        tracker.backward_notify(layer_group_id)
    if first:
        # No microbatch computed (no gradient reached this stage): the downloads below still read the
        # gradients uploaded as seeds, so the compute stream (which the download stream follows) must
        # wait for the uploads.
        for k in range(len(ready)):
            wait_layer(device, ready, k)
    for i, layer in zip(layers, gpu_layers):
        download_layer(model.layers[i], layer, i, model.layer_attrs[i], device, with_buffer=False, with_grad=True, tied=run.tied, job_layers=layers)
    release_layers(gpu_layers, device)
    device.job_done()


def _check_loss(loss: Any) -> List[torch.Tensor]:
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    for item in losses:
        if not isinstance(item, torch.Tensor) or item.numel() != 1:
            shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(f"loss_fn must return a scalar tensor or a sequence of scalar tensors; got {shape}. Reduce it, e.g. loss.mean() or loss.sum()")
    return losses


def run_forward_backward(device: "DeviceManager", run: Run) -> None:
    """The last backward group: forward, loss and backward in one job, with no recompute and no host
    round trip for the head. Losses (and outputs when asked) are downloaded per microbatch."""
    model, batch, tracker = run.model, run.batch, run.tracker
    gid = len(run.plan.bwd_plan) - 1
    layers = run.plan.bwd_plan[gid]
    assert run.loss_fn is not None
    gpu_layers = _upload_group(device, run, layers, with_grad=True, for_recompute=False)
    for m in range(batch.num_microbatch):
        tracker.forward_wait_for(len(run.plan.fwd_plan))
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
        tracker.fused_forward_notify()
        tracker.backward_notify(gid)
    for i, layer in zip(layers, gpu_layers):
        download_layer(model.layers[i], layer, i, model.layer_attrs[i], device, with_buffer=True, with_grad=True, tied=run.tied, job_layers=layers)
    release_layers(gpu_layers, device)
    device.job_done()


# ---- main-thread dispatch --------------------------------------------------------------------------------


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
        if isinstance(exc, torch.OutOfMemoryError) or isinstance(device_mod.threads_failure(), torch.OutOfMemoryError):
            # Give the failed run's memory back so the next call (e.g. with more microbatches) fits.
            run.release()
            device_mod.gc_collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        raise_if_failed(what)
        raise


def _wait_plain(d: "DeviceManager") -> None:
    """Wait, without aborting, until ``d`` has no job queued or running."""
    import threading

    threading.Event.wait(d.drained)


def _assign(run: Run, jobs: Sequence[Tuple[str, int]]) -> List[Tuple[str, int, "DeviceManager"]]:
    """Give each job the next device round robin (fixed before launch so jobs know their consumers)."""
    out = []
    for kind, gid in jobs:
        dev = device_mod.get_next_device()
        run.job_device[(kind, gid)] = dev
        out.append((kind, gid, dev))
    return out


def _launch(run: Run, jobs: List[Tuple[str, int, "DeviceManager"]]) -> None:
    """Fence each job's layers (attribute.py protocol), then hand the job to its device."""
    attrs = run.model.layer_attrs
    for kind, gid, dev in jobs:
        if kind == "f":
            for i in run.plan.fwd_plan[gid]:
                attrs[i].forward_fence()
            dev.launch_forward(gid, run)
        elif kind == "b":
            for i in run.plan.bwd_plan[gid]:
                attrs[i].backward_fence()
            dev.launch_backward(gid, run)
        else:
            for i in run.plan.bwd_plan[-1]:
                attrs[i].forward_backward_fence()
            dev.launch_forward_backward(run)


def dispatch_forward(run: Run) -> None:
    """Dispatch every forward group round robin, then wait until all microbatches are through."""
    _launch(run, _assign(run, [("f", g) for g in range(len(run.plan.fwd_plan))]))
    run.tracker.forward_wait_complete(run.batch.num_microbatch)


def dispatch_backward(run: Run) -> None:
    """Dispatch the backward groups, last first, round robin, then wait for group 0."""
    _launch(run, _assign(run, [("b", b) for b in range(len(run.plan.bwd_plan) - 1, -1, -1)]))
    run.tracker.backward_wait_complete(run.batch.num_microbatch)


def dispatch_fused(run: Run) -> None:
    """forward_backward: forward groups, the fused last group, then the other backward groups."""
    n_bwd = len(run.plan.bwd_plan)
    jobs = [("f", g) for g in range(len(run.plan.fwd_plan))] + [("fb", 0)] + [("b", b) for b in range(n_bwd - 2, -1, -1)]
    _launch(run, _assign(run, jobs))
    run.tracker.backward_wait_complete(run.batch.num_microbatch)


def finish_backward(run: Run) -> None:
    """After all backward jobs: wait for the gradient downloads (one fence) and fold shared-parameter
    gradient shares into ``param.grad``."""
    for i in range(run.model.num_layers):
        run.model.layer_attrs[i].grad_downloaded.synchronize()
    run.model.reduce_shared_grads()


class RoundPipeBatchedBackward(torch.autograd.Function):
    """Autograd node of a whole RoundPipe call: its forward runs the pipelined forward of all
    microbatches; its backward runs the pipelined backward and returns the input gradients."""

    @staticmethod
    def forward(ctx: Any, run: Run, tag: torch.Tensor, *all_inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.run = run
        ctx.set_materialize_grads(False)
        guarded(run, f"model {run.model.name!r} forward", lambda: dispatch_forward(run))
        outs: List[torch.Tensor] = [t for leaves in run.batch.flatten_states for t in leaves if isinstance(t, torch.Tensor)]
        nondiff = [t for t in outs if not _differentiable(t)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        run: Run = ctx.run
        if run.backward_done:
            raise RuntimeError(
                f"RoundPipe model {run.model.name!r}: backward through the same forward a second time; "
                "RoundPipe frees the saved activations after the first backward (retain_graph is not supported). Run forward again."
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
