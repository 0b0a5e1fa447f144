"""Host memory for the model: pinned (page-locked) storage so uploads run as fast, asynchronous DMA.

'alloc' copies each tensor into a fresh pinned allocation (fast transfers). Tensors of at least ``EXACT_MIN_BYTES`` get
an exact-size allocation (``pinned_empty``: an anonymous mapping registered with CUDA), because torch's caching host
allocator rounds every block up to a power of two, which costs up to 2x memory for odd sizes (a 24 MiB weight takes 32
MiB); smaller ones use the caching allocator. 'register' pins the existing storage in place with cudaHostRegister (no
copy, CUDA only). 'off' leaves memory pageable: with mmap-loaded weights Linux pages them in on demand, which lets LoRA
train base models larger than RAM. Pinning is skipped on CPU workers (there is no device to transfer to).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Callable, Iterator, List, Literal, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.devices import backend
from roundpipe.utils import packed_parts

PinMode = Literal["alloc", "register", "off"]

# Below this size the caching allocator's rounding costs little and its reuse pays.
EXACT_MIN_BYTES = 1 << 20

Registrar = Callable[[int, int], None]  # (address, bytes) -> None
Unregistrar = Callable[[int], None]  # address -> None


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister failed ({err}) pinning {nbytes / 2**20:.1f} MiB of host memory: the host is out of "
            "memory it can page-lock. Free host memory, or lower RoundPipe's use of it: pin_model='off' (model "
            "weights), RPP_STEP_MODE=streamed (no staged copy of the trainable parameters, also with gradient "
            "accumulation); see docs/resolve-oom.md"
        )


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _capturing() -> bool:
    """Whether this thread is capturing a CUDA graph on its current stream (never without CUDA started;
    False when CUDA cannot answer, as at interpreter exit: the release then goes ahead as before)."""
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


# Mappings whose last view died while their thread captured a CUDA graph: cudaHostUnregister is not
# allowed during a capture (it would invalidate it, and the range would be unmapped still registered),
# so they wait here until ``release_deferred``. Appended by whichever thread drops the last view;
# drained by the capturing thread after its capture (``graphs``) and by the next ``mapped_empty``.
_deferred: List[Tuple[int, mmap.mmap, Unregistrar]] = []
_deferred_lock = threading.Lock()


def release_deferred() -> None:
    """Unpin and unmap the mappings released during a capture, unless this thread captures still."""
    if not _deferred or _capturing():
        return
    with _deferred_lock:
        pending = _deferred[:]
        del _deferred[:]
    for ptr, mapping, unregister in pending:
        _unpin_and_unmap(ptr, mapping, unregister)


def _release_mapping(ptr: int, mapping: mmap.mmap, unregister: Unregistrar, owner_pid: int) -> None:
    """Last view of a ``mapped_empty`` tensor died: unpin, then unmap (in that order, so the address
    range is never reused while still registered); during a graph capture both wait for the capture's
    end (``release_deferred``). A forked child (a DataLoader worker) inherits the mapping but not the
    registration, so it only unmaps."""
    if os.getpid() != owner_pid:
        _unpin_and_unmap(ptr, mapping, None)
    elif _capturing():
        with _deferred_lock:
            _deferred.append((ptr, mapping, unregister))
    else:
        _unpin_and_unmap(ptr, mapping, unregister)


def _unpin_and_unmap(ptr: int, mapping: mmap.mmap, unregister: Optional[Unregistrar]) -> None:
    if unregister is not None:
        unregister(ptr)
    try:
        mapping.close()
    except BufferError:  # an export is still open elsewhere: the mapping goes with its last reference
        pass


def mapped_empty(
    shape: Sequence[int], dtype: torch.dtype, register: Registrar, unregister: Unregistrar
) -> torch.Tensor:
    """An uninitialised host tensor in its own anonymous mapping of exactly its size (rounded to a page),
    registered with ``register`` (page-locking it) and unregistered by ``unregister`` once the last
    tensor viewing it is gone.

    Life cycle: the tensors hold the memoryview ``mv``; a finalizer on ``mv`` owns the mapping, so the
    mapping outlives every view, and the finalizer runs ``unregister`` before it unmaps. Transparent huge
    pages are requested before the pages are touched (fewer pages to pin and to translate for DMA).
    """
    release_deferred()
    size = torch.Size(shape).numel() * dtype.itemsize
    nbytes = max(size, 1)
    try:
        mapping = mmap.mmap(-1, nbytes)
    except OSError as e:  # out of memory, or vm.max_map_count reached
        raise RuntimeError(
            f"could not map {nbytes / 2**20:.1f} MiB of host memory ({e}); free host memory or lower "
            "RoundPipe's use of it (see docs/resolve-oom.md)"
        ) from e
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    mv = memoryview(mapping)
    flat = torch.frombuffer(mv, dtype=torch.uint8)
    ptr = flat.data_ptr()
    register(ptr, nbytes)  # on failure nothing is registered and the mapping goes with ``flat``
    weakref.finalize(mv, _release_mapping, ptr, mapping, unregister, os.getpid())
    del mv  # only the tensors keep it now
    return flat[:size].view(dtype).view(tuple(int(d) for d in shape))


def pinned_empty(shape: Sequence[int], dtype: torch.dtype, pin: Optional[bool] = None) -> torch.Tensor:
    """An uninitialised host tensor for a long-lived buffer (model weights, staged parameters, gradient
    download buffers): pinned at exactly its size when CUDA is used (``pin`` overrides), else pageable."""
    pin = backend.pin_enabled() if pin is None else pin
    if not pin:
        return torch.empty(tuple(shape), dtype=dtype)
    if torch.Size(shape).numel() * dtype.itemsize < EXACT_MIN_BYTES:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    return mapped_empty(shape, dtype, _cuda_register, _cuda_unregister)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host tensor ``t`` (exact size, see ``pinned_empty``), contiguous."""
    return pinned_empty(t.shape, t.dtype, pin=True).copy_(t)


def _tensors(mod: nn.Module) -> Iterator[torch.Tensor]:
    """``mod``'s parameters and buffers, each once; a frozen weight in a packed host format
    (``roundpipe.host.formats.FrozenWeight``, which carries a ``packed`` dict) as its packed tensors."""
    seen = set()
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield from _host_tensors(t)


def _host_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    packed = packed_parts(t)
    return list(packed.values()) if packed is not None else [t]


def _pin_packed(mod: nn.Module) -> None:
    """Pin the packed tensors of ``mod``'s frozen weights in place of their dict entries (every alias of
    a FrozenWeight shares the dict, so each sees the pinned tensors)."""
    for t in list(mod.parameters()) + list(mod.buffers()):
        packed = packed_parts(t)
        if packed is not None:
            for k, v in list(packed.items()):
                if v.device.type == "cpu" and not v.is_pinned():
                    packed[k] = pinned_copy(v)


def pin_module_alloc(mod: nn.Module) -> None:
    """Move parameters and buffers of ``mod`` into pinned host allocations (tensor objects are kept)."""
    _pin_packed(mod)
    for t in list(mod.parameters()) + list(mod.buffers()):
        if packed_parts(t) is None and t.device.type == "cpu" and not t.is_pinned():
            t.data = pinned_copy(t.data)


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
            raise RuntimeError(
                f"cudaHostRegister failed ({err}) for a tensor of {nbytes} bytes; use pin_model='alloc' or 'off'"
            )


def pin_module(mod: nn.Module, mode: PinMode) -> None:
    """Pin ``mod``'s host memory per ``mode`` (a no-op without CUDA). A model built on a GPU and moved
    to the host leaves its old blocks in torch's cache, reserved for the default stream that RoundPipe's
    streams never allocate from, yet counted as room by ``backend.capacity_bytes``; they go back here."""
    if mode not in ("alloc", "register", "off"):
        raise ValueError(f"pin_model={mode!r}: expected 'alloc', 'register' or 'off'")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # frees only blocks no stream uses; once per wrap, not on a hot path
    if mode == "off" or not backend.pin_enabled():
        return
    if mode == "alloc":
        pin_module_alloc(mod)
    else:
        pin_module_register(mod)
