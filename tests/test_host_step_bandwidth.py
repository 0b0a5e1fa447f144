"""The one-pass host Adam step against torch.optim.AdamW: experts without tokens (``skip_zero_grad`` and Adam's
own result), subnormal moments (``flush_denormals``) and the bf16 copy the kernel writes in its loop.

Tolerance as in test_adam.py: |ours - torch| <= 1e-6 + 1e-6 * |torch| (a few float32 ulps).
"""

from __future__ import annotations

import platform
from typing import List, Optional

import pytest
import test_adam
import torch
from torch import nn

from roundpipe import settings
from roundpipe.optim import Adam
from roundpipe.optim.adam import _adam_kernel
from roundpipe.optim.fp32_step import KernelBatch

TOL = dict(rtol=1e-6, atol=1e-6)
KW = dict(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)
EXPERTS = 4
# test_adam's kernel check and its fixture (each test twice: the C++ kernel and the torch path).
_kernel_available = test_adam._kernel_available
impl = test_adam.impl


def expert_params(seed: int = 0) -> List[nn.Parameter]:
    """A router and four experts' weights, one tensor each."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(8, 16, generator=g))] + [
        nn.Parameter(torch.randn(64, 96, generator=g)) for _ in range(EXPERTS)
    ]


def routed(step: int) -> List[bool]:
    """Which experts got tokens at ``step``: expert 1 never, expert 2 on odd steps (not on the first or last)."""
    return [True, False, step % 2 == 1, True]


def grads(params: List[nn.Parameter], step: int, none_for_idle: bool) -> List[Optional[torch.Tensor]]:
    """The step's gradients: idle experts get zeros, or None (torch's view of an unused parameter)."""
    g = torch.Generator().manual_seed(100 + step)
    out: List[Optional[torch.Tensor]] = [torch.randn(params[0].shape, generator=g)]
    for p, used in zip(params[1:], routed(step)):
        full = torch.randn(p.shape, generator=g)
        out.append(full if used else (None if none_for_idle else torch.zeros_like(full)))
    return out


def run(opt: torch.optim.Optimizer, params: List[nn.Parameter], none_for_idle: bool, steps: int = 5) -> None:
    for step in range(steps):
        for p, gr in zip(params, grads(params, step, none_for_idle)):
            p.grad = gr
        opt.step()


def test_skip_zero_grad_is_torch_without_those_gradients(impl: str) -> None:
    """``skip_zero_grad``: an all-zero gradient is stepped as torch steps a None one (state, weight and step count
    untouched; an expert idle from the start has no state)."""
    ps, qs = expert_params(), expert_params()
    ours = Adam(ps, skip_zero_grad=True, **KW)
    ref = torch.optim.AdamW(qs, lr=KW["lr"], weight_decay=KW["weight_decay"])
    run(ours, ps, none_for_idle=False)
    run(ref, qs, none_for_idle=True)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        assert set(ours.state[p]) == set(ref.state[q])
        for key, val in ref.state[q].items():
            torch.testing.assert_close(ours.state[p][key], val, **TOL)
    assert len(ours.state[ps[2]]) == 0  # expert 1, never routed: never stepped
    assert ours.state[ps[3]]["step"].item() == 2.0 and ours.state[ps[4]]["step"].item() == 5.0


def test_zero_gradients_without_skip_are_adams(impl: str) -> None:
    """The default steps a zero gradient as Adam does (moments decay, the weight keeps moving): equal to torch's
    AdamW with the zeros, and not to the skipped step."""
    ps, qs, ss = expert_params(), expert_params(), expert_params()
    ours = Adam(ps, **KW)
    ref = torch.optim.AdamW(qs, lr=KW["lr"], weight_decay=KW["weight_decay"])
    skipped = Adam(ss, skip_zero_grad=True, **KW)
    run(ours, ps, none_for_idle=False)
    run(ref, qs, none_for_idle=False)
    run(skipped, ss, none_for_idle=False)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        for key, val in ref.state[q].items():
            torch.testing.assert_close(ours.state[p][key], val, **TOL)
    assert ours.state[ps[2]]["step"].item() == 5.0
    # Expert 2 was idle on the last step: Adam moved it by its momentum, the skipped step did not.
    assert (ps[3] - ss[3]).abs().max().item() > 1e-4


def test_skip_zero_grad_per_param_group(impl: str) -> None:
    """A param group's own ``skip_zero_grad`` (the experts' group) overrides the optimizer's default."""
    ps, qs = expert_params(), expert_params()
    ours = Adam([{"params": ps[:1]}, {"params": ps[1:], "skip_zero_grad": True}], **KW)
    ref = torch.optim.AdamW(qs, lr=KW["lr"], weight_decay=KW["weight_decay"])
    run(ours, ps, none_for_idle=False)
    run(ref, qs, none_for_idle=True)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)


def test_partly_zero_gradient_is_stepped(impl: str) -> None:
    """Only a gradient that is zero everywhere is skipped: a 2-d tensor with idle rows is stepped whole (3-d
    experts are skipped one by one: tests/test_expert_skip.py)."""
    p = nn.Parameter(torch.randn(32, 8))
    q = nn.Parameter(p.detach().clone())
    ours, ref = Adam([p], skip_zero_grad=True, **KW), torch.optim.AdamW([q], lr=KW["lr"], weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(32, 8)
        g[8:16] = 0.0
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), **TOL)
    assert ours.state[p]["step"].item() == 3.0


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="FTZ/DAZ are x86 modes")
@pytest.mark.parametrize("flush", [True, False])
def test_subnormal_moments(flush: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Moments in the subnormal range under zero gradients: flushed, they count as zero (the weights equal torch's
    to the tolerance); not flushed, they keep torch's values."""
    if not _kernel_available():
        pytest.skip("no C++ compiler: the C++ kernel cannot be built")
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, "cpp")
    n = 1 << 18
    p = nn.Parameter(torch.randn(n))
    q = nn.Parameter(p.detach().clone())
    ours, ref = Adam([p], flush_denormals=flush, **KW), torch.optim.AdamW([q], lr=KW["lr"], weight_decay=0.01)
    g0 = torch.randn(n)
    for opt, x in ((ours, p), (ref, q)):
        x.grad = g0.clone()
        opt.step()
        opt.state[x]["exp_avg"].mul_(1e-40)  # subnormal moments
        x.grad = torch.zeros(n)
        opt.step()
    m_ours, m_ref = ours.state[p]["exp_avg"], ref.state[q]["exp_avg"]
    assert (m_ref != 0).float().mean().item() > 0.9  # torch keeps the subnormals
    torch.testing.assert_close(p.detach(), q.detach(), **TOL)
    if flush:
        assert torch.count_nonzero(m_ours).item() == 0
    else:
        torch.testing.assert_close(m_ours, m_ref, rtol=1e-6, atol=0.0)


def test_bf16_copy_written_in_the_loop() -> None:
    """The kernel's bf16 output is the updated fp32 parameter rounded as ``copy_`` rounds it (ties, infinities; a
    NaN stays NaN)."""
    kernel = _adam_kernel("adam", "cpp") if _kernel_available() else None
    if kernel is None:
        pytest.skip("no C++ compiler: the C++ kernel cannot be built")
    n = (1 << 17) + 5  # multi-threaded, with a ragged end
    p = torch.randn(n)
    p[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2.0**-8])  # a tie
    g = torch.randn(n).bfloat16()
    m, v, step, out = torch.zeros(n), torch.zeros(n), torch.zeros(()), torch.empty(n, dtype=torch.bfloat16)
    batch = KernelBatch()
    assert batch.add(p, g, m, v, None, step)
    batch.add_output(out)
    group = dict(betas=(0.9, 0.999), lr=0.0, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    batch.run(kernel, {**group, "decoupled_weight_decay": False})
    assert batch.written == [p]
    ref = p.to(torch.bfloat16)
    assert torch.equal(out.isnan(), ref.isnan())  # a NaN's bits depend on torch's conversion path
    assert torch.equal(out[1:].view(torch.int16), ref[1:].view(torch.int16))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="FTZ/DAZ are x86 modes")
def test_compact_kernel_flushes_subnormal_moments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact kernel (bf16 moments) flushes subnormal moments too; the weights still equal the torch
    fallback's, which keeps them, to the tolerance."""
    if not _kernel_available():
        pytest.skip("no C++ compiler: the C++ kernel cannot be built")
    n = 1 << 17
    g0 = torch.randn(n)
    results = {}
    for which in ("cpp", "torch"):
        monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, which)
        p = nn.Parameter(torch.ones(n))
        p.grad_dtype = None  # a bf16 gradient of an fp32 master, as the runtime hands it
        opt = Adam([p], state_dtype="bfloat16", **KW)
        p.grad = g0.to(torch.bfloat16)
        opt.step()
        opt.state[p]["exp_avg"].copy_((g0 * 1e-40).to(torch.bfloat16))  # subnormal bf16 moments
        p.grad = torch.zeros(n, dtype=torch.bfloat16)
        opt.step()
        results[which] = (p.detach(), opt.state[p]["exp_avg"])
    torch.testing.assert_close(results["cpp"][0], results["torch"][0], **TOL)
    assert torch.count_nonzero(results["cpp"][1]).item() == 0
    assert (results["torch"][1] != 0).float().mean().item() > 0.5
