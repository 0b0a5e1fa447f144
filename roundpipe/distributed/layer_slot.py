"""A layer's place in the device gradient reduction (``reduce_on="device"``): its reducer
(:class:`LayerSlot`, what ``transfer.download_layer`` calls through ``grad_sync``, with the layer's
presence counts between the download and the step) and the collectives its gradients go in
(:class:`LayerBucket`, :func:`layer_buckets`).

Apart from :mod:`roundpipe.distributed.device_reduce` (the groups, streams and step checks of the whole
reduction) because a layer's layout depends only on its parameters: the same on every rank, and
testable without any group. The slot knows the reduction only as :class:`LayerReduction`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol

import torch
from torch import nn


class LayerReduction(Protocol):
    """What a :class:`LayerSlot` asks of the reduction it belongs to (``DeviceReduction``)."""

    def reduce_layer(
        self, slot: "LayerSlot", cpu_layer: nn.Module, gpu_layer: nn.Module, layer_id: int, device: Any
    ) -> None:
        """Reduce one layer's device gradients (device thread, gradient stream current)."""
        ...


class LayerSlot:
    """One layer's device reduction: the ``grad_sync`` layer reducer that ``transfer.download_layer``
    calls, and the layer's presence counts between the download and the step.

    Attributes:
        index: Position of the layer among all reduced layers (the same on every rank).
        flags_host: Host copy of the layer's last reduced presence counts (one per trainable parameter).
        flags_params: The host parameters the counts refer to, in order.
        flags_valid: Whether the counts belong to the current step (cleared when the step reads them).
    """

    def __init__(self, red: LayerReduction, index: int, model_name: str, layer_id: int) -> None:
        self.red = red
        self.index = index
        self.model_name = model_name
        self.layer_id = layer_id
        self.flags_host: Optional[torch.Tensor] = None
        self.flags_params: List[nn.Parameter] = []
        self.flags_valid = False

    def __call__(self, cpu_layer: nn.Module, gpu_layer: nn.Module, layer_id: int, device: Any) -> None:
        """``grad_sync.LayerReducer``: reduce this layer (device thread, gradient stream current)."""
        self.red.reduce_layer(self, cpu_layer, gpu_layer, layer_id, device)


@dataclass
class LayerBucket:
    """One collective of a layer's reduction: packed (flat buffer, presence counts first in bucket 0)
    or one large gradient reduced in place. Depends only on the layer's parameters: the same on all ranks."""

    indices: List[int]
    dtype: torch.dtype
    numel: int
    packed: bool
    nflags: int = 0


def layer_buckets(
    params: List[nn.Parameter], reduce_dtype: Optional[torch.dtype], bucket_bytes: int
) -> List[LayerBucket]:
    """Buckets of one layer with trainable parameters ``params``: bucket 0 packed, starting with the
    presence counts; small gradients packed up to ``bucket_bytes``; a gradient of at least
    ``bucket_bytes`` (reduced in its own dtype) alone, in place."""
    first = LayerBucket([], reduce_dtype or params[0].dtype, 0, packed=True, nflags=len(params))
    buckets = [first]
    cur = first
    for i, p in enumerate(params):
        dtype = reduce_dtype or p.dtype
        nbytes = p.numel() * dtype.itemsize
        if nbytes >= bucket_bytes and dtype == p.dtype:
            buckets.append(LayerBucket([i], dtype, p.numel(), packed=False))
            continue
        if cur.dtype != dtype or (cur.indices and (cur.numel + p.numel()) * dtype.itemsize > bucket_bytes):
            cur = LayerBucket([], dtype, 0, packed=True)
            buckets.append(cur)
        cur.indices.append(i)
        cur.numel += p.numel()
    return buckets
