"""The ``grad_sync`` of a data-parallel RoundPipe model: :class:`DataParallel`, the facade over the
host reduction (``host_reduce``) and, with ``reduce_on="device"``, the device reduction
(``device_reduce``). It implements :class:`roundpipe.runtime.grad_sync.GradSync`, the only interface the core
calls, and adds the user's calls (``normalize_by``, ``stats``, ``close``)."""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

import torch
from torch import nn

from roundpipe.distributed.device_reduce import DeviceReduction, roundpipes_of
from roundpipe.distributed.host_reduce import HostReduction
from roundpipe.distributed.optim_shard import OptimizerShard
from roundpipe.distributed.reduction import (
    DataParallelStats,
    ReduceOptions,
    StatsCounter,
)
from roundpipe.host import optim_thread
from roundpipe.planning.plan import ModelExecutePlan, RunType
from roundpipe.roundpipe import RoundPipeBase
from roundpipe.runtime.grad_sync import LayerReducer


class DataParallel:
    """The ``grad_sync`` of a data-parallel RoundPipe model (built by ``enable_data_parallel``).

    ``reduce_on == "host"``: per optimizer step, on the optimizer thread, the units' host gradients are
    all-reduced with gloo in buckets, unit by unit as the step kernel hands them over, overlapping the
    copy of each unit into the optimizer's masters with the reduction of later buckets
    (:class:`~roundpipe.distributed.host_reduce.HostReduction` says how every rank issues the same
    collectives).

    ``reduce_on == "device"``: the gradients of the layers run by RoundPipe are reduced on the devices
    during the backward (:class:`~roundpipe.distributed.device_reduce.DeviceReduction`, reached through
    :meth:`layer_reducer` and :meth:`agree_plan`); at the step the host reduction only settles which
    parameters have a gradient anywhere, checks that every rank reduced the same layers in the same
    order, and reduces the remaining units (an ``AutoRoundPipe``'s host parameters).

    Overlap (host): with ``model.step(..., is_async=True)`` the whole reduction runs while the devices
    compute the next iteration's forward (its backward waits for the last layer's gradients to be
    copied). The reduction does not start during the backward itself: the backward returns before
    ``step()`` can be called, shared-parameter gradients are only complete at its end, and with gradient
    accumulation only the last backward before a step should be reduced; see docs/multi-node.md.

    Attributes:
        model: The data-parallel model.
        group: The host reduction's gloo group (optimizer thread only).
        options: Bucket size, op, reduction dtype, buckets in flight.
        stats: The reduction's counters (:class:`DataParallelStats`).
        reduce_on: ``"host"`` or ``"device"`` (what ``enable_data_parallel``'s ``reduce_on`` resolved to).
        step_sync: With ``shard_optimizer=True``, this rank's share of the host optimizer step
            (:class:`~roundpipe.distributed.optim_shard.OptimizerShard`), else None.
    """

    def __init__(
        self,
        model: RoundPipeBase,
        group: Any,
        bucket_mb: float = 25.0,
        op: Literal["mean", "sum"] = "mean",
        reduce_dtype: Optional[torch.dtype] = None,
        max_in_flight: int = 2,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be positive")
        if op not in ("mean", "sum"):
            raise ValueError(f"op={op!r}: expected 'mean' or 'sum'")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: must be at least 1")
        self.model = model
        self.group = group
        self.options = ReduceOptions(int(bucket_mb * 2**20), op, reduce_dtype, max_in_flight)
        self.counter = StatsCounter()
        self.stats: DataParallelStats = self.counter.stats
        self.host = HostReduction(model, group, self.options, self.counter)
        self.rank, self.world_size, self.global_rank = self.host.rank, self.host.world_size, self.host.global_rank
        # Where the layers' gradients are reduced; the device part is attached by enable_data_parallel.
        self.reduce_on: Literal["host", "device"] = "host"
        # The sharded host optimizer step (roundpipe.runtime.grad_sync.StepSync), attached by enable_data_parallel.
        self.step_sync: Optional[OptimizerShard] = None

    @property
    def device(self) -> Optional[DeviceReduction]:
        """The device reduction (``reduce_on="device"`` with several ranks), else None."""
        return self.host.device

    def attach_device(self, device: DeviceReduction) -> None:
        """Reduce the model's RoundPipe layers on the devices with ``device`` (setup, main thread,
        before training: nothing is in flight)."""
        self.host.device = device
        device.install(roundpipes_of(self.model), self, self.model.name)

    # ---- public ------------------------------------------------------------------------------------
    def normalize_by(self, count: float) -> None:
        """Weight this rank's gradients by ``count / (sum of all ranks' counts)`` in the next step
        instead of ``1/W``.

        For losses that are a *local* mean (``train_step`` divides by this rank's token count; the CLI
        by its step's token count): ``sum_r (n_r/N) * (S_r/n_r) = (sum_r S_r) / N``, the mean over all
        ranks' tokens, which is exactly the one-process loss of the concatenated batch even when the
        ranks count different numbers of tokens (padding, loss masks, uneven shards). With equal counts
        it changes nothing (``n/N = 1/W``).

        Call it on every rank, once per step, before the step's first forward/backward: that order
        works with both ``reduce_on`` modes. With ``reduce_on="host"`` it may also come later, up to
        ``model.step``: the counts are all-reduced on the optimizer thread inside the step's metadata
        collective (queued on the optimizer stream now, it applies to the next step kernel whatever the
        asynchronous step is still doing). With ``reduce_on="device"`` the weight multiplies this
        rank's gradients on the device before they are reduced in the backward, so the counts are
        exchanged now (main thread); called after the step's backward it raises
        :class:`DataParallelError` on every rank, unless all counts are equal (then the default weight
        already applied is the right one).
        """
        count = float(count)
        if not count >= 0:
            raise ValueError(f"normalize_by({count}): the count must be >= 0")
        if self.device is not None:
            self.device.normalize_by(count)
            return
        optim_thread.submit(self.host.set_count, count)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
        """``optimizer.state_dict()`` complete for a checkpoint. With ``shard_optimizer=True`` each rank
        holds the moments of its own units only: this gathers them onto the first rank of each host
        (global rank 0 among them) and returns None on the others; call it on every rank, between steps
        (after ``model.synchronize()``). Without sharding, ``optimizer.state_dict()`` on every rank.
        Loading the result on every rank resumes exactly: a sharded step drops the moments it does not own."""
        if self.step_sync is None:
            return optimizer.state_dict()
        return self.step_sync.full_state_dict(optimizer)

    def close(self) -> None:
        """Stop reducing (the model trains locally again). Call on every rank after ``model.synchronize()``.
        A sharded step's masters become private copies again; the moments of units other ranks owned
        are not on this rank (gather them first with :meth:`full_optimizer_state_dict` if needed)."""
        if self.step_sync is not None:
            optim_thread.synchronize()
            self.step_sync.unshare()
            self.step_sync = None
        device = self.host.device
        if device is not None:
            device.uninstall(self.model)
            self.host.device = None
        if self.model.grad_sync is self:
            self.model.grad_sync = None

    # ---- roundpipe.runtime.grad_sync.GradSync ----------------------------------------------------------------
    def on_step_launch(self) -> None:
        """Main-thread hook of ``model.step`` (``RoundPipeBase.step``): the step boundary. The device
        reduction starts a new step here (default weight again, ``normalize_by`` allowed again)."""
        if self.device is not None:
            self.device.on_step_launch()

    def reduce_host(self, params: List[nn.Parameter]) -> None:
        """Optimizer thread, once for each unit of a step: reduce the unit's host gradients."""
        self.host.reduce_unit(params)

    def agree_plan(self, model: Any, run_type: RunType, plan: ModelExecutePlan) -> ModelExecutePlan:
        """Main thread, before a call: with the device reduction, the plan every rank runs (rank 0's)."""
        if self.device is None:
            return plan
        return self.device.agree_plan(model, run_type, plan)

    def layer_reducer(self, model: Any, layer_id: int) -> Optional[LayerReducer]:
        """Main thread: the device reduction of ``model``'s layer, if reduced there."""
        return None if self.device is None else self.device.layer_reducer(model, layer_id)
