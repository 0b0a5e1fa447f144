"""Fused staging (``RPP_DEBUG_FUSED_STAGING=1``, or ``auto`` with a step function declared by
``roundpipe.optim.step_fn_zeroes_grads``): roundpipe.optim.Adam writes an asynchronous step's new bf16 weights into
their staging buffer in its own pass. Every loss and weight equals the staging pass, bit for bit; a step function
that keeps its gradients, or steps a parameter twice, fails loudly instead of training on weights read as
gradients."""

from __future__ import annotations

from typing import Callable, List

import pytest
import torch
from helpers import require_adam_kernel
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.devices.threads import OptimizerStepError
from roundpipe.host import step as optim_step
from roundpipe.host.step_mode import StepMode
from roundpipe.optim import Adam, step_fn_zeroes_grads

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


@pytest.fixture
def kernel() -> None:
    require_adam_kernel()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).bfloat16()


def _loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o.float() - t) ** 2).mean()


def _run(
    workers: int, microbatches: int, steps: int, step_fn: Callable[[Adam], None], declared: bool = False
) -> List[torch.Tensor]:
    """Train ``steps`` steps; ``declared``: the step function given to ``model.step`` is declared with
    ``step_fn_zeroes_grads``."""
    roundpipe.configure(devices=f"cpu:{workers}")
    model = _model()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
    opt = Adam(rp.optim_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        out.append(rp.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=_loss).detach().clone())
        if k == steps // 2:
            rp.synchronize()  # a sync point in the middle: the publish after it copies, then staging resumes
        fn = lambda: step_fn(opt)  # noqa: E731
        rp.step(step_fn_zeroes_grads(fn) if declared else fn)
    rp.synchronize()
    return out + [p.detach().clone() for p in model.parameters()] + [p.detach().clone() for p in rp.optim_parameters()]


def _step_and_zero(opt: Adam) -> None:
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("workers, microbatches", [(1, 1), (2, 2), (3, 4)])
def test_fused_staging_equals_the_staging_pass(
    kernel: None, workers: int, microbatches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrote = _counting_writes(monkeypatch)
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "0")
    plain = _run(workers, microbatches, 7, _step_and_zero)
    assert not wrote
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "1")
    fused = _run(workers, microbatches, 7, _step_and_zero)
    assert wrote and all(n == 6 for n in wrote), wrote  # the kernel wrote all 6 parameters' buffers at every step
    for a, b in zip(plain, fused):
        assert torch.equal(a, b)


def test_fused_staging_refuses_kept_gradients(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "1")
    with pytest.raises(OptimizerStepError, match="zero_grad"):
        _run(1, 2, 3, lambda opt: opt.step())


def test_fused_staging_refuses_a_second_step_of_the_same_parameters(
    kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "1")

    def twice(opt: Adam) -> None:
        opt.step()
        opt.step()
        opt.zero_grad()

    with pytest.raises(OptimizerStepError, match="second time"):
        _run(1, 2, 3, twice)


def _counting_writes(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    wrote: List[int] = []
    real = optim_step.Stager.done

    def counting(self: optim_step.Stager, written: list, outs: dict) -> None:
        wrote.append(len(written))
        real(self, written, outs)

    monkeypatch.setattr(optim_step.Stager, "done", counting)
    return wrote


def test_auto_fuses_only_declared_step_functions(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ``auto``: a step function declared with ``step_fn_zeroes_grads`` gets the fused writes (the same
    bits as the staging pass), an undeclared one the staging pass, and ``RPP_DEBUG_FUSED_STAGING=0`` turns off even a
    declared one."""
    assert roundpipe.settings.DEBUG_FUSED_STAGING.get() == "auto"
    wrote = _counting_writes(monkeypatch)
    plain = _run(2, 2, 5, _step_and_zero)
    assert not wrote
    fused = _run(2, 2, 5, _step_and_zero, declared=True)
    assert wrote and all(n == 6 for n in wrote), wrote
    for a, b in zip(plain, fused):
        assert torch.equal(a, b)
    wrote.clear()
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "0")
    _run(1, 2, 3, _step_and_zero, declared=True)
    assert not wrote


def test_a_declared_step_function_that_keeps_gradients_fails(kernel: None) -> None:
    with pytest.raises(OptimizerStepError, match="zero_grad"):
        _run(1, 2, 3, lambda opt: opt.step(), declared=True)


def test_a_declared_method_keeps_its_declaration() -> None:
    """Declared in the class (as roundpipe train's recipe does), the bound method says so too."""

    class Recipe:
        @step_fn_zeroes_grads
        def step_fn(self) -> None:
            pass

        def other(self) -> None:
            pass

    mode = StepMode()
    assert optim_step.fused_staging(Recipe().step_fn, mode) and not optim_step.fused_staging(Recipe().other, mode)
