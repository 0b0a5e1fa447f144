"""Per-expert ``skip_zero_grad`` for experts kept as one 3-d tensor: each expert (slice ``[e]``) without a token is
left out as torch leaves out a separate parameter whose ``.grad`` is None; checked against torch.optim.AdamW on
each expert as its own parameter. Tolerance as in test_adam.py (a few float32 ulps)."""

from __future__ import annotations

import copy
from typing import List, Tuple

import pytest
import test_adam
import torch
from torch import nn

from roundpipe.optim import Adam

TOL = dict(rtol=1e-6, atol=1e-6)
KW = dict(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)
EXPERTS = 4
# Which experts got tokens at each step: expert 1 idle from the start, no expert at step 3.
ROUTES: List[List[int]] = [[0, 2, 3], [0, 2], [0, 1, 2, 3], [], [1, 3], [0, 1, 2, 3]]
impl = test_adam.impl  # each test twice: the C++ kernel and the torch path


def make_params(seed: int = 0) -> Tuple[nn.Parameter, nn.Parameter]:
    """A router weight (2-d) and a layer's experts as one 3-d tensor [E, out, in]."""
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(8, 16, generator=g)), nn.Parameter(torch.randn(EXPERTS, 12, 16, generator=g))


def step_grads(step: int, shape: torch.Size) -> Tuple[torch.Tensor, torch.Tensor]:
    """The router's gradient and the experts' (zero slices for the experts without tokens)."""
    g = torch.Generator().manual_seed(100 + step)
    router = torch.randn(8, 16, generator=g)
    experts = torch.randn(shape, generator=g)
    for e in range(EXPERTS):
        if e not in ROUTES[step]:
            experts[e] = 0
    return router, experts


@pytest.mark.parametrize("amsgrad", [False, True])
def test_experts_step_as_separate_parameters(impl: str, amsgrad: bool) -> None:
    """Weights, moments and each expert's step count equal torch.optim.AdamW's on one parameter per expert given
    None for the experts without tokens; the router (2-d) steps as before."""
    router, experts = make_params()
    ref_router = nn.Parameter(router.detach().clone())
    ref_experts = [nn.Parameter(experts.detach()[e].clone()) for e in range(EXPERTS)]
    ours = Adam([router, experts], skip_zero_grad=True, amsgrad=amsgrad, **KW)
    ref = torch.optim.AdamW([ref_router, *ref_experts], lr=KW["lr"], weight_decay=KW["weight_decay"], amsgrad=amsgrad)
    for step in range(len(ROUTES)):
        router.grad, experts.grad = step_grads(step, experts.shape)
        ref_router.grad = router.grad.clone()
        for e, q in enumerate(ref_experts):
            q.grad = experts.grad[e].clone() if e in ROUTES[step] else None
        ours.step()
        ref.step()
    torch.testing.assert_close(router.detach(), ref_router.detach(), **TOL)
    assert "expert_step" not in ours.state[router]
    state = ours.state[experts]
    for e, q in enumerate(ref_experts):
        torch.testing.assert_close(experts.detach()[e], q.detach(), **TOL)
        for key, val in ref.state[q].items():
            got = state["expert_step"][e] if key == "step" else state[key][e]
            torch.testing.assert_close(got, val, **TOL)
    assert state["expert_step"].tolist() == [4.0, 3.0, 4.0, 4.0]
    assert state["step"].item() == 5.0  # the steps in which any expert stepped (not step 3)


def test_state_dict_resumes_exactly(impl: str) -> None:
    """A saved per-expert state loads into a fresh optimizer (``expert_step`` keeps its dtype) and the run continues
    bit for bit as the uninterrupted one."""
    _, a = make_params()
    _, b = make_params()
    opt_a = Adam([a], skip_zero_grad=True, **KW)
    opt_b = Adam([b], skip_zero_grad=True, **KW)
    for step in range(len(ROUTES)):
        if step == 2:  # expert 1 has been left out twice: the counts differ
            saved = copy.deepcopy(opt_b.state_dict())
            opt_b = Adam([b], skip_zero_grad=True, **KW)
            opt_b.load_state_dict(saved)
        grad = step_grads(step, a.shape)[1]
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a.detach(), b.detach())
    assert opt_b.state[b]["expert_step"].dtype == opt_b.state[b]["step"].dtype
    for key in ("exp_avg", "exp_avg_sq", "expert_step", "step"):
        assert torch.equal(opt_a.state[a][key], opt_b.state[b][key])


def test_default_steps_experts_whole(impl: str) -> None:
    """``skip_zero_grad=False`` (the default): a 3-d parameter with idle experts is Adam's result given the zeros,
    with one step count and no ``expert_step``, bit for bit the same as the same values stepped as a 2-d tensor."""
    _, experts = make_params()
    flat = nn.Parameter(experts.detach().reshape(EXPERTS * 12, 16).clone())
    ref_p = nn.Parameter(experts.detach().clone())
    ours, ours_flat = Adam([experts], **KW), Adam([flat], **KW)
    ref = torch.optim.AdamW([ref_p], lr=KW["lr"], weight_decay=KW["weight_decay"])
    for step in range(len(ROUTES)):
        grad = step_grads(step, experts.shape)[1]
        experts.grad, flat.grad, ref_p.grad = grad.clone(), grad.reshape(flat.shape).clone(), grad.clone()
        ours.step()
        ours_flat.step()
        ref.step()
    assert set(ours.state[experts]) == {"step", "exp_avg", "exp_avg_sq"}
    assert ours.state[experts]["step"].item() == len(ROUTES)
    assert torch.equal(experts.detach().reshape(flat.shape), flat.detach())
    torch.testing.assert_close(experts.detach(), ref_p.detach(), **TOL)
