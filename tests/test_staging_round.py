"""The asynchronous step's staging pass rounds every fp32 optimizer copy into its bf16 staging buffer in one
call of the C++ kernel (``roundpipe.optim.step.copy_into``): bit for bit what torch's ``copy_`` writes."""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.optim import Adam, build
from roundpipe.optim import step as optim_step


@pytest.fixture
def kernel() -> None:
    try:
        build.get_optim_function("adam")  # copy_into uses the rounding once Adam's library is loaded
    except build.OptimBuildError as exc:
        pytest.skip(f"no C++ kernel here: {exc}")


def test_copy_into_rounds_like_copy(kernel: None) -> None:
    torch.manual_seed(0)
    srcs = [torch.randn(n) * s for n, s in ((1000, 1.0), (70_000, 1e-30), (300_000, 1e30), (5, 1.0), (1 << 17, 3.0))]
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 3.4e38, 65504.0, 1.0000001]
    srcs[0][: len(special)] = torch.tensor(special)
    srcs.append(torch.randn(8, 8).t())  # not contiguous: torch's copy_
    srcs.append(torch.randn(16, dtype=torch.float64))  # not fp32: torch's copy_
    dsts = [torch.full(s.shape, 7.0, dtype=torch.bfloat16) for s in srcs]
    versions = [d._version for d in dsts]
    optim_step.copy_into(dsts, srcs)
    for d, s, v in zip(dsts, srcs, versions):
        ref = s.to(torch.bfloat16)
        assert torch.equal(torch.isnan(d), torch.isnan(ref))
        assert torch.equal(d[~torch.isnan(d)].view(torch.int16), ref[~torch.isnan(ref)].view(torch.int16))
        assert d._version > v  # a saved tensor of an autograd graph would notice the write


def _run(workers: int, steps: int) -> List[torch.Tensor]:
    import roundpipe

    roundpipe.configure(devices=f"cpu:{workers}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).bfloat16()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = Adam(rp.optim_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        loss = rp.forward_backward(
            input_args=(x.bfloat16(),), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean()
        )
        rp.step(lambda: (opt.step(), opt.zero_grad()))
        out.append(loss.detach().clone())
    rp.synchronize()
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("workers", [1, 3])
def test_staged_steps_through_the_kernel_equal_copying(
    kernel: None, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 model, fp32 masters, asynchronous steps: every loss and final weight is the same whether the
    staging pass rounds through the kernel or through copy_, and the kernel did the staging."""
    rounded = []
    real = optim_step.copy_into

    def counting(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        rounded.append(sum(1 for d, s in zip(dsts, srcs) if optim_step._roundable(d, s)))
        real(dsts, srcs)

    monkeypatch.setattr(optim_step, "copy_into", counting)
    through_kernel = _run(workers, 6)
    assert rounded and all(n == 6 for n in rounded), rounded  # 3 weights + 3 biases per step
    monkeypatch.setattr(optim_step, "_round_kernel", lambda: None)
    through_copy = _run(workers, 6)
    for a, b in zip(through_kernel, through_copy):
        assert torch.equal(a, b)
