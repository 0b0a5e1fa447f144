"""The first asynchronous step converts nothing (``roundpipe.host.step_cycle``): an optimizer copy starts as
the weights' version, so the first publish leaves the weights in place; nothing that changes the weights
or the optimizer copies before that step is lost, and nothing is staged ahead."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.host.buffers import ParamBuffers
from roundpipe.optim import Adam

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)).to(torch.bfloat16)


def _batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g).bfloat16(), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _setup() -> Tuple[RoundPipe, Adam]:
    rp = RoundPipe(_model(), optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    return rp, Adam(rp.optim_parameters(), lr=1e-2)


def _trained(params: List[nn.Parameter]) -> List[nn.Parameter]:
    return [p for p in params if p.requires_grad]


def _edit_copies_unseen(rp: RoundPipe) -> None:
    """Change the optimizer copies through ``.data``, which the runtime cannot see (the documented way is
    ``load_optim_params``): a first publish that converted the copies would show the change."""
    with torch.no_grad():
        for q in rp.optim_parameters():
            q.data.add_(1.0)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
def test_first_async_step_leaves_the_weights_in_place(workers: str) -> None:
    """The optimizer copies were made from the weights, so the first asynchronous step's publish leaves
    them (no conversion of every copy while the next forward waits): same buffer, values before the
    update (one-step-stale rule); the step stages its update, which the second step publishes."""
    rp, opt = _setup()
    (x, y), (x2, y2) = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    before = {id(p): (p.data.data_ptr(), p.detach().clone()) for p in rp.model.parameters()}
    _edit_copies_unseen(rp)
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.wait_optimizer()
    for p in _trained(list(rp.model.parameters())):
        assert p.data.data_ptr() == before[id(p)][0]
        assert torch.equal(p.detach(), before[id(p)][1])  # not converted from the edited copies
        assert ParamBuffers.of(p).staged_valid  # the step staged its own update for the next one
    rp.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss)
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    for p in _trained(list(rp.model.parameters())):
        assert torch.equal(p.detach(), ParamBuffers.of(p).optim.detach().to(p.dtype))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("written", ["weights", "copies"])
def test_weights_or_copies_written_before_the_first_step_are_published(workers: str, written: str) -> None:
    """Code that writes the weights or the optimizer copies in place before the first step (a checkpoint
    restore copies the copies in, then the weights of the version one step older) is seen: the first
    publish copies the optimizer copies into the weights, as every publish did before."""
    rp, opt = _setup()
    (x, y), _ = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    with torch.no_grad():
        if written == "weights":
            for p in _trained(list(rp.model.parameters())):
                p.mul_(0.5)
        else:
            for q in rp.optim_parameters():
                q.fill_(0.25)
    expected = {id(p): ParamBuffers.of(p).optim.detach().to(p.dtype) for p in _trained(list(rp.model.parameters()))}
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.wait_optimizer()
    for p in _trained(list(rp.model.parameters())):
        assert torch.equal(p.detach(), expected[id(p)])


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_optimizer_copies_changed_before_the_first_step_reach_the_model(workers: str) -> None:
    """Optimizer copies set after the first training call (``load_optim_params``, as a resume does) reach
    the weights: the first asynchronous step publishes them, not the weights the copies were made from."""
    rp, opt = _setup()
    (x, y), _ = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    new = {name: torch.full_like(p, 0.25) for name, p in rp.optim_named_parameters()}
    rp.load_optim_params(new)
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.wait_optimizer()
    for p in _trained(list(rp.model.parameters())):
        assert torch.equal(p.detach(), torch.full_like(p, 0.25))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_synchronous_steps_keep_no_staging_buffer(workers: str) -> None:
    """Synchronous training keeps two host buffers per parameter and no staging buffer."""
    rp, opt = _setup()
    for x, y in _batches(3):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        for p in _trained(list(rp.model.parameters())):
            attr = ParamBuffers.of(p)
            assert attr.staged is None
            assert torch.equal(p.detach(), attr.optim.detach().to(p.dtype))
            assert len(attr.host_buffers(p)) <= 2, len(attr.host_buffers(p))


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize(
    "env",
    [("RPP_STEP_MODE", "staged"), ("RPP_STEP_MODE", "streamed")],
)
def test_nothing_is_staged_ahead_of_the_first_step(
    workers: str, env: Tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No staging buffer is made during the first training call, whatever the step mode."""
    monkeypatch.setenv(*env)
    rp, opt = _setup()
    (x, y), _ = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    rp._finish_host_buffers()
    assert all(ParamBuffers.of(p).staged is None for p in _trained(list(rp.model.parameters())))
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_synchronize_swaps_the_staged_version_in_and_a_restore_wins_over_it(workers: str) -> None:
    """After an asynchronous step staged its update, ``synchronize()`` makes the weights that version
    without converting the copies again (where a staging buffer holds it, that buffer becomes the
    weights); copies restored later (``load_optim_params``, which bumps their version) are what reach
    the weights then, not the stale staged version."""
    rp, opt = _setup()
    for x, y in _batches(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.wait_optimizer()
    staged = {id(p): ParamBuffers.of(p).staged for p in _trained(list(rp.model.parameters()))}
    rp.synchronize()
    masters = dict(rp.optim_named_parameters())
    for name, p in rp.model.named_parameters():
        torch.testing.assert_close(p.detach(), masters[name].detach().to(p.dtype), rtol=0, atol=0)
        if staged[id(p)] is not None:
            assert p.data.data_ptr() == staged[id(p)].data_ptr(), name
    saved = {n: q.detach().clone() for n, q in masters.items()}
    x, y = _batches(3)[2]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.wait_optimizer()  # a staged version of the step after `saved` exists now
    rp.load_optim_params(saved)
    for name, p in rp.model.named_parameters():
        torch.testing.assert_close(p.detach(), saved[name].to(p.dtype), rtol=0, atol=0)
