"""The ``RPP_*`` names roundpipe no longer reads, and what to use instead.

A user's shell or launcher may still export a renamed or removed setting. Ignoring it in silence would
run with a default the user did not choose, so ``import roundpipe`` warns once, naming the replacement
of each such variable (or saying that it is no setting at all, e.g. a typo). Plain data and ``os``:
cheap enough to run at import, before torch.
"""

from __future__ import annotations

import warnings
from typing import Collection, List, Mapping

#: Old name -> what became of it.
RETIRED = {
    "RPP_STRESS_DELAY_S": "renamed RPP_DEBUG_STRESS_DELAY_S",
    "RPP_CHECK_STREAMS": "renamed RPP_DEBUG_CHECK_STREAMS",
    "RPP_VERBOSE_TIMER": "renamed RPP_DEBUG_TIMER",
    "RPP_SPLIT_FUSED": "renamed RPP_DEBUG_SPLIT_FUSED",
    "RPP_PEER_HANDOFF": "renamed RPP_DEBUG_PEER_HANDOFF",
    "RPP_GRAPHS": "renamed RPP_DEBUG_GRAPHS",
    "RPP_TILE_ATTENTION": "renamed RPP_DEBUG_TILE_ATTENTION",
    "RPP_FUSED_KERNELS": "renamed RPP_DEBUG_FUSED_KERNELS (or a model preset's fused_kernels= argument)",
    "RPP_ADAM_IMPL": "renamed RPP_DEBUG_ADAM_IMPL",
    "RPP_DEVICE_SAVED_GB": "renamed RPP_DEBUG_DEVICE_SAVED_GB",
    "RPP_GRAD_STREAM": "removed: parameter gradients always download on a stream of their own",
    "RPP_GC_FREEZE": "removed: a model's first step always freezes the objects alive then (gc.freeze)",
    "RPP_FUSED_LAYERS": "removed: a fused decoder layer always runs as one compiled op",
    "RPP_FUSED_STAGING": "renamed RPP_DEBUG_FUSED_STAGING",
    "RPP_GRAD_BUFFERS": "removed: the step mode (RPP_STEP_MODE) decides the host buffers",
    "RPP_STAGE_PARAMS": "removed: staged steps always stage (RPP_STEP_MODE=streamed does not)",
    "RPP_GRAD_INTO_MODEL": "removed: gradient downloads reuse the weights' buffers wherever the step cycle allows",
}


def unknown_variables(environ: Mapping[str, str], known: Collection[str]) -> List[str]:
    """One line per ``RPP_*`` variable of ``environ`` not in ``known``: what replaced it, or that it is no setting."""
    unknown = sorted(n for n in environ if n.startswith("RPP_") and n not in known)
    return [f"{n}: {RETIRED.get(n, 'not a roundpipe setting (see roundpipe.settings.REGISTRY)')}" for n in unknown]


def warn_unknown(environ: Mapping[str, str], known: Collection[str]) -> None:
    """One warning for all of ``environ``'s unknown ``RPP_*`` variables (none when there are none)."""
    lines = unknown_variables(environ, known)
    if lines:
        warnings.warn("roundpipe ignores these environment variables:\n  " + "\n  ".join(lines), stacklevel=3)
