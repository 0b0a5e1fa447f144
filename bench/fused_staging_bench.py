"""The host Adam pass with and without its fused bf16 write (``RPP_DEBUG_FUSED_STAGING``), against the pass plus a
separate staging copy (what an undeclared step function gets), on this machine's CPU.

The C++ kernel (``roundpipe/optim/csrc/adam.cpp``) steps fp32 masters from bf16 gradients. Fused, each work
item also rounds its updated masters to bf16 into the gradient buffer (the staging buffer of a declared step
function) while they are in cache. Unfused, ``stage_params`` copies every master into that buffer after the step
function returns. The three candidates run interleaved, one step each per round; the table gives medians.

    python bench/fused_staging_bench.py                     # 88M parameters, 7 rounds, torch's threads
    python bench/fused_staging_bench.py --params 400M --threads 12 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from roundpipe.optim.adam import _adam_kernel
from roundpipe.optim.fp32_step import KernelBatch

TENSOR = 12_582_912  # one 6144 x 2048 projection (qwen3-1.7b's MLP)
GROUP = dict(
    betas=(0.9, 0.999), lr=1e-5, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, decoupled_weight_decay=False
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="88M", help="total parameters (rounded to whole 12.6M tensors)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (the kernel uses as many)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    total = int(float(args.params.rstrip("MmBb")) * (1e9 if args.params[-1] in "Bb" else 1e6))
    n = max(1, round(total / TENSOR))
    kernel = _adam_kernel("adam")
    if kernel is None:
        raise SystemExit("the C++ Adam kernel could not be built on this machine (see roundpipe.optim.build)")
    masters = [torch.randn(TENSOR) for _ in range(n)]
    grads = [torch.randn(TENSOR).bfloat16() for _ in range(n)]  # also the staging buffers, as in the runtime
    m = [torch.zeros(TENSOR) for _ in range(n)]
    v = [torch.zeros(TENSOR) for _ in range(n)]
    steps = [torch.zeros(()) for _ in range(n)]

    def adam(fused: bool) -> float:
        batch = KernelBatch()
        for i in range(n):
            batch.add(masters[i], grads[i], m[i], v[i], None, steps[i])
            batch.add_output(grads[i] if fused else None)
        t0 = time.perf_counter()
        batch.run(kernel, GROUP)
        return time.perf_counter() - t0

    def staged() -> float:
        t = adam(False)
        t0 = time.perf_counter()
        for g, p in zip(grads, masters):
            g.copy_(p)  # stage_params: torch's rounding copy, one call per tensor
        return t + time.perf_counter() - t0

    candidates: Dict[str, Callable[[], float]] = {
        "Adam pass alone": lambda: adam(False),
        "Adam pass, bf16 write fused (declared step function)": lambda: adam(True),
        "Adam pass, then the staging copy (undeclared)": staged,
    }
    times: Dict[str, List[float]] = {k: [] for k in candidates}
    for r in range(args.rounds + 1):
        for name, fn in candidates.items():
            dt = fn()
            if r:  # round 0 warms the pages and the thread team
                times[name].append(dt)
    print(
        f"{n * TENSOR / 1e6:.0f}M parameters in {n} tensors, {torch.get_num_threads()} threads, median of {args.rounds}"
    )
    base = statistics.median(times["Adam pass alone"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1e3 * med:.1f} ms | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
