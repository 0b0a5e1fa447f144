"""The dispatch policy's contract (``roundpipe.devices.dispatch``): data parallel relies on it, the planner's
model of a call asks it."""

from __future__ import annotations

import pytest
import torch

from roundpipe import settings
from roundpipe.devices import device as device_mod
from roundpipe.devices import dispatch
from roundpipe.devices.dispatch import DispatchPolicy, RoundRobin
from roundpipe.planning.simulate import round_robin, simulate_iteration


def test_round_robin_is_the_policy() -> None:
    assert isinstance(dispatch.dispatcher, DispatchPolicy)
    assert isinstance(RoundRobin(), DispatchPolicy)


@pytest.mark.parametrize("workers", ["cpu:3"], indirect=True)
def test_assignment_depends_on_position_and_count_only(workers: str) -> None:
    """Two policies at the same position give the same devices for the same number of jobs, whatever
    happened before; ``seek`` adopts another's position; the position wraps around the pool."""
    a, b = RoundRobin(), RoundRobin()
    a.assign(5)  # a's history differs
    b.seek(a.position())
    assert [d.id for d in a.assign(7)] == [d.id for d in b.assign(7)]
    assert a.position() == b.position() == (5 + 7) % 3
    c = RoundRobin()
    c.seek(4)
    assert c.position() == 1 and [d.id for d in c.assign(4)] == [1, 2, 0, 1]
    assert c.devices_for(4, 3, 1) == [1, 2, 0, 1]


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_a_new_pool_starts_at_device_zero(workers: str) -> None:
    dispatch.dispatcher.assign(3)
    assert dispatch.dispatcher.position() == 1
    settings.configure(devices="cpu:3")  # the pool is re-created
    assert dispatch.dispatcher.position() == 0
    assert device_mod.get_num_devices() == 3


def test_the_simulator_asks_the_same_policy() -> None:
    """``simulate_iteration`` with the policy's own assignment equals its default round robin, and a
    policy that puts every job on one device simulates one device."""
    fwd = [range(0, 1), range(1, 2), range(2, 3)]
    times = [1.0, 2.0, 1.0]
    policy = RoundRobin()
    by_policy = simulate_iteration("infer", fwd, [], times, [], 2, 4, assign=lambda n, d: policy.devices_for(n, d, 0))
    assert by_policy == pytest.approx(simulate_iteration("infer", fwd, [], times, [], 2, 4))
    assert round_robin(5, 2) == policy.devices_for(5, 2, 0)


def test_the_planner_simulates_with_the_runtimes_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan choice (``ModelExecutePlan.auto``'s host-cost choice and ``plan_choice.replan_pays``)
    simulates calls with the dispatcher the runtime assigns jobs with, not a model of round robin."""
    from roundpipe.planning.plan import ModelExecutePlan
    from roundpipe.runtime import plan_choice

    asked: list = []
    real = dispatch.dispatcher.devices_for

    def recording(n: int, d: int, position: int = 0) -> list:
        asked.append((n, d))
        return real(n, d, position)

    monkeypatch.setattr(dispatch.dispatcher, "devices_for", recording)

    class Timer:
        @staticmethod
        def get_estimate(run_type: str) -> tuple:
            return "time", [1.0] * 4, [2.0] * 4

        @staticmethod
        def host_costs(serial: bool) -> object:
            from roundpipe.planning.simulate import HostCosts

            return HostCosts(serial_compute=serial)

    class Model:
        model_timer = Timer()
        REPLAN_GAIN = 0.02

    old = ModelExecutePlan([range(0, 4)], [range(0, 4)])
    new = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 4)])
    plan_choice.replan_pays(Model(), old, new, "train", 4)
    assert asked, "replan_pays did not simulate with the dispatch policy"


def test_peer_handoff_auto_needs_three_gpus_that_reach_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RPP_DEBUG_PEER_HANDOFF=auto``: peer hand-overs on a pool of three or more GPUs with peer access between every
    pair; never on CPU workers or two GPUs; ``1`` / ``0`` decide outright; the answer is kept per pool."""
    import types

    from roundpipe import settings
    from roundpipe.devices import device as device_mod

    def pool(devices: list, reachable: bool = True) -> None:
        managers = [types.SimpleNamespace(device=d) for d in devices]
        monkeypatch.setattr(device_mod, "get_devices", lambda: managers)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: reachable)
        monkeypatch.setattr(device_mod, "_peer_handoff", None)

    monkeypatch.delenv("RPP_DEBUG_PEER_HANDOFF", raising=False)
    gpus = [torch.device("cuda", i) for i in range(4)]
    pool(gpus)
    assert device_mod.peer_handoff_enabled()
    pool(gpus[:2])
    assert not device_mod.peer_handoff_enabled()
    pool(gpus, reachable=False)
    assert not device_mod.peer_handoff_enabled()
    pool([torch.device("cpu")] * 4)
    assert not device_mod.peer_handoff_enabled()
    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "1")
    assert device_mod.peer_handoff_enabled()
    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "0")
    pool(gpus)
    assert not device_mod.peer_handoff_enabled()
    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "sometimes")
    with pytest.raises(ValueError, match="RPP_DEBUG_PEER_HANDOFF"):
        device_mod.peer_handoff_enabled()
    assert settings.DEBUG_PEER_HANDOFF.default == "auto"
