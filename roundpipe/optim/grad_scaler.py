"""A gradient scaler for mixed precision training in RoundPipe.

API of ``torch.amp.GradScaler``, for an optimizer whose parameters and gradients live on the host (fp32
masters), and split across two threads: the main thread scales the loss, the optimizer thread
unscales, steps and updates the scale. Usage (see docs/optimizer.md)::

    scaler = GradScaler()
    for batch in data:
        loss = model(batch)
        scaler.scale(loss).backward()
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()  # on the main thread, after model.step

The problem with async steps: while iteration i+1 scales its loss on the main thread, the update that
follows step i may not have run yet. The gradients of i+1 then carry the old scale and must be
unscaled by the old scale, not by whatever the optimizer thread's scale is by then. So:

* The optimizer thread owns the dynamic scale (``main_scaler``): growth tracker, backoff and growth
  exactly as torch's ``_amp_update_scale_``. Each update publishes the new scale in ``next_scale`` and
  sets ``scaler_updated``.
* The main thread owns the scale it multiplies losses by (``scale_scaler``). It changes only at an
  iteration boundary: the first ``scale()`` after ``update()`` adopts ``next_scale`` if an update was
  published by then (never waiting for one), and queues the adopted value to the optimizer thread.
  Every scale of one iteration's losses is therefore the same.
* The optimizer thread unscales with the scale the main thread announced last (``applied_scale``).
  The optimizer stream runs kernels in submission order, and the announcement is queued before the
  iteration's ``model.step``, so it is in place before that step's unscale.

Gradients are thus always unscaled exactly. When the optimizer keeps up (``is_async=False``, or a
synchronize per iteration), every scale equals what ``torch.amp.GradScaler`` would use; when it lags,
an iteration may scale with the previous scale while the dynamic scale evolves as torch's would.
"""

from __future__ import annotations

import threading
from collections import abc, defaultdict
from enum import Enum
from typing import Any, Dict, Final, Iterable, List, Optional, Union

import torch
from torch import Tensor

from roundpipe.devices.threads import AnnotatedEvent
from roundpipe.host import optim_thread

__all__ = ["GradScaler"]


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_optimizer_state() -> Dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _scalar(value: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.full((), value, dtype=dtype)


class _MainScaler:
    """Dynamic-scale state of the optimizer thread (torch.amp.GradScaler's, plus ``applied_scale``).

    Attributes:
        scale: The current dynamic scale (float32, host).
        growth_tracker: Consecutive unskipped steps since the last growth or backoff (int32, host).
        applied_scale: The scale the gradients about to be unscaled were multiplied by.
        per_optimizer_states: Stage and found_inf tensors of each optimizer since the last update.
    """

    def __init__(self, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
        self.scale = _scalar(init_scale)
        self.growth_tracker = _scalar(0, torch.int32)
        self.applied_scale = self.scale.clone()
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.per_optimizer_states: Dict[int, Dict[str, Any]] = defaultdict(_fresh_optimizer_state)


class _ScaleScaler:
    """What the main thread knows: the scale it applies and the factors it last set.

    Attributes:
        scale: The scale ``scale()`` multiplies by. Replaced, never modified in place: autograd graphs
            of this iteration's losses hold it for their backward.
        boundary_pending: ``update()`` ran since the last adoption; the next ``scale()`` starts an
            iteration and may adopt a newer scale.
    """

    def __init__(self, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
        self.scale = _scalar(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.boundary_pending = False


class GradScaler:
    """Helps perform the steps of gradient scaling conveniently; API compatible with torch.amp.GradScaler.

    Accessed from the main thread (and device threads running loss functions) and from the optimizer
    stream; every method checks which one it runs on. Member access rules:

    * Both: ``next_scale``, ``scaler_updated`` (under ``_lock``)
    * Optimizer stream only: ``main_scaler``
    * Main thread only: ``scale_scaler`` (under ``_lock``: device threads may call ``scale()`` at once)
    * Read only: ``enabled``

    The main thread never waits for the optimizer thread, except in the getters with
    ``up_to_date=True``, in ``unscale_`` (the caller wants to inspect the gradients) and in
    ``state_dict``/``load_state_dict``.

    Attributes:
        enabled: Whether gradient scaling is enabled.
        main_scaler: Tracks the dynamic scale; unscales, steps and updates (optimizer stream).
        scale_scaler: Holds the scale applied to outputs (main thread).
        next_scale: The newest scale published by an update, for the main thread to adopt.
        scaler_updated: Set when ``next_scale`` holds a value the main thread has not adopted yet.
    """

    enabled: Final[bool]

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        """
        Args:
            init_scale: Initial scale factor.
            growth_factor: Factor by which the scale is multiplied during update if no inf/NaN
                gradients occur for ``growth_interval`` consecutive iterations.
            backoff_factor: Factor by which the scale is multiplied during update if inf/NaN gradients
                occur in an iteration.
            growth_interval: Number of consecutive iterations without inf/NaN gradients that must occur
                for the scale to be multiplied by ``growth_factor``.
            enabled: If False, ``step`` simply invokes ``optimizer.step()`` and other methods are no-ops.
        """
        self.enabled = enabled
        # What the getters report when disabled (torch's GradScaler has no state then).
        self._disabled_factors = {
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        if not enabled:
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")
        self.main_scaler = _MainScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        self.scale_scaler = _ScaleScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        self.next_scale = _scalar(init_scale)
        self.scaler_updated = AnnotatedEvent("GradScaler.scaler_updated")
        # Guards next_scale + scaler_updated (written together by the optimizer thread, read together by
        # the main thread) and scale_scaler. Held for microseconds; nobody waits on the other thread
        # while holding it, so it never makes the main thread wait for optimizer work.
        self._lock = threading.Lock()

    # ---- main thread: scaling ----------------------------------------------------------------------
    def scale(self, outputs: Union[Tensor, Iterable[Tensor]]) -> Union[Tensor, Iterable[Tensor]]:
        """Multiply ('scale') a tensor or an iterable of tensors by the scale factor.

        Returns scaled outputs; unmodified if this instance is not enabled. Outputs may live on any
        device: the scale is a host 0-dim tensor, which device kernels take as a plain scalar.
        """
        if not self.enabled:
            return outputs
        if optim_thread.on_thread():
            raise RuntimeError(
                "GradScaler.scale() runs on the main thread (or in a loss function on a device thread), not "
                "inside the optimizer step function."
            )
        with self._lock:
            self._adopt_published_scale()
            scale = self.scale_scaler.scale

        def apply(val: Any) -> Any:
            if isinstance(val, Tensor):
                return val * scale
            if isinstance(val, abc.Iterable):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _adopt_published_scale(self) -> None:
        """At the first ``scale()`` of an iteration, take the newest published scale, if any (main, locked).

        Adopting only at this boundary keeps every loss of one iteration on one scale. The adopted value
        is queued to the optimizer thread, ahead of this iteration's step, as the scale to unscale by.
        """
        sc = self.scale_scaler
        if not sc.boundary_pending:
            return
        sc.boundary_pending = False
        if not self.scaler_updated.is_set():
            return  # the optimizer has not caught up: keep the current scale, its grads stay exact
        self.scaler_updated.clear()
        if torch.equal(self.next_scale, sc.scale):
            return  # unchanged: the optimizer thread already unscales by this value
        sc.scale = self.next_scale.clone()
        optim_thread.submit(self._set_applied_scale_kernel, sc.scale)

    def _set_applied_scale_kernel(self, scale: Tensor) -> None:
        self.main_scaler.applied_scale = scale

    # ---- unscale / step ----------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ('unscale') the optimizer's gradient tensors by the scale factor.

        Optional; serves cases where you need to modify or inspect gradients between the backward
        pass(es) and ``step``. If not called explicitly, ``step`` unscales. Called from the main thread,
        the unscale is launched on the optimizer stream and waited for.
        """
        if not self.enabled:
            return
        if optim_thread.on_thread():
            self._unscale_kernel(optimizer)
            return
        optim_thread.submit(self._unscale_kernel, optimizer)
        # The caller wants to look at the unscaled gradients next: wait for them.
        optim_thread.synchronize()

    def _unscale_kernel(self, optimizer: torch.optim.Optimizer) -> None:
        ms = self.main_scaler
        state = ms.per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # Divide by the scale these gradients were multiplied by, computed like torch does.
        inv_scale = ms.applied_scale.double().reciprocal().float()
        state["found_inf_per_device"] = _unscale_grads(optimizer, inv_scale)
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscale the gradients (unless ``unscale_`` did) and run ``optimizer.step(*args, **kwargs)``
        unless they contain inf/NaN, in which case the step is skipped and the parameters stay as they are.

        Returns:
            If disabled, the return value of ``optimizer.step``. If enabled, that value when called on
            the optimizer stream; called on the main thread, the step is queued there and None returned.
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if optim_thread.on_thread():
            return self._step_kernel(optimizer, args, kwargs)
        optim_thread.submit(self._step_kernel, optimizer, args, kwargs)
        return None

    def _step_kernel(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: Dict[str, Any]) -> Optional[float]:
        state = self.main_scaler.per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self._unscale_kernel(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = None
        # Host tensors: .item() costs nothing here (on a GPU it would be the sync torch also pays).
        if not sum(v.item() for v in state["found_inf_per_device"].values()):
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    # ---- update ------------------------------------------------------------------------------------
    def update(self, new_scale: Optional[Union[float, Tensor]] = None) -> None:
        """Update the scale factor. Call on the main thread, after ``model.step(...)`` each iteration.

        The update is queued on the optimizer stream behind the step; it backs the scale off if any
        step found inf/NaN gradients and grows it after ``growth_interval`` clean steps, as torch does.
        The next ``scale()`` uses the result if it is there by then (see the module docstring).

        Passing ``new_scale`` sets the new scale value manually (its value is copied now: later in-place
        changes to a tensor passed do not affect the scaler).
        """
        if not self.enabled:
            return
        if optim_thread.on_thread():
            raise RuntimeError(
                "GradScaler.update() must be called on the main thread after model.step(...), not inside the "
                "step function: it marks the iteration boundary at which the next scale() may adopt a new scale."
            )
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                reason = "new_scale should be a float or a 1-element tensor with requires_grad=False."
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                new_scale = new_scale.detach().to("cpu", torch.float32, copy=True).reshape(())
            else:
                new_scale = float(new_scale)
        optim_thread.submit(self.update_kernel, new_scale)
        with self._lock:
            self.scale_scaler.boundary_pending = True

    def update_kernel(self, new_scale: Optional[Union[float, Tensor]]) -> None:
        """Update the scale on the optimizer stream and publish it to the main thread."""
        ms = self.main_scaler
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                ms.scale.copy_(new_scale)
            else:
                ms.scale.fill_(new_scale)
        else:
            found_infs = [
                found_inf.to("cpu")
                for state in ms.per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf_combined = found_infs[0]
            for found_inf in found_infs[1:]:
                found_inf_combined = found_inf_combined + found_inf
            torch._amp_update_scale_(
                ms.scale,
                ms.growth_tracker,
                found_inf_combined,
                ms.growth_factor,
                ms.backoff_factor,
                ms.growth_interval,
            )
        ms.per_optimizer_states = defaultdict(_fresh_optimizer_state)
        with self._lock:
            self.next_scale.copy_(ms.scale)
            self.scaler_updated.set()

    # ---- getters and setters -----------------------------------------------------------------------
    def get_scale(self, up_to_date: bool = False) -> float:
        """Return the current scale factor (1.0 if scaling is disabled).

        On the optimizer stream: the dynamic scale. On the main thread: the scale the next ``scale()``
        call would apply (mid-iteration, the iteration's scale), without waiting; with
        ``up_to_date=True``, it waits for the queued optimizer work and returns the dynamic scale after
        the last ``update()``, as torch's ``get_scale`` does.
        """
        if not self.enabled:
            return 1.0
        if optim_thread.on_thread():
            return self.main_scaler.scale.item()
        if up_to_date:
            optim_thread.synchronize()
            return self.main_scaler.scale.item()  # the optimizer stream is idle now
        with self._lock:
            sc = self.scale_scaler
            if sc.boundary_pending and self.scaler_updated.is_set():
                return self.next_scale.item()
            return sc.scale.item()

    def _get_factor(self, name: str, up_to_date: bool) -> Any:
        if not self.enabled:
            return self._disabled_factors[name]
        if optim_thread.on_thread():
            return getattr(self.main_scaler, name)
        if up_to_date:
            optim_thread.synchronize()
            # The optimizer stream is idle now: reading its (immutable) Python number is safe.
            return getattr(self.main_scaler, name)
        return getattr(self.scale_scaler, name)

    def _set_factor(self, name: str, value: Any) -> None:
        if not self.enabled:
            self._disabled_factors[name] = value
            return
        if optim_thread.on_thread():
            setattr(self.main_scaler, name, value)
            return
        with self._lock:
            setattr(self.scale_scaler, name, value)
        # Ordered with the queued updates: updates queued before use the old value, as in torch.
        optim_thread.submit(setattr, self.main_scaler, name, value)

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        """Return the scale growth factor (main thread: the last value set there, unless ``up_to_date``)."""
        return self._get_factor("growth_factor", up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set a new scale growth factor."""
        self._set_factor("growth_factor", new_factor)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        """Return the scale backoff factor (main thread: the last value set there, unless ``up_to_date``)."""
        return self._get_factor("backoff_factor", up_to_date)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set a new scale backoff factor."""
        self._set_factor("backoff_factor", new_factor)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        """Return the growth interval (main thread: the last value set there, unless ``up_to_date``)."""
        return self._get_factor("growth_interval", up_to_date)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set a new growth interval."""
        self._set_factor("growth_interval", new_interval)

    def is_enabled(self) -> bool:
        """Return whether this instance is enabled."""
        return self.enabled

    # ---- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Return the state as ``torch.amp.GradScaler.state_dict`` does (empty if disabled).

        Keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker. Called on the main
        thread it waits for queued optimizer work, so it describes the state after the last ``update()``
        (checkpoint the optimizer at the same point).
        """
        if not self.enabled:
            return {}
        if not optim_thread.on_thread():
            optim_thread.synchronize()
        ms = self.main_scaler  # the optimizer stream is idle (or is us)
        return {
            "scale": ms.scale.item(),
            "growth_factor": ms.growth_factor,
            "backoff_factor": ms.backoff_factor,
            "growth_interval": ms.growth_interval,
            "_growth_tracker": int(ms.growth_tracker.item()),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (this class's or torch.amp.GradScaler's). No-op if disabled.

        Called on the main thread it waits for queued optimizer work, then resets both threads' views
        to the loaded scale.
        """
        if not self.enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        if optim_thread.on_thread():
            raise RuntimeError("GradScaler.load_state_dict() must be called on the main thread.")
        scale = float(state_dict["scale"])
        optim_thread.submit(self._load_kernel, dict(state_dict))
        # Nothing may be queued behind the load while the main side is reset below: wait for it.
        optim_thread.synchronize()
        with self._lock:
            sc = self.scale_scaler
            sc.scale = _scalar(scale)
            sc.growth_factor = float(state_dict["growth_factor"])
            sc.backoff_factor = float(state_dict["backoff_factor"])
            sc.growth_interval = int(state_dict["growth_interval"])
            sc.boundary_pending = False
            self.scaler_updated.clear()
            self.next_scale.fill_(scale)

    def _load_kernel(self, state_dict: Dict[str, Any]) -> None:
        ms = self.main_scaler
        ms.scale.fill_(float(state_dict["scale"]))
        ms.applied_scale = ms.scale.clone()
        ms.growth_factor = float(state_dict["growth_factor"])
        ms.backoff_factor = float(state_dict["backoff_factor"])
        ms.growth_interval = int(state_dict["growth_interval"])
        ms.growth_tracker.fill_(int(state_dict["_growth_tracker"]))
        ms.per_optimizer_states = defaultdict(_fresh_optimizer_state)


def _unscale_grads(optimizer: torch.optim.Optimizer, inv_scale: Tensor) -> Dict[torch.device, Tensor]:
    """Multiply every gradient of ``optimizer`` by ``inv_scale`` in place; return found_inf per device.

    fp16 gradients are refused as by torch: unscaling them in fp16 loses precision; RoundPipe's
    optimizer copies (fp32 masters) carry fp32 gradients.
    """
    per_device: Dict[torch.device, Dict[torch.dtype, List[Tensor]]] = defaultdict(lambda: defaultdict(list))
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse:
                    raise NotImplementedError("GradScaler: sparse gradients are not supported.")
                per_device[param.grad.device][param.grad.dtype].append(param.grad)
        found_infs: Dict[torch.device, Tensor] = {}
        for device, per_dtype in per_device.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            inv = inv_scale.to(device)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
            found_infs[device] = found_inf
    return found_infs
