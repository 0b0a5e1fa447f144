"""Each GPU's busy share and idle gaps in one profiled iteration (``train_bench.py --profile``): kernel time per
device from a chrome trace, the gaps split into those between layer groups and those inside one."""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch


def cuda_sync() -> None:
    """Wait for every GPU (RoundPipe spreads work over all visible devices)."""
    for d in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.synchronize(d)


# Each GPU's busy time and idle gaps in a profiled iteration, split into gaps between layer groups and gaps
# inside one. RoundPipe marks each job (one layer group over all microbatches) on its device thread with a
# profiler range when RPP_PROFILER=torch. In a chrome trace of a torch.profiler run that records CPU and CUDA
# activity on all threads, each kernel carries the correlation id of the runtime call that launched it, and
# that call lies on the launching thread's timeline, inside the job's range; kernels that autograd's worker
# thread launches during a job's backward get the job running on the GPU's device thread at that moment. So
# every idle gap on a GPU (no kernel running; copies are not compute) falls between two jobs or inside one:
# the first kind is time a GPU waits because one group ended and the next was not ready.

JOB_PREFIX = "roundpipe model "
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class DeviceGaps:
    """One GPU's kernel time and idle gaps in microseconds, from its first kernel to its last.

    A gap counts as between groups when the kernels on either side belong to different jobs, or when
    either kernel could not be given a job (so the split never flatters the planner)."""

    device: int
    busy_us: float
    span_us: float
    between_us: float
    within_us: float
    between_count: int
    within_count: int
    kernels: int
    unattributed: int
    head_us: Optional[float] = None  # with a window: idle from its start to the first kernel
    tail_us: Optional[float] = None  # and from the last kernel to its end

    def describe(self, wall_us: float) -> str:
        """One line: busy share and the two kinds of idle time as shares of ``wall_us`` (the iteration); the
        idle time as one where no kernel could be given a job (no ``RPP_PROFILER=torch``)."""
        idle = self.between_us + self.within_us
        if self.unattributed == self.kernels:
            split = f"idle {idle / 1e3:.1f} ms ({idle / wall_us:.1%}, {self.between_count + self.within_count} gaps)"
        else:
            split = (
                f"idle between layer groups {self.between_us / 1e3:.1f} ms ({self.between_us / wall_us:.1%}, "
                f"{self.between_count} gaps), inside groups {self.within_us / 1e3:.1f} ms "
                f"({self.within_us / wall_us:.1%}, {self.within_count} gaps); "
                f"{self.kernels - self.unattributed}/{self.kernels} kernels attributed to a job"
            )
        edges = (
            ""
            if self.head_us is None or self.tail_us is None
            else f"; idle before the first kernel {self.head_us / 1e3:.1f} ms ({self.head_us / wall_us:.1%}), "
            f"after the last {self.tail_us / 1e3:.1f} ms ({self.tail_us / wall_us:.1%})"
        )
        return f"GPU {self.device}: busy {self.busy_us / wall_us:.1%} of the iteration; {split}{edges}"


def split_gaps(events: Iterable[Dict[str, Any]], job_prefix: str = JOB_PREFIX, window: str = "") -> List[DeviceGaps]:
    """Per GPU, busy time and idle gaps between / inside jobs, from chrome-trace events (``traceEvents``).

    ``window`` names a host range around the profiled iteration (a ``record_function``): then the idle
    time from its start to each GPU's first kernel and from the last kernel to its end is reported too
    (the trace puts host and GPU events on one clock)."""
    span: Optional[Tuple[float, float]] = None
    jobs: Dict[Any, List[Tuple[float, float, str]]] = {}
    launches: Dict[int, Tuple[Any, float]] = {}
    kernels: Dict[int, List[Tuple[float, float, int]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        args = e.get("args") or {}
        if cat == "user_annotation" and window and e.get("name") == window:
            span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith(job_prefix):
            jobs.setdefault(e.get("tid"), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
            )
        elif cat in _LAUNCH_CATEGORIES and "correlation" in args:
            launches[int(args["correlation"])] = (e.get("tid"), float(e["ts"]))
        elif cat == "kernel":
            dev = int(args.get("device", 0))
            kernels.setdefault(dev, []).append(
                (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(args.get("correlation", -1)))
            )
    for ranges in jobs.values():
        ranges.sort()
    starts = {tid: [r[0] for r in ranges] for tid, ranges in jobs.items()}

    def job_at(tid: Any, ts: float) -> Optional[str]:
        if tid not in jobs:
            return None
        i = bisect.bisect_right(starts[tid], ts) - 1
        return jobs[tid][i][2] if i >= 0 and jobs[tid][i][1] >= ts else None

    out = []
    for dev, ks in sorted(kernels.items()):
        ks.sort()
        launch_of = [launches.get(c) for _, _, c in ks]
        owners = [job_at(*launch) if launch is not None else None for launch in launch_of]
        # Backward kernels are launched by autograd's worker thread for the GPU while the device thread
        # waits inside its job; give such a kernel the job running at its launch time on the device
        # threads that launched this GPU's other kernels (only where exactly one such job runs).
        job_tids = {launch[0] for launch, owner in zip(launch_of, owners) if owner is not None and launch is not None}
        for i, (launch, owner) in enumerate(zip(launch_of, owners)):
            if owner is None and launch is not None:
                found = {job for job in (job_at(tid, launch[1]) for tid in job_tids) if job is not None}
                if len(found) == 1:
                    owners[i] = found.pop()
        between = within = 0.0
        n_between = n_within = 0
        busy, end, last_owner = ks[0][1] - ks[0][0], ks[0][1], owners[0]
        for (start, stop, _), owner in zip(ks[1:], owners[1:]):
            if start > end:  # idle from ``end`` to ``start``
                if owner is not None and owner == last_owner:
                    within, n_within = within + start - end, n_within + 1
                else:
                    between, n_between = between + start - end, n_between + 1
                busy, end, last_owner = busy + stop - start, stop, owner
            elif stop > end:
                busy, end, last_owner = busy + stop - end, stop, owner
        head, tail = (ks[0][0] - span[0], span[1] - end) if span is not None else (None, None)
        out.append(
            DeviceGaps(
                dev, busy, end - ks[0][0], between, within, n_between, n_within, len(ks), owners.count(None), head, tail
            )
        )
    return out


ITERATION = "train_bench iteration"
"""The profiler range around the profiled iteration."""


def busy_fraction(step: Callable[[], None], trace: str = "") -> str:
    """Profile one more ``step``: print each GPU's busy share and idle gaps (between and inside layer groups
    with ``RPP_PROFILER=torch``, which costs some host time); write the chrome trace to ``trace`` if set."""
    import json
    import tempfile

    from roundpipe.devices import profile

    by_group = profile.PROFILER_TYPE == "torch"
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True) if by_group else None
    with torch.profiler.profile(activities=acts, experimental_config=config) as prof:
        t0 = time.perf_counter()
        with torch.profiler.record_function(ITERATION):
            step()
            cuda_sync()
        wall = (time.perf_counter() - t0) * 1e6
    path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    opener = __import__("gzip").open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        devices = split_gaps(json.load(f)["traceEvents"], window=ITERATION)
    if not trace:
        os.remove(path)
    for d in devices:
        print(d.describe(wall))
    return f"GPU busy {'/'.join(f'{d.busy_us / wall:.0%}' for d in devices)} of {wall / 1e3:.0f} ms"
