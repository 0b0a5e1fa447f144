"""Faults a user meets in a training loop: an exception in their ``loss_fn`` or step function, and a device
out of memory mid-step. Each is raised once, in the caller's thread, with the user's own frame in its
traceback (or the setting to change, for memory), and the model trains on afterwards exactly as a fresh
model would."""

from __future__ import annotations

import time
import traceback
from typing import List, Optional, Tuple

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.devices import threads
from roundpipe.devices.threads import OptimizerStepError, RoundPipeOutOfMemoryError, RoundPipeWorkerError


class UserBug(RuntimeError):
    """What a user's own code raises."""


class _NeedsMemory(nn.Module):
    """Identity that stands for a layer whose activations grow with the microbatch: while ``limit`` is set,
    a microbatch of more rows than it raises ``torch.OutOfMemoryError`` as the caching allocator would."""

    limit: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _NeedsMemory.limit is not None and x.shape[0] > _NeedsMemory.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (simulated)")
        return x


def build(microbatches: int = 2) -> Tuple[RoundPipe, torch.optim.Optimizer]:
    """The same model and optimizer each time (a fresh model to compare with)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), _NeedsMemory(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = RoundPipe(layers, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
    return model, torch.optim.Adam(model.optim_parameters(), lr=1e-2)


def batch(rows: int = 8, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, label)


def train_step(model: RoundPipe, optimizer: torch.optim.Optimizer, data: Tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = data
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    return loss.item()


def trained(model: RoundPipe) -> List[torch.Tensor]:
    model.synchronize()
    return [p.detach().clone() for p in model.model.parameters()]


def fresh_run(steps: List[Tuple[torch.Tensor, torch.Tensor]], microbatches: int = 2) -> Tuple[List[float], list]:
    """Losses and final weights of a fresh model trained on ``steps``: what a recovered model must give."""
    model, optimizer = build(microbatches)
    losses = [train_step(model, optimizer, data) for data in steps]
    return losses, trained(model)


def frames(exc: BaseException) -> List[str]:
    """Function names of every traceback in ``exc``'s chain of causes."""
    names: List[str] = []
    while exc is not None:
        names += [f.name for f in traceback.extract_tb(exc.__traceback__)]
        exc = exc.__cause__  # type: ignore[assignment]
    return names


def assert_same(got: Tuple[List[float], list], want: Tuple[List[float], list]) -> None:
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("failing_microbatch", [0, 1])
def test_loss_fn_exception_is_raised_once_and_the_model_trains_on(workers: str, failing_microbatch: int) -> None:
    """The first or the second microbatch's loss raises (the second: the first's backward may have run)."""
    model, optimizer = build()
    calls = {"n": 0}

    def buggy_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == failing_microbatch + 1:
            raise UserBug("the user's loss is wrong")
        return mse(out, label)

    x, y = batch(seed=1)
    with pytest.raises(RoundPipeWorkerError, match="UserBug: the user's loss is wrong") as info:
        model.forward_backward(input_args=(x,), label=y, loss_fn=buggy_loss)
    assert isinstance(info.value.__cause__, UserBug)
    assert "buggy_loss" in frames(info.value)  # the user's frame, where it raised
    assert threads.current_failure() is None  # raised once: nothing is left to raise again
    model.zero_grad()  # what a microbatch's backward may have accumulated before the failure
    after = [batch(seed=2), batch(seed=3)]
    got = [train_step(model, optimizer, data) for data in after], trained(model)
    assert_same(got, fresh_run(after))


def buggy_step() -> None:
    raise UserBug("the user's step is wrong")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("surfaces_at", ["synchronize", "next forward_backward", "next step"])
def test_step_fn_exception_surfaces_at_the_next_call(workers: str, surfaces_at: str) -> None:
    """``model.step(fn)`` returns before ``fn`` runs (asynchronous): ``fn``'s exception is raised by the
    model's next call (``synchronize``, ``wait_optimizer``, ``forward_backward``, ``step``), once. As in
    PyTorch, the optimizer's gradients keep what the failed step handed them until a ``zero_grad``; after
    one, the run goes on as a fresh model's does."""
    model, optimizer = build()
    x, y = batch(seed=1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(buggy_step)  # returns at once
    if surfaces_at != "synchronize":
        deadline = time.monotonic() + 30
        while threads.current_failure() is None:  # the step has failed: the next call starts with its error
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with pytest.raises(OptimizerStepError, match="UserBug") as info:
        if surfaces_at == "synchronize":
            model.synchronize()
        elif surfaces_at == "next forward_backward":
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        else:
            model.step(lambda: optimizer.step())
    assert isinstance(info.value.__cause__, UserBug)
    assert "buggy_step" in frames(info.value)
    assert threads.current_failure() is None
    model.synchronize()  # raised once: nothing is raised again
    optimizer.zero_grad()  # the failed step's gradients, which its function never cleared
    after = [batch(seed=2), batch(seed=3)]
    got = [train_step(model, optimizer, data) for data in after], trained(model)
    assert_same(got, fresh_run(after))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_out_of_memory_names_the_settings_and_a_smaller_batch_trains_on(workers: str) -> None:
    """A device out of memory mid-step (simulated on CPU workers: a layer whose microbatch of 8 rows does
    not fit) names the settings that make it fit; the same model then trains with a smaller batch, and with
    more microbatches, exactly as fresh models do."""
    model, optimizer = build(microbatches=1)
    _NeedsMemory.limit = 4
    try:
        x, y = batch(rows=8, seed=1)
        with pytest.raises(RoundPipeOutOfMemoryError) as info:
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        msg = str(info.value)
        for fragment in (
            "layer 2",
            "out of memory",
            "num_microbatch",
            "--batch-size",
            "RPP_GPU_MEMORY",
            "--gpu-memory",
        ):
            assert fragment in msg, (fragment, msg)
        assert isinstance(info.value, torch.OutOfMemoryError)  # what an `except torch.OutOfMemoryError` catches
        assert threads.current_failure() is None
        smaller = [batch(rows=4, seed=2), batch(rows=4, seed=3)]
        got = [train_step(model, optimizer, data) for data in smaller], trained(model)
        assert_same(got, fresh_run(smaller, microbatches=1))
        more = RoundPipeRunConfig(num_microbatch=2)  # the full batch in microbatches of 4 rows fits too
        fresh, fresh_optimizer = build(microbatches=1)
        for data in smaller:
            train_step(fresh, fresh_optimizer, data)
        fresh.synchronize()
        want = fresh.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=more)
        assert model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=more).item() == want.item()
    finally:
        _NeedsMemory.limit = None
