"""Sequence tiling inside decoder layers: long context without position-wise activations at full length.

A Qwen3 / Llama decoder layer holds many tensors proportional to the sequence length, and most of them
are *position-wise* (each token's value depends on that token only): the norms, the q/k/v projections
and q/k norms, the rotary embedding, the o projection, the residual adds and, largest of all, the MLP's
``seq x intermediate`` gate, up and activation tensors. Only attention mixes positions. Above
``RPP_SEQ_TILE`` tokens (counted over the batch rows) a layer runs as three parts:

(a) pre-attention, ``x -> (q, k, v)`` (input norm, projections, q/k norms, rotary), tile by tile into
    preallocated full-length ``q``, ``k``, ``v`` (:class:`_PreAttention`);
(b) attention over the full length through the model's own attention function (sdpa by default:
    causal flash / memory-efficient kernels without a mask, never a ``seq x seq`` score matrix);
(c) post-attention, ``(x, attn) -> y = x + o_proj(attn) -> y + mlp(norm(y))``, tile by tile
    (:class:`_PostAttention`).

(a) and (c) are autograd Functions that save only their full-length inputs; their backward recomputes
one tile at a time under grad, back-propagates it with the tile's slice of the output gradient, writes
the tile's input gradient into a preallocated full-length gradient and sums the parameter gradients
over tiles (returned to autograd like any input's). Per tile they call the Hugging Face submodules, so
PEFT adapters, the fused kernels (:mod:`roundpipe.models.kernels`) and any activation function work;
with fused kernels and plain projections each part is one compiled op instead: the two halves of the
fused decoder layer's math (``fused_ops.pre_attention`` and ``fused_ops.post_attention``, which
``fused_ops.decoder_layer`` joins with attention for a whole untiled layer), applied per tile, PEFT LoRA
projections among them as the same fused LoRA linear (:mod:`roundpipe.models.lora`).

RoundPipe recomputes a layer right before its backward (the forward pass keeps no graph), so the
recompute avoids work the tiles would repeat:

* (c)'s output is usually only back-propagated through there (the layer ends its stage, or
  ``recompute_grain='layer'``): (c) *defers* it, returning a placeholder without memory, and
  :func:`materialize` (through which every preset stage reads hidden states) computes it when a next
  layer of the same stage does read it. The MLP then runs once per recompute + backward, as untiled.
* (a) runs untiled, with its graph, below :data:`PRE_TILES_IN_RECOMPUTE` tiles: its activations are
  O(seq x hidden), and recomputing its projections once more per tile would cost ~5% at 32K tokens.

Dropout inside the tiled parts (PEFT ``lora_dropout`` in training) draws per tile; each tile's RNG state
is recorded in forward and replayed by its backward recompute (the masks then differ from an untiled
run's, but forward, recompute and backward agree). Layers the tiles cannot reproduce exactly fall back
to the untiled forward: other families, hooks on the layer or its submodules (they would see tiles),
projections that are not ``nn.Linear`` (or PEFT layers around one). Which layers those are, and the tile
length, is :mod:`roundpipe.models.tile_choice` (the families whose record says ``tiles``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from roundpipe.devices import backend
from roundpipe.models import kernels
from roundpipe.models.fused_ops import POST_ATTENTION, PRE_ATTENTION, post_attention, pre_attention
from roundpipe.models.tile_choice import Tiles, rows_per_tile, tile_bounds, tileable
from roundpipe.runtime import sequence
from roundpipe.runtime.context import doing_recompute

_FILL_ATTR = "_rpp_tiling_fill"

PRE_TILES_IN_RECOMPUTE = 16
"""In a recompute (its backward follows at once) the pre-attention part runs untiled, keeping its graph,
below this many tiles: tiled, its backward would recompute the q/k/v projections once more, ~5% of the
layer's time at 16K-32K tokens (Qwen3-8B, H100); from 16 tiles (256K tokens at the default tile)
attention dominates, that recompute costs ~1%, and the activations it saves matter more: hidden + q +
k columns per token (18 KB for Qwen3-8B in bf16 with fused kernels, ~55 KB with Hugging Face's eager
norms)."""

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout_active(modules: Sequence[nn.Module]) -> bool:
    """Whether a dropout among ``modules`` draws random numbers (training mode, ``p > 0``)."""
    return any(isinstance(d, _DROPOUTS) and d.training and d.p > 0 for m in modules for d in m.modules())


# ---------------------------------------------------------------------------------------------------------
# One layer's tiled computation
# ---------------------------------------------------------------------------------------------------------


class _LayerTiles:
    """What the tiled parts of one layer call need: the modules, the tiles and how each tile runs."""

    def __init__(self, layer: nn.Module, tiles: Tiles) -> None:
        # Any: the Hugging Face submodules are attributes that nn.Module does not type
        lay: Any = layer
        attn: Any = lay.self_attn
        self.layer, self.attn, self.tiles = lay, attn, tiles
        self.qk_norm = hasattr(attn, "q_norm")
        self.fused_rope = kernels.is_fused(attn)
        self.pre_modules: Tuple[nn.Module, ...] = (lay.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj) + (
            (attn.q_norm, attn.k_norm) if self.qk_norm else ()
        )
        self.post_modules: Tuple[nn.Module, ...] = (attn.o_proj, lay.post_attention_layernorm, lay.mlp)
        self.pre_dropout = _dropout_active(self.pre_modules)
        self.post_dropout = _dropout_active(self.post_modules)
        ln1, ln2 = lay.input_layernorm, lay.post_attention_layernorm
        # (weights, eps) of the compiled parts, when they apply (plain or fused LoRA projections)
        self.pre_op: Optional[Tuple[Any, ...]] = None
        pre = kernels.pre_attention_weights(lay)
        if pre is not None:
            qn, kn = (attn.q_norm, attn.k_norm) if self.qk_norm else (None, None)
            eps = (
                ln1.variance_epsilon,
                *((qn.variance_epsilon, kn.variance_epsilon) if qn is not None else (0.0, 0.0)),
            )
            self.pre_op = (pre, eps)
        self.post_op: Optional[Tuple[Any, ...]] = None
        post = kernels.post_attention_weights(lay)
        if post is not None:
            self.post_op = (post, ln2.variance_epsilon)

    # ---- per tile ----

    def pre_tile(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hugging Face's attention input for one tile: ``q``, ``k``, ``v`` as ``[batch, rows, heads,
        head_dim]`` views (the projection layout, which sdpa reads through a transpose)."""
        attn = self.attn
        if self.pre_op is not None:
            return PRE_ATTENTION(x, cos, sin, self.pre_op[0], self.pre_op[1], attn.head_dim)
        h = self.layer.input_layernorm(x)
        shape = (x.shape[0], x.shape[1], -1, attn.head_dim)
        q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
        v = attn.v_proj(h).view(shape)
        if self.fused_rope:
            if self.qk_norm:
                qn, kn = attn.q_norm, attn.k_norm
                q, k = kernels.QK_NORM_ROPE(
                    q, k, qn.weight, kn.weight, qn.variance_epsilon, kn.variance_epsilon, cos, sin
                )
            else:
                q, k = kernels.ROPE(q, k, cos, sin)
        else:
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            rope = sys.modules[kernels.base_class(attn).__module__].apply_rotary_pos_emb
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def post_tile(self, x: torch.Tensor, a: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``y = x + o_proj(a); y + mlp(post_attention_layernorm(y))`` for one tile, into ``out`` if given."""
        if self.post_op is not None:
            result = POST_ATTENTION(x, a, self.post_op[0], self.post_op[1])
            return result if out is None else out.copy_(result)
        y = x + self.attn.o_proj(a)
        m = self.layer.mlp(self.layer.post_attention_layernorm(y))
        return torch.add(y, m) if out is None else torch.add(y, m, out=out)

    # ---- whole sequence, no graph ----

    def pre_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rng: Optional[List[torch.Tensor]]
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full-length ``q``, ``k``, ``v`` (``[batch, seq, heads, head_dim]``) filled tile by tile;
        ``rng`` collects each tile's RNG state when given."""
        full: List[torch.Tensor] = []
        for s, e in self.tiles:
            if rng is not None:
                rng.append(backend.get_rng_state(x.device))
            parts = self.pre_tile(x[:, s:e], cos[:, s:e], sin[:, s:e])
            if not full:  # shapes (heads) known after the first tile
                full = [t.new_empty(x.shape[:2] + t.shape[2:]) for t in parts]
            for buf, t in zip(full, parts):
                buf[:, s:e].copy_(t)
            del parts
        q, k, v = full
        return q, k, v

    def post_forward(
        self, x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, rng: Optional[List[torch.Tensor]]
    ) -> torch.Tensor:
        """The layer output, written into ``out`` tile by tile."""
        for s, e in self.tiles:
            if rng is not None:
                rng.append(backend.get_rng_state(x.device))
            self.post_tile(x[:, s:e], a[:, s:e], out=out[:, s:e])
        return out

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The layer's attention function (``config._attn_implementation``) over the full length, called
        as the Hugging Face attention module calls it; returns ``[batch, seq, heads * head_dim]``."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = self.attn
        dropout = 0.0 if not attn.training else attn.attention_dropout
        if sequence.active() is not None:  # a tile of a longer sequence (roundpipe.runtime.sequence)
            if getattr(attn, "sliding_window", None):
                raise ValueError("sequence tiles: sliding-window attention layers are not supported")
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = sequence.attend(attn.layer_idx, qh, kh, vh, attn.scaling, dropout)
            return out.reshape(q.shape[0], q.shape[1], -1).contiguous()
        eager = sys.modules[kernels.base_class(attn).__module__].eager_attention_forward
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        kwargs: Dict[str, Any] = {"position_ids": position_ids, "use_cache": False}
        if hasattr(attn, "sliding_window"):  # Qwen3 passes it (sdpa reads the mask instead)
            kwargs["sliding_window"] = attn.sliding_window
        out, _ = fn(
            attn,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            mask,
            dropout=dropout,
            scaling=attn.scaling,
            **kwargs,
        )
        return out.reshape(q.shape[0], q.shape[1], -1).contiguous()


def _trainable(modules: Sequence[nn.Module]) -> List[nn.Parameter]:
    return [p for m in modules for p in m.parameters() if p.requires_grad]


AutocastState = Tuple[bool, torch.dtype, bool]


def _autocast_state(device: torch.device) -> AutocastState:
    """The autocast settings a forward ran under, for its recompute (as ``torch.utils.checkpoint``)."""
    return (
        torch.is_autocast_enabled(device.type),
        torch.get_autocast_dtype(device.type),
        torch.is_autocast_cache_enabled(),
    )


def _autocast(device: torch.device, state: AutocastState) -> Any:
    """Autocast as ``state`` says (nothing to enter when it was off and is off)."""
    enabled, dtype, cache = state
    if not enabled and not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=cache)


@contextlib.contextmanager
def _replay(
    device: torch.device, autocast: AutocastState, rng: Optional[List[torch.Tensor]]
) -> Iterator[Callable[[int], None]]:
    """Recompute context of a tiled backward: grad on, the forward's autocast, and ``replay(k)`` setting
    tile k's RNG state (the caller's RNG state is given back afterwards)."""
    own = backend.get_rng_state(device) if rng else None
    try:
        with torch.enable_grad(), _autocast(device, autocast):
            yield (lambda k: backend.set_rng_state(device, rng[k])) if rng else (lambda k: None)
    finally:
        if own is not None:
            backend.set_rng_state(device, own)


def _tile_grads(
    outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> Sequence[Optional[torch.Tensor]]:
    """Gradients of ``inputs`` for one tile (outputs without a gradient skipped)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if not pairs or not inputs:
        return [None] * len(inputs)
    return torch.autograd.grad([o for o, _ in pairs], list(inputs), [g for _, g in pairs], allow_unused=True)


def _accumulate(acc: List[Optional[torch.Tensor]], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Add one tile's parameter gradients to the running sums (the first tile's become the sums)."""
    for i, g in enumerate(grads):
        prev = acc[i]
        if g is not None:
            acc[i] = g if prev is None else prev.add_(g)


def _write(buf: Optional[torch.Tensor], s: int, e: int, grad: Optional[torch.Tensor]) -> None:
    """One tile's input gradient into the full-length gradient (zeros where the tile had none)."""
    if buf is None:
        return
    if grad is None:
        buf[:, s:e].zero_()
    else:
        buf[:, s:e].copy_(grad)


class _PreAttention(torch.autograd.Function):
    """``x -> (q, k, v)`` tile by tile; saves ``x`` only and recomputes each tile in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, lt: _LayerTiles, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *params: torch.Tensor
    ):
        ctx.lt, ctx.cos, ctx.sin = lt, cos, sin
        ctx.autocast = _autocast_state(x.device)
        ctx.rng = [] if lt.pre_dropout else None
        ctx.save_for_backward(x, *params)
        ctx.set_materialize_grads(False)
        return lt.pre_forward(x, cos, sin, ctx.rng)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor]
    ):
        lt: _LayerTiles = ctx.lt
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[4:]) if need]
        dx = torch.empty_like(x) if need_x else None
        acc: List[Optional[torch.Tensor]] = [None] * len(wanted)
        with _replay(x.device, ctx.autocast, ctx.rng) as replay:
            for k, (s, e) in enumerate(lt.tiles):
                xt = x[:, s:e].detach().requires_grad_(need_x)
                replay(k)
                outs = lt.pre_tile(xt, ctx.cos[:, s:e], ctx.sin[:, s:e])
                gouts = [None if g is None else g[:, s:e] for g in (dq, dk, dv)]
                got = list(_tile_grads(outs, gouts, ([xt] if need_x else []) + wanted))
                del outs
                if need_x:
                    _write(dx, s, e, got.pop(0))
                _accumulate(acc, got)
        it = iter(acc)
        return (None, dx, None, None, *[next(it) if need else None for need in ctx.needs_input_grad[4:]])


class _PostAttention(torch.autograd.Function):
    """``(x, attn) -> x + o_proj(attn) -> + mlp(norm(.))`` tile by tile; saves ``x`` and ``attn`` only.
    With ``defer`` nothing is computed and the output is a placeholder without memory of its own (see
    :func:`materialize`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, lt: _LayerTiles, defer: bool, x: torch.Tensor, a: torch.Tensor, *params: torch.Tensor
    ):
        ctx.lt = lt
        ctx.autocast = _autocast_state(x.device)
        ctx.rng = [] if lt.post_dropout else None
        ctx.save_for_backward(x, a, *params)
        if defer:
            return x.new_empty(()).expand(x.shape)
        return lt.post_forward(x, a, torch.empty_like(x), ctx.rng)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # type: ignore[override]
        lt: _LayerTiles = ctx.lt
        x, a, *params = ctx.saved_tensors
        need_x, need_a = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[4:]) if need]
        dx = torch.empty_like(x) if need_x else None
        da = torch.empty_like(a) if need_a else None
        acc: List[Optional[torch.Tensor]] = [None] * len(wanted)
        with _replay(x.device, ctx.autocast, ctx.rng) as replay:
            for k, (s, e) in enumerate(lt.tiles):
                xt = x[:, s:e].detach().requires_grad_(need_x)
                at = a[:, s:e].detach().requires_grad_(need_a)
                replay(k)
                out = lt.post_tile(xt, at)
                got = list(
                    _tile_grads([out], [dout[:, s:e]], ([xt] if need_x else []) + ([at] if need_a else []) + wanted)
                )
                del out
                if need_x:
                    _write(dx, s, e, got.pop(0))
                if need_a:
                    _write(da, s, e, got.pop(0))
                _accumulate(acc, got)
        it = iter(acc)
        return (None, None, dx, da, *[next(it) if need else None for need in ctx.needs_input_grad[4:]])


class _Deferred:
    """How to compute a deferred layer output: the post-attention part's inputs (no reference to the
    output itself, so nothing keeps it alive)."""

    def __init__(self, lt: _LayerTiles, x: torch.Tensor, a: torch.Tensor) -> None:
        self.lt, self.x, self.a = lt, x.detach(), a.detach()


class _Materialize(torch.autograd.Function):
    """The deferred output's value, computed now; its gradient passes to the placeholder unchanged (the
    placeholder's backward, :class:`_PostAttention`'s, recomputes what it needs itself)."""

    @staticmethod
    def forward(ctx: Any, placeholder: torch.Tensor, deferred: _Deferred) -> torch.Tensor:  # type: ignore[override]
        return deferred.lt.post_forward(deferred.x, deferred.a, torch.empty_like(deferred.x), None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def materialize(hidden: Any) -> Any:
    """``hidden`` itself, or, when it is the placeholder of a layer output a tiled layer deferred (in a
    recompute, where the value may never be read), the computed output, connected to autograd through
    the placeholder. Every preset stage reads hidden states through this."""
    deferred = getattr(hidden, _FILL_ATTR, None)
    if deferred is None:
        return hidden
    return _Materialize.apply(hidden, deferred)


def tiled_forward(
    layer: nn.Module,
    hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    position_embeddings: Tuple[torch.Tensor, torch.Tensor],
    rows: int,
) -> torch.Tensor:
    """``layer``'s forward (a :func:`tileable` decoder layer) with its position-wise parts in tiles of
    ``rows`` positions; the same result as ``layer(hidden, attention_mask=..., position_embeddings=...)``."""
    lt = _LayerTiles(layer, tile_bounds(hidden.shape[1], rows))
    # The rotary tables carry no gradient (Hugging Face builds them under no_grad; RoundPipe marks every
    # float tensor it hands a recompute as requiring grad).
    cos, sin = (t.detach() for t in position_embeddings)
    grad = torch.is_grad_enabled()
    recompute = grad and doing_recompute()
    pre_params = _trainable(lt.pre_modules) if grad else []
    # Untiled with its graph (see PRE_TILES_IN_RECOMPUTE); not with dropout, which must draw the masks
    # the forward pass drew, per tile.
    if recompute and len(lt.tiles) < PRE_TILES_IN_RECOMPUTE and not lt.pre_dropout:
        q, k, v = lt.pre_tile(hidden, cos, sin)
    elif grad and (hidden.requires_grad or pre_params):
        q, k, v = _PreAttention.apply(lt, hidden, cos, sin, *pre_params)
    else:
        q, k, v = lt.pre_forward(hidden, cos, sin, None)
    a = lt.attention(q, k, v, attention_mask, position_ids)
    del q, k, v
    post_params = _trainable(lt.post_modules) if grad else []
    if grad and (hidden.requires_grad or a.requires_grad or post_params):
        # In a recompute the output is usually only back-propagated through: leave it to materialize().
        # Not with dropout in the tiled part: a later computation would draw other masks.
        defer = recompute and not lt.post_dropout
        out = _PostAttention.apply(lt, defer, hidden, a, *post_params)
        if defer:
            setattr(out, _FILL_ATTR, _Deferred(lt, hidden, a))
        return out
    return lt.post_forward(hidden, a, torch.empty_like(hidden), None)


def maybe_tiled_forward(
    layer: nn.Module,
    hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]],
) -> Optional[torch.Tensor]:
    """The tiled forward of ``layer`` when the input is longer than one tile (``RPP_SEQ_TILE``) and the
    layer can be tiled; None otherwise (the caller runs the layer as it is). Costs nothing measurable
    at or below the tile length."""
    if hidden.dim() != 3 or position_embeddings is None:
        return None
    rows = rows_per_tile(hidden.shape[0], hidden.shape[1])
    if rows >= hidden.shape[1] or not tileable(layer):
        return None
    return tiled_forward(layer, hidden, attention_mask, position_ids, position_embeddings, rows)


__all__ = [
    "POST_ATTENTION",
    "PRE_ATTENTION",
    "PRE_TILES_IN_RECOMPUTE",
    "materialize",
    "maybe_tiled_forward",
    "post_attention",
    "pre_attention",
    "rows_per_tile",
    "tile_bounds",
    "tileable",
    "tiled_forward",
]
