"""A sequence tile's causal attention over ``[prefix, tile]`` as two flash-attention blocks.

Tile t of a sequence (``roundpipe.runtime.sequence``) attends to every key of the earlier tiles and
causally to its own. One ``scaled_dot_product_attention`` call with a bottom-right causal mask does
that (``RPP_DEBUG_TILE_ATTENTION=bias``), but how fast depends on which kernel torch picks for the mask; on
CPU workers it materialises a ``tile x (prefix + tile)`` mask. Here (``split``) the two parts are
separate kernels with no mask at all:

* the prefix block, every query against every earlier key (not causal);
* the diagonal block, the tile against itself (causal, square: the usual upper-left mask).

Each returns its output and the log-sum-exp of its rows; the outputs merge with weights
``exp(lse_block - lse)``, where ``lse = logaddexp(lse_prefix, lse_diagonal)``. The backward calls each
block's flash backward with the *merged* output and log-sum-exp: the block's softmax probabilities are
then those of the whole row, and ``rowsum(dout * out)`` is the whole row's, so the block gradients are
exact (the identity ring attention uses). On CUDA cuDNN's fused attention where a probe finds it exact
(``cudnn_blocks``), else flash attention 2 (``aten._scaled_dot_product_flash_attention``); its CPU kernel on
CPU workers (float64 included, which the tests use).

Grouped-query attention: key and value heads are repeated to the query heads for the kernels (the prefix
again in the backward rather than kept: a backward job recomputes a whole layer group before it runs
backward, so every layer's repeated prefix would be alive at once); their gradients sum over the group.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

import torch
from torch import Tensor

Extra = Tuple[Any, ...]  # what a CUDA flash block's backward needs besides out and lse


def _repeat(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: Tensor, groups: int) -> Tensor:
    """The gradient of ``_repeat``: the query heads of a group summed onto their key/value head."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _block(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], kind: Optional[str] = None
) -> Tuple[Tensor, Tensor, Extra]:
    """One flash-attention block: output ``[b, h, n, d]``, the rows' log-sum-exp ``[b, h, n]`` (a kernel may
    pad the rows), and what its backward needs (the kernel first). ``kind``: ``cudnn`` or ``flash`` on CUDA
    (default: ``cudnn_blocks``)."""
    if q.device.type == "cuda":
        if kind is None:
            kind = "cudnn" if cudnn_blocks(q) else "flash"
        if kind == "cudnn":
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            rows = lse.reshape(*lse.shape[:2], -1)[..., : q.shape[2]]
            return out.contiguous(), rows, ("cudnn", lse.shape, cq, ck, mq, mk, seed, offset)
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, ("flash", cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: Optional[float],
    extra: Extra,
) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    if q.device.type == "cuda":
        if extra[0] == "cudnn":
            shape, cq, ck, mq, mk, seed, offset = extra[1:]
            lse = lse[..., : q.shape[2]].reshape(shape).contiguous()  # in the layout the kernel gave
            q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale
            )
        cq, ck, mq, mk, seed, offset = extra[1:]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


_cudnn_ok: Dict[Tuple[Any, ...], bool] = {}  # (device index, dtype, head size) -> cuDNN's blocks passed the probe


def cudnn_blocks(q: Tensor) -> bool:
    """Whether the blocks of ``q``'s tiles run on cuDNN's fused attention rather than flash attention 2.

    On Hopper torch picks cuDNN's kernels for a whole sequence's causal attention; the flash-attention 2
    kernels ran a tile's blocks 1.7x slower (qwen3-8b LoRA, 8 tiles of 8,192 tokens, one H200, profiled);
    on cuDNN they took as long as the whole sequence's attention. Decided once
    per (device, dtype, head size) by a probe: the blocks of a small random tile (a rectangular prefix
    block and a causal diagonal block, merged, then both backward with the merged output and
    log-sum-exp, queries strided as a layer's are) on cuDNN against flash attention 2; any error or
    difference keeps flash attention 2."""
    key = (q.device.index, q.dtype, q.shape[-1])
    ok = _cudnn_ok.get(key)
    if ok is None:
        ok = _cudnn_ok[key] = _probe_cudnn(q)
    return ok


def _probe_cudnn(like: Tensor) -> bool:
    g = torch.Generator(device=like.device).manual_seed(0)
    d, dt = like.shape[-1], like.dtype

    def rand(n: int) -> Tensor:  # [1, 2, n, d] viewed from [1, n, 2, d], as a layer's projections give them
        return torch.randn(1, n, 2, d, device=like.device, dtype=dt, generator=g).transpose(1, 2)

    q, k, v, pk, pv, dout = rand(128), rand(128), rand(128), rand(256), rand(256), rand(128)

    def run(kind: str) -> list:
        out_d, lse_d, extra_d = _block(q, k, v, True, None, kind)
        out_p, lse_p, extra_p = _block(q, pk, pv, False, None, kind)
        out, lse = _merge(q, out_p, lse_p, out_d, lse_d)
        grads_d = _block_backward(dout, q, k, v, out, lse, True, None, extra_d)
        grads_p = _block_backward(dout, q, pk, pv, out, lse, False, None, extra_p)
        return [out, *grads_d, *grads_p]

    try:
        for a, b in zip(run("cudnn"), run("flash")):
            a, b = a.float(), b.float()
            if a.shape != b.shape or (a - b).abs().max() > 2e-2 * b.abs().max():
                return False
        return True
    except RuntimeError:
        return False


def _merge(q: Tensor, out_p: Tensor, lse_p: Tensor, out_d: Tensor, lse_d: Tensor) -> Tuple[Tensor, Tensor]:
    """The prefix and diagonal blocks merged into the rows' output (q's dtype) and log-sum-exp."""
    lse = torch.logaddexp(lse_p, lse_d)
    n = q.shape[2]  # a kernel may pad the log-sum-exp's rows; the weights take the real ones
    w_p = torch.exp(lse_p - lse)[..., :n, None]
    w_d = torch.exp(lse_d - lse)[..., :n, None]
    out = out_p.to(w_p.dtype) * w_p + out_d.to(w_d.dtype) * w_d
    return out.to(q.dtype), lse


def forward_blocks(
    q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor, prefix_v: Tensor, scale: Optional[float]
) -> Tuple[Tensor, Tensor, Extra, Extra]:
    """The tile's attention output ``[b, heads, tile, head_dim]``, its rows' log-sum-exp, and each block's
    extras (prefix first; empty without a prefix). ``k``/``v``: the tile's own; ``prefix_*``: earlier tiles'."""
    groups = q.shape[1] // k.shape[1]
    out_d, lse_d, extra_d = _block(q, _repeat(k, groups), _repeat(v, groups), True, scale)
    if prefix_k.shape[2] == 0:
        return out_d, lse_d, (), extra_d
    out_p, lse_p, extra_p = _block(q, _repeat(prefix_k, groups), _repeat(prefix_v, groups), False, scale)
    out, lse = _merge(q, out_p, lse_p, out_d, lse_d)
    return out, lse, extra_p, extra_d


class KVGrads(Protocol):
    """Where a tile's key and value gradients go besides its own projections (``sequence._LayerKV``)."""

    def add_prefix(self, dk: Tensor, dv: Tensor) -> None:
        """Add the gradient w.r.t. the earlier tiles' keys and values (read when their backward runs)."""

    def own(self, dk: Tensor, dv: Tensor) -> Tuple[Tensor, Tensor]:
        """The tile's own key and value gradients with what later tiles added for them."""


class TileAttention(torch.autograd.Function):
    """``forward_blocks`` with autograd: gradients for the queries and the tile's own keys and values;
    the prefix is a constant here (earlier tiles' keys and values), its gradient goes to ``grads``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor, prefix_v: Tensor, scale: Optional[float],
        grads: KVGrads,
    ) -> Tensor:  # fmt: skip
        out, lse, extra_p, extra_d = forward_blocks(q, k, v, prefix_k, prefix_v, scale)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse)
        ctx.scale, ctx.extra, ctx.grads = scale, (extra_p, extra_d), grads
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        q, k, v, prefix_k, prefix_v, out, lse = ctx.saved_tensors
        extra_p, extra_d = ctx.extra
        groups = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq, dk, dv = _block_backward(
            dout, q, _repeat(k, groups), _repeat(v, groups), out, lse, True, ctx.scale, extra_d
        )
        if prefix_k.shape[2] > 0:
            dq_p, dk_p, dv_p = _block_backward(
                dout, q, _repeat(prefix_k, groups), _repeat(prefix_v, groups), out, lse, False, ctx.scale, extra_p
            )
            wide = torch.promote_types(dq.dtype, torch.float32)  # two blocks' sums, added in float32 at least
            dq = (dq.to(wide) + dq_p.to(wide)).to(dq.dtype)
            ctx.grads.add_prefix(_fold(dk_p, groups), _fold(dv_p, groups))
        dk, dv = ctx.grads.own(_fold(dk, groups), _fold(dv, groups))
        return dq, dk, dv, None, None, None, None
