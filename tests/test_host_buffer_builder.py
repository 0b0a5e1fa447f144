"""The host buffers and optimizer state built in the background before the first step
(``roundpipe.host.step_cycle``): no later iteration allocates a host buffer, a tied weight's buffers come from
the builder too, and the first step (or the second call) waits for the builder once."""

from __future__ import annotations

from typing import Callable, List, Tuple

import pytest
import torch
from test_step import batches, make_model
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def _bf16_async_training(step: bool = True) -> Tuple[RoundPipe, Callable[[torch.Tensor, torch.Tensor], None]]:
    """A bf16 RoundPipe model with fp32 masters and roundpipe's Adam, and one training call with an
    asynchronous step (``step=False``: the call alone; ``rp.opt`` steps)."""
    from roundpipe.optim import Adam

    rp = RoundPipe(
        make_model().to(torch.bfloat16),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    opt = Adam(rp.optim_parameters(), lr=1e-2)
    rp.__dict__["opt"] = opt

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        rp.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
        if step:
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)

    return rp, train


def _record_host_allocations(mode: str, monkeypatch: pytest.MonkeyPatch) -> list:
    """Set the step mode (``RPP_STEP_MODE``) and record the shape of every host buffer the runtime's
    download and step paths allocate from now on."""
    from roundpipe.host import buffers as host_buffers

    monkeypatch.setenv("RPP_STEP_MODE", mode)
    allocations: list = []
    for mod in (host_buffers,):
        real = mod.pinned_empty
        monkeypatch.setattr(
            mod, "pinned_empty", lambda *a, real=real, **k: (allocations.append(a[0]), real(*a, **k))[1]
        )
    return allocations


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("mode", ["staged", "streamed"])
def test_host_buffers_exist_before_the_second_iteration(
    workers: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffers the first steps rotate through are allocated in the background from the first
    training call on: once that is done, no later iteration or step allocates a host buffer (the first
    iterations after warm-up run at the steady pace), and training is unchanged."""
    allocations = _record_host_allocations(mode, monkeypatch)
    rp, train = _bf16_async_training()
    data = batches(5)

    train(*data[0])
    assert rp.cycle.prep.thread is None  # the first step waited for it
    rp.synchronize()
    allocations.clear()
    for x, y in data[1:]:
        train(x, y)
    rp.synchronize()
    assert allocations == []


@pytest.mark.parametrize(
    "workers,plan_kind", [("cpu:1", "layerwise"), ("cpu:2", "layerwise"), ("cpu:2", "one-group")], indirect=["workers"]
)
@pytest.mark.parametrize("mode", ["staged", "streamed"])
def test_a_tied_weights_buffers_come_from_the_background_builder(
    workers: str, plan_kind: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied weight's gradient buffers are built in the background too: with the builder done before
    the first backward, neither the first call, nor the first step (which runs beside the next
    iteration: pinning there held the driver's lock for 0.3 s of it on a GPU), nor a later iteration
    allocates a host buffer; the results are bit-identical to a run whose buffers are all allocated
    where they are first needed (no builder). In the default step mode (staged) the tied weight
    has two host copies in the model dtype, as any weight, plus one per other layer sharing it that
    downloads its own share (several devices, or owner and sharer in one stage: the builder foresees
    the first only, so that case on one device is not run here)."""
    import threading

    from roundpipe.host import step_cycle
    from roundpipe.host.attribute import ParamAttribute
    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.optim import Adam
    from roundpipe.planning.plan import ModelExecutePlan

    allocations = _record_host_allocations(mode, monkeypatch)
    build = step_cycle.preallocate_host_buffers

    def run(builder: bool) -> Tuple[List[torch.Tensor], int]:
        def prealloc(params: list, name: str) -> threading.Thread:
            t = build(params, name) if builder else threading.Thread(target=lambda: None)
            if not builder:
                t.start()
            t.join()  # done before the first backward
            return t

        monkeypatch.setattr(step_cycle, "preallocate_host_buffers", prealloc)
        torch.manual_seed(0)
        m = nn.Sequential(
            nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
        )
        m[4].weight = m[2].weight
        plan = (
            ModelExecutePlan.layerwise(7, "train")
            if plan_kind == "layerwise"
            else ModelExecutePlan([range(0, 7)], [range(0, 7)])
        )
        rp = RoundPipe(
            m.to(torch.bfloat16),
            optim_dtype=torch.float32,
            model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
        )
        assert ParamAttribute.get(rp.model[2].weight).shared
        opt = Adam(rp.optim_parameters(), lr=1e-2)
        allocations.clear()
        for x, y in batches(4):
            rp.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        rp.synchronize()
        w = rp.model[2].weight
        copies = len(ParamBuffers.of(w).host_buffers(w))
        return [o.detach().clone() for o in rp.optim_parameters()], copies

    without, _ = run(builder=False)
    assert allocations  # the buffers were allocated on the way (the tied weight's among them)
    with_builder, copies = run(builder=True)
    assert allocations == []
    if mode == "staged":
        assert copies == (2 if workers == "cpu:1" else 3)
    for a, b in zip(with_builder, without):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("waiter", ["first step", "second call"])
def test_the_first_step_waits_for_the_host_buffers_and_the_optimizer_state(
    workers: str, waiter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinning holds the driver's lock, and a first step still building its state would hold up the
    next iteration: the first ``step`` (or, without one, the second training call) lets the background
    allocation and the state reserve finish, so no later iteration runs beside them; calls without
    gradients do not wait."""
    import threading

    from roundpipe.host import state_reserve as reserve
    from roundpipe.host import step_cycle

    release = threading.Event()
    real = step_cycle.preallocate_host_buffers
    waited: list = []
    real_wait = reserve.wait_for
    monkeypatch.setattr(reserve, "wait_for", lambda params: (waited.append(len(list(params))), real_wait(params))[1])

    def slow(params: list, name: str) -> threading.Thread:
        def run() -> None:
            release.wait(30)
            real(params, name).join()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    monkeypatch.setattr(step_cycle, "preallocate_host_buffers", slow)
    rp, train = _bf16_async_training(step=False)
    opt = rp.__dict__["opt"]
    data = batches(2)

    train(*data[0])
    prep = rp.cycle.prep
    thread = prep.thread
    assert thread.is_alive()
    with torch.no_grad():
        rp(data[1][0].bfloat16())  # inference does not wait
    assert thread.is_alive() and waited == []
    threading.Timer(0.5, release.set).start()
    if waiter == "first step":
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    else:
        train(*data[1])
    assert not thread.is_alive() and prep.thread is None
    assert waited and waited[0] > 0  # the optimizer states' builders were waited for too
    rp.synchronize()
