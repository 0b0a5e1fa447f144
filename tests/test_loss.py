"""The chunked causal-LM loss equals cross-entropy on full logits, without ever building them."""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
import torch.nn.functional as F
from helpers import SyncRecorder, rel_err
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_known_count_gathers_the_counted_rows(head_kind: str) -> None:
    """``num_valid`` (the counted-token number, known on the host): only the counted rows go through the
    head (the logits matmul sees that many rows), with the loss and gradients of the masked path and no
    syncing op."""
    g = torch.Generator().manual_seed(6)
    B, T = 4, 24
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    linear = nn.Linear(H, V, bias=False).double()
    head = linear if head_kind == "linear" else nn.Sequential(linear)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :20] = -100  # a prompt
    labels[2] = -100  # a padded row
    target = shift_causal_labels(labels)
    counted = int((target != -100).sum())
    ref_sum, ref_n = causal_lm_loss(hidden, head, labels, chunk_size=8)
    ref_sum.backward()
    ref_h, ref_w = hidden.grad.clone(), linear.weight.grad.clone()
    hidden.grad = None
    linear.weight.grad = None
    with SyncRecorder() as rec:
        got_sum, got_n = causal_lm_loss(hidden, head, labels, chunk_size=8, num_valid=counted)
        got_sum.backward()
    assert rec.syncs == []
    assert got_n == ref_n and rel_err(got_sum, ref_sum) < TOL
    assert rel_err(hidden.grad, ref_h) < TOL and rel_err(linear.weight.grad, ref_w) < TOL
    assert torch.count_nonzero(hidden.grad.abs().sum(-1)) == counted  # ignored rows get no gradient
    # The head ran on the counted rows only: no op produced a [rows, V] tensor with more rows.
    with _LargestTensor() as big:
        causal_lm_loss(hidden.detach(), head, labels, chunk_size=1024, num_valid=counted)
    assert big.largest <= counted * V


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


# ---------------------------------------------------------------------------------------------------------
# Ignored tokens are masked, not gathered: exact values, and no host synchronisation
# ---------------------------------------------------------------------------------------------------------

CHUNK = 8


def _ignored_chunks_target(seed: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """N targets that, in chunks of CHUNK rows, give: an all-ignored chunk, a mixed one, a chunk with
    nothing ignored, a chunk with one counted token, a mixed one, another all-ignored chunk, and an
    all-ignored partial chunk at the end."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (N,), generator=g)
    target[target == ignore_index] = (ignore_index + 1) % V  # only the rows set below are ignored
    ignored = torch.zeros(N, dtype=torch.bool)
    ignored[0:8] = True
    ignored[8:16:3] = True
    ignored[24:31] = True
    ignored[33:40:2] = True
    ignored[40:50] = True
    target[ignored] = ignore_index
    return target


def _full_ref(
    hidden: torch.Tensor,
    head: nn.Linear,
    target: torch.Tensor,
    ignore_index: int = -100,
    scale: float = 1.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Plain cross-entropy on full logits, in the inputs' dtype (float64 inputs: a float64 reference)."""
    z = head(hidden) * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, target, ignore_index=ignore_index, reduction="sum")


def _chunked(
    hidden: torch.Tensor,
    head: nn.Linear,
    target: torch.Tensor,
    head_kind: str,
    ignore_index: int = -100,
    scale: float = 1.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """The chunked loss in chunks of CHUNK rows: fused linear path, or the module path (any non-Linear)."""
    kw = dict(chunk_size=CHUNK, ignore_index=ignore_index, logit_scale=scale, softcap=softcap)
    if head_kind == "linear":
        return linear_cross_entropy(hidden, head.weight, target, head.bias, **kw)
    return chunked_module_cross_entropy(hidden, nn.Sequential(head), target, **kw)


@pytest.mark.parametrize("head_kind", ["linear", "module"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("transform", [(1.0, None), (0.5, 2.0)], ids=["plain", "scale_softcap"])
def test_matches_cross_entropy_with_ignored_chunks(head_kind: str, dtype: torch.dtype, transform: tuple) -> None:
    """Loss and gradients equal F.cross_entropy on full logits when whole chunks, parts of chunks or
    nothing is ignored; the reference is float64 for float64 inputs. The chunks compute in fp32, or in
    the inputs' dtype above it (float64 models keep their precision)."""
    scale, softcap = transform
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    head = nn.Linear(H, V).to(dtype)
    target = _ignored_chunks_target()
    ref = _full_ref(hidden, head, target, scale=scale, softcap=softcap)
    (ref * 0.37).backward()
    ref_grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad()
    got = _chunked(hidden, head, target, head_kind, scale=scale, softcap=softcap)
    (got * 0.37).backward()
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(got, ref) < TOL
    for g_, r in zip([hidden.grad] + [p.grad for p in head.parameters()], ref_grads):
        assert rel_err(g_, r) < TOL
    assert hidden.grad[target == -100].abs().sum() == 0  # ignored tokens get exactly zero gradient
    with torch.no_grad():
        assert rel_err(_chunked(hidden, head, target, head_kind, scale=scale, softcap=softcap), ref) < TOL


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_ignored_rows_never_reach_the_result(head_kind: str) -> None:
    """Hidden states of ignored tokens are never read: NaN/inf there (fully masked padding rows can be
    NaN) change neither the loss nor any gradient, although those rows are now computed and masked."""
    g = torch.Generator().manual_seed(2)
    clean = torch.randn(N, H, generator=g)
    head = nn.Linear(H, V)
    target = _ignored_chunks_target()
    ignored = target == -100
    dirty = clean.clone()
    dirty[ignored] = float("nan")
    dirty[ignored.nonzero()[::2, 0]] = float("inf")
    results = []
    for h0 in (clean, dirty):
        hidden = h0.clone().requires_grad_()
        loss = _chunked(hidden, head, target, head_kind)
        loss.backward()
        results.append([loss, hidden.grad] + [p.grad.clone() for p in head.parameters()])
        head.zero_grad()
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_ignore_index_may_be_a_class_id(head_kind: str) -> None:
    """A custom ignore_index (here a real class id) is honoured the same way on both paths."""
    hidden, weight, _, _ = _data()
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    target = _ignored_chunks_target(ignore_index=3)
    ref = _full_ref(hidden, head, target, ignore_index=3)
    ref.backward()
    ref_h = hidden.grad.clone()
    hidden.grad = None
    got = _chunked(hidden, head, target, head_kind, ignore_index=3)
    got.backward()
    assert rel_err(got, ref) < TOL and rel_err(hidden.grad, ref_h) < TOL


@pytest.mark.parametrize("head_kind", ["linear", "module"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_no_host_sync(head_kind: str, grad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward issue no op that makes the host wait for the device (CPU check)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, H, generator=g, requires_grad=grad)
    head = nn.Linear(H, V).requires_grad_(grad)
    target = _ignored_chunks_target()

    def forbidden(*args, **kwargs) -> None:
        raise AssertionError("host sync in the chunked loss")

    for method in ("nonzero", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, forbidden)
    with SyncRecorder() as rec:
        loss = _chunked(hidden, head, target, head_kind)
        if grad:
            loss.backward()
    monkeypatch.undo()
    assert "mm" in rec.ops or "addmm" in rec.ops  # the recorder did see the loss's ops
    assert rec.syncs == []
    assert rel_err(loss, _full_ref(hidden, head, target)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", ["linear", "linear_no_grad", "linear_compiled", "module", "causal_lm", "causal_lm_counted"]
)
def test_no_host_sync_on_cuda(case: str) -> None:
    """On CUDA, forward + backward run under ``set_sync_debug_mode("error")``: any synchronising call
    (nonzero, item, blocking copies) raises. The values are checked against full logits afterwards."""
    if case == "linear_compiled":
        pytest.importorskip("triton")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, H, generator=g).to(dev).requires_grad_(case != "linear_no_grad")
    head = nn.Linear(H, V).to(dev)
    target = _ignored_chunks_target().to(dev)
    counted = int((target != -100).sum().cpu()) if case == "causal_lm_counted" else None  # before the check

    def run() -> torch.Tensor:
        if case.startswith("causal_lm"):  # the fused head job's entry point, with pre-shifted targets
            loss, _ = causal_lm_loss(
                hidden.unsqueeze(0), head, shift_labels=target.unsqueeze(0), chunk_size=CHUNK, num_valid=counted
            )
        elif case == "module":
            loss = chunked_module_cross_entropy(hidden, nn.Sequential(head), target, chunk_size=CHUNK)
        else:
            loss = linear_cross_entropy(
                hidden, head.weight, target, head.bias, chunk_size=CHUNK, compile=case == "linear_compiled"
            )
        if loss.requires_grad:
            loss.backward()
        return loss

    if case == "linear_compiled":
        run()  # compiling syncs (once); the compiled chunk function must not
        hidden.grad = None
        head.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    hidden_cpu = hidden.detach().cpu().requires_grad_()
    head_cpu = nn.Linear(H, V)
    head_cpu.load_state_dict({k: v.cpu() for k, v in head.state_dict().items()})
    ref = _full_ref(hidden_cpu, head_cpu, target.cpu())
    assert rel_err(loss, ref) < TOL
    if hidden.grad is not None:
        ref.backward()
        assert rel_err(hidden.grad, hidden_cpu.grad) < TOL
        assert rel_err(head.weight.grad, head_cpu.weight.grad) < TOL
