"""The optimizer thread: one host thread that runs optimizer work in submission order.

``submit(fn, ...)`` queues ``fn`` and returns at once; the thread runs kernels one after
another, so work queued by one ``model.step`` is ordered after the previous step's. The main thread
waits for all queued work with ``synchronize()``. A kernel that raises is recorded in the
RoundPipe failure slot (see ``threads``), and the next ``synchronize`` or RoundPipe call raises it.
While the CPU streams check their order (``cpu_streams.host_checks``), each kernel's ops are checked as host
reads and writes of what the device streams wrote or read.

Attributes:
    kernel_queue: Queue of optimizer kernel tasks.
    OPTIM_STOP: Sentinel object that stops the thread.
    _thread: Daemon thread that executes optimizer tasks (started on first use).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional

import torch

from roundpipe import settings
from roundpipe.devices import cpu_streams
from roundpipe.devices.threads import OptimizerStepError, RoundPipeThread, note_progress, report_failure

KernelQueueType = "queue.Queue[Tuple[Callable, Tuple, Dict[str, Any]]]"

kernel_queue: "queue.Queue[Any]" = queue.Queue()
OPTIM_STOP = object()
_thread: Optional[RoundPipeThread] = None
_start_lock = threading.Lock()
_base_threads: Optional[int] = None  # torch's intra-op count before the optimizer thread set its own
_recount = threading.Event()  # the pool changed: set the thread count again before the next kernel


logger = logging.getLogger("roundpipe")


def _set_thread_count() -> None:
    """Give the optimizer thread ``RPP_OPTIM_THREADS`` intra-op threads (default: this rank's share of
    the cores when several ranks share the host, see ``shared_host_default``; else torch's count less
    the cores each GPU's issuing threads need, see ``single_process_default``).

    Fewer than all cores leaves CPU time to the main and device threads, which issue the GPU work while
    the step runs. torch keeps the OpenMP thread count per thread, so this only changes the optimizer
    thread's parallel regions (its copies and the Adam kernel, which asks ``torch.get_num_threads()``).
    """
    global _base_threads
    if _base_threads is None:
        _base_threads = torch.get_num_threads()
    n = settings.OPTIM_THREADS.get()
    if n is None:
        share = shared_host_default(_base_threads)
        if share is not None:
            logger.info(
                "roundpipe: %s ranks on this host and one intra-op thread each (torchrun sets "
                "OMP_NUM_THREADS=1): the optimizer thread uses %d; set %s to choose",
                os.environ.get("LOCAL_WORLD_SIZE"),
                share,
                settings.OPTIM_THREADS.name,
            )
            torch.set_num_threads(share)
            return
        torch.set_num_threads(single_process_default(issuing_devices(), _base_threads) or _base_threads)
        return
    torch.set_num_threads(n)


def _pool_changed() -> None:
    """``configure`` chose another pool (or thread count): the optimizer thread, which took its count for the
    pool it started with, sets it again before its next kernel (the count is per thread: only it can)."""
    _recount.set()


settings.on_change(settings.DEVICES, _pool_changed)
settings.on_change(settings.OPTIM_THREADS, _pool_changed)


#: Cores left to each GPU's issuing threads (its device thread, autograd's backward thread for it, the
#: main thread's share) when the host optimizer would otherwise take them all.
RESERVED_SINGLE = 4
#: The fewest optimizer threads the per-GPU share gives on hosts of 8 cores or more (fewer make the
#: step of a 1.7B model longer than the iteration it hides behind: 4 threads, 0.8-1.1 s on 2 H200s).
MIN_SHARED_THREADS = 8


def issuing_devices() -> int:
    """How many GPUs this process issues work to (``RPP_DEVICES``; CPU workers count as one)."""
    from roundpipe.devices import backend

    try:
        devices = backend.parse_devices(settings.DEVICES.get())
    except (RuntimeError, ValueError):  # a bad RPP_DEVICES is reported where the pool is created
        return 1
    return max(1, sum(1 for d in devices if backend.is_cuda(d)))


def single_process_default(devices: int = 1, threads: Optional[int] = None) -> Optional[int]:
    """The optimizer thread count of a process that does not share its host with other ranks and drives
    ``devices`` GPUs: each GPU's share of torch's thread count less ``RESERVED_SINGLE``, but at least
    ``MIN_SHARED_THREADS`` (or torch's count less 4, if smaller); None below 8 threads (keep torch's).

    An Adam step on every core starves the threads that issue the GPU work while the step runs. Measured
    on a 16-core host with one H100 (qwen3-1.7b, 8 x 4096): a compact-state step on 16 threads held the
    GPU idle for seconds (first timed iteration 3.6 s against 0.98 s), on 12 its iterations equal the
    GPU's and the step itself ran faster; qwen3-8b's compact step took 2.2-2.6 s on 12 threads against
    3.6-4.6 s on 16. With two GPUs on a 32-core host (2 x H200, qwen3-1.7b 16 x 4096) 28 threads ran
    1.039-1.050 s per iteration, 20 threads 1.028 s, 12 threads 1.000 s and 8 threads 1.007 s (the step
    0.38, 0.44, 0.49, 0.59 s, hidden in each case): twice the issuing threads need twice the cores
    (docs/benchmarks.md)."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        return None
    n = torch.get_num_threads() if threads is None else threads
    if n < 8:
        return None
    return max(min(MIN_SHARED_THREADS, n - RESERVED_SINGLE), n // max(1, devices) - RESERVED_SINGLE)


def shared_host_default(threads: Optional[int] = None) -> Optional[int]:
    """The optimizer thread count when several ranks share this host and torch was left with one
    intra-op thread, else None (keep torch's setting).

    torchrun sets ``OMP_NUM_THREADS=1`` when it starts several ranks per host, which would make the host
    Adam step single-threaded, several times slower than the iteration it must hide behind. Each rank's
    optimizer then gets its share of the cores this process may run on (:func:`rank_share`).
    """
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if ranks <= 1 or (torch.get_num_threads() if threads is None else threads) != 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = rank_share(cores, ranks)
    return share if share > 1 else None


RESERVED_PER_RANK = 2


def rank_share(cores: int, ranks: int) -> int:
    """Optimizer threads of one of ``ranks`` ranks sharing ``cores``: an equal share, less two cores for
    the rank's device and main threads (they issue the GPU work while the step runs) when the share is
    at least 6. Measured on a 16-core host (qwen3-1.7b, one rank beside a second host Adam as a
    second rank would run): 6 threads each instead of 8 slowed the iteration by 21% instead of 35%,
    and cost nothing alone (docs/benchmarks.md)."""
    share = max(1, cores // ranks)
    return share - RESERVED_PER_RANK if share >= 6 else share


def controller() -> None:
    """Optimizer stream thread function: run queued kernels in order until OPTIM_STOP."""
    assert _thread is not None
    try:
        _set_thread_count()
    except ValueError as exc:
        report_failure(OptimizerStepError(str(exc)))
        return
    while True:
        item = kernel_queue.get()
        try:
            if item is OPTIM_STOP:
                return
            if _recount.is_set():
                _recount.clear()
                try:
                    _set_thread_count()
                except ValueError as exc:  # a bad RPP_OPTIM_THREADS set since the start
                    report_failure(OptimizerStepError(str(exc)))
            fn, args, kwargs = item
            _thread.is_active = True
            try:
                # While the CPU streams check their order, the kernel's host reads and writes are checked
                # against the streams' work (a gradient read before its download was synchronized).
                with cpu_streams.host_checks():
                    fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - surfaced in the caller's thread
                err = OptimizerStepError(f"optimizer step failed in {getattr(fn, '__qualname__', fn)!r}: {exc!r}")
                err.__cause__ = exc
                report_failure(err)
            finally:
                _thread.is_active = False
                note_progress()
        finally:
            kernel_queue.task_done()


def _ensure_started() -> None:
    global _thread
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = RoundPipeThread(controller, name="roundpipe-optimizer")
            _thread.start()


def submit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Queue ``fn(*args, **kwargs)`` on the optimizer stream; runs inline when already on it."""
    if on_thread():
        fn(*args, **kwargs)
        return
    _ensure_started()
    kernel_queue.put((fn, args, kwargs))


def on_thread() -> bool:
    """Whether the current thread is the optimizer stream."""
    return _thread is not None and threading.current_thread() is _thread


def synchronize() -> None:
    """Block until every queued optimizer kernel has run, then raise the first failure, if any."""
    from roundpipe.devices.threads import POLL_S, current_failure

    if on_thread() or _thread is None:
        return
    # Queue.join() cannot time out, so wait on an event that a marker kernel sets; poll the failure
    # slot meanwhile so a crashed kernel never leaves the caller hanging.
    done = threading.Event()
    kernel_queue.put((done.set, (), {}))
    while not done.wait(POLL_S):
        if current_failure() is not None or not _thread.is_alive():
            break
    from roundpipe.devices.threads import raise_if_failed

    raise_if_failed("optimizer step")


def shutdown() -> None:
    """Stop the optimizer thread after the queued work."""
    global _thread
    if _thread is not None and _thread.is_alive():
        kernel_queue.put(OPTIM_STOP)
        _thread.join(timeout=10)
    _thread = None


atexit.register(shutdown)
