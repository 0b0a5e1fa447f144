"""The chunked causal-LM loss equals cross-entropy on full logits, without ever building them."""

from __future__ import annotations

import os

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import rel_err
from roundpipe.models.loss import (
    causal_lm_loss,
    chunked_module_cross_entropy,
    count_loss_tokens,
    linear_cross_entropy,
    shift_causal_labels,
)

# Tiny models: intra-op threads only add synchronisation overhead (8x slower on the 2-core CI).
torch.set_num_threads(1)

TOL = 1e-6
N, H, V = 50, 16, 96


def _data(seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    target[::7] = -100
    return hidden, weight, b, target


def _full(hidden, weight, b, target, logit_scale=1.0, softcap=None):
    z = F.linear(hidden, weight, b).float() * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, target, ignore_index=-100, reduction="sum")


def _grads(*ts):
    out = [t.grad.clone() for t in ts if t is not None]
    for t in ts:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk_size", [7, 16, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transform", [(1.0, None), (0.5, None), (1.0, 2.0)], ids=["plain", "scale", "softcap"])
def test_linear_cross_entropy_matches_full_logits(chunk_size, bias, transform) -> None:
    scale, softcap = transform
    hidden, weight, b, target = _data(bias=bias)
    ref = _full(hidden, weight, b, target, scale, softcap)
    (ref * 0.37).backward()
    ref_grads = _grads(hidden, weight, b)
    got = linear_cross_entropy(hidden, weight, target, b, chunk_size=chunk_size, logit_scale=scale, softcap=softcap)
    (got * 0.37).backward()  # the incoming gradient scales the stored chunk gradients
    assert rel_err(got, ref) < TOL
    for g, r in zip(_grads(hidden, weight, b), ref_grads):
        assert rel_err(g, r) < TOL


def test_gradient_only_where_needed() -> None:
    """Frozen head (LoRA): no weight gradient is computed; no-grad mode gives the same value."""
    hidden, weight, _, target = _data()
    weight.requires_grad_(False)
    ref = _full(hidden, weight, None, target)
    ref.backward()
    (ref_h,) = _grads(hidden)
    got = linear_cross_entropy(hidden, weight, target, chunk_size=8)
    got.backward()
    assert weight.grad is None and rel_err(hidden.grad, ref_h) < TOL
    with torch.no_grad():
        assert rel_err(linear_cross_entropy(hidden, weight, target, chunk_size=8), ref) < TOL


def test_all_ignored_gives_zero() -> None:
    hidden, weight, _, target = _data()
    target.fill_(-100)
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_module_head_path_matches() -> None:
    """A head that is not a plain nn.Linear (e.g. LoRA-wrapped) takes the checkpointed chunk path."""
    hidden, weight, _, target = _data()
    head = nn.Sequential(nn.Linear(H, H), nn.Linear(H, V))
    ref = F.cross_entropy(head(hidden).float(), target, ignore_index=-100, reduction="sum")
    ref.backward()
    ref_grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad()
    got = chunked_module_cross_entropy(hidden, head, target, chunk_size=9)
    got.backward()
    assert rel_err(got, ref) < TOL
    for g, r in zip([hidden.grad] + [p.grad for p in head.parameters()], ref_grads):
        assert rel_err(g, r) < TOL


def test_causal_lm_loss_matches_transformers() -> None:
    """Shifted labels, ignore_index, batch mean == transformers' ForCausalLMLoss on full logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(3)
    B, T = 3, 9
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    head = nn.Linear(H, V, bias=False)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, :4] = -100
    labels[2, -1] = -100
    ref = ForCausalLMLoss(head(hidden), labels, V)
    ref.backward()
    ref_h, ref_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = None
    head.weight.grad = None
    loss_sum, n = causal_lm_loss(hidden, head, labels, chunk_size=5)
    assert n.item() == count_loss_tokens(labels) == int((shift_causal_labels(labels) != -100).sum())
    (loss_sum / n).backward()
    assert rel_err(loss_sum / n, ref) < TOL
    assert rel_err(hidden.grad, ref_h) < TOL and rel_err(head.weight.grad, ref_w) < TOL
    # Pre-shifted targets (shift_labels) give the same.
    with torch.no_grad():
        s, m = causal_lm_loss(hidden, head, shift_labels=shift_causal_labels(labels))
    assert rel_err(s / m, ref) < TOL


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_never_materialises_full_logits(head_kind: str) -> None:
    """Forward and backward of 4096 tokens x 512 vocab: no tensor is larger than a chunk's logits."""
    tokens, hidden_size, vocab, chunk = 4096, 16, 512, 256
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab, bias=False)
    if head_kind == "module":
        head = nn.Sequential(head)
    target = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as mode:
        if head_kind == "linear":
            loss = linear_cross_entropy(hidden, head.weight, target, chunk_size=chunk)
        else:
            loss = chunked_module_cross_entropy(hidden, head, target, chunk_size=chunk)
        loss.backward()
    assert mode.largest <= chunk * vocab < tokens * vocab
    ref = F.cross_entropy(head(hidden), target, reduction="sum")
    assert rel_err(loss, ref) < TOL


def test_compiled_chunks_match_eager() -> None:
    pytest.importorskip("torch._inductor")
    hidden, weight, _, target = _data()
    eager = linear_cross_entropy(hidden, weight, target, chunk_size=16, compile=False)
    eager.backward()
    ref_h, ref_w = _grads(hidden, weight)
    compiled = linear_cross_entropy(hidden, weight, target, chunk_size=16, compile=True)
    compiled.backward()
    assert rel_err(compiled, eager) < TOL
    assert rel_err(hidden.grad, ref_h) < TOL and rel_err(weight.grad, ref_w) < TOL
