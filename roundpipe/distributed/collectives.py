"""Small collectives of the main thread: rank queries, barriers, broadcasting a value, reducing a few
numbers, decisions every rank takes together; all no-ops in a single process.

They use the default group, which the optimizer thread never touches (its gradient reduction has its
own group), so they may run while an asynchronous step is reducing gradients.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Literal, Sequence, TypeVar

import torch
import torch.distributed as dist

from roundpipe.distributed.env import main_timeout_s
from roundpipe.distributed.errors import DataParallelError

T = TypeVar("T")


def get_rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Whether this rank logs, writes metrics and saves checkpoints (rank 0, or a single process)."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (e.g. rank 0 finished writing a checkpoint); a no-op in a single process.

    On gloo a monitored barrier: after the main timeout it names the ranks that never arrived.
    """
    if get_world_size() == 1:
        return
    if "gloo" in str(dist.get_backend()):
        dist.monitored_barrier(timeout=timedelta(seconds=main_timeout_s()), wait_all_ranks=True)
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` of rank ``src`` on every rank (picklable, small: configs, paths, step numbers)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_scalars(values: Sequence[float], op: Literal["sum", "mean", "max", "min"] = "sum") -> List[float]:
    """Reduce a few numbers over the ranks in float64 (losses, token counts for logging)."""
    vals = [float(v) for v in values]
    if get_world_size() == 1:
        return vals
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(
        t,
        op={"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
            op
        ],
    )
    if op == "mean":
        t /= get_world_size()
    return t.tolist()


def any_across_ranks(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: for decisions every rank must take together (skip a step
    with a non-finite loss, stop after this step), since a rank that skips ``model.step`` alone would
    leave the others waiting in the gradient all-reduce."""
    return bool(all_reduce_scalars([1.0 if flag else 0.0], "max")[0])


def assert_same_across_ranks(value: Any, what: str) -> None:
    """Raise on every rank if ``value`` (picklable) differs between ranks, naming the ranks."""
    if get_world_size() == 1:
        return
    gathered: List[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, value)
    if any(v != gathered[0] for v in gathered):
        detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(gathered))
        raise DataParallelError(f"{what} differs between ranks ({detail})")
