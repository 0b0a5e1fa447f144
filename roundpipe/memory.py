"""Host memory for the model: pinned (page-locked) storage so uploads run as fast, asynchronous DMA.

'alloc' packs the tensors into a few large pinned arenas (fastest transfers). The caching host
allocator rounds every pinned allocation up to a power of two, so pinning tensor by tensor can cost up
to 2x memory; arenas whose size is already a power of two waste only the tail of the last one. 'register' pins the existing storage in place with
cudaHostRegister (no extra memory, ~10% slower transfers, CUDA only). 'off' leaves memory pageable: with
mmap-loaded weights Linux pages them in on demand, which lets LoRA train base models larger than RAM.
Pinning is skipped on CPU workers (there is no device to transfer to).
"""

from __future__ import annotations

from typing import Iterator, List, Literal

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


ARENA_BYTES = 1 << 30
_ALIGN = 64  # bytes; keeps every tensor's start aligned for vectorised host code and DMA


def pack_into_arenas(tensors: List[torch.Tensor], pin: bool, arena_bytes: int = ARENA_BYTES) -> List[torch.Tensor]:
    """Move ``tensors`` (their ``.data``) into shared byte arenas; returns the arenas.

    First-fit decreasing by size. Each arena is a power of two of at least ``arena_bytes`` bytes (one
    tensor larger than that gets an arena of its own next power of two, which later tensors fill).
    Tensor objects stay the same, so references held elsewhere (optimizers, hooks) stay valid.
    """
    def size_of(t: torch.Tensor) -> int:
        return (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN

    arenas: List[torch.Tensor] = []
    used: List[int] = []
    for t in sorted(tensors, key=size_of, reverse=True):
        need = size_of(t)
        if need == 0:
            continue
        slot = next((i for i, u in enumerate(used) if arenas[i].numel() - u >= need), None)
        if slot is None:
            cap = max(arena_bytes, 1 << (need - 1).bit_length())
            arenas.append(torch.empty(cap, dtype=torch.uint8, pin_memory=pin))
            used.append(0)
            slot = len(arenas) - 1
        start = used[slot]
        view = arenas[slot][start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
        used[slot] = start + need
    return arenas


def pin_module_alloc(mod: nn.Module) -> None:
    """Move parameters and buffers of ``mod`` into pinned arenas (tensor objects are kept)."""
    todo = [t for t in _tensors(mod) if t.device.type == "cpu" and not t.is_pinned() and t.is_contiguous()]
    pack_into_arenas(todo, pin=True)
    for t in _tensors(mod):  # non-contiguous leftovers: pinned one by one
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
