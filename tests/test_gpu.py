"""GPU-only checks: parameter uploads overlap compute (the point of the separate streams)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import use_devices
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

pytestmark = pytest.mark.gpu


def _intervals(prof: torch.profiler.profile):
    """(kernel intervals, host-to-device copy intervals) in device time, microseconds."""
    kernels, h2d = [], []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (evt.time_range.start, evt.time_range.end)
        if "Memcpy HtoD" in evt.name:
            h2d.append(span)
        elif not evt.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    return kernels, h2d


def _overlap(a, b) -> float:
    """Total length of the intersection of two interval sets."""
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def test_parameter_upload_overlaps_compute() -> None:
    use_devices("cuda:0")
    torch.manual_seed(0)
    n_layers, width = 8, 4096
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)]).to(torch.bfloat16)
    plan = ModelExecutePlan.layerwise(n_layers, "infer")
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    x = torch.randn(16384, width, dtype=torch.bfloat16).pin_memory()
    with torch.no_grad():
        for _ in range(2):
            rp(x)  # warm-up: allocator, cuBLAS handles
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = rp(x)
            torch.cuda.synchronize()
    ref = x.cuda()
    for layer in model:
        ref = ref @ layer.weight.cuda().t()
    assert (out.float() - ref.float().cpu()).norm() / ref.float().norm() < 2e-2
    kernels, h2d = _intervals(prof)
    assert kernels and h2d, "profiler saw no kernels or uploads"
    upload_time = sum(e - s for s, e in h2d)
    overlapped = _overlap(h2d, kernels)
    print(f"h2d {upload_time:.0f} us, overlapped with compute {overlapped:.0f} us ({overlapped / upload_time:.0%})")
    # Parameters of group g+1 (and activations) upload while group g computes.
    assert overlapped / upload_time > 0.3


def test_qwen3_0_6b_trains_on_gpu_and_matches_cpu() -> None:
    """A Qwen3-0.6B-architecture model (random init, bf16) through RoundPipe on one GPU: loss and
    gradients match a plain fp32 Hugging Face run on the CPU within bf16 tolerance, and it trains."""
    import copy
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from train_bench import build_model

    import roundpipe
    from roundpipe import RoundPipeRunConfig

    use_devices("cuda:0")
    hf = build_model("qwen3-0.6b", "cpu")  # bf16
    ref = copy.deepcopy(hf).float()
    ids = torch.randint(0, hf.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    model = roundpipe.wrap_model_to_roundpipe(hf, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in hf.named_parameters():
        q = ref_params[name]
        err = ((p.grad.float() - q.grad).norm() / q.grad.norm()).item()
        worst = max(worst, err)
    print(f"loss {loss.item():.4f} vs cpu fp32 {ref_loss.item():.4f}; worst grad rel err {worst:.3g}")
    assert worst < 5e-2
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3)
    for p in hf.parameters():
        p.grad = None
    losses = [model.train_step(input_ids=ids, labels=ids).item()]
    for _ in range(5):
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        losses.append(model.train_step(input_ids=ids, labels=ids).item())
    print("losses", [round(v, 3) for v in losses])
    assert losses[-1] < losses[0] - 0.5
