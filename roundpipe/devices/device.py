"""Device workers: one ``DeviceManager`` per GPU (or CPU worker), each with a controller thread and five
streams. A worker runs whatever callable it is handed (``launch(fn, *args, label=...)``); what a job
does (forward, backward of a layer group) is the run's business (``roundpipe.runtime.jobs``), and which device
gets which job is the dispatcher's (``roundpipe.devices.dispatch``).

Job life cycle (owned by ``DeviceManager``): the dispatching thread acquires ``is_idle`` (the one-job
slot is free), stores the job in ``cur_job``, clears ``drained`` and releases ``job_arrived``; the
controller takes the job out of the slot and releases ``is_idle`` at once, so the next job can be queued
while this one issues and the worker starts it without waiting for the dispatching thread; when no job
is left queued or running, the controller sets ``drained``. A job that raises records its error, with
model, layer, microbatch and device, in the failure slot of ``threads``; every waiter in RoundPipe then
aborts within a poll interval.

Streams: ``param_upstream`` (parameter uploads, low priority: prefetch), ``upstream`` (activation
uploads, high priority: on the critical path), ``compute_stream``, ``downstream`` (activation and
input-gradient downloads, high priority: the next job waits for them) and ``grad_stream`` (a layer's
parameter gradients and buffers back to the host, with the merges and reductions before that download;
low priority). Parameter gradients have a stream of their own because one layer's can be large (a tied
151k-token embedding: 593 MiB, 11 ms each way) and a hand-over queued behind them on one stream left
the next GPU idle for as long.

Attributes:
    device_list: The instantiated DeviceManager objects (created on first use from ``RPP_DEVICES``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from roundpipe import settings
from roundpipe.devices import allocator, backend, profile
from roundpipe.devices.backend import Event, Stream
from roundpipe.devices.graphs import GraphCache
from roundpipe.devices.threads import (
    AnnotatedEvent,
    AnnotatedSemaphore,
    RoundPipeAborted,
    RoundPipeOutOfMemoryError,
    RoundPipeThread,
    RoundPipeWorkerError,
    report_failure,
)


class InterStreamMemManager:
    """Keeps tensors used on several streams alive until the streams that used them are done.

    A tensor allocated on one stream (say an upload on ``param_upstream``) and read on another (the
    compute stream) must not return to the caching allocator before the reading kernels finish, or the
    next upload could overwrite it while compute still reads it. ``free(tensors, *use_streams)`` records
    an event on each use stream and holds the tensors until all those events complete; ``flush()`` drops
    the ones that are done. Its controller thread queues and flushes; the planner also flushes before it reads
    the device's free memory (``get_min_capacity``): otherwise a finished call's last tensors (its fused job's
    weights and activations, 3.5 GiB of a qwen3-8b slice) stayed allocated until the next job's flush, and
    the next call planned with that much less. The lock makes the two threads' deque operations atomic.

    Attributes:
        free_queue: (events, tensors) pairs waiting for their events.
    """

    def __init__(self) -> None:
        self.free_queue: Deque[Tuple[List[Event], Any]] = collections.deque()
        self._lock = threading.Lock()

    def free(self, tensors: Any, *use_streams: Stream) -> None:
        """Hold ``tensors`` until the work queued so far on ``use_streams`` has finished."""
        events = [backend.record_event(s) for s in use_streams if not isinstance(s, backend.CpuStream)]
        if events:
            with self._lock:
                self.free_queue.append((events, tensors))

    def free_after(self, events: List[Event], tensors: Any) -> None:
        """Hold ``tensors`` until ``events`` (already recorded by the caller) have completed."""
        events = [e for e in events if not isinstance(e, backend.CpuEvent)]
        if events:
            with self._lock:
                self.free_queue.append((events, tensors))

    def flush(self) -> None:
        """Release the tensors whose streams have passed their last use (never blocks)."""
        with self._lock:
            while self.free_queue and all(e.query() for e in self.free_queue[0][0]):
                self.free_queue.popleft()

    def free_all(self) -> None:
        """Release everything; the caller has synchronised the device."""
        with self._lock:
            self.free_queue.clear()


class DeviceManager:
    """Manages the streams, memory and job execution of one device (see the module docstring).

    Attributes:
        id: Sequential identifier of this worker.
        device: The torch device (``cuda:i`` or ``cpu``).
        is_idle: Released when the controller can accept the next job (its one-job slot is free; a job
            may still be running).
        job_arrived: Released when a job is queued.
        cur_job: The job to run next: (function, args, profiler label).
        drained: Set while no job is queued or running.
        location: What the running job is doing now (layer, microbatch), for error messages.
        where: The same, unformatted: ``(format, args)``, formatted only when an error needs it (the
            jobs update it per layer and microbatch, too often to build a string each time).
        graphs: This device's weight slots and captured graphs (``roundpipe.devices.graphs``).
        recent_jobs: Compute-done events of the last jobs; bounds prefetch to two resident stages.
    """

    def __init__(self, id: int, device: torch.device) -> None:  # noqa: A002 - spec name
        self.id = id
        self.device = device
        backend.apply_memory_cap(device)
        self.name = f"{device.type}:{device.index}" if backend.is_cuda(device) else f"cpu-worker{id}"
        # Lower number = higher priority on CUDA: activation uploads are on the critical path and must
        # not queue behind a parameter prefetch.
        self.param_upstream = backend.new_stream(device, priority=0, name=f"{self.name}.param_upstream")
        self.upstream = backend.new_stream(device, priority=-1, name=f"{self.name}.upstream")
        self.compute_stream = backend.new_stream(device, priority=0, name=f"{self.name}.compute_stream")
        self.downstream = backend.new_stream(device, priority=-1, name=f"{self.name}.downstream")
        self.grad_stream = backend.new_stream(device, priority=0, name=f"{self.name}.grad_stream")
        self.mem_manager = InterStreamMemManager()
        self.recent_jobs: Deque[Event] = collections.deque()
        self.is_idle = AnnotatedSemaphore(1, name=f"{self.name}.is_idle")
        self.job_arrived = AnnotatedSemaphore(0, name=f"{self.name}.job_arrived")
        self.cur_job: Optional[Tuple[Callable[..., None], Tuple[Any, ...], str]] = None
        # Jobs queued or running; ``drained`` mirrors ``jobs == 0``. Both change under ``jobs_lock`` (the
        # dispatching thread adds, the controller removes) so ``drained`` never misses a job.
        self.jobs = 0
        self.jobs_lock = threading.Lock()
        self.drained = AnnotatedEvent(name=f"{self.name}.drained", set=True)
        self.location = ""
        self.where: Optional[Tuple[Callable[..., str], Tuple[Any, ...]]] = None
        self.spin_s = 0.0  # CPU seconds this thread spent in spinning waits (``throttle_prefetch``)
        self.graphs = GraphCache(device, self.compute_stream)
        # The stage the running job executes: (model name, layers, bytes on the device), for OOM errors.
        self.stage: Optional[Tuple[str, range, float]] = None
        self.shutdown = False
        self.intra_op_threads = torch.get_num_threads()  # this (creating) thread's, for a CPU worker's compute
        self.controller_thread = RoundPipeThread(self.controller, name=f"roundpipe-{self.name}")
        self.controller_thread.describe = self.describe_location  # the watchdog names the job and the layer
        self.controller_thread.start()

    def __repr__(self) -> str:
        return f"DeviceManager({self.name})"

    # ---- job queue -------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., None], *args: Any, label: str = "") -> None:
        """Queue ``fn(self, *args)`` on this device; blocks while an earlier job is still waiting in the
        slot (at most one job runs and one waits). ``label`` names the job on profiler timelines."""
        self.is_idle.acquire()
        with self.jobs_lock:
            self.jobs += 1
            self.drained.clear()
        self.cur_job = (fn, args, label)
        self.job_arrived.release()

    def wait_idle(self) -> None:
        """Block until this device has finished issuing every queued job."""
        self.drained.wait()

    def controller(self) -> None:
        """Background loop: run jobs as they arrive. Errors are reported, never fatal to the loop."""
        backend.init_worker_thread(self.device, self.intra_op_threads)
        while True:
            # Plain (non-aborting) wait: an idle worker must keep waiting for work after a failure.
            threading.Semaphore.acquire(self.job_arrived)
            if self.shutdown:
                return
            assert self.cur_job is not None
            fn, args, label = self.cur_job
            self.cur_job = None
            # The slot is free: the dispatching thread may queue the next job while this one issues.
            self.is_idle.release()
            self.controller_thread.is_active = True
            try:
                # One profiler range per job (RPP_PROFILER): kernels launched inside it belong to this
                # layer group, which is how bench/train_bench.py tells idle time between groups apart.
                with torch.inference_mode(False), profile.annotate(label):
                    fn(self, *args)
            except BaseException as exc:  # noqa: BLE001 - surfaced in the dispatching thread
                report_failure(self._locate(exc))
            finally:
                # Drop the job before waiting for the next: an idle thread's locals would otherwise keep the last
                # call's run, and through it its model and device memory, alive after the user let it go.
                fn = args = None  # noqa: F841
                self.location = ""
                self.where = None
                self.stage = None
                self.controller_thread.is_active = False
                with self.jobs_lock:
                    self.jobs -= 1
                    if self.jobs == 0:
                        self.drained.set()

    def _locate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, (RoundPipeAborted, KeyboardInterrupt)):
            return exc
        location = self.describe_location()
        where = f"{location} on device {self.name}" if location else f"on device {self.name}"
        if isinstance(exc, torch.OutOfMemoryError):
            err: RoundPipeWorkerError = RoundPipeOutOfMemoryError(
                f"{where}: out of memory. {self._oom_advice()}\n{type(exc).__name__}: {exc}"
            )
        else:
            err = RoundPipeWorkerError(f"{where}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        err.original = exc  # type: ignore[attr-defined]
        return err

    def describe_location(self) -> str:
        """What the running job is doing now, formatted (``where`` wins over ``location``)."""
        if self.where is not None:
            fmt, args = self.where
            return fmt(*args)
        return self.location

    def _oom_advice(self) -> str:
        """What ran out of memory and the knobs that fix it (docs/resolve-oom.md)."""
        free = backend.free_memory_bytes(self.device) / 1024**3
        stage = ""
        if self.stage is not None:
            name, layers, nbytes = self.stage
            stage = (
                f"Stage layers {layers.start}-{layers.stop - 1} of model {name!r} needs {nbytes / 1024**3:.2f} GiB "
                "for parameters (and gradients); "
            )
        return (
            f"{stage}{free:.2f} GiB of device memory is free now. Fixes: more microbatches "
            "(RoundPipeRunConfig(num_microbatch=...)) or a smaller batch (roundpipe train --batch-size) for "
            "smaller activations; smaller stages (a manual execute_plan, or ModelExecutePlan.auto(..., "
            "model_memory_limit=<GB>); a lower RPP_GPU_MEMORY, roundpipe train --gpu-memory, plans them); "
            "recompute_grain='layer' (one layer's autograd graph at a time); the model stays usable for the next "
            "call; see docs/resolve-oom.md"
        )

    def shutdown_controller(self) -> None:
        """Stop the controller thread."""
        self.shutdown = True
        self.job_arrived.release()
        self.controller_thread.join(timeout=5)

    # ---- stream helpers --------------------------------------------------------------------------
    def wait_stream(self, waiter: Stream, wait_for: Stream) -> None:
        """Make ``waiter`` wait for the work queued so far on ``wait_for``."""
        waiter.wait_stream(wait_for)

    def throttle_prefetch(self) -> None:
        """Keep at most two jobs' parameters on the device: before a new job uploads, wait (on this
        worker thread, never the main one) for the job before the previous one to finish computing."""
        self.mem_manager.flush()
        if len(self.recent_jobs) >= 2:
            # The wait spins on CUDA: its CPU time is not the job's host cost (``jobs.HostClock``).
            t0 = time.thread_time()
            while len(self.recent_jobs) >= 2:
                self.recent_jobs.popleft().synchronize()
            self.spin_s += time.thread_time() - t0
        self.mem_manager.flush()

    def job_done(self) -> None:
        """Record the end of the current job's compute (see ``throttle_prefetch``)."""
        if backend.is_cuda(self.device):
            self.recent_jobs.append(backend.record_event(self.compute_stream))


device_list: List[DeviceManager] = []
_init_lock = threading.Lock()
_reset_callbacks: List[Callable[[], None]] = []


def get_devices() -> List[DeviceManager]:
    """The device pool, created from ``RPP_DEVICES`` on first use."""
    global device_list
    if not device_list:
        with _init_lock:
            if not device_list:
                devices = backend.parse_devices(settings.DEVICES.get())
                # Before any controller thread allocates: see allocator.settle_expandable_handle_type.
                allocator.settle_expandable_handle_type([d for d in devices if backend.is_cuda(d)])
                device_list = [DeviceManager(i, d) for i, d in enumerate(devices)]
    return device_list


def get_num_devices() -> int:
    """Number of devices (GPUs or CPU workers) RoundPipe runs on."""
    return len(get_devices())


def get_min_gpu_memory() -> float:
    """Minimum free memory across the devices, in GB (host memory for CPU workers)."""
    return min(backend.free_memory_bytes(d.device) for d in get_devices()) / 1024**3


def get_min_capacity() -> int:
    """The least any device could hold for this process now, in bytes (``backend.capacity_bytes``), after
    releasing what finished jobs still held (``InterStreamMemManager.flush``: only tensors whose streams are
    past their last use, so nothing in flight)."""
    devices = get_devices()
    for d in devices:
        d.mem_manager.flush()
    return min(backend.capacity_bytes(d.device) for d in devices)


def wait_all_idle() -> None:
    """Block until every device has finished issuing its jobs."""
    for d in device_list:
        d.wait_idle()


def synchronize_devices() -> None:
    """Block until every device has run all the work queued on its streams (CPU workers: mark it done
    for the streams' order checks, ``roundpipe.devices.cpu_streams``)."""
    for d in device_list:
        if backend.is_cuda(d.device):
            torch.cuda.synchronize(d.device)
        else:
            for s in (d.param_upstream, d.upstream, d.compute_stream, d.downstream, d.grad_stream):
                s.synchronize()


def gc_collect() -> None:
    """Release tensors held for other streams on all devices (synchronises the GPUs first)."""
    synchronize_devices()
    for d in device_list:
        d.mem_manager.free_all()
        d.recent_jobs.clear()
        d.graphs.clear()  # their pool's memory goes back with the next empty_cache


def release_graphs() -> bool:
    """Give back the memory every device's graphs and weight slots hold, for a call that does not fit beside
    what calls of other shapes left there (``budget.plan_or_refuse``); returns whether any device held some.
    The caller has no job in flight of its own; a later job re-creates the slots and graphs it needs."""
    if not any(d.graphs.holds_memory() for d in device_list):
        return False
    # A cache belongs to its device thread: wait until every thread has finished its jobs (none runs then; the
    # next launch's semaphore orders this thread's writes before the thread's reads). gc_collect then waits for
    # the work those jobs queued (a replay, an upload into a slot) before it drops the graphs and slots.
    wait_all_idle()
    gc_collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the graphs' private pools and freed slots back to the driver
    return True


PEER_MIN_DEVICES = 3
"""The smallest pool ``RPP_DEBUG_PEER_HANDOFF=auto`` gives peer hand-overs: on 4 H200s (NVLink) they ran 1.10x
(qwen3-1.7b and 4b, 16 x 4096, one call, 2026-11-27) and 1.20x (1.7b, across calls, 2026-11-28); on 2 GPUs
they were 0-4% slower when measured eagerly (docs/benchmarks.md)."""
_peer_handoff: Optional[bool] = None  # auto's answer for the current pool (reset with it)


def peer_handoff_enabled() -> bool:
    """Whether jobs hand activations and input gradients to the next job's GPU as peer copies
    (``RPP_DEBUG_PEER_HANDOFF``; ``auto``: a pool of at least :data:`PEER_MIN_DEVICES` GPUs, every pair with peer
    access). Asked once per call by the main thread."""
    global _peer_handoff
    mode = settings.DEBUG_PEER_HANDOFF.get()
    if mode != "auto":
        return mode == "1"
    if _peer_handoff is None:
        devices = [d.device for d in get_devices()]
        _peer_handoff = (
            len(devices) >= PEER_MIN_DEVICES
            and all(backend.is_cuda(d) for d in devices)
            and all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)
        )
    return _peer_handoff


def peer_handoff_chosen() -> bool:
    """Whether ``RPP_DEBUG_PEER_HANDOFF`` is ``1`` or ``0`` rather than ``auto`` (calls of one long sequence keep
    ``auto`` off)."""
    return settings.DEBUG_PEER_HANDOFF.get() != "auto"


def on_reset(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever the pool is re-created (the dispatcher starts again at device 0)."""
    _reset_callbacks.append(callback)


def reset_devices() -> None:
    """Shut the workers down so the next use re-reads ``RPP_DEVICES`` (tests and interactive use)."""
    global device_list, _peer_handoff
    for d in device_list:
        d.shutdown_controller()
    device_list = []
    _peer_handoff = None
    for callback in _reset_callbacks:
        callback()


settings.on_change(settings.DEVICES, reset_devices)
