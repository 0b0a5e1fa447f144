"""How many GPUs this process will see, counted without torch and without starting CUDA.

``import roundpipe`` chooses the CUDA caching allocator's settings (``roundpipe.devices.allocator``), which
torch reads once, when CUDA starts, and the choice depends on the pool's GPU count. Importing torch to count
them cost the command line's ``--help``, ``--version`` and configuration errors about 1.5 s, so the count is
taken here from NVML's C library (what ``pynvml`` wraps and what torch's own ``_device_count_nvml`` calls)
or, without it, from ``/proc/driver/nvidia/gpus``; ``CUDA_VISIBLE_DEVICES`` narrows either as CUDA does.
"""

from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Union

PROC_GPUS = "/proc/driver/nvidia/gpus"
"""One entry per GPU the NVIDIA driver knows (Linux), when NVML's library cannot be loaded."""


def visible_devices(var: Optional[str]) -> Optional[Union[List[int], List[str]]]:
    """``CUDA_VISIBLE_DEVICES`` read as CUDA reads it: None when unset (every GPU), else the ordinals up to the
    first that is not one (``0,1,x,3`` is ``0,1``), or the ``GPU-`` / ``MIG-`` ids; a repeated entry makes
    the list empty, as it hides every GPU."""
    if var is None:
        return None
    entries = [e.strip() for e in var.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        ids: List[str] = []
        for e in entries:
            if not e.startswith(prefix):
                break
            if e in ids:
                return []
            ids.append(e)
        return ids
    ordinals: List[int] = []
    for e in entries:
        digits = e[: len(e) - len(e.lstrip("+-0123456789"))] if e else ""
        try:
            n = int(digits)
        except ValueError:
            break
        if n < 0:
            break
        if n in ordinals:
            return []
        ordinals.append(n)
    return ordinals


def physical_gpus() -> Optional[int]:
    """The GPUs the driver exposes to this container: NVML's count, else ``/proc/driver/nvidia/gpus``'s
    entries, else 0 when neither exists (no NVIDIA driver); None when NVML is there but fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        nvml = None
    if nvml is not None:
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            count = ctypes.c_uint(0)
            return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
        finally:
            nvml.nvmlShutdown()
    try:
        return len(os.listdir(PROC_GPUS))
    except OSError:
        return 0


def count_visible_gpus() -> Optional[int]:
    """The GPUs CUDA would show this process (``torch.cuda.device_count()`` once CUDA starts), or None when
    unknown. Visible ordinals past the last GPU end the list, as in CUDA; ``GPU-`` / ``MIG-`` ids are counted,
    not matched against the GPUs' own (a mistyped id counts here, and CUDA shows no GPU for it). On one H200
    this matched torch's count for each ordinal list, in about 20 ms."""
    visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None and not visible:
        return 0
    physical = physical_gpus()
    if visible is None or physical is None:
        return physical if visible is None else len(visible)
    if isinstance(visible[0], str):
        return min(len(visible), physical)
    for index, ordinal in enumerate(visible):
        if int(ordinal) >= physical:
            return index
    return len(visible)


__all__ = ["count_visible_gpus", "physical_gpus", "visible_devices"]
