"""The state of one RoundPipe call (a forward, a backward or a fused forward-backward over all
microbatches), shared by the main thread that dispatches its jobs (``roundpipe.runtime.pipeline``) and the
device threads that run them (``roundpipe.runtime.jobs``).

``Run`` holds what the whole call needs (plan, batch, tracker, which device runs which job, handoffs
of activations and gradients that stay on a device); ``MicrobatchState`` what one microbatch carries
from its forward to its backward (saved stage inputs, recompute data, RNG states, output gradients).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from roundpipe import settings
from roundpipe.devices import cpu_streams, graphs, threads
from roundpipe.devices import device as device_mod
from roundpipe.planning import budget
from roundpipe.planning.fused_split import split_enabled, split_parts
from roundpipe.planning.plan import ModelExecutePlan, RunType
from roundpipe.runtime.batch import Batch
from roundpipe.runtime.grad_sync import LayerReducer
from roundpipe.runtime.model_protocol import PipelinedModel
from roundpipe.runtime.partial_grads import PartialGrads
from roundpipe.runtime.run_config import ResolvedRunConfig
from roundpipe.runtime.sequence import SequenceRun
from roundpipe.runtime.tied_grads import TiedGrads
from roundpipe.runtime.tracker import ModelTracker
from roundpipe.runtime.transfer import async_d2h, async_h2d, device_saved_limit, tensor_bytes

logger = logging.getLogger("roundpipe")

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager

Leaves = List[Any]
_NO_AUTOCAST = contextlib.nullcontext()


def differentiable(t: Any) -> bool:
    """Whether autograd can carry a gradient for ``t`` (a floating or complex tensor)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def call_profile(model: PipelinedModel, batch: Batch, recompute_grain: str) -> Optional["budget.ActivationProfile"]:
    """``model.activation_profile`` of one call's batch, computed once per call and grain: the plan
    (``RoundPipe._local_plan``) and the run's device room (``Run._device_saved_budget``) both need it."""
    if recompute_grain not in batch.profiles:
        batch.profiles[recompute_grain] = model.activation_profile(batch, recompute_grain)
    return batch.profiles[recompute_grain]


def may_graph(model: PipelinedModel, batch: Batch, recompute_grain: str, train: bool) -> bool:
    """Whether any job of a call may be graphed, from its activation profile (known before its first job): not
    a training call whose largest stage input per microbatch, ``max(profile.checkpoint)`` (all microbatches'
    host copies) over the microbatches, exceeds ``graphs.MAX_INPUT_BYTES``. Such a call is long context: its
    decoder groups' microbatches run eagerly anyway (``compute._fits_graph``), and the weight slots a graphed
    job takes (each position of its largest group, both parities) would sit beside its backward's activations,
    which the planner budgets without them. The profile counts the hidden states alone (the presets round
    them up to a power of two, as the limit is one); a job's inputs carry more, so a call flagged here is one
    whose microbatches would not fit a graph. Without a profile (inference, a model with no activation model)
    only the per-microbatch check applies."""
    profile = call_profile(model, batch, recompute_grain) if train else None
    if profile is None:
        return True
    return max(profile.checkpoint, default=0.0) / batch.num_microbatch <= graphs.MAX_INPUT_BYTES


class MicrobatchState:
    """Per-microbatch state shared between the forward and backward jobs of one call (the spec's
    ``MicrobatchState``).

    Attributes:
        microbatch_id: Index of this microbatch.
        flatten_inputs: Host copies of each backward stage's input: layer id -> (leaves, spec, events).
        device_inputs: Backward-stage inputs kept on the device instead (``RPP_DEBUG_DEVICE_SAVED_GB``, one
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
        # Output gradients handed over on a device: (its device, the tensors there, events its upload
        # stream waits for: none from a job on the same device, the copy's from a peer copy).
        self.grad_handoff: Optional[Tuple[Any, List[Optional[torch.Tensor]], List[Any]]] = None

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


def _sequence_run(batch: Batch, run_type: RunType) -> Optional[SequenceRun]:
    """The call's sequence state when ``sequence_tiles`` cut its batch along the sequence: the tiles'
    lengths are the microbatches' dim 1."""
    if batch.sequence_tiles <= 1:
        return None
    if run_type == "fused":
        raise ValueError(
            "sequence_tiles: forward_backward runs each tile's backward right after its forward, before the later "
            "tiles that attend to it; use RoundPipeForCausalLM.train_step (or forward, then loss.backward())"
        )
    lengths = []
    for leaves in batch.flatten_states:
        dims = [t.shape[1] for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 2]
        if not dims:
            raise ValueError("sequence_tiles: a tile has no [batch, seq] tensor")
        lengths.append(int(dims[0]))
    return SequenceRun.from_lengths(lengths)


def watchdog_limit(model: PipelinedModel, plan: ModelExecutePlan, num_microbatch: int) -> Tuple[float, str]:
    """One call's watchdog (seconds without progress before a wait fails) and where it came from:
    ``RPP_WATCHDOG_S`` when set, else ``WATCHDOG_JOBS`` x the slowest job the model's timings expect, at least
    ``WATCHDOG_FLOOR_S`` (the floor alone until forward has been timed). Progress comes at every microbatch
    of every job, so a long-context step of minutes per job on a slow card is far inside it."""
    explicit = settings.WATCHDOG_S.get()
    if explicit is not None:
        return explicit, f"RPP_WATCHDOG_S={explicit:g}"
    job_ms = model.model_timer.slowest_job_ms([*plan.fwd_plan, *plan.bwd_plan], num_microbatch)
    jobs, floor = threads.WATCHDOG_JOBS, threads.WATCHDOG_FLOOR_S
    limit = max(floor, jobs * (job_ms or 0.0) / 1000.0)
    return limit, f"RPP_WATCHDOG_S=auto: {jobs:g} x the slowest job expected, at least {floor:g} s"


class Run:
    """State of one RoundPipe call, shared by the main thread and the jobs it dispatches."""

    def __init__(
        self,
        model: PipelinedModel,
        run_config: ResolvedRunConfig,
        batch: Batch,
        run_type: RunType,
        plan: ModelExecutePlan,
        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
        return_outputs: bool = False,
    ) -> None:
        threads.refresh_waits()  # RPP_DEBUG_STRESS_DELAY_S, read once per call (the waits use it)
        threads.set_stall_limit(*watchdog_limit(model, plan, batch.num_microbatch))
        cpu_streams.refresh()  # RPP_DEBUG_CHECK_STREAMS (on in the stress mode): CPU streams check their order
        self.model = model
        self.cfg = run_config
        # Settings the device threads consult per job, read once per call.
        self.peer_handoff = device_mod.peer_handoff_enabled()
        self.graph_mode = settings.DEBUG_GRAPHS.get()  # ``graphs.enabled``
        self.batch = batch
        self.run_type = run_type
        self.enable_grad = run_type != "infer"
        self.may_graph = may_graph(model, batch, run_config.recompute_grain, self.enable_grad)
        self.plan = plan
        self.tracker = ModelTracker(plan, batch.num_microbatch)
        self.contexts = [MicrobatchState(m) for m in range(batch.num_microbatch)]
        # Per layer: its device gradient reduction (data parallel, ``grad_sync.layer_reducer``) or None.
        sync = model.grad_sync if self.enable_grad else None
        self.reducers: List[Optional[LayerReducer]] = [
            sync.layer_reducer(model, i) if sync is not None else None for i in range(model.num_layers)
        ]
        self.saved_buffers: Dict[int, Dict[str, torch.Tensor]] = {}
        self.loss_fn = loss_fn
        self.return_outputs = return_outputs
        self.outputs: List[Any] = [None] * batch.num_microbatch
        self.timer = model.model_timer.new_iter()
        # The last backward group (the fused job, or a 'train' call's first backward job: a language
        # model's head) runs in this many parts, each taking every parts-th microbatch on its own device
        # (``partial_grads.part_microbatches``); their gradients meet in part 0's download (``partial_grads``).
        self.fused_parts = 1
        self.partial_grads: Optional[PartialGrads] = None
        # One sequence cut into tiles (``roundpipe.runtime.sequence``): its jobs keep keys and values across tiles,
        # so each group runs whole on one device, and no fused job (its backward would precede later tiles).
        self.sequence = _sequence_run(batch, run_type)
        if self.sequence is not None and not device_mod.peer_handoff_chosen():
            # One long sequence: a peer copy lands while the receiving GPU still runs its previous job, a
            # tile's hidden state more per GPU that the tiles' memory plan does not count.
            self.peer_handoff = False
        if run_type in ("fused", "train") and plan.bwd_plan and self.sequence is None:
            fused = plan.bwd_plan[-1]
            has_buffers = any(True for i in fused for _ in model.layers[i].buffers())
            self.fused_parts = split_parts(
                device_mod.get_num_devices(), batch.num_microbatch, has_buffers, split_enabled()
            )
            if self.fused_parts > 1:
                self.partial_grads = PartialGrads(
                    self.fused_parts,
                    fused,
                    model.partial_grad_store,
                    lambda i: f"model {model.name!r}: {self.layer_name(i)}",
                    primary=lambda: (
                        self.job_device.get(("fb", 0)) or self.job_device.get(("b", len(plan.bwd_plan) - 1))
                    ),
                    peer=self.peer_handoff,
                )
        # Which device runs each job ('f', g) / ('b', b) / ('fb', part), fixed at dispatch (roundpipe.devices.dispatch).
        self.job_device: Dict[Tuple[str, int], "DeviceManager"] = {}
        # Activations handed to the next job without a host copy: (its device, leaves there, events its
        # upload stream waits on: none when the job ran on the same device, the copy's with a peer copy).
        self.act_handoff: List[Optional[Tuple["DeviceManager", Leaves, List[Any]]]] = [None] * batch.num_microbatch
        self.backward_done = False
        self.loss_is_sequence = False
        # Bytes of backward-stage inputs this call may still keep on the device (one device only: there
        # every job runs on the same device thread, the only one that reserves from this budget). The
        # budget is per call: every call awaiting its backward may hold this much.
        self.device_saved_left = (
            self._device_saved_budget() if self.enable_grad and device_mod.get_num_devices() == 1 else 0
        )
        self.device_saved_room = self.device_saved_left  # what the call started with (logged at ``release``)
        # Gradient shares of tied parameters, summed into the owner layer's share on its device.
        self.tied = TiedGrads(model.layer_attrs, device_mod.get_num_devices() == 1) if self.enable_grad else None
        # Kept stages (``roundpipe.runtime.kept``): per (stage start, microbatch) the graph its forward left on the
        # device, (input leaves, output leaves); per stage start its device layers, from its forward to its backward.
        self.kept_graphs: Dict[Tuple[int, int], Tuple[Leaves, Leaves]] = {}
        self.kept_layers: Dict[int, List[torch.nn.Module]] = {}
        # Per microbatch: group boundaries whose output the producing job left on the device for the
        # next job to keep as its saved stage input (no host copy was made).
        self.kept_inputs: List[Set[int]] = [set() for _ in range(batch.num_microbatch)]
        # Whether this call's gradient downloads may take the weights' host buffers (set by the model at
        # the call's start, ``roundpipe.host.step_cycle.StepCycle``; read by the device threads).
        self.grad_into_weights = False
        # Autocast is thread-local: carry the caller's settings into the device threads.
        self.autocast: List[Tuple[str, torch.dtype]] = [
            (dt, torch.get_autocast_dtype(dt)) for dt in ("cuda", "cpu") if torch.is_autocast_enabled(dt)
        ]
        # The model input per microbatch (the batch's states are replaced by each group's outputs).
        self.input_leaves: List[Leaves] = [list(leaves) for leaves in batch.flatten_states]
        for ctx, leaves in zip(self.contexts, batch.flatten_states):
            ctx.input_requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]

    def _device_saved_budget(self) -> int:
        """``RPP_DEBUG_DEVICE_SAVED_GB`` in bytes; ``auto``: the device memory the plan leaves free
        (``budget.device_saved_room``) in a forward_backward call, none in a call whose backward comes
        later (several such calls may await their backward at once)."""
        limit = device_saved_limit()
        if limit is not None:
            return limit
        if self.run_type != "fused":
            return 0
        profile = call_profile(self.model, self.batch, self.cfg.recompute_grain)
        room = budget.device_saved_room(profile, self.model.layer_device_bytes(self.run_type), self.plan.bwd_plan)
        return int(max(0.0, room - self.plan.keep_bytes))  # what kept stages take is not the saved inputs' room

    def keep_on_device(self, leaves: Leaves) -> bool:
        """Reserve room to keep a backward-stage input on the device (instead of a host copy); the
        room is not given back within the call (all its forward jobs run before its backward jobs)."""
        nbytes = tensor_bytes(leaves)
        if nbytes == 0 or nbytes > self.device_saved_left:
            return False
        self.device_saved_left -= nbytes
        return True

    def take_stage_input(
        self, ctx: MicrobatchState, layer_id: int, device: "DeviceManager"
    ) -> Tuple[Leaves, pytree.TreeSpec]:
        """Backward stage ``layer_id``'s saved input of ``ctx``'s microbatch on ``device``: kept there in
        forward, or uploaded from its host copy."""
        kept = ctx.device_inputs.pop(layer_id, None)
        if kept is not None:
            return kept
        host_in, spec, in_events = ctx.flatten_inputs.pop(layer_id)
        return async_h2d(device, in_events, host_in), spec

    def drop_stage_input(self, ctx: MicrobatchState, layer_id: int) -> int:
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
        if self.device_saved_room and logger.isEnabledFor(logging.DEBUG):
            kept = self.device_saved_room - self.device_saved_left
            logger.debug(
                "model %r: kept %.2f GiB of backward-stage inputs on the device (room %.2f GiB); backward stages of "
                "%s layers",
                self.model.name,
                kept / 2**30,
                self.device_saved_room / 2**30,
                sorted({len(r) for r in self.plan.bwd_plan}),
            )
        self.sequence = None
        self.kept_graphs, self.kept_layers = {}, {}
        self.contexts = []
        self.input_leaves = []
        self.saved_buffers = {}
        self.timer.finish()

    def autocast_ctx(self, device: "DeviceManager") -> Any:
        """The caller's autocast settings for ``device``'s type (a no-op context without autocast)."""
        if not self.autocast:
            return _NO_AUTOCAST
        stack = contextlib.ExitStack()
        for dt, dtype in self.autocast:
            if dt == device.device.type:
                stack.enter_context(torch.autocast(dt, dtype=dtype))
        return stack

    def layer_name(self, i: int) -> str:
        return f"layer {i} ({type(self.model.layers[i]).__name__})"


RoundPipeRunContext = MicrobatchState  # the spec's name

__all__ = ["Leaves", "MicrobatchState", "Run", "RoundPipeRunContext", "differentiable"]
