"""The optimizer step protocol: what ``model.step`` runs on the optimizer thread, as functions over the
model's optimizer units (a layer's trainable parameters with the ``LayerAttribute`` whose events guard
them; ``RoundPipeBase.optim_units()``).

One step, on the optimizer thread (``roundpipe.host.optim_thread``):

1. (asynchronous steps) publish the parameters the previous step staged into the model, layer by layer
   in forward order, setting ``param_copied`` so the next forward's uploads of that layer may start
   (weights already current, ``host.buffers.ParamBuffers.in_place``, are left where they are);
2. per unit, last layer first: wait for the unit's gradient download (``grad_downloaded``), let the
   model's ``grad_sync`` reduce it across processes, hand it to the optimizer parameter's ``.grad``
   (the buffer itself, or a copy), choose the gradient buffer as the staging buffer (asynchronous),
   set ``grad_copied`` (the next backward's download of that layer may take a buffer: where the step cycle
   allows, the weights', whose weights then move to the staging buffer);
3. run the user's ``step_fn`` (``optimizer.step(); optimizer.zero_grad()``) on the optimizer copies;
4. (asynchronous) stage the updated parameters in the model's dtype for the next step's publish (into
   the weights themselves if a download has moved them there); (synchronous) copy them into the model.

The step mode (``step_mode.StepMode``, ``RPP_STEP_MODE``, resolved when the model was built and
passed with each step) decides the rest. ``streamed`` changes the asynchronous step: no publish in 1.
and no staging in 4.; instead each layer's updated parameters are copied into the model as soon as the
optimizer has stepped them (:class:`Publisher`: ``roundpipe.optim.Adam`` steps its parameters layer by
layer in forward order and reports each layer; other optimizers' layers are copied when ``step_fn``
returns), setting ``param_copied``. The next forward, which waits for ``param_copied`` layer by layer,
follows the step: no parameter is stale (results equal synchronous steps) and no staging buffer
exists, so a parameter has two host copies in the model dtype (weights, gradient), also with gradient
accumulation. The next backward's gradient downloads wait until the step has released its gradient
buffers (``zero_grad``).

Which host buffer holds what at each of these points (the roles of a parameter's buffers and their
transitions) is ``roundpipe.host.buffers``' business: this module runs the protocol's order and events
and asks it for each change of role.

The main thread clears ``param_copied`` / ``grad_copied`` of every unit before it queues the step
(``launch``) and the step sets each exactly once, so each event has one owner per phase: cleared by the
main thread at launch, set by the optimizer thread when it is done with the layer.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

from roundpipe.devices.threads import AnnotatedEvent
from roundpipe.host import optim_thread
from roundpipe.host.attribute import LayerAttribute, ParamAttribute
from roundpipe.host.buffers import ParamBuffers, same_storage
from roundpipe.host.protocol import HostModel, StepSync, Units
from roundpipe.host.step_mode import StepMode

_scope = threading.local()  # per thread: how many OptimizerCtx scopes are open


class OptimizerCtx:
    """Marks optimizer-related code: inside it, RoundPipe models' ``parameters()`` and
    ``named_parameters()`` return the optimizer copies (``optim_parameters()``)."""

    def __enter__(self) -> "OptimizerCtx":
        _scope.depth = getattr(_scope, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _scope.depth -= 1


def doing_optimizer() -> bool:
    """Whether the current scope is doing optimizer-related operations (inside an ``OptimizerCtx``)."""
    return bool(getattr(_scope, "depth", 0))


# Marks optimizer parameters whose optimizer reads a gradient of a lower precision than the parameter
# (``roundpipe.optim.Adam`` widens bfloat16 gradients on the fly). For those the host gradient buffer
# itself becomes the optimizer's ``.grad`` instead of a copy in the parameter's dtype. Kept on the
# tensor (it lives as long as the parameter), written and read only through the two functions below.
_LOW_PRECISION_MARK = "_roundpipe_reads_low_precision_grad"


def accept_low_precision_grad(param: torch.Tensor) -> None:
    """Declare that ``param``'s optimizer reads a bfloat16 ``.grad`` of an fp32 parameter correctly (an
    optimizer calls this for the parameters it owns, as ``roundpipe.optim.Adam`` does)."""
    setattr(param, _LOW_PRECISION_MARK, True)


def reads_low_precision_grad(param: torch.Tensor) -> bool:
    """Whether ``param``'s optimizer takes a low-precision ``.grad`` and this torch lets ``.grad`` differ
    from the tensor's dtype (``Tensor.grad_dtype``, torch >= 2.10)."""
    return bool(getattr(param, _LOW_PRECISION_MARK, False)) and hasattr(param, "grad_dtype")


_ZEROES_GRADS_MARK = "_roundpipe_zeroes_grads"
F = TypeVar("F", bound=Callable[..., Any])


def step_fn_zeroes_grads(fn: F) -> F:
    """Declare that the step function ``fn`` calls ``optimizer.zero_grad()`` after ``optimizer.step()`` and reads
    no gradient after it (a decorator; on a method, decorate it in the class). Under ``RPP_DEBUG_FUSED_STAGING=auto``
    (the default) ``roundpipe.optim.Adam`` may then write an asynchronous step's new weights straight into their
    staging buffer, which is the gradient's (:class:`Stager`): on H200 hosts 0.03-0.13 s less per qwen3-1.7b step and
    0.33 s per qwen3-4b step, depending on the host's cores (docs/optimizer.md).
    A declared function that keeps a gradient after the step raises OptimizerStepError."""
    setattr(fn, _ZEROES_GRADS_MARK, True)
    return fn


_FUSED = "fused staging (RPP_DEBUG_FUSED_STAGING, or a step function declared with step_fn_zeroes_grads): "


def fused_staging(step_fn: Callable[..., Any], mode: StepMode) -> bool:
    """Whether a staged asynchronous step with ``step_fn`` lets the optimizer write the staging buffers
    (``mode.fused_staging``: ``1`` always, ``0`` never, ``auto`` when ``step_fn`` was declared with
    :func:`step_fn_zeroes_grads`)."""
    fused = mode.fused_staging
    return fused == "1" or (fused == "auto" and bool(getattr(step_fn, _ZEROES_GRADS_MARK, False)))


@dataclass(frozen=True)
class StepCall:
    """One ``model.step``, as the optimizer thread runs it (``_step_kernel``; the module docstring).

    Attributes:
        units: The model's optimizer units.
        step_fn: The user's step, called as ``step_fn(*args, **kwargs)`` on the optimizer copies.
        args: Positional arguments of ``step_fn``.
        kwargs: Keyword arguments of ``step_fn``.
        is_async: Return at once (the step runs while the next iteration does) instead of at its end.
        mode: The model's step mode (what an asynchronous step does with its update).
        done: The model's ``optim_updated``: cleared at launch, set when the step ends, failed or not.
        reduce_host: The model's ``grad_sync.reduce_host``, called per unit (None: local training).
        step_sync: The model's ``grad_sync.step_sync``, called around ``step_fn`` (None: not shared).
    """

    units: Units
    step_fn: Callable[..., Any]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    is_async: bool
    mode: StepMode
    done: AnnotatedEvent
    reduce_host: Optional[Callable[[List[nn.Parameter]], None]]
    step_sync: Optional[StepSync]


def launch(
    model: HostModel, step_fn: Callable[..., Any], is_async: bool, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> None:
    """Queue one step of ``model`` on the optimizer thread (main thread; see the module docstring), after
    telling its ``grad_sync`` (``on_step_launch``). Without ``is_async`` this returns when the step has finished."""
    sync = model.grad_sync
    if sync is not None:
        sync.on_step_launch()
    units = model.optim_units()
    # The previous step must be done with these layers before this one clears their events: its
    # kernel sets them again (W&C).
    for attr, _ in units:
        attr.param_copied.wait()
        attr.param_copied.clear()
        attr.grad_copied.wait()
        attr.grad_copied.clear()
    model.optim_updated.clear()
    reduce_host, step_sync = (sync.reduce_host, sync.step_sync) if sync is not None else (None, None)
    call = StepCall(
        units, step_fn, args, kwargs, is_async, model.step_mode, model.optim_updated, reduce_host, step_sync
    )
    optim_thread.submit(_step_kernel, call)
    if not is_async:
        optim_thread.synchronize()


def _step_kernel(call: StepCall) -> None:
    """Optimizer-thread body of a step (the protocol in the module docstring)."""
    units, step_fn, is_async, done = call.units, call.step_fn, call.is_async, call.done
    reduce_host, step_sync = call.reduce_host, call.step_sync
    streamed = is_async and call.mode.streamed
    try:
        with OptimizerCtx():
            if is_async and not streamed:
                copy_params_to_model(units, use_staged=True, downloads_into_weights=True)
            # Gradients in reverse layer order: the next backward starts from the last layer and
            # its downloads wait for these copies (``grad_copied``); the next forward needs only
            # the parameters, copied above in layer order.
            staged = is_async and not streamed
            for attr, params in reversed(units):
                # The gradient download of this layer must have landed before we read it.
                attr.grad_download_started.wait()
                attr.grad_downloaded.synchronize()
                if reduce_host is not None:
                    reduce_host(params)
                for p in params:
                    copy_grad_to_optim(p, staged, streamed)  # the buffer's role changes: host.buffers
                # After the staging buffers are chosen: the next call's downloads may move weights there.
                attr.grad_copied.set()
            publisher = Publisher(units) if streamed else None
            stager = Stager(units) if staged and fused_staging(step_fn, call.mode) else None
            if step_sync is not None:
                step_sync.before_step_fn(units, streamed)
            try:
                with publisher.active() if publisher is not None else _stager_active(stager):
                    step_fn(*call.args, **call.kwargs)
            except BaseException:
                if step_sync is not None:
                    step_sync.abort()
                raise
            if step_sync is not None:
                step_sync.after_step_fn(units)
            if publisher is not None:
                publisher.finish()  # layers no optimizer reported (other optimizers, no gradient)
                release_grad_buffers(units)
            elif is_async:
                if stager is not None:
                    stager.check()
                stage_params(units, stager.written_buffers() if stager is not None else None)
            else:
                release_grad_buffers(units)
                copy_params_to_model(units)
    except BaseException:
        # Never leave the main thread waiting on a step that failed (the failure is raised there).
        # Only on failure: on success each event was set once above, and by now the main thread
        # may already have cleared it again for the next step.
        for attr, _ in units:
            attr.param_copied.set()
            attr.grad_copied.set()
        raise
    finally:
        done.set()


_active = threading.local()  # the Publisher (streamed step) or Stager (fused staging) running on this thread, if any


def current_publisher() -> Optional["Publisher"]:
    """The :class:`Publisher` of the streamed step whose ``step_fn`` runs on this thread, else None
    (an optimizer asks this to step layer by layer; see the module docstring)."""
    return getattr(_active, "publisher", None)


def current_stager() -> Optional["Stager"]:
    """The :class:`Stager` of the staged step whose ``step_fn`` runs on this thread (``RPP_DEBUG_FUSED_STAGING``)."""
    return getattr(_active, "stager", None)


@contextlib.contextmanager
def _stager_active(stager: Optional["Stager"]) -> Iterator[None]:
    _active.stager = stager
    try:
        yield
    finally:
        _active.stager = None


class Stager:
    """``RPP_DEBUG_FUSED_STAGING``: an asynchronous staged step whose optimizer writes each parameter's new version,
    rounded to the model's dtype, into the buffer ``stage_params`` would copy it to (``ParamBuffers.fused_target``)
    in its own pass: ``roundpipe.optim.Adam``'s kernel rounds each chunk while it is in cache, instead of a second
    pass over every fp32 copy after ``step_fn`` (about 30% of qwen3-1.7b's step on an H200, docs/benchmarks.md).

    That buffer is usually the gradient buffer the optimizer reads as its ``.grad`` (``hand_over`` makes it the
    staging buffer), so the step function must not read a gradient after ``optimizer.step()``; :meth:`check`
    raises when one was kept (no ``zero_grad()``), and :meth:`outputs` when a parameter is stepped again from
    a gradient buffer that holds weights now. Only the optimizer thread uses it."""

    def __init__(self, units: Units) -> None:
        self.model_of: Dict[int, nn.Parameter] = {}
        for _, params in units:
            for p in params:
                optim = ParamAttribute.get(p).optim
                if optim is not None:
                    self.model_of[id(optim)] = p
        self.written: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(optim) -> (optim, buffer written)

    def outputs(self, params: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """``id(optimizer parameter) -> buffer`` for those of ``params`` the optimizer may write."""
        out: Dict[int, torch.Tensor] = {}
        for o in params:
            prev = self.written.get(id(o))
            if prev is not None and o.grad is not None and same_storage(o.grad, prev[1]):
                raise RuntimeError(
                    _FUSED + "a parameter is stepped a second time in one step function, from a gradient buffer its "
                    "first step filled with weights; step each parameter once per model.step(), or set "
                    "RPP_DEBUG_FUSED_STAGING=0"
                )
            p = self.model_of.get(id(o))
            target = ParamBuffers.of(p).fused_target(p) if p is not None else None
            if target is not None:
                out[id(o)] = target
        return out

    def done(self, written: Sequence[torch.Tensor], outs: Dict[int, torch.Tensor]) -> None:
        """The optimizer wrote ``written``'s new versions into their ``outs`` buffers."""
        for o in written:
            self.written[id(o)] = (o, outs[id(o)])
        # Raw-pointer writes: bump the version counters as the copy in stage_params would.
        torch.autograd.graph.increment_version([outs[id(o)] for o in written])

    def check(self) -> None:
        """After ``step_fn``: no written buffer may still be an optimizer parameter's ``.grad``."""
        for o, buf in self.written.values():
            if o.grad is not None and same_storage(o.grad, buf):
                raise RuntimeError(
                    _FUSED + "the step function kept its gradients after optimizer.step() (no optimizer.zero_grad()), "
                    "but the optimizer wrote the new weights into their buffer; call zero_grad() in the step "
                    "function, or set RPP_DEBUG_FUSED_STAGING=0"
                )

    def written_buffers(self) -> Dict[int, torch.Tensor]:
        """``id(optimizer parameter) -> the buffer holding its new version`` (for ``stage_params``)."""
        return {k: buf for k, (_, buf) in self.written.items()}


class Publisher:
    """Copies a streamed step's layers into the model as the optimizer finishes them.

    ``units`` lists each layer's optimizer parameters in forward order. An optimizer that steps all of
    a layer's parameters calls :meth:`done` for it right after; :meth:`finish` (after ``step_fn``)
    copies the layers nobody reported. Only the optimizer thread uses it. A layer once published is
    read by the next forward, so stepping its parameters again in the same ``step_fn`` (a second
    ``optimizer.step()``) raises instead of leaving the model with an older version.
    """

    def __init__(self, units: Units) -> None:
        self.units = units
        self.masters: List[List[torch.Tensor]] = [
            [pa.optim for pa in (ParamAttribute.get(p) for p in params) if pa.optim is not None] for _, params in units
        ]
        self.unit_of: Dict[int, int] = {id(m): k for k, ms in enumerate(self.masters) for m in ms}
        self.published = [False] * len(units)

    @contextlib.contextmanager
    def active(self) -> Iterator["Publisher"]:
        """Make this the thread's :func:`current_publisher` while ``step_fn`` runs."""
        _active.publisher = self
        try:
            yield self
        finally:
            _active.publisher = None

    def plan(
        self, param_groups: List[Dict[str, Any]]
    ) -> List[Tuple[Optional[int], List[Tuple[int, List[torch.Tensor]]]]]:
        """How an optimizer with ``param_groups`` steps: ``[(layer or None, [(group index, params)])]``:
        the layers whose optimizer parameters are all in these groups, in forward order (the optimizer
        calls :meth:`done` after each), then the rest of its parameters (a layer partly in another
        optimizer is copied by :meth:`finish`)."""
        group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
        plan: List[Tuple[Optional[int], List[Tuple[int, List[torch.Tensor]]]]] = []
        covered = set()
        for k, masters in enumerate(self.masters):
            if not masters or any(id(m) not in group_of for m in masters):
                continue
            parts: Dict[int, List[torch.Tensor]] = {}
            for m in masters:
                parts.setdefault(group_of[id(m)], []).append(m)
                covered.add(id(m))
            plan.append((k, sorted(parts.items(), key=lambda kv: kv[0])))
        rest = [(gi, [p for p in g["params"] if id(p) not in covered]) for gi, g in enumerate(param_groups)]
        rest = [(gi, ps) for gi, ps in rest if ps]
        if rest:
            plan.append((None, rest))
        return plan

    def check_unpublished(self, params: List[torch.Tensor]) -> None:
        """Raise if one of ``params`` (about to be stepped) belongs to a layer already published."""
        for p in params:
            k = self.unit_of.get(id(p))
            if k is not None and self.published[k]:
                raise RuntimeError(
                    f"RPP_STEP_MODE=streamed: layer {self.units[k][0].layer_id} was already handed to the next "
                    "forward when its "
                    "parameters were stepped again in the same step function (a second optimizer.step()); step "
                    "each parameter "
                    "once per model.step(), or use RPP_STEP_MODE=staged"
                )

    def outputs(self, k: int) -> Dict[int, torch.Tensor]:
        """``id(optimizer parameter) -> model weights`` of layer ``k``, for an optimizer that writes the
        converted update itself in its step pass (``roundpipe.optim.Adam``'s kernel; it reports what it
        wrote to :meth:`done`). Waits until no upload reads the layer's weights any more."""
        attr, params = self.units[k]
        wait_uploads(attr)
        out: Dict[int, torch.Tensor] = {}
        for p in params:
            bufs = ParamBuffers.of(p)
            weights = bufs.direct_output(p)
            if weights is not None and bufs.optim is not None:
                out[id(bufs.optim)] = weights
        return out

    def done(self, k: int, written: Sequence[torch.Tensor] = ()) -> None:
        """The optimizer has stepped every parameter of layer ``k``: copy it into the model now
        (``written``: optimizer parameters whose model weights it already wrote, see :meth:`outputs`)."""
        if not self.published[k]:
            self.published[k] = True
            copy_params_to_model([self.units[k]], written={id(t) for t in written})

    def finish(self) -> None:
        """Copy every layer not published yet (in forward order)."""
        for k in range(len(self.units)):
            self.done(k)


def sync_params(units: Units, mode: StepMode, keep: bool = False) -> None:
    """Make the model parameters the optimizer's current version now (main or optimizer thread): a
    staged version that is current is swapped in (the asynchronous step already converted it), else a
    copy; with ``keep``, the result is kept through the next publish (``settle_params``)."""
    run = _settle if keep else _publish_now
    if optim_thread.on_thread():
        run(units, mode)
        return
    for attr, _ in units:
        attr.param_copied.wait()
        attr.param_copied.clear()
    optim_thread.submit(run, units, mode)
    optim_thread.synchronize()


def settle_params(units: Units, mode: StepMode) -> None:
    """Make every model parameter the optimizer's current version and keep it there through the next
    publish, after a call moved weights into the step's staging buffers and another call of the same
    cycle is about to read them (``roundpipe.host.step_cycle.StepCycle``): without this, the weights a
    download moved would be one version ahead of those it did not reach. Main thread; runs on the
    optimizer thread after the steps queued so far."""
    sync_params(units, mode, keep=True)


def _publish_now(units: Units, mode: StepMode) -> None:
    copy_params_to_model(units, use_staged=True, downloads_into_weights=mode.staged)


def _settle(units: Units, mode: StepMode) -> None:
    _publish_now(units, mode)
    for _, params in units:
        for p in params:
            bufs = ParamBuffers.of(p)
            if bufs.optim is not None:
                bufs.mark_current(p)  # the weights are current where they are: the next publish leaves them


def wait_uploads(attr: LayerAttribute) -> None:
    """Until no upload reads the layer's model parameters: the latest upload was issued
    (``param_upload_started``) and has finished reading host memory (``param_uploaded``)."""
    attr.param_upload_started.wait()
    attr.param_uploaded.synchronize()


def copy_params_to_model(
    units: Units,
    use_staged: bool = False,
    written: AbstractSet[int] = frozenset(),
    downloads_into_weights: bool = False,
) -> None:
    """Make the model parameters the optimizer's current version, layer by layer (``param_copied``).

    With ``use_staged`` (the start of an asynchronous step) weights that are that version already are
    left, and a staged version is swapped in (``host.buffers.ParamBuffers.publish``): the
    dtype-converting copy already ran while the devices were busy, and the next forward, which waits
    for ``param_copied`` layer by layer, does not wait for it. ``written``: ids of optimizer
    parameters whose values the optimizer has already written into the model (a streamed step's
    fused conversion, after :func:`wait_uploads`): not copied again. ``downloads_into_weights`` (staged
    mode): the next downloads may take the weights' buffers, so weights left in place keep no spare.
    """
    for attr, params in units:
        # An upload in flight still reads the model parameters: wait until it has finished. After
        # that nothing reads the old buffer, so the publish may make it a spare.
        wait_uploads(attr)
        with torch.no_grad():
            for p in params:
                bufs = ParamBuffers.of(p)
                written_here = bufs.optim is not None and id(bufs.optim) in written
                bufs.publish(p, use_staged, written_here, downloads_into_weights)
        attr.param_copied.set()


def stage_params(units: Units, written: Optional[Dict[int, torch.Tensor]] = None) -> None:
    """End of an asynchronous step: write the updated optimizer parameters into each parameter's
    staging buffer (model dtype, pinned like the parameter), published by the next step
    (``host.buffers.ParamBuffers.stage``: the buffers rotate, so staging costs no extra host copy).
    No event: the running call's uploads read the weights, not the staging buffers. ``written``: the buffers
    the optimizer already wrote (:class:`Stager`), by ``id`` of the optimizer parameter: not copied again.
    """
    with torch.no_grad():
        for _, params in units:
            for p in params:
                bufs = ParamBuffers.of(p)
                done = written.get(id(bufs.optim)) if written and bufs.optim is not None else None
                bufs.stage(p, done)


def release_grad_buffers(units: Units) -> None:
    """After a synchronous (or streamed) step: the gradient buffers the optimizer let go of, and any
    staging buffer (obsolete now), become spares (``host.buffers.ParamBuffers.release_after_step``)."""
    for _, params in units:
        for p in params:
            ParamBuffers.of(p).release_after_step()


def copy_grad_to_optim(p: nn.Parameter, stage_into_grad: bool = False, downloads_wait: bool = False) -> None:
    """Hand the model gradient to the optimizer copy (``host.buffers.ParamBuffers.hand_over``: the buffer
    itself where the optimizer reads its dtype, see ``reads_low_precision_grad``, else a copy) and clear
    it; ``stage_into_grad`` (a staged asynchronous step): the buffer is the next staging buffer;
    ``downloads_wait`` (a streamed one): a download that finds no spare waits for the step to release it."""
    optim = ParamAttribute.get(p).optim
    low_precision_ok = optim is not None and reads_low_precision_grad(optim)
    ParamBuffers.of(p).hand_over(p, stage_into_grad, low_precision_ok, downloads_wait)
