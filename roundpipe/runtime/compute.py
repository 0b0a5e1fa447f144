"""What one job computes for one microbatch: the forward of its layer group, or the recompute and
backward of it, on device tensors that are already in place.

``roundpipe.runtime.jobs`` moves data around these (uploads, hand-overs, downloads, the tracker); this module
only computes, eagerly or, for a group whose weights sit in graph slots, through the device's CUDA
graphs (``roundpipe.devices.graphs``). Both paths run the same function, so a graph replays exactly what the
eager warm-up computed:

* ``GroupForward``: the group's layers without an autograd graph; returns the output leaves and the
  inputs of the backward stages that start inside the group (kept for the backward's recompute).
* ``GroupBackward``: recompute with a graph and back-propagate, for the 'stage' recompute grain; the
  parameter gradients accumulate into the device copies' ``.grad``. The 'layer' grain (one layer's
  graph alive at a time) is ``backward_by_layer``, eager only.

Per-layer bookkeeping of the eager path (the location named in errors, the per-layer upload waits of
the first microbatch, RNG states saved for recompute, per-layer timing) stays outside a graph: a
graphed group waits for all its uploads before its first replay, draws no random numbers (checked in
the warm-up), and is timed as a whole (``IterTimer.time_group``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe.devices import backend, graphs
from roundpipe.devices import device as device_mod
from roundpipe.host.attribute import ParamAttribute
from roundpipe.runtime.context import ForwardCtx, RecomputeCtx
from roundpipe.runtime.run import Leaves, MicrobatchState, Run, differentiable
from roundpipe.runtime.transfer import HostScalar, slot_parts, wait_layer

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager

graphs.register_opaque(HostScalar)  # the head's token count rides through the decoder layers unread


def call_layer(layer: torch.nn.Module, x: Tuple[Tuple[Any, ...], Dict[str, Any]]) -> Any:
    return layer(*x[0], **x[1])


def wrap(out: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A layer's output as the next layer's (args, kwargs)."""
    return ((out,), {})


def grad_leaves(leaves: Leaves, flags: Optional[List[bool]]) -> Leaves:
    """Fresh leaves that collect input gradients: every float tensor, or those ``flags`` marks."""
    out = []
    for k, t in enumerate(leaves):
        want = flags[k] if flags is not None else differentiable(t)
        out.append(t.detach().requires_grad_(True) if want and isinstance(t, torch.Tensor) else t)
    return out


def input_grads(leaves: Leaves) -> List[Optional[torch.Tensor]]:
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]


def backward_through(outputs: Leaves, grads: Sequence[Optional[torch.Tensor]], where: str) -> None:
    """Back-propagate ``grads`` into ``outputs`` (pairs without gradient are skipped)."""
    pairs = _grad_pairs(outputs, grads, where)
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])


def _grad_pairs(
    outputs: Leaves, grads: Sequence[Optional[torch.Tensor]], where: str
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    if len(outputs) != len(grads):
        raise RuntimeError(
            f"{where}: recompute produced {len(outputs)} outputs but forward produced {len(grads)}; "
            "a layer's output structure must not change between forward and recompute"
        )
    return [(o, g) for o, g in zip(outputs, grads) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]


class RngFork:
    """Run recompute on the saved RNG states, then give the device its own RNG state back. A layer
    without a saved state continues the stream of the layer before it (forward saved states only where
    the sequence of layers on one device thread breaks, ``GroupForward``)."""

    def __init__(self, run: Run, device: "DeviceManager", ctx: MicrobatchState) -> None:
        self.run, self.device, self.ctx = run, device, ctx
        self.enabled = run.cfg.preserve_rng_state and bool(ctx.rng_states)

    def __enter__(self) -> "RngFork":
        if self.enabled:
            self.own = backend.get_rng_state(self.device.device)
        return self

    def restore(self, layer_id: int) -> None:
        if self.enabled:
            state = self.ctx.rng_states.get(layer_id)
            if state is not None:
                backend.set_rng_state(self.device.device, state)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            backend.set_rng_state(self.device.device, self.own)


# ---- where errors say the job was (formatted only when one happens) ------------------------------------
def _at_forward(run: Run, i: int, m: int) -> str:
    return f"model {run.model.name!r}: forward of {run.layer_name(i)}, microbatch {m}"


def _at_recompute(run: Run, i: int, m: int) -> str:
    return f"model {run.model.name!r}: recompute of {run.layer_name(i)}, microbatch {m}"


def _at_backward(run: Run, layers: range, m: int) -> str:
    span = f"{run.layer_name(layers.start)}-{layers.stop - 1}" if len(layers) > 1 else run.layer_name(layers.start)
    return f"model {run.model.name!r}: backward of {span}, microbatch {m}"


def _at_graph(run: Run, what: str, layers: range, m: int) -> str:
    return f"model {run.model.name!r}: {what} of layers {layers.start}-{layers.stop - 1} (graphed), microbatch {m}"


# ---- which groups may be graphed ----------------------------------------------------------------------
class _LayerFacts:
    """Per model, what the eager warm-ups learned of each layer: (layer, training) -> whether its forward
    drew no random numbers and saved nothing for recompute (a graph may replay its recompute)."""

    def __init__(self) -> None:
        self.graphable: Dict[Tuple[int, bool], bool] = {}
        self.signatures: Dict[int, Optional[Tuple[Any, ...]]] = {}


_facts: "weakref.WeakKeyDictionary[Any, _LayerFacts]" = weakref.WeakKeyDictionary()


def _facts_of(model: Any) -> _LayerFacts:
    facts = _facts.get(model)
    if facts is None:
        facts = _facts[model] = _LayerFacts()
    return facts


def graph_signatures(
    run: Run, device: "DeviceManager", layers: range, backward: bool
) -> Optional[List[Tuple[Any, ...]]]:
    """The slot signatures of a job that may be graphed, or None for an eager job: a device with graphs
    on (``graphs.enabled``), layers that fit slots (no buffers, no parameter tied to another layer)
    and, for a backward job, the 'stage' grain and layers whose forward was seen drawing no random
    numbers and saving nothing for recompute. Sequence tiles run eagerly (each tile's attention reads a
    longer prefix), and so does every job of a long-context call (``Run.may_graph``)."""
    if (
        run.sequence is not None
        or not run.may_graph
        or not graphs.enabled(device.device, device_mod.get_num_devices(), run.graph_mode)
    ):
        return None
    if backward and run.cfg.recompute_grain != "stage":
        return None
    facts = _facts_of(run.model)
    sigs = []
    for i in layers:
        if i not in facts.signatures:
            layer = run.model.layers[i]
            shared = any(ParamAttribute.has(p) and ParamAttribute.get(p).shared for p in layer.parameters())
            facts.signatures[i] = None if shared else graphs.layer_signature(layer, slot_parts)
        sig = facts.signatures[i]
        if sig is None:
            return None
        if backward and not facts.graphable.get((i, run.model.layers[i].training), False):
            return None
        sigs.append(sig)
    return sigs


def _fits_graph(leaves: Leaves) -> bool:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)) <= graphs.MAX_INPUT_BYTES


def _autocast_key(run: Run) -> Tuple[Any, ...]:
    return tuple(run.autocast)


# ---- forward ------------------------------------------------------------------------------------------
Saved = List[Tuple[int, Leaves, Any]]  # backward stages starting inside a group: (layer, input leaves, spec)


def _pack(out_leaves: Leaves, out_spec: Any, saved: Saved) -> Tuple[Leaves, Any]:
    """A forward's results as one list of leaves (what a graph returns) and how to split it. Saved
    inputs are named by their position in the group (a graph serves every group of the same shape)."""
    flat = list(out_leaves)
    kept = []
    for i, leaves, sp in saved:
        kept.append((i, len(leaves), sp))
        flat.extend(leaves)
    return flat, (out_spec, len(out_leaves), kept)


def _unpack(flat: Leaves, meta: Any) -> Tuple[Leaves, Any, Saved]:
    out_spec, n_out, kept = meta
    saved: Saved = []
    pos = n_out
    for i, n, sp in kept:
        saved.append((i, flat[pos : pos + n], sp))
        pos += n
    return flat[:n_out], out_spec, saved


@dataclasses.dataclass(frozen=True)
class JobGroup:
    """One job's layer group on its device, as the job uploaded it."""

    run: Run
    device: "DeviceManager"
    layers: range
    """The model's layers of the group."""
    gpu_layers: List[torch.nn.Module]
    """Their device copies, in order."""
    ready: List[Any]
    """Per-layer upload events, waited for on the first microbatch (a replay waits for all at once)."""
    slots: Optional[List[graphs.LayerSlot]]
    """The graph slots the layers sit in when the job runs as graphs, else None (eager)."""
    parity: int
    """Which of the device's two slot sets (a job's and the next one's alternate)."""


class _GroupCompute:
    """What the forward and the backward of one job's layer group share: the group on its device, its
    per-layer upload events (``ready``, waited for on the first microbatch) and, for a graphed group,
    the graph key of a microbatch and the timing of a replay."""

    def __init__(self, group: JobGroup) -> None:
        self.run, self.device, self.layers = group.run, group.device, group.layers
        self.gpu_layers, self.ready = group.gpu_layers, group.ready
        self.graphed = group.slots is not None
        self.waited = False
        self.key_base: Tuple[Any, ...] = ()

    def _graph_key_base(self, kind: str, parity: int, *extra: Any) -> Tuple[Any, ...]:
        """What every graph of this group shares in its key: the direction, the slot parity, the layers'
        slot signatures and training flags, ``extra`` and the caller's autocast."""
        sigs = tuple(_facts_of(self.run.model).signatures[i] for i in self.layers)
        training = tuple(layer.training for layer in self.gpu_layers)
        return (kind, parity, sigs, training, *extra, _autocast_key(self.run))

    def _graph_key(self, leaves: Leaves, spec: Any, *extra: Any) -> Optional[Tuple[Any, ...]]:
        """A microbatch's graph key, or None for inputs a graph cannot be keyed by (``graphs.leaves_key``)."""
        inputs_key = graphs.leaves_key(leaves, spec)
        return None if inputs_key is None else (*self.key_base, inputs_key, *extra)

    def _wait_all(self) -> None:
        """A replay runs every layer at once: all the group's uploads first (once per job)."""
        if not self.waited:
            for k in range(len(self.ready)):
                wait_layer(self.device, self.ready, k)
            self.waited = True

    def _replay_timing(self, name: str, key: Optional[Tuple[Any, ...]]) -> ContextManager[Any]:
        """Only a replay is timed as a group: a warm-up times its layers itself, and a capture leaves the
        GPU idle while the host records (an outlier the planner must not see)."""
        if self.device.graphs.captured(key):
            return self.run.timer.time_group(name, self.layers, self.device.compute_stream)
        return backend._NULL


class GroupForward(_GroupCompute):
    """The forward of one job's layer group, per microbatch (no autograd graph).

    Graphed (the group in graph slots): the first replay waits for every layer's upload (``ready``); the
    eager path waits layer by layer on its first microbatch."""

    def __init__(self, group: JobGroup) -> None:
        super().__init__(group)
        run, layers = group.run, group.layers
        tracker, cfg = run.tracker, run.cfg
        train = run.enable_grad
        # Backward stages starting inside the group (their input is kept for the recompute).
        self.keep_input = [train and k > 0 and tracker.backward_need_input(i) for k, i in enumerate(layers)]
        # RNG states for the recompute: every layer in the 'layer' grain (each is recomputed alone), else
        # where a backward stage starts or this job's run of layers begins (the recompute of a stage
        # replays its layers in order on one device, continuing the RNG stream from the state it restored).
        save_rng = train and cfg.preserve_rng_state
        by_layer = cfg.recompute_grain == "layer"
        self.save_rng = [
            save_rng and (by_layer or k == 0 or tracker.backward_need_input(i)) for k, i in enumerate(layers)
        ]
        self.current = layers.start
        self.ctx: Optional[MicrobatchState] = None
        self.m = 0
        if self.graphed:
            self.key_base = self._graph_key_base("fwd", group.parity, train, tuple(self.keep_input))

    def __call__(self, ctx: MicrobatchState, m: int, dev_leaves: Leaves, spec: Any) -> Tuple[Leaves, Any, Saved]:
        """Microbatch ``m``'s forward: (output leaves, output spec, the inputs of the backward stages that
        start inside the group)."""
        self.ctx, self.m = ctx, m
        run, device = self.run, self.device
        if not (self.graphed and _fits_graph(dev_leaves)):
            return self._eager(dev_leaves, spec)
        device.where = (_at_graph, (run, "forward", self.layers, m))
        facts = _facts_of(run.model)
        saved_any = [False]
        before = backend.get_rng_state(device.device)

        def check() -> bool:
            fit = not saved_any[0] and torch.equal(before, backend.get_rng_state(device.device))
            for i, layer in zip(self.layers, self.gpu_layers):
                key = (i, layer.training)
                facts.graphable[key] = fit and facts.graphable.get(key, True)
            return fit

        def eager(leaves: Leaves) -> Tuple[Leaves, Any]:
            out_leaves, out_spec, saved = self._eager(leaves, spec, saved_any)
            return _pack(out_leaves, out_spec, [(i - self.layers.start, lv, sp) for i, lv, sp in saved])

        self._wait_all()
        key = self._graph_key(dev_leaves, spec)
        with self._replay_timing("fwd", key):
            flat, meta = device.graphs.run(key, lambda lv: self._pure(lv, spec), dev_leaves, eager, check)
        out_leaves, out_spec, saved = _unpack(flat, meta)
        return out_leaves, out_spec, [(self.layers.start + k, lv, sp) for k, lv, sp in saved]

    def _save(self, *data: Any) -> None:
        """``save_for_recompute`` of the layer running now (a ``ForwardCtx`` callback)."""
        assert self.ctx is not None
        self.ctx.save_for_recompute(self.current, self.device, *data)

    def _eager(
        self, dev_leaves: Leaves, spec: Any, saved_any: Optional[List[bool]] = None
    ) -> Tuple[Leaves, Any, Saved]:
        """The forward with the eager path's bookkeeping (see the module docstring)."""
        run, device, ctx, m = self.run, self.device, self.ctx, self.m
        assert ctx is not None
        timer = run.timer
        x = pytree.tree_unflatten(dev_leaves, spec)
        saved: Saved = []

        def save(*data: Any) -> None:
            if saved_any is not None:
                saved_any[0] = True
            self._save(*data)

        with ForwardCtx(save) if run.enable_grad else backend._NULL:
            for k, (i, layer) in enumerate(zip(self.layers, self.gpu_layers)):
                device.where = (_at_forward, (run, i, m))
                if not self.waited:
                    wait_layer(device, self.ready, k)
                if self.keep_input[k]:
                    leaves, sp = pytree.tree_flatten(x)
                    saved.append((i, leaves, sp))
                if self.save_rng[k]:
                    ctx.rng_states[i] = backend.get_rng_state(device.device)
                self.current = i
                with timer.time_fwd("fwd", i, device.compute_stream):
                    x = wrap(call_layer(layer, x))
        self.waited = True
        out_leaves, out_spec = pytree.tree_flatten(x)
        return out_leaves, out_spec, saved

    def _pure(self, leaves: Leaves, spec: Any) -> Tuple[Leaves, Any]:
        """The group's forward as a function of its input leaves alone (what a graph captures). A layer
        that saves for recompute here raises: the warm-ups saw it save nothing."""

        def refuse(*data: Any) -> None:
            raise RuntimeError("a graphed layer called save_for_recompute")

        x = pytree.tree_unflatten(leaves, spec)
        saved: Saved = []
        with ForwardCtx(refuse) if self.run.enable_grad else backend._NULL:
            for k, layer in enumerate(self.gpu_layers):
                if self.keep_input[k]:
                    lv, sp = pytree.tree_flatten(x)
                    saved.append((k, lv, sp))
                x = wrap(call_layer(layer, x))
        out_leaves, out_spec = pytree.tree_flatten(x)
        return _pack(out_leaves, out_spec, saved)


# ---- backward -----------------------------------------------------------------------------------------
class BackwardInputs(NamedTuple):
    """What one microbatch's recompute and backward of a layer group takes, on the job's device."""

    ctx: MicrobatchState
    m: int
    dev_in: Leaves
    """The stage input's leaves (``spec`` its tree)."""
    spec: Any
    dev_grads: List[Optional[torch.Tensor]]
    """The gradients of the group's output leaves."""
    recompute: Dict[int, Any]
    """Per layer: the data its forward saved for the recompute."""
    flags: Optional[List[bool]]
    """Which input leaves require grad (the model's first group only, else None)."""


class GroupBackward(_GroupCompute):
    """Recompute + backward of one job's layer group, per microbatch ('stage' grain): the recompute
    keeps its graph, the backward fills the input gradients and accumulates the parameter gradients
    into the device copies' ``.grad``.

    A graphed job (``slots``) computes every microbatch with ``_pure`` (autograd.grad, each gradient
    added into its slot buffer), replayed or not, so the buffers hold one sum whatever ran; a
    parameter's buffer becomes its ``.grad`` once a gradient reaches it (``finish``)."""

    def __init__(self, group: JobGroup) -> None:
        super().__init__(group)
        slots, gpu_layers = group.slots, group.gpu_layers
        self.touched: set = set()
        if slots is not None:
            self.key_base = self._graph_key_base("bwd", group.parity)
            # Trainable parameters and their slot gradient buffers, in a fixed order (the slots' order).
            self.params: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
            for layer, slot in zip(gpu_layers, slots):
                j = 0
                seen: set = set()
                for mod in layer.modules():
                    for p in mod._parameters.values():
                        if p is None or id(p) in seen:
                            continue
                        seen.add(id(p))
                        if p.requires_grad:
                            self.params.append((p, slot.grad(j)))
                        j += 1

    def __call__(self, b: BackwardInputs) -> List[Optional[torch.Tensor]]:
        """Microbatch ``b.m``'s input gradients (the parameter gradients accumulate on the device)."""
        run, device = self.run, self.device
        if not self.graphed:
            return self._eager(b)
        if any(b.recompute[i] is not None for i in self.layers):
            raise RuntimeError(
                f"{_at_graph(run, 'recompute', self.layers, b.m)}: a graphed layer saved data for its recompute"
            )
        device.where = (_at_graph, (run, "recompute and backward", self.layers, b.m))
        self._wait_all()
        n_in = len(b.dev_in)
        inputs = list(b.dev_in) + list(b.dev_grads)

        def pure(lv: Leaves) -> Tuple[Leaves, Any]:
            return self._pure(lv, b.spec, n_in, b.flags)

        if not _fits_graph(b.dev_in):
            out, touched = pure(inputs)
        else:
            key = self._graph_key(inputs, b.spec, None if b.flags is None else tuple(b.flags))
            with self._replay_timing("rebwd", key):
                out, touched = device.graphs.run(key, pure, inputs)
        self.touched.update(touched)
        return out

    def finish(self) -> None:
        """After the last microbatch: a slot buffer that a gradient reached becomes its parameter's
        ``.grad`` (one seeded from the host already is); the others stay None, as in PyTorch."""
        if self.graphed:
            for k, (p, buf) in enumerate(self.params):
                if k in self.touched and p.grad is None:
                    p.grad = buf

    def _eager(self, b: BackwardInputs) -> List[Optional[torch.Tensor]]:
        run, device = self.run, self.device
        timer = run.timer
        with torch.enable_grad(), RngFork(run, device, b.ctx) as rng:
            leaves = grad_leaves(b.dev_in, b.flags)
            x = pytree.tree_unflatten(leaves, b.spec)
            for k, (i, layer) in enumerate(zip(self.layers, self.gpu_layers)):
                device.where = (_at_recompute, (run, i, b.m))
                if not self.waited:
                    wait_layer(device, self.ready, k)
                rng.restore(i)
                with RecomputeCtx(b.recompute[i]), timer.time_fwd("re", i, device.compute_stream):
                    x = wrap(call_layer(layer, x))
            device.where = (_at_backward, (run, self.layers, b.m))
            with timer.time_bwd(self.layers, device.compute_stream):
                backward_through(pytree.tree_leaves(x), b.dev_grads, device.describe_location())
            self.waited = True
            return input_grads(leaves)

    def _pure(self, leaves: Leaves, spec: Any, n_in: int, flags: Optional[List[bool]]) -> Tuple[Leaves, Any]:
        """Input gradients as a function of (stage input leaves + output gradient leaves), the parameter
        gradients added into their buffers: what a graph captures. The same sums as the eager path's
        ``backward`` (each buffer += this microbatch's gradient). Returns the input gradients and the
        indices of the parameters a gradient reached."""
        dev_in, dev_grads = leaves[:n_in], leaves[n_in:]
        with torch.enable_grad():
            xs = grad_leaves(dev_in, flags)
            x = pytree.tree_unflatten(xs, spec)
            for layer in self.gpu_layers:
                with RecomputeCtx(None):
                    x = wrap(call_layer(layer, x))
            pairs = _grad_pairs(pytree.tree_leaves(x), dev_grads, "graphed backward")
            wanted = [k for k, t in enumerate(xs) if isinstance(t, torch.Tensor) and t.requires_grad]
            out: List[Optional[torch.Tensor]] = [None] * len(xs)
            if not pairs:
                return out, ()
            grads = torch.autograd.grad(
                [o for o, _ in pairs],
                [xs[k] for k in wanted] + [p for p, _ in self.params],
                [g.to(o.dtype) for o, g in pairs],
                allow_unused=True,
            )
        touched = []
        with torch.no_grad():
            for k, ((_, buf), g) in enumerate(zip(self.params, grads[len(wanted) :])):
                if g is not None:
                    buf.add_(g)
                    touched.append(k)
        for k, g in zip(wanted, grads):
            out[k] = g
        return out, tuple(touched)


def backward_by_layer(
    run: Run,
    device: "DeviceManager",
    layers: range,
    gpu_layers: List[torch.nn.Module],
    ready: List[Any],
    first: bool,
    b: BackwardInputs,
) -> List[Optional[torch.Tensor]]:
    """The 'layer' grain: recompute the stage without a graph to get each layer's input, then recompute
    and back-propagate one layer at a time (one layer's autograd graph alive at once)."""
    timer, m, recompute, flags = run.timer, b.m, b.recompute, b.flags
    with RngFork(run, device, b.ctx) as rng:
        inputs: List[Tuple[Leaves, Any]] = []
        x_leaves, x_spec = b.dev_in, b.spec
        with torch.no_grad():
            for k, (i, layer) in enumerate(zip(layers, gpu_layers)):
                device.where = (_at_recompute, (run, i, m))
                if first:
                    wait_layer(device, ready, k)
                inputs.append((x_leaves, x_spec))
                if k == len(layers) - 1:
                    break  # the last layer's output is not needed: its backward recomputes it
                rng.restore(i)
                with RecomputeCtx(recompute[i]):
                    x_leaves, x_spec = pytree.tree_flatten(
                        wrap(call_layer(layer, pytree.tree_unflatten(x_leaves, x_spec)))
                    )
        grads = b.dev_grads
        for k in reversed(range(len(layers))):
            i, layer = layers[k], gpu_layers[k]
            device.where = (_at_backward, (run, range(i, i + 1), m))
            with torch.enable_grad():
                leaves = grad_leaves(inputs[k][0], flags if i == 0 else None)
                rng.restore(i)
                with RecomputeCtx(recompute[i]), timer.time_fwd("re", i, device.compute_stream):
                    out = wrap(call_layer(layer, pytree.tree_unflatten(leaves, inputs[k][1])))
                with timer.time_bwd(range(i, i + 1), device.compute_stream):
                    backward_through(pytree.tree_leaves(out), grads, device.describe_location())
                grads = input_grads(leaves)
            del out
        return grads
