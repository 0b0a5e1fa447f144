"""Host step speed of the compact Adam state against the fp32 C++ Adam (roundpipe.optim.Adam), on CPU.

Each candidate steps the same parameter count (tensors of 4M elements, AdamW with weight decay); the
candidates run interleaved, round by round, and the table gives the median step time and parameters per
second. The fp32 baseline reads fp32 gradients; ``fp32 (bf16 grad)`` is the RoundPipe case (bf16 host
gradients of fp32 masters). Compact modes with a bf16 master read bf16 gradients (the model's own).

    python bench/compact_adam_bench.py                       # 40M params, all cores
    python bench/compact_adam_bench.py --params 100M --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from roundpipe.optim import Adam

TENSOR = 4 * 2**20

CANDIDATES: List[Tuple[str, Dict[str, str], torch.dtype, torch.dtype]] = [
    ("fp32 Adam (C++)", {}, torch.float32, torch.float32),
    ("fp32 Adam, bf16 grad", {}, torch.float32, torch.bfloat16),
    ("bf16 state, fp32 master", {"state_dtype": "bfloat16"}, torch.float32, torch.bfloat16),
    ("int8 state, fp32 master", {"state_dtype": "int8"}, torch.float32, torch.bfloat16),
    ("bf16 state, bf16 master SR", {"state_dtype": "bfloat16", "master": "bfloat16"}, torch.bfloat16, torch.bfloat16),
    ("int8 state, bf16 master SR", {"state_dtype": "int8", "master": "bfloat16"}, torch.bfloat16, torch.bfloat16),
    (
        "int8 state, bf16 master Kahan",
        {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "kahan"},
        torch.bfloat16,
        torch.bfloat16,
    ),
    (
        "int8 state, bf16 master nearest",
        {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "nearest"},
        torch.bfloat16,
        torch.bfloat16,
    ),
]


def parse_size(s: str) -> int:
    """'40M' -> 40_000_000."""
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9}.get(s[-1], 1)
    return int(float(s.rstrip("KMB")) * mult)


def make(total: int, kw: Dict[str, str], p_dtype: torch.dtype, g_dtype: torch.dtype) -> Callable[[], None]:
    """A step function over ``total`` parameters of one candidate (state initialised by a first step)."""
    ps = []
    for _ in range(max(1, total // TENSOR)):
        p = nn.Parameter(torch.randn(TENSOR).to(p_dtype))
        if g_dtype != p_dtype:
            p.grad_dtype = None
        p.grad = torch.randn(TENSOR).to(g_dtype)
        ps.append(p)
    opt = Adam(ps, lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True, **kw)  # type: ignore[arg-type]
    opt.step()
    return opt.step


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="40M")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    total = parse_size(args.params)
    n = max(1, total // TENSOR) * TENSOR
    steps = {name: make(n, kw, pd, gd) for name, kw, pd, gd in CANDIDATES}
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[CANDIDATES[0][0]])
    print(f"{n / 1e6:.0f}M params, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| candidate | ms / step | G params/s | vs fp32 C++ Adam |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {n / med / 1e9:.2f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
