"""One long sequence over the pool: its tiles flow through the pipeline as microbatches, in causal order.

A single sequence is one microbatch, and one microbatch runs on one device at a time, so a second GPU
adds nothing to it. With ``RoundPipeRunConfig(sequence_tiles=T)`` a causal LM's batch is cut along the
*sequence* into T tiles that are the call's microbatches (``models.causal_lm``). Round-robin dispatch is
unchanged: a job is still one layer group over all microbatches on one device, and the next group's
job starts tile 0 as soon as this one has issued it, so T tiles keep up to T devices busy at once.

Only attention mixes positions, and only with earlier ones. Tile t's queries attend to the keys and
values of tiles 0..t of the same layer, and the job that computes tile t is the job that computed tiles
0..t-1 of its layers just before. So each job keeps, per attention layer of its group, the keys and
values of the whole sequence on its device (:class:`TileKV`): a forward job writes tile t's into them
and attends over the prefix; at its end it downloads them to the host (``SequenceRun.host``), for the
backward.

Backward jobs take the tiles in reverse order. Recomputing tile t, a layer's attention reads the
uploaded keys and values of tiles 0..t-1 as constants and its own, recomputed, with their graph
(:class:`_PrefixKV`). Its backward adds the gradient w.r.t. the earlier tiles' keys and values into the
job's accumulators, and adds the accumulated gradient of tile t's own (left there by tiles t+1.. of
this job, which ran before it) to what flows back into tile t's projections. Tile 0's backward ends
the job: every tile's key and value gradient has reached its projections. Loss and gradients are the
unsplit sequence's (``tests/test_sequence.py`` compares in float64).

Attention over ``[prefix, tile]`` is one call of ``scaled_dot_product_attention`` with a bottom-right
aligned causal mask (``torch.nn.attention.bias.causal_lower_right``: flash or memory-efficient kernels
on GPUs, never a ``seq x seq`` matrix there). Key and value heads are repeated to the query heads
first when they differ (grouped-query attention), as Hugging Face's sdpa path does without
``enable_gqa``.

Synchronisation: everything here runs on the job's compute stream. A forward job's download of its
keys and values is issued after its last tile's compute (``transfer.async_d2h``, download stream);
the backward job's compute stream waits for those download events before it uploads them
(``TileKV.layer``), on another device or the same one. The accumulators live and die on one job's
compute stream.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from roundpipe import settings
from roundpipe.devices import cpu_streams
from roundpipe.runtime import tile_attention
from roundpipe.runtime.transfer import async_d2h, to_device

if TYPE_CHECKING:
    from roundpipe.devices.device import DeviceManager

HostKV = Tuple[torch.Tensor, torch.Tensor, List[Any]]


@dataclass
class SequenceRun:
    """The sequence state of one call: the tiles' start positions and, after the forward, each attention
    layer's keys and values on the host (keyed by the attention module's ``layer_idx``)."""

    starts: List[int]
    """Start position of each tile (microbatch) in the sequence; the last entry is the sequence length."""
    host: Dict[int, HostKV] = field(default_factory=dict)
    """Per attention layer: keys, values ``[batch, kv_heads, seq, head_dim]`` and their download events."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    attention: str = field(default_factory=lambda: settings.DEBUG_TILE_ATTENTION.get())
    """How the tiles attend (``RPP_DEBUG_TILE_ATTENTION``, see :func:`split_attention`), read once per call."""

    @classmethod
    def from_lengths(cls, lengths: List[int]) -> "SequenceRun":
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return cls(starts)

    @property
    def length(self) -> int:
        return self.starts[-1]

    def job_store(self, device: "DeviceManager", backward: bool) -> "TileKV":
        """The keys and values a job keeps on its device (see the module docstring)."""
        return TileKV(self, device, backward)


@dataclass
class _LayerKV:
    """One attention layer's keys and values over the sequence on a job's device, and (backward) the
    gradients accumulated for them."""

    k: torch.Tensor
    v: torch.Tensor
    dk: Optional[torch.Tensor] = None
    dv: Optional[torch.Tensor] = None

    def accumulators(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The gradient accumulators, zero at first (float32 at least: many tiles add into them)."""
        if self.dk is None or self.dv is None:
            dtype = torch.promote_types(self.k.dtype, torch.float32)
            self.dk = torch.zeros(self.k.shape, dtype=dtype, device=self.k.device)
            self.dv = torch.zeros(self.v.shape, dtype=dtype, device=self.v.device)
        return self.dk, self.dv


class TileKV:
    """What one job keeps of the sequence on its device: per attention layer, keys and values (and in a
    backward job, their gradient accumulators). Owned by the job's device thread; dropped at its end."""

    def __init__(self, seq: SequenceRun, device: "DeviceManager", backward: bool) -> None:
        self.seq = seq
        self.device = device
        self.backward = backward
        self.layers: Dict[int, _LayerKV] = {}

    def layer(self, key: int, like: torch.Tensor) -> _LayerKV:
        """Layer ``key``'s keys and values: allocated for the whole sequence in a forward job (``like``:
        a tile's keys), uploaded from the forward's host copy in a backward job."""
        kv = self.layers.get(key)
        if kv is not None:
            return kv
        if not self.backward:
            b, h, _, d = like.shape
            shape = (b, h, self.seq.length, d)
            kv = _LayerKV(like.new_empty(shape), like.new_empty(shape))
        else:
            with self.seq.lock:
                host = self.seq.host.get(key)
            if host is None:
                raise RuntimeError(
                    f"sequence tiles: no keys and values of attention layer {key} from the forward; the backward of "
                    "a sequence-tiled call needs its forward in the same call"
                )
            hk, hv, events = host
            # The forward's download must land before this upload reads the host copy; the upload runs on
            # the compute stream (current here), which the tile's attention then reads in order.
            stream = self.device.compute_stream
            for ev in events:
                stream.wait_event(ev)
            kv = _LayerKV(to_device(hk, self.device.device), to_device(hv, self.device.device))
        self.layers[key] = kv
        return kv

    def finish(self, keep: bool) -> None:
        """End of a job: with ``keep`` (a training forward), the keys and values to the host for the
        backward (download stream, after the compute queued so far); then dropped here."""
        if keep and not self.backward:
            for key, kv in self.layers.items():
                events: List[Any] = []
                hk, hv = async_d2h(self.device, events, [kv.k, kv.v])
                with self.seq.lock:
                    self.seq.host[key] = (hk, hv, events)
        self.layers = {}


@dataclass
class _Tile:
    store: TileKV
    start: int
    length: int


_local = threading.local()


def active() -> Optional[_Tile]:
    """The tile this thread computes now (None outside a sequence-tiled job)."""
    return getattr(_local, "tile", None)


@contextlib.contextmanager
def tile(store: Optional[TileKV], m: int) -> Iterator[None]:
    """Compute microbatch ``m`` as tile ``m`` of ``store``'s sequence (a no-op context without a store)."""
    if store is None:
        yield
        return
    starts = store.seq.starts
    previous = active()
    _local.tile = _Tile(store, starts[m], starts[m + 1] - starts[m])
    try:
        yield
    finally:
        _local.tile = previous


class _TileGrads:
    """Tile ``[start, start + length)``'s key/value gradient routing (``tile_attention.KVGrads``): the
    prefix's into the job's accumulators, and the accumulated gradient of its own (left there by tiles
    t+1.. of this job, which ran before it) into what flows back to its projections."""

    def __init__(self, kv: _LayerKV, start: int, length: int) -> None:
        self.kv, self.start, self.length = kv, start, length

    def add_prefix(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        acc_k, acc_v = self.kv.accumulators()
        acc_k[:, :, : self.start] += dk
        acc_v[:, :, : self.start] += dv

    def own(self, dk: torch.Tensor, dv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        acc_k, acc_v = self.kv.accumulators()
        s, n = self.start, self.length
        return (dk + acc_k[:, :, s : s + n]).to(dk.dtype), (dv + acc_v[:, :, s : s + n]).to(dv.dtype)


class _PrefixKV(torch.autograd.Function):
    """``[prefix, tile]`` keys and values for one masked attention call (``RPP_DEBUG_TILE_ATTENTION=bias``),
    where the prefix (the earlier tiles') is a constant of this graph: its gradient and the tile's go
    through ``_TileGrads``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, k: torch.Tensor, v: torch.Tensor, kv: _LayerKV, start: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        ctx.grads = _TileGrads(kv, start, k.shape[2])
        return torch.cat([kv.k[:, :, :start], k], dim=2), torch.cat([kv.v[:, :, :start], v], dim=2)

    @staticmethod
    def backward(ctx: Any, dk_all: torch.Tensor, dv_all: torch.Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        s = ctx.grads.start
        ctx.grads.add_prefix(dk_all[:, :, :s], dv_all[:, :, :s])
        dk, dv = ctx.grads.own(dk_all[:, :, s:], dv_all[:, :, s:])
        return dk, dv, None, None


def attend(
    key: Optional[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Optional[float], dropout: float
) -> torch.Tensor:
    """Causal attention of the current tile's queries over the sequence so far, as Hugging Face's
    attention functions take it: ``q`` ``[batch, heads, tile, head_dim]``, ``k`` / ``v`` ``[batch,
    kv_heads, tile, head_dim]`` (the tile's own); returns ``[batch, tile, heads, head_dim]``."""
    t = active()
    assert t is not None, "sequence.attend outside a sequence-tiled job"
    if key is None:
        raise ValueError("sequence tiles: an attention module without layer_idx cannot keep its keys per layer")
    if dropout > 0.0:
        raise ValueError("sequence tiles: attention dropout is not supported (set the model's attention_dropout to 0)")
    if k.shape[2] != t.length:
        raise ValueError(f"sequence tiles: a tile of {t.length} tokens gave keys of length {k.shape[2]}")
    kv = t.store.layer(key, k)
    s, n = t.start, t.length
    if not t.store.backward:
        kv.k[:, :, s : s + n] = k
        kv.v[:, :, s : s + n] = v
    grad = t.store.backward and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if split_attention(q, t.store.seq.attention):
        prefix_k, prefix_v = kv.k[:, :, :s], kv.v[:, :, :s]
        if grad:
            out = tile_attention.TileAttention.apply(q, k, v, prefix_k, prefix_v, scaling, _TileGrads(kv, s, n))
        else:
            out = tile_attention.forward_blocks(q, k, v, prefix_k, prefix_v, scaling)[0]
        return out.transpose(1, 2)
    if not t.store.backward:
        keys, values = kv.k[:, :, : s + n], kv.v[:, :, : s + n]
    elif grad:
        keys, values = _PrefixKV.apply(k, v, kv, s)
    else:
        keys, values = torch.cat([kv.k[:, :, :s], k], dim=2), torch.cat([kv.v[:, :, :s], v], dim=2)
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    # A data-less tensor subclass, made outside the stream checks' dispatch mode (``cpu_streams.unrecorded``).
    mask = cpu_streams.unrecorded(causal_lower_right, n, s + n) if s > 0 else None
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling)
    return out.transpose(1, 2)


def split_attention(q: torch.Tensor, mode: str) -> bool:
    """Whether a tile attends as two flash blocks (``tile_attention``) rather than one masked call under
    ``mode`` (``RPP_DEBUG_TILE_ATTENTION``): ``split`` or ``bias``. ``auto`` splits on CPU workers (the masked call
    materialises its mask there) and on GPUs where the blocks run on cuDNN's fused attention
    (``tile_attention.cudnn_blocks``: 8 tiles of qwen3-8b LoRA at 65,536 tokens took 1.09x the whole
    sequence's step there, against 1.44x on flash attention 2 or with the mask; docs/benchmarks.md); else
    the masked call."""
    if mode == "auto":
        if q.device.type != "cuda":
            return True
        return q.dtype in (torch.float16, torch.bfloat16) and tile_attention.cudnn_blocks(q)
    if mode == "split" and q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"RPP_DEBUG_TILE_ATTENTION=split: flash attention on GPUs takes float16 or bfloat16, not {q.dtype}; "
            "set RPP_DEBUG_TILE_ATTENTION=bias (or auto) for this model"
        )
    return mode == "split"


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Host bytes per token of the keys and values a sequence-tiled call keeps between its forward and
    backward: both, for each attention layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


_router_lock = threading.Lock()
_router_installed = False


def install_attention_router() -> None:
    """Route Hugging Face's ``sdpa`` attention function through :func:`attend` while a tile is computed.

    RoundPipe's fused attention modules and its tiled layers call :func:`attend` themselves; a plain
    Hugging Face attention module calls ``ALL_ATTENTION_FUNCTIONS["sdpa"]``, transformers' registry of
    attention functions, which this wraps once per process: outside a tile the wrapper calls the
    original function with the same arguments, so nothing else changes."""
    global _router_installed
    with _router_lock:
        if _router_installed:
            return
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        original = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def sdpa_or_tile(
            module: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Optional[torch.Tensor],
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            if active() is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            if kwargs.get("sliding_window"):
                raise ValueError("sequence tiles: sliding-window attention layers are not supported")
            out = attend(
                getattr(module, "layer_idx", None), query, key, value, kwargs.get("scaling"), kwargs.get("dropout", 0.0)
            )
            return out, None

        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_or_tile
        _router_installed = True
