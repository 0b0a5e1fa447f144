"""The optimizer copies staged ahead of the first step (``roundpipe.host_buffers.prestage_params``): the
first asynchronous step publishes them by a swap, as later steps publish theirs, and nothing that changes
the optimizer copies before that step is lost."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.attribute import ParamAttribute
from roundpipe.optim import Adam


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


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
def test_first_async_step_swaps_in_the_values_staged_ahead(workers: str) -> None:
    """After the first training call each parameter has a staging buffer holding its optimizer copy in
    the model dtype; the first asynchronous step makes that buffer the model parameter (no copy on the
    next forward's path), and the model then holds exactly those values."""
    rp, opt = _setup()
    (x, y), (x2, y2) = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    rp._finish_host_buffers()
    staged: Dict[int, torch.Tensor] = {}
    for p in _trained(list(rp.model.parameters())):
        attr = ParamAttribute.get(p)
        assert attr.staged is not None and attr.staged_valid
        assert torch.equal(attr.staged, attr.optim.detach().to(p.dtype))
        assert attr.staged.data_ptr() != p.data.data_ptr()
        staged[id(p)] = attr.staged
    before = {id(p): p.detach().clone() for p in rp.model.parameters()}
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.wait_optimizer()
    for p in _trained(list(rp.model.parameters())):
        assert p.data.data_ptr() == staged[id(p)].data_ptr()  # swapped in, not copied
        assert torch.equal(p.detach(), before[id(p)])  # the values before the update (one-step-stale rule)
        assert ParamAttribute.get(p).staged_valid  # this step staged its own update for the next one
    rp.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss)
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    for p in _trained(list(rp.model.parameters())):
        assert torch.equal(p.detach(), ParamAttribute.get(p).optim.detach().to(p.dtype))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_optimizer_copies_changed_before_the_first_step_reach_the_model(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizer copies set after the first training call (``load_optim_params``, as a resume does) make
    the staged values obsolete: the first asynchronous step publishes the new copies, not the staged,
    also when the staging thread is still running when they are set (it is waited for first)."""
    import time

    from roundpipe import host_buffers

    real = host_buffers.prestage_params

    def slow(params: List[nn.Parameter]) -> None:
        """A stager whose copy of a parameter ends before, and its marking after, the new copies are set."""
        real(params)
        time.sleep(0.3)
        for p in params:
            if ParamAttribute.get(p).staged is not None:
                ParamAttribute.get(p).staged_valid = True

    monkeypatch.setattr(host_buffers, "prestage_params", slow)
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
    """A first step that runs synchronously drops the buffer staged ahead (its values are obsolete once
    the optimizer has stepped): synchronous training keeps two host buffers per parameter, as before."""
    rp, opt = _setup()
    for x, y in _batches(3):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        for p in _trained(list(rp.model.parameters())):
            attr = ParamAttribute.get(p)
            assert attr.staged is None
            assert torch.equal(p.detach(), attr.optim.detach().to(p.dtype))
            assert len(attr.host_buffers(p)) <= 2, len(attr.host_buffers(p))


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("env", [("RPP_STAGE_PARAMS", "0"), ("RPP_STEP_MODE", "streamed")])
def test_nothing_is_staged_ahead_without_staging(workers: str, env: Tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With staging off, or streamed steps, no staging buffer is made ahead of the first step."""
    monkeypatch.setenv(*env)
    rp, opt = _setup()
    (x, y), _ = _batches(2)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    rp._finish_host_buffers()
    assert all(ParamAttribute.get(p).staged is None for p in _trained(list(rp.model.parameters())))
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
