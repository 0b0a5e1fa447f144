"""Re-planning from timings: a plan in use is replaced only by one the planner's model says is at least
``RoundPipe.REPLAN_GAIN`` faster, so plans of equal cost do not alternate on timer noise (each new plan
moves stage boundaries and the device memory peak)."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def _model() -> RoundPipe:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    return RoundPipe(layers, model_run_config=RoundPipeRunConfig(num_microbatch=2))


def _plan(fwd: List[range], bwd: List[range]) -> ModelExecutePlan:
    return ModelExecutePlan(fwd, bwd)


def _proposing(monkeypatch: pytest.MonkeyPatch) -> Tuple[List[ModelExecutePlan], List[int]]:
    """The auto planner proposes a first plan, then, at every later planning, a second one of the same
    simulated cost on one device (same layers, other forward groups). Returns (plans, calls made)."""
    proposals = [
        _plan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 4)]),
        _plan([range(0, 1), range(1, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 4)]),
    ]
    calls: List[int] = []

    def auto(run_type: str, *models: object, **kw: object) -> ModelExecutePlan:
        calls.append(1)
        return proposals[min(len(calls), len(proposals)) - 1]

    monkeypatch.setattr(ModelExecutePlan, "auto", staticmethod(auto))
    return proposals, calls


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_replan_pays_only_for_a_real_gain(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layers in other groups at equal cost: no gain, the old plan stays. A plan that halves the
    simulated time on two devices (or removes a slow group's wait) pays."""
    from roundpipe.planning.simulate import HostCosts
    from roundpipe.runtime import plan_choice

    rp = _model()
    times = [1.0, 1.0, 1.0, 1.0]
    monkeypatch.setattr(
        rp.model_timer, "get_estimate", lambda run_type: (None, list(times), [3.0 * t for t in times] + [3.0])
    )
    # Devices that compute at once, as GPUs do (CPU workers compute under one lock: below).
    monkeypatch.setattr(plan_choice, "host_costs", lambda model: HostCosts())
    old = _plan([range(0, 2), range(2, 3), range(3, 4)], [range(0, 2), range(2, 4), range(4, 5)])
    same_cost = _plan([range(0, 1), range(1, 2), range(2, 3), range(3, 4)], [range(0, 2), range(2, 4), range(4, 5)])
    assert plan_choice.replan_pays(rp, old, old, "train", 2)  # identical plans: nothing to compare
    if workers == "cpu:1":
        assert not plan_choice.replan_pays(rp, old, same_cost, "train", 2)  # one device: the sum of costs is equal
    # One group holding all backward layers serialises two devices; split, they overlap.
    lumped = _plan([range(0, 4)], [range(0, 4), range(4, 5)])
    split = _plan(
        [range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
        [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 5)],
    )
    if workers == "cpu:2":
        assert plan_choice.replan_pays(rp, lumped, split, "train", 2)
        # CPU workers compute one at a time: splitting overlaps nothing, and each job costs the host.
        monkeypatch.setattr(plan_choice, "host_costs", lambda model: HostCosts(job_ms=0.5, serial_compute=True))
        assert not plan_choice.replan_pays(rp, lumped, split, "train", 2)
        assert plan_choice.replan_pays(rp, split, lumped, "train", 2)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_a_replan_of_equal_cost_keeps_the_plan_in_use(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the training path: the auto planner proposes another plan of the same simulated cost at
    the re-plan after the first timings; the calls keep running the first plan. A plan that pays is
    taken at the next re-plan."""
    from roundpipe.runtime import plan_choice

    rp = _model()
    proposals, calls = _proposing(monkeypatch)
    x = torch.randn(4, 8)
    used: List[ModelExecutePlan] = []
    for _ in range(4):
        rp.forward_backward(input_args=(x,), loss_fn=lambda o, t: o.square().mean())
        rp.synchronize()
        used.append(next(iter(rp.plan_cache.plans.values()))[0])
    assert len(calls) >= 2, "the timings never triggered a re-plan"
    assert all(p is proposals[0] for p in used), [str(p) for p in used]

    # A re-plan that pays (its simulated time is half) is taken.
    monkeypatch.setattr(plan_choice, "replan_pays", lambda model, old, new, run_type, n: True)
    version = rp.model_timer.version
    rp.plan_cache.plans[next(iter(rp.plan_cache.plans))] = (proposals[0], version - rp.REPLAN_EVERY)
    rp.forward_backward(input_args=(x,), loss_fn=lambda o, t: o.square().mean())
    rp.synchronize()
    assert next(iter(rp.plan_cache.plans.values()))[0] is proposals[1]


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_a_plan_that_no_longer_fits_is_replaced_even_without_gain(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host memory shrinks once the optimizer state exists: the plan in use is kept only while it still
    fits the budgets; otherwise the re-plan's plan is taken whatever its simulated time."""
    from roundpipe.planning import budget

    rp = _model()
    proposals, calls = _proposing(monkeypatch)
    monkeypatch.setattr(budget, "still_fits", lambda profile, layer_bytes, bwd_plan, fused: False)
    x = torch.randn(4, 8)
    for _ in range(4):
        rp.forward_backward(input_args=(x,), loss_fn=lambda o, t: o.square().mean())
        rp.synchronize()
    assert len(calls) >= 2
    assert next(iter(rp.plan_cache.plans.values()))[0] is proposals[1]


def test_still_fits_checks_the_budgets_of_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's backward stages against the GPU budget and its checkpoints against the host budget as
    they are at the call; a model planned by its weights alone always fits."""
    from roundpipe.planning import budget

    G = float(1 << 30)
    profile = budget.ActivationProfile([G] * 4, [2 * G] * 4, [G] * 4, 1024, 1024, lambda n: profile)
    sizes = [G] * 4
    monkeypatch.setattr(budget, "gpu_budget", lambda layer_bytes: 10 * G)
    plan = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]  # three checkpoints (layer 0's input is the model's)
    monkeypatch.setattr(budget, "host_budget", lambda: 3 * G)
    assert budget.still_fits(profile, sizes, plan, False)
    monkeypatch.setattr(budget, "host_budget", lambda: 2 * G)
    assert not budget.still_fits(profile, sizes, plan, False)
    assert budget.still_fits(None, sizes, plan, False)
