"""How the fused forward-backward job splits over the devices: how many parts, and which microbatches
each part runs.

On several devices the fused group (the last layers and the loss head) runs in parts, one per device:
part j runs every K-th microbatch, part 0 ending on the call's last one. The planner's model of a call
(``roundpipe.planning.simulate``) and the runtime's jobs (``roundpipe.runtime.jobs``) both need that rule;
the gradient hand-over between the parts is the runtime's (``roundpipe.runtime.partial_grads``).
"""

from __future__ import annotations

from roundpipe import settings
from roundpipe.devices import backend, threads
from roundpipe.devices import device as device_mod


def part_microbatches(part: int, parts: int, num_microbatch: int) -> range:
    """The microbatches part ``part`` of ``parts`` runs, in order: every ``parts``-th, part 0 ending on the
    last one (8 microbatches in 4 parts: part 0 runs 3 and 7, part 3 runs 0 and 4)."""
    return range((num_microbatch - 1 - part) % parts, num_microbatch, parts)


def part_of(m: int, parts: int, num_microbatch: int) -> int:
    """The part that runs microbatch ``m`` (the inverse of :func:`part_microbatches`)."""
    return (num_microbatch - 1 - m) % parts


def split_enabled() -> bool:
    """Whether the fused job may be split over the devices (``RPP_DEBUG_SPLIT_FUSED``). ``auto``: where the
    devices compute at once (GPUs; CPU workers in the stress mode). CPU workers otherwise compute one
    at a time, and a split only adds each part's uploads and hand-overs (bench/job_cost.py: 4 workers
    167 us per job split, 79 us whole)."""
    mode = settings.DEBUG_SPLIT_FUSED.get()
    if mode != "auto":
        return mode == "1"
    return any(backend.is_cuda(d.device) for d in device_mod.get_devices()) or threads.stress_limit() > 0


def split_parts(num_devices: int, num_microbatch: int, has_buffers: bool, enabled: bool) -> int:
    """How many parts the fused job runs in: one per device (at most one per microbatch) when enabled
    and there are several devices; one when the fused group has buffers (a forward may update them,
    e.g. running statistics, and only one device's update could be kept)."""
    if not enabled or has_buffers or num_devices <= 1:
        return 1
    return max(1, min(num_devices, num_microbatch))


__all__ = ["part_microbatches", "part_of", "split_enabled", "split_parts"]
