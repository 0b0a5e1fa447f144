"""Cut a model's layers into stages (layer groups) for the forward and the backward pass.

This module is the pure algorithm behind ``ModelExecutePlan.auto`` and ``ModelExecutePlan.check_valid``:
it sees per-layer times and sizes as plain numbers and knows nothing of devices. What a plan costs
under the dispatch policy over several devices, the host's costs included, is ``roundpipe.planning.simulate``.

A stage is a contiguous ``range`` of layers that is uploaded to a device, run, and dropped. Two things
bound a stage:

* Time. The pipeline runs at the pace of its slowest stage, and no stage can be faster than the slowest
  single layer. So a stage may grow until its time reaches ``upper_threshold`` x the slowest layer's time:
  up to there, merging layers costs no throughput and saves per-stage overhead (launches, events,
  saved activations at every stage boundary).
* Memory. The current stage and the prefetched next one are resident at once, so a stage's bytes must fit
  in half of the memory budget.

Within those bounds the planner uses as few stages as possible (but at least ``min_stages`` so that every
device gets work), and among the plans with that many stages picks one whose slowest stage is as fast as
possible, then spreads the remaining time evenly.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from roundpipe.planning.partition import REL_TOL as _REL_TOL
from roundpipe.planning.partition import partition, prefix
from roundpipe.planning.simulate import RunType
from roundpipe.utils import GiB


@dataclass(frozen=True)
class _Problem:
    """One training call's planning problem, as ``plan_stages`` checked it: the per-layer costs and the caps."""

    run_type: RunType
    fwd_times: Sequence[float]
    bwd_times: Sequence[float]
    layer_bytes: Sequence[int]
    min_stages: int
    upper_threshold: float
    mem_cap: float
    """Device bytes of one stage's weights (half the weight budget: the prefetched stage is resident too)."""
    fwd_cap: Optional[float] = None
    """The forward groups' cap where it is lower (``forward_weight_cap``, under budgeted activations)."""

    @property
    def fwd_mem_cap(self) -> float:
        return self.mem_cap if self.fwd_cap is None else min(self.mem_cap, self.fwd_cap)


class PlanMemoryError(ValueError):
    """A single layer does not fit in the per-stage memory budget. ``plan_stages`` warns and raises the
    budget instead; kept for callers that catch it."""


class ActivationMemoryError(PlanMemoryError):
    """No plan keeps a call's activations within the GPU or the host budget (``plan_stages`` with
    ``activations``). ``gpu_needed`` / ``host_needed``: the bytes the best plan would need."""

    def __init__(self, message: str, gpu_needed: float, host_needed: float) -> None:
        super().__init__(message)
        self.gpu_needed = gpu_needed
        self.host_needed = host_needed


@dataclass(frozen=True)
class ActivationCosts:
    """What a call's activations cost per layer, for planning under GPU and host budgets.

    With sequence lengths of tens of thousands of tokens a stage's activations, not its weights, decide
    whether it fits, and the inputs of the backward stages (kept on the host from the forward to the
    backward) decide the host memory. Per layer ``i`` (bytes):
    """

    kept: Sequence[float]
    """GPU bytes the recompute of layer ``i`` keeps for the backward while later layers of its stage
    run (one microbatch)."""
    peak: Sequence[float]
    """GPU bytes while layer ``i`` itself is back-propagated (its kept bytes and its transients)."""
    checkpoint: Sequence[float]
    """Host bytes kept when a backward stage starts at layer ``i``: its input, all microbatches."""
    gpu_limit: float
    """GPU bytes per device for one stage's activations (beyond the weights)."""
    host_limit: float
    """Host bytes for all backward stages' inputs."""

    def stage_bytes(self, start: int, stop: int, sizes: Sequence[float] = ()) -> float:
        """GPU activation bytes of a backward stage of layers [start, stop): the layer back-propagated
        at the time needs its peak, the others what their recompute keeps; with the layers' weight
        ``sizes``, plus the stage's weights beyond what ``gpu_limit`` already leaves out
        (``stage_weight_excess``)."""
        kept = sum(self.kept[start:stop])
        excess = stage_weight_excess(float(sum(sizes[start:stop])), float(max(sizes))) if sizes else 0.0
        return kept + max(self.peak[i] - self.kept[i] for i in range(start, stop)) + excess


#: Share of the device memory a single-device plan leaves free that backward-stage inputs take by default
#: (``budget.device_saved_room``); the rest absorbs what the activation model does not count, and the forward
#: groups' weights beyond one layer (``forward_weight_cap``).
DEVICE_SAVED_SHARE = 0.75

#: Share of that same room the stages whose graphs stay on the device may take, with the saved inputs and the
#: forward groups' weights beyond one layer counted in it (``budget.device_keep_room``). Measured on one H200
#: (qwen3-8b LoRA r16, 8 x 4096): every stage kept peaked at 126.9 GiB of the 139.8, where the plan's count
#: came to 139 GiB; 23 stages kept at 87.5 GiB against 94.6 counted. The count of a kept stage is the larger,
#: so it is the margin.
KEEP_SHARE = 0.9


def forward_weight_cap(a: ActivationCosts, sizes: Sequence[float], bwd_plan: Sequence[range], mem_cap: float) -> float:
    """Device bytes of one forward group's weights when activations are budgeted.

    ``budget.gpu_budget`` leaves out two of the largest layer: a forward group of several layers, and the next
    one prefetched while it runs, hold twice its weights beyond that. During the forward the device also holds
    the stage inputs kept there (at most ``DEVICE_SAVED_SHARE`` of the budget the largest backward stage
    leaves) and one layer's forward transients (no more than that stage's activations), so the excess is safe
    within the rest of that room. Without this cap a re-plan from measured timings grouped a 70B model's
    forward in threes under a 24 GiB cap (5.4 GiB of weights a group; out of memory in the second step)."""
    largest = float(max(sizes, default=0.0))
    worst = max((a.stage_bytes(r.start, r.stop, sizes) for r in bwd_plan), default=0.0)
    slack = (1.0 - DEVICE_SAVED_SHARE) * max(0.0, a.gpu_limit - worst)
    return min(mem_cap, largest + slack / 2.0)


def stage_weight_excess(stage_weights: float, largest_layer: float) -> float:
    """Device bytes of a stage's weights that the activation budget must also hold.

    ``budget.gpu_budget`` leaves out twice the largest layer (the running and the prefetched one). A
    stage of several layers holds all of them, and the next stage, prefetched while it runs, may be as
    large: twice the stage's weights beyond the largest layer count against its activations. Without
    this a stage merged under host pressure was planned by its activations alone (qwen3-32b LoRA on an
    H200: 30 layers, 28 GiB of weights beside the activations the budget had allowed, out of memory)."""
    return 2.0 * max(0.0, stage_weights - largest_layer)


def plan_stages(
    run_type: RunType,
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    layer_bytes: Sequence[int],
    *,
    min_stages: int,
    upper_threshold: float,
    memory_limit_bytes: float,
    activations: Optional[ActivationCosts] = None,
) -> Tuple[List[range], List[range]]:
    """Plan forward and backward layer groups.

    Args:
        run_type: 'infer' (forward only), 'train' (forward, then backward), or 'fused' (forward, then the
            last backward group runs forward + loss + backward in one go, then the other backward groups).
        fwd_times: Per-layer forward cost (ms, or any unit proportional to it, such as bytes).
        bwd_times: Per-layer backward cost, recompute included (same unit). Ignored for 'infer'.
        layer_bytes: Per-layer bytes that must live on the device while the layer's stage runs
            (parameters for 'infer', parameters and gradients for training).
        min_stages: Wanted minimum number of groups per pass, usually the number of devices. Honoured as
            far as the number of layers allows.
        upper_threshold: A group's time may be at most this multiple of the slowest layer's time (>= 1).
        memory_limit_bytes: Device memory for model parameters (and gradients); each group gets half of it
            because the current and the prefetched group are resident at once.
        activations: A call's activation costs (training runs at long context): each backward group's
            activations must fit ``gpu_limit``, and the backward groups' input checkpoints together
            ``host_limit``. Under host pressure groups grow beyond the time cap (fewer, longer stages
            cost no throughput on the round-robin pipeline, only device memory).

    Returns:
        ``(fwd_plan, bwd_plan)``, each a list of contiguous ranges in layer order. For 'infer' the
        backward plan is empty. For 'fused' the forward plan covers ``[0, bwd_plan[-1].start)``: the last
        backward group's layers run their forward inside the fused step.

    A single layer larger than ``memory_limit_bytes / 2`` gets a ``RuntimeWarning`` and the limit is
    raised to twice that layer's size (every stage must hold one layer at least).

    Raises:
        ActivationMemoryError: No backward plan fits the activation budgets (``activations``).
        ValueError: Inputs of the wrong length, negative or non-finite costs, or a threshold below 1.

    Fused choice: the fused group runs forward + backward of its layers, and its cost is estimated by the
    layers' backward times (recompute + backward, and a recompute is a forward). The fused group is simply
    the last group of the backward plan, so it obeys the same time cap as every backward group and the
    same memory cap. The backward groups before it and the forward plan are then cut over the layers
    before it, with their time caps taken from the slowest of those layers and ``min_stages - 1`` groups
    at least (the fused group is a stage of both passes).
    """
    n = len(fwd_times)
    if n == 0:
        raise ValueError("plan_stages: the model has no layers")
    if run_type not in ("infer", "train", "fused"):
        raise ValueError(f"plan_stages: run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
    if not upper_threshold >= 1.0:
        raise ValueError(
            "plan_stages: upper_threshold must be >= 1 (a group cannot be faster than its slowest layer), got "
            f"{upper_threshold}"
        )
    if not memory_limit_bytes > 0:
        raise ValueError(f"plan_stages: memory_limit_bytes must be > 0, got {memory_limit_bytes}")
    _check_costs("fwd_times", fwd_times, n)
    _check_costs("layer_bytes", layer_bytes, n)
    if run_type != "infer":
        _check_costs("bwd_times", bwd_times, n)

    largest = max(range(n), key=lambda i: layer_bytes[i])
    if layer_bytes[largest] > memory_limit_bytes / 2:
        # No stage could hold this layer: plan with a limit that fits it (the layer's stage then holds
        # it alone) instead of refusing; the device may still have the room, the limit is an estimate.
        warnings.warn(
            _layer_too_big_message(largest, layer_bytes[largest], memory_limit_bytes, run_type),
            RuntimeWarning,
            stacklevel=3,
        )
        memory_limit_bytes = 2.0 * layer_bytes[largest]
    mem_cap = memory_limit_bytes / 2

    min_stages = max(1, int(min_stages))
    if run_type == "infer":
        return partition(fwd_times, layer_bytes, min_stages, upper_threshold, mem_cap), []

    problem = _Problem(run_type, fwd_times, bwd_times, layer_bytes, min_stages, upper_threshold, mem_cap)
    if activations is not None:
        _check_activations(activations, n)
        plain = _plain_training_plan(problem)
        if fits_budgets(plain[1], activations, run_type == "fused", layer_bytes):
            # The same backward plan, its forward groups re-cut under the room its stages leave.
            cap = forward_weight_cap(activations, layer_bytes, plain[1], mem_cap)
            return _plain_training_plan(dataclasses.replace(problem, fwd_cap=cap))
        return _plan_with_activations(problem, activations)
    return _plain_training_plan(problem)


def _settled_forward(p: _Problem, bwd_plan: List[range]) -> Optional[Tuple[List[range], List[range]]]:
    """The plan, when its forward needs no cut in front of the fused group: a 'train' forward is cut by
    its own times; a 'fused' plan whose fused group starts at layer 0 has no forward groups. None: the
    forward groups of a 'fused' plan, which the caller cuts in front of its fused group."""
    if p.run_type == "train":
        return partition(p.fwd_times, p.layer_bytes, p.min_stages, p.upper_threshold, p.fwd_mem_cap), bwd_plan
    if bwd_plan[-1].start == 0:
        return [], bwd_plan
    return None


def _plain_training_plan(p: _Problem) -> Tuple[List[range], List[range]]:
    """The time-balanced training plan under the weight cap (activations not budgeted)."""
    fwd_times, bwd_times, layer_bytes = p.fwd_times, p.bwd_times, p.layer_bytes
    min_stages, upper_threshold, mem_cap = p.min_stages, p.upper_threshold, p.mem_cap
    bwd_plan = partition(bwd_times, layer_bytes, min_stages, upper_threshold, mem_cap)
    settled = _settled_forward(p, bwd_plan)
    if settled is not None:
        return settled
    # Fused: the forward pipeline is the forward groups plus the fused group, so the forward groups need
    # one stage fewer to give every device work.
    fused_start = bwd_plan[-1].start
    # The backward groups before the fused one are re-cut with their cap relative to a typical (median)
    # one of their own layers: the fused group (typically the head, the slowest layer by far) runs as its
    # own job, so letting the other groups grow to its time would save only per-group overhead, which
    # the runtime hides, and would keep several layers' recompute activations on the device at once. The
    # median, not the slowest: a layer timed slow once (18 ms among 10.5 ms on 2 H200s) raised the cap
    # enough to pair layers, and two plans of one command on one machine ran 1.105 s with one layer per
    # group and 1.267 s with pairs. A layer above the cap still forms a group of its own.
    body_bwd = bwd_times[:fused_start]
    bwd_plan = partition(
        body_bwd,
        layer_bytes[:fused_start],
        min_stages - 1,
        upper_threshold,
        mem_cap,
        slowest=statistics.median(body_bwd),
    ) + [bwd_plan[-1]]
    # Forward groups may take as long as a typical (median) one of those backward groups, not only the
    # threshold times the slowest forward layer: a forward job no longer than a backward job does not
    # become the pipeline's bottleneck, and each forward group boundary costs a hand-over, which on
    # several devices goes device -> host -> device before the next group's first microbatch can start.
    # On 2 H200s (qwen3-1.7b, 16 x 4096) forward groups of two or four layers gave the best iterations
    # measured, 1.08-1.10 s (docs/benchmarks.md); on one GPU the grouping made no difference. The
    # median, not the slowest: one backward layer timed at 18 ms among 10 ms ones once gave forward
    # groups of six layers. The fused group (typically the head) does not set this cap either: its
    # forward runs inside the fused job, and capping by it would let forward groups grow to many layers
    # for nothing but device memory (two groups are resident at once).
    body = [math.fsum(bwd_times[i] for i in r) for r in bwd_plan[:-1]]
    # (``partition`` caps at upper_threshold x slowest; a backward group's time is a cap as it is.)
    slowest = max([max(fwd_times[:fused_start])] + ([statistics.median(body) / upper_threshold] if body else []))
    fwd_plan = partition(
        fwd_times[:fused_start],
        layer_bytes[:fused_start],
        min_stages - 1,
        upper_threshold,
        p.fwd_mem_cap,
        slowest=slowest,
    )
    return fwd_plan, bwd_plan


def checkpoint_bytes(bwd_plan: Sequence[range], a: ActivationCosts, fused: bool) -> float:
    """Host bytes of a backward plan's input checkpoints: every stage's but the first layer's (the model
    input is on the host anyway) and, for a fused run, the fused stage's (handed over on the device)."""
    groups = list(bwd_plan[:-1]) if fused and bwd_plan else list(bwd_plan)
    return float(sum(a.checkpoint[r.start] for r in groups if r.start > 0))


def fits_budgets(bwd_plan: Sequence[range], a: ActivationCosts, fused: bool, sizes: Sequence[float]) -> bool:
    """Whether every backward stage fits the GPU activation budget and the checkpoints the host one."""
    return all(a.stage_bytes(r.start, r.stop, sizes) <= a.gpu_limit * (1 + _REL_TOL) for r in bwd_plan) and (
        checkpoint_bytes(bwd_plan, a, fused) <= a.host_limit * (1 + _REL_TOL)
    )


def _check_activations(a: ActivationCosts, n: int) -> None:
    for name in ("kept", "peak", "checkpoint"):
        _check_costs(f"activations.{name}", getattr(a, name), n)
    if not (a.gpu_limit >= 0 and a.host_limit >= 0):
        raise ValueError(f"plan_stages: activation limits must be >= 0, got gpu {a.gpu_limit}, host {a.host_limit}")


def _plan_with_activations(p: _Problem, a: ActivationCosts) -> Tuple[List[range], List[range]]:
    """``plan_stages`` for a training call whose activations are budgeted (see ``ActivationCosts``).

    The backward plan: the time-balanced plan when its stages fit the GPU budget and its checkpoints
    the host budget; under host pressure the fewest stages the GPU budget allows, cut so their
    checkpoints fit (groups may then exceed the time cap). For 'fused' the last stage is the fused
    one, whose input is handed over on the device (no checkpoint). The forward plan is cut as without
    activations (forward jobs keep no graph).
    """
    n = len(p.fwd_times)
    if any(a.peak[i] > a.gpu_limit for i in range(n)):
        raise _activation_error("a layer alone does not fit", a, n)
    bwd = _activation_partition(p.layer_bytes, p.mem_cap, a, n, p.run_type == "fused")
    p = dataclasses.replace(p, fwd_cap=forward_weight_cap(a, p.layer_bytes, bwd, p.mem_cap))
    settled = _settled_forward(p, bwd)
    if settled is not None:
        return settled
    start = bwd[-1].start
    fwd = partition(p.fwd_times[:start], p.layer_bytes[:start], p.min_stages - 1, p.upper_threshold, p.fwd_mem_cap)
    return fwd, bwd


def _activation_error(what: str, a: ActivationCosts, n: int) -> ActivationMemoryError:
    """The error of a plan whose stages cannot hold their activations, naming the layer that needs the most."""
    worst = max(range(n), key=lambda i: a.peak[i])
    return ActivationMemoryError(
        f"{what} in {a.gpu_limit / GiB:.1f} GiB of device memory for activations "
        f"(layer {worst} needs {a.peak[worst] / GiB:.1f} GiB alone)",
        a.peak[worst],
        0.0,
    )


def _activation_partition(
    sizes: Sequence[float], mem_cap: float, a: ActivationCosts, n: int, last_free: bool
) -> List[range]:
    """Contiguous backward groups of all ``n`` layers under the weight cap and the GPU activation budget
    whose checkpoints fit the host budget, as many groups as possible (smaller stages keep less on the
    device): a dynamic program over (groups, end) of the fewest checkpoint bytes, exact for contiguous
    groups. Among plans of equal checkpoint bytes (equal inputs, as at long context, make most of them equal)
    it takes one whose largest stage keeps the fewest activation bytes: exact too, since every plan of the
    fewest bytes extends a prefix of the fewest. An arbitrary one may put many layers in one stage, whose
    recompute then takes the device room the backward-stage inputs would have had (``budget.device_saved_room``).
    Raises ``ActivationMemoryError`` when no such plan exists."""
    s_prefix = prefix(sizes)
    k_prefix = prefix(a.kept)
    extra = [float(a.peak[i]) - float(a.kept[i]) for i in range(n)]
    gpu_lim = a.gpu_limit * (1 + _REL_TOL)
    w_lim = mem_cap * (1 + _REL_TOL)
    largest = float(max(sizes, default=0.0))
    # starts[j]: the group starts i such that [i, j) fits, nearest first, with the stage's GPU bytes.
    starts: List[List[Tuple[int, float]]] = [[] for _ in range(n + 1)]
    for j in range(1, n + 1):
        worst = -math.inf
        for i in range(j - 1, -1, -1):
            worst = max(worst, extra[i])
            weights = s_prefix[j] - s_prefix[i]
            stage = k_prefix[j] - k_prefix[i] + worst + stage_weight_excess(weights, largest)
            if weights > w_lim or stage > gpu_lim:
                break  # longer groups ending at j only grow
            starts[j].append((i, stage))
    if not starts[n] or any(not starts[j] for j in range(1, n + 1)):
        raise _activation_error("no backward stage plan fits", a, n)

    def add(i: int, j: int) -> float:
        return 0.0 if i == 0 or (j == n and last_free) else float(a.checkpoint[i])

    INF = math.inf
    # best[k][j]: fewest checkpoint bytes covering layers [0, j) with k groups, then the fewest bytes of its
    # largest stage (compared within the planner's tolerance, so float sums of equal inputs tie); back[k][j]:
    # its last start.
    best: List[List[Tuple[float, float]]] = [[(INF, INF)] * (n + 1) for _ in range(n + 1)]
    back = [[-1] * (n + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n + 1):
        for j in range(k, n + 1):
            for i, stage in starts[j]:
                prev_c, prev_m = best[k - 1][i]
                c, m = prev_c + add(i, j), max(prev_m, stage)
                best_c, best_m = best[k][j]
                if c < best_c * (1 - _REL_TOL) or (c <= best_c * (1 + _REL_TOL) and m < best_m):
                    best[k][j], back[k][j] = (c, m), i
    cost = [best[k][n][0] for k in range(n + 1)]  # cost[k]: fewest checkpoint bytes of all n layers in k groups
    feasible = [k for k in range(1, n + 1) if cost[k] <= a.host_limit * (1 + _REL_TOL)]
    if not feasible:
        fewest = min(cost[1:])
        k_min = min(range(1, n + 1), key=lambda k: cost[k])
        plan = _backtrack(back, k_min, n)
        gpu = max(a.stage_bytes(r.start, r.stop, sizes) for r in plan)
        raise ActivationMemoryError(
            f"the backward stages' input checkpoints need at least {fewest / GiB:.1f} GiB of host memory "
            f"(with stages of up to {max(len(r) for r in plan)} layers, which need {gpu / GiB:.1f} GiB of "
            "device memory); "
            f"{a.host_limit / GiB:.1f} GiB are available",
            gpu,
            fewest,
        )
    return _backtrack(back, max(feasible), n)


def _backtrack(back: List[List[int]], k: int, n: int) -> List[range]:
    plan: List[range] = []
    j = n
    while k > 0:
        i = back[k][j]
        plan.append(range(i, j))
        j, k = i, k - 1
    return plan[::-1]


def validate_plan(fwd_plan: Sequence[range], bwd_plan: Sequence[range], num_layers: int, run_type: RunType) -> None:
    """Check that a (possibly hand-written) plan can run; raise ValueError naming the offending layers.

    Rules: every entry is a non-empty ``range`` with step 1 inside ``[0, num_layers)``; groups are listed
    in layer order without gaps or overlaps. 'infer' needs the forward plan to cover all layers (the
    backward plan is not used and not checked). 'train' needs both plans to cover all layers. 'fused'
    needs the backward plan to cover all layers and the forward plan to cover exactly the layers before
    the last backward group, which runs forward + loss + backward in one step.
    """
    if run_type not in ("infer", "train", "fused"):
        raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
    if run_type == "infer":
        _check_cover("fwd_plan", fwd_plan, num_layers, num_layers)
        return
    _check_cover("bwd_plan", bwd_plan, num_layers, num_layers)
    if run_type == "train":
        _check_cover("fwd_plan", fwd_plan, num_layers, num_layers)
        return
    fused = bwd_plan[-1]
    _check_cover(
        "fwd_plan",
        fwd_plan,
        fused.start,
        num_layers,
        why=f"the last backward group {fused} runs forward + loss + backward in one step (fused run)",
    )


# ---------------------------------------------------------------------------------------------------------
# Partitioning


def _check_costs(name: str, values: Sequence[float], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"plan_stages: {name} has {len(values)} entries, expected one per layer ({n})")
    for i, v in enumerate(values):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"plan_stages: {name}[{i}] = {v}; costs must be finite and >= 0")


def _layer_too_big_message(layer: int, size: float, memory_limit_bytes: float, run_type: RunType) -> str:
    what = "parameters" if run_type == "infer" else "parameters and gradients"
    return (
        f"layer {layer} needs {size / GiB:.2f} GiB on the device ({what}), more than a stage may use: "
        f"{memory_limit_bytes / 2 / GiB:.2f} GiB, half of the model memory limit of "
        f"{memory_limit_bytes / GiB:.2f} GiB (the current and the prefetched stage are resident at once). "
        f"Planning with the limit raised to {2 * size / GiB:.2f} GiB. If the device runs out of memory: "
        f"split layer {layer} into smaller layers, use a device with more memory, or pass "
        f"model_memory_limit (in GB) to ModelExecutePlan.auto(...) to plan for the memory there is."
    )


def _layers(start: int, stop: int) -> str:
    """Name the layers [start, stop) for a message."""
    return f"layer {start}" if stop - start == 1 else f"layers {start}..{stop - 1}"


def _check_cover(name: str, plan: Sequence[range], stop: int, num_layers: int, why: str = "") -> None:
    """Check that ``plan`` lists non-empty ranges covering [0, stop) exactly once, in order. ``why``
    explains ``stop`` in messages when it is not the number of layers."""
    must = f"; {name} must cover exactly layers [0, {stop}) because {why}" if why else ""
    if not isinstance(plan, (list, tuple)):
        raise ValueError(f"{name} must be a list of ranges, got {type(plan).__name__}")
    for i, r in enumerate(plan):
        if not isinstance(r, range):
            raise ValueError(
                f"{name}[{i}] is {r!r} ({type(r).__name__}); each group must be a range of layers, e.g. range(0, 4)"
            )
        if r.step != 1:
            raise ValueError(f"{name}[{i}] = {r} has step {r.step}; groups must be contiguous (step 1)")
        if len(r) == 0:
            raise ValueError(f"{name}[{i}] = {r} is empty; every group needs at least one layer")
        if r.start < 0 or r.stop > num_layers:
            bad = range(r.start, 0) if r.start < 0 else range(num_layers, r.stop)
            raise ValueError(
                f"{name}[{i}] = {r}: {_layers(bad.start, bad.stop)} out of range; the model has {num_layers} "
                f"layers (0..{num_layers - 1})"
            )
    for i in range(1, len(plan)):
        prev, cur = plan[i - 1], plan[i]
        if cur.start < prev.start:
            raise ValueError(
                f"{name}: groups out of order: {name}[{i - 1}] = {prev} comes before {name}[{i}] = {cur}; list "
                "groups in layer order"
            )
    covered = 0
    for i, r in enumerate(plan):
        if r.start > covered:
            raise ValueError(f"{name}: {_layers(covered, r.start)} not covered (gap before {name}[{i}] = {r})")
        if r.start < covered:
            raise ValueError(
                f"{name}: {_layers(r.start, min(r.stop, covered))} covered twice ({name}[{i}] = {r} overlaps "
                f"{name}[{i - 1}] = {plan[i - 1]})"
            )
        covered = r.stop
    if covered > stop:
        raise ValueError(f"{name}: {_layers(stop, covered)} must not be in {name}{must}")
    if covered < stop:
        ends = f"the plan ends at layer {covered - 1}" if plan else "the plan is empty"
        raise ValueError(f"{name}: {_layers(covered, stop)} not covered ({ends}){must}")
