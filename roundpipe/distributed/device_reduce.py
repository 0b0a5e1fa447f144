"""The device gradient reduction (``reduce_on="device"``): each layer's gradients are all-reduced on its
device at the end of its backward job, before the gradient download (NCCL on GPUs, gloo on CPU workers).

``enable_data_parallel(model, reduce_on="device")`` calls :func:`setup_device_reduction`, which creates
the groups (one per local device index, joining device k of every rank) and a :class:`DeviceReduction`;
that gives every layer a reducer through the model's ``grad_sync`` (``roundpipe.runtime.grad_sync``), which
``transfer.download_layer`` calls at the end of each backward job. The comment above
:meth:`DeviceReduction.reduce_layer` explains the streams; ``roundpipe.distributed.device_order``, why
every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from roundpipe.devices import backend
from roundpipe.devices import device as device_mod
from roundpipe.devices.threads import report_failure, thread_exception_print_lock
from roundpipe.distributed.device_order import RUN_CODES, PlanAgreement
from roundpipe.distributed.env import timeout_s
from roundpipe.distributed.errors import (
    DataParallelError,
    collective_failure,
    exception_summary,
    run_collective,
)
from roundpipe.distributed.layer_slot import LayerBucket, LayerSlot, layer_buckets
from roundpipe.distributed.reduction import ReduceOptions, StatsCounter, group_ranks
from roundpipe.distributed.sharding import (
    register_device_reduction,
    unregister_device_reduction,
)
from roundpipe.host import optim_thread
from roundpipe.host.attribute import LayerAttribute
from roundpipe.host.buffers import host_grad
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.roundpipe import RoundPipe, RoundPipeBase
from roundpipe.runtime.grad_sync import GradSync

NCCL_GRACE_S = 30.0  # NCCL groups time out this much later than RPP_DIST_TIMEOUT_S (see CollectiveMonitor)


def _trainable_pairs(cpu_layer: nn.Module, gpu_layer: nn.Module) -> List[Tuple[nn.Parameter, nn.Parameter]]:
    """(host parameter, device copy) of each trainable parameter of a layer, once each, in the order
    ``download_layer`` visits them (same model on every rank: same order)."""
    out: List[Tuple[nn.Parameter, nn.Parameter]] = []
    seen: set = set()
    for host_mod, dev_mod in zip(cpu_layer.modules(), gpu_layer.modules()):
        for name, p in host_mod._parameters.items():
            if p is None or not p.requires_grad or id(p) in seen:
                continue
            dp = dev_mod._parameters.get(name)
            if dp is None:
                continue
            seen.add(id(p))
            out.append((p, dp))
    return out


def _staging_host(values: List[float], dtype: torch.dtype) -> torch.Tensor:
    """A small host tensor to upload (pinned where CUDA is used, so the copy is asynchronous; the
    caching host allocator keeps it until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if backend.pin_enabled() else t


def _add_from_host(dst: torch.Tensor, host: torch.Tensor, chunk_elems: int) -> None:
    """``dst += host`` (``dst`` flat on the device, ``host`` on the host), through a staging buffer of
    at most ``chunk_elems`` so a large gradient needs no full-size temporary. Runs on the current stream:
    each chunk's upload is queued before its add, and the staging buffer is reused only by later work
    on the same stream."""
    src = host.detach().reshape(-1)
    if dst.device.type == "cpu":
        dst.add_(src)
        return
    n = src.numel()
    step = max(1, min(n, chunk_elems))
    stage = torch.empty(step, dtype=src.dtype, device=dst.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        stage[: b - a].copy_(src[a:b], non_blocking=True)
        dst[a:b].add_(stage[: b - a])


class CollectiveMonitor:
    """Names a stalled NCCL collective (CUDA only).

    NCCL collectives never block the host, so a peer that stalls shows as a hang in some later event
    synchronisation, and NCCL's own watchdog only aborts the process after the group timeout without
    saying which layer was being reduced. This thread watches the reductions in issue order: once one
    has been waiting on the device for ``RPP_DIST_TIMEOUT_S`` since this rank's gradients were ready,
    it prints a :class:`DataParallelError` naming rank, collective, layer and device, and records it in
    RoundPipe's failure slot. The NCCL groups' own timeout is longer (``NCCL_GRACE_S`` more), so the
    message comes first; NCCL's watchdog then aborts the communicators and ends the process (no hang).
    """

    def __init__(self, red: "DeviceReduction") -> None:
        self.red = red
        self.pending: Deque[List[Any]] = deque()  # [ready event, done event, what, bytes, first seen ready]
        self.lock = threading.Lock()  # device threads add, the monitor thread pops
        self.fired = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="roundpipe-dp-monitor", daemon=True)
        self.thread.start()

    def add(self, ready: Any, done: Any, what: str, nbytes: int) -> None:
        """Watch a collective: ``ready`` recorded before it, ``done`` after it, on the gradient stream."""
        with self.lock:
            self.pending.append([ready, done, what, nbytes, None])

    def stop(self) -> None:
        """End the thread (at its next poll)."""
        self.stopped = True

    def _run(self) -> None:
        while not self.stopped:
            time.sleep(min(1.0, timeout_s() / 10))
            with self.lock:
                while self.pending and self.pending[0][1].query():
                    self.pending.popleft()
                head = self.pending[0] if self.pending else None
            if head is None or self.fired:
                continue
            if head[4] is None:
                if head[0].query():
                    head[4] = time.monotonic()
                continue
            waited = time.monotonic() - head[4]
            if waited > timeout_s():
                self.fired = True
                err = self.red.error(
                    head[2], head[3], waited, TimeoutError("the collective is still running on the device")
                )
                with thread_exception_print_lock:
                    print(f"roundpipe: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                report_failure(err)


class DeviceReduction:
    """``reduce_on="device"``: each layer's gradients are all-reduced on its device at the end of its
    backward job, before the gradient download (streams: the comment above :meth:`reduce_layer`;
    ordering: ``roundpipe.distributed.device_order``).

    Per layer, the collectives are a few flat buckets (``bucket_mb``; presence counts first) plus, in
    place, each gradient larger than a bucket: every rank issues them with the same sizes, in the same
    order, whatever its data.

    Weights and accumulation. Between calls of a step the host gradients hold the reduced, weighted sum
    of what the step computed so far, ``H = sum over calls and ranks of w_r * g``, on every rank.
    Uploads do not seed device gradients in this mode (``transfer.upload_layers``), so after the
    backward a device gradient holds this call's local gradient ``g_r`` alone; the reduction sends
    ``w_r * g_r`` from every rank plus ``H`` from rank 0 only, and the SUM is ``H + sum_r w_r g_r``:
    exact for any number of ranks and calls, with no division. ``w_r`` is 1/W (``op="mean"``), 1
    (``op="sum"``), or ``n_r / N`` after ``normalize_by`` (which therefore must come before the backward).
    Tied parameters: each layer reduces its own share; ``reduce_shared_grads`` adds the reduced shares.

    Presence. A parameter without a gradient on this rank contributes zeros (the layout is fixed); the
    first bucket carries one count per parameter (ranks and calls that had a gradient; rank 0 adds the
    counts of the step's earlier calls). At the step a parameter whose count is 0 gets ``.grad = None``,
    as in one process (the optimizer skips it).

    Args:
        options: Bucket size, op and reduction dtype.
        counter: Where collectives, bytes and times are counted.
        host_group: The host reduction's gloo group (optimizer thread): the step's order check runs on it.
        host_weight: Sets the host reduction's weight for a step (queued on the optimizer thread).
        groups: One group per local device index (device k of every rank).
        control: A gloo group of all ranks for the main thread's agreement and ``normalize_by``.
    """

    def __init__(
        self,
        options: ReduceOptions,
        counter: StatsCounter,
        host_group: Any,
        host_weight: Callable[[float], None],
        groups: List[Any],
        control: Any,
        backend_name: str,
        num_devices: int,
        max_layers: int,
    ) -> None:
        self.options = options
        self.counter = counter
        self.host_group = host_group
        self.host_weight = host_weight
        self.groups = groups
        self.control = control
        self.backend = backend_name
        self.num_devices = num_devices
        self.rank, self.world_size, self.global_rank = group_ranks(control)
        self.where = f"rank {self.global_rank}/{self.world_size}"
        self.default_weight = options.default_weight(self.world_size)
        self.agreement = PlanAgreement(control, max_layers)
        # Main-thread state of the current step. Device threads read ``weight`` during a call; the main
        # thread changes it only between calls (normalize_by, step), when no device job is running.
        self.weight = self.default_weight
        self.count_given = False
        self.reduced_this_step = False  # set by device threads, read by the main thread after the call
        self.slots: List[LayerSlot] = []
        self.models: List[RoundPipe] = []
        self.grad_sync: Optional[GradSync] = None
        self.index_of: Dict[int, int] = {}  # id(model) -> its index among the reduced models
        self.slot_of: Dict[Tuple[int, int], LayerSlot] = {}
        self.reduced_attrs: Set[int] = set()
        self.lock = threading.Lock()
        self.sequence: Dict[int, List[int]] = {}  # device index -> slots reduced there since the last step
        self.timings: List[Any] = []  # per layer reduction since the last step: seconds, or (ready, done) events
        self.last_step_s = 0.0
        self.monitor: Optional[CollectiveMonitor] = CollectiveMonitor(self) if backend_name == "nccl" else None

    @property
    def adopted_plans(self) -> int:
        """Training calls that ran rank 0's plan instead of this rank's own."""
        return self.agreement.adopted_plans

    # ---- setup ---------------------------------------------------------------------------------------
    def install(self, models: List[RoundPipe], grad_sync: GradSync, model_name: str) -> None:
        """Reduce every layer of ``models`` on the devices: each becomes reachable through ``grad_sync``'s
        calls (``layer_reducer``, ``agree_plan``); RoundPipe submodels of an AutoRoundPipe without a
        ``grad_sync`` get this one."""
        self.grad_sync = grad_sync
        for i, rp in enumerate(models):
            self.index_of[id(rp)] = i
            for lid, attr in enumerate(rp.layer_attrs):
                slot = LayerSlot(self, len(self.slots), rp.name, lid)
                self.slot_of[(id(rp), lid)] = slot
                self.reduced_attrs.add(id(attr))
                self.slots.append(slot)
            if rp.grad_sync is None:
                rp.grad_sync = grad_sync
        self.models = list(models)
        register_device_reduction(id(self), model_name)

    def uninstall(self, root: RoundPipeBase) -> None:
        """Undo :meth:`install` (``root``, the data-parallel model, keeps its ``grad_sync``: its owner's to drop)."""
        unregister_device_reduction(id(self))
        for rp in self.models:
            if rp.grad_sync is self.grad_sync and rp is not root:
                rp.grad_sync = None
        self.models, self.slots = [], []
        self.index_of, self.slot_of, self.reduced_attrs = {}, {}, set()
        if self.monitor is not None:
            self.monitor.stop()

    def reduces(self, attr: LayerAttribute) -> bool:
        """Whether the unit guarded by ``attr`` is reduced on the devices (a layer RoundPipe runs)."""
        return id(attr) in self.reduced_attrs

    def layer_reducer(self, model: Any, layer_id: int) -> Optional[LayerSlot]:
        """The reduction of ``model``'s layer ``layer_id`` (None for a model this reduction does not cover)."""
        return self.slot_of.get((id(model), layer_id))

    def error(self, what: str, nbytes: int, waited: float, exc: BaseException) -> DataParallelError:
        """The error of a failed collective of this reduction, naming rank, collective and size."""
        return collective_failure(self.where, f"{what} ({nbytes / 2**20:.2f} MiB)", waited, exc)

    # ---- main thread ---------------------------------------------------------------------------------
    def on_step_launch(self) -> None:
        """A new step: default weight again, ``normalize_by`` allowed again."""
        self.weight = self.default_weight
        self.count_given = False
        self.reduced_this_step = False
        self.agreement.on_step_launch()

    def normalize_by(self, count: float) -> None:
        """All-gather the counts now (the weight is applied on the devices during the backward)."""
        if self.count_given:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by called twice before one model.step")
        mine = torch.tensor([count, 1.0 if self.reduced_this_step else 0.0], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        run_collective(
            lambda: dist.all_gather(rows, mine, group=self.control),
            self.where,
            "normalize_by's all_gather of the counts",
        )
        counts = [float(r[0]) for r in rows]
        total = sum(counts)
        if total <= 0:
            raise DataParallelError(
                f"rank {self.global_rank}: normalize_by counts sum to {total} over all ranks; nothing to average"
            )
        # Every rank sees every count, so every rank takes the same decision below.
        if any(float(r[1]) > 0 for r in rows) and any(c / total != self.weight for c in counts):
            raise DataParallelError(
                f"rank {self.global_rank}/{self.world_size}: normalize_by came after this step's backward had "
                "already reduced the "
                f"gradients on the devices (reduce_on='device') with the weight {self.weight:g} per rank, but "
                "the counts "
                f"({', '.join(f'{c:g}' for c in counts)}) need count/{total:g} per rank. Call normalize_by "
                "before the step's "
                "first forward/backward (that order works with both reduce_on modes), or use reduce_on='host'"
            )
        self.weight = count / total
        self.count_given = True
        # Units reduced on the host (an AutoRoundPipe's host parameters) use the same weight at the step:
        # queued on the optimizer thread, it applies to the next step kernel.
        optim_thread.submit(self.host_weight, self.weight)

    def agree_plan(self, model: RoundPipe, run_type: str, plan: ModelExecutePlan) -> ModelExecutePlan:
        """The plan of a training call, the same on every rank (rank 0's; ``device_order``)."""
        index = self.index_of.get(id(model))
        if run_type not in RUN_CODES or index is None:
            return plan  # inference: no gradients, no collectives (rank-local evaluation is fine)
        return self.agreement.agree(model, index, run_type, plan)

    # ---- device threads --------------------------------------------------------------------------------
    # Streams (CUDA). ``transfer.download_layer`` calls the ``LayerSlot`` at the end of a backward job with
    # the gradient stream current, right after ``grad_stream.wait_stream(compute_stream)``: everything
    # below is queued on ``grad_stream`` behind the layer's backward of all microbatches, so the packing
    # reads final gradients. ``dist.all_reduce`` on an NCCL group makes NCCL's internal stream wait for the
    # current stream (``grad_stream``) before the collective, and ``work.wait()`` makes the current stream
    # wait for the collective's end, without blocking the host. So the unpacking and the gradient download
    # queued next on ``grad_stream`` see the reduced values, the device thread never blocks (it goes on
    # issuing its next job while NCCL runs), and neither the compute stream nor the activation downloads
    # (``downstream``) wait for communication: only this device's later gradient downloads queue behind
    # it, which is where a rank waits for a slower peer. No deadlock: host threads never wait for NCCL
    # (only the main thread, after the backward, and the optimizer thread wait for gradient downloads),
    # and every stream dependency, collectives included, points to work of an earlier-dispatched job, in
    # the same dispatch order on every rank (one gradient stream per device carries its collectives in
    # that order), so the dependency graph across ranks has no cycle. Tensors stay alive as long as
    # streams use them: the flat buffers are allocated on ``grad_stream`` (the caching allocator reuses
    # them only for later work on that stream) and NCCL records its own use of its inputs; device
    # gradients are released through the memory manager, which waits for ``grad_stream``. Host buffers
    # read by an upload on ``grad_stream`` (the seeds) are written again only by the gradient download
    # queued after it on the same stream. On CPU workers the same code runs with gloo; ``work.wait()``
    # blocks the device thread.
    def reduce_layer(
        self, slot: LayerSlot, cpu_layer: nn.Module, gpu_layer: nn.Module, layer_id: int, device: Any
    ) -> None:
        """All-reduce one layer's device gradients (SUM of weighted shares, plus rank 0's seed) in place,
        on the current (gradient) stream; see the class and the comment above for the reasoning."""
        pairs = _trainable_pairs(cpu_layer, gpu_layer)
        if not pairs:
            return
        k = getattr(device, "id", 0)
        if k >= len(self.groups):
            raise DataParallelError(
                f"rank {self.global_rank}: local device #{k} ({device}) has no data-parallel group: devices "
                "were re-created "
                f"after enable_data_parallel ({len(self.groups)} then); call it again after changing RPP_DEVICES"
            )
        group = self.groups[k]
        name = getattr(device, "name", str(k))
        what = f"all_reduce of the gradients of layer {layer_id} of model {slot.model_name!r} on device {name}"
        if hasattr(device, "location"):  # where a failure here is reported (DeviceManager._locate)
            device.location = f"model {slot.model_name!r}: data-parallel gradient all-reduce of layer {layer_id}"
        weight = self.weight
        seeding = self.rank == 0
        host_params = [p for p, _ in pairs]
        prev = (
            slot.flags_host.tolist()
            if seeding and slot.flags_valid and slot.flags_params == host_params and slot.flags_host is not None
            else None
        )
        flags = [
            (1.0 if dp.grad is not None else 0.0) + (prev[i] if prev is not None else 0.0)
            for i, (_, dp) in enumerate(pairs)
        ]
        for _, dp in pairs:
            if dp.grad is None:
                dp.grad = torch.zeros_like(dp)  # a gradient elsewhere, none here: contribute zeros
        # Rank 0 adds what the step accumulated on the host so far (the reduced sum of earlier calls).
        seeds = [host_grad(p, layer_id) if seeding else None for p in host_params]
        cuda = device.device.type == "cuda" if hasattr(device, "device") else False
        t0 = time.perf_counter()
        ready = done = None
        targets: List[torch.Tensor] = []
        works: List[Any] = []
        nbytes = 0
        buckets = layer_buckets(host_params, self.options.reduce_dtype, self.options.bucket_bytes)
        for b in buckets:
            target = self._prepare(b, pairs, flags, seeds, weight)
            targets.append(target)
            nbytes += target.numel() * target.element_size()
            if ready is None and cuda:
                ready = torch.cuda.Event(enable_timing=True)
                ready.record()  # on the current stream: this rank's first bucket is ready
            try:
                works.append(dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group, async_op=True))
            except Exception as exc:  # noqa: BLE001 - reported with its context
                raise self.error(what, nbytes, time.perf_counter() - t0, exc) from exc
        for work in works:
            try:
                work.wait()  # NCCL: the current stream waits (no host block); gloo: blocks this thread
            except Exception as exc:  # noqa: BLE001 - reported with its context
                raise self.error(what, nbytes, time.perf_counter() - t0, exc) from exc
        if cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        for b, target in zip(buckets, targets):
            self._unpack(b, target, pairs, slot)
        slot.flags_params, slot.flags_valid = host_params, True
        with self.lock:
            self.reduced_this_step = True
            self.sequence.setdefault(k, []).append(slot.index)
            self.timings.append((ready, done) if cuda else time.perf_counter() - t0)
        self.counter.count(collectives=len(works), nbytes=nbytes, comm_s=0.0 if cuda else time.perf_counter() - t0)
        if self.monitor is not None and ready is not None:
            self.monitor.add(ready, done, what, nbytes)

    def _prepare(
        self,
        b: LayerBucket,
        pairs: List[Tuple[nn.Parameter, nn.Parameter]],
        flags: List[float],
        seeds: List[Optional[torch.Tensor]],
        weight: float,
    ) -> torch.Tensor:
        """This rank's input of one bucket: ``weight * gradient`` (+ rank 0's seed), counts first."""
        chunk = max(1, self.options.bucket_bytes // b.dtype.itemsize)
        if not b.packed:
            dp = pairs[b.indices[0]][1]
            target = dp.grad if dp.grad.is_contiguous() else dp.grad.contiguous()
            if weight != 1.0:
                target.mul_(weight)
            seed = seeds[b.indices[0]]
            if seed is not None:
                _add_from_host(target.view(-1), seed, chunk)
            return target
        dev = pairs[0][1].device
        flat = torch.empty(b.nflags + b.numel, dtype=b.dtype, device=dev)
        if b.nflags:
            flat[: b.nflags].copy_(_staging_host(flags, b.dtype), non_blocking=True)
        off = b.nflags
        for i in b.indices:
            g = pairs[i][1].grad
            flat[off : off + g.numel()].copy_(g.reshape(-1))
            off += g.numel()
        if weight != 1.0 and b.numel:
            flat[b.nflags :].mul_(weight)
        off = b.nflags
        for i in b.indices:
            n = pairs[i][1].grad.numel()
            if seeds[i] is not None:
                _add_from_host(flat[off : off + n], seeds[i], chunk)  # type: ignore[arg-type]
            off += n
        return flat

    def _unpack(
        self, b: LayerBucket, target: torch.Tensor, pairs: List[Tuple[nn.Parameter, nn.Parameter]], slot: LayerSlot
    ) -> None:
        """Reduced values back into the device gradients (downloaded next); counts to the host."""
        if not b.packed:
            dp = pairs[b.indices[0]][1]
            if target is not dp.grad:
                dp.grad.copy_(target.view_as(dp.grad))
            return
        if b.nflags:
            host = slot.flags_host
            if host is None or host.numel() != b.nflags or host.dtype != b.dtype:
                host = slot.flags_host = backend.empty_host_like(target[: b.nflags])
            # Lands before the layer's grad_downloaded event (recorded after this on the same stream),
            # which the step waits for before reading the counts.
            host.copy_(target[: b.nflags], non_blocking=target.device.type != "cpu")
        off = b.nflags
        for i in b.indices:
            g = pairs[i][1].grad
            g.copy_(target[off : off + g.numel()].view_as(g))
            off += g.numel()

    # ---- optimizer thread ----------------------------------------------------------------------------
    def finish_step(self, units: List[Tuple[LayerAttribute, List[nn.Parameter]]]) -> None:
        """At the step (all downloads landed): drop gradients no rank had, check that every rank reduced
        the same layers in the same order (the last guard of ``device_order``), and account the step's
        device time."""
        present: Dict[int, bool] = {}
        for slot in self.slots:
            if slot.flags_valid and slot.flags_host is not None:
                for p, f in zip(slot.flags_params, slot.flags_host.tolist()):
                    present[id(p)] = present.get(id(p), False) or f > 0
                slot.flags_valid = False  # the next call starts the next step's counts
        for attr, params in units:
            if self.reduces(attr):
                for p in params:
                    if present.get(id(p)) is False:
                        p.grad = None  # no rank computed one: the optimizer skips it, as in one process
        with self.lock:
            sequence, self.sequence = self.sequence, {}
            timings, self.timings = self.timings, []
        self.last_step_s = sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3 for t in timings)
        h = hashlib.sha256(repr(sorted(sequence.items())).encode()).digest()
        mine = torch.tensor([int.from_bytes(h[:8], "little", signed=True)], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.counter.count(collectives=1)
        t0 = time.perf_counter()
        try:
            dist.all_gather(rows, mine, group=self.host_group)
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self.error(
                "the step's check of the device reduction order (all_gather)", 0, time.perf_counter() - t0, exc
            ) from exc
        bad = [r for r, t in enumerate(rows) if int(t) != int(rows[0])]
        if bad:
            raise DataParallelError(
                f"rank {self.global_rank}/{self.world_size}: the device gradient reductions of this step ran "
                "in a different order "
                f"on ranks {bad} than on rank 0, so gradients of different layers may have been summed; the "
                "step is refused. "
                "Every rank must run the same RoundPipe calls in the same order (no rank-local training calls "
                "between a "
                "forward and its backward)"
            )


def setup_device_reduction(
    model: RoundPipeBase,
    options: ReduceOptions,
    counter: StatsCounter,
    host_group: Any,
    host_weight: Callable[[float], None],
    backend_name: str,
) -> DeviceReduction:
    """Create the control group and one group per local device (every rank, same order: ``new_group``
    is a collective of the default group), connect them, and return the reduction of ``model``'s
    RoundPipe layers (to :meth:`DeviceReduction.install`)."""
    secs = timeout_s()
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=secs))
    # NCCL's watchdog ends the process after the group timeout; ours names the layer first (monitor).
    grad_secs = secs + (NCCL_GRACE_S if backend_name == "nccl" else 0.0)
    devices = list(device_mod.device_list)
    if backend_name == "nccl" and torch.cuda.current_device() not in [d.device.index for d in devices]:
        # This rank's GPUs came from RPP_DEVICES: make the first one current, so nothing NCCL or CUDA
        # does on the main thread lands on another rank's GPU (init_from_env does the same).
        torch.cuda.set_device(devices[0].device)
    groups = [dist.new_group(backend=backend_name, timeout=timedelta(seconds=grad_secs)) for _ in devices]
    world = dist.get_world_size()
    for k, (d, group) in enumerate(zip(devices, groups)):
        # Connect now, group by group in the same order on every rank (NCCL would otherwise create its
        # communicators lazily inside the first backward): a broken setup fails here, clearly.
        try:
            t = torch.ones(1, device=d.device)
            dist.all_reduce(t, group=group)
            got = float(t.item())  # synchronises with the collective
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise DataParallelError(
                f"rank {dist.get_rank()}/{world}: connecting the {backend_name} group of local device #{k} "
                f"({d.device}) failed: {exception_summary(exc)}"
            ) from exc
        if got != world:
            raise DataParallelError(
                f"rank {dist.get_rank()}/{world}: the {backend_name} group of local device #{k} ({d.device}) "
                f"summed {got:g} instead of {world}"
            )
    models = roundpipes_of(model)
    return DeviceReduction(
        options,
        counter,
        host_group,
        host_weight,
        groups,
        control,
        backend_name,
        len(devices),
        max((m.num_layers for m in models), default=1),
    )


def roundpipes_of(model: RoundPipeBase) -> List[RoundPipe]:
    """The RoundPipe models whose layers run on the devices: ``model`` itself, or an AutoRoundPipe's parts."""
    return [model] if isinstance(model, RoundPipe) else [m for m in model.model.modules() if isinstance(m, RoundPipe)]
