"""Nothing hangs: a call with no progress for the watchdog's time fails on every thread, naming the job, the
layer and the event waited for (``threads._poll``), while a slow call that keeps moving runs to the end; and
the default limit scales from the planner's timings (``run.watchdog_limit``)."""

from __future__ import annotations

import copy
import time
from typing import List

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import threads
from roundpipe.runtime.run import watchdog_limit
from roundpipe.runtime.tracker import ModelTracker

# Layers 0-2 run as forward groups [0, 1], [2]; backward groups [0, 1], [2], and the fused group [3, 4].
PLAN = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 5)])


class Slow(nn.Module):
    """The identity, taking ``seconds`` per call (forward and recompute): a slow layer that still moves."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def _model(slow_s: float = 0.0) -> nn.Sequential:
    torch.manual_seed(5)
    first: nn.Module = Slow(slow_s) if slow_s > 0 else nn.Tanh()
    return nn.Sequential(nn.Linear(8, 16), first, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def _call(rp: RoundPipe, x: torch.Tensor) -> None:
    rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).mean())


def _ref_loss(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the sum of the microbatches' losses (as ``forward_backward`` defines it)."""
    return torch.stack([ref(part).pow(2).mean() for part in torch.tensor_split(x, 4)]).sum()


def _wait_idle_threads() -> List[str]:
    """The RoundPipe threads still busy 5 s from now at most (none once every thread has let go)."""
    deadline = time.monotonic() + 5
    while any(t.is_alive() and t.is_active for t in threads.roundpipe_threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [t.name for t in threads.roundpipe_threads if t.is_alive() and t.is_active]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_an_input_gradient_never_handed_on_fails_within_the_watchdog(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backward group 1 never says microbatch 0's input gradient is issued: group 0's backward job waits for
    an event nobody sets. The call fails within the limit, naming that job, its layers and the event, every
    thread lets go, and the model runs the next call."""
    real = ModelTracker.backward_notify

    def backward_notify(self: ModelTracker, layer_group_id: int, m: int) -> None:
        if (layer_group_id, m) != (1, 0):
            real(self, layer_group_id, m)

    rp = RoundPipe(_model(), model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=PLAN))
    x = torch.randn(10, 8, dtype=torch.float64)
    limit = 1.0
    monkeypatch.setattr(ModelTracker, "backward_notify", backward_notify)
    with settings.overridden(watchdog_s=limit):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="no RoundPipe thread made progress for 1 s") as info:
            _call(rp, x)
        elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "backward job of layers 0-1, before microbatch 0, waits for event bwd_group1.microbatch0" in msg, msg
    assert "event bwd_group1.microbatch0" in msg and "RPP_WATCHDOG_S=1" in msg and "cpu-worker" in msg, msg
    assert isinstance(info.value.original, threads.RoundPipeStalled)  # type: ignore[attr-defined]
    assert limit <= elapsed < limit + 3.0, elapsed
    assert not _wait_idle_threads()
    monkeypatch.setattr(ModelTracker, "backward_notify", real)
    with settings.overridden(watchdog_s=limit):
        _call(rp, x)  # the model works again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_slow_call_that_keeps_moving_is_not_cut_short(workers: str) -> None:
    """A layer that takes 0.3 s per microbatch, in forward and again in recompute, in a call of 4 microbatches
    (1.2 s of sleep in the forward alone, past the 1 s limit): every microbatch is progress, so the call runs
    through and its gradients are plain PyTorch's."""
    model = _model(slow_s=0.3)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=PLAN))
    x = torch.randn(12, 8, dtype=torch.float64)
    with settings.overridden(watchdog_s=1.0):
        start = time.monotonic()
        _call(rp, x)
        assert time.monotonic() - start > 1.2
    ref[1].seconds = 0.0
    _ref_loss(ref, x).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) < 1e-10, name  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_the_default_scales_from_the_timed_jobs(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: the floor until forward is timed; then 10 x the slowest job the estimates expect when that is
    longer (a long-context step of minutes per job); an explicit setting wins, 0 included."""
    rp = RoundPipe(_model(), model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=PLAN))
    assert watchdog_limit(rp, PLAN, 4)[0] == threads.WATCHDOG_FLOOR_S
    per_layer_ms = [1.0, 2.0, 3.0, 4.0, 5.0]  # fwd; bwd twice that: the slowest group is [3, 4], 27 ms each
    monkeypatch.setattr(rp.model_timer, "get_estimate", lambda _: ("time", per_layer_ms, [2 * t for t in per_layer_ms]))
    assert rp.model_timer.slowest_job_ms([*PLAN.fwd_plan, *PLAN.bwd_plan], 4) == pytest.approx(27.0 * 4)
    assert watchdog_limit(rp, PLAN, 4)[0] == threads.WATCHDOG_FLOOR_S  # 1.08 s x 10: below the floor
    long_ms = [t * 60_000 for t in per_layer_ms]  # minutes per layer: a long context on a slow card
    monkeypatch.setattr(rp.model_timer, "get_estimate", lambda _: ("time", long_ms, [2 * t for t in long_ms]))
    limit, source = watchdog_limit(rp, PLAN, 4)
    assert limit == pytest.approx(threads.WATCHDOG_JOBS * 27.0 * 60 * 4) and "RPP_WATCHDOG_S=auto" in source
    with settings.overridden(watchdog_s=0.0):
        assert watchdog_limit(rp, PLAN, 4) == (0.0, "RPP_WATCHDOG_S=0")
