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
