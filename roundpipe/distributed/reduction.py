"""What the host and the device gradient reductions share: where to reduce, the options of a
reduction (bucket size, op, dtype) and its statistics, which both the optimizer thread and the device
threads update."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Literal, Optional, Tuple

import torch
import torch.distributed as dist

ReduceOn = Literal["auto", "host", "device"]


def group_ranks(group: Any) -> Tuple[int, int, int]:
    """(this rank in ``group``, the group's size, this rank in the default group): what a reduction names
    itself by in its errors and weights its share with."""
    return dist.get_rank(group), dist.get_world_size(group), dist.get_rank()


@dataclass(frozen=True)
class ReduceOptions:
    """How gradients are reduced (``enable_data_parallel``'s arguments, checked there).

    Attributes:
        bucket_bytes: Target size of one collective: small gradients are packed up to it.
        op: ``"mean"`` (each rank's share weighted 1/W) or ``"sum"`` (weight 1).
        reduce_dtype: Reduce in this dtype; None: the gradients' own.
        max_in_flight: Host reduction: buckets in flight at once.
    """

    bucket_bytes: int
    op: Literal["mean", "sum"] = "mean"
    reduce_dtype: Optional[torch.dtype] = None
    max_in_flight: int = 2

    def default_weight(self, world_size: int) -> float:
        """The weight of each rank's gradients when ``normalize_by`` was not called for a step."""
        return 1.0 / world_size if self.op == "mean" else 1.0


@dataclass
class DataParallelStats:
    """Counters of the gradient reduction (read them after ``synchronize()``).

    Attributes:
        steps: Optimizer steps reduced.
        collectives: Collectives issued (metadata, order checks and device reductions included).
        bytes: Gradient bytes all-reduced (this rank's input size).
        comm_s: Host time blocked in collectives: the optimizer thread's (host reduction, setup and
            packing included) plus, on CPU workers, the device threads' (device reduction).
        last_step_s: Host reduction: wall time of the last step's reduction, first to last unit
            (waiting for the slowest rank included). Device reduction: the sum over the last step's
            layer reductions of their time on the device, from this rank's gradients being ready to
            the reduced result (waiting for the other ranks included; layers on different devices
            overlap, so this can exceed the wall time).
        history: ``last_step_s`` of the recent steps (the last 4096).
    """

    steps: int = 0
    collectives: int = 0
    bytes: int = 0
    comm_s: float = 0.0
    last_step_s: float = 0.0
    history: Deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class StatsCounter:
    """A :class:`DataParallelStats` updated under one lock: the optimizer thread (host reduction, the
    step's checks) and the device threads (device reduction, during the next backward when the step is
    asynchronous) count into it concurrently."""

    def __init__(self) -> None:
        self.stats = DataParallelStats()
        self.lock = threading.Lock()

    def count(self, collectives: int = 0, nbytes: int = 0, comm_s: float = 0.0) -> None:
        """Add collectives issued, bytes reduced and host seconds spent in them."""
        with self.lock:
            self.stats.collectives += collectives
            self.stats.bytes += nbytes
            self.stats.comm_s += comm_s

    def end_step(self, seconds: float) -> None:
        """One more step reduced, whose reduction took ``seconds`` (see ``last_step_s``)."""
        with self.lock:
            self.stats.steps += 1
            self.stats.last_step_s = seconds
            self.stats.history.append(seconds)
