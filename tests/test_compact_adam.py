"""The compact state of roundpipe.optim.Adam: bf16 / int8 moments and bf16 masters.

Error bounds (see roundpipe/optim/quant.py and docs/optimizer.md):

* one step from a state rounded to bf16: the update's relative error is at most
  ``beta1 |m_old| / |m_new| * 2^-8 + beta2 v_old / v_new * 2^-9`` (the stored moments are within half a
  bf16 ulp: 2^-8 relative, the bf16 unit roundoff; sqrt halves it) to first order, plus fp32 rounding;
* int8: each stored moment is within one companded code step of its value (``quant``'s bounds), and
  the update stays inside the interval those bounds give;
* stochastic rounding: unbiased (the mean over elements and seeds within 0.02 bf16 ulp of the exact
  value) and a pure function of (seed, step, parameter, element);
* the C++ kernel and the torch fallback agree bit for bit.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterator, List, Tuple

import pytest
import torch
from conftest import WORKER_SPECS
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.optim import Adam, compact, quant
from roundpipe.optim import build as optim_builder

MODES: List[Tuple[str, str, str]] = [
    ("bfloat16", "float32", "nearest"),
    ("int8", "float32", "nearest"),
    ("float32", "bfloat16", "stochastic"),
    ("bfloat16", "bfloat16", "kahan"),
    ("int8", "bfloat16", "stochastic"),
    ("int8", "bfloat16", "kahan"),
    ("int8", "bfloat16", "nearest"),
]
# Host bytes per parameter (master + optimizer state) that docs/optimizer.md states, block_size 256.
DOC_BYTES = {("bfloat16", "float32"): 8.0, ("int8", "float32"): 6.04, ("float32", "bfloat16"): 10.0}
DOC_BYTES.update({("bfloat16", "bfloat16"): 6.0, ("int8", "bfloat16"): 4.04})


def _kernel_available() -> bool:
    try:
        optim_builder.get_optim_function("compact_adam")
        return True
    except optim_builder.OptimBuildError:
        return False


@pytest.fixture(params=["cpp", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "cpp" and not _kernel_available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, request.param)
    yield request.param


def _dtype(master: str) -> torch.dtype:
    return torch.bfloat16 if master == "bfloat16" else torch.float32


def _params(master: str, shapes: Tuple[Tuple[int, ...], ...] = ((37, 29), (300,), (5,))) -> List[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g).to(_dtype(master))) for s in shapes]


def _run(opt: Adam, ps: List[nn.Parameter], steps: int, seed: int = 1, bias: float = 0.0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) + bias).to(p.dtype)
        opt.step()


def _ref_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float) -> torch.Tensor:
    """The float64 Adam update (betas 0.9, 0.999, eps 1e-8) from state (m, v) at ``step``."""
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g * g
    return -lr / (1 - 0.9**step) * m2 / (v2.sqrt() / (1 - 0.999**step) ** 0.5 + 1e-8)


def _reference_state(shape: Tuple[int, ...], steps: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, v, next grad) of a float64 Adam run on gradients with mean 1 (m stays away from zero)."""
    g = torch.Generator().manual_seed(5)
    m = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64)
    for _ in range(steps):
        gr = 1.0 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
        m, v = 0.9 * m + 0.1 * gr, 0.999 * v + 0.001 * gr * gr
    return m, v, 1.0 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)


def _one_step_from(
    state_dtype: str, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int
) -> Tuple[torch.Tensor, Adam]:
    """The update of one compact step from the fp32 state (m, v) converted into ``state_dtype``."""
    p = nn.Parameter(torch.zeros(m.shape))
    opt = Adam([p], lr=1e-3, state_dtype=state_dtype)
    sd = {
        "state": {0: {"step": torch.tensor(float(step - 1)), "exp_avg": m.float(), "exp_avg_sq": v.float()}},
        "param_groups": opt.state_dict()["param_groups"],
    }
    opt.load_state_dict(sd)
    p.grad = g.float()
    opt.step()
    return p.detach().double(), opt


def test_bf16_state_update_error_bounded_by_bf16_epsilon(impl: str) -> None:
    m, v, g = _reference_state((4096,), 20)
    upd, _ = _one_step_from("bfloat16", m, v, g.float().double(), 21)
    gf = g.float().double()
    ref = _ref_step(torch.zeros(()), gf, m.float().double(), v.float().double(), 21, 1e-3)
    m2, v2 = 0.9 * m + 0.1 * gf, 0.999 * v + 0.001 * gf * gf
    bound = (0.9 * m.abs() / m2.abs() * 2.0**-8 + 0.999 * v / v2 * 2.0**-9) * 1.01 + 1e-6
    rel = (upd - ref).abs() / ref.abs()
    assert (rel <= bound).all(), (rel / bound).max()
    assert rel.max() > 1e-5  # the state really was rounded


def test_int8_state_update_within_block_quantisation_bound(impl: str) -> None:
    block = 256
    m, v, g = _reference_state((4096,), 20)
    m = m * torch.linspace(0.01, 1.0, 4096, dtype=torch.float64)  # magnitudes spread within blocks
    m32, v32, g64 = m.float().double(), v.float().double(), g.float().double()
    upd, _ = _one_step_from("int8", m32, v32, g64, 21)
    a = m32.abs().view(-1, block).amax(1).repeat_interleave(block)
    r = v32.sqrt()
    big_r = r.view(-1, block).amax(1).repeat_interleave(block)
    dm = a / 254 * (2 * (m32.abs() / a).sqrt() + 1 / 254)
    dr = big_r / 510 * (2 * (r / big_r).sqrt() + 1 / 510) + big_r / 255**2
    ref = _ref_step(torch.zeros(()), g64, m32, v32, 21, 1e-3)
    dev = torch.zeros_like(ref)
    for sm in (-1, 1):
        for sr in (-1, 1):
            rr = (r + sr * dr).clamp_min(0)
            dev = torch.maximum(dev, (_ref_step(torch.zeros(()), g64, m32 + sm * dm, rr * rr, 21, 1e-3) - ref).abs())
    err = (upd - ref).abs()
    assert (err <= dev * 1.001 + 1e-6 * ref.abs()).all()
    assert err.max() > 1e-4 * ref.abs().max()  # quantised for real


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_modes_track_float64_adam(impl: str, mode: Tuple[str, str, str]) -> None:
    """Twenty steps of each mode stay close to float64 Adam from the same start (bf16 masters: within
    bf16 rounding of the weights, which move by ~20 lr)."""
    state_dtype, master, rounding = mode
    ps = _params(master)
    opt = Adam(ps, lr=1e-2, state_dtype=state_dtype, master=master, master_rounding=rounding, block_size=64)
    refs = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(r) for r in refs]
    vs = [torch.zeros_like(r) for r in refs]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 21):
        for i, p in enumerate(ps):
            gr = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = gr
            gd = gr.double()
            refs[i] = refs[i] + _ref_step(refs[i], gd, ms[i], vs[i], step, 1e-2)
            ms[i], vs[i] = 0.9 * ms[i] + 0.1 * gd, 0.999 * vs[i] + 0.001 * gd * gd
        opt.step()
    moved = 20 * 1e-2
    for p, r in zip(ps, refs):
        err = (p.detach().double() - r).abs()
        tol = 0.05 * moved if state_dtype == "int8" else 0.01 * moved
        if master == "bfloat16":
            tol += (
                2 * r.abs().max().item() * 2.0**-8 if rounding != "stochastic" else 4 * r.abs().max().item() * 2.0**-8
            )
        assert err.mean() < tol / 4 and err.max() < tol * 4


def test_stochastic_rounding_is_unbiased_and_deterministic(impl: str) -> None:
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    lr = 0.3 * ulp
    means = []
    outs = {}
    for seed in range(8):
        p = nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
        opt = Adam([p], lr=lr, eps=0.0, master="bfloat16", master_rounding="stochastic", seed=seed)
        p.grad = torch.ones(4096, dtype=torch.bfloat16)
        opt.step()
        vals = p.detach().double()
        assert set(vals.unique().tolist()) <= {1.5, 1.5 - ulp}
        means.append(vals.mean().item())
        outs[seed] = p.detach().clone()
    exact = 1.5 - lr
    assert abs(sum(means) / len(means) - exact) < 0.02 * ulp
    # A fixed seed gives the same bits; another seed others.
    p = nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
    opt = Adam([p], lr=lr, eps=0.0, master="bfloat16", master_rounding="stochastic", seed=3)
    p.grad = torch.ones(4096, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(p.detach(), outs[3])
    assert not torch.equal(outs[2], outs[3])
    # Nearest rounding is biased: the 0.3-ulp update is lost entirely.
    q = nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
    opt = Adam([q], lr=lr, eps=0.0, master="bfloat16", master_rounding="nearest")
    q.grad = torch.ones(4096, dtype=torch.bfloat16)
    opt.step()
    assert (q.detach() == 1.5).all()


def test_kahan_keeps_tiny_updates_that_nearest_loses(impl: str) -> None:
    results: Dict[str, torch.Tensor] = {}
    for rounding in ("kahan", "nearest", "stochastic"):
        p = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        opt = Adam([p], lr=1e-4, eps=0.0, master="bfloat16", master_rounding=rounding)
        for _ in range(500):
            p.grad = -torch.ones(1000, dtype=torch.bfloat16)
            opt.step()
        results[rounding] = p.detach().double()
        if rounding == "kahan":
            # Each step rounds the bf16 compensation (|c| <= half a weight ulp + the update) to 2^-8
            # relative: at most 500 * 2^-8 * (2^-8 + 1e-4) / 2 off in all, 7% of the 0.05 gained.
            total = p.detach().double() + opt.state[p]["kahan_comp"].double()
            drift = 500 * 2.0**-9 * (2.0**-8 + 1e-4)
            assert (total - 1.05).abs().max() <= drift
    assert (results["nearest"] == 1.0).all()  # each 1e-4 step is below half an ulp (2^-8)
    assert (results["kahan"] - 1.05).abs().max() <= drift + 2.0**-8
    assert (results["stochastic"].mean() - 1.05).abs() < 2.0**-7


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_checkpoint_resume_is_exact(impl: str, mode: Tuple[str, str, str]) -> None:
    state_dtype, master, rounding = mode
    kw = dict(
        lr=1e-2,
        weight_decay=0.01,
        decoupled_weight_decay=True,
        state_dtype=state_dtype,
        master=master,
        master_rounding=rounding,
        block_size=32,
        seed=7,
    )
    ps = _params(master)
    opt = Adam(ps, **kw)
    _run(opt, ps, 3)
    saved_params = [p.detach().clone() for p in ps]
    saved = copy.deepcopy(opt.state_dict())
    _run(opt, ps, 4, seed=2)
    qs = [nn.Parameter(t.clone()) for t in saved_params]
    opt2 = Adam(qs, **kw)
    opt2.load_state_dict(saved)
    _run(opt2, qs, 4, seed=2)
    for p, q in zip(ps, qs):
        assert torch.equal(p.detach(), q.detach())
        for k, t in opt.state[p].items():
            assert torch.equal(t, opt2.state[q][k]), k


def test_fp32_state_converts_to_compact_and_back() -> None:
    ps = _params("float32")
    ref = torch.optim.Adam(ps, lr=1e-2)
    _run(ref, ps, 5)  # type: ignore[arg-type]
    sd = ref.state_dict()
    opt = Adam([nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, state_dtype="int8", block_size=64)
    opt.load_state_dict(sd)
    for i, q in enumerate(opt.param_groups[0]["params"]):
        m, v = compact.state_to_fp32(opt.state[q], q.shape, 64)
        m0, v0 = sd["state"][i]["exp_avg"], sd["state"][i]["exp_avg_sq"]
        a, big_r = m0.abs().max(), v0.sqrt().max()
        assert (m - m0).abs().max() <= a / 254 * (2 + 1 / 254)
        assert (v.sqrt() - v0.sqrt()).abs().max() <= big_r / 510 * (2 + 1 / 510) + big_r / 255**2
        assert opt.state[q]["exp_avg"].dtype == torch.int8 and opt.state[q]["step"].item() == 5
    _run(opt, opt.param_groups[0]["params"], 2)
    # ...and the compact state back into a default (fp32) optimizer: decoded moments.
    sd2 = opt.state_dict()
    assert sd2["compact"]["state_dtype"] == "int8"
    plain = Adam([nn.Parameter(p.detach().clone()) for p in opt.param_groups[0]["params"]], lr=1e-2)
    plain.load_state_dict(sd2)
    for i, q in enumerate(plain.param_groups[0]["params"]):
        st = plain.state[q]
        m, v = compact.state_to_fp32(sd2["state"][i], q.shape, 64)
        assert (
            st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
        )
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    _run(plain, plain.param_groups[0]["params"], 2)


def _assert_same_results(finals: Dict[str, Tuple[List[nn.Parameter], Adam]]) -> None:
    """The C++ and torch runs (``finals["cpp"]``, ``finals["torch"]``: parameters and optimizer) ended
    with the same parameters and state, bit for bit."""
    (a, oa), (b, ob) = finals["cpp"], finals["torch"]
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        for k, t in oa.state[p].items():
            assert torch.equal(t, ob.state[q][k]), k


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
@pytest.mark.parametrize("variant", ["decoupled", "coupled-maximize", "bf16-grad"])
def test_cpp_and_torch_fallback_agree(
    mode: Tuple[str, str, str], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _kernel_available():
        pytest.skip("no C++ compiler")
    state_dtype, master, rounding = mode
    kw = dict(
        lr=1e-2,
        weight_decay=0.05,
        decoupled_weight_decay=variant == "decoupled",
        maximize=variant == "coupled-maximize",
    )
    finals = {}
    shapes = ((181, 367), (7,), (0,), (3, 5))  # (181, 367) spans chunks and ragged blocks
    for which in ("cpp", "torch"):
        monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, which)
        ps = _params(master, shapes)
        opt = Adam(ps, state_dtype=state_dtype, master=master, master_rounding=rounding, block_size=100, seed=11, **kw)
        g = torch.Generator().manual_seed(4)
        for _ in range(4):
            for p in ps:
                if variant == "bf16-grad":
                    p.grad_dtype = None  # a bf16 gradient of an fp32 master, as RoundPipe hands it over
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16 if variant == "bf16-grad" else p.dtype)
            opt.step()
        finals[which] = (ps, opt)
    _assert_same_results(finals)


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_cpp_and_torch_fallback_agree_on_extreme_values(
    mode: Tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradients from 1e-40 (subnormal) to 1e18 and zeros, coupled weight decay, in tensors whose sizes
    leave every tail of the kernel's vector loops and cross the 2^16-element step of the rounding hash."""
    if not _kernel_available():
        pytest.skip("no C++ compiler")
    state_dtype, master, rounding = mode
    finals = {}
    shapes = ((65536 + 3 * 16 + 5,), (2 * 4096 + 7,), (13,))
    for which in ("cpp", "torch"):
        monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, which)
        ps = _params(master, shapes)
        opt = Adam(
            ps,
            lr=1e-2,
            weight_decay=0.1,
            state_dtype=state_dtype,
            master=master,
            master_rounding=rounding,
            block_size=64,
            seed=3,
            flush_denormals=False,  # the torch fallback keeps subnormals
        )
        g = torch.Generator().manual_seed(8)
        for _ in range(3):
            for p in ps:
                grad = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-40, 19, p.shape, generator=g).double()
                grad[torch.rand(p.shape, generator=g) < 0.05] = 0.0
                p.grad = grad.to(p.dtype)
            opt.step()
        finals[which] = (ps, opt)
    _assert_same_results(finals)


@pytest.mark.parametrize("mode", [m for m in MODES if m[0] != "int8" and (m[0] == "bfloat16" or m[1] == "bfloat16")])
def test_cpp_rounds_nan_to_the_canonical_bf16_nan(mode: Tuple[str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN gradient makes the bf16 weight (Kahan: and compensation) and bf16 moments 0x7FC0, as
    c10::BFloat16 rounds NaN, wherever the element sits in the kernel's vector groups or tails."""
    if not _kernel_available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, "cpp")
    state_dtype, master, rounding = mode
    p = nn.Parameter(torch.randn(1000).to(_dtype(master)))
    opt = Adam([p], lr=1e-2, state_dtype=state_dtype, master=master, master_rounding=rounding)
    bad = torch.tensor([0, 7, 8, 15, 16, 17, 500, 993, 999])
    grad = torch.randn(1000)
    grad[bad] = float("nan")
    p.grad = grad.to(p.dtype)
    opt.step()
    ok = torch.ones(1000, dtype=torch.bool)
    ok[bad] = False
    tensors = [p.detach()] + [t for k, t in opt.state[p].items() if k != "step"]
    for t in (t for t in tensors if t.dtype == torch.bfloat16):
        bits = t.view(torch.int16)
        assert (bits[bad] == 0x7FC0).all() and not t[ok].isnan().any()


def test_cpp_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _kernel_available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, "cpp")
    called = []
    monkeypatch.setattr(compact, "torch_step", lambda *a: called.append(a))
    ps = _params("bfloat16")
    opt = Adam(ps, state_dtype="int8", master="bfloat16")
    _run(opt, ps, 1)
    assert not called and opt.state[ps[0]]["step"].item() == 1


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_host_bytes_per_parameter(mode: Tuple[str, str, str]) -> None:
    state_dtype, master, rounding = mode
    p = nn.Parameter(torch.zeros(1 << 20, dtype=_dtype(master)))
    opt = Adam([p], state_dtype=state_dtype, master=master, master_rounding=rounding)
    _run(opt, [p], 1)
    per_param = (compact.state_bytes(opt.state[p]) + p.numel() * p.element_size()) / p.numel()
    # The figure of the docs, plus the 4-byte step counter of each tensor.
    doc = DOC_BYTES[(state_dtype, master)] + (2.0 if rounding == "kahan" else 0.0) + 4 / p.numel()
    assert per_param <= doc
    assert per_param > doc - 0.05  # the figure is tight, not just an upper bound


def test_bad_options_raise_value_error() -> None:
    f32 = [nn.Parameter(torch.zeros(3))]
    b16 = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="state_dtype must be one of .*'int8'"):
        Adam(f32, state_dtype="int4")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        Adam(f32, state_dtype="int8", block_size=0)
    with pytest.raises(ValueError, match="master must be one of"):
        Adam(f32, master="float16")
    with pytest.raises(ValueError, match="master_rounding must be one of .*'kahan'"):
        Adam(b16, master="bfloat16", master_rounding="up")
    with pytest.raises(ValueError, match="master='bfloat16'.*torch.float32"):
        Adam(f32, master="bfloat16")
    with pytest.raises(ValueError, match="master='float32'.*torch.bfloat16"):
        Adam(b16, state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad"):
        Adam(f32, state_dtype="bfloat16", amsgrad=True)
    with pytest.raises(ValueError, match="seed must be"):
        Adam(b16, master="bfloat16", seed=-1)
    opt = Adam(f32, state_dtype="int8")
    with pytest.raises(ValueError, match="master='float32'"):
        opt.add_param_group({"params": b16})


def test_default_state_dict_unchanged() -> None:
    """Defaults: no 'compact' entry, torch.optim.Adam's state layout (bit-identity is test_adam's)."""
    ps = _params("float32")
    opt = Adam(ps, lr=1e-2)
    _run(opt, ps, 1)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_quantisation_bounds_hold() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10000, generator=g) * torch.logspace(-6, 0, 10000)
    q, s = quant.quantize_m(x, 256)
    back = quant.dequantize_m(q, s, 256)
    a = x.abs().view(-1)[: 39 * 256].view(39, 256).amax(1).repeat_interleave(256)
    a = torch.cat([a, x[39 * 256 :].abs().amax().expand(10000 - 39 * 256)])
    bound = a / 254 * (2 * (x.abs() / a).sqrt() + 1 / 254) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    r = x.abs()
    qr, sr = quant.quantize_r(r, 256)
    assert ((quant.dequantize_r(qr, sr, 256) > 0) == (r > 0)).all()  # no positive r decodes to 0


@pytest.mark.parametrize("workers", WORKER_SPECS[:1], indirect=True)
@pytest.mark.parametrize("mode", [("int8", "bfloat16", "stochastic"), ("bfloat16", "bfloat16", "kahan")])
def test_roundpipe_training_with_compact_state(workers: str, mode: Tuple[str, str, str]) -> None:
    """A bf16 RoundPipe model trained with async steps: the compact optimizer (bf16 optimizer copies
    are the masters) lowers the loss about as much as fp32 masters with fp32 Adam state do."""
    state_dtype, master, rounding = mode
    final = {}
    for kind in ("fp32", "compact"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).to(
            torch.bfloat16
        )
        if kind == "fp32":
            rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
            opt = Adam(rp.optim_parameters(), lr=1e-2)
        else:
            rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
            opt = Adam(rp.optim_parameters(), lr=1e-2, state_dtype=state_dtype, master=master, master_rounding=rounding)
        torch.manual_seed(3)
        w_true = torch.randn(6, 3)
        losses = []
        for _ in range(120):
            x = torch.randn(16, 6)
            loss = rp.forward_backward(
                input_args=(x.bfloat16(),), label=x @ w_true, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean()
            )
            rp.step(lambda: (opt.step(), opt.zero_grad()))
            losses.append(loss.item())
        rp.synchronize()
        final[kind] = sum(losses[-10:]) / 10
        assert final[kind] < 0.1 * sum(losses[:10]) / 10
        if kind == "compact":
            assert all(p.dtype == torch.bfloat16 for p in rp.optim_parameters())
            assert all(opt.state[p]["step"].item() == 120 for p in rp.optim_parameters())
    assert final["compact"] < 1.5 * final["fp32"] + 0.01


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block maximum of ``x`` (flat, >= 0) for blocks of ``block`` elements."""
    pad = (-x.numel()) % block
    b = torch.cat([x, x.new_zeros(pad)]).view(-1, block).amax(1)
    return b.repeat_interleave(block)[: x.numel()]


INT8_MODES = [("int8", "float32", "nearest"), ("int8", "bfloat16", "kahan")]


@pytest.mark.parametrize("mode", INT8_MODES, ids=["f32", "bf16-kahan"])
def test_int8_state_loads_into_another_block_size(mode: Tuple[str, str, str]) -> None:
    """An int8 state saved with block_size 64 and loaded with 67 (the same number of blocks for every
    tensor, so the layouts agree): the moments are decoded with the saved block size and requantised,
    within one code step of the new blocks; read raw, elements near a block edge would take the
    neighbour's scale. The same block size loads bit for bit."""
    state_dtype, master, rounding = mode
    shapes = ((37, 29), (100,))  # 17 and 2 blocks with either block size
    kw = dict(lr=1e-2, state_dtype=state_dtype, master=master, master_rounding=rounding, seed=5)
    ps = _params(master, shapes)
    opt = Adam(ps, block_size=64, **kw)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p in ps:  # magnitudes over three decades: neighbouring blocks have very different scales
            p.grad = (torch.randn(p.shape, generator=g) * torch.logspace(-3, 0, p.numel()).view(p.shape)).to(p.dtype)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for p in ps:
        assert quant.n_blocks(p.numel(), 64) == quant.n_blocks(p.numel(), 67)
    same = Adam([nn.Parameter(p.detach().clone()) for p in ps], block_size=64, **kw)
    same.load_state_dict(sd)
    for i, q in enumerate(same.param_groups[0]["params"]):
        assert set(same.state[q]) == set(sd["state"][i])
        for k, t in sd["state"][i].items():
            assert torch.equal(same.state[q][k], t), k
    other = Adam([nn.Parameter(p.detach().clone()) for p in ps], block_size=67, **kw)
    other.load_state_dict(sd)
    for i, q in enumerate(other.param_groups[0]["params"]):
        m0, v0 = compact.state_to_fp32(sd["state"][i], q.shape, 64)
        m, v = compact.state_to_fp32(other.state[q], q.shape, 67)
        m0, r0, m, r = m0.reshape(-1), v0.sqrt().reshape(-1), m.reshape(-1), v.sqrt().reshape(-1)
        a, big_r = _block_max(m0.abs(), 67), _block_max(r0, 67)
        dm = a / 254 * (2 * (m0.abs() / a).sqrt() + 1 / 254) * (1 + 1e-6)
        dr = (big_r / 510 * (2 * (r0 / big_r).sqrt() + 1 / 510) + big_r / 255**2) * (1 + 1e-6)
        assert ((m - m0).abs() <= dm).all(), ((m - m0).abs() / dm).max()
        assert ((r - r0).abs() <= dr).all(), ((r - r0).abs() / dr).max()
        assert other.state[q]["exp_avg_scale"].numel() == quant.n_blocks(q.numel(), 67)
        assert other.state[q]["step"].item() == 3
        if rounding == "kahan":
            assert torch.equal(other.state[q]["kahan_comp"], sd["state"][i]["kahan_comp"])
    _run(other, other.param_groups[0]["params"], 1)  # and it steps on
