"""Core runtime: RoundPipe over a layer list equals plain PyTorch, on 1-3 CPU workers (and CUDA)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from conftest import WORKER_SPECS
from helpers import DropoutRecorder, rel_err, with_recorded_dropout
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.devices.threads import RoundPipeWorkerError
from roundpipe.runtime.batch import RoundPipePackedData
from roundpipe.runtime.run_config import ResolvedRunConfig

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def make_model(dtype: torch.dtype, dropout: float = 0.3) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(16, 16, bias=False),  # a bias before BatchNorm has an identically zero gradient
        nn.BatchNorm1d(16),
        nn.Dropout(dropout),
        nn.Linear(16, 5),
    ).to(dtype)


def reference_run(ref: nn.Module, x: torch.Tensor, n_mb: int):
    """Plain PyTorch on the same microbatches (BatchNorm sees microbatch statistics, as in a pipeline)."""
    return torch.cat([ref(part) for part in torch.tensor_split(x, n_mb)])


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def check_grads(model: nn.Module, ref: nn.Module, tol: float) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        assert rel_err(p.grad, q.grad) < tol, (name, rel_err(p.grad, q.grad))
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert rel_err(b, c) < tol, name


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_pytorch(workers: str, num_microbatch: int, grain: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = make_model(dtype)
    recorder = DropoutRecorder(model)
    ref = with_recorded_dropout(model, recorder)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain))
    x = torch.randn(10, 8, dtype=dtype, requires_grad=True)  # 10 is not divisible by 3 or 4
    x_ref = x.detach().clone().requires_grad_(True)
    w = torch.randn(10, 5, dtype=dtype)

    out = rp(x)
    (out * w).sum().backward()
    out_ref = reference_run(ref, x_ref, num_microbatch)
    (out_ref * w).sum().backward()

    tol = TOL[dtype]
    assert rel_err(out, out_ref) < tol
    assert rel_err(x.grad, x_ref.grad) < tol
    check_grads(model, ref, tol)


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_forward_backward_equals_forward_then_backward(workers: str) -> None:
    torch.manual_seed(1)
    base = make_model(torch.float64, dropout=0.0)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cfg = RoundPipeRunConfig(num_microbatch=3)
    rp_a, rp_b = RoundPipe(a, model_run_config=cfg), RoundPipe(b, model_run_config=cfg)
    for _ in range(2):  # two calls: gradients accumulate as in PyTorch
        x = torch.randn(9, 8, dtype=torch.float64)
        y = torch.randn(9, 5, dtype=torch.float64)
        loss_fn = lambda out, label: ((out - label) ** 2).sum()  # noqa: E731
        loss = rp_a.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        out = rp_b(x)
        loss_b = loss_fn(out, y)
        loss_b.backward()
        assert rel_err(loss, loss_b) < 1e-12
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert rel_err(p.grad, q.grad) < 1e-10, n


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_forward_backward_returns_outputs_and_input_grads(workers: str) -> None:
    torch.manual_seed(2)
    model = make_model(torch.float64, dropout=0.0)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    pre = nn.Linear(4, 8).double()  # a user module before RoundPipe gets its gradients
    pre_ref = copy.deepcopy(pre)
    x = torch.randn(7, 4, dtype=torch.float64)
    loss, out = rp.forward_backward(
        input_args=(pre(x),),
        loss_fn=lambda o, _: o.pow(2).sum(),
        return_outputs=True,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    out_ref = reference_run(ref, pre_ref(x), 3)
    out_ref.pow(2).sum().backward()  # (a plain sum through BatchNorm has an identically zero input gradient)
    assert rel_err(out, out_ref) < 1e-10
    assert rel_err(loss, out_ref.pow(2).sum()) < 1e-10
    assert rel_err(pre.weight.grad, pre_ref.weight.grad) < 1e-10


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
@pytest.mark.parametrize("fused", [False, True])
def test_chained_models_equal_one_model(workers: str, fused: bool) -> None:
    torch.manual_seed(3)
    full = make_model(torch.float64, dropout=0.0)
    ref = copy.deepcopy(full)
    first = RoundPipe(nn.Sequential(*list(full)[:4]), model_run_config=RoundPipeRunConfig(merge_output=False))
    second = RoundPipe(nn.Sequential(*list(full)[4:]))
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    cfg = RoundPipeRunConfig(num_microbatch=4)
    mid = first(x, roundpipe_run_config=cfg)
    assert isinstance(mid, RoundPipePackedData) and len(mid) == 4
    if fused:
        second.forward_backward(input_args=(mid,), loss_fn=lambda o, _: o.pow(2).sum())
    else:
        second(mid).pow(2).sum().backward()
    reference_run(ref, x_ref, 4).pow(2).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 1e-10
    for (n, p), (_, q) in zip(full.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) < 1e-10, n


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_inference_no_grad(workers: str) -> None:
    torch.manual_seed(4)
    model = make_model(torch.float32).eval()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    x = torch.randn(11, 8)
    with torch.no_grad():
        out = rp(x)
        out_ref = ref(x)
    assert not out.requires_grad
    assert rel_err(out, out_ref) < 1e-6


class _Head(nn.Module):
    """Takes kwargs and emits a nested pytree with non-tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x, *, scale: float, extra: dict):
        return {"h": self.lin(x) * scale, "pair": (extra["bias"], extra["tag"]), "n": 3, "ids": extra["ids"]}


class _Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2).double()

    def forward(self, d: dict):
        bias, tag = d["pair"]
        assert tag == "keep" and d["n"] == 3 and d["ids"].dtype == torch.long
        return (self.lin(d["h"] + bias), d["ids"] * 2)


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
def test_pytrees_kwargs_and_non_tensors_pass_through(workers: str) -> None:
    torch.manual_seed(5)
    head, tail = _Head(), _Tail()
    ref = nn.Sequential(copy.deepcopy(head), copy.deepcopy(tail))
    rp = RoundPipe(nn.Sequential(head, tail), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(6, 4, dtype=torch.float64)
    bias = torch.randn(6, 4, dtype=torch.float64)
    ids = torch.arange(6)
    out, ids2 = rp(x, scale=2.0, extra={"bias": bias, "tag": "keep", "ids": ids})
    h_ref = ref[0](x, scale=2.0, extra={"bias": bias, "tag": "keep", "ids": ids})
    out_ref, _ = ref[1](h_ref)
    assert torch.equal(ids2, ids * 2)
    assert rel_err(out, out_ref) < 1e-12
    out.sum().backward()
    out_ref.sum().backward()
    assert rel_err(head.lin.weight.grad, ref[0].lin.weight.grad) < 1e-10


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.fail:
            raise ValueError("injected failure")
        return g, None


class _MaybeFail(nn.Module):
    """Raises in ``phase`` ('forward', 'recompute' or 'backward') for the microbatch whose first row
    id equals ``fail_row``."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_row = -1
        self.phase = "backward"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from roundpipe import doing_recompute

        hit = int(x[0, 0].item()) == self.fail_row
        if hit and self.phase == ("recompute" if doing_recompute() else "forward"):
            raise ValueError("injected failure")
        return _FailingBackward.apply(x, hit and self.phase == "backward")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
@pytest.mark.parametrize("phase", ["forward", "recompute", "backward"])
def test_exception_surfaces_with_location(workers: str, phase: str) -> None:
    torch.manual_seed(6)
    bomb = _MaybeFail()
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 3).double(), bomb, nn.Linear(3, 3).double())
    # One layer per group, so that backward errors name exactly layer 2 (a group's backward names its range).
    plan = ModelExecutePlan.layerwise(4, "train")
    rp = RoundPipe(model, name="bomb-model", model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan))
    x = torch.cat([torch.arange(9, dtype=torch.float64)[:, None], torch.randn(9, 2, dtype=torch.float64)], dim=1)
    # Rows 0-2, 3-5, 6-8 form microbatches 0, 1, 2; fail in microbatch 1. Layer 1 is Linear: keep the
    # row id column intact by failing on the identity-fed input of layer 2 instead.
    model[1].weight.data = torch.eye(3, dtype=torch.float64)
    model[1].bias.data.zero_()
    bomb.fail_row, bomb.phase = 3, phase
    start = time.monotonic()
    with pytest.raises(RoundPipeWorkerError) as info:
        rp(x).sum().backward()
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert f"{phase} of layer 2" in msg and "microbatch 1" in msg and "device" in msg and "injected failure" in msg, msg
    bomb.fail_row = -1
    out = rp(x)
    out.sum().backward()  # the same model works after the failure
    assert model[3].weight.grad is not None


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_double_backward_raises(workers: str) -> None:
    rp = RoundPipe(make_model(torch.float32, dropout=0.0))
    out = rp(torch.randn(6, 8)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def _grouped_plan_model(grain: str):
    """(model, its reference with recorded dropout, RoundPipe) with forward and backward groups cut at
    different layers: recompute spans forward groups, and stage inputs sit at group starts and inside."""
    torch.manual_seed(7)
    model = make_model(torch.float64)
    ref = with_recorded_dropout(model, DropoutRecorder(model))
    plan = ModelExecutePlan([range(0, 3), range(3, 6), range(6, 8)], [range(0, 2), range(2, 5), range(5, 8)])
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(execute_plan=plan, recompute_grain=grain, num_microbatch=3)
    )
    return model, ref, rp


def _step_both(rp: RoundPipe, ref: nn.Module) -> None:
    """One forward + backward of RoundPipe and of the reference on the same random batch (3
    microbatches); the input gradients must agree."""
    x = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    rp(x).pow(2).sum().backward()
    reference_run(ref, x_ref, 3).pow(2).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 1e-10


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_grouped_plan_matches_layerwise(workers: str, grain: str) -> None:
    model, ref, rp = _grouped_plan_model(grain)
    _step_both(rp, ref)
    check_grads(model, ref, 1e-10)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_attribute_shimming(workers: str) -> None:
    inner = nn.Sequential(nn.Linear(2, 2))
    inner.config = {"hidden": 2}
    rp = RoundPipe(inner)
    assert rp.config == {"hidden": 2}
    rp.config = {"hidden": 3}
    assert inner.config == {"hidden": 3}
    original = nn.Module()
    original.generation_config = "gen"
    rp.set_original_model(original)
    assert rp.generation_config == "gen"
    del rp.config
    assert not hasattr(inner, "config")
    with pytest.raises(AttributeError):
        _ = rp.does_not_exist


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_auto_plan_equals_layerwise_plan(workers: str) -> None:
    """Auto plans (from size estimates, then re-planned from measured timings) give the results of the
    one-layer-per-group plan."""
    torch.manual_seed(8)
    base = make_model(torch.float64, dropout=0.0)
    auto_model, layer_model = copy.deepcopy(base), copy.deepcopy(base)
    auto = RoundPipe(auto_model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    layerwise = ModelExecutePlan.layerwise(8, "train")
    manual = RoundPipe(layer_model, model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=layerwise))
    plans = set()
    for step in range(4):
        x = torch.randn(9, 8, dtype=torch.float64)
        for rp, _m in ((auto, auto_model), (manual, layer_model)):
            rp.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.pow(2).sum())
        plans.add(repr(auto.resolve_plan(ResolvedRunConfig(RoundPipeRunConfig(), auto.model_run_config), "fused")))
        for (n, p), (_, q) in zip(auto_model.named_parameters(), layer_model.named_parameters()):
            assert rel_err(p.grad, q.grad) < 1e-10, (step, n)
    assert auto.model_timer.has_measurements("fused")
    assert all("groups" in p for p in plans)


class _Scaled(nn.Module):
    """Computes a per-call scale once in forward and reuses it in recompute via save_for_recompute."""

    def __init__(self, counter: dict) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.counter = counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from roundpipe import doing_recompute, get_recompute_data, save_for_recompute

        if doing_recompute():
            (scale,) = get_recompute_data()
        else:
            self.counter["computed"] += 1
            scale = x.detach().abs().mean() + 1
            save_for_recompute(scale)
        return self.lin(x) * scale


@pytest.mark.parametrize("workers", WORKER_SPECS, indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_reuses_saved_data(workers: str, grain: str) -> None:
    torch.manual_seed(9)
    counter = {"computed": 0}
    model = nn.Sequential(_Scaled(counter), nn.Tanh(), _Scaled(counter))
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain))
    x = torch.randn(4, 4, dtype=torch.float64)
    rp(x).pow(2).sum().backward()
    assert counter["computed"] == 4  # 2 layers x 2 microbatches, never again in recompute
    reference_run(ref, x, 2).pow(2).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) < 1e-10, n


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("budget_gib", ["0", str(1000 / 2**30), "1"])
def test_stage_inputs_kept_on_the_device_change_nothing(
    workers: str, grain: str, budget_gib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RPP_DEBUG_DEVICE_SAVED_GB keeps backward-stage inputs on the device (one device only) up to a budget:
    results equal plain PyTorch whether all, some (1000 bytes: two 384-byte microbatch inputs per call)
    or none stay, over two calls (each call has the budget)."""
    from roundpipe.runtime import run as run_mod

    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", budget_gib)
    kept = []
    real_keep = run_mod.Run.keep_on_device
    monkeypatch.setattr(
        run_mod.Run, "keep_on_device", lambda self, leaves: (lambda r: (kept.append(r), r)[1])(real_keep(self, leaves))
    )
    model, ref, rp = _grouped_plan_model(grain)
    for _ in range(2):
        _step_both(rp, ref)
    check_grads(model, ref, 1e-10)
    # Stage inputs of layers 2 and 5, 3 microbatches, 2 calls: 12 candidates.
    expected = {"0": 0, "1": 12}.get(budget_gib, 4) if workers == "cpu:1" else 0
    assert sum(kept) == expected


def test_device_saved_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("-1", "lots", "inf"):
        monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", bad)
        with pytest.raises(ValueError, match="RPP_DEBUG_DEVICE_SAVED_GB"):
            RoundPipe(make_model(torch.float32))


def _train_both(rp: RoundPipe, ref: nn.Module, fused: bool, rows: int, num_microbatch: int) -> None:
    """Two calls of a squared-error loss over ``rows`` random rows (8 in, 5 out), through
    forward_backward (``fused``) or forward + loss.backward(), and the reference per microbatch; the
    losses must agree. Gradients accumulate in both models."""
    loss_fn = lambda out, label: ((out - label) ** 2).sum()  # noqa: E731
    for _ in range(2):
        x, y = torch.randn(rows, 8, dtype=torch.float64), torch.randn(rows, 5, dtype=torch.float64)
        if fused:
            loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        else:
            loss = loss_fn(rp(x), y)
            loss.backward()
        ref_loss = sum(
            loss_fn(ref(a), b)
            for a, b in zip(torch.tensor_split(x, num_microbatch), torch.tensor_split(y, num_microbatch))
        )
        ref_loss.backward()
        assert rel_err(loss, ref_loss) < 1e-12


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 5])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("split", ["1", "0"])
@pytest.mark.parametrize("fused", [True, False])
def test_split_fused_job_equals_pytorch(
    workers: str, num_microbatch: int, grain: str, split: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On several devices the last backward group (here two layers: the fused job of forward_backward,
    or the first backward job of forward + loss.backward()) runs in parts, one per device and microbatch
    share; the gradients the parts meet in equal plain PyTorch, accumulated over two calls."""
    from roundpipe.runtime.partial_grads import PartialGrads

    monkeypatch.setenv("RPP_DEBUG_SPLIT_FUSED", split)
    published = set()
    real_publish = PartialGrads.publish

    def publish(self: PartialGrads, part: int, *args: object) -> None:
        published.add(part)
        real_publish(self, part, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PartialGrads, "publish", publish)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 5)])
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan),
    )
    _train_both(rp, ref, fused, rows=10, num_microbatch=num_microbatch)
    check_grads(model, ref, 1e-10)
    devices = int(workers.split(":")[1])
    want = set(range(1, min(devices, num_microbatch))) if split == "1" else set()
    assert published == want


@pytest.mark.parametrize("workers", ["cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("room", [1.0, 0.0])
@pytest.mark.parametrize("fused", [True, False])
def test_split_group_shares_go_to_part_0_as_peer_copies(
    workers: str, room: float, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RPP_DEBUG_PEER_HANDOFF=1: the other parts of a split last group copy their gradients to part 0's device
    (no host buffer), while they take at most ``PEER_SHARE_FRACTION`` of its room (0 here: through the
    host); either way the sums equal plain PyTorch's, over two calls, under the stress mode."""
    from roundpipe import settings
    from roundpipe.runtime import partial_grads

    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "1")
    monkeypatch.setattr(partial_grads, "PEER_SHARE_FRACTION", room)
    ways: list = []
    real_target = partial_grads.PartialGrads._peer_target

    def peer_target(self: partial_grads.PartialGrads, device: object, nbytes: int) -> object:
        target = real_target(self, device, nbytes)
        if nbytes:  # a layer with gradients (the Tanh has none)
            ways.append(target is not None)
        return target

    monkeypatch.setattr(partial_grads.PartialGrads, "_peer_target", peer_target)
    with settings.overridden(debug_stress_delay_s=0.001, debug_split_fused="1"):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5)).double()
        ref = copy.deepcopy(model)
        plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 2), range(2, 3), range(3, 5)])
        rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan))
        _train_both(rp, ref, fused, rows=12, num_microbatch=4)
    check_grads(model, ref, 1e-10)
    assert ways and all(way == (room > 0) for way in ways)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("fused", [True, False])
def test_peer_handoff_equals_pytorch(workers: str, grain: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_DEBUG_PEER_HANDOFF=1: a forward job's output, and a backward job's input gradients, go to the next
    job's device directly when that job runs on another device (no host copy unless it is a backward
    stage's input). Results equal plain
    PyTorch over two calls, through forward_backward and forward + loss.backward(); with several devices
    the copies happened."""
    from roundpipe.runtime import jobs

    monkeypatch.setenv("RPP_DEBUG_PEER_HANDOFF", "1")
    copies = []
    real_copy = jobs.peer_copy
    monkeypatch.setattr(
        jobs, "peer_copy", lambda src, dst, leaves: (copies.append((src.id, dst.id)), real_copy(src, dst, leaves))[1]
    )
    model, ref, rp = _grouped_plan_model(grain)
    _train_both(rp, ref, fused, rows=9, num_microbatch=3)
    check_grads(model, ref, 1e-10)
    assert all(src != dst for src, dst in copies)
    assert bool(copies) == (workers != "cpu:1")


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_split_auto_splits_only_where_devices_compute_at_once(workers: str) -> None:
    """``RPP_DEBUG_SPLIT_FUSED=auto`` (the default): CPU workers compute one at a time, so the fused job stays
    whole; in the stress mode they compute at once, as GPUs do, and it is split; 1 and 0 force."""
    from roundpipe import settings
    from roundpipe.planning.fused_split import split_enabled

    assert not split_enabled()
    with settings.overridden(debug_stress_delay_s=0.001):
        assert split_enabled()
    with settings.overridden(debug_split_fused="1"):
        assert split_enabled()
    with settings.overridden(debug_split_fused="0", debug_stress_delay_s=0.001):
        assert not split_enabled()


def test_split_parts_rule() -> None:
    from roundpipe.planning.fused_split import split_parts

    assert split_parts(1, 4, False, True) == 1
    assert split_parts(2, 4, False, True) == 2
    assert split_parts(3, 2, False, True) == 2  # at most one part per microbatch
    assert split_parts(2, 4, True, True) == 1  # buffers (running statistics) keep the job whole
    assert split_parts(2, 4, False, False) == 1
