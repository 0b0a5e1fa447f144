"""Profiler annotations: named ranges in NVTX (nsys) or torch.profiler timelines.

``RPP_PROFILER=nvtx`` emits NVTX ranges, ``RPP_PROFILER=torch`` ``record_function`` ranges; unset (or
0 / off), the annotations cost nothing; any other value is an error. RoundPipe marks each device job
(``roundpipe.devices.device``) and each blocking wait (``roundpipe.devices.threads``).

Attributes:
    PROFILER_TYPE: The profiler selected from the environment, or None.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch

from roundpipe import settings

# Read once: the choice decides at import whether job labels are built at all.
PROFILER_TYPE: Optional[str] = settings.PROFILER.get()


def annotate(name: str, color: Optional[str] = None) -> ContextManager[object]:
    """A context manager that marks ``name`` on the profiler timeline (a no-op without a profiler)."""
    if PROFILER_TYPE == "nvtx" and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    if PROFILER_TYPE == "torch":
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
