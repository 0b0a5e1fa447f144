"""The CUDA caching allocator's settings, which torch reads once, when CUDA starts: the variable
``import roundpipe`` sets (expandable segments, unless the user chose the allocator's settings) and whether
expandable segments are asked for. Only the environment, roundpipe's settings and NVML's GPU count are read
here, without importing torch, so ``import roundpipe`` can call :func:`prefer_expandable_segments` before anything
starts CUDA (and the command line answers ``--help`` at once); ``graphs.allocator_allows`` may withdraw
roundpipe's own choice later (:data:`EXPANDABLE_BY_ROUNDPIPE`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Literal, Optional, Sequence

if TYPE_CHECKING:
    import torch

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_BY_ROUNDPIPE: Optional[str] = None
"""The variable ``import roundpipe`` set to ``expandable_segments:True`` (None: it set none), so that the
graphs can withdraw that choice (``withdraw_own_expandable_segments``) without overriding a user's."""

_withdraw_lock = threading.Lock()
"""Serialises :func:`withdraw_own_expandable_segments`: every device thread asks at its first job, at once."""


EXPANDABLE_MAX_DEVICES = 2
"""The largest pool measured to capture graphs with the allocator's expandable segments on. On 4 H200s
(2026-11-28, qwen3-1.7b 16 x 4096) graphed runs with them failed on a device thread ("CUDA driver error:
operation not permitted", or an out-of-memory error with 139 GiB free), also when they were turned off at the
first job (segments made before stay expandable); 2 GPUs graphed with them (docs/benchmarks.md)."""


def pool_gpus_from_environment() -> Optional[int]:
    """How many GPUs the pool will use, as far as the environment tells before CUDA starts: the ids in
    ``RPP_DEVICES`` (``cuda:0,1``), else the visible GPUs as NVML counts them without torch
    (``roundpipe.devices.gpu_count``; ``CUDA_VISIBLE_DEVICES`` applies); None when unknown.
    ``roundpipe.configure(devices=...)`` later may choose another pool: ``withdraw_own_expandable_segments``
    covers that case."""
    from roundpipe import settings

    try:
        spec = settings.DEVICES.get()
    except ValueError:  # a bad RPP_DEVICES is reported where the pool is created
        return None
    kind, _, rest = spec.strip().lower().partition(":")
    if kind == "cpu":
        return 0
    if kind == "cuda" and rest:
        return len([x for x in rest.split(",") if x.strip()])
    from roundpipe.devices.gpu_count import count_visible_gpus  # neither torch nor CUDA

    return count_visible_gpus()


def prefer_expandable_segments() -> Optional[str]:
    """Give torch's CUDA caching allocator expandable segments, when nobody chose its settings and CUDA
    has not started (the allocator reads them once, when CUDA starts); returns the variable set, or None.

    Fixed-size segments leave gaps that a long sequence's stage cannot use: qwen3-8b LoRA at 131,072
    tokens under a 24 GiB cap failed in a backward stage with 3.8 GiB free, and ran with expandable
    segments. A user's own ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` (even
    ``expandable_segments:False``) is left as it is. Nor are they chosen for a pool of more than
    :data:`EXPANDABLE_MAX_DEVICES` GPUs whose jobs may be graphed (``RPP_DEBUG_GRAPHS`` not ``0``): graph
    captures failed with them there. Called by ``import roundpipe``."""
    if any(os.environ.get(name, "").strip() for name in ALLOC_CONF_VARS):
        return None
    from roundpipe import settings

    gpus = pool_gpus_from_environment()
    try:
        graphs = settings.DEBUG_GRAPHS.get()
    except ValueError:  # reported where the graphs read it
        graphs = "auto"
    if gpus is not None and gpus > EXPANDABLE_MAX_DEVICES and graphs != "0":
        return None
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None:
        cuda = getattr(torch_mod, "cuda", None)
        if cuda is None or cuda.is_initialized():
            return None
    name = ALLOC_CONF_VARS[0] if _torch_at_least(2, 9) else ALLOC_CONF_VARS[1]  # renamed in torch 2.9
    global EXPANDABLE_BY_ROUNDPIPE
    os.environ[name] = "expandable_segments:True"
    EXPANDABLE_BY_ROUNDPIPE = name
    return name


def expandable_segments_requested() -> bool:
    """Whether the allocator's variables (ours or the user's) ask for expandable segments."""
    conf = ",".join(os.environ.get(name, "") for name in ALLOC_CONF_VARS)
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def withdraw_own_expandable_segments() -> Literal["off", "withdrawn", "user"]:
    """Turn off the expandable segments that ``import roundpipe`` chose, for the segments the allocator creates
    from now on. Returns ``"withdrawn"`` when this call turned them off, ``"off"`` when none are asked for
    (withdrawn earlier, or never chosen), ``"user"`` when the user asked for them (theirs are kept).

    Each device thread of a new pool asks at its first job, all at once: the check and the withdrawal happen
    under one lock, so exactly one thread withdraws (two at once once wrote ``os.environ[None]``, a TypeError
    on 4 GPUs)."""
    global EXPANDABLE_BY_ROUNDPIPE
    with _withdraw_lock:
        if not expandable_segments_requested():
            return "off"
        name = EXPANDABLE_BY_ROUNDPIPE
        if name is None:
            return "user"
        import torch

        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:  # torch before 2.9
            setter = torch.cuda.memory._set_allocator_settings
        setter("expandable_segments:False")
        os.environ[name] = "expandable_segments:False"
        EXPANDABLE_BY_ROUNDPIPE = None
        return "withdrawn"


_handle_type_settled = False
"""Whether :func:`settle_expandable_handle_type` made this process's first expandable segment (once is enough:
torch keeps the handle type it chose for the process)."""


def settle_expandable_handle_type(cuda_devices: Sequence["torch.device"]) -> bool:
    """Make torch's CUDA allocator choose its expandable segments' handle type now, on the thread that creates the
    pool, before the device threads make their first segments at once. Returns whether this call allocated.

    Why: torch (2.11 at least) chooses that type once per process, at the first expandable segment any device
    maps. The first mapper sets a process-wide flag to fabric handles, tries ``cuMemCreate``, and, where the
    driver refuses them (``CUDA_ERROR_NOT_PERMITTED`` without an IMEX channel, as on single-host H200s), sets the
    flag to POSIX file descriptors and tries again. A second device's first segment that reads the flag while it
    says "fabric" fails in turn, and then raises "CUDA driver error: operation not permitted" if the flag says
    POSIX by the time it looks again, or reports out of memory if it still says fabric. Each device's allocator
    has its own lock, so only several GPUs race: the first job of a 2-GPU pool failed this way (qwen3-1.7b,
    2026-11-29), and so did 4-GPU graphed runs and a 2-GPU tiled run earlier ("operation not permitted", or out
    of memory with 139 GiB free; docs/benchmarks.md). One allocation here, before any device thread runs, lets
    the type be chosen alone; later segments only read it. Without expandable segments it costs one cached
    block, so it is made whenever the pool has several GPUs."""
    global _handle_type_settled
    if _handle_type_settled or len(cuda_devices) < 2:
        return False
    import torch

    probe = torch.empty(1, dtype=torch.uint8, device=cuda_devices[0])
    del probe
    _handle_type_settled = True
    return True


def _torch_at_least(major: int, minor: int) -> bool:
    try:
        from importlib.metadata import version

        parts = version("torch").split("+")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except Exception:  # noqa: BLE001 - no torch metadata (or an odd version): the old name
        return False
