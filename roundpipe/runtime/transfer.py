"""Moving activations, parameters and gradients between host and device on the right streams.

Every copy here is issued on one of the device's copy streams and ordered by events, never by a host
synchronisation: activation uploads on ``upstream``, parameter uploads on ``param_upstream``,
activation (and input-gradient) downloads on ``downstream``, a layer's parameter gradients and buffers
on ``grad_stream`` (``download_layer``). Callers make the compute stream wait for the upload stream before use,
and hand device tensors to the device's ``InterStreamMemManager`` so they outlive their last use.
Host waits: ``HostScalar.item()`` waits for an event recorded stages earlier (in practice long complete).
Which host buffer a gradient download writes (and whether it must wait for the optimizer to release one)
is ``roundpipe.host.buffers``' decision.

On CPU workers uploads copy too (so layers that modify inputs or parameters in place never touch the
host copies saved for recompute or written by the optimizer thread) and downloads detach; while the CPU
streams check their order (``cpu_streams.enabled()``) downloads, peer copies and host scalars copy into new
tensors on their stream as well, so that host copies and device tensors are distinct storages exactly as
on a GPU and each hand-over has a copy the checks order (unchecked, a download costs no copy).

Attributes:
    chunked_upload: Whether large parameters (and gradient seeds) upload, and large parameter
        gradients download, in slices of ``CHUNK_UPLOAD_SIZE`` bytes, so that activation copies, which
        wait on the critical path on the higher-priority ``upstream`` / ``downstream``, can be scheduled
        between the slices instead of behind a whole embedding table.
    CHUNK_UPLOAD_SIZE: Size in bytes above which such a copy is sliced, and the slice size.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe import settings
from roundpipe.devices import backend, cpu_streams, graphs
from roundpipe.devices.backend import Event
from roundpipe.host.attribute import LayerAttribute, ParamAttribute, buffer_downloaded, note_buffer_download
from roundpipe.host.buffers import ParamBuffers
from roundpipe.host.formats import FrozenWeight
from roundpipe.runtime.stage_codec import Packed, decode

chunked_upload = True
CHUNK_UPLOAD_SIZE = 64 * 1024**2


def device_saved_limit() -> Optional[int]:
    """Bytes of backward-stage inputs one call (forward + backward) on one device may keep on the device
    (``RPP_DEBUG_DEVICE_SAVED_GB``, in GiB), or None for ``auto`` (the default: ``budget.device_saved_room``).

    Every backward stage needs its input again for the recompute. Otherwise each one is downloaded to
    the host in forward and uploaded again in backward; up to this many bytes of them (per call) stay
    on the device instead, saving that host memory (about 2 bytes/param on qwen3-1.7b at 8 x 4096) and
    both copies for as much GPU memory. With several devices they go through the host (a stage's
    backward may run on another device).
    """
    gib = settings.DEBUG_DEVICE_SAVED_GB.get()
    return None if gib is None else int(gib * 2**30)


def tensor_bytes(leaves: Iterable[Any]) -> int:
    """Bytes held by the tensors among ``leaves``."""
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class HostScalar:
    """A device scalar the host reads later without waiting: created right after the kernel that
    computes it, it queues a copy to pinned host memory and an event; ``item()`` waits for that event
    only, which has long completed when it is read stages later. A plain ``.item()`` would instead stall
    the issuing thread until the device has caught up. A non-tensor, so RoundPipe passes it between
    stages and devices as it is.

    The copy runs on a side stream of the device (``scalar_stream``) that waits for the current one,
    never on the compute stream itself: the pinned block comes from torch's caching host allocator,
    which records an event on every stream that used a block when the block is freed. Whichever thread
    drops the scalar may do that while the device thread captures a CUDA graph on its compute stream
    (``roundpipe.devices.graphs``); the event would be recorded into the capture, and every later pinned
    allocation of the process, which queries it, failed with "CUDA error: invalid argument". The side
    stream is never captured. (Inside a capture the copy stays on the capturing stream: that capture is
    refused anyway, as its outputs include this object.)"""

    def __init__(self, t: torch.Tensor) -> None:
        self.event: Optional[Any] = None
        if t.device.type == "cuda":
            self.host = torch.empty((), dtype=t.dtype, pin_memory=True)
            src, current = t.detach(), torch.cuda.current_stream(t.device)
            stream = current if torch.cuda.is_current_stream_capturing() else scalar_stream(t.device)
            if stream is not current:
                stream.wait_stream(current)  # after the kernel that computes ``t``
            with torch.cuda.stream(stream):
                self.host.copy_(src, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            if stream is not current:
                src.record_stream(stream)  # ``t``'s device block is reused only after this copy
        elif cpu_streams.enabled():
            # A real copy, on the current stream, and its event: the host reads it only after
            # synchronizing that event (``item``), which the checks verify as they would on a GPU.
            self.host = t.detach().clone()
            self.event = cpu_streams.current_event()
        else:
            self.host = t.detach()

    def item(self) -> Any:
        if self.event is not None:
            self.event.synchronize()
        return self.host.item()


_scalar_streams: Dict[int, Any] = {}  # device index -> the side stream of ``HostScalar`` copies


def scalar_stream(device: torch.device) -> Any:
    """The side stream ``HostScalar`` copies use on ``device`` (made at its first use; the first happens on
    the device's own thread, and a dict assignment is atomic, so two threads can at worst make two)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _scalar_streams.get(index)
    if stream is None:
        stream = _scalar_streams.setdefault(index, torch.cuda.Stream(device=index))
    return stream


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous copy of ``t`` on ``device`` (on the current stream); a host tensor is pinned first."""
    if device.type == "cpu" and t.device.type == "cpu":
        return t.detach().clone()
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        # A non_blocking copy from pageable memory synchronises the copy stream (and so this device
        # thread) with everything queued on it; staging through the pinned cache keeps it asynchronous.
        # The caching host allocator keeps the staging block until the copy has finished.
        t = _pinned_copy(t)
    return t.detach().to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned, contiguous copy of host tensor ``t``. ``Tensor.pin_memory()`` refuses tensors whose
    elements overlap in memory (e.g. the expanded ones of ``loss.sum().backward()``); a copy into a
    fresh pinned block takes any strides."""
    with torch.no_grad():
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def _copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """``dst.copy_(src, non_blocking=True)`` as consecutive slices of at most ``chunk_bytes`` (both
    contiguous, same shape): the same copy on the same stream, in smaller DMA pieces."""
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    step = max(1, chunk_bytes // src.element_size())
    for a in range(0, src.numel(), step):
        flat_dst[a : a + step].copy_(flat_src[a : a + step], non_blocking=True)


def _sliced(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a host-device copy of ``src`` into ``dst`` goes in ``CHUNK_UPLOAD_SIZE`` slices: large
    and contiguous on both sides, with ``chunked_upload`` on. A copy engine can then take the copies of
    a higher-priority stream (activations) between the slices instead of after the whole tensor."""
    return (
        chunked_upload
        and src.numel() * src.element_size() > CHUNK_UPLOAD_SIZE
        and src.is_contiguous()
        and dst.is_contiguous()
    )


def _upload_param(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``to_device`` for parameters, buffers and gradient seeds: sliced above ``CHUNK_UPLOAD_SIZE`` on
    CUDA (see ``chunked_upload``). The destination is allocated on the current (parameter upload) stream
    like ``.to()`` would; the pinned source's blocks are kept by the caching host allocator until the
    copies that read them have run. A frozen weight in a packed format (``FrozenWeight``) comes back as a
    plain tensor of its logical dtype (``_upload_frozen``)."""
    if isinstance(t, FrozenWeight):
        return _upload_frozen(t, device)
    if not (device.type == "cuda" and t.device.type == "cpu" and _sliced(t, t)):
        return to_device(t, device)
    src = t.detach() if t.is_pinned() else _pinned_copy(t)
    out = torch.empty(src.shape, dtype=src.dtype, device=device)
    _copy_in_chunks(out, src, CHUNK_UPLOAD_SIZE)
    return out


def _upload_frozen(t: FrozenWeight, device: torch.device, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Upload a FrozenWeight's packed tensors as they are and dequantize them on ``device`` (into ``out``,
    a graph slot's storage, when given): the layer's device copy then holds a plain weight that every
    microbatch of the job reads, unpacked once per upload of the group.

    Stream order: everything runs on the current stream (the parameter upload stream): the packed
    copies (pinned, non_blocking, sliced like other large parameters), then the dequantize kernels,
    which the stream orders after them. The packed device tensors are allocated on that stream, so the
    caching allocator reuses their blocks only for work queued on it after the dequantize. The compute
    stream waits for the layer's ``param_uploaded`` event (recorded after this) before reading the weight.
    On a CPU worker the host packed tensors are dequantized directly (a new tensor, as a copy would be).
    Without ``out`` the format says what the device copy holds (``Format.device_weight``: the dequantized
    weight, or for a base whose GEMMs read fp8 bytes, those bytes as they were uploaded). A format that keeps
    its packed tensors on the device (``Format.keeps_packed``) is never unpacked into a slot: its slot holds
    those tensors (``_upload_slot``)."""
    if out is not None and t.format.keeps_packed:
        raise ValueError(
            f"{t!r} computes from its packed tensors on the device: its graph slot holds them "
            "(transfer.slot_parts), not a plain weight to unpack into"
        )
    if device.type == "cpu":
        packed = t.packed
    else:
        packed = {k: _upload_param(v, device) for k, v in t.packed.items()}
    if out is None:
        return t.format.device_weight(packed, t.shape, t.dtype)
    return t.dequantize_into(packed, out)


def slot_parts(p: torch.Tensor) -> Optional[graphs.Parts]:
    """What a graph slot holds for parameter ``p`` instead of one plain tensor of its shape and dtype
    (``graphs.layer_signature``): the packed tensors of a frozen weight whose device copy keeps them
    (``FrozenWeight.device_parts``: an fp8 base under FP8 GEMMs), else None."""
    return p.device_parts() if isinstance(p, FrozenWeight) else None


def _upload_slot(slot: graphs.LayerSlot, j: int, p: torch.Tensor) -> torch.Tensor:
    """Upload parameter ``p`` into position ``j`` of graph slot ``slot`` (on the current, parameter upload,
    stream) and return its device weight over the slot's storage: the slot's plain tensor (a packed frozen weight
    dequantized into it), or for a frozen weight whose device copy keeps its packed tensors the format's
    ``device_weight`` over the slot's copies of them: the object an ungraphed upload makes (``_upload_frozen``),
    at the slot's fixed addresses, so graphed and eager jobs compute the same.

    Stream order (no new synchronisation): the parameter stream has already waited for the slot's ``release``
    (``upload_layers``: the job that last read these tensors is done), the copies go on it like any slot upload's,
    and the compute stream reads the device weight only after the layer's ``param_uploaded`` event, recorded after
    them. The device weight allocates nothing: it wraps the slot's tensors."""
    parts, plain = slot.packed[j], slot.params[j]
    if (parts is not None) != (slot_parts(p) is not None):
        raise ValueError(
            f"graph slot: {p!r} is {'not ' if parts is not None else ''}kept packed on the device, unlike when its "
            "layer's slot was made; choose the frozen base's format (and fp8=True) before the first call"
        )
    if parts is None:
        assert plain is not None  # a plain position of the slot (``graphs.LayerSlot``)
        _upload_into(plain, p)
        return plain
    assert isinstance(p, FrozenWeight)
    for name, dst in parts.items():
        _upload_into(dst, p.packed[name])
    return p.format.device_weight(parts, p.shape, p.dtype)


def _upload_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``_upload_param`` into existing device storage (a graph slot): the same copies, sliced above
    ``CHUNK_UPLOAD_SIZE``, from pinned memory (a pageable source is staged through the pinned cache); a
    FrozenWeight is dequantized into the slot (``_upload_frozen``)."""
    if isinstance(src, FrozenWeight):
        _upload_frozen(src, dst.device, out=dst)
        return
    if dst.device.type != "cuda":
        dst.copy_(src)
        return
    if src.device.type == "cpu" and not src.is_pinned():
        src = _pinned_copy(src)
    if _sliced(dst, src):
        _copy_in_chunks(dst, src, CHUNK_UPLOAD_SIZE)
    else:
        dst.copy_(src, non_blocking=True)


def async_h2d(
    device: Any, host_ready_event: Iterable[Event], host_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> List[Any]:
    """Upload tensors (non-tensors pass through) on the activation upload stream; a compact stage input
    (``stage_codec.Packed``) is decoded there, after its upload.

    The upload stream first waits for ``host_ready_event`` (e.g. the download that produced the host
    tensors on another device). Returns device tensors; the caller makes compute wait on ``upstream``.
    """
    stream = device.upstream
    for ev in host_ready_event:
        stream.wait_event(ev)
    out: List[Any] = []
    with torch.no_grad(), backend.use_stream(stream):
        for t in host_tensors:
            if isinstance(t, torch.Tensor):
                d = to_device(t, device.device)
                if keep_requires_grad and t.requires_grad:
                    d.requires_grad_(True)
                out.append(d)
            elif isinstance(t, Packed):  # a compact stage input (roundpipe.runtime.stage_codec): decoded on this stream
                out.append(decode(t.map(lambda x: to_device(x, device.device))))
            else:
                out.append(t)
    return out


def _copy_after_compute(
    device: Any, tensors: List[Any], copy: Callable[[torch.Tensor], torch.Tensor]
) -> Tuple[List[Any], Event]:
    """``copy`` of each tensor (non-tensors pass through), issued on ``device``'s download stream after
    the compute queued so far, and the event that marks the copies done.

    The sources were allocated on the compute stream; if the caller drops them now, the caching
    allocator may hand their memory to the next kernel on the compute stream before this copy has read
    it (the copy runs on another stream). The memory manager keeps them until the copies are done."""
    stream = device.downstream
    stream.wait_stream(device.compute_stream)
    with torch.no_grad(), backend.use_stream(stream):
        out = [copy(t) if isinstance(t, torch.Tensor) else t.map(copy) if isinstance(t, Packed) else t for t in tensors]
    done = backend.record_event(stream)
    sources = [u for t in tensors for u in (t.tensors() if isinstance(t, Packed) else [t])]
    device.mem_manager.free_after(
        [done], [t for t in sources if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    )
    return out, done


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        # Checking: a copy on the download stream (a GPU's download never aliases the device tensor).
        return t.detach().clone() if cpu_streams.enabled() else t.detach()
    h = backend.empty_host_like(t)
    h.copy_(t, non_blocking=True)
    return h


def async_d2h(
    device: Any, transfer_finish_event: List[Event], device_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> List[Any]:
    """Download tensors to (pinned) host memory on ``downstream`` after the compute queued so far (a compact
    stage input, ``stage_codec.Packed``, as its payload and scales).

    Appends the event marking completion to ``transfer_finish_event``. Non-tensors pass through.
    """
    device_tensors = list(device_tensors)
    out, done = _copy_after_compute(device, device_tensors, _to_host)
    if keep_requires_grad:
        for t, h in zip(device_tensors, out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                h.requires_grad_(True)
    transfer_finish_event.append(done)
    return out


def peer_copy(src: Any, dst: Any, tensors: Iterable[Any]) -> Tuple[List[Any], List[Event]]:
    """Copy a job's output ``tensors`` from ``src``'s device to ``dst``'s (the next job's), on ``src``'s
    download stream after the compute queued so far: one device-to-device copy instead of a download to
    pinned host memory and an upload. Returns the copies and the event that marks them complete, for
    ``dst``'s upload stream to wait on before its compute reads them.

    Synchronisation: torch runs a copy between two GPUs on the source's current stream (here
    ``src.downstream``, which first waits for ``src.compute_stream``: the output is written), fenced
    both ways with the destination device's current stream of this thread (its default stream, which
    RoundPipe's streams never wait on implicitly: they are non-blocking). The copies are allocated from
    ``dst``'s default-stream pool, which only these copies use, and ``dst`` frees them through its memory
    manager after its compute and download streams are done with them, so a block is reused only after
    its last reader. The sources stay alive until the copy has read them. CPU workers share one memory:
    the tensors pass as they are (copied while the CPU streams check their order, as on GPUs)."""
    out, done = _copy_after_compute(src, list(tensors), _peer_copier(dst))
    return out, [done]


def _peer_copier(dst: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """How ``peer_copy`` copies one tensor to ``dst``'s device: ``.to`` (a no-op between CPU workers,
    a real copy while the checks run)."""
    if dst.device.type == "cpu" and cpu_streams.enabled():
        return lambda t: t.detach().clone() if t.device.type == "cpu" else t.to(dst.device)
    return lambda t: t.to(dst.device, non_blocking=True)


def _device_copy(mod: nn.Module, tensors: Dict[int, torch.Tensor], memo: Dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of ``mod`` (and its submodules) whose parameters and buffers are ``tensors[id(t)]``.

    Made fresh at every upload, so it always carries the host module's current Python state
    (``training``, hooks, flags set after wrapping) and no two jobs share a copy.
    """
    if id(mod) in memo:
        return memo[id(mod)]
    new = mod.__class__.__new__(mod.__class__)
    new.__dict__ = mod.__dict__.copy()
    memo[id(mod)] = new
    new.__dict__["_parameters"] = {k: (None if p is None else tensors[id(p)]) for k, p in mod._parameters.items()}
    new.__dict__["_buffers"] = {k: (None if b is None else tensors[id(b)]) for k, b in mod._buffers.items()}
    new.__dict__["_modules"] = {
        k: (None if c is None else _device_copy(c, tensors, memo)) for k, c in mod._modules.items()
    }
    return new


def upload_layers(
    layers: Sequence[nn.Module],
    layer_ids: Sequence[int],
    layer_attrs: Sequence[LayerAttribute],
    device: Any,
    with_grad: bool,
    saved_buffers: Optional[Dict[int, Dict[str, torch.Tensor]]] = None,
    ready: Optional[List[Event]] = None,
    seed_grads: Optional[Sequence[bool]] = None,
    slots: Optional[Sequence[Any]] = None,
) -> List[nn.Module]:
    """Copy layers onto ``device`` (parameter upload stream) and return their device copies.

    With ``with_grad``, trainable parameters get ``requires_grad`` and start from the host gradient
    (so gradients accumulate across calls exactly as in PyTorch). ``saved_buffers`` replaces host
    buffers (the pre-forward values used for recompute). After issuing a layer's copies its
    ``param_uploaded`` event is recorded and ``param_upload_started`` set (attribute.py protocol).

    Without ``ready`` the compute stream waits for the whole upload before using any layer. With a
    list, each layer's event is appended to it instead and the caller makes the compute stream wait
    for layer k's event before running layer k (``wait_layer``): compute starts on the first layer
    while the later ones still upload. The caller keeps these events (``param_uploaded`` may be
    recorded again by another device's upload of the same layer meanwhile).

    ``seed_grads[k]`` False: layer k's trainable parameters start without a gradient (data parallel
    reducing on the device adds the accumulated host gradient inside the reduction, after weighting
    this rank's share; see ``roundpipe.runtime.grad_sync``). Default: all seeded.

    ``slots`` (``graphs.LayerSlot`` per layer, a graphed job): the weights go into the slots' fixed storage instead of
    new tensors, and the slot's gradient buffer of a trainable one is seeded from the host gradient (and is its
    ``.grad``) or zeroed. The stream first waits for the slot's ``release``: the job that used it last is done reading
    it (its compute and gradient downloads).
    """
    stream = device.param_upstream
    out: List[nn.Module] = []
    with torch.no_grad(), backend.use_stream(stream):
        seeds = seed_grads if seed_grads is not None else [True] * len(layers)
        for k, (layer, lid, attr, seed) in enumerate(zip(layers, layer_ids, layer_attrs, seeds)):
            slot = slots[k] if slots is not None else None
            if slot is not None and slot.release is not None:
                stream.wait_event(slot.release)
            tensors: Dict[int, torch.Tensor] = {}
            buffers = (saved_buffers or {}).get(lid)
            j = 0  # the parameter's index in the slot (the order of ``graphs.layer_signature``)
            for host_mod in layer.modules():
                for p in host_mod._parameters.values():
                    if p is None or id(p) in tensors:
                        continue
                    train = with_grad and p.requires_grad
                    g = ParamBuffers.of(p).seed(p, lid) if train and seed else None
                    if slot is None:
                        dp = nn.Parameter(_upload_param(p, device.device), requires_grad=train)
                        if g is not None:
                            dp.grad = _upload_param(g, device.device)
                    else:
                        dp = nn.Parameter(_upload_slot(slot, j, p), requires_grad=train)
                        if train:
                            # Seeded: the gradient accumulates onto the host's. Unseeded: the zeroed buffer
                            # becomes ``.grad`` only once a microbatch reaches the parameter
                            # (``compute.GroupBackward``): an unused parameter keeps ``.grad = None``.
                            buf = slot.grad(j)
                            if g is not None:
                                _upload_into(buf, g)
                                dp.grad = buf
                            else:
                                buf.zero_()
                    j += 1
                    tensors[id(p)] = dp
                for name, b in host_mod._buffers.items():
                    if b is None or id(b) in tensors:
                        continue
                    src = buffers.get(f"{id(host_mod)}.{name}", b) if buffers else b
                    stream.wait_event(buffer_downloaded(b))  # the last forward's download, of any wrapper
                    tensors[id(b)] = _upload_param(src, device.device)
            attr.param_uploaded = backend.record_event(stream)
            if ready is not None:
                ready.append(attr.param_uploaded)
            attr.param_upload_started.set()
            out.append(_device_copy(layer, tensors, {}))
    if ready is None:
        device.compute_stream.wait_stream(stream)
    return out


def wait_layer(device: Any, ready: List[Event], k: int) -> None:
    """Make the compute stream wait until the ``k``-th layer of a group uploaded with ``ready`` is on
    the device (``upload_layers``). Safe to call once per layer per job: later waits on a completed
    event are no-ops, so callers wait only on their first microbatch."""
    device.compute_stream.wait_event(ready[k])


def snapshot_buffers(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """Host copies of ``layer``'s buffers before a forward updates them (used for recompute)."""
    return {f"{id(m)}.{n}": b.clone() for m in layer.modules() for n, b in m._buffers.items() if b is not None}


def download_layer(
    cpu_layer: nn.Module,
    gpu_layer: nn.Module,
    layer_id: int,
    layer_attr: LayerAttribute,
    device: Any,
    with_buffer: bool,
    with_grad: bool,
    tied: Optional[Any] = None,
    job_layers: Optional[range] = None,
    reducer: Optional[Callable[[nn.Module, nn.Module, int, Any], None]] = None,
    parts: Optional[Any] = None,
    into_weights: bool = False,
) -> None:
    """Issue copies of a layer's buffers and/or parameter gradients back to the host (no waiting).

    Buffers are written into the host buffers in place (``attribute.buffer_downloaded`` of each marks
    completion; the next upload of the buffer, by any wrapper of the module, waits for it). Gradients go to
    the host gradient slots, reusing the buffer ``roundpipe.host.buffers`` gives; ``grad_downloaded`` is
    recorded and ``grad_download_started`` set.

    ``tied`` (the call's ``TiedGrads``) sums the gradient shares of tied parameters into the owner
    layer's share before its download (``job_layers``: the layers of this job). ``reducer``
    (``roundpipe.runtime.grad_sync``) reduces the layer's device gradients across processes before the download.
    ``parts`` (``partial_grads.PartialGrads``, the fused job split over devices) first adds the other
    parts' gradients of the layer into this device's. ``into_weights``: gradients may take the weights'
    host buffers (``host_buffers.ParamBuffers.download_target``).

    Stream order (``grad_stream``): the uploads of other devices' shares (fused parts, tied sharers)
    wait only for those devices' download events, so they are queued before the wait for this job's
    compute and land while it runs; the additions, the reduction and the downloads follow the compute.
    """
    stream = device.grad_stream
    with torch.no_grad(), backend.use_stream(stream):
        pairs = list(zip(cpu_layer.modules(), gpu_layer.modules()))
        part_shares = parts.fetch(layer_id, cpu_layer, gpu_layer, device) if with_grad and parts is not None else []
        if with_grad and tied is not None and reducer is None and job_layers is not None:
            tied.fetch(cpu_layer, layer_id, job_layers, device)
        stream.wait_stream(device.compute_stream)
        if with_buffer and any(b is not None for m, _ in pairs for b in m._buffers.values()):
            written = []
            for host_mod, dev_mod in pairs:
                for name, b in host_mod._buffers.items():
                    db = dev_mod._buffers.get(name)
                    if b is not None and db is not None and db is not b:
                        b.copy_(db, non_blocking=True)
                        written.append(b)
            event = backend.record_event(stream)
            for b in written:
                note_buffer_download(b, event)
        if with_grad:
            hold: List[torch.Tensor] = []
            if parts is not None:
                parts.add(part_shares, hold)
            if reducer is not None:
                # Reduce this layer's device gradients across processes here, queued on the gradient
                # stream after the compute, so the copies below (same stream) download reduced values.
                reducer(cpu_layer, gpu_layer, layer_id, device)
            done = set()
            for host_mod, dev_mod in pairs:
                for name, p in host_mod._parameters.items():
                    dp = dev_mod._parameters.get(name)
                    if p is None or dp is None or id(p) in done:
                        continue
                    attr = ParamAttribute.get(p)
                    bufs = ParamBuffers.of(p)
                    grad = dp.grad
                    if tied is not None and attr.shared and reducer is None and job_layers is not None:
                        grad = tied.merge(p, attr, layer_id, grad, hold)
                        if grad is not None and tied.keep(p, attr, layer_id, grad, job_layers):
                            done.add(id(p))
                            bufs.download_issued(p, layer_id, None)
                            continue
                    if grad is None:
                        continue
                    done.add(id(p))
                    # A host buffer no other thread reads or writes now (the backward fence waited for
                    # grad_copied); host_buffers decides which, and whether it waits for the optimizer.
                    buf = bufs.download_target(p, layer_id, grad, into_weights)
                    if grad.device.type == "cpu":
                        buf.copy_(grad)
                    elif _sliced(buf, grad):  # the activation downloads of ``downstream`` can go between slices
                        _copy_in_chunks(buf, grad, CHUNK_UPLOAD_SIZE)
                    else:
                        buf.copy_(grad, non_blocking=True)
                    bufs.download_issued(p, layer_id, buf)
            layer_attr.grad_downloaded = backend.record_event(stream)
            if hold:
                device.mem_manager.free_after([layer_attr.grad_downloaded], hold)
            layer_attr.grad_download_started.set()


def release_layers(gpu_layers: Sequence[nn.Module], device: Any, slots: Optional[Sequence[Any]] = None) -> None:
    """Drop a job's device copies: their tensors go to the memory manager, which frees them once the
    compute and gradient streams (``download_layer``) are past their last use. A graphed job's slots
    (``slots``) instead get their ``release`` event: the gradient stream (where the job's downloads
    were queued) after the compute stream, so the next upload into them waits for both."""
    if slots:
        device.grad_stream.wait_stream(device.compute_stream)
        done = backend.record_event(device.grad_stream)
        for slot in slots:
            slot.release = done
        return
    held: List[torch.Tensor] = []
    for layer in gpu_layers:
        for p in layer.parameters():
            held.append(p)
            if p.grad is not None:
                held.append(p.grad)
        held.extend(layer.buffers())
    device.mem_manager.free(held, device.compute_stream, device.grad_stream)
