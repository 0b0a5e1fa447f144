"""Graphed jobs (``roundpipe.devices.graphs``): weights in fixed device slots, each microbatch one replay.

On CPU workers ``RPP_DEBUG_GRAPHS=1`` selects the stand-in, which "captures" by recording the job's function
and "replays" by running it again on the static inputs and copying its results into the static
outputs: the same slots, static copies, pass-through outputs, clones and refusals as on a GPU, so the
whole data flow is checked against plain PyTorch here (float64, tight tolerances). The GPU versions
(real CUDA graphs against the eager runtime) are in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Dict, Iterator, List

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import allocator
from roundpipe.devices import device as device_mod
from roundpipe.runtime.context import save_for_recompute

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)

TOL = 1e-10


@pytest.fixture(autouse=True)
def graphs_on() -> Iterator[None]:
    with settings.overridden(debug_graphs="1"):
        yield


def _stack(n: int = 6, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)]).double()


def _counts() -> Dict[str, int]:
    devs = device_mod.get_devices()
    return {
        "captures": sum(d.graphs.captures for d in devs),
        "replays": sum(d.graphs.replays for d in devs),
        "refused": sum(len(d.graphs.refused) for d in devs),
    }


def _train(rp: RoundPipe, ref: nn.Module, xs: List[torch.Tensor], ys: List[torch.Tensor], n_mb: int) -> None:
    """Steps of SGD on both, compared after each (synchronous steps: no staleness to model)."""
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in zip(xs, ys):
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        loss_ref = sum(
            ((ref(xm) - ym) ** 2).sum() for xm, ym in zip(torch.tensor_split(x, n_mb), torch.tensor_split(y, n_mb))
        )
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        assert abs(loss.item() - loss_ref.item()) <= TOL * abs(loss_ref.item())
    rp.synchronize()
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert rel_err(p, q) < TOL


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("num_microbatch", [1, 3, 4])
def test_graphed_training_equals_pytorch(workers: str, num_microbatch: int) -> None:
    """Several training steps through graphed jobs (weights change every step, so every upload into the
    slots must land before a replay reads it) equal plain PyTorch; the jobs really replay."""
    model = _stack()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 4), range(4, 6)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, execute_plan=plan))
    torch.manual_seed(1)
    xs = [torch.randn(8, 8, dtype=torch.float64) for _ in range(8)]
    ys = [torch.randn(8, 8, dtype=torch.float64) for _ in range(8)]
    _train(rp, ref, xs, ys, num_microbatch)
    counts = _counts()
    assert counts["captures"] > 0 and counts["replays"] > 0 and counts["refused"] == 0, counts


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_input_gradients_and_forward_then_backward(workers: str) -> None:
    """``out = rp(x); loss.backward()`` (a 'train' call) through graphed jobs: the input gradient and
    the accumulated parameter gradients (two calls per step) equal plain PyTorch."""
    model = _stack()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 3), range(3, 6)], [range(0, 1), range(1, 3), range(3, 6)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    for seed in range(8):
        torch.manual_seed(seed)
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        w = torch.randn(6, 8, dtype=torch.float64)
        (rp(x) * w).sum().backward()
        (torch.cat([ref(p) for p in torch.tensor_split(x_ref, 2)]) * w).sum().backward()
        assert rel_err(x.grad, x_ref.grad) < TOL
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < TOL
    assert _counts()["replays"] > 0


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_new_length_is_captured_again_not_replayed_wrong(workers: str) -> None:
    """Inputs of another shape are another key: warmed up and captured again, and each length's results
    equal plain PyTorch (a replay of the wrong shape would fail or be wrong)."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]).double()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 2)], [range(0, 2), range(2, 4)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    captures = []
    for rows in (6,) * 8 + (10,) * 8 + (6,):
        torch.manual_seed(rows)
        x, y = torch.randn(rows, 8, dtype=torch.float64), torch.randn(rows, 8, dtype=torch.float64)
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        ref_loss = sum(((ref(a) - b) ** 2).sum() for a, b in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
        captures.append(_counts()["captures"])
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < TOL
    assert captures[7] > 0 and captures[15] > captures[7], captures  # length 10 was captured too
    assert captures[16] == captures[15]  # length 6 again: its graphs were kept


class _Saves(nn.Module):
    """Saves data for its recompute: cannot be graphed (the data goes to the host per microbatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        save_for_recompute(x.detach().sum())
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_group_that_saves_data_for_its_recompute_stays_eager(workers: str) -> None:
    """A group whose forward saves data for its recompute is refused after its warm-up and keeps running
    eagerly (the data goes to the host per microbatch); results equal plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Saves(), nn.Linear(8, 8)).double()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 3)], [range(0, 3)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        (rp(x) ** 2).sum().backward()
        (torch.cat([ref(p) for p in torch.tensor_split(x_ref, 2)]) ** 2).sum().backward()
        assert rel_err(x.grad, x_ref.grad) < TOL
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < TOL
    counts = _counts()
    assert counts["refused"] > 0 and counts["captures"] == 0, counts


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_dropout_group_recompute_matches_forward(workers: str) -> None:
    """A group whose forward draws random numbers (dropout: the recompute must see the forward's mask)
    is refused after its warm-up and runs eagerly; its gradients equal the reference run with the masks
    RoundPipe's forward drew (recorded by a forward hook)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).double()
    masks: List[torch.Tensor] = []
    from roundpipe.runtime.context import doing_recompute

    model[1].register_forward_hook(
        lambda m, i, o: masks.append((o != 0).detach().clone()) if not doing_recompute() else None
    )
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 3)], [range(0, 3)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    for seed in range(4):
        masks.clear()
        torch.manual_seed(seed)
        x = torch.randn(6, 8, dtype=torch.float64)
        w = torch.randn(6, 8, dtype=torch.float64)
        (rp(x) * w).sum().backward()
        outs = []
        for part, mask in zip(torch.tensor_split(x, 2), masks):
            outs.append(ref[2](ref[0](part) * mask / 0.5))
        (torch.cat(outs) * w).sum().backward()
    for p, q in zip(rp.model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < TOL
    counts = _counts()
    assert counts["captures"] == 0 and counts["refused"] > 0, counts  # dropout drew random numbers


class _MakesObject(nn.Module):
    """Returns an object made in forward: a replay could not make it, so the group stays eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        x = x[0] if isinstance(x, tuple) else x
        return (self.lin(x), object())


class _DropsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Any) -> torch.Tensor:
        return self.lin(x[0])


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_a_group_returning_a_new_object_is_refused(workers: str) -> None:
    """The first group hands an object made in its forward to the next: refused after its capture; the
    second group, which takes that object as input, is never warmed up (a replay could not see the
    next object)."""
    torch.manual_seed(0)
    model = nn.Sequential(_MakesObject(), _MakesObject(), _DropsObject()).double()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 2), range(2, 3)], [])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8, dtype=torch.float64)
            assert rel_err(rp(x), ref(x)) < TOL
    counts = _counts()
    assert counts["refused"] == 1 and counts["captures"] == 0, counts
    assert sum(len(d.graphs.warm) for d in device_mod.get_devices()) == 1  # no key per object


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_graphs_off_runs_no_slots(workers: str) -> None:
    """``RPP_DEBUG_GRAPHS=0``: no slot, no capture; the same results."""
    with settings.overridden(debug_graphs="0"):
        model = _stack()
        ref = copy.deepcopy(model)
        rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        torch.manual_seed(1)
        _train(
            rp,
            ref,
            [torch.randn(8, 8, dtype=torch.float64) for _ in range(3)],
            [torch.randn(8, 8, dtype=torch.float64) for _ in range(3)],
            2,
        )
        assert all(not d.graphs.slots for d in device_mod.get_devices())
        assert _counts()["captures"] == 0


class _Branch(nn.Module):
    """Python control flow on the data (a host read of a device value): ``x @ a`` when the microbatch's
    mean is positive, else ``x @ b``. A CUDA capture of it fails; the stand-in must notice too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ (self.a if float(x.mean()) > 0 else self.b))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_a_group_that_branches_on_the_data_is_refused_and_right(workers: str) -> None:
    """Microbatches that take different branches through the same group: every gradient equals plain
    PyTorch (the unused branch's weight of a step keeps ``.grad = None`` when no microbatch took it),
    and the key is refused once a replay saw the branch change."""
    torch.manual_seed(0)
    model = nn.Sequential(_Branch(), _Branch(), nn.Linear(8, 8)).double()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 2)], [range(0, 2), range(2, 3)])
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    for step in range(12):
        torch.manual_seed(step)
        sign = 1.0 if step < 8 else -1.0  # the first steps take branch a (warm-ups and capture), then b
        x = (torch.randn(4, 8, dtype=torch.float64) + 2.0 * sign).requires_grad_(False)
        y = torch.randn(4, 8, dtype=torch.float64)
        rp.zero_grad()
        ref.zero_grad()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        sum(((ref(a) - b) ** 2).sum() for a, b in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2))).backward()
        for (name, p), q in zip(rp.model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (step, name)
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) < TOL, (step, name)
    assert _counts()["refused"] > 0


def test_auto_graphs_withdraw_roundpipes_expandable_segments_above_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph captures failed with expandable segments on 4 GPUs: ``auto`` turns off the segments that
    ``import roundpipe`` chose (and graphs), keeps a user's choice (and stays eager), and leaves pools of
    up to two GPUs alone."""
    from roundpipe.devices import graphs

    calls: list = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: calls.append(conf))
    for name in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(allocator, "EXPANDABLE_BY_ROUNDPIPE", None)
    monkeypatch.setattr(graphs, "_allocator_checked", False)
    assert graphs.allocator_allows(2) and not calls
    assert not graphs.allocator_allows(4) and not calls  # the user's choice: eager, segments kept
    assert graphs.allocator_allows(4) is False

    monkeypatch.setattr(allocator, "EXPANDABLE_BY_ROUNDPIPE", "PYTORCH_ALLOC_CONF")
    assert graphs.allocator_allows(4)
    assert calls == ["expandable_segments:False"]
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert allocator.EXPANDABLE_BY_ROUNDPIPE is None
    assert graphs.allocator_allows(4) and len(calls) == 1  # once


def test_expandable_segments_are_withdrawn_once_when_every_device_thread_asks_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device threads of a new 4-GPU pool ask at their first job, all at once: exactly one withdraws
    roundpipe's expandable segments, and none fails (two at once once wrote ``os.environ[None]``)."""
    import threading

    from roundpipe.devices import graphs

    calls: list = []
    barrier = threading.Barrier(8)

    def slow_setter(conf: str) -> None:  # widen the window between the check and the withdrawal
        calls.append(conf)
        time.sleep(0.05)

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", slow_setter)
    for name in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(allocator, "EXPANDABLE_BY_ROUNDPIPE", "PYTORCH_ALLOC_CONF")
    results: list = []
    errors: list = []

    def ask() -> None:
        barrier.wait()
        try:
            results.append(graphs.allocator_allows(4))
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors and results == [True] * 8
    assert calls == ["expandable_segments:False"]
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    assert allocator.EXPANDABLE_BY_ROUNDPIPE is None
