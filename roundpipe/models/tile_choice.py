"""Which decoder layers run sequence-tiled, and in tiles of how many positions.

The families whose record in :data:`roundpipe.models.families.FAMILIES` says ``tiles`` name the Hugging
Face classes (layer, attention, MLP, RMSNorm) that :mod:`roundpipe.models.tiling` reproduces op for op;
a layer of those classes tiles unless something would see the tiles instead of the sequence (hooks) or
compute other than a position-wise projection (a projection that is not ``nn.Linear`` or a PEFT layer
around one). Apart from the tiled forward because the choice is read elsewhere too (the preset plans its
stages' activations with it, ``roundpipe.models.causal_lm``) and changes with the family table, not with
the tiled computation.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from roundpipe import settings
from roundpipe.models import families, kernels

Tiles = List[Tuple[int, int]]
"""``[(start, stop), ...]``: the positions of each tile."""


_classes: Optional[Dict[str, Tuple[type, ...]]] = None


def _supported() -> Dict[str, Tuple[type, ...]]:
    """Hugging Face classes the tiled forward reproduces op for op, by role, from the families whose
    record says ``tiles`` (exact classes: a subclass or another family's look-alike may compute something
    else)."""
    global _classes
    if _classes is None:
        roles: Dict[str, List[type]] = {"layer": [], "attention": [], "mlp": [], "norm": []}
        for family in families.FAMILIES:
            names = family.fused_kernels
            if not family.tiles or names is None:
                continue
            module = importlib.import_module(names.module)
            roles["layer"].append(getattr(module, names.decoder_layer))
            roles["attention"].append(getattr(module, names.attention))
            roles["mlp"].append(getattr(module, names.mlp))
            roles["norm"].append(getattr(module, names.norm))
        _classes = {role: tuple(classes) for role, classes in roles.items()}
    return _classes


def _is(module: Any, role: str) -> bool:
    return isinstance(module, nn.Module) and kernels.base_class(module) in _supported()[role]


def _linear_like(module: Any) -> bool:
    """``nn.Linear`` (quantized subclasses included) or a PEFT layer around one: position-wise."""
    if isinstance(module, nn.Linear):
        return True
    get_base = getattr(module, "get_base_layer", None)
    return callable(get_base) and isinstance(get_base(), nn.Linear)


def tileable(layer: nn.Module) -> bool:
    """Whether ``layer`` (a decoder layer, possibly fused or PEFT-adapted) can run tiled."""
    if not _is(layer, "layer"):
        return False
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    if not (_is(attn, "attention") and _is(mlp, "mlp")):
        return False
    if not (
        _is(getattr(layer, "input_layernorm", None), "norm")
        and _is(getattr(layer, "post_attention_layernorm", None), "norm")
    ):
        return False
    if not all(_linear_like(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if not all(_linear_like(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
        return False
    if hasattr(attn, "q_norm") and not (_is(attn.q_norm, "norm") and _is(attn.k_norm, "norm")):
        return False
    return not kernels.has_hooks(layer.modules())  # a hook would see tiles instead of the full sequence


def rows_per_tile(batch: int, seq: int, tile_tokens: Optional[int] = None) -> int:
    """Sequence positions per tile for a ``[batch, seq]`` input (``tile_tokens`` counts the tokens of
    all rows; default ``RPP_SEQ_TILE``); ``seq`` or more means the layer runs untiled."""
    tile = settings.SEQ_TILE.get() if tile_tokens is None else tile_tokens
    if tile <= 0 or batch * seq <= tile:
        return seq
    return max(1, tile // batch)


def tile_bounds(seq: int, rows: int) -> Tiles:
    """``[(start, stop), ...]`` covering ``range(seq)`` in tiles of ``rows`` (the last may be shorter)."""
    return [(s, min(s + rows, seq)) for s in range(0, seq, rows)]
