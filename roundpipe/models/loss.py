"""Memory-light causal language-model loss.

The full-vocabulary logits of a microbatch are by far its largest activation (tokens x vocab in fp32:
16k tokens x 152k vocab = 9.3 GiB), larger than a whole decoder layer's weights. This module never
materialises them: tokens are processed in chunks, each chunk computes ``lm_head`` + an fp32
log-softmax, and only a scalar loss leaves the chunk.

Backward is chunked too. :class:`LinearCrossEntropy` computes the gradients w.r.t. the hidden states
and the head weight chunk by chunk *inside its forward* whenever autograd will need them, and its
backward only scales them by the incoming gradient. In RoundPipe the loss stage runs with grad enabled
only right before its backward (the fused last stage, or the backward recompute), so this does the
minimum work: one logits matmul and two gradient matmuls per chunk, with no recompute of the logits.
Heads that are not a plain weight matrix (e.g. a LoRA-wrapped ``lm_head``) fall back to
:func:`chunked_module_cross_entropy`, which checkpoints each chunk with ``torch.utils.checkpoint``.

Both return the *sum* of the token losses and the caller divides by the token count of the whole batch,
so that a batch split into microbatches gives exactly the loss of the unsplit batch.

No host synchronisation: chunks are fixed row ranges of the batch, and tokens whose target is
``ignore_index`` are computed and then masked out. Gathering only the counted tokens would need their
number on the host (``nonzero``), which on CUDA blocks the thread that issues the GPU work until the
device has caught up (twice per iteration for the fused head job: forward and backward recompute).
The price is the compute of the ignored tokens' logits, unless the caller knows the number of counted
tokens on the host without waiting (``causal_lm_loss(num_valid=...)``; RoundPipe's causal-LM preset
counts them in its first stage and reads the count stages later, see ``transfer.HostScalar``): then
only the counted rows are gathered (``torch.nonzero_static``, which needs no sync) and computed.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit in 1 GiB, in [256, 8192].

    Measured on an H100 (bf16, 16k tokens, vocab 152k): chunks of 1024 tokens run within 5% of the
    fastest chunking (0.1 s for forward + backward at hidden 4096) while the loss adds 1.8 GiB at most
    (weight gradient included) instead of 28 GiB for full logits; 256-token chunks are 1.5x slower.
    """
    return max(256, min(8192, 1 << int(math.log2(2**30 / (4 * max(vocab_size, 1))))))


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss math: fp32 for low-precision models (as Hugging Face's loss), the model's own
    above (float64 models keep float64: their tests compare to 1e-10)."""
    return torch.promote_types(dtype, torch.float32)


def _transform_logits(
    z: torch.Tensor,  # [rows, vocab] fp32 (at least) logits
    logit_scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Apply the model's logit scaling and final soft-capping (Gemma 2) to fp32 logits."""
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _mask_rows(
    h: torch.Tensor,  # [rows, hidden]
    target: torch.Tensor,  # [rows] token ids
    ignore_index: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's rows as ``(hidden, safe target, counted mask)``, without a host sync.

    Ignored rows get hidden state 0 and target 0 so the chunk math can run on every row: their hidden
    states may be garbage (fully masked padding can give NaN rows), and a NaN there would otherwise reach
    the weight gradient through ``d.T @ h`` even with ``d``'s row zeroed (0 * NaN = NaN). Ignored rows
    thus never influence the result, as when only the counted rows were gathered.
    """
    valid = target != ignore_index
    return torch.where(valid.unsqueeze(1), h, 0), torch.where(valid, target, 0), valid


def _chunk_loss(
    h: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [vocab, hidden]
    bias: Optional[torch.Tensor],  # [vocab]
    target: torch.Tensor,  # [rows] token ids (0 where not valid)
    valid: torch.Tensor,  # [rows] bool: counted
    logit_scale: float,
    softcap: Optional[float],
    dlogits: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum of the cross-entropy of the ``valid`` rows of one chunk (fp32 math at least, as Hugging Face's
    loss) and, with ``dlogits``, d(loss sum)/d(raw logits) ``[rows, vocab]`` in ``h``'s dtype (all-zero
    rows where not ``valid``); without it, None."""
    z = _transform_logits(F.linear(h, weight, bias).to(loss_dtype(h.dtype)), logit_scale, softcap)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    loss = torch.where(valid, lse.squeeze(1) - z.gather(1, target.unsqueeze(1)).squeeze(1), 0.0).sum()
    if not dlogits:
        return loss, None
    d = torch.exp(z - lse)
    d.scatter_add_(1, target.unsqueeze(1), torch.full_like(target, -1, dtype=d.dtype).unsqueeze(1))
    if softcap is not None:
        d = d * (1.0 - (z / softcap) ** 2)
    if logit_scale != 1.0:
        d = d * logit_scale
    return loss, torch.where(valid.unsqueeze(1), d, 0.0).to(h.dtype)


_compiled: dict = {}


def _maybe_compiled(fn: Callable, compile: Optional[bool]) -> Callable:
    """``fn`` under torch.compile unless compile is off (``RPP_DISABLE_TORCH_COMPILE=1``).

    Compilation fuses the fp32 upcast, log-sum-exp, softmax and one-hot subtraction of a chunk into a
    few kernels; the matmul stays with cuBLAS.
    """
    if compile is None:
        from roundpipe import settings

        compile = not settings.DISABLE_TORCH_COMPILE.get()
    if not compile:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


class LinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``cross_entropy(hidden @ weight.T + bias, target)``, chunked over tokens.

    Chunks are fixed row ranges; tokens whose target is ``ignore_index`` are computed but masked out, so
    nothing waits on the device (see the module docstring). Gradients are produced chunk by chunk during
    forward and stored: ``hidden``-sized and ``weight``-sized buffers (the weight gradient accumulates in
    the weight's dtype, as a single autograd matmul would produce).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: Optional[torch.Tensor],  # [V]
        target: torch.Tensor,  # [N] token ids
        chunk_size: int,
        ignore_index: int,
        logit_scale: float,
        softcap: Optional[float],
        compile: Optional[bool],
    ) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk_fn = _maybe_compiled(_chunk_loss, compile)
        loss = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)
        # Every row of grad_h is written by its chunk (ignored rows get 0 @ weight = 0), so no zero fill.
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        grad_h_chunks = grad_h.split(chunk_size) if grad_h is not None else None
        for i, (h, t) in enumerate(zip(hidden.split(chunk_size), target.split(chunk_size))):
            h, t, valid = _mask_rows(h, t, ignore_index)
            chunk_loss, d = chunk_fn(h, weight, bias, t, valid, logit_scale, softcap, True)
            assert d is not None
            loss += chunk_loss
            if grad_h_chunks is not None:
                torch.mm(d, weight.to(d.dtype), out=grad_h_chunks[i])
            if grad_w is not None:
                grad_w.addmm_(d.t().to(weight.dtype), h.to(weight.dtype))
            if grad_b is not None:
                grad_b += d.sum(0).to(bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors

        def scale(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if g is None else g * grad_loss.to(g.dtype)

        return scale(grad_h), scale(grad_w), scale(grad_b), None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    target: torch.Tensor,  # [N] token ids
    bias: Optional[torch.Tensor] = None,  # [V]
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: Optional[int] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    compile: Optional[bool] = None,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T (+ bias)`` against ``target``, chunked.

    Args:
        hidden: ``[N, H]`` hidden states.
        weight: ``[V, H]`` output projection (``lm_head.weight``).
        target: ``[N]`` token ids; ``ignore_index`` entries contribute nothing.
        bias: Optional ``[V]`` bias.
        chunk_size: Tokens per chunk; default :func:`default_chunk_size` of the vocabulary.
        logit_scale: Multiplier on the logits before the softmax (Cohere, Granite).
        softcap: Final logit soft-capping ``cap * tanh(z / cap)`` (Gemma 2).
        compile: torch.compile the per-chunk math; default: on unless ``RPP_DISABLE_TORCH_COMPILE=1``.

    Returns:
        fp32 scalar: the *sum* over counted tokens (divide by the whole batch's count yourself).
    """
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    tensors = (hidden, weight) + ((bias,) if bias is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return LinearCrossEntropy.apply(
            hidden, weight, bias, target, chunk_size, ignore_index, logit_scale, softcap, compile
        )
    chunk_fn = _maybe_compiled(_chunk_loss, compile)
    loss = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)
    for h, t in zip(hidden.split(chunk_size), target.split(chunk_size)):
        h, t, valid = _mask_rows(h, t, ignore_index)
        loss += chunk_fn(h, weight, bias, t, valid, logit_scale, softcap, False)[0]
    return loss


def _module_chunk_loss(
    head: nn.Module,  # [rows, H] -> [rows, V]
    h: torch.Tensor,  # [rows, H]
    target: torch.Tensor,  # [rows] token ids
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
) -> torch.Tensor:
    """Loss sum of the counted rows of one chunk through ``head``.

    The masking happens in here so that a checkpoint of this function keeps only views of ``hidden``
    (alive anyway) for backward, not a masked copy per chunk.
    """
    h, t, valid = _mask_rows(h, target, ignore_index)
    z = _transform_logits(head(h).to(loss_dtype(h.dtype)), logit_scale, softcap)
    return torch.where(valid, F.cross_entropy(z, t, reduction="none"), 0.0).sum()


def chunked_module_cross_entropy(
    hidden: torch.Tensor,  # [N, H]
    head: nn.Module,  # [rows, H] -> [rows, V]
    target: torch.Tensor,  # [N] token ids
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = 1024,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Like :func:`linear_cross_entropy` for an arbitrary head module (e.g. LoRA-wrapped ``lm_head``).

    Each chunk runs under ``torch.utils.checkpoint``, so its logits are dropped after forward and
    recomputed one chunk at a time in backward. Like :func:`linear_cross_entropy`, chunks are fixed row
    ranges with the ignored tokens masked out, so there is no host synchronisation.
    """
    loss = torch.zeros((), dtype=loss_dtype(hidden.dtype), device=hidden.device)
    # split (views) rather than slicing: its backward concatenates the chunks' gradients once instead
    # of every chunk producing a hidden-sized gradient to accumulate.
    for h, t in zip(hidden.split(chunk_size), target.split(chunk_size)):
        args = (head, h, t, ignore_index, logit_scale, softcap)
        if torch.is_grad_enabled():
            loss = loss + checkpoint(_module_chunk_loss, *args, use_reentrant=False)
        else:
            loss = loss + _module_chunk_loss(*args)
    return loss


def shift_causal_labels(
    labels: torch.Tensor,  # [..., T] token ids
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Targets for next-token prediction: ``labels[:, 1:]`` padded with ``ignore_index`` at the end
    (the same shift as transformers' ``ForCausalLMLoss``)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def check_label_range(
    labels: Optional[torch.Tensor],  # [..., T] token ids
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
    shifted: bool = False,
    name: str = "labels",
) -> None:
    """Every target of a causal-LM loss is a token id in ``[0, vocab_size)`` or ``ignore_index``; a
    ValueError naming the first that is not otherwise. Checked on the caller's thread before any device
    runs: an out-of-range target would otherwise fail inside a loss kernel on a worker, as a device-side
    assert on a GPU (after which the CUDA context is unusable) or an index error of a compiled kernel.
    ``shifted``: ``labels`` are the targets themselves (``shift_labels``); else ``labels[..., 1:]`` are."""
    if labels is None or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return
    target = labels if shifted else labels[..., 1:]
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if not bool(bad.any()):
        return
    where = [int(i) for i in bad.nonzero()[0]]
    value = int(target[tuple(where)])
    if not shifted and where:
        where[-1] += 1  # the position in ``labels``
    raise ValueError(
        f"{name}{where} = {value} is not a token id of this model (vocab_size={vocab_size}): a label is a token id in "
        f"[0, {vocab_size}) or ignore_index={ignore_index}"
    )


def count_loss_tokens(
    labels: Optional[torch.Tensor] = None,  # [B, T] token ids
    shift_labels: Optional[torch.Tensor] = None,  # [B, T] targets, already shifted
    ignore_index: int = IGNORE_INDEX,
) -> int:
    """Number of tokens a causal-LM loss counts for this batch: the normaliser of the batch mean."""
    target = shift_labels if shift_labels is not None else shift_causal_labels(labels, ignore_index)
    return int((target != ignore_index).sum())


def causal_lm_loss(
    hidden: torch.Tensor,  # [B, T, H]
    head: nn.Module,  # [rows, H] -> [rows, V]
    labels: Optional[torch.Tensor] = None,  # [B, T] token ids
    *,
    shift_labels: Optional[torch.Tensor] = None,  # [B, T] targets, already shifted
    ignore_index: int = IGNORE_INDEX,
    chunk_size: Optional[int] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    compile: Optional[bool] = None,
    num_valid: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal-LM loss of ``head(hidden)`` without materialising the logits.

    Args:
        hidden: ``[B, T, H]`` final (normed) hidden states.
        head: The output projection; a plain ``nn.Linear`` takes the fused :class:`LinearCrossEntropy`
            path, anything else the checkpointed per-chunk path.
        labels: ``[B, T]`` token labels, shifted here as transformers does (position t predicts t+1).
        shift_labels: Already shifted ``[B, T]`` targets (then ``labels`` is ignored).
        num_valid: The number of counted targets when the host knows it without waiting for the device
            (see ``CausalLMPrefix``): the counted rows are then gathered first (``nonzero_static``,
            no sync), so ignored tokens (prompts, padding) cost no head compute.

    Returns:
        ``(loss_sum, num_tokens)``: fp32 sum of the token losses and the fp32 count of counted tokens.
    """
    target = shift_labels if shift_labels is not None else shift_causal_labels(labels, ignore_index)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1).to(hidden.device)
    num_tokens = (target != ignore_index).sum().to(torch.float32)
    if num_valid is not None and num_valid < target.numel():
        rows = torch.nonzero_static(target != ignore_index, size=num_valid).squeeze(1)
        hidden2d, target = hidden2d.index_select(0, rows), target.index_select(0, rows)
    if type(head) is nn.Linear:
        loss = linear_cross_entropy(
            hidden2d,
            head.weight,
            target,
            head.bias,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            logit_scale=logit_scale,
            softcap=softcap,
            compile=compile,
        )
    else:
        loss = chunked_module_cross_entropy(
            hidden2d,
            head,
            target,
            ignore_index=ignore_index,
            chunk_size=chunk_size or default_chunk_size(getattr(head, "out_features", 1 << 17)),
            logit_scale=logit_scale,
            softcap=softcap,
        )
    return loss, num_tokens
