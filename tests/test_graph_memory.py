"""Device memory of graphed jobs (``roundpipe.devices.graphs``) and long-context calls.

A call whose microbatches are too large for a graph (``Run.may_graph``) takes no weight slots:
its jobs upload as eager jobs do. Graphs and slots left by calls of other shapes, and the pinned host blocks
earlier calls' checkpoints were cut from, do not make the planner refuse a call that fits without them
(``budget.plan_or_refuse`` releases them, ``device.release_graphs`` and ``backend.empty_host_cache``, and plans
again). On CPU workers with the stand-in (``RPP_DEBUG_GRAPHS=1``), against plain PyTorch (float64).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterator, List, Optional

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import device as device_mod
from roundpipe.devices import graphs
from roundpipe.planning import budget
from roundpipe.runtime.batch import Batch
from roundpipe.utils import GiB

TOL = 1e-10
LAYERS = 6
WIDTH = 8
SMALL_ROWS = 6  # 3 rows per microbatch: 192 bytes of input
LARGE_ROWS = 40  # 20 rows per microbatch: 1,280 bytes of input
PLAN = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 4), range(4, 6)])


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with settings.overridden(debug_graphs="1"):
        yield


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]).double()


def _profile(batch: Batch, recompute_grain: str) -> budget.ActivationProfile:
    """An activation profile as a preset reports one: every layer after the first starts a backward stage
    whose input (all microbatches) is ``checkpoint``; kept and peak a few stage inputs."""
    per_mb = max(
        sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        for leaves in batch.flatten_states
    )
    rows = sum(leaves[0].shape[0] for leaves in batch.flatten_states)

    def scaled(n: int) -> budget.ActivationProfile:
        b = float(per_mb) * n / rows
        checkpoint = [0.0] + [batch.num_microbatch * b] * (LAYERS - 1)
        return budget.ActivationProfile([b] * LAYERS, [3 * b] * LAYERS, checkpoint, n, n, scaled)

    return scaled(rows)


def _model(monkeypatch: pytest.MonkeyPatch, plan: Optional[ModelExecutePlan], profile: bool = True) -> RoundPipe:
    rp = RoundPipe(_stack(), model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    if profile:
        monkeypatch.setattr(rp, "activation_profile", _profile)
    return rp


def _data(rows: int, seed: int) -> List[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(rows, WIDTH, dtype=torch.float64) for _ in range(2)]


def _call(rp: RoundPipe, ref: nn.Module, rows: int, seed: int, cfg: Optional[RoundPipeRunConfig] = None) -> None:
    """One forward_backward call on both; the losses are equal (gradients accumulate, compared by ``_same_grads``)."""
    x, y = _data(rows, seed)
    loss = rp.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=lambda o, t: ((o - t) ** 2).sum(),
        run_config=cfg if cfg is not None else RoundPipeRunConfig(),
    )
    ref_loss = sum(((ref(a) - b) ** 2).sum() for a, b in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())


def _same_grads(rp: RoundPipe, ref: nn.Module) -> None:
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) < TOL


def _captures() -> int:
    return sum(d.graphs.captures for d in device_mod.get_devices())


def _holding() -> bool:
    return any(d.graphs.holds_memory() for d in device_mod.get_devices())


def _count_slots(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Record every ``GraphCache.take_slots`` (how many slots each job asked for)."""
    taken: List[int] = []
    real = graphs.GraphCache.take_slots

    def spy(self: graphs.GraphCache, signatures: Any, parity: int) -> List[graphs.LayerSlot]:
        taken.append(len(signatures))
        return real(self, signatures, parity)

    monkeypatch.setattr(graphs.GraphCache, "take_slots", spy)
    return taken


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_a_call_too_large_for_graphs_takes_no_slots(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Microbatches whose stage inputs exceed ``graphs.MAX_INPUT_BYTES`` (by the call's profile): no job of
    the call takes slots or captures, the results equal PyTorch; small calls still graph, and a large one
    after them takes no slots either."""
    monkeypatch.setattr(graphs, "MAX_INPUT_BYTES", 1000)
    taken = _count_slots(monkeypatch)
    rp = _model(monkeypatch, PLAN)
    ref = copy.deepcopy(rp.model)
    for seed in range(3):  # more calls than the warm-up: a graphed job would have captured by the third
        _call(rp, ref, LARGE_ROWS, seed)
    assert taken == [] and not _holding() and _captures() == 0
    for seed in range(4):
        _call(rp, ref, SMALL_ROWS, 10 + seed)
    assert taken and _captures() > 0, (taken, _captures())
    replays = sum(d.graphs.replays for d in device_mod.get_devices())
    assert replays > 0
    before = len(taken)
    _call(rp, ref, LARGE_ROWS, 20)
    assert len(taken) == before
    _call(rp, ref, SMALL_ROWS, 21)  # the small shape's graphs were kept: replayed again
    assert len(taken) > before and sum(d.graphs.replays for d in device_mod.get_devices()) > replays
    _same_grads(rp, ref)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_without_a_profile_the_microbatch_check_alone_decides(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that reports no activation profile keeps the per-microbatch check: its large call's jobs
    take slots but run eagerly (nothing captured); results equal PyTorch."""
    monkeypatch.setattr(graphs, "MAX_INPUT_BYTES", 1000)
    taken = _count_slots(monkeypatch)
    rp = _model(monkeypatch, PLAN, profile=False)
    ref = copy.deepcopy(rp.model)
    for seed in range(3):
        _call(rp, ref, LARGE_ROWS, seed)
    assert taken and _captures() == 0
    _same_grads(rp, ref)


def _capacity(monkeypatch: pytest.MonkeyPatch, free: float, while_held: float) -> List[bool]:
    """Device capacity ``while_held`` bytes while any device holds graphs or slots, else ``free``; a host
    budget that is never the limit. Returns, per budget read, whether graphs were held."""
    reads: List[bool] = []

    def capacity() -> int:
        held = _holding()
        reads.append(held)
        return int(while_held if held else free)

    monkeypatch.setattr(device_mod, "get_min_capacity", capacity)
    monkeypatch.setattr(budget, "host_budget", lambda: 64 * GiB)
    return reads


def _graph_small_calls(rp: RoundPipe, ref: nn.Module) -> None:
    """Small calls with an explicit plan: they leave graphs and slots on the devices."""
    for seed in range(4):
        _call(rp, ref, SMALL_ROWS, 30 + seed, RoundPipeRunConfig(execute_plan=PLAN))
    assert _captures() > 0 and _holding()


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_leftover_graphs_are_released_before_a_refusal(
    workers: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A call planned while graphs of another shape hold the memory it needs: the planner releases them,
    plans again (and says so at debug level) and the call trains as PyTorch does (without the release it
    would be refused)."""
    reads = _capacity(monkeypatch, free=64 * GiB, while_held=1 * GiB)  # 1 GiB: no budget after the margin
    rp = _model(monkeypatch, None)
    ref = copy.deepcopy(rp.model)
    _graph_small_calls(rp, ref)
    reads.clear()
    with caplog.at_level(logging.DEBUG, logger="roundpipe"):
        _call(rp, ref, LARGE_ROWS, 40)  # planned by the budgets (no execute_plan)
    assert reads[0] and not reads[-1], reads  # refused while held, planned once released
    assert sum("the graphs and weight slots of calls of other shapes" in r.getMessage() for r in caplog.records) == 1
    _call(rp, ref, SMALL_ROWS, 41, RoundPipeRunConfig(execute_plan=PLAN))  # graphs again after the release
    _same_grads(rp, ref)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_a_call_that_cannot_fit_is_refused_as_before(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that does not fit even without graphs: the same MemoryError as on devices that held none
    (the graphs were released and the budget read again), and no job ran."""
    _capacity(monkeypatch, free=1 * GiB, while_held=1 * GiB)
    rp = _model(monkeypatch, None)
    ref = copy.deepcopy(rp.model)
    x, y = _data(LARGE_ROWS, 50)

    def refused() -> str:
        launched = sum(d.graphs.jobs for d in device_mod.get_devices())
        with pytest.raises(MemoryError) as err:
            rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        assert sum(d.graphs.jobs for d in device_mod.get_devices()) == launched
        return str(err.value)

    fresh = refused()
    assert "does not fit" in fresh and "per device for a backward stage's activations" in fresh
    _graph_small_calls(rp, ref)
    assert refused() == fresh
    assert not _holding()
    _same_grads(rp, ref)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_replan_counts_the_host_cache_of_its_own_checkpoints_as_free(
    workers: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A replan of the same call after a step, while torch's host cache still holds the pinned blocks of that
    step's checkpoints (which the host budget reads as used): the planner empties the cache, plans again (and
    says so at debug level) and the call trains as PyTorch does; without the release it would be refused."""
    b = (LARGE_ROWS // 2) * WIDTH * 8  # a stage input of one microbatch (``_profile``: kept b, peak 3b)
    monkeypatch.setattr(budget, "gpu_budget", lambda layer_bytes: 3.2 * b)  # one layer per backward stage
    cached = [0.0]
    monkeypatch.setattr(budget, "host_budget", lambda: 12 * b - cached[0])  # every stage's input: at most 10b
    emptied: List[int] = []
    monkeypatch.setattr(budget.backend, "empty_host_cache", lambda: (emptied.append(1), cached.__setitem__(0, 0.0)))
    rp = _model(monkeypatch, None)
    ref = copy.deepcopy(rp.model)
    _call(rp, ref, LARGE_ROWS, 60)
    plan = rp.plan_cache.plans[next(iter(rp.plan_cache.plans))][0]
    assert max(len(r) for r in plan.bwd_plan) == 1 and emptied == [], plan
    cached[0] = 10 * b  # the step's checkpoints went back to the host cache
    rp.plan_cache.plans.clear()  # the next call plans again, as after new timings
    with caplog.at_level(logging.DEBUG, logger="roundpipe"):
        _call(rp, ref, LARGE_ROWS, 61)
    assert emptied == [1]
    assert sum("released the pinned host cache" in r.getMessage() for r in caplog.records) == 1
    _same_grads(rp, ref)
