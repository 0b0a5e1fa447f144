"""The host gradient reduction (``reduce_on="host"``): a bucketed gloo all-reduce on the optimizer
thread, unit by unit as the step kernel hands the units over (``GradSync.reduce_host``).

It runs after the gradients have landed on the host and before they are copied into the optimizer's
master copies, on a *dedicated* gloo group that only the optimizer thread uses: collectives on one
group must be issued in the same order on every rank, and the main thread (logging, barriers,
checkpoints) could otherwise interleave its collectives differently on different ranks. With a device
reduction it also reduces what the devices did not (an ``AutoRoundPipe``'s host parameters) and runs
the step's device checks first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from roundpipe.distributed.errors import DataParallelError, collective_failure
from roundpipe.distributed.reduction import ReduceOptions, StatsCounter, group_ranks
from roundpipe.host.attribute import LayerAttribute
from roundpipe.roundpipe import RoundPipeBase

if TYPE_CHECKING:
    from roundpipe.distributed.device_reduce import DeviceReduction


@dataclass
class _Bucket:
    """Gradients reduced by one collective: several small ones packed into a flat buffer, or one large
    gradient reduced where it lies (``packed`` False)."""

    index: int
    units: Tuple[int, int]  # lowest and highest unit (layer) whose gradients it holds
    params: List[nn.Parameter]
    dtype: torch.dtype
    numel: int
    packed: bool
    buffer: Optional[torch.Tensor] = None
    work: Any = None


class HostReduction:
    """Per optimizer step, on the optimizer thread, with units (layers) handed over one by one by the
    step kernel (:meth:`reduce_unit`):

    1. At the first unit: wait until every unit's gradient download has landed (the backward is over
       when ``step()`` is called, so this costs nothing), then one small all-reduce of metadata: which
       parameters have a gradient on any rank, and the counts of ``normalize_by``. A parameter
       without ``.grad`` on this rank but with one elsewhere contributes zeros, so every rank issues the
       same collectives with the same sizes; a parameter no rank computed a gradient for keeps
       ``.grad = None`` (the optimizer skips it, exactly as in one process).
    2. The gradients, in the order the kernel visits the units, are cut into buckets of about
       ``bucket_mb``: small gradients are packed into a reusable flat buffer (one collective instead of
       many: a gloo call costs ~0.1-2 ms whatever its size), a gradient larger than a bucket is reduced
       in place. Each rank's share is pre-multiplied by its weight (1/W for a mean) before the SUM.
    3. Up to ``max_in_flight`` buckets are in flight (gloo runs them on its own threads); when the
       kernel reaches unit i, the buckets holding unit i's gradients are waited for and unpacked, so the
       copy of unit i's gradients into the fp32 masters overlaps the reduction of later buckets.

    Units are recognised by their parameters, not by position: the kernel may visit them first to last
    or last to first (the order is inferred from the first unit with parameters; every rank runs the
    same kernel, so every rank infers the same order). The bucket layout depends only on the parameter
    list, that order and the metadata, which are identical on all ranks (checked at setup), never on
    timing, so ranks always agree on the sequence of collectives.

    With a device reduction (``device``), the layers RoundPipe runs were reduced during the backward:
    the first unit then also settles which of their parameters have a gradient anywhere and checks that
    every rank reduced the same layers in the same order (``DeviceReduction.finish_step``); only the
    remaining units are reduced here.

    All state below is the optimizer thread's.
    """

    def __init__(self, model: RoundPipeBase, group: Any, options: ReduceOptions, counter: StatsCounter) -> None:
        self.model = model
        self.group = group
        self.options = options
        self.counter = counter
        self.rank, self.world_size, self.global_rank = group_ranks(group)
        self.device: Optional["DeviceReduction"] = None  # attached by enable_data_parallel
        self._cursor = 0
        self._units: List[Tuple[LayerAttribute, List[nn.Parameter]]] = []
        self._unit_index: Dict[Tuple[int, ...], int] = {}
        self._seen: set = set()
        self._reduced: List[Tuple[int, nn.Parameter]] = []
        self._planned = False
        self._buckets: List[_Bucket] = []
        self._need: Dict[int, int] = {}  # per unit: buckets [0, need) must be done before its grads are copied
        self._issued = 0
        self._done = 0
        self._in_flight: Deque[_Bucket] = deque()
        self._free: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._weight = 1.0
        self._pending_count: Optional[float] = None
        self._pending_weight: Optional[float] = None
        self._broken: Optional[BaseException] = None
        self._t_step = 0.0

    # ---- queued by the main thread (optim_thread.submit), so they apply to the next step kernel ----------
    def set_count(self, count: float) -> None:
        """``normalize_by(count)`` for the next step; its weight comes from the step's metadata collective."""
        if self._pending_count is not None:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by called twice before one model.step")
        self._pending_count = count

    def set_weight(self, weight: float) -> None:
        """Device reduction: this rank's ``normalize_by`` weight, for the units reduced here on the host."""
        self._pending_weight = weight

    # ---- the step kernel ---------------------------------------------------------------------------
    def reduce_unit(self, params: List[nn.Parameter]) -> None:
        """``GradSync.reduce_host``: called once for each unit of a step, on the optimizer thread."""
        if self._broken is not None:
            raise DataParallelError(
                f"rank {self.global_rank}: data parallel stopped after an earlier failure: {self._broken}"
            ) from self._broken
        try:
            if self._cursor == 0:
                self._begin_step()
            t0 = time.perf_counter()
            u = self._identify(params)
            if u is not None:
                if not self._planned:
                    self._plan(first=u)
                self._finish_through(self._need.get(u, 0))
                self._issue_ahead()  # keep the network busy while the kernel copies this unit's gradients
            self._cursor += 1
            if self._cursor == len(self._units):
                self._finish_through(len(self._buckets))
                self._end_step()
            self.counter.count(comm_s=time.perf_counter() - t0)
        except BaseException as exc:
            self._broken = exc
            self._reset_step()
            raise

    def _identify(self, params: List[nn.Parameter]) -> Optional[int]:
        """The unit the kernel hands over, recognised by its parameters (None: a unit without any)."""
        if not params:
            return None  # nothing to reduce or copy
        u = self._unit_index.get(tuple(id(p) for p in params))
        if u is None or u in self._seen or self._cursor >= len(self._units):
            raise DataParallelError(
                f"rank {self.global_rank}: reduce_host called with an unexpected unit (call #{self._cursor} of "
                "the step); "
                "was requires_grad changed during training without model.synchronize()?"
            )
        self._seen.add(u)
        return u

    def _begin_step(self) -> None:
        """Settle the step: which parameters are reduced here, with which weight (one metadata collective)."""
        t0 = time.perf_counter()
        self._t_step = t0
        self._units = self.model.optim_units()
        self._unit_index = {tuple(id(p) for p in ps): u for u, (_, ps) in enumerate(self._units) if ps}
        self._seen = set()
        # Every unit's gradients must be on the host before the metadata says who has which gradient.
        # step() is called after the backward has returned, so these waits return at once.
        for attr, _ in self._units:
            attr.grad_download_started.wait()
            attr.grad_downloaded.synchronize()
        count, self._pending_count = self._pending_count, None
        weight_given, self._pending_weight = self._pending_weight, None
        if self.device is not None:
            # The device layers were reduced during the backward: settle presence, check the order.
            self.device.finish_step(self._units)
            entries = [(u, p) for u, (attr, ps) in enumerate(self._units) if not self.device.reduces(attr) for p in ps]
        else:
            entries = [(u, p) for u, (_, ps) in enumerate(self._units) for p in ps]
        self._reduced, self._buckets, self._need = [], [], {}
        self._issued = self._done = 0
        self._planned = True
        self._weight = 1.0
        # Nothing to exchange with one rank; in device mode, nothing left on the host (identical on all
        # ranks: the units come from the same model everywhere).
        if self.world_size == 1 or (self.device is not None and not entries):
            self.counter.count(comm_s=time.perf_counter() - t0)
            return
        weight, present = self._exchange_metadata(entries, count)
        if self.device is not None:  # normalize_by was handled on the main thread (same weight as the devices)
            weight = weight_given if weight_given is not None else self.device.default_weight
        # Identical on all ranks from here on: the list of reduced parameters and the bucket layout.
        reduced = [(u, p) for (u, p), keep in zip(entries, present) if keep]
        for _, p in reduced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a gradient elsewhere, none here: contribute zeros
        self._weight = weight
        self._reduced = reduced
        self._planned = not reduced
        self.counter.count(comm_s=time.perf_counter() - t0)

    def _exchange_metadata(
        self, entries: List[Tuple[int, nn.Parameter]], count: Optional[float]
    ) -> Tuple[float, List[bool]]:
        """One float64 all-reduce: [normalize_by set?, count, has-grad flag per parameter]."""
        meta = torch.zeros(2 + len(entries), dtype=torch.float64)
        if count is not None:
            meta[0], meta[1] = 1.0, count
        meta[2:] = torch.tensor([p.grad is not None for _, p in entries], dtype=torch.float64)
        units = (min(u for u, _ in entries), max(u for u, _ in entries))
        self._collective(meta, "metadata all_reduce", units).wait()
        users = int(meta[0].item())
        if users not in (0, self.world_size):
            raise DataParallelError(
                f"rank {self.global_rank}: normalize_by was called on {users} of {self.world_size} ranks for "
                "this step; call it on every rank or none"
            )
        if users:
            total = float(meta[1].item())
            if total <= 0:
                raise DataParallelError(
                    f"rank {self.global_rank}: normalize_by counts sum to {total} over all ranks; nothing to average"
                )
            weight = count / total  # type: ignore[operator]
        else:
            weight = self.options.default_weight(self.world_size)
        return weight, [bool(f > 0) for f in meta[2:].tolist()]

    def _plan(self, first: int) -> None:
        """Cut the reduced gradients into buckets in the order the kernel visits the units (inferred
        from ``first``, the first unit with parameters it handed over); record per unit how many
        buckets must be done before its gradients may be copied."""
        with_params = [u for u, (_, ps) in enumerate(self._units) if ps]
        backwards = len(with_params) > 1 and first == with_params[-1]
        # A stable sort keeps each unit's parameters in their order.
        reduced = sorted(self._reduced, key=lambda e: -e[0] if backwards else e[0])
        rd, limit = self.options.reduce_dtype, self.options.bucket_bytes
        buckets: List[_Bucket] = []
        cur: List[Tuple[int, nn.Parameter]] = []
        cur_bytes = 0

        def close() -> None:
            nonlocal cur, cur_bytes
            if cur:
                dtype = rd or cur[0][1].grad.dtype
                us = [u for u, _ in cur]
                buckets.append(
                    _Bucket(
                        len(buckets),
                        (min(us), max(us)),
                        [p for _, p in cur],
                        dtype,
                        sum(p.numel() for _, p in cur),
                        packed=True,
                    )
                )
            cur, cur_bytes = [], 0

        for u, p in reduced:
            g = p.grad
            dtype = rd or g.dtype
            nbytes = g.numel() * dtype.itemsize
            if nbytes >= limit and g.is_contiguous() and dtype == g.dtype:
                close()  # a large gradient is its own bucket, reduced in place (no copy)
                buckets.append(_Bucket(len(buckets), (u, u), [p], dtype, g.numel(), packed=False))
                continue
            if cur and (cur_bytes + nbytes > limit or dtype != (rd or cur[0][1].grad.dtype)):
                close()
            cur.append((u, p))
            cur_bytes += nbytes
        close()
        owner = {id(p): u for u, p in reduced}
        need: Dict[int, int] = {}
        for b in buckets:
            for p in b.params:
                need[owner[id(p)]] = b.index + 1  # buckets are issued and finished in order
        self._buckets, self._need, self._planned = buckets, need, True
        self._issued = self._done = 0

    def _collective(self, t: torch.Tensor, what: str, units: Tuple[int, int]) -> "_Work":
        """Issue an async SUM all-reduce on the data-parallel group; errors name rank and layers."""
        self.counter.count(collectives=1)
        try:
            return _Work(
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                self,
                what,
                units,
                t.numel() * t.element_size(),
            )
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self.error(what, units, t.numel() * t.element_size(), 0.0, exc) from exc

    def error(
        self, what: str, units: Tuple[int, int], nbytes: int, waited: float, exc: BaseException
    ) -> DataParallelError:
        """The error of a failed collective of this reduction, naming rank, layers and size."""
        return collective_failure(
            f"rank {self.global_rank}/{dist.get_world_size()}",
            f"{what} of the gradients of layers {units[0]}-{units[1]} ({nbytes / 2**20:.2f} MiB)",
            waited,
            exc,
        )

    def _issue(self, bucket: _Bucket) -> None:
        """Pack (or take in place) one bucket, weight this rank's share, and start its all-reduce."""
        if bucket.packed:
            pool = self._free.setdefault(bucket.dtype, [])
            buf = (
                pool.pop()
                if pool
                else torch.empty(
                    max(self.options.bucket_bytes // bucket.dtype.itemsize, bucket.numel), dtype=bucket.dtype
                )
            )
            if buf.numel() < bucket.numel:  # only with reduce_dtype and a gradient above the bucket size
                buf = torch.empty(bucket.numel, dtype=bucket.dtype)
            bucket.buffer = buf
            flat, off = buf[: bucket.numel], 0
            for p in bucket.params:
                n = p.grad.numel()
                flat[off : off + n].copy_(p.grad.reshape(-1))
                off += n
            target = flat
        else:
            target = bucket.params[0].grad
        if self._weight != 1.0:
            target.mul_(self._weight)
        bucket.work = self._collective(
            target, f"all_reduce of gradient bucket {bucket.index + 1}/{len(self._buckets)}", bucket.units
        )
        self._in_flight.append(bucket)

    def _finish_oldest(self) -> None:
        """Wait for the oldest bucket in flight and unpack it into the gradients."""
        bucket = self._in_flight.popleft()
        bucket.work.wait()
        self.counter.count(nbytes=bucket.numel * bucket.dtype.itemsize)
        if bucket.packed:
            assert bucket.buffer is not None
            off = 0
            with torch.no_grad():
                for p in bucket.params:
                    n = p.grad.numel()
                    p.grad.copy_(bucket.buffer[off : off + n].view_as(p.grad))
                    off += n
            self._free[bucket.dtype].append(bucket.buffer)
            bucket.buffer = None
        bucket.work = None
        self._done += 1

    def _issue_ahead(self) -> None:
        """Start buckets in order while fewer than ``max_in_flight`` are running."""
        while self._issued < len(self._buckets) and self._issued - self._done < self.options.max_in_flight:
            self._issue(self._buckets[self._issued])
            self._issued += 1

    def _finish_through(self, n: int) -> None:
        """Complete buckets ``[0, n)`` in order, issuing ahead as the window allows."""
        while self._done < n:
            self._issue_ahead()
            self._finish_oldest()

    def _end_step(self) -> None:
        """The step's last unit: account its time and start the next step afresh."""
        assert self._done == len(self._buckets)
        wall = time.perf_counter() - self._t_step
        self.counter.end_step(self.device.last_step_s if self.device is not None else wall)
        self._cursor = 0
        self._units, self._buckets, self._reduced = [], [], []

    def _reset_step(self) -> None:
        """After a failure: drop the step's state (the reduction then refuses further steps)."""
        self._cursor = 0
        self._units, self._buckets, self._reduced, self._need = [], [], [], {}
        self._unit_index, self._seen = {}, set()
        self._in_flight.clear()
        self._issued = self._done = 0


class _Work:
    """An issued collective; ``wait()`` turns a failure or timeout into a :class:`DataParallelError`."""

    def __init__(self, work: Any, owner: HostReduction, what: str, units: Tuple[int, int], nbytes: int) -> None:
        self.work, self.owner, self.what, self.units, self.nbytes = work, owner, what, units, nbytes
        self.t0 = time.perf_counter()

    def wait(self) -> None:
        """Wait for the collective on this (optimizer) thread."""
        try:
            self.work.wait()
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self.owner.error(self.what, self.units, self.nbytes, time.perf_counter() - self.t0, exc) from exc
