"""roundpipe.optim.Adam against torch.optim.Adam: results, state dicts, param groups, fallbacks.

Every comparison runs twice: on the C++ kernel (RPP_DEBUG_ADAM_IMPL=cpp) and on the torch path
(RPP_DEBUG_ADAM_IMPL=torch, torch's fused CPU kernel). Tolerance: |ours - torch| <= 1e-6 + 1e-6 * |torch|
(the two agree to a few float32 ulps; torch's own fused and single-tensor paths differ as much).
"""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

import roundpipe.optim.adam as adam_mod
from roundpipe import settings
from roundpipe.optim import Adam
from roundpipe.optim import build as optim_builder

TOL = dict(rtol=1e-6, atol=1e-6)

# Odd, empty and scalar shapes; the C++ kernel splits work into 32K-element chunks, so (181, 367) spans
# three chunks with a ragged end. Tensors large enough for the multi-threaded path are in
# test_large_tensors_parallel_path (kept out of the 64-way matrix: torch's reference is slow on them).
REAL_SHAPES: List[Tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 5), (0, 4), (17, 33), (2, 3, 5), (181, 367)]
COMPLEX_SHAPES: List[Tuple[int, ...]] = [(5,), (4, 3), (0,), (33, 65)]


def _kernel_available() -> bool:
    try:
        optim_builder.get_optim_function("adam")
        return True
    except optim_builder.OptimBuildError:
        return False


@pytest.fixture(params=["cpp", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpp" and not _kernel_available():
        pytest.skip("no C++ compiler: the C++ kernel cannot be built")
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, request.param)
    return request.param


@pytest.fixture
def path_calls(impl: str, monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Counts the calls into each implementation, so a test knows which one actually ran."""
    calls = {"cpp": 0, "torch": 0}
    for owner, name, key in ((adam_mod.KernelBatch, "run", "cpp"), (adam_mod, "torch_step", "torch")):
        orig = getattr(owner, name)

        def counted(*args, _orig=orig, _key=key, **kwargs):
            calls[_key] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


def make_params(seed: int = 0, real_shapes=REAL_SHAPES, complex_shapes=COMPLEX_SHAPES) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    real = [torch.randn(s, generator=g).requires_grad_() for s in real_shapes]
    cplx = [torch.randn(s, generator=g, dtype=torch.complex64).requires_grad_() for s in complex_shapes]
    return real + cplx


def clone_params(params: List[torch.Tensor]) -> List[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(groups: List[List[torch.Tensor]], step: int, seed: int = 0) -> None:
    """Same random gradients on each list of params; param 3 has no gradient on odd steps, so its
    step count (and bias correction) falls behind the others."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ref = groups[0]
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in ref]
    for params in groups:
        for i, (p, gr) in enumerate(zip(params, grads)):
            p.grad = None if (i == 3 and step % 2) else gr.clone()


def assert_same_state(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, ps, qs) -> None:
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)
        so, sr = ours.state[p], ref.state[q]
        assert set(so) == set(sr)
        for key in sr:
            if key == "step":
                assert so[key].dtype == sr[key].dtype == torch.float32 and so[key].dim() == 0
                assert so[key].device == sr[key].device
                assert so[key].item() == sr[key].item()
            else:
                assert so[key].dtype == sr[key].dtype
                torch.testing.assert_close(so[key], sr[key], **TOL)


HYPER = list(itertools.product([0.0, 0.01], [False, True], [False, True], [False, True], ["float", "tensor"]))


@pytest.mark.parametrize("weight_decay,amsgrad,maximize,decoupled,hyper_type", HYPER)
def test_matches_torch_adam(impl, path_calls, weight_decay, amsgrad, maximize, decoupled, hyper_type) -> None:
    if hyper_type == "tensor":
        lr, betas = torch.tensor(0.01), (torch.tensor(0.9), torch.tensor(0.999))
    else:
        lr, betas = 0.01, (0.9, 0.999)
    kw = dict(weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled)
    ps = make_params()
    qs = clone_params(ps)
    ours = Adam(ps, lr=lr, betas=betas, **kw)
    ref = torch.optim.Adam(qs, lr=copy.deepcopy(lr), betas=copy.deepcopy(betas), **kw)
    for step in range(12):
        set_grads([ps, qs], step)
        ours.step()
        ref.step()
    assert_same_state(ours, ref, ps, qs)
    # Every tensor here is fp32/complex64 and contiguous: the selected implementation did all the work.
    other = "torch" if impl == "cpp" else "cpp"
    assert path_calls[impl] == 12 and path_calls[other] == 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(amsgrad=True, maximize=True, weight_decay=0.01),
        dict(decoupled_weight_decay=True, weight_decay=0.01, betas=(0.3, 0.9)),  # lerp weight >= 0.5
    ],
)
def test_large_tensors_parallel_path(impl, path_calls, kw) -> None:
    """More than 2^17 elements per group: the C++ kernel runs multi-threaded."""
    ps = make_params(3, real_shapes=[(7,), (301, 499), ((1 << 17) + 3,)], complex_shapes=[(129, 257)])
    qs = clone_params(ps)
    ours, ref = Adam(ps, lr=0.01, **kw), torch.optim.Adam(qs, lr=0.01, **kw)
    for step in range(6):
        set_grads([ps, qs], step, seed=3)
        ours.step()
        ref.step()
    assert_same_state(ours, ref, ps, qs)
    assert path_calls[impl] == 6


def test_param_groups_and_layouts(impl) -> None:
    """Groups with their own lr/betas/decay; a channels_last param (stepped the torch way), a strided
    gradient and an fp64 param."""
    torch.manual_seed(0)
    a = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    b = torch.randn(64, 48, requires_grad=True)
    c = torch.randn(33, dtype=torch.float64, requires_grad=True)
    d = torch.randn(1000, 3, requires_grad=True)
    ps = [a, b, c, d]
    qs = clone_params(ps)
    qs[0] = a.detach().clone(memory_format=torch.channels_last).requires_grad_()

    def groups(t):
        return [
            {"params": [t[0], t[1]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [t[2]], "lr": 3e-3, "betas": (0.5, 0.9), "amsgrad": True},
            {"params": [t[3]], "lr": 1e-3, "decoupled_weight_decay": True, "weight_decay": 0.05},
        ]

    ours, ref = Adam(groups(ps)), torch.optim.Adam(groups(qs))
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in ps]
        grads[1] = torch.randn(48, 64, generator=g).t()  # non-contiguous gradient
        for p, q, gr in zip(ps, qs, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    assert_same_state(ours, ref, ps, qs)
    assert ps[0].is_contiguous(memory_format=torch.channels_last)


def test_state_dict_round_trip_both_ways(impl) -> None:
    kw = dict(lr=0.01, weight_decay=0.01, amsgrad=True)
    ps = make_params(1)
    ours = Adam(ps, **kw)
    for step in range(5):
        set_grads([ps], step, seed=1)
        ours.step()

    # ours -> torch: torch continues from our state exactly as we do. (Deep copies, as a checkpoint on
    # disk would be: load_state_dict keeps the very tensors it is given when dtype and device match.)
    qs = clone_params(ps)
    ref = torch.optim.Adam(qs, **kw)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert_same_state(ours, ref, ps, qs)
    for step in range(5, 10):
        set_grads([ps, qs], step, seed=1)
        ours.step()
        ref.step()
    assert_same_state(ours, ref, ps, qs)

    # torch -> ours.
    rs = clone_params(qs)
    ours2 = Adam(rs, **kw)
    ours2.load_state_dict(copy.deepcopy(ref.state_dict()))
    for step in range(10, 15):
        set_grads([qs, rs], step, seed=1)
        ref.step()
        ours2.step()
    assert_same_state(ours2, ref, rs, qs)

    # The state dicts have the same layout: same group keys and values, same state keys and dtypes.
    sd_ours, sd_ref = ours2.state_dict(), ref.state_dict()
    assert sd_ours["param_groups"] == sd_ref["param_groups"]
    assert sd_ours["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in st.items()} == {
            k: (v.dtype, v.shape) for k, v in sd_ours["state"][i].items()
        }


def test_named_parameters(impl) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    twin = copy.deepcopy(model)
    ours = Adam(model.named_parameters(), lr=1e-2)
    ref = torch.optim.Adam(twin.named_parameters(), lr=1e-2)
    x = torch.randn(11, 5)
    for _ in range(10):
        for m, opt in ((model, ours), (twin, ref)):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    assert_same_state(ours, ref, list(model.parameters()), list(twin.parameters()))
    assert ours.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ours.state_dict()["param_groups"] == ref.state_dict()["param_groups"]


def test_setstate_fills_missing_defaults() -> None:
    p = torch.randn(3, requires_grad=True)
    opt = Adam([p])
    p.grad = torch.ones(3)
    opt.step()
    state = opt.__getstate__()
    # An old checkpoint: groups without the newer keys, a Python number for `step`.
    for key in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
        del state["param_groups"][0][key]
    state["state"][p]["step"] = 1
    restored = pickle.loads(pickle.dumps(state))
    opt2 = Adam.__new__(Adam)
    opt2.__setstate__(restored)
    group = opt2.param_groups[0]
    assert group["amsgrad"] is False and group["maximize"] is False and group["decoupled_weight_decay"] is False
    assert group["foreach"] is None and group["fused"] is None
    assert group["capturable"] is False and group["differentiable"] is False
    step = next(iter(opt2.state.values()))["step"]
    assert torch.is_tensor(step) and step.dtype == torch.float32 and step.item() == 1.0


def test_validation_matches_torch() -> None:
    p = [torch.zeros(1, requires_grad=True)]
    for kwargs in (
        dict(lr=-1.0),
        dict(eps=-1.0),
        dict(betas=(1.0, 0.9)),
        dict(betas=(0.9, -0.1)),
        dict(weight_decay=-1.0),
        dict(betas=(torch.tensor(0.9), 0.999)),
        dict(lr=torch.tensor([1e-3, 1e-3])),
    ):
        with pytest.raises(ValueError):
            torch.optim.Adam(p, **kwargs)
        with pytest.raises(ValueError):
            Adam(p, **kwargs)
    # Accepted for compatibility, and stored like torch stores them.
    opt = Adam(p, foreach=True, fused=True, capturable=True, differentiable=False)
    assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is True


def test_sparse_gradient_rejected(impl) -> None:
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Adam([p]).step()


def test_closure_and_version_counter(impl) -> None:
    p = torch.randn(10, requires_grad=True)
    opt = Adam([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    version = p._version
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    # In-place semantics are visible to autograd, whichever implementation wrote the parameter.
    assert p._version > version


def test_auto_falls_back_without_compiler(monkeypatch, caplog) -> None:
    """No compiler: `auto` logs one warning and steps the torch way; `cpp` raises."""
    monkeypatch.setattr(optim_builder, "loaded_optim_functions", {})
    monkeypatch.setattr(optim_builder, "_build_errors", {})
    monkeypatch.setattr(optim_builder, "_compiler", lambda: None)
    monkeypatch.setattr(adam_mod, "_kernel_error", None)
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, "auto")
    ps = make_params(2)
    qs = clone_params(ps)
    ours, ref = Adam(ps, lr=0.01), torch.optim.Adam(qs, lr=0.01)
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        for step in range(3):
            set_grads([ps, qs], step, seed=2)
            ours.step()
            ref.step()
    warnings = [r for r in caplog.records if "C++ kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert_same_state(ours, ref, ps, qs)
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, "cpp")  # read when an optimizer is built
    strict = Adam(ps, lr=0.01)
    with pytest.raises(optim_builder.OptimBuildError, match="no C\\+\\+ compiler"):
        strict.step()
    # The failure is remembered: no rebuild attempt per step, even once a compiler would be found.
    monkeypatch.setattr(optim_builder, "_compiler", lambda: pytest.fail("rebuilt after a failure"))
    with pytest.raises(optim_builder.OptimBuildError, match="no C\\+\\+ compiler"):
        strict.step()


def test_kernel_builds_into_cache_keyed_by_cpu(monkeypatch, tmp_path) -> None:
    if optim_builder._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("RPP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(optim_builder, "loaded_optim_functions", {})
    monkeypatch.setattr(optim_builder, "_build_errors", {})
    fn = optim_builder.get_optim_function("adam")
    assert optim_builder.get_optim_function("adam") is fn
    cpu_hash = optim_builder.get_cpu_flags_hash()
    assert len(cpu_hash) == 16 and int(cpu_hash, 16) >= 0
    built = list((tmp_path / "optim" / cpu_hash).glob("adam-*.so"))
    assert len(built) == 1
    assert not list((tmp_path / "optim" / cpu_hash).glob("*.tmp.so"))


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_the_kernel_is_built_before_the_first_step(impl, monkeypatch, tmp_path) -> None:
    """The constructor starts building (first run on a machine) and loading the C++ step in a
    background thread: the first step finds it loaded instead of compiling it itself; with
    ``RPP_DEBUG_ADAM_IMPL=torch`` nothing is built."""
    if optim_builder._compiler() is None:
        pytest.skip("no C++ compiler")
    import threading

    monkeypatch.setenv("RPP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(settings.DEBUG_ADAM_IMPL.name, impl)
    monkeypatch.setattr(optim_builder, "loaded_optim_functions", {})
    monkeypatch.setattr(optim_builder, "_build_errors", {})
    compiled_on: List[str] = []
    real = optim_builder._compile
    monkeypatch.setattr(
        optim_builder, "_compile", lambda *a: (compiled_on.append(threading.current_thread().name), real(*a))[1]
    )
    ps = make_params(2)
    opt = Adam(ps, lr=0.01)
    for t in threading.enumerate():
        if t.name == "roundpipe-build-adam":
            t.join()
    built = ["roundpipe-build-adam"] if impl == "auto" else []
    assert compiled_on == built
    assert ("adam" in optim_builder.loaded_optim_functions) == (impl == "auto")
    set_grads([ps], 0, seed=2)
    opt.step()
    assert compiled_on == built


def test_cache_key_covers_the_files_a_source_includes(monkeypatch, tmp_path) -> None:
    """A library is keyed by its source and the files it includes with quotes (recursively): editing
    only an included part (compact_adam.cpp's AVX2 path) must not load the stale library."""
    (tmp_path / "k.cpp").write_text('#include <cmath>\n#include "part.h"\nint f() { return g(); }\n')
    (tmp_path / "part.h").write_text('#pragma once\n#include "inner.h"\ninline int g() { return h(); }\n')
    (tmp_path / "inner.h").write_text("inline int h() { return 1; }\n")
    monkeypatch.setattr(optim_builder, "_CSRC", tmp_path)
    monkeypatch.setenv("RPP_CACHE_DIR", str(tmp_path / "cache"))
    first = optim_builder._library_path("k", "c++")
    assert optim_builder._library_path("k", "c++") == first
    (tmp_path / "inner.h").write_text("inline int h() { return 2; }\n")
    second = optim_builder._library_path("k", "c++")
    assert second != first
    (tmp_path / "part.h").write_text('#pragma once\n#include "inner.h"\ninline int g() { return -h(); }\n')
    assert optim_builder._library_path("k", "c++") not in (first, second)
    monkeypatch.undo()  # the shipped kernel: its key reads the AVX2 part it includes
    shipped = optim_builder._source_bytes(optim_builder._CSRC / "compact_adam.cpp")
    assert (optim_builder._CSRC / "compact_adam_avx2.h").read_bytes() in shipped


def test_state_of_the_wrong_shape_raises(impl) -> None:
    """load_state_dict does not check shapes; a mismatched state must raise, never be walked past its end."""
    a = torch.zeros(3, requires_grad=True)
    a.grad = torch.ones(3)
    opt = Adam([a])
    opt.step()
    b = torch.zeros(4, requires_grad=True)
    b.grad = torch.ones(4)
    opt2 = Adam([b])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    with pytest.raises(RuntimeError, match="size"):
        opt2.step()


def test_step_on_the_optimizer_thread(impl) -> None:
    """Where RoundPipe runs it: queued on the optimizer stream, large enough for the threaded kernel."""
    from roundpipe.host import optim_thread

    ps = make_params(4, real_shapes=[(5,), (400, 400)], complex_shapes=[(3,)])
    qs = clone_params(ps)
    ours, ref = Adam(ps, lr=0.01, weight_decay=0.01), torch.optim.Adam(qs, lr=0.01, weight_decay=0.01)
    for step in range(4):
        set_grads([ps, qs], step, seed=4)
        optim_thread.submit(ours.step)
        ref.step()
        optim_thread.synchronize()
    assert_same_state(ours, ref, ps, qs)
