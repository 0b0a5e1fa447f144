"""Device backends: CUDA GPUs, or CPU workers that run the same runtime without an accelerator.

The runtime talks to devices only through this module (streams, events, RNG, memory queries), so the
scheduler, threads, recompute, optimizer thread and autograd integration run unchanged on CPU workers:
there a "stream" runs work synchronously in the calling thread and events are complete once recorded
(``roundpipe.devices.cpu_streams``, which can also check the order between streams: ``RPP_DEBUG_CHECK_STREAMS``).

``RPP_DEVICES`` picks the devices: ``cpu:N`` gives N CPU workers, ``cuda`` all GPUs, ``cuda:0,2`` some.
Default: all GPUs where CUDA is available, else ``cpu:1``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, ContextManager, List, Optional, Union

import torch

from roundpipe.devices import allocator, cpu_streams
from roundpipe.devices.cpu_streams import CpuEvent, CpuStream

Stream = Union[torch.cuda.Stream, CpuStream]
Event = Union[torch.cuda.Event, CpuEvent]

# CPU workers share one process-wide RNG (torch's default CPU generator). Holding this lock around each
# stage's compute makes "snapshot RNG state, run the stage" and "restore it, recompute" atomic with
# respect to the other CPU workers, so recompute sees the forward's dropout masks.
cpu_compute_lock = threading.RLock()


def parse_devices(spec: str) -> List[torch.device]:
    """Resolve an ``RPP_DEVICES`` value (empty: the default) into the list of devices to run on."""
    spec = spec.strip().lower()
    if not spec:
        spec = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu:1"
    kind, _, rest = spec.partition(":")
    if kind == "cpu":
        try:
            n = int(rest) if rest else 1
        except ValueError:
            raise ValueError(
                f"RPP_DEVICES={spec!r}: expected 'cpu:N' with an integer N, e.g. RPP_DEVICES=cpu:2"
            ) from None
        if n < 1:
            raise ValueError(f"RPP_DEVICES={spec!r}: need at least one CPU worker")
        return [torch.device("cpu") for _ in range(n)]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"RPP_DEVICES={spec!r} asks for CUDA but torch.cuda.is_available() is False; use RPP_DEVICES=cpu:N"
            )
        count = torch.cuda.device_count()
        if not rest:
            return [torch.device("cuda", i) for i in range(count)]
        try:
            ids = [int(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"RPP_DEVICES={spec!r}: expected 'cuda' or 'cuda:0,1'") from None
        bad = [i for i in ids if not 0 <= i < count]
        if bad or not ids:
            raise ValueError(f"RPP_DEVICES={spec!r}: GPU ids {bad or ids} not in 0..{count - 1}")
        return [torch.device("cuda", i) for i in ids]
    raise ValueError(f"RPP_DEVICES={spec!r}: expected 'cpu:N', 'cuda' or 'cuda:0,1'")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def new_stream(device: torch.device, priority: int = 0, name: str = "") -> Stream:
    """A stream on ``device``; ``name`` (e.g. ``cpu-worker0.upstream``) names a CPU worker's stream in
    the order checks' errors."""
    if is_cuda(device):
        return torch.cuda.Stream(device=device, priority=priority)
    return CpuStream(device, name)


def new_event(device: torch.device) -> Event:
    if is_cuda(device):
        return torch.cuda.Event()
    return CpuEvent()


def record_event(stream: Stream) -> Event:
    """Record a new event on ``stream`` and return it."""
    if isinstance(stream, CpuStream):
        return stream.record_event()
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


_NULL = contextlib.nullcontext()  # reusable: nullcontext keeps no state between uses


def use_stream(stream: Stream) -> ContextManager[Any]:
    """Make ``stream`` current for the kernels issued in this block (on CPU workers a no-op, or, while
    ``cpu_streams`` checks the order, the block whose ops it records on ``stream``)."""
    if isinstance(stream, CpuStream):
        return cpu_streams.use(stream) or _NULL
    return torch.cuda.stream(stream)


def get_rng_state(device: torch.device) -> torch.Tensor:
    if is_cuda(device):
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if is_cuda(device):
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def compute_guard(device: torch.device) -> ContextManager[Any]:
    """Serialise stage compute across CPU workers (see ``cpu_compute_lock``); GPUs run freely. In stress
    mode (``RPP_DEBUG_STRESS_DELAY_S``) CPU workers compute concurrently too, as GPUs do, so races between
    workers' compute, transfers and the optimizer thread can show on CPU (the shared RNG is then not
    isolated: run models without dropout in that mode)."""
    if is_cuda(device):
        return _NULL
    from roundpipe.devices import threads

    if threads.stress_limit() > 0:
        return _NULL
    return cpu_compute_lock


def init_worker_thread(device: torch.device, intra_op_threads: int) -> None:
    """Prepare a device's controller thread (on that thread, before its first job). A CPU worker computes
    with ``intra_op_threads`` (torch's count on the thread that created the device), its BLAS included:
    ``torch.set_num_threads`` sets MKL's count per thread, so a new thread's matrix products would use MKL's
    default (every core) in an OpenMP team that spins between calls. Measured with ``bench/job_cost.py`` on
    2 cores and torch at one thread: a spinning thread beside each worker, 2 workers 3.4x slower than 1."""
    if not is_cuda(device):
        torch.set_num_threads(max(1, intra_op_threads))


def gpu_memory_cap_bytes() -> Optional[int]:
    """The per-GPU memory cap (``RPP_GPU_MEMORY``), or None for the whole GPU."""
    from roundpipe import settings

    gib = settings.GPU_MEMORY_GIB.get()
    return None if gib is None else int(gib * 2**30)


def apply_memory_cap(device: torch.device) -> None:
    """Limit this process's caching allocator on ``device`` to ``RPP_GPU_MEMORY`` (a no-op without a cap
    or on CPU workers), so a run on a large GPU behaves as on a smaller card: allocations beyond the cap
    raise ``torch.OutOfMemoryError`` as they would there."""
    cap = gpu_memory_cap_bytes()
    if cap is None or not is_cuda(device):
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        raise ValueError(
            f"RPP_GPU_MEMORY={cap / 2**30:.1f} GiB is more than {device}'s {total / 2**30:.1f} GiB; lower it "
            "or unset it"
        )
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    if not allocator.expandable_segments_requested():
        # Measured on an H100 capped at 24 GiB (qwen3-8b LoRA, 131,072 tokens): fixed-size segments
        # left the allocator unable to serve a backward stage that fits with expandable ones.
        # ``import roundpipe`` sets them when it can (``allocator.prefer_expandable_segments``); here
        # the user chose otherwise, or CUDA had started first.
        logging.getLogger("roundpipe").warning(
            "RPP_GPU_MEMORY caps %s at %.1f GiB: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before "
            "the process starts, or long sequences may fail from fragmentation well under the cap",
            device,
            cap / 2**30,
        )


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes (host available memory for CPU workers); under a GPU memory
    cap, what this process may still allocate: the cap less what its allocator holds."""
    if is_cuda(device):
        free, _ = torch.cuda.mem_get_info(device)
        cap = gpu_memory_cap_bytes()
        if cap is not None:
            free = min(free, max(0, cap - torch.cuda.memory_reserved(device)))
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        return int(pages * os.sysconf("SC_PAGE_SIZE"))


def capacity_bytes(device: torch.device) -> int:
    """What this process could hold on ``device`` at most now: free memory plus what its own allocator
    caches unused (CUDA, under ``RPP_GPU_MEMORY``), or the host's available memory for CPU workers."""
    if not is_cuda(device):
        return free_memory_bytes(device)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    total = free + cached
    cap = gpu_memory_cap_bytes()
    if cap is not None:
        total = min(total, cap - torch.cuda.memory_allocated(device))
    return int(max(0, total))


def host_budget_bytes() -> int:
    """Host bytes this process may still allocate: ``RPP_HOST_MEMORY`` less what it holds now, else the
    available memory less a margin (5% of the total, at least 2 GiB) for the rest of the system."""
    import psutil

    from roundpipe import settings

    gib = settings.HOST_MEMORY_GIB.get()
    if gib is not None:
        return int(max(0, gib * 2**30 - psutil.Process().memory_info().rss))
    vm = psutil.virtual_memory()
    return int(max(0, vm.available - max(2 * 2**30, 0.05 * vm.total)))


def pin_enabled() -> bool:
    """Pinned host memory only pays (and only works) when CUDA is present."""
    return torch.cuda.is_available()


def empty_host_cache() -> None:
    """Give the pinned blocks torch's host caching allocator holds unused back to the system. Activation
    checkpoints come from that allocator, which keeps every block it ever served for reuse by a request
    of the same (power-of-two) size: after calls of another length the old blocks would stay pinned."""
    if not torch.cuda.is_available():
        return
    for fn in (
        getattr(getattr(torch, "accelerator", None), "memory", None)
        and getattr(torch.accelerator.memory, "empty_host_cache", None),
        getattr(torch._C, "_accelerator_emptyHostCache", None),
        getattr(torch._C, "_host_emptyCache", None),
    ):
        if fn is not None:
            fn()
            return


def empty_host_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor shaped like ``t``, pinned when CUDA is in use (fast async copies)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin_enabled())
