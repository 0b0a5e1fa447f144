"""State-machine test of the host buffers' roles (``roundpipe.host.buffers``).

Random (seeded) orders of training calls (gradient downloads, through ``forward_backward`` or
``forward`` + ``backward``), optimizer steps (asynchronous, synchronous, or keeping the optimizer's
gradients), evaluations (forward without backward) and synchronizations drive a model with a tied weight
through every role transition, under the CPU stress mode (``RPP_DEBUG_STRESS_DELAY_S``: concurrent CPU
workers, every wait delayed at random), in each buffer mode. Checked:

- at every transition, its role conditions (``host_buffers.enable_role_checks``): a download never
  writes the weights, a spare, the staging buffer or a gradient the optimizer holds; a step never
  stages into a download target, a spare or the optimizer's gradient; ...
- at quiescent points, that no host buffer has two owners (``ParamBuffers.check_roles``);
- inside the step function, that no download wrote a gradient while the optimizer read it;
- every loss, evaluation output and the trained parameters against a plain PyTorch reference that
  follows the documented version rules: an asynchronous staged step leaves the next calls on the
  version before it; synchronous and streamed steps, ``synchronize()`` and a call after one that moved
  the weights into the step's buffers (``step_cycle.StepCycle``) read the newest.

The random schedules reach ``stage()`` in a few of its states only, and a wrong role it wrote could pass them
(a buffer both STAGED and SPARE does no harm until both roles are used at once): the cases at the end drive
one parameter through each state of ``stage()`` by hand and compare every buffer's role, and the contents of
STAGED and the weights, with the diagram's.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.host import buffers as host_buffers
from roundpipe.host.buffers import ParamBuffers, RoleError
from roundpipe.planning.plan import ModelExecutePlan

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)

STRESS_S = 0.002
MODES = {  # buffer mode -> environment
    "moved": {"RPP_STEP_MODE": "staged"},  # the default: downloads may take the weights' buffers
    "streamed": {"RPP_STEP_MODE": "streamed"},  # a download waits for the optimizer
}
OPS = ["train", "train", "train_split", "eval", "step_async", "step_async", "step_keep", "step_sync", "sync"]


@pytest.fixture(autouse=True)
def checked_stress() -> Iterator[None]:
    host_buffers.enable_role_checks(True)
    try:
        with settings.overridden(debug_stress_delay_s=STRESS_S):
            yield
    finally:
        host_buffers.enable_role_checks(False)


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)
    )
    model[4].weight = model[2].weight  # tied: layers 2 and 4 share it (2 owns it)
    return model.to(dtype)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()  # sums over rows: the microbatches' losses add up to the batch's


class Reference:
    """Plain PyTorch: float64 masters stepped by SGD, the model-dtype weights each call reads (``seen``),
    the model's accumulated gradients, and a copy of ``StepCycle``'s documented rule (which calls may
    move weights, and so which call must read the newest version)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, into: bool, staging: bool) -> None:
        self.dtype, self.into, self.staging = dtype, into, staging
        self.master = copy.deepcopy(model).double()
        self.net = copy.deepcopy(model)  # the model dtype: computes at ``seen``
        self.opt = torch.optim.SGD(self.master.parameters(), lr=0.02, momentum=0.9)
        self.seen = self._newest()
        self.grads: Optional[List[torch.Tensor]] = None
        self.calls, self.last_calls, self.async_staged, self.moved = 0, None, False, False

    def _newest(self) -> List[torch.Tensor]:
        return [p.detach().to(self.dtype).clone() for p in self.master.parameters()]

    def _begin(self, train: bool) -> None:
        resync, self.moved = self.moved, False
        into = train and self.into and self.async_staged and self.last_calls == 1 and self.calls == 0
        self.calls += train
        self.moved = into
        if resync:
            self.seen = self._newest()

    def _load(self) -> None:
        with torch.no_grad():
            for p, w in zip(self.net.parameters(), self.seen):
                p.copy_(w)
                p.grad = None

    def train(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._begin(True)
        self._load()
        loss = _loss(self.net(x), y)
        loss.backward()
        new = [p.grad.detach().clone() for p in self.net.parameters()]
        self.grads = new if self.grads is None else [a + b for a, b in zip(self.grads, new)]
        return loss.item()

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        self._begin(False)
        self._load()
        with torch.no_grad():
            return self.net(x)

    def step(self, stale: bool, keep: bool) -> None:
        """``stale``: the calls until the next step read the version before this one (an asynchronous
        step, not streamed); ``keep``: the optimizer keeps its gradients (no ``zero_grad``)."""
        self.last_calls, self.calls, self.moved = self.calls, 0, False
        self.async_staged = stale and self.staging
        before = self._newest()
        if self.grads is not None:
            for q, g in zip(self.master.parameters(), self.grads):
                g = g.double()
                q.grad = g if q.grad is None else q.grad + g
        self.grads = None
        self.opt.step()
        if not keep:
            self.opt.zero_grad()
        self.seen = before if stale else self._newest()

    def synchronize(self) -> None:
        self.seen, self.moved = self._newest(), False


def _step_fn(opt: torch.optim.Optimizer, keep: bool, rng: random.Random, torn: List[str]) -> Callable[[], None]:
    """The user's step, on the optimizer thread: the gradients it reads must not change while it reads
    them (a download of the next call into one of them would), which it checks around a random pause."""

    def fn() -> None:
        grads = [(q.grad, q.grad.clone()) for g in opt.param_groups for q in g["params"] if q.grad is not None]
        time.sleep(rng.uniform(0.0, 0.01))  # the next call's downloads arrive meanwhile
        opt.step()
        torn.extend("a gradient changed while the optimizer read it" for g, b in grads if not torch.equal(g, b))
        if not keep:
            opt.zero_grad()

    return fn


def _check_roles(rp: RoundPipe) -> None:
    for p in rp.model.parameters():
        ParamBuffers.of(p).check_roles(p)


def _run(mode: str, dtype: torch.dtype, plan_kind: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """One random schedule of ``mode``; returns how many operations ran."""
    for name, value in MODES[mode].items():
        monkeypatch.setenv(name, value)
    rng = random.Random(seed)
    model = _model(dtype)
    ref = Reference(model, dtype, into=mode == "moved", staging=mode == "moved")
    n = len(model)
    plan = (
        ModelExecutePlan.layerwise(n, "train") if plan_kind == "layerwise" else ModelExecutePlan([range(n)], [range(n)])
    )
    rp = RoundPipe(
        model,
        optim_dtype=torch.float64,
        model_run_config=RoundPipeRunConfig(num_microbatch=rng.choice([1, 2, 3]), execute_plan=plan),
    )
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.02, momentum=0.9)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torn: List[str] = []
    gen = torch.Generator().manual_seed(seed)
    ops = ["train"] + [rng.choice(OPS) for _ in range(14)] + ["step_async", "train", "step_async"]
    for op in ops:
        x, y = torch.randn(6, 6, generator=gen).to(dtype), torch.randn(6, 4, generator=gen).to(dtype)
        if op == "train":
            got = rp.forward_backward(input_args=(x,), label=y, loss_fn=_loss).item()
            assert abs(got - ref.train(x, y)) <= tol * max(1.0, abs(got)), (op, ops)
        elif op == "train_split":
            loss = _loss(rp(x), y)
            loss.backward()
            assert abs(loss.item() - ref.train(x, y)) <= tol * max(1.0, abs(loss.item())), (op, ops)
        elif op == "eval":
            with torch.no_grad():
                out = rp(x)
            assert rel_err(out, ref.evaluate(x)) <= tol, (op, ops)
        elif op == "sync":
            rp.synchronize()
            ref.synchronize()
            _check_roles(rp)
        else:
            is_async, keep = op != "step_sync", op == "step_keep"
            rp.step(_step_fn(opt, keep, rng, torn), is_async=is_async)
            ref.step(is_async and mode != "streamed", keep)
            if not is_async or mode == "streamed":
                rp.wait_optimizer()
                _check_roles(rp)
    rp.synchronize()
    ref.synchronize()
    _check_roles(rp)
    assert not torn, torn
    for q, r in zip(rp.optim_parameters(), ref.master.parameters()):
        assert rel_err(q, r) <= tol, (ops, rel_err(q, r))
    for p, r in zip(rp.model.parameters(), ref.master.parameters()):
        assert rel_err(p, r.to(dtype)) <= tol, ops
    return len(ops)


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_keep_the_roles_and_train_as_pytorch(
    workers: str, mode: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan_kind = "layerwise" if seed % 2 == 0 else "one-group"
    _run(mode, torch.float64, plan_kind, seed + 10 * len(workers) + 100 * list(MODES).index(mode), monkeypatch)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("mode", list(MODES))
def test_copied_gradients_keep_the_roles(workers: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model with float64 optimizer copies: the gradient is copied into the optimizer's dtype
    and its buffer becomes the staging buffer at once (no HELD role)."""
    _run(mode, torch.float32, "layerwise", 7, monkeypatch)


def test_the_role_checks_catch_two_owners() -> None:
    """The checks themselves: a buffer both spare and the weights, or a download into the optimizer's
    gradient, is reported."""
    from roundpipe.host.attribute import ParamAttribute

    p = nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))
    attr = ParamAttribute.set(p, 0)
    attr.optim = nn.Parameter(p.detach().clone())
    bufs = ParamBuffers.of(p)
    bufs.check_roles(p)
    bufs.give_spare(p.data)
    with pytest.raises(RoleError, match="WEIGHTS and SPARE"):
        bufs.check_roles(p)
    bufs.take_spare(p.shape, p.dtype, pinned=False)
    g = torch.zeros(3, 3, dtype=torch.float64)
    attr.optim.grad = g
    bufs.give_spare(g)  # wrongly: the optimizer still reads it
    with pytest.raises(RoleError, match="download: the GRAD buffer is also SPARE|is also optimizer .grad"):
        bufs.download_target(p, 0, torch.zeros(3, 3, dtype=torch.float64))


def test_the_state_machine_runs_every_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schedules above go through every role transition (so their checks are not vacuous)."""
    called: set = set()
    names = ["download_target", "move_weights", "hand_over", "choose_staging", "stage", "publish", "fold_shares"]
    names += ["release_after_step", "take_share", "_keep_grad_apart", "_wait_for_release"]
    lock = threading.Lock()
    for name in names:
        real = getattr(ParamBuffers, name)

        def spy(*a: object, _real: Callable[..., object] = real, _name: str = name, **k: object) -> object:
            with lock:
                called.add(_name)
            return _real(*a, **k)

        monkeypatch.setattr(ParamBuffers, name, staticmethod(spy) if name == "_wait_for_release" else spy)
    from roundpipe.devices import device

    for spec, mode in (("cpu:1", "moved"), ("cpu:2", "streamed"), ("cpu:2", "moved")):
        settings.configure(devices=spec)
        try:
            for seed in range(2):
                _run(mode, torch.float64, "layerwise", seed, monkeypatch)
        finally:
            settings.unconfigure(settings.DEVICES.name)
            device.reset_devices()
    assert called == set(names), set(names) - called


# ---------------------------------------------------------------------------------------------------------
# stage(), transition by transition: one parameter driven by hand in the step kernel's order
# ---------------------------------------------------------------------------------------------------------


class _Walk:
    """One float64 parameter and its optimizer copy (float64, or float32 ``optim_dtype``: its gradients are
    copied), driven through the diagram of ``roundpipe.host.buffers`` by hand, in the order of the step
    kernel (``roundpipe.host.step``): no threads, so each role after each transition is exact."""

    def __init__(self, optim_dtype: torch.dtype = torch.float64) -> None:
        from roundpipe.host.attribute import ParamAttribute

        self.p = nn.Parameter(torch.arange(9.0, dtype=torch.float64).reshape(3, 3))
        ParamAttribute.set(self.p, 0).optim = nn.Parameter(self.p.detach().to(optim_dtype).clone())
        self.bufs = ParamBuffers.of(self.p)
        self.optim = self.bufs.optim
        self.w0 = self.p.data  # the first weights buffer

    def download(self, value: float, into_weights: bool = False) -> torch.Tensor:
        """(1): a call's gradient of the layer lands in the buffer the device thread is given."""
        dev = torch.full((3, 3), value, dtype=torch.float64)
        buf = self.bufs.download_target(self.p, 0, dev, into_weights)
        buf.copy_(dev)
        self.bufs.download_issued(self.p, 0, buf)
        return buf

    def begin_step(self, staged: bool = True) -> None:
        """An asynchronous step (``staged``: publish the last one's version, hand the gradient over as the
        next staging buffer) or a synchronous one (hand over only)."""
        if staged:
            self.bufs.publish(self.p, use_staged=True, downloads_into_weights=True)
        self.bufs.hand_over(self.p, stage_into_grad=staged, low_precision_ok=False)

    def optimizer(self, zero_grad: bool = True) -> torch.Tensor:
        """The step function: SGD with lr 1 on the optimizer copy; returns the new version (model dtype)."""
        with torch.no_grad():
            if self.optim.grad is not None:
                self.optim.sub_(self.optim.grad)
            else:
                self.optim.mul_(0.5)  # a step without a gradient still moves the weights (weight decay)
        if zero_grad:
            self.optim.grad = None
        return self.optim.detach().to(torch.float64).clone()

    def roles(self, **named: torch.Tensor) -> Dict[str, List[str]]:
        """Each role's buffers, named by ``named`` (``name=buffer``; another buffer is ``new``)."""
        out: Dict[str, List[str]] = {}
        for role, t in self.bufs.roles(self.p):
            name = next((n for n, b in named.items() if host_buffers.same_storage(t, b)), "new")
            out.setdefault(role, []).append(name)
        return {role: sorted(names) for role, names in out.items()}

    def staged_buffer(self) -> torch.Tensor:
        """The one STAGED buffer (the role table, not an attribute)."""
        staged = [t for role, t in self.bufs.roles(self.p) if role == "STAGED"]
        assert len(staged) == 1, f"STAGED buffers after stage(): {len(staged)}"
        return staged[0]


def _staged_version(w: _Walk, new: torch.Tensor, old: torch.Tensor) -> None:
    """After ``stage()``: no buffer has two owners, STAGED holds the optimizer's new version and the weights,
    which the running call's uploads still read, the one before."""
    w.bufs.check_roles(w.p)
    assert torch.equal(w.staged_buffer(), new)
    assert torch.equal(w.p.data, old)


def test_stage_writes_the_new_version_into_the_handed_over_gradient() -> None:
    """(2) then (3): the gradient buffer the optimizer read becomes STAGED, the weights stay; the next publish
    swaps it in and the old weights become the spare."""
    w = _Walk()
    old = w.p.detach().clone()
    g1 = w.download(1.0)
    w.begin_step()
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "HELD": ["g1", "g1"], "STAGED": ["g1"]}
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "STAGED": ["g1"]}
    _staged_version(w, new, old)
    w.bufs.publish(w.p, use_staged=True, downloads_into_weights=True)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["g1"], "SPARE": ["w0"]}
    assert torch.equal(w.p.data, new)


def test_stage_writes_into_the_weights_a_download_moved_there() -> None:
    """A download of the next call during the step moves the staging buffer into the weights (staged mode)
    and takes the old weights: the step then writes its version into the weights, nothing is STAGED, and
    the gradient that landed meanwhile stays GRAD."""
    w = _Walk()
    g1 = w.download(1.0)
    w.begin_step()
    g2 = w.download(2.0, into_weights=True)
    assert host_buffers.same_storage(g2, w.w0) and host_buffers.same_storage(w.p.data, g1)
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["g1"], "GRAD": ["w0"]}
    w.bufs.check_roles(w.p)
    assert torch.equal(w.p.data, new) and torch.equal(g2, torch.full((3, 3), 2.0, dtype=torch.float64))


def test_stage_leaves_a_download_that_landed_during_the_step() -> None:
    """A download of the next call during the step that does not take the weights gets a buffer of its own;
    the step stages into the gradient it read, not into that one."""
    w = _Walk()
    old = w.p.detach().clone()
    g1 = w.download(1.0)
    w.begin_step()
    g2 = w.download(2.0)
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1, g2=g2) == {"WEIGHTS": ["w0"], "STAGED": ["g1"], "GRAD": ["g2"]}
    _staged_version(w, new, old)
    assert torch.equal(g2, torch.full((3, 3), 2.0, dtype=torch.float64))


def test_stage_moves_a_gradient_the_optimizer_keeps_out_of_the_staging_buffer() -> None:
    """An optimizer without ``zero_grad`` still reads the handed-over buffer as its ``.grad``: the step gives
    that gradient a tensor of its own (HELD) before it writes the new version into the buffer (STAGED)."""
    w = _Walk()
    old = w.p.detach().clone()
    g1 = w.download(1.0)
    w.begin_step()
    new = w.optimizer(zero_grad=False)
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "HELD": ["new"], "STAGED": ["g1"]}
    _staged_version(w, new, old)
    assert torch.equal(w.optim.grad, torch.ones(3, 3, dtype=torch.float64))


def test_stage_without_a_gradient_takes_the_spare() -> None:
    """A step with no gradient handed over (nothing STAGED after the publish) stages into the spare the
    publish left: the spare becomes STAGED, not both."""
    w = _Walk()
    g1 = w.download(1.0)
    w.begin_step()
    w.optimizer()
    w.bufs.stage(w.p)
    w.begin_step()
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["g1"], "SPARE": ["w0"]}
    old = w.p.detach().clone()
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["g1"], "STAGED": ["w0"]}
    _staged_version(w, new, old)


def _after_a_synchronous_step_that_keeps_its_gradient(w: _Walk) -> torch.Tensor:
    """A synchronous step whose optimizer keeps the handed-over buffer as its ``.grad`` (HELD after the step)."""
    g1 = w.download(1.0)
    w.begin_step(staged=False)
    w.optimizer(zero_grad=False)
    w.bufs.release_after_step()
    w.bufs.publish(w.p, use_staged=False)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "HELD": ["g1", "g1"]}
    return g1


def test_stage_takes_the_buffer_the_optimizer_let_go_of() -> None:
    """After a synchronous step that kept its gradient, an asynchronous step with no new gradient lets go of
    it (``zero_grad``): that buffer becomes STAGED, and only STAGED."""
    w = _Walk()
    g1 = _after_a_synchronous_step_that_keeps_its_gradient(w)
    w.begin_step()
    old = w.p.detach().clone()
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "STAGED": ["g1"]}
    _staged_version(w, new, old)


def test_stage_gives_the_released_gradient_back_as_a_spare() -> None:
    """After a synchronous step that kept its gradient, a call's gradient is added into the optimizer's and
    its buffer becomes STAGED; once the optimizer lets go, the kept buffer becomes the spare."""
    w = _Walk()
    g1 = _after_a_synchronous_step_that_keeps_its_gradient(w)
    g2 = w.download(2.0)
    w.begin_step()
    old = w.p.detach().clone()
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1, g2=g2) == {"WEIGHTS": ["w0"], "STAGED": ["g2"], "SPARE": ["g1"]}
    _staged_version(w, new, old)


def test_stage_of_copied_gradients_writes_the_staging_buffer_only() -> None:
    """A float32 optimizer copy: the gradient is copied into its dtype (its own HELD tensor) and the buffer
    becomes STAGED at the hand-over; the step writes the new version there and lets go of the copy."""
    w = _Walk(optim_dtype=torch.float32)
    old = w.p.detach().clone()
    g1 = w.download(1.0)
    w.begin_step()
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "HELD": ["new"], "STAGED": ["g1"]}
    new = w.optimizer()
    w.bufs.stage(w.p)
    assert w.roles(w0=w.w0, g1=g1) == {"WEIGHTS": ["w0"], "STAGED": ["g1"]}
    _staged_version(w, new, old)
