"""Optimizer side: master copies, synchronous and asynchronous steps, tied parameters, AutoRoundPipe."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from conftest import WORKER_SPECS
from helpers import rel_err
from torch import nn

from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig
from roundpipe.host.step import OptimizerCtx

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def batches(n: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum() / 24  # mean over the whole batch of 8 x 3


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_sync_step_equals_plain_pytorch(workers: str) -> None:
    model, ref = make_model(), make_model()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2, weight_decay=0.01)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(10):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        loss_fn(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    rp.synchronize()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p, q) < 1e-6, n


def stale_reference(n_iter: int) -> nn.Module:
    """The documented one-step-stale rule in plain PyTorch: each step first copies the optimizer
    parameters as they are before its update into the model, then updates the optimizer copies with
    the gradients the model computed."""
    model, master = make_model(), make_model()
    opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(n_iter):
        loss_fn(model(x), y).backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), master.parameters()):
                p.copy_(q)  # copy before the update
                q.grad = p.grad.clone()
                p.grad = None
        opt.step()
        opt.zero_grad()
    return master


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_async_step_follows_one_step_stale_rule(workers: str) -> None:
    model = make_model()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(8):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    rp.synchronize()
    master = stale_reference(8)
    for (n, p), (_, q) in zip(model.named_parameters(), master.named_parameters()):
        assert rel_err(p, q) < 1e-6, n
    # And it differs from the synchronous result (the rule is observable, not a no-op).
    assert any(rel_err(p, q) > 1e-4 for p, q in zip(model.parameters(), make_sync_result(8).parameters()))


def _mixed_schedule_losses(model: nn.Module) -> List[float]:
    """Losses of a run that mixes asynchronous steps, ``synchronize()``, a synchronous step, and an
    optimizer-parameter edit after ``synchronize()`` (as a checkpoint load would)."""
    rp = RoundPipe(model, optim_dtype=torch.float64, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1, momentum=0.9)
    losses = []
    for k, (x, y) in enumerate(batches(12)):
        losses.append(rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn).item())
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=k not in (5, 6))
        if k == 3:
            rp.synchronize()
        if k == 8:
            rp.synchronize()
            with torch.no_grad():
                for q in rp.optim_parameters():
                    q.mul_(0.5)
    rp.synchronize()
    # The host buffers of a parameter rotate without piling up across the schedule: the model
    # buffer, the staging buffer and one spare (the last model buffer, or the copied gradient).
    from roundpipe.host.buffers import ParamBuffers

    assert all(len(ParamBuffers.of(p).host_buffers(p)) <= 3 for p in model.parameters())
    return losses + [p.detach().double().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:3"], indirect=True)
def test_staged_parameters_follow_the_one_step_stale_rule(workers: str) -> None:
    """Asynchronous steps stage the updated parameters for the next step: a schedule mixing them with
    synchronize(), synchronous steps and edits of the optimizer parameters runs the same twice without
    piling up host buffers, and pure asynchronous iterations follow the one-step-stale reference."""
    assert _mixed_schedule_losses(make_model()) == _mixed_schedule_losses(make_model())
    # Pure asynchronous iterations follow the one-step-stale reference loss by loss.
    rp = RoundPipe(make_model(), model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1, momentum=0.9)
    ref, master = make_model(), make_model()
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(6):
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), master.parameters()):
                p.copy_(q)
                q.grad, p.grad = p.grad.clone(), None
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) < 1e-6 * max(1.0, abs(ref_loss.item()))
    rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_fused_staging_env_is_checked(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value fails when the model is built, naming the variable (not at some later step)."""
    monkeypatch.setenv("RPP_DEBUG_FUSED_STAGING", "maybe")
    with pytest.raises(ValueError, match="RPP_DEBUG_FUSED_STAGING='maybe': expected"):
        RoundPipe(make_model())


def make_sync_result(n_iter: int) -> nn.Module:
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(n_iter):
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_bf16_model_with_fp32_master_converges(workers: str) -> None:
    torch.manual_seed(3)
    w_true = torch.randn(6, 3)
    model = make_model().to(torch.bfloat16)
    rp = RoundPipe(model, optim_dtype=torch.float32)
    params = list(rp.optim_parameters())
    assert all(p.dtype == torch.float32 for p in params)
    opt = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(150):
        x = torch.randn(16, 6)
        y = x @ w_true
        loss = rp.forward_backward(
            input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean() / 3
        )
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
    rp.synchronize()
    assert sum(losses[-10:]) / 10 < 0.1 * sum(losses[:10]) / 10
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_tied_parameters_appear_once_and_sum_gradients(workers: str) -> None:
    torch.manual_seed(4)
    emb = nn.Linear(5, 5, bias=False)
    head = nn.Linear(5, 5, bias=False)
    head.weight = emb.weight  # tied, in two different layers
    model = nn.Sequential(emb, nn.Tanh(), head)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert len(list(rp.optim_parameters())) == 1
    x = torch.randn(4, 5)
    rp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert rel_err(emb.weight.grad, ref[0].weight.grad) < 1e-6
    # Gradients of tied parameters accumulate across calls (the summed share is reused, not copied).
    for k in range(2):
        x = torch.randn(4, 5)
        rp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert rel_err(emb.weight.grad, ref[0].weight.grad) < 1e-6, k
    # ... and start from zero again after zero_grad, through optimizer steps (async and sync).
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    rp.step(lambda: opt.zero_grad(), is_async=False)
    emb.weight.grad = None
    for is_async in (False, False, True):
        x = torch.randn(4, 5)
        rp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert rel_err(emb.weight.grad, ref[0].weight.grad) < 1e-6
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        if not is_async:
            ref_opt.step()
            ref_opt.zero_grad()
            assert rel_err(emb.weight, ref[0].weight) < 1e-6
    rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("plan_kind", ["layerwise", "one-group", "three-way"])
@pytest.mark.parametrize("fused", [False, True])
def test_tied_gradient_shares_are_summed_on_the_device(
    workers: str, plan_kind: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shares of a tied parameter from layers above its owner are summed into the owner's share on
    the device before the owner's download (transfer.TiedGrads): on one device the sharers' shares are
    not even downloaded, on two they are and the owner's download adds them in. Either way the main
    thread finds one share left to fold; where owner and sharer run in one job it still adds them.
    Gradients equal plain PyTorch, across calls (accumulation) and steps."""
    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.planning.plan import ModelExecutePlan

    torch.manual_seed(5)
    emb, mid, head = (nn.Linear(5, 5, bias=False) for _ in range(3))
    head.weight = emb.weight
    if plan_kind == "three-way":
        mid.weight = emb.weight
    model = nn.Sequential(emb, nn.Tanh(), mid, nn.Tanh(), head)
    ref = copy.deepcopy(model)
    n = len(model)
    plan = (
        ModelExecutePlan.layerwise(n, "train")
        if plan_kind != "one-group"
        else ModelExecutePlan([range(0, n)], [range(0, n)])
    )
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    bufs = ParamBuffers.of(emb.weight)
    left: List[int] = []  # shares the main thread found to fold, per call
    real_reduce = RoundPipe.reduce_shared_grads

    def reduce(self: RoundPipe) -> None:
        left.append(sum(g is not None for g in bufs.shares.values()))
        real_reduce(self)

    monkeypatch.setattr(RoundPipe, "reduce_shared_grads", reduce)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    one_device = workers == "cpu:1"
    for k in range(4):
        x, y = torch.randn(4, 5), torch.randn(4, 5)
        if fused:
            rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        else:
            ((rp(x) - y) ** 2).sum().backward()
        ((ref(x) - y) ** 2).sum().backward()
        assert rel_err(emb.weight.grad, ref[0].weight.grad) < 1e-6, k
        assert left[-1] == (len(bufs.attr.layer_ids) if plan_kind == "one-group" else 1), left
        sharer_buffers = [lid for lid, lst in bufs.share_buffers.items() if lst and lid != 0]
        if one_device and plan_kind != "one-group":
            assert sharer_buffers == [], sharer_buffers  # kept on the device, never downloaded
        if k % 2 == 1:  # two calls accumulate, then a synchronous step
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            emb.weight.grad = None
            ref_opt.step()
            ref_opt.zero_grad()
            assert rel_err(emb.weight, ref[0].weight) < 1e-6, k


class _DetachedUse(nn.Module):
    """Uses a (tied) weight without a gradient path: its layer contributes no gradient share."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.detach().t()


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_tied_share_kept_on_the_device_when_the_owner_has_no_gradient(workers: str) -> None:
    """The owner layer of a tied weight computes no gradient for it: the share kept on the device by
    the layer above becomes the whole gradient at the owner's download."""
    from roundpipe.planning.plan import ModelExecutePlan

    torch.manual_seed(6)
    head = nn.Linear(5, 5, bias=False)
    model = nn.Sequential(_DetachedUse(head.weight), nn.Tanh(), head)
    ref = copy.deepcopy(model)
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=ModelExecutePlan.layerwise(3, "train")),
    )
    for _ in range(2):  # the second call accumulates onto the first
        x = torch.randn(4, 5, requires_grad=True)
        rp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert rel_err(head.weight.grad, ref[2].weight.grad) < 1e-6


def test_spare_buffers_serve_pinned_requests_only_with_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """ParamBuffers spares: a pageable spare (pin_model='off' model buffer) serves staging of a
    pageable parameter but is dropped, not returned, when a pinned download buffer is asked for."""
    from roundpipe.devices import backend
    from roundpipe.host.attribute import ParamAttribute
    from roundpipe.host.buffers import ParamBuffers

    monkeypatch.setattr(backend, "pin_enabled", lambda: True)
    attr = ParamBuffers(ParamAttribute())
    pageable = torch.empty(3, 4)
    attr.give_spare(pageable)
    assert attr.take_spare(torch.Size([4, 3]), torch.float32, pinned=False) is None  # other shape
    assert attr.take_spare(torch.Size([3, 4]), torch.float64, pinned=False) is None  # other dtype
    assert attr.take_spare(torch.Size([3, 4]), torch.float32, pinned=False) is pageable
    attr.give_spare(pageable)
    assert attr.take_spare(torch.Size([3, 4]), torch.float32, pinned=True) is None
    assert attr.spare == []  # dropped: the caller allocates pinned memory instead
    pinned = torch.empty(3, 4)
    attr.give_spare(pageable)
    attr.spare.append((pinned, True))  # as give_spare records a pinned buffer
    assert attr.take_spare(torch.Size([3, 4]), torch.float32, pinned=True) is pinned  # past the pageable one
    assert attr.spare == []
    attr.give_spare(torch.empty(3, 4))
    attr.give_spare(torch.empty(3, 4))
    attr.trim_spare()
    assert len(attr.spare) == 1


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_optimizer_ctx_and_parameters(workers: str) -> None:
    model = make_model().to(torch.bfloat16)
    rp = RoundPipe(model, optim_dtype=torch.float32)
    with OptimizerCtx():
        inside = list(rp.parameters())
    assert all(p.dtype == torch.float32 for p in inside)
    assert [id(p) for p in inside] == [id(p) for p in rp.optim_parameters()]
    with pytest.warns(UserWarning, match="optim_parameters"):
        list(rp.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in rp.parameters())


class _HostHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = RoundPipe(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)))
        self.scale = nn.Linear(3, 3)  # runs on the host, outside any RoundPipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.body(x))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_auto_roundpipe_steps_all_parameters(workers: str) -> None:
    torch.manual_seed(5)
    inner = _HostHead()
    ref = nn.Sequential(copy.deepcopy(inner.body.model), copy.deepcopy(inner.scale))
    auto = AutoRoundPipe(inner)
    opt = torch.optim.SGD(auto.optim_parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    assert len(list(auto.optim_parameters())) == 6
    for x, y in batches(5):
        loss_fn(auto(x), y).backward()
        auto.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        loss_fn(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    auto.synchronize()
    for p, q in zip(list(inner.body.model.parameters()) + list(inner.scale.parameters()), ref.parameters()):
        assert rel_err(p, q) < 1e-6


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_failing_step_surfaces_and_model_recovers(workers: str) -> None:
    rp = RoundPipe(make_model())
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    x, y = batches(1)[0]

    def bad_step() -> None:
        raise RuntimeError("step exploded")

    rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    rp.step(bad_step)
    with pytest.raises(RuntimeError, match="step exploded"):
        rp.synchronize()
    rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_host_buffers_rotate_and_one_gradient_buffer_waits(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model with fp32 masters and roundpipe.optim.Adam, a slow asynchronous step (the next
    backward's downloads arrive while it still reads the gradient buffers it was handed):

    - staged (the default): downloads take the weights' buffer once a step has staged ahead, two copies
      per parameter (tests/test_grad_into_weights.py has the details);
    - streamed: the download waits for the optimizer to release its one gradient buffer, two copies;
    - a streamed step that keeps its gradients (no zero_grad) still gets its own buffers."""
    import time

    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.optim import Adam

    def run(mode: str, zero_grad: bool = True) -> tuple:
        monkeypatch.setenv("RPP_STEP_MODE", mode)
        model = make_model().to(torch.bfloat16)
        rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        opt = Adam(rp.optim_parameters(), lr=1e-2)

        def step() -> None:
            time.sleep(0.05)  # the next backward's downloads arrive while the step has not read the grads
            opt.step()
            if zero_grad:
                opt.zero_grad()

        most = 0
        for x, y in batches(6):
            rp.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
            rp.step(step, is_async=True)
            most = max([most] + [len(ParamBuffers.of(p).host_buffers(p)) for p in model.parameters()])
        rp.synchronize()
        counts = {len(ParamBuffers.of(p).host_buffers(p)) for p in model.parameters()}
        return max(most, *counts), counts

    most, counts = run("staged")
    assert most == 2 and counts == {2}, (most, counts)
    most, counts = run("streamed")
    assert most == 2 and counts == {2}, (most, counts)
    kept, _ = run("streamed", zero_grad=False)
    assert kept > 2  # no release to wait for: it took another buffer (and did not hang)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("is_async", [True, False])
def test_bf16_gradients_are_handed_to_roundpipe_adam_without_a_copy(workers: str, is_async: bool) -> None:
    """bf16 model, fp32 masters: roundpipe.optim.Adam reads the bf16 host gradient buffers as its .grad
    (no fp32 gradient copy); the run equals the copying path (torch.optim.Adam gets fp32 gradients) and
    each layer keeps at most two gradient buffers, alternating while the asynchronous step reads one."""
    from roundpipe.host.buffers import ParamBuffers
    from roundpipe.optim import Adam

    def run(opt_cls: type, accumulate: bool) -> List[torch.Tensor]:
        model = make_model().to(torch.bfloat16)
        rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
        opt = opt_cls(rp.optim_parameters(), lr=1e-2)
        seen = set()

        def step() -> None:
            seen.update(p.grad.dtype for p in rp.optim_parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad()

        for k, (x, y) in enumerate(batches(6)):
            rp.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
            if accumulate and k % 2 == 0:
                rp.step(lambda: None, is_async=is_async)  # gradients stay in the optimizer's .grad
                continue
            rp.step(step, is_async=is_async)
        rp.synchronize()
        # Handed over as bf16 unless an earlier step left a gradient to accumulate into (then fp32).
        assert seen == ({torch.bfloat16} if opt_cls is Adam and not accumulate else {torch.float32}), seen
        if opt_cls is Adam:
            for p in model.parameters():
                attr = ParamBuffers.of(p)
                assert attr.optim_grad_buffer is None or accumulate  # handed over, never copied to fp32
                assert len(attr.host_buffers(p)) <= (4 if accumulate else 3), len(attr.host_buffers(p))
        return [p.detach().clone() for p in rp.optim_parameters()]

    for accumulate in (False, True):
        handed = run(Adam, accumulate)
        copied = run(torch.optim.Adam, accumulate)
        for a, b in zip(handed, copied):
            assert a.dtype == torch.float32
            assert (a - b).abs().max().item() < 1e-6, accumulate
