"""Execution plans: how a model's layers are grouped into stages (layer groups) for forward and backward.

``ModelExecutePlan`` is the record (and what users write by hand); ``roundpipe.planning.planner`` holds the pure
algorithms that choose one (``auto``) and check one (``check_valid``).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from roundpipe.devices import device
from roundpipe.devices.dispatch import dispatcher
from roundpipe.planning.fused_split import split_enabled, split_parts
from roundpipe.planning.planner import ActivationCosts, plan_stages, validate_plan
from roundpipe.planning.simulate import HostCosts, RunType, simulate_iteration
from roundpipe.planning.timer import ModelTimer
from roundpipe.utils import GiB

__all__ = ["ModelExecutePlan", "PlannedModel", "RunType"]


class PlannedModel(Protocol):
    """What :meth:`ModelExecutePlan.auto` reads of a model (a ``RoundPipe`` satisfies it): its layers'
    sizes, measured times and device bytes. A protocol so that this module need not import the wrapper
    that imports it (``roundpipe.runtime.model_protocol.PipelinedModel`` extends it)."""

    layer_size: List[float]
    """Each layer's parameters and buffers, in GB."""
    model_timer: ModelTimer
    """The layers' measured forward and backward times (``roundpipe.planning.timer``)."""

    def layer_device_bytes(self, run_type: RunType) -> List[float]:
        """Bytes each layer occupies on a device while it runs."""
        ...


class ModelExecutePlan:
    """Execution plans of a RoundPipe model: contiguous layer groups for forward and for backward.

    For 'fused' runs (``forward_backward``) the last backward group runs forward, loss and backward in
    one job, so ``fwd_plan`` stops where ``bwd_plan[-1]`` starts. A plan written for 'train' is adapted
    to 'fused' (and back) by ``for_run_type``.

    Attributes:
        fwd_plan: Layer ranges executed during forward.
        bwd_plan: Layer ranges executed during backward (empty for inference).
        keep: Backward stages whose forward keeps its autograd graph on the device for the backward, which
            then recomputes nothing (``roundpipe.planning.keep``); each is also one forward group.
        keep_bytes: Device bytes the kept stages take from the forward to the backward (0 when unknown).
        keep_saves_ms: Recompute time the kept stages save per call (milliseconds; 0 when not timed yet).
    """

    def __init__(
        self,
        fwd_plan: Optional[List[range]] = None,
        bwd_plan: Optional[List[range]] = None,
        keep: Sequence[range] = (),
        keep_bytes: float = 0.0,
        keep_saves_ms: float = 0.0,
    ) -> None:
        self.fwd_plan: List[range] = list(fwd_plan or [])
        self.bwd_plan: List[range] = list(bwd_plan or [])
        self.keep: Tuple[range, ...] = tuple(keep)
        self.keep_bytes = float(keep_bytes)
        self.keep_saves_ms = float(keep_saves_ms)

    def __repr__(self) -> str:
        def fmt(plan: List[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in plan) + "]"

        kept = f", keep={fmt(list(self.keep))}" if self.keep else ""
        if self.keep and (self.keep_bytes or self.keep_saves_ms):
            kept += f" ({self.keep_bytes / GiB:.2f} GiB, {self.keep_saves_ms:.0f} ms of recompute saved a call)"
        return (
            f"ModelExecutePlan(fwd={fmt(self.fwd_plan)} ({len(self.fwd_plan)} groups), bwd={fmt(self.bwd_plan)} "
            f"({len(self.bwd_plan)} groups){kept})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelExecutePlan) and (self.fwd_plan, self.bwd_plan, self.keep) == (
            other.fwd_plan,
            other.bwd_plan,
            other.keep,
        )

    @classmethod
    def layerwise(cls, num_layers: int, run_type: RunType) -> "ModelExecutePlan":
        """One layer per group: the finest plan, valid for any model."""
        groups = [range(i, i + 1) for i in range(num_layers)]
        if run_type == "infer":
            return cls(groups, [])
        return cls(groups, groups).for_run_type(run_type, num_layers)

    def for_run_type(self, run_type: RunType, num_layers: int) -> "ModelExecutePlan":
        """This plan adapted to ``run_type`` (forward coverage differs between 'train' and 'fused')."""
        if run_type == "infer" or not self.bwd_plan:
            return ModelExecutePlan(self.fwd_plan, [] if run_type == "infer" else self.bwd_plan)
        keep = [r for r in self.keep if run_type != "fused" or r != self.bwd_plan[-1]]
        fused_start = self.bwd_plan[-1].start
        fwd: List[range] = []
        for r in self.fwd_plan:
            if run_type == "fused":
                if r.start < fused_start:
                    fwd.append(range(r.start, min(r.stop, fused_start)))
            else:
                fwd.append(r)
        if run_type == "train" and (not fwd or fwd[-1].stop < num_layers):
            start = fwd[-1].stop if fwd else 0
            fwd.append(range(start, num_layers))
        return ModelExecutePlan(fwd, self.bwd_plan, keep, self.keep_bytes, self.keep_saves_ms)

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ``ValueError`` naming the offending layers unless the plans cover every layer once, in order."""
        validate_plan(self.fwd_plan, self.bwd_plan, num_layers, run_type)
        for r in self.keep:
            if r not in self.bwd_plan or r not in self.fwd_plan:
                raise ValueError(
                    f"keep: {r} must be both a backward stage and a forward group of the plan (a kept stage's "
                    "forward job holds its graph whole); planning.keep.refine_forward cuts the forward to match"
                )

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: PlannedModel,
        min_stages: Optional[int] = None,
        upper_threshold: float = 1.1,
        model_memory_limit: Optional[float] = None,
        activations: Optional[ActivationCosts] = None,
        num_microbatch: Optional[int] = None,
        host: Optional[HostCosts] = None,
    ) -> Union["ModelExecutePlan", List["ModelExecutePlan"]]:
        """Plan from the models' timers (see ``roundpipe.planning.planner``): the plan of a single model, or a
        list with one plan per model when several share the memory budget (``auto_many`` always
        returns the list). ``activations`` budgets a training call's activations (one model).
        ``host`` (the host's measured cost per job and microbatch) with ``num_microbatch``: fewer,
        longer groups where they simulate faster (``choose_by_host_cost``)."""
        plans = cls.auto_many(
            run_type,
            *models,
            min_stages=min_stages,
            upper_threshold=upper_threshold,
            model_memory_limit=model_memory_limit,
            activations=[activations] * len(models) if activations is not None else None,
            num_microbatch=num_microbatch,
            host=host,
        )
        return plans[0] if len(models) == 1 else plans

    @classmethod
    def auto_many(
        cls,
        run_type: RunType,
        *models: PlannedModel,
        min_stages: Optional[int] = None,
        upper_threshold: float = 1.1,
        model_memory_limit: Optional[float] = None,
        activations: Optional[List[Optional[ActivationCosts]]] = None,
        num_microbatch: Optional[int] = None,
        host: Optional[HostCosts] = None,
    ) -> List["ModelExecutePlan"]:
        """Plans for several models sharing one device memory budget; ``activations`` (per model) also
        budgets a training call's activations (``planner.ActivationCosts``); ``host`` and
        ``num_microbatch`` as in ``auto``."""
        if not models:
            raise ValueError("ModelExecutePlan.auto needs at least one RoundPipe model")
        if min_stages is None:
            min_stages = device.get_num_devices()
        if model_memory_limit is None:
            model_memory_limit = device.get_min_gpu_memory() * 0.6
        total = sum(sum(m.layer_size) for m in models) or 1.0
        plans = []
        for k, m in enumerate(models):
            # Several models share the budget in proportion to their size.
            share = model_memory_limit * (sum(m.layer_size) / total) if len(models) > 1 else model_memory_limit
            _, fwd_t, bwd_t = m.model_timer.get_estimate(run_type)
            layer_bytes = [int(b) for b in m.layer_device_bytes(run_type)]

            cut = functools.partial(
                _cut,
                cls,
                run_type,
                fwd_t,
                bwd_t,
                layer_bytes,
                min_stages,
                share * GiB,
                activations[k] if activations is not None else None,
            )
            plan = cut(upper_threshold)
            if host is not None and host.job_ms > 0 and num_microbatch and run_type != "infer":
                if host.serial_compute:
                    # Devices that compute one at a time (CPU workers) gain nothing from a group per
                    # device: candidates may have fewer groups than devices.
                    cut = functools.partial(cut.func, *cut.args[:5], 1, *cut.args[6:])
                plan = choose_by_host_cost(
                    run_type, plan, cut, upper_threshold, fwd_t, bwd_t, min_stages, num_microbatch, host
                )
            plans.append(plan)
        return plans


#: (run type, tokens of the call rounded up to a power of two; 0 when the model reports no activations).
PlanKey = Tuple[RunType, int]


class PlanCache:
    """One model's automatic plans: per ``PlanKey``, the plan in use and the timer version it was planned
    at (-1: from size estimates), and the key of the last training call (a new length frees the pinned
    blocks cached for the old one's checkpoints). Used by the main thread only."""

    def __init__(self) -> None:
        self.plans: Dict[PlanKey, Tuple[ModelExecutePlan, int]] = {}
        self.last_activation_key: Optional[PlanKey] = None

    def clear(self) -> None:
        """Forget every plan: the next call plans again from the timer."""
        self.plans.clear()


def _cut(
    cls: type,
    run_type: RunType,
    fwd_t: List[float],
    bwd_t: List[float],
    layer_bytes: List[int],
    min_stages: int,
    memory_limit_bytes: float,
    activations: Optional[ActivationCosts],
    threshold: float,
) -> ModelExecutePlan:
    """``plan_stages`` under the time cap ``threshold`` x the slowest layer, as a plan."""
    fwd, bwd = plan_stages(
        run_type,
        fwd_t,
        bwd_t,
        layer_bytes,
        min_stages=min_stages,
        upper_threshold=threshold,
        memory_limit_bytes=memory_limit_bytes,
        activations=activations,
    )
    return cls(fwd, bwd)


#: Time caps tried by ``choose_by_host_cost``, as multiples of the planner's threshold.
HOST_COST_CAPS = (2.0, 4.0, 8.0, 16.0, 64.0, float("inf"))


def choose_by_host_cost(
    run_type: RunType,
    plan: ModelExecutePlan,
    cut: Callable[[float], ModelExecutePlan],
    upper_threshold: float,
    fwd_t: List[float],
    bwd_t: List[float],
    devices: int,
    num_microbatch: int,
    host: HostCosts,
) -> ModelExecutePlan:
    """Among plans with longer groups than ``plan`` (time caps ``HOST_COST_CAPS`` x the threshold, each
    still within the memory caps and at least one group per device), the one the pipeline model with
    the host's cost per job (``roundpipe.planning.simulate``) runs fastest; ``plan`` unless another is at least
    2% faster. Each job and microbatch costs the host ``host.job_ms`` whatever its length, so where
    that cost is near a layer's time (small layers, small microbatches, CPU workers) fewer jobs win."""

    def cost(p: ModelExecutePlan) -> float:
        return plan_cost(run_type, p, fwd_t, bwd_t, devices, num_microbatch, host)

    best, best_cost = plan, cost(plan)
    for scale in HOST_COST_CAPS:
        candidate = cut(upper_threshold * scale)
        c = cost(candidate)
        if c < 0.98 * best_cost:
            best, best_cost = candidate, c
    return best


def plan_cost(
    run_type: RunType,
    plan: ModelExecutePlan,
    fwd_t: List[float],
    bwd_t: List[float],
    devices: int,
    num_microbatch: int,
    host: HostCosts,
) -> float:
    """The time the pipeline model (``roundpipe.planning.simulate``) gives one call of ``plan`` over
    ``devices`` under the dispatch policy, the fused job split as the runtime splits it."""
    parts = split_parts(devices, num_microbatch, False, split_enabled())
    return simulate_iteration(
        run_type,
        plan.fwd_plan,
        plan.bwd_plan,
        fwd_t,
        bwd_t,
        devices,
        num_microbatch,
        parts,
        host,
        dispatcher.devices_for,
    )


def replan_pays(
    run_type: RunType,
    old: ModelExecutePlan,
    new: ModelExecutePlan,
    timer: ModelTimer,
    devices: int,
    num_microbatch: int,
    host: HostCosts,
    gain: float,
) -> bool:
    """Whether ``new`` simulates at least ``gain`` (a fraction) faster than ``old`` under ``timer``'s
    current estimates and the host's costs: a re-plan replaces the plan in use only then, so plans of
    equal cost do not alternate on timer noise. Identical plans: True (nothing to compare)."""
    if old.fwd_plan == new.fwd_plan and old.bwd_plan == new.bwd_plan:
        return True
    _, fwd_t, bwd_t = timer.get_estimate(run_type)
    cost_new = plan_cost(run_type, new, fwd_t, bwd_t, devices, num_microbatch, host)
    return cost_new < (1.0 - gain) * plan_cost(run_type, old, fwd_t, bwd_t, devices, num_microbatch, host)
