"""Gradient downloads into the weights' host buffers (staged steps, ``step_cycle.StepCycle``): with one
training call per staged asynchronous step a weight keeps two host copies in the model dtype instead of
three, and every run trains exactly what the three-buffer rotation (calls that never take the weights'
buffers, as with gradient accumulation) trains (bit for bit),
including when the number of calls per step changes, an evaluation reads the weights mid-cycle, or the
optimizer keeps its gradients."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable, List, Optional, Tuple

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.host.attribute import ParamAttribute
from roundpipe.host.buffers import ParamBuffers
from roundpipe.host.step_mode import StepMode
from roundpipe.optim import Adam
from roundpipe.planning.plan import ModelExecutePlan

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def _model(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12)
    )
    if tied:
        model[4].weight = model[2].weight  # a shared parameter: layers 2 and 4 download shares of its gradient
    return model.to(torch.bfloat16)


def _batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 6, generator=g).bfloat16(), torch.randn(12, 12, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _buffers(model: nn.Module, shared: bool = False) -> List[int]:
    """Host buffers in the model dtype of each unshared (``shared``: shared) trainable parameter
    (weights, gradient, staging, spares; not an optimizer's own fp32 gradient copy)."""
    ps = [p for p in model.parameters() if p.requires_grad and ParamAttribute.get(p).shared == shared]
    return [sum(b.dtype == p.dtype for b in ParamBuffers.of(p).host_buffers(p)) for p in ps]


Schedule = Callable[[int], Tuple[int, bool]]  # iteration -> (training calls before its step, evaluate mid-cycle)


def _joined(thread: threading.Thread) -> threading.Thread:
    thread.join()
    return thread


def _rotation_only(rp: RoundPipe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference: none of ``rp``'s calls takes the weights' buffers (its step cycle sees no staged step
    to move weights into), so the three host buffers of a staged step rotate, as with several calls per step."""
    cycle, real = rp.cycle, rp.cycle.on_step

    def on_step(is_async: bool, mode: StepMode) -> None:
        real(is_async, mode)
        cycle.async_staged = False

    monkeypatch.setattr(cycle, "on_step", on_step)


def _train(
    into: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    microbatches: int = 2,
    grain: str = "stage",
    fused: bool = True,
    optimizer: str = "roundpipe",
    zero_grad: bool = True,
    schedule: Optional[Schedule] = None,
    sync_iters: Tuple[int, ...] = (),
    step_s: float = 0.01,
    tied: bool = False,
    n_iter: int = 6,
) -> Tuple[List[float], List[torch.Tensor], List[List[int]]]:
    """Losses, optimizer copies and host buffer counts (after each step) of an asynchronous run. The
    background builder of the first buffers (``step_cycle``, tested on its own in test_step.py) is
    done before the first backward here: racing it, a download that comes first makes its own buffer
    and the builder a spare that the step trims, which the counts would see on a loaded machine."""
    from roundpipe.host import step_cycle

    build = step_cycle.preallocate_host_buffers
    monkeypatch.setattr(step_cycle, "preallocate_host_buffers", lambda *a: _joined(build(*a)))
    model = _model(tied)
    # A fixed plan: the auto planner follows measured times, and on a loaded machine two runs could
    # choose different layer groups, which sum the same gradients in another order (6th digit).
    plan = ModelExecutePlan.layerwise(len(model), "train")
    rp = RoundPipe(
        model,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=grain, execute_plan=plan),
    )
    if into == "0":
        _rotation_only(rp, monkeypatch)
    params = list(rp.optim_parameters())
    opt: torch.optim.Optimizer = (
        Adam(params, lr=1e-2) if optimizer == "roundpipe" else torch.optim.AdamW(params, lr=1e-2)
    )

    def step() -> None:
        time.sleep(step_s)  # the next call's downloads arrive while the step still runs
        opt.step()
        if zero_grad:
            opt.zero_grad()

    losses: List[float] = []
    counts: List[List[int]] = []  # per step: each unshared parameter's count, then each shared one's
    data = iter(_batches(4 * n_iter))
    for k in range(n_iter):
        calls, evaluate = schedule(k) if schedule is not None else (1, False)
        for c in range(calls):
            x, y = next(data)
            if c > 0 and k in sync_iters:
                rp.synchronize()
            if fused:
                losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss).item())
            else:
                loss = _loss(rp(x), y)
                loss.backward()
                losses.append(loss.item())
        if evaluate:
            if k in sync_iters:
                rp.synchronize()
            with torch.no_grad():
                losses.append(_loss(rp(next(data)[0]), torch.zeros(12, 12)).item())
        rp.step(step, is_async=True)
        counts.append(_buffers(model) + _buffers(model, shared=True))
    rp.synchronize()
    return losses, [p.detach().clone() for p in rp.optim_parameters()], counts


def _same(
    a: Tuple[List[float], List[torch.Tensor], List[List[int]]],
    b: Tuple[List[float], List[torch.Tensor], List[List[int]]],
) -> None:
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_two_buffers_per_weight_and_the_same_training(
    workers: str, microbatches: int, grain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each weight has two host buffers at every step (nothing is staged ahead of the first step: it
    stages into the first gradient buffer, where the second call moves the weights) instead of three,
    and losses and optimizer copies equal the three-buffer rotation's."""
    moved = _train("1", monkeypatch, microbatches=microbatches, grain=grain)
    rotated = _train("0", monkeypatch, microbatches=microbatches, grain=grain)
    _same(moved, rotated)
    assert all(set(c) == {2} for c in moved[2]), moved[2]
    assert max(max(c) for c in rotated[2]) == 3, rotated[2]  # (counted while the step runs: 2 or 3)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:3"], indirect=True)
@pytest.mark.parametrize("optimizer", ["roundpipe", "torch"])
def test_forward_then_backward_and_copied_gradients(
    workers: str, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``loss.backward()`` on a forward's result moves weights as ``forward_backward`` does; an optimizer
    that gets fp32 gradient copies (torch's AdamW) stages into the downloaded buffer the same way."""
    moved = _train("1", monkeypatch, fused=False, optimizer=optimizer)
    _same(moved, _train("0", monkeypatch, fused=False, optimizer=optimizer))
    assert all(set(c) == {2} for c in moved[2]), moved[2]


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_second_call_before_step_reads_one_consistent_version(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of one call, then steps of two calls (gradient accumulation): the second call of the first
    two-call cycle finds weights moved ahead by the first; it is warned about and trains on the step in
    flight's version for every layer, exactly as the three-buffer rotation does after ``synchronize()``
    there; later two-call cycles move nothing (three buffers) and equal the rotation again."""

    def schedule(k: int) -> Tuple[int, bool]:
        return (1 if k < 3 else 2), False

    with pytest.warns(UserWarning, match="second training call before step"):
        moved = _train("1", monkeypatch, schedule=schedule, step_s=0.2)  # the extra call comes while it runs
    _same(moved, _train("0", monkeypatch, schedule=schedule, sync_iters=(3,)))
    assert max(max(c) for c in moved[2][4:]) == 3, moved[2]  # the cycle length was learned: three buffers


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:3"], indirect=True)
def test_an_evaluation_between_call_and_step_sees_the_newest_weights(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward without gradients after a call that moved weights waits for the step in flight and reads
    its version on every layer (as after ``synchronize()`` with three buffers), silently; training then
    continues exactly as the rotation's."""

    def schedule(k: int) -> Tuple[int, bool]:
        return 1, k in (3, 4)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: an evaluation does not change what training computes
        moved = _train("1", monkeypatch, schedule=schedule, step_s=0.2)  # the evaluation comes while it runs
    _same(moved, _train("0", monkeypatch, schedule=schedule, sync_iters=(3, 4)))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_an_optimizer_that_keeps_its_gradients(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``zero_grad`` in the step function: the optimizer keeps the gradient buffer that the step would
    stage into as its ``.grad``; it is moved into a tensor of its own first, and the run equals the
    rotation's."""
    moved = _train("1", monkeypatch, zero_grad=False)
    _same(moved, _train("0", monkeypatch, zero_grad=False))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("cycle", ["one call", "evaluation", "second call"])
def test_tied_weights_move_at_their_owners_download(workers: str, cycle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter shared by two layers moves its weights at the download of its owner (its lowest
    layer, the call's last use of it) like any weight, and its gradient buffer rotates: two host copies
    with one worker (the shares are summed on the device), three with two (the other layer downloads its
    own share). Also with an evaluation mid-cycle and a second training call before a step (the weights
    moved ahead, read consistently); every run equals the three-buffer rotation's."""
    if cycle == "one call":
        moved = _train("1", monkeypatch, tied=True)
        _same(moved, _train("0", monkeypatch, tied=True))
        n_shared = 2 if workers == "cpu:1" else 3
        assert all(c[:-1] == [2] * (len(c) - 1) and c[-1] == n_shared for c in moved[2]), moved[2]
        return

    def schedule(k: int) -> Tuple[int, bool]:
        if cycle == "evaluation":
            return 1, k in (3, 4)
        return (1 if k < 3 else 2), False

    sync = (3, 4) if cycle == "evaluation" else (3,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the second call's warning (its own test checks it)
        moved = _train("1", monkeypatch, schedule=schedule, step_s=0.2, tied=True)
    _same(moved, _train("0", monkeypatch, schedule=schedule, sync_iters=sync, tied=True))


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_planner_counts_one_buffer_besides_the_weights(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert StepMode.resolve().host_buffers_besides_weights == 1 and StepMode.resolve().staged
    monkeypatch.setenv("RPP_STEP_MODE", "streamed")
    assert StepMode.resolve().host_buffers_besides_weights == 1 and not StepMode.resolve().staged


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_shared_gradient_accumulated_over_two_calls_counts_each_call_once(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two training calls per step and a tied weight: the second call continues the shared parameter's
    running gradient in the buffer its upload was seeded from. Here the step in flight holds its own
    gradient buffer through the first call of the next cycle and releases it before the second (a
    gate in its step function): were the second call's download to take that released buffer, the fold
    would add the first call's share twice. The result must equal the run whose step ends before the next
    cycle starts."""
    import threading

    def run(gated: bool) -> Tuple[List[torch.Tensor], bool]:
        model = _model(tied=True)
        plan = ModelExecutePlan.layerwise(len(model), "train")  # fixed: both runs sum in the same order
        rp = RoundPipe(
            model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
        )
        _rotation_only(rp, monkeypatch)
        opt = Adam(list(rp.optim_parameters()), lr=1e-2)
        gate = threading.Event()
        data = iter(_batches(4))

        def call() -> None:
            x, y = next(data)
            rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss)

        def held_step() -> None:
            gate.wait()  # the step keeps its gradients (and their buffers) until the gate opens
            opt.step()
            opt.zero_grad()

        call()
        call()
        rp.step(held_step if gated else (lambda: (opt.step(), opt.zero_grad())), is_async=True)
        if not gated:
            rp.wait_optimizer()
        call()  # the first call of the next cycle
        shared, w = ParamAttribute.get(model[2].weight), model[2].weight
        held = shared.optim.grad if shared.optim is not None else None
        # Whether the step still held its gradient buffer and this call downloaded into another one.
        apart = held is not None and w.grad is not None and w.grad.data_ptr() != held.data_ptr()
        gate.set()
        rp.wait_optimizer()  # the step has released its buffers before the second call
        call()
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
        return [p.detach().clone() for p in rp.optim_parameters()], apart

    reference, _ = run(gated=False)
    got, apart = run(gated=True)
    assert apart  # the scenario happened: the held buffer made the first call take another one
    assert all(torch.equal(p, q) for p, q in zip(got, reference))
