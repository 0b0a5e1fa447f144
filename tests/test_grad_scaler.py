"""roundpipe.GradScaler against torch.amp.GradScaler("cpu"), with the step on the optimizer thread.

The training loop below emulates RoundPipe's split: an fp16 model on the main thread produces scaled
fp16 gradients; the step function, queued on the optimizer stream as ``model.step`` queues it, copies
them into fp32 master gradients and calls ``scaler.step`` on an optimizer over the masters; the main
thread calls ``scaler.update()`` right after queueing the step.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import pytest
import torch
from torch import nn

from roundpipe.devices import threads
from roundpipe.host import optim_thread
from roundpipe.optim import Adam
from roundpipe.optim.grad_scaler import GradScaler

INF_STEP = 6


@pytest.fixture(autouse=True)
def _clean_optimizer_stream():
    yield
    try:
        optim_thread.synchronize()
    finally:
        threads.clear_failure()


class Setup:
    """An fp16 model (what the devices compute with) and fp32 masters (what the optimizer steps)."""

    def __init__(self, optimizer_cls: Callable = torch.optim.Adam, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).half()
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = optimizer_cls(self.masters, lr=1e-2)
        g = torch.Generator().manual_seed(seed + 1)
        self.batches = [(torch.randn(5, 6, generator=g).half(), torch.randn(5, 3, generator=g)) for _ in range(16)]

    def loss(self, it: int) -> torch.Tensor:
        x, y = self.batches[it % len(self.batches)]
        return (self.model(x).float() - y).pow(2).mean() * 1000.0  # large: the first scales overflow fp16

    def take_grads(self, it: int) -> List[torch.Tensor]:
        """Hand the model's gradients over (as RoundPipe's grad download does); inject an inf at INF_STEP."""
        grads = [p.grad.float() for p in self.model.parameters()]
        for p in self.model.parameters():
            p.grad = None
        if it == INF_STEP:
            grads[0][0, 0] = float("inf")
        return grads

    def load_grads(self, grads: List[torch.Tensor]) -> None:
        for m, g in zip(self.masters, grads):
            m.grad = g

    def sync_model(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)


def run_torch(iters: int, clip: bool = False, scaler_kw: Optional[dict] = None) -> Tuple[Setup, List[float], object]:
    """Reference: torch.amp.GradScaler("cpu"), everything on the main thread."""
    s = Setup()
    scaler = torch.amp.GradScaler("cpu", **(scaler_kw or dict(growth_interval=3)))
    scales = []
    for it in range(iters):
        scales.append(scaler.get_scale())
        scaler.scale(s.loss(it)).backward()
        s.load_grads(s.take_grads(it))
        if clip:
            scaler.unscale_(s.opt)
            torch.nn.utils.clip_grad_norm_(s.masters, 1.0)
        scaler.step(s.opt)
        s.opt.zero_grad()
        scaler.update()
        s.sync_model()
    scales.append(scaler.get_scale())
    return s, scales, scaler


def run_roundpipe(
    iters: int,
    clip: bool = False,
    scaler_kw: Optional[dict] = None,
    optimizer_cls: Callable = torch.optim.Adam,
    scaler: Optional[GradScaler] = None,
    setup: Optional[Setup] = None,
    start: int = 0,
) -> Tuple[Setup, List[float], GradScaler]:
    """scale() on the main thread, step on the optimizer thread, update() on the main thread."""
    s = setup or Setup(optimizer_cls)
    scaler = scaler or GradScaler(**(scaler_kw or dict(growth_interval=3)))
    scales = []

    def step_fn(grads: List[torch.Tensor]) -> None:
        assert optim_thread.on_thread()
        s.load_grads(grads)
        if clip:
            scaler.unscale_(s.opt)
            torch.nn.utils.clip_grad_norm_(s.masters, 1.0)
        scaler.step(s.opt)
        s.opt.zero_grad()
        s.sync_model()

    for it in range(start, start + iters):
        scales.append(scaler.get_scale())
        scaler.scale(s.loss(it)).backward()
        optim_thread.submit(step_fn, s.take_grads(it))
        scaler.update()
        # The synchronous form of model.step (is_async=False): the next iteration sees the update.
        optim_thread.synchronize()
    scales.append(scaler.get_scale())
    return s, scales, scaler


@pytest.mark.parametrize("clip", [False, True])
def test_cross_thread_equals_torch_single_thread(clip) -> None:
    ref, ref_scales, _ = run_torch(14, clip=clip)
    ours, scales, _ = run_roundpipe(14, clip=clip)
    assert scales == ref_scales
    # The first iterations overflow fp16 and back off; INF_STEP backs off; growth every 3 clean steps.
    assert scales[0] == 2.0**16 and scales[1] == 2.0**15
    assert scales[INF_STEP + 1] == scales[INF_STEP] / 2
    assert any(b == 2 * a for a, b in zip(scales, scales[1:]))
    for a, b in zip(ours.masters, ref.masters, strict=True):
        assert torch.equal(a, b)  # the same torch.optim.Adam on the same unscaled gradients
    for a, b in zip(ours.opt.state.values(), ref.opt.state.values(), strict=True):
        assert a["step"].item() == b["step"].item()
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_inf_step_is_skipped_exactly_and_scale_halves() -> None:
    s = Setup(Adam)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=100)  # small scale: only INF_STEP overflows
    run_roundpipe(INF_STEP, scaler=scaler, setup=s)
    before = [m.detach().clone() for m in s.masters]
    state_before = {k: v.clone() for k, v in s.opt.state[s.masters[0]].items()}
    scale_before = scaler.get_scale(up_to_date=True)
    run_roundpipe(1, scaler=scaler, setup=s, start=INF_STEP)
    for a, b in zip(s.masters, before, strict=True):
        assert torch.equal(a, b)
    state_after = s.opt.state[s.masters[0]]
    assert state_after["step"].item() == state_before["step"].item() == INF_STEP
    assert torch.equal(state_after["exp_avg"], state_before["exp_avg"])
    assert scaler.get_scale(up_to_date=True) == scale_before / 2
    # The next clean step moves the parameters again.
    run_roundpipe(1, scaler=scaler, setup=s, start=INF_STEP + 1)
    assert not torch.equal(s.masters[0], before[0])


def test_growth_after_growth_interval_clean_steps() -> None:
    kw = dict(init_scale=4.0, growth_factor=2.0, growth_interval=3)
    s = Setup()
    s.batches = s.batches[:INF_STEP]  # no forced inf below: iterations never reach INF_STEP
    ref = torch.amp.GradScaler("cpu", **kw)
    scaler = GradScaler(**kw)
    _, scales, _ = run_roundpipe(5, scaler=scaler, setup=s)
    assert scales == [4.0, 4.0, 4.0, 8.0, 8.0, 8.0]
    assert scaler.state_dict()["_growth_tracker"] == 2
    # torch's bookkeeping, fed the same (clean) iterations.
    for _ in range(5):
        ref.scale(torch.ones((), requires_grad=True)).backward()
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        opt.param_groups[0]["params"][0].grad = torch.ones(1)
        ref.step(opt)
        ref.update()
    assert ref.state_dict() == scaler.state_dict()


def test_state_dict_round_trips_with_torch() -> None:
    _, _, ref = run_torch(9)
    _, _, ours = run_roundpipe(9)
    assert ours.state_dict() == ref.state_dict()
    assert set(ours.state_dict()) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}

    # torch -> ours, then both continue identically.
    sd = dict(ref.state_dict(), growth_factor=4.0, growth_interval=2)
    fresh = GradScaler()
    fresh.load_state_dict(sd)
    assert fresh.get_scale() == sd["scale"]
    assert fresh.get_growth_factor() == 4.0 and fresh.get_growth_interval() == 2
    assert fresh.get_growth_factor(up_to_date=True) == 4.0
    ref.load_state_dict(sd)
    for _ in range(4):
        for sc in (ref, fresh):
            sc.scale(torch.ones((), requires_grad=True)).backward()
            opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
            opt.param_groups[0]["params"][0].grad = torch.ones(1)
            if sc is ref:
                sc.step(opt)
            else:
                optim_thread.submit(sc.step, opt)
            sc.update()
            optim_thread.synchronize()
        assert fresh.get_scale() == ref.get_scale()
    assert fresh.state_dict() == ref.state_dict()

    # ours -> torch.
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(fresh.state_dict())
    assert back.state_dict() == fresh.state_dict()
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler().load_state_dict({})


class GradRecorder(torch.optim.Optimizer):
    """An optimizer that only records the (unscaled) gradients it is asked to step with."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.seen: List[torch.Tensor] = []

    def step(self, closure=None):
        self.seen.append(self.param_groups[0]["params"][0].grad.clone())


def test_lagging_optimizer_unscales_by_the_scale_applied() -> None:
    """The async case: the main thread runs ahead of a blocked optimizer thread. Iterations scaled
    before the optimizer got to publish the backed-off scale must be unscaled by the old scale."""
    w = torch.ones(4, requires_grad=True)  # the main thread's model
    master = torch.zeros(4, requires_grad=True)
    opt = GradRecorder([master])
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    scaler = GradScaler(init_scale=2.0**8)
    gate = threading.Event()
    optim_thread.submit(gate.wait, 30)  # the optimizer thread is busy until the gate opens

    def step_fn(grad: torch.Tensor) -> None:
        master.grad = grad
        scaler.step(opt)

    applied = []
    for it in range(4):
        loss = (w * x).sum() * (float("inf") if it == 0 else 1.0)
        scaled = scaler.scale(loss)
        applied.append(scaled.item() / loss.item() if it else scaler.get_scale())
        scaled.backward()
        optim_thread.submit(step_fn, w.grad.clone())
        w.grad = None
        scaler.update()
        # Non-blocking: the getters answer while the optimizer thread is still stuck.
        assert scaler.get_scale() == 2.0**8
        assert scaler.get_growth_interval() == 2000
    gate.set()
    optim_thread.synchronize()
    # Iteration 0 overflowed and was skipped; 1..3 used the stale 2^8 and come out exact (not 2x).
    assert applied == [2.0**8] * 4
    assert len(opt.seen) == 3
    for g in opt.seen:
        assert torch.equal(g, x)
    # The backoff was applied once (iteration 0); later scale() calls adopt it.
    assert scaler.get_scale(up_to_date=True) == 2.0**7
    y = scaler.scale(torch.tensor(1.0))
    assert y.item() == 2.0**7


def test_one_scale_per_iteration_even_if_an_update_lands_mid_iteration() -> None:
    """Two losses in one iteration; the backed-off scale is published between them. Both must use the
    scale the iteration started with, or their gradients could not be unscaled by one number."""
    w = torch.ones(2, requires_grad=True)
    master = torch.zeros(2, requires_grad=True)
    opt = GradRecorder([master])
    scaler = GradScaler(init_scale=2.0**8)
    gate = threading.Event()

    def step_fn(grad: torch.Tensor) -> None:
        master.grad = grad
        scaler.step(opt)

    # Iteration 0 overflows; its step and update wait behind the gate.
    optim_thread.submit(gate.wait, 30)
    scaler.scale(w.sum() * float("inf")).backward()
    optim_thread.submit(step_fn, w.grad.clone())
    w.grad = None
    scaler.update()
    # Iteration 1: first loss, then the optimizer catches up and publishes 2^7, then the second loss.
    first = scaler.scale(w[0] * 1.0)
    gate.set()
    optim_thread.synchronize()
    assert scaler.get_scale() == 2.0**8  # what scale() applies in this iteration
    assert scaler.get_scale(up_to_date=True) == 2.0**7  # the dynamic scale, for the next iteration
    second = scaler.scale(w[1] * 1.0)
    assert first.item() == second.item() == 2.0**8
    (first + second).backward()
    optim_thread.submit(step_fn, w.grad.clone())
    scaler.update()
    optim_thread.synchronize()
    assert len(opt.seen) == 1 and torch.equal(opt.seen[0], torch.ones(2))
    assert scaler.scale(torch.tensor(1.0)).item() == 2.0**7


def test_update_inside_the_step_function_is_refused() -> None:
    scaler = GradScaler()
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p])
    scaler.scale(p.sum()).backward()

    def bad_step():
        scaler.step(opt)
        scaler.update()

    optim_thread.submit(bad_step)
    with pytest.raises(optim_thread.OptimizerStepError, match="main thread"):
        optim_thread.synchronize()


def test_set_factors_are_ordered_with_updates() -> None:
    scaler = GradScaler(init_scale=8.0, growth_interval=1000)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.set_growth_interval(1)
    scaler.set_growth_factor(3.0)
    assert scaler.get_growth_interval() == 1 and scaler.get_growth_factor() == 3.0
    scaler.scale(p.sum()).backward()
    optim_thread.submit(scaler.step, opt)
    scaler.update()
    assert scaler.get_scale(up_to_date=True) == 24.0
    scaler.set_backoff_factor(0.25)
    assert scaler.get_backoff_factor(up_to_date=True) == 0.25


def test_main_thread_step_and_unscale() -> None:
    """Called on the main thread, step() queues and returns None; unscale_() waits and unscales."""
    scaler = GradScaler(init_scale=4.0)
    p = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale((p * torch.tensor([1.0, 2.0])).sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0]))
    assert scaler.step(opt) is None
    optim_thread.synchronize()
    assert torch.equal(p.detach(), torch.tensor([0.5, 0.0]))
    with pytest.raises(optim_thread.OptimizerStepError, match="already been called"):
        optim_thread.submit(scaler.step, opt)
        optim_thread.synchronize()


def test_disabled_is_a_pass_through() -> None:
    scaler = GradScaler(enabled=False)
    assert not scaler.is_enabled()
    t = torch.ones(3)
    assert scaler.scale(t) is t
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.ones(1)
    opt = torch.optim.SGD([p], lr=1.0)
    assert scaler.step(opt) is None and p.item() == -1.0  # ran at once, on this thread
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.set_growth_interval(7)
    assert scaler.get_growth_interval() == 7


def test_scale_handles_iterables_and_fp16() -> None:
    scaler = GradScaler(init_scale=2.0**10)
    a = torch.ones(2, dtype=torch.float16)
    out = scaler.scale([a, (a, a)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].dtype == torch.float16 and out[0][0].item() == 2.0**10
    with pytest.raises(ValueError):
        scaler.scale([a, 3])
