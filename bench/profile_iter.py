"""Profile one RoundPipe training iteration of the MLP stack: GPU busy fraction, copy volumes and gaps.

    python bench/profile_iter.py --layers 12 --hidden 4096 --tokens 16384
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def merged_length(spans):
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--trace", default="")
    args = p.parse_args()
    h = args.hidden
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.GELU(), nn.Linear(4 * h, h, bias=False)) for _ in range(args.layers)]).bfloat16()
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches))
    x = torch.randn(args.tokens, h, dtype=torch.bfloat16).pin_memory()
    y = torch.randn(args.tokens, h, dtype=torch.bfloat16).pin_memory()
    loss_fn = lambda o, t: nn.functional.mse_loss(o.float(), t.float())  # noqa: E731
    for _ in range(3):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    torch.cuda.synchronize()
    print("plan:", rp._plans)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels, h2d, d2h = [], [], []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (evt.time_range.start, evt.time_range.end)
        if "HtoD" in evt.name:
            h2d.append(span)
        elif "DtoH" in evt.name:
            d2h.append(span)
        elif not evt.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    print(f"wall {wall / 1e3:.1f} ms; compute busy {merged_length(kernels) / 1e3:.1f} ms ({merged_length(kernels) / wall:.0%}); "
          f"h2d {merged_length(h2d) / 1e3:.1f} ms in {len(h2d)} copies; d2h {merged_length(d2h) / 1e3:.1f} ms in {len(d2h)} copies")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
