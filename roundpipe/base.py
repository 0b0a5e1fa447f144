"""What every RoundPipe wrapper shares (``RoundPipeBase``): attribute reads and writes that fall through to
the wrapped (and original) model, the optimizer copies of the trainable parameters, and the asynchronous
optimizer step. ``roundpipe.roundpipe`` builds ``RoundPipe`` and ``AutoRoundPipe`` on it."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from roundpipe.devices.cpu_streams import host_checked
from roundpipe.devices.threads import AnnotatedEvent, raise_if_failed
from roundpipe.host import optim_thread, step_cycle
from roundpipe.host import step as optim_step
from roundpipe.host.attribute import LayerAttribute, ParamAttribute
from roundpipe.host.buffers import ParamBuffers, fold_shared_grads
from roundpipe.host.protocol import HostGradSync
from roundpipe.host.step_mode import StepMode
from roundpipe.utils import get_call_location

_OWN_ATTRS = ("model", "original_model", "_rpp_initialized", "grad_sync")


def check_wrapper_arguments(cls: str, model: Any, optim_dtype: Any) -> None:
    """A RoundPipe wrapper's constructor arguments, checked where they are given rather than at the first
    call or step (``optim_dtype="bf16"`` used to fail there as "Invalid device string")."""
    if not isinstance(model, nn.Module):
        got = f"{type(model).__name__} {model!r:.60}"
        raise TypeError(f"{cls} wraps an nn.Module (an nn.Sequential streams its children as layers), not {got}")
    if optim_dtype is not None and not (isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point):
        raise TypeError(
            f"{cls}: optim_dtype={optim_dtype!r} is not a floating-point torch.dtype; pass torch.float32, "
            "torch.bfloat16 or torch.float16 (or None: each parameter's own dtype)"
        )


def check_step_arguments(step_fn: Any, is_async: Any) -> None:
    """``step``'s arguments, checked on the caller's thread: ``model.step(optimizer.step())`` passes the
    result (None) instead of the function, and ``model.step(optimizer.step, optimizer.zero_grad)`` puts a
    function where ``is_async`` goes."""
    if not callable(step_fn):
        got = "None (the result of a call)" if step_fn is None else f"a {type(step_fn).__name__}"
        raise TypeError(
            f"step: step_fn must be a function run on the optimizer thread, e.g. "
            f"model.step(lambda: (optimizer.step(), optimizer.zero_grad())); got {got}"
        )
    if not isinstance(is_async, bool):
        raise TypeError(
            f"step: is_async is True or False, not {is_async!r:.60}; put several calls in one step_fn "
            f"(lambda: (optimizer.step(), optimizer.zero_grad()))"
        )


class RoundPipeBase(nn.Module):
    """Attributes and methods common to RoundPipe and AutoRoundPipe: attribute shimming to the wrapped
    (and original) model, optimizer-side parameters and the asynchronous optimizer step.

    Attributes:
        name: Human-readable identifier shown in errors and traces.
        model: The wrapped module.
        original_model: The pre-wrap module that attribute access falls through to (if set).
        layer_attrs: Per-layer event sets (see ``attribute``).
        optim_dtype: dtype of the optimizer copies (None: same as each parameter).
        optim_updated: Set when no optimizer step is in flight.
    """

    def __init__(self, model: nn.Module, name: Optional[str] = None, optim_dtype: Optional[torch.dtype] = None) -> None:
        check_wrapper_arguments(type(self).__name__, model, optim_dtype)
        super().__init__()
        self.model = model
        self.original_model: Optional[nn.Module] = None
        self.name = name if name is not None else get_call_location(2)
        self.optim_dtype = optim_dtype
        self.layer_attrs: List[LayerAttribute] = []
        self.optim_updated = AnnotatedEvent(f"{self.name}.optim_updated", set=True)
        self.step_mode = StepMode.resolve()  # the buffer policy of its steps, read once (a bad value fails here)
        self.cycle = step_cycle.StepCycle(self.name)  # its calls between two steps
        # Gradient synchronisation across processes (data parallel), or None: see roundpipe.runtime.grad_sync.
        self.grad_sync: Optional[HostGradSync] = None

    # ---- attribute shimming ------------------------------------------------------------------------
    def _finish_init(self) -> None:
        """Mark construction done: from now on writes of new attributes go to the wrapped models."""
        self.__dict__["_rpp_initialized"] = True

    def _shim_targets(self) -> List[nn.Module]:
        """The models attribute access falls through to: the original model first (the user's model,
        whose API the wrapper stands in for), then the wrapped one; each once."""
        out: List[nn.Module] = []
        for m in (self.__dict__.get("original_model"), self.__dict__.get("_modules", {}).get("model")):
            if m is not None and all(m is not o for o in out):
                out.append(m)
        return out

    def _is_own(self, name: str) -> bool:
        """Whether ``name`` is the wrapper's own attribute (set on the wrapper itself, never mirrored):
        private names, the wrapper's fields and submodules, and anything its class defines."""
        if name.startswith("_") or name in _OWN_ATTRS or name in self.__dict__:
            return True
        if any(name in self.__dict__.get(d, {}) for d in ("_modules", "_parameters", "_buffers")):
            return True
        return hasattr(type(self), name)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name not in _OWN_ATTRS:
            for holder in self._shim_targets():
                try:
                    return getattr(holder, name)
                except AttributeError:
                    continue
        wrapped = type(self.__dict__.get("_modules", {}).get("model")).__name__
        raise AttributeError(f"{type(self).__name__} (wrapping {wrapped}) has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """After construction, a write of anything but the wrapper's own attributes is mirrored to the
        original and the wrapped model (the spec's ``__setattr__``): ``rp.config = c`` or a new
        ``rp.foo = 1`` reaches the user's model, and reads find it there."""
        if not self.__dict__.get("_rpp_initialized") or self._is_own(name):
            super().__setattr__(name, value)
            return
        targets = self._shim_targets()
        if isinstance(value, (nn.Module, nn.Parameter)) and len(targets) > 1:
            # A module or parameter would become a layer or weight of the wrapped layer list (a
            # preset's nn.Sequential): it goes to the original model only.
            targets = targets[:1]
        for m in targets:
            setattr(m, name, value)

    def __delattr__(self, name: str) -> None:
        """Delete an own attribute, else delete ``name`` from every wrapped model that has it."""
        if name in self.__dict__ or any(
            name in self.__dict__.get(d, {}) for d in ("_modules", "_parameters", "_buffers")
        ):
            super().__delattr__(name)
            return
        found = False
        for m in self._shim_targets():
            if hasattr(m, name):
                delattr(m, name)
                found = True
        if not found:
            raise AttributeError(f"{type(self).__name__} and the models it wraps have no attribute {name!r}")

    def set_original_model(self, original_model: nn.Module) -> None:
        """Make attribute reads and writes fall through to ``original_model`` (e.g. a HF model's config)."""
        self.__dict__["original_model"] = original_model

    def train(self, mode: bool = True) -> "RoundPipeBase":
        """Set training mode on the wrapper, the wrapped model and the original model (whose
        ``training`` flag the user's code and Hugging Face read)."""
        super().train(mode)
        original = self.__dict__.get("original_model")
        if original is not None:
            original.train(mode)
        return self

    # ---- optimizer-side parameters -------------------------------------------------------------------
    def _model_params(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.model.named_parameters(remove_duplicate=True)

    def _trainable(self, remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The trainable model parameters by name, in the order of their optimizer copies."""
        seen = set()
        for name, p in self.model.named_parameters(remove_duplicate=remove_duplicate):
            if not p.requires_grad:
                continue
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            yield name, p

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Named optimizer copies of the trainable parameters (fp32 masters when ``optim_dtype`` says so)."""
        for name, p in self._trainable(remove_duplicate):
            yield (f"{prefix}.{name}" if prefix else name), self._optim_param(p)

    def named_optim_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        """Alias of ``optim_named_parameters`` (the name the spec's ``OptimizerCtx`` text uses)."""
        return self.optim_named_parameters(prefix, remove_duplicate)

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The optimizer copies of the trainable parameters: give these to the optimizer."""
        for _, p in self.optim_named_parameters():
            yield p

    def _optim_param(self, p: nn.Parameter) -> nn.Parameter:
        """The optimizer copy of ``p``, created on first use in ``optim_dtype`` (default: p's dtype). A separate
        copy even when the dtype matches: uploads read the model parameter, the optimizer writes the copy,
        and the step copies one into the other under the event protocol."""
        attr = ParamAttribute.set(p, None)
        if attr.optim is None:
            dtype = self.optim_dtype or p.dtype
            attr.optim = nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=True)
            wider = (
                dtype.is_floating_point
                and p.dtype.is_floating_point
                and torch.finfo(dtype).bits > torch.finfo(p.dtype).bits
            )
            if dtype == p.dtype or wider:  # the weights round-trip exactly: they are its version
                ParamBuffers.of(p).mark_current(p)
        return attr.optim

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        """Model parameters; the optimizer copies inside ``OptimizerCtx``."""
        if optim_step.doing_optimizer():
            return self.optim_parameters()
        # nn.Module.parameters goes through named_parameters, whose warning is for the named form.
        return (p for _, p in nn.Module.named_parameters(self, recurse=recurse))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:  # type: ignore[override]
        """Named model parameters; the optimizer copies inside ``OptimizerCtx``."""
        if optim_step.doing_optimizer():
            return self.optim_named_parameters(prefix, remove_duplicate)
        if self.optim_dtype is not None and any(p.dtype != self.optim_dtype for _, p in super().named_parameters()):
            warnings.warn(
                f"{type(self).__name__}.named_parameters() returns the model's "
                f"{next(iter(self.model.parameters())).dtype} "
                f"parameters; give optim_parameters() (the {self.optim_dtype} master copies) to the optimizer",
                stacklevel=2,
            )
        return super().named_parameters(prefix, recurse, remove_duplicate)

    # ---- optimizer step ----------------------------------------------------------------------------
    def optim_units(self) -> List[Tuple[LayerAttribute, List[nn.Parameter]]]:
        """Trainable parameters grouped by the layer whose events guard them, each listed once: the
        units of the optimizer step protocol (``roundpipe.host.step``)."""
        raise NotImplementedError

    @host_checked
    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Run ``step_fn(*args, **kwargs)`` (e.g. ``optimizer.step(); optimizer.zero_grad()``) on the
        optimizer thread, on the optimizer copies (``optim_parameters()``).

        The one-step-stale rule of ``is_async=True``: the step first copies the optimizer parameters
        as they are *before* its update into the model, then copies the gradients in and runs
        ``step_fn``. So iteration k >= 1 computes its gradients at the parameters after step k-2 (the
        initial ones for k <= 1), and the update runs on the host while iteration k+1 runs on the
        devices. ``is_async=False`` copies the gradients, runs ``step_fn``, copies the updated
        parameters back, and returns when done: every iteration sees the latest parameters, as a
        plain PyTorch loop does. ``synchronize()`` brings the model up to date either way.

        ``RPP_STEP_MODE=streamed``: ``is_async=True`` returns at once too, but nothing is stale: each
        layer goes to the next forward as soon as the optimizer has stepped it (layer by layer with
        ``roundpipe.optim.Adam``, after ``step_fn`` with other optimizers), so results equal
        ``is_async=False``, two host copies of the weights also with accumulation (``roundpipe.host.step``).
        """
        check_step_arguments(step_fn, is_async)
        raise_if_failed(f"model {self.name!r} optimizer step")
        self._finish_host_buffers()
        for cycle in self._cycles():
            cycle.on_step(is_async, self.step_mode)
        optim_step.launch(self, step_fn, is_async, args, kwargs)

    def _cycles(self) -> List[step_cycle.StepCycle]:
        """The step cycles (``step_cycle.StepCycle``) of the RoundPipes whose calls this model's step ends."""
        return [self.cycle]

    def _finish_host_buffers(self) -> None:
        """Wait, once, for the host buffers and optimizer state built ahead (``roundpipe.host.step_cycle``)."""
        self.cycle.prep.finish()

    def sync_optim_param(self) -> None:
        """Copy the optimizer parameters into the model parameters (from the main or optimizer thread);
        first waits for the values staged ahead of the first step, which this makes obsolete."""
        self._finish_host_buffers()
        optim_step.sync_params(self.optim_units(), self.step_mode)
        for cycle in self._cycles():
            cycle.on_sync()

    def wait_optimizer(self) -> None:
        """Wait until every optimizer step queued so far has finished (raising the failure of one that
        failed), and leave the model's weights as they are: unlike ``synchronize()``, an asynchronous
        run continues exactly as if nothing had waited (a checkpoint of the optimizer state taken now
        does not change the run's trajectory)."""
        optim_thread.synchronize()

    def synchronize(self) -> None:
        """Wait for pending optimizer work and bring model parameters up to date with the optimizer
        copies (for inspection, evaluation or saving)."""
        optim_thread.synchronize()
        # Parameters never handed to an optimizer (no optim_parameters() call) have no copy to sync.
        if any(
            ParamAttribute.has(p) and ParamAttribute.get(p).optim is not None
            for _, params in self.optim_units()
            for p in params
        ):
            self.sync_optim_param()

    def optim_param_state_dict(self) -> Dict[str, torch.Tensor]:
        """The optimizer copies by name (``optim_named_parameters``), detached: what a checkpoint saves
        to resume exactly when they are more precise than the weights. Call after ``synchronize()``."""
        return {name: p.detach() for name, p in self.optim_named_parameters()}

    def load_optim_params(self, state: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Set the optimizer copies from ``state`` (``optim_param_state_dict()`` of a checkpoint) or, with
        None, from the model parameters (after loading weights into the model); the model parameters
        then become the copies in their dtype. Waits for pending optimizer work first."""
        optim_thread.synchronize()
        with torch.no_grad():
            for name, p in self._trainable():
                master = self._optim_param(p)
                if state is None:
                    master.copy_(p.detach())
                elif name not in state:
                    raise KeyError(
                        f"load_optim_params: no saved optimizer copy for {name!r} (saved: {len(state)} tensors)"
                    )
                else:
                    master.copy_(state[name])
        self.sync_optim_param()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients, once an asynchronous step in flight has taken them.

        The step moves each layer's gradients into the optimizer copies on the optimizer thread
        (``grad_copied``); clearing them meanwhile would race with that copy, so each layer waits for
        its copy first (the step itself runs on). The optimizer's own gradients are cleared by its
        ``zero_grad`` inside the step function.
        """
        for attr in self.layer_attrs:
            attr.grad_copied.wait()
        super().zero_grad(set_to_none)

    def reset_events(self) -> None:
        """Mark nothing pending on any layer (after a failed run)."""
        for a in self.layer_attrs:
            a.reset()

    def reduce_shared_grads(self) -> None:
        """Fold the per-layer gradient shares of shared (tied) parameters into ``param.grad``
        (``host_buffers.fold_shared_grads``)."""
        fold_shared_grads(self._shared_params)

    @property
    def _shared_params(self) -> List[nn.Parameter]:
        return []
