"""Which plan a RoundPipe call runs: the user's, or the automatic one, re-planned as timings arrive.

The automatic plan comes from size estimates at first, is planned again once real timings exist and
then every ``RoundPipe.REPLAN_EVERY`` timer updates (plans do not churn every iteration), one per size
of the call's activations (tokens rounded up to a power of two) when the model reports them. A new plan
replaces the one in use only when the model of a call (``roundpipe.planning.plan.replan_pays``, with the
host's measured cost per job) says it is ``RoundPipe.REPLAN_GAIN`` faster and the old one still fits the
budgets. The plans a model has chosen live in its ``plan_cache`` (``roundpipe.planning.plan.PlanCache``).
"""

from __future__ import annotations

from typing import Optional

from roundpipe.devices import backend, threads
from roundpipe.devices import device as device_mod
from roundpipe.planning import budget, keep
from roundpipe.planning import plan as plan_mod
from roundpipe.planning.plan import ModelExecutePlan, PlanKey, RunType
from roundpipe.planning.planner import validate_plan
from roundpipe.planning.simulate import HostCosts
from roundpipe.runtime.batch import Batch
from roundpipe.runtime.model_protocol import PipelinedModel
from roundpipe.runtime.run import call_profile
from roundpipe.runtime.run_config import ResolvedRunConfig


def host_costs(model: PipelinedModel) -> HostCosts:
    """The host's measured cost per job and microbatch, and whether compute is serial: CPU workers
    compute under one lock (unless the stress mode lets them run at once)."""
    serial = all(d.device.type == "cpu" for d in device_mod.get_devices()) and threads.stress_limit() == 0
    if not serial:
        # On GPUs the model with host costs is not validated (0.48 s predicted against 0.90 s measured on
        # 4 H200s), and the first GPU runs of the runtime that let it choose plans were slower (4 GPUs,
        # qwen3-1.7b 16 x 4096: 62,119 tokens/s against 80,128 for the runtime before it, across calls;
        # the cause is not isolated, docs/benchmarks.md): GPU plans are chosen as before it.
        return HostCosts(serial_compute=False)
    return model.model_timer.host_costs(serial)


def local_plan(
    model: PipelinedModel, cfg: ResolvedRunConfig, run_type: RunType, batch: Optional[Batch] = None
) -> ModelExecutePlan:
    """This process's plan for a call (see the module docstring). The call's microbatch count is the
    batch's (``Batch.num_microbatch``); without a batch, the count the config asks for."""
    num_microbatch = batch.num_microbatch if batch is not None else cfg.num_microbatch
    profile = call_profile(model, batch, cfg.recompute_grain) if batch is not None and run_type != "infer" else None
    if cfg.execute_plan is not None:
        plan = cfg.execute_plan.for_run_type(run_type, model.num_layers)
        validate_plan(plan.fwd_plan, plan.bwd_plan, model.num_layers, run_type)
        plan = with_kept(model, plan, run_type, batch, num_microbatch, profile)
        plan.check_valid(model.num_layers, run_type)
        return plan
    cache = model.plan_cache
    key: PlanKey = (run_type, 1 << max(0, profile.tokens - 1).bit_length()) if profile is not None else (run_type, 0)
    if profile is not None:
        if cache.last_activation_key not in (None, key):
            # Another length than the last call: the pinned blocks cached for its checkpoints would stay
            # next to this call's (the host caching allocator reuses blocks of one size only).
            backend.empty_host_cache()
        cache.last_activation_key = key
    version = model.model_timer.version if model.model_timer.has_measurements(run_type) else -1
    cached = cache.plans.get(key)
    if cached is None or (cached[1] != version and (cached[1] < 0 or version - cached[1] >= model.REPLAN_EVERY)):
        layer_bytes = model.layer_device_bytes(run_type)
        host = host_costs(model)

        def auto(costs: Optional[budget.ActivationCosts]) -> ModelExecutePlan:
            plan = ModelExecutePlan.auto(run_type, model, activations=costs, num_microbatch=num_microbatch, host=host)
            assert isinstance(plan, ModelExecutePlan)  # one model: one plan
            return plan

        plan = budget.plan_or_refuse(model.name, profile, layer_bytes, auto)
        assert isinstance(plan, ModelExecutePlan)
        plan.check_valid(model.num_layers, run_type)
        # The plan in use stays unless the new one pays, and only while it still fits the budgets.
        if (
            cached is not None
            and version >= 0
            and not replan_pays(model, cached[0], plan, run_type, num_microbatch)
            and budget.still_fits(profile, layer_bytes, cached[0].bwd_plan, run_type == "fused")
        ):
            plan = cached[0]
        cache.plans[key] = (plan, version)
    return with_kept(model, cache.plans[key][0], run_type, batch, num_microbatch, profile)


def with_kept(
    model: PipelinedModel,
    plan: ModelExecutePlan,
    run_type: RunType,
    batch: Optional[Batch],
    num_microbatch: int,
    profile: Optional[budget.ActivationProfile],
) -> ModelExecutePlan:
    """``plan`` with the backward stages that keep their forward's graph marked (``planning.keep.decide``,
    ``RPP_DEBUG_KEEP_ACTIVATIONS``), within the device room the plan leaves (``budget.device_keep_room``)."""
    tiled = batch is not None and batch.sequence_tiles > 1
    devices = device_mod.get_num_devices()
    if not plan.keep and not keep.keepable(plan, run_type, devices, tiled):
        return plan
    layer_bytes = model.layer_device_bytes(run_type)
    costs = budget.costs(profile, budget.gpu_budget(layer_bytes), 0.0) if profile is not None else None
    room = budget.device_keep_room(profile, layer_bytes, plan.bwd_plan, plan.fwd_plan)
    source, fwd_t, _ = model.model_timer.get_estimate(run_type)
    gpu = all(backend.is_cuda(d.device) for d in device_mod.get_devices())
    return keep.decide(
        plan, run_type, devices, tiled, num_microbatch, layer_bytes, fwd_t, source == "time", costs, room, gpu
    )


def replan_pays(
    model: PipelinedModel, old: ModelExecutePlan, new: ModelExecutePlan, run_type: RunType, num_microbatch: int
) -> bool:
    """Whether ``new`` simulates at least ``model.REPLAN_GAIN`` faster than ``old`` on this pool, under
    the model's current timings and the host's costs (``roundpipe.planning.plan.replan_pays``)."""
    devices = device_mod.get_num_devices()
    return plan_mod.replan_pays(
        run_type, old, new, model.model_timer, devices, num_microbatch, host_costs(model), model.REPLAN_GAIN
    )
