"""Small helpers shared across RoundPipe components: the byte unit, a caller's location, module sizes.
torch is imported only by the helpers that read modules, so that the CLI's answers that need no model
(``roundpipe plan``, configuration errors) can use this module without loading it."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from torch import nn

#: Bytes in a GiB, as a float (sizes are divided by it for messages and budgets).
GiB = float(1 << 30)

#: How frozen base weights can be kept in host memory (``roundpipe.host.formats``): named here, without torch,
#: so that the CLI checks its flags before torch loads.
BASE_FORMATS = ("bf16", "fp8", "int8", "nf4", "mxfp4")


def get_call_location(depth: int) -> str:
    """The caller ``depth`` frames up, as 'filename:lineno' (default names of models)."""
    frame = sys._getframe(depth + 1)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def packed_parts(t: Any) -> Optional[Dict[str, Any]]:
    """The packed host tensors of a frozen weight in a packed format (``roundpipe.host.formats.FrozenWeight``,
    told by its ``packed`` dict, so the layers below the host one need not import it), else None."""
    packed = getattr(t, "__dict__", {}).get("packed")
    return packed if isinstance(packed, dict) else None


def host_nbytes(t: Any) -> int:
    """Bytes a host tensor holds: the packed bytes of a frozen weight in a packed format
    (``roundpipe.host.formats.FrozenWeight.host_nbytes``), ``numel * element_size`` otherwise."""
    packed = packed_parts(t)
    if packed is not None:
        return sum(v.numel() * v.element_size() for v in packed.values())
    return t.numel() * t.element_size()


def get_model_size(model: nn.Module, recurse: bool = True) -> int:
    """Bytes of the parameters and buffers of ``model`` in host memory (each tensor counted once; a
    packed frozen weight by its packed bytes)."""
    seen = {}
    for t in list(model.parameters(recurse)) + list(model.buffers(recurse)):
        seen[id(t)] = host_nbytes(t)
    return sum(seen.values())


def get_model_compute_size(model: nn.Module) -> float:
    """A size that stands in for a layer's compute time before any is measured: the bytes of its
    parameters and buffers, with embedding tables counted at 1% (a lookup reads only the rows it needs,
    so a 150k-token embedding is fast however large; counting it in full made the first plan treat it as
    the slowest layer and group everything else around it)."""
    from torch import nn

    lookup = {
        id(t)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for t in m.parameters(recurse=False)
    }
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * t.element_size() * (0.01 if id(t) in lookup else 1.0)
    return float(sum(seen.values()))


def get_model_active_size(model: nn.Module, recurse: bool = True) -> int:
    """Bytes of the parameters of ``model`` that require grad."""
    seen = {id(p): p.numel() * p.element_size() for p in model.parameters(recurse) if p.requires_grad}
    return sum(seen.values())


#: Set to True on every module of a model that ``roundpipe.models.fp8.prepare`` converted for FP8 GEMMs: a
#: ``RoundPipe`` under ``RoundPipeRunConfig(fp8=True)`` checks it (the conversion lives above it, with the models).
FP8_PREPARED = "_roundpipe_fp8_prepared"
