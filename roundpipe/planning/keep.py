"""Which backward stages keep their forward's autograd graph on the device instead of recomputing it.

A kept stage's forward job runs its layers with autograd and leaves every microbatch's graph, and the
stage's device layers with their gradients, on its device until the stage's backward job, which
back-propagates through that graph: no recompute, no stage input kept on the host and no second upload of
the layers. Where it is valid: a forward_backward call (its backward follows its forward at once, so no
other call of the model runs in between) on one device (every job of the call runs there, so the graph is
where the backward runs; a pool of several devices hands jobs out round robin and never keeps), without
sequence tiles, and not the call's last backward stage (the fused job, which runs forward and backward
in one job and recomputes nothing already).

What a kept stage costs on its device, from its forward to its backward (bytes): its layers (weights and
gradients), and for every microbatch in flight its whole activation footprint: what each layer's
recompute would have kept (``ActivationCosts.kept``) and the stage's input (which it no longer keeps
elsewhere). What it saves: the stage's recompute, its layers' forward time for every microbatch.
``RPP_DEBUG_KEEP_ACTIVATIONS`` chooses: ``auto`` keeps, best saving per byte first, the stages that fit the
room the plan leaves on a GPU (``budget.device_saved_room``) once every backward-stage input has its place
there: the inputs kept on the device save host memory, so keeping never sends one back to the host, and with
no room beyond them nothing changes; ``1`` every stage where it is valid, room or not; ``0`` none. ``auto``
keeps nothing on CPU workers: their room is the host's available memory, which the host's own budget
(checkpoints, optimizer state) counts already, and there is no upload to save.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from roundpipe import settings
from roundpipe.planning.plan import ModelExecutePlan, RunType
from roundpipe.planning.planner import ActivationCosts, checkpoint_bytes


def keepable(plan: ModelExecutePlan, run_type: RunType, devices: int, tiled: bool) -> List[range]:
    """The backward stages of ``plan`` that may keep their graph (see the module docstring): those
    before the fused one in a forward_backward call on one device without sequence tiles."""
    if run_type != "fused" or devices != 1 or tiled or not plan.bwd_plan:
        return []
    return list(plan.bwd_plan[:-1])


def stage_cost(a: ActivationCosts, stage: range, layer_bytes: Sequence[float], num_microbatch: int) -> float:
    """Device bytes keeping ``stage`` costs beyond its input's place in the room (``decide``): its layers'
    bytes, and per microbatch what its layers' recomputes keep."""
    kept = sum(float(a.kept[i]) for i in stage)
    return num_microbatch * kept + sum(float(layer_bytes[i]) for i in stage)


def choose(
    candidates: Sequence[range],
    a: ActivationCosts,
    layer_bytes: Sequence[float],
    fwd_times: Sequence[float],
    num_microbatch: int,
    room: float,
) -> List[range]:
    """The stages among ``candidates`` to keep within ``room`` bytes: best recompute time saved per
    byte first, each taken while the total still fits (greedy; the stages are few and alike)."""

    def ratio(r: range) -> float:
        cost = stage_cost(a, r, layer_bytes, num_microbatch)
        return sum(fwd_times[i] for i in r) / cost if cost > 0 else float("inf")

    chosen: List[range] = []
    used = 0.0
    for r in sorted(candidates, key=lambda r: (-ratio(r), r.start)):
        cost = stage_cost(a, r, layer_bytes, num_microbatch)
        if used + cost <= room:
            chosen.append(r)
            used += cost
    return sorted(chosen, key=lambda r: r.start)


def refine_forward(fwd_plan: Sequence[range], keep: Sequence[range]) -> List[range]:
    """``fwd_plan`` cut so that each kept stage is exactly one forward group: the kept stage's forward
    job holds its graph and its layers whole, so no forward group may start or end inside it (groups
    it cuts through are split at its ends, those inside it merged)."""
    if not fwd_plan or not keep:
        return list(fwd_plan)
    stop = fwd_plan[-1].stop
    cuts = {r.start for r in fwd_plan} | {stop}
    cuts = {c for c in cuts if not any(r.start < c < r.stop for r in keep)}
    cuts |= {r.start for r in keep} | {r.stop for r in keep}
    ends = sorted(c for c in cuts if c <= stop)
    return [range(a, b) for a, b in zip(ends, ends[1:])]


def decide(
    plan: ModelExecutePlan,
    run_type: RunType,
    devices: int,
    tiled: bool,
    num_microbatch: int,
    layer_bytes: Sequence[float],
    fwd_times: Sequence[float],
    timed: bool,
    costs: Optional[ActivationCosts],
    room: float,
    gpu: bool,
    mode: Optional[str] = None,
) -> ModelExecutePlan:
    """``plan`` with the stages to keep marked (``ModelExecutePlan.keep``) and its forward cut to match,
    under ``mode`` (``RPP_DEBUG_KEEP_ACTIVATIONS`` when None; see the module docstring). ``costs`` (None: the
    model reports no activations, and ``auto`` keeps nothing) sizes each stage; ``room`` is the device
    room, of which ``auto`` spends what the backward-stage inputs leave; ``fwd_times`` (milliseconds per
    microbatch when ``timed``, else proportional) rank the stages and give the recompute time saved;
    ``gpu``: the pool is GPUs (``auto`` keeps nothing on CPU workers). A stage ``plan`` marks by hand is
    kept where valid."""
    mode = settings.DEBUG_KEEP_ACTIVATIONS.get() if mode is None else mode
    for r in plan.keep:
        if r not in plan.bwd_plan:
            raise ValueError(
                f"ModelExecutePlan keep={list(plan.keep)}: {r} is not a backward stage of the plan "
                f"(bwd_plan={plan.bwd_plan}); list backward stages to keep"
            )
    valid = keepable(plan, run_type, devices, tiled)
    if mode == "0" or not valid:
        keep: List[range] = []
    elif mode == "1":
        keep = valid
    elif plan.keep:
        keep = [r for r in valid if r in plan.keep]
    elif costs is not None and gpu:
        inputs = checkpoint_bytes(plan.bwd_plan, costs, run_type == "fused")
        keep = choose(valid, costs, layer_bytes, fwd_times, num_microbatch, room - inputs)
    else:
        keep = []
    nbytes = sum(stage_cost(costs, r, layer_bytes, num_microbatch) for r in keep) if costs is not None else 0.0
    saves = num_microbatch * sum(fwd_times[i] for r in keep for i in r) if timed else 0.0
    fwd = refine_forward(plan.fwd_plan, keep)
    return ModelExecutePlan(fwd, plan.bwd_plan, keep=keep, keep_bytes=nbytes, keep_saves_ms=saves)
