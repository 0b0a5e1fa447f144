"""Each rank's share of a global batch: contiguous blocks of rows, in rank order.

Contiguous blocks (not strides): concatenating the ranks' blocks in rank order gives back the global
batch, which is what makes a W-rank step equal a one-process step on that batch. A model reducing on
the devices needs every rank in every training call, so while one is live (it registers here) a batch
with fewer rows than ranks is refused.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from roundpipe.distributed.collectives import get_rank, get_world_size
from roundpipe.distributed.errors import DataParallelError

# Live reduce_on="device" reductions of this process: key -> model name (for the error message). Written
# by the main thread (enable_data_parallel, DataParallel.close), read by shard on the main thread.
_device_reductions: Dict[int, str] = {}


def register_device_reduction(key: int, model_name: str) -> None:
    """A device reduction of ``model_name`` is live: from now on every rank needs a row (see :func:`shard`)."""
    _device_reductions[key] = model_name


def unregister_device_reduction(key: int) -> None:
    """The device reduction registered under ``key`` is gone (a no-op if it never was)."""
    _device_reductions.pop(key, None)


def shard_bounds(n: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """``[start, stop)`` of rank's contiguous block of ``n`` items: ``[r*n//W, (r+1)*n//W)``.

    Contiguous blocks (not strides): concatenating the ranks' blocks in rank order gives back the
    global batch, which is what makes a W-rank step equal a one-process step on that batch.
    """
    r = get_rank() if rank is None else rank
    w = get_world_size() if world_size is None else world_size
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in 0..{w - 1}")
    return r * n // w, (r + 1) * n // w


def _check_rows(n: int, world_size: Optional[int]) -> None:
    """Device reduction: every rank needs at least one row (see :func:`shard`)."""
    w = get_world_size() if world_size is None else world_size
    if _device_reductions and n < w:
        names = ", ".join(repr(v) for v in _device_reductions.values())
        empty = [r for r in range(w) if shard_bounds(n, r, w)[0] == shard_bounds(n, r, w)[1]]
        raise DataParallelError(
            f"shard: a batch of {n} rows for {w} ranks leaves rank(s) {empty} without rows; with "
            f"reduce_on='device' (model {names}) every rank must run every training call, so every rank needs "
            "at least one "
            "row: use a global batch of at least one row per rank, or reduce_on='host' (then skip the call on "
            "an empty share)"
        )


def shard(data: Any, rank: Optional[int] = None, world_size: Optional[int] = None) -> Any:
    """This rank's contiguous share (see :func:`shard_bounds`) of ``data`` along its first dimension.

    ``int n`` -> ``range`` of indices; tensor, list, range or array -> slice; ``Mapping`` -> the same keys
    with each value sharded; ``tuple`` -> each element sharded (a batch such as ``(input_ids, labels)``);
    ``None`` -> ``None``.
    Shares differ by at most one item when ``len`` is not divisible by the world size; then normalise
    the loss by the global count (``DataParallel.normalize_by``) for an exact global mean.

    With a model reducing on the devices (``reduce_on="device"``) every rank must run every training
    call, so a batch with fewer rows than ranks raises :class:`DataParallelError` here, on every rank
    (all compute the same bounds), instead of failing later on one rank only.
    """
    if data is None:
        return None  # an absent field of a batch (e.g. attention_mask=None) stays absent
    if isinstance(data, bool):
        raise TypeError("shard: expected a count, sequence, tensor, mapping or tuple, got a bool")
    if isinstance(data, int):
        return range(*shard_bounds(data, rank, world_size))
    if isinstance(data, Mapping):
        return type(data)({k: shard(v, rank, world_size) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and not isinstance(data, str):
        return tuple(shard(v, rank, world_size) for v in data)
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ValueError("shard: a 0-dim tensor has no rows to split")
        _check_rows(data.shape[0], world_size)
        a, b = shard_bounds(data.shape[0], rank, world_size)
        return data[a:b]
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (str, bytes)):
        _check_rows(len(data), world_size)
        a, b = shard_bounds(len(data), rank, world_size)
        return data[a:b]
    raise TypeError(f"shard: cannot split a {type(data).__name__}")
