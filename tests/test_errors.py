"""Bad input ends in one clear error that names the fix; the model keeps working afterwards."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, save_for_recompute
from roundpipe.devices.backend import parse_devices
from roundpipe.devices.threads import RoundPipeWorkerError


def model() -> RoundPipe:
    torch.manual_seed(0)
    return RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))


class _SavesGradTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        save_for_recompute(x.detach().requires_grad_(True))
        return x


def _run(fn: Callable[[], object]) -> Callable[[], object]:
    return fn


X = torch.randn(6, 4)
CASES = [
    ("batch dims disagree", lambda: model()(X, torch.randn(5, 4)), ValueError, "disagree on the batch dimension"),
    (
        "num_microbatch > batch",
        lambda: model()(X, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=7)),
        ValueError,
        "larger than the batch size 6",
    ),
    ("num_microbatch zero", lambda: RoundPipeRunConfig(num_microbatch=0), ValueError, "num_microbatch=0"),
    ("recompute grain", lambda: RoundPipeRunConfig(recompute_grain="block"), ValueError, "'stage' or 'layer'"),
    ("merge_output type", lambda: RoundPipeRunConfig(merge_output="yes"), ValueError, "merge_output"),
    ("execute_plan type", lambda: RoundPipeRunConfig(execute_plan=[range(0, 3)]), ValueError, "ModelExecutePlan"),
    (
        "plan gap",
        lambda: _no_grad(
            lambda: model()(
                X,
                roundpipe_run_config=RoundPipeRunConfig(execute_plan=ModelExecutePlan([range(0, 1), range(2, 3)], [])),
            )
        ),
        ValueError,
        "layer 1 not covered",
    ),
    (
        "plan overlap",
        lambda: _no_grad(
            lambda: model()(
                X,
                roundpipe_run_config=RoundPipeRunConfig(execute_plan=ModelExecutePlan([range(0, 2), range(1, 3)], [])),
            )
        ),
        ValueError,
        "twice",
    ),
    (
        "plan out of range",
        lambda: _no_grad(
            lambda: model()(
                X, roundpipe_run_config=RoundPipeRunConfig(execute_plan=ModelExecutePlan([range(0, 5)], []))
            )
        ),
        ValueError,
        "layers 3..4 out of range; the model has 3 layers",
    ),
    ("model not on host", lambda: RoundPipe(nn.Sequential(nn.Linear(2, 2)).to("meta")), ValueError, "model.cpu()"),
    ("empty sequential", lambda: RoundPipe(nn.Sequential()), ValueError, "at least one layer"),
    (
        "pin mode",
        lambda: RoundPipe(nn.Sequential(nn.Linear(2, 2)), pin_model="always"),
        ValueError,
        "'alloc', 'register' or 'off'",
    ),
    (
        "loss not scalar",
        lambda: model().forward_backward(input_args=(X,), loss_fn=lambda o, _: o),
        RoundPipeWorkerError,
        "loss_fn must return a scalar",
    ),
    (
        "forward_backward under no_grad",
        lambda: _no_grad(lambda: model().forward_backward(input_args=(X,), loss_fn=lambda o, _: o.sum())),
        RuntimeError,
        "no_grad",
    ),
    (
        "requires_grad under no_grad",
        lambda: _no_grad(lambda: model()(X, roundpipe_run_config=RoundPipeRunConfig(requires_grad=True))),
        RuntimeError,
        "gradients are disabled",
    ),
    ("bad RPP_DEVICES", lambda: parse_devices("tpu:3"), ValueError, "cpu:N"),
    ("bad cpu worker count", lambda: parse_devices("cpu:x"), ValueError, "integer N"),
    (
        "split_input result",
        lambda: model()(X, roundpipe_run_config=RoundPipeRunConfig(split_input=lambda a, k, n: [a])),
        ValueError,
        "split_input must return",
    ),
    (
        "saved tensor requires grad",
        lambda: RoundPipe(nn.Sequential(_SavesGradTensor()))(X.requires_grad_(False).clone().requires_grad_(True)),
        RoundPipeWorkerError,
        "must not require grad",
    ),
    ("wrong feature size", lambda: model()(torch.randn(6, 3)), RoundPipeWorkerError, "layer 0 (Linear)"),
]


def _no_grad(fn: Callable[[], object]) -> object:
    with torch.no_grad():
        return fn()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,call,exc_type,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name: str, call: Callable[[], object], exc_type: type, fragment: str) -> None:
    with pytest.raises(exc_type) as info:
        call()
    assert fragment in str(info.value), str(info.value)


@pytest.mark.timeout(30)
def test_model_runs_after_bad_input() -> None:
    rp = model()
    with pytest.raises(RoundPipeWorkerError):
        rp(torch.randn(6, 3))
    with pytest.raises(ValueError):
        rp(X, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=9))
    out = rp(X)
    out.sum().backward()
    assert out.shape == (6, 2)


class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if _OomLayer.armed:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return g


class _OomLayer(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OomInBackward.apply(x)


@pytest.mark.timeout(30)
def test_out_of_memory_names_stage_and_fixes() -> None:
    """An OOM in backward (simulated on CPU workers; tests/test_gpu.py does it for real) gives the
    documented message, and the next call works."""
    rp = RoundPipe(nn.Sequential(nn.Linear(4, 4), _OomLayer(), nn.Linear(4, 2)), name="oom-model")
    _OomLayer.armed = True
    out = rp(X)
    with pytest.raises(torch.OutOfMemoryError) as info:
        out.sum().backward()
    msg = str(info.value)
    for fragment in (
        "model 'oom-model'",
        "layer 1",
        "out of memory",
        "Stage layers",
        "GiB",
        "num_microbatch",
        "execute_plan",
        "recompute_grain='layer'",
        "resolve-oom",
    ):
        assert fragment in msg, (fragment, msg)
    _OomLayer.armed = False
    rp(X).sum().backward()
