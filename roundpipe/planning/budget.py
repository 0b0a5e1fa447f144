"""Memory budgets of a training call: what its activations may use on the devices and on the host, and
the refusal a call gets before its first job when no plan fits.

A model that knows what its layers' activations cost (``RoundPipe.activation_profile``: the Hugging
Face presets compute it from the config) is planned under both budgets (``planner.ActivationCosts``):
the GPU budget is the smallest device capacity (``RPP_GPU_MEMORY`` caps it) less the weights of two
stages and a margin; the host budget is ``RPP_HOST_MEMORY`` less what the process holds, or the
available memory less a margin. A plain ``RoundPipe`` reports nothing and is planned by its weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from roundpipe.devices import backend, device
from roundpipe.planning.planner import (
    DEVICE_SAVED_SHARE,
    KEEP_SHARE,
    ActivationCosts,
    ActivationMemoryError,
    fits_budgets,
)
from roundpipe.utils import GiB

logger = logging.getLogger("roundpipe")


# Kept free on each device for what the activation model does not count (allocator fragmentation,
# cuBLAS / attention workspaces) and on the host for page cache and the rest of the system.
GPU_MARGIN_FRACTION = 0.08
GPU_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class ActivationProfile:
    """Per-layer activation bytes of one call (see ``planner.ActivationCosts`` for each field), and how
    they scale: ``tokens`` of the call; ``for_tokens(n)`` gives the profile of the same call at ``n``
    tokens (used to find the longest sequence that fits)."""

    kept: List[float]
    peak: List[float]
    checkpoint: List[float]
    tokens: int
    seq_len: int
    for_tokens: Callable[[int], "ActivationProfile"]


def gpu_budget(layer_bytes: List[float]) -> float:
    """Device bytes a stage's activations may use: the smallest device capacity less a margin and the
    weights of two stages of the largest layer (the running and the prefetched one)."""
    capacity = float(device.get_min_capacity())
    return max(0.0, capacity * (1 - GPU_MARGIN_FRACTION) - GPU_MARGIN_BYTES - 2 * max(layer_bytes, default=0.0))


def device_saved_room(
    profile: Optional[ActivationProfile], layer_bytes: List[float], bwd_plan: Sequence[range]
) -> float:
    """Device bytes a one-device call may keep its backward-stage inputs in instead of host copies: a
    share of the GPU budget less the plan's largest backward stage (the inputs kept are freed stage by
    stage in backward, so that stage still fits beside the ones not yet consumed). 0 for a model that
    reports no activations (nothing to size the room by)."""
    return DEVICE_SAVED_SHARE * _beside_largest_stage(profile, layer_bytes, bwd_plan)


def device_keep_room(
    profile: Optional[ActivationProfile],
    layer_bytes: List[float],
    bwd_plan: Sequence[range],
    fwd_plan: Sequence[range] = (),
) -> float:
    """Device bytes a one-device call may keep its backward stages' graphs and inputs in (``planning.keep``):
    ``KEEP_SHARE`` of the GPU budget less the plan's largest backward stage, less what its largest forward group
    and the one prefetched beside it hold beyond one layer's weights (``planner.forward_weight_cap`` gives the
    stage inputs' room the rest of the budget for them; kept graphs take most of it, so they are counted here)."""
    largest = max(layer_bytes) if layer_bytes else 0.0
    groups = [sum(layer_bytes[i] for i in r) - largest for r in fwd_plan] if layer_bytes else []
    excess = 2 * max([0.0] + groups)
    return max(0.0, KEEP_SHARE * _beside_largest_stage(profile, layer_bytes, bwd_plan) - excess)


def _beside_largest_stage(
    profile: Optional[ActivationProfile], layer_bytes: List[float], bwd_plan: Sequence[range]
) -> float:
    """The GPU activation budget less the plan's largest backward stage (0 for a model that reports no
    activations, or no plan)."""
    if profile is None or not bwd_plan:
        return 0.0
    a = costs(profile, gpu_budget(layer_bytes), 0.0)
    worst = max(a.stage_bytes(r.start, r.stop, layer_bytes) for r in bwd_plan)
    return max(0.0, a.gpu_limit - worst)


def host_budget() -> float:
    """Host bytes the call's activation checkpoints may use (``backend.host_budget_bytes``)."""
    return float(backend.host_budget_bytes())


def costs(profile: ActivationProfile, gpu_limit: float, host_limit: float) -> ActivationCosts:
    return ActivationCosts(profile.kept, profile.peak, profile.checkpoint, gpu_limit, host_limit)


def refusal(
    model_name: str,
    profile: ActivationProfile,
    error: ActivationMemoryError,
    gpu_limit: float,
    host_limit: float,
    fits: Callable[[ActivationProfile], bool],
) -> MemoryError:
    """The error a call that cannot fit gets before its first job: what it needs, what is available, the
    longest sequence of the same shape that fits (by bisection over ``profile.for_tokens``) and what
    to change."""
    lo, hi = 0, profile.seq_len
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(profile.for_tokens(mid)):
            lo = mid
        else:
            hi = mid
    longest = (lo // 1024) * 1024 if lo >= 2048 else lo
    need = []
    if error.gpu_needed:
        need.append(
            f"{error.gpu_needed / GiB:.1f} GiB per device for a backward stage's activations "
            f"({gpu_limit / GiB:.1f} GiB available)"
        )
    if error.host_needed:
        need.append(
            f"{error.host_needed / GiB:.1f} GiB of host memory for activation checkpoints "
            f"({host_limit / GiB:.1f} GiB available)"
        )
    what = "; ".join(need) if need else str(error)
    return MemoryError(
        f"model {model_name!r}: a step of {profile.tokens:,} tokens ({profile.seq_len:,} per sequence) does not fit: "
        f"it needs {what}. The longest sequence of this batch shape that fits: {longest:,} tokens. "
        "Fixes: a shorter --seq-len / sequence, fewer rows per microbatch (more microbatches), LoRA instead of "
        "a full fine-tune, RPP_HOST_MEMORY / RPP_GPU_MEMORY if the limits are wrong; `roundpipe plan` "
        "estimates a run before it starts (docs/resolve-oom.md)."
    )


def still_fits(
    profile: Optional[ActivationProfile], layer_bytes: List[float], bwd_plan: Sequence[range], fused: bool
) -> bool:
    """Whether a backward plan made earlier still fits the budgets as they are now (host memory shrinks
    as the optimizer state and pinned blocks appear); a plan by weights alone (no profile) always does.
    Graphs held on the devices count against it as they counted against the new plan it is weighed
    against (``plan_or_refuse`` releases them only when that plan does not fit beside them)."""
    if profile is None:
        return True
    return fits_budgets(bwd_plan, costs(profile, gpu_budget(layer_bytes), host_budget()), fused, layer_bytes)


def plan_or_refuse(
    model_name: str,
    profile: Optional[ActivationProfile],
    layer_bytes: List[float],
    plan: Callable[[Optional[ActivationCosts]], object],
) -> object:
    """``plan(costs)`` under the budgets when the model has an activation profile, else ``plan(None)``;
    a plan that cannot fit becomes the refusal (``refusal``), unless it fits once earlier calls' leftovers
    are given back, which both budgets count as taken:

    * the devices' graphs and weight slots (``device.release_graphs``), left by calls of other shapes;
    * the pinned host blocks that earlier calls' checkpoints were cut from (``backend.empty_host_cache``): torch's
      host caching allocator keeps them in this process, so the host budget sees them as used. A replan of the
      same call after its first steps met this (a 70B LoRA at 8 x 4096 on a 125 GiB host: 40.0 GiB of checkpoints
      needed, 32.4 GiB seen free while the cache held the blocks of the steps before)."""
    if profile is None:
        return plan(None)
    for retry in (False, True):
        gpu_limit, host_limit = gpu_budget(layer_bytes), host_budget()
        try:
            return plan(costs(profile, gpu_limit, host_limit))
        except ActivationMemoryError as exc:
            error = exc
        if retry:
            break
        # Plans are made before the call's first job is launched (``RoundPipe.resolve_plan``), and every earlier
        # call's dispatch waited for its jobs (``pipeline.guarded``): no job is in flight here (a forward awaiting
        # its backward has none either; its backward jobs re-create the slots they use). Emptying the host cache
        # frees only the blocks no tensor holds: a forward awaiting its backward keeps its checkpoints.
        released = device.release_graphs()
        backend.empty_host_cache()
        logger.debug(
            "model %r: released the pinned host cache%s to plan this call",
            model_name,
            " and the graphs and weight slots of calls of other shapes" if released else "",
        )

    def fits(p: ActivationProfile) -> bool:
        try:
            plan(costs(p, gpu_limit, host_limit))
            return True
        except ActivationMemoryError:
            return False

    raise refusal(model_name, profile, error, gpu_limit, host_limit, fits) from error
