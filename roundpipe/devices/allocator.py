"""The CUDA caching allocator's settings, which torch reads once, when CUDA starts: the variable
``import roundpipe`` sets (expandable segments, unless the user chose the allocator's settings) and whether
expandable segments are asked for. Only the environment is read here, so ``import roundpipe`` can call
:func:`prefer_expandable_segments` before anything starts CUDA; ``graphs.allocator_allows`` may withdraw
roundpipe's own choice later (:data:`EXPANDABLE_BY_ROUNDPIPE`).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_BY_ROUNDPIPE: Optional[str] = None
"""The variable ``import roundpipe`` set to ``expandable_segments:True`` (None: it set none), so that the
graphs can withdraw that choice (``graphs.allocator_allows``) without overriding a user's."""


def prefer_expandable_segments() -> Optional[str]:
    """Give torch's CUDA caching allocator expandable segments, when nobody chose its settings and CUDA
    has not started (the allocator reads them once, when CUDA starts); returns the variable set, or None.

    Fixed-size segments leave gaps that a long sequence's stage cannot use: qwen3-8b LoRA at 131,072
    tokens under a 24 GiB cap failed in a backward stage with 3.8 GiB free, and ran with expandable
    segments. A user's own ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` (even
    ``expandable_segments:False``) is left as it is. Called by ``import roundpipe``."""
    if any(os.environ.get(name, "").strip() for name in ALLOC_CONF_VARS):
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


def _torch_at_least(major: int, minor: int) -> bool:
    try:
        from importlib.metadata import version

        parts = version("torch").split("+")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except Exception:  # noqa: BLE001 - no torch metadata (or an odd version): the old name
        return False
