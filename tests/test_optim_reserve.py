"""roundpipe.optim.Adam builds its zero state in the background (``preallocate_state``): the first step
takes those tensors instead of allocating, and nothing else changes (torch.optim.Adam's results and
state dicts, lazy state for parameters without a gradient, exact resume)."""

from __future__ import annotations

import copy
import threading
from typing import Dict, List

import pytest
import torch

from roundpipe.host.state_reserve import StateReserve, start_for
from roundpipe.optim import Adam


def _params(seed: int = 0, n: int = 3) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(17 + 5 * i, 9, generator=g, dtype=torch.float64)) for i in range(n)]


def _grads(step: int, params: List[torch.nn.Parameter], skip: int = -1) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _roundpipe_mlp(width: int) -> "tuple":
    """A RoundPipe over a two-layer MLP taking ``width`` features (fp32 optimizer copies, 2 microbatches) and a
    roundpipe Adam on its copies, built but not yet called."""
    from torch import nn

    from roundpipe import RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    rp = RoundPipe(
        nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, 2)),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    return rp, Adam(rp.optim_parameters(), lr=1e-3)


def _run(
    opt: torch.optim.Optimizer, params: List[torch.nn.Parameter], steps: int, no_grad_until: Dict[int, int]
) -> None:
    for s in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(s, params))):
            p.grad = None if s < no_grad_until.get(i, 0) else g.clone()
        opt.step()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_preallocated_state_is_used_and_matches_torch_adam(amsgrad: bool, decoupled: bool) -> None:
    ours_p, ref_p = _params(), _params()
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, decoupled_weight_decay=decoupled)
    ours = Adam(ours_p, **kw)
    ref = torch.optim.Adam(ref_p, **kw)
    reserve = ours._reserve
    assert reserve is not None and not reserve.started  # nothing built before a training call starts it
    start_for(ours_p[:1])  # what RoundPipe's first training call does (any one parameter names the optimizer)
    reserve.wait()
    assert len(reserve) == len(ours_p) and len(ours.state) == 0  # built, not yet visible
    built = {id(p): reserve._ready[id(p)][2]["exp_avg"].data_ptr() for p in ours_p}
    _run(ours, ours_p, 4, {})
    _run(ref, ref_p, 4, {})
    assert ours._reserve is None  # dropped after the first step
    for p in ours_p:
        assert ours.state[p]["exp_avg"].data_ptr() == built[id(p)]  # the prebuilt tensor, not a new one
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    for k, st in ref.state_dict()["state"].items():
        mine = ours.state_dict()["state"][k]
        assert mine.keys() == st.keys()
        for key in st:
            torch.testing.assert_close(mine[key], st[key], rtol=1e-12, atol=1e-14)


def test_parameter_without_gradient_at_the_first_step_gets_its_state_lazily() -> None:
    ours_p, ref_p = _params(1), _params(1)
    ours = Adam(ours_p, lr=1e-2)
    ref = torch.optim.Adam(ref_p, lr=1e-2)
    start_for(ours_p)
    late = {1: 2}  # parameter 1 has no gradient in steps 0 and 1
    _run(ours, ours_p, 1, late)
    assert ours._reserve is None and ours_p[1] not in ours.state  # its prebuilt state was freed
    for s in range(1, 4):
        for i, p in enumerate(ours_p):
            p.grad = None if s < late.get(i, 0) else _grads(s, ours_p)[i].clone()
        ours.step()
    _run(ref, ref_p, 4, late)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours.state[ours_p[1]]["step"], ref.state[ref_p[1]]["step"])


def test_load_state_dict_drops_the_reserve_and_resumes_exactly() -> None:
    p0 = _params(2)
    first = Adam(p0, lr=1e-2)
    _run(first, p0, 3, {})
    saved = copy.deepcopy(first.state_dict())  # the live state keeps changing below
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in p0]
    resumed = Adam(resumed_p, lr=1e-2)
    resumed.load_state_dict(saved)
    assert resumed._reserve is None
    for s in range(3, 5):
        for q, r, g in zip(p0, resumed_p, _grads(s, p0)):
            q.grad, r.grad = g.clone(), g.clone()
        first.step()
        resumed.step()
    for a, b in zip(p0, resumed_p):
        assert torch.equal(a, b)


def test_preallocate_off_and_frozen_parameters_reserve_nothing() -> None:
    ps = _params(3)
    assert Adam(ps, lr=1e-3, preallocate_state=False)._reserve is None
    ps[0].requires_grad_(False)
    opt = Adam(ps, lr=1e-3)
    start_for(ps)
    opt._reserve.wait()
    assert set(opt._reserve._ready) == {id(ps[1]), id(ps[2])}


@pytest.mark.parametrize("state_dtype,master", [("int8", "float32"), ("bfloat16", "bfloat16")])
def test_compact_state_prebuilt_steps_bit_for_bit_as_lazy(state_dtype: str, master: str) -> None:
    dtype = torch.bfloat16 if master == "bfloat16" else torch.float32
    a = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(4)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    kw = dict(lr=1e-2, state_dtype=state_dtype, master=master, block_size=32)
    eager, lazy = Adam(a, **kw), Adam(b, preallocate_state=False, **kw)
    start_for(a + b)  # starts eager's reserve; lazy has none
    assert eager._reserve is not None and eager._reserve.started and lazy._reserve is None
    for s in range(3):
        for x, y, g in zip(a, b, _grads(s, a)):
            gd = torch.bfloat16 if master == "bfloat16" else torch.float32
            x.grad, y.grad = g.to(gd), g.to(gd)
        eager.step()
        lazy.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, b):
        for key, t in lazy.state[y].items():
            assert torch.equal(eager.state[x][key], t), key


def test_reserve_stops_on_allocation_failure_and_the_rest_allocate_lazily() -> None:
    ps = _params(5)
    calls = []

    def make(p: torch.Tensor) -> Dict[str, torch.Tensor]:
        calls.append(p)
        if len(calls) == 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return {"exp_avg": torch.zeros_like(p)}

    reserve = StateReserve("test")
    reserve.add(ps, make)
    reserve.start()
    assert reserve.take(ps[0]) is not None
    assert reserve.take(ps[1]) is None and reserve.take(ps[2]) is None
    assert isinstance(reserve.error, RuntimeError) and len(calls) == 2


def test_take_waits_for_the_builder_and_rejects_a_replaced_parameter() -> None:
    ps = _params(6, n=2)
    gate = threading.Event()

    def make(p: torch.Tensor) -> Dict[str, torch.Tensor]:
        gate.wait(10)
        return {"exp_avg": torch.zeros_like(p)}

    reserve = StateReserve("test")
    reserve.add(ps, make)
    reserve.start()
    threading.Timer(0.05, gate.set).start()
    assert reserve.take(ps[0]) is not None  # waited for the builder, did not see a half-built reserve
    ps[1].data = torch.zeros(3, dtype=ps[1].dtype)  # replaced storage of another shape
    assert reserve.take(ps[1]) is None


def test_resume_builds_nothing_and_a_roundpipe_training_call_starts_the_builder() -> None:
    """A resumed run loads its state before training: nothing is built first (no double peak). A fresh
    run's first RoundPipe training call starts the builder, before the first step."""

    p0 = _params(7)
    first = Adam(p0, lr=1e-2)
    _run(first, p0, 1, {})
    resumed = Adam([torch.nn.Parameter(p.detach().clone()) for p in p0], lr=1e-2)
    reserve = resumed._reserve
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert reserve is not None and not reserve.started and len(reserve) == 0

    rp, opt = _roundpipe_mlp(4)
    assert opt._reserve is not None and not opt._reserve.started
    rp.forward_backward(input_args=(torch.randn(4, 4),), loss_fn=lambda out, _: out.pow(2).mean())
    assert opt._reserve.started
    opt._reserve.wait()
    assert len(opt._reserve) == len(list(rp.optim_parameters()))
    rp.step(lambda: (opt.step(), opt.zero_grad()))
    rp.synchronize()
    assert opt._reserve is None and all(len(opt.state[p]) == 3 for p in rp.optim_parameters())


def test_parameters_stepped_elsewhere_get_no_reserved_state() -> None:
    """A sharded data-parallel step (``roundpipe.distributed.optim_shard``) declares the parameters other
    ranks step: no reserve builds their moments (the memory the sharding saves), and declaring them
    local again lets the next reserve build them."""
    from roundpipe.host.state_reserve import stepped_elsewhere

    params = _params()
    stepped_elsewhere(params[1:])
    try:
        reserve = StateReserve("t")
        reserve.add(params, lambda p: {"m": torch.zeros_like(p)})
        reserve.start()
        reserve.wait()
        assert len(reserve) == 1 and reserve.take(params[0]) is not None and reserve.take(params[1]) is None
    finally:
        stepped_elsewhere(params[1:], elsewhere=False)
    again = StateReserve("t")
    again.add(params, lambda p: {"m": torch.zeros_like(p)})
    again.start()
    again.wait()
    assert len(again) == 3


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"amsgrad": True},
        {"state_dtype": "bfloat16"},
        {"state_dtype": "int8"},
        {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "kahan"},
    ],
    ids=["fp32", "amsgrad", "bf16", "int8", "int8-kahan"],
)
def test_planned_bytes_are_the_bytes_the_builders_allocate(kw: dict) -> None:
    """What a reserve says it will allocate (the host-room check reads it) is what its builders allocate."""
    dtype = torch.bfloat16 if kw.get("master") == "bfloat16" else torch.float32
    params = [torch.nn.Parameter(torch.zeros(n, 33, dtype=dtype)) for n in (1, 7, 130)]
    opt = Adam(params, lr=1e-3, **kw)
    reserve = opt._reserve
    planned = reserve.planned_bytes()
    start_for(params)
    reserve.wait()
    built = sum(
        t.numel() * t.element_size() for _, _, st in reserve._ready.values() for k, t in st.items() if k != "step"
    )
    assert planned == built > 0


def test_first_training_call_refuses_what_the_host_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first training call whose gradient buffers and optimizer state exceed the host's room raises
    MemoryError before allocating them, naming the sizes and the options that shrink the state; the same
    model within its room trains."""
    import psutil

    def run(room_mib: float) -> None:
        rss = psutil.Process().memory_info().rss
        monkeypatch.setenv("RPP_HOST_MEMORY", f"{rss / 2**20 + room_mib}MiB")
        rp, opt = _roundpipe_mlp(512)
        rp.forward_backward(input_args=(torch.randn(4, 512),), loss_fn=lambda out, _: out.pow(2).mean())
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        rp.synchronize()

    # 0.53M parameters: 2.0 MiB of fp32 gradient buffers and 4.0 MiB of moments.
    with pytest.raises(MemoryError, match=r"needs .* GiB more host memory .* of gradient buffers") as err:
        run(1.0)
    assert all(w in str(err.value) for w in ("state_dtype='bfloat16'", "--optim-state", "RPP_HOST_MEMORY")), err.value
    run(4096.0)
