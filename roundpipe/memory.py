"""Host memory for the model: pinned (page-locked) storage so uploads run as fast, asynchronous DMA.

'alloc' copies each tensor into a pinned allocation (fastest transfers; the caching host allocator
rounds sizes up, up to 2x memory for odd sizes). 'register' pins the existing storage in place with
cudaHostRegister (no extra memory, ~10% slower transfers, CUDA only). 'off' leaves memory pageable: with
mmap-loaded weights Linux pages them in on demand, which lets LoRA train base models larger than RAM.
Pinning is skipped on CPU workers (there is no device to transfer to).
"""

from __future__ import annotations

from typing import Iterator, Literal

import torch
from torch import nn

from roundpipe import backend

PinMode = Literal["alloc", "register", "off"]


def _tensors(mod: nn.Module) -> Iterator[torch.Tensor]:
    seen = set()
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def pin_module_alloc(mod: nn.Module) -> None:
    """Move parameters and buffers of ``mod`` into pinned host allocations (tensor objects are kept)."""
    for t in _tensors(mod):
        if t.device.type == "cpu" and not t.is_pinned():
            t.data = t.data.pin_memory()


def pin_module_register(mod: nn.Module) -> None:
    """Pin parameters and buffers of ``mod`` in place with cudaHostRegister."""
    cudart = torch.cuda.cudart()
    for t in _tensors(mod):
        if t.device.type != "cpu" or t.is_pinned() or t.numel() == 0:
            continue
        if not t.is_contiguous():
            t.data = t.data.contiguous()
        nbytes = t.untyped_storage().nbytes()
        err = cudart.cudaHostRegister(t.untyped_storage().data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({err}) for a tensor of {nbytes} bytes; use pin_model='alloc' or 'off'")


def pin_module(mod: nn.Module, mode: PinMode) -> None:
    """Pin ``mod``'s host memory per ``mode`` (a no-op without CUDA)."""
    if mode not in ("alloc", "register", "off"):
        raise ValueError(f"pin_model={mode!r}: expected 'alloc', 'register' or 'off'")
    if mode == "off" or not backend.pin_enabled():
        return
    if mode == "alloc":
        pin_module_alloc(mod)
    else:
        pin_module_register(mod)
