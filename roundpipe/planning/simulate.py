"""What one call costs under RoundPipe's dispatch: a model of the pipeline from per-layer times and the
host's costs, used by the planner to choose among plans (``ModelExecutePlan.auto``) and by the
benchmarks to predict machines not at hand (docs/benchmarks.md, eight GPUs).

The jobs of a call (forward groups, the fused group in parts, backward groups in reverse) go to the
devices in dispatch order (``assign``, default round robin: job k on device k mod N). For each job and
microbatch the model follows three resources:

* the device thread, which issues the microbatch after its producer issued it, spending
  ``HostCosts.job_ms`` of host time that all device threads share (the interpreter lock: one thread
  runs Python at a time);
* the device, which computes once the microbatch is issued, its input has arrived (``handoff_ms``
  after the producer finished, when the producer ran on another device) and its previous work is
  done;
* on CPU workers (``serial_compute``) one compute lock: the issuing thread computes, one at a time.

With no host costs this is the pure compute pipeline: with one device the sum of all costs, with
several the waits that a slow job imposes on the jobs after it, and the pipeline's fill and drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Sequence, Tuple

from roundpipe.planning.fused_split import part_microbatches

RunType = Literal["infer", "train", "fused"]


@dataclass(frozen=True)
class HostCosts:
    """What the host adds to every job, in the unit of the layer times (ms)."""

    job_ms: float = 0.0
    """Host time per job and microbatch (Python bookkeeping, copies issued, graph replays), taken by
    one device thread at a time."""
    layer_ms: float = 0.0
    """Host time per job and layer of its group (the upload, the device copies of the layer, the
    gradient download), paid once per job, before its first microbatch."""
    handoff_ms: float = 0.0
    """Time for a microbatch's activation (or gradient) to reach a job on another device: through
    pinned host memory (down and up), or a peer copy."""
    serial_compute: bool = False
    """CPU workers: compute runs on the issuing thread, one worker at a time (the compute lock)."""


def round_robin(n_jobs: int, num_devices: int) -> List[int]:
    """Round robin from position 0 (``roundpipe.devices.dispatch.RoundRobin``): job k on device k mod N."""
    return [k % num_devices for k in range(n_jobs)]


Job = Tuple[float, Sequence[int], int]  # (cost per microbatch, its microbatches, its layer count)


def call_jobs(
    run_type: RunType,
    fwd_plan: Sequence[range],
    bwd_plan: Sequence[range],
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    num_microbatch: int,
    fused_parts: int = 1,
) -> List[Job]:
    """A call's jobs in dispatch order: (cost per microbatch, the microbatches it runs, its layers). The
    last backward group (the fused group for 'fused', the first backward job for 'train') runs in
    ``fused_parts`` jobs, each taking every ``fused_parts``-th microbatch as the runtime's parts do
    (``fused_split.part_microbatches``)."""
    every = range(max(1, num_microbatch))
    jobs: List[Job] = [(math.fsum(fwd_times[i] for i in r), every, len(r)) for r in fwd_plan]
    if run_type in ("fused", "train") and bwd_plan:
        top = bwd_plan[-1]
        cost = math.fsum(bwd_times[i] for i in top)  # fused: forward + loss + backward
        parts = max(1, fused_parts)
        jobs += [(cost, part_microbatches(j, parts, len(every)), len(top)) for j in range(parts)]
        jobs += [(math.fsum(bwd_times[i] for i in r), every, len(r)) for r in reversed(bwd_plan[:-1])]
    return jobs


def simulate_iteration(
    run_type: RunType,
    fwd_plan: Sequence[range],
    bwd_plan: Sequence[range],
    fwd_times: Sequence[float],
    bwd_times: Sequence[float],
    num_devices: int,
    num_microbatch: int,
    fused_parts: int = 1,
    host: HostCosts = HostCosts(),
    assign: Optional[Callable[[int, int], List[int]]] = None,
) -> float:
    """Time of one call (see the module docstring): when the last device finishes.

    ``fwd_times`` / ``bwd_times``: per layer and microbatch (``bwd`` = recompute + backward; for the
    fused group forward + loss + backward). ``assign``: the dispatch policy, ``(jobs, devices) ->
    device of each job`` (default ``round_robin``; the runtime passes its ``DispatchPolicy``'s
    ``devices_for``, see ``plan_choice``)."""
    jobs = call_jobs(run_type, fwd_plan, bwd_plan, fwd_times, bwd_times, num_microbatch, fused_parts)
    n_dev = max(1, num_devices)
    devices = (assign or round_robin)(len(jobs), n_dev)
    n_mb = max(1, num_microbatch)
    device_free = [0.0] * n_dev
    thread_free = [0.0] * n_dev
    host_free = 0.0
    lock_free = 0.0
    ready = [0.0] * n_mb  # when the previous job finished computing each microbatch
    issued = [0.0] * n_mb  # when the previous job issued it (its tracker event)
    where: List[Optional[int]] = [None] * n_mb
    for (cost, mbs, n_layers), d in zip(jobs, devices):
        # The job's own host work (uploads, device copies of its layers) before its first microbatch.
        start_job = max(thread_free[d], host_free)
        host_free = thread_free[d] = start_job + host.layer_ms * n_layers
        for m in mbs:
            start_issue = max(thread_free[d], host_free, issued[m])
            host_free = thread_free[d] = start_issue + host.job_ms
            hop = host.handoff_ms if where[m] is not None and where[m] != d else 0.0
            start = max(device_free[d], host_free, ready[m] + hop)
            if host.serial_compute:
                start = max(start, lock_free)
            end = start + cost
            if host.serial_compute:
                lock_free = thread_free[d] = end
            device_free[d] = ready[m] = end
            issued[m] = host_free
            where[m] = d
    return max(device_free)
