"""The runtime's own cost per job, without a GPU: a tiny layer stack where the math is negligible, so
what an iteration costs beyond a plain PyTorch loop is the runtime's bookkeeping (dispatch, events,
tracker, transfers, Python calls), the cost every backend pays per job.

The stack: ``--layers`` x ``nn.Linear(--width, --width)``, ``--microbatches`` microbatches of
``--rows`` rows, ``forward_backward`` + ``step`` (SGD) per iteration, torch at one intra-op thread.
The reference: the same math in the same process as a plain PyTorch loop (per microbatch forward,
loss, backward; one SGD step). Both are divided by the number of layer-microbatch jobs of an
iteration, forward and backward counted as two (``2 x layers x microbatches``).

    python bench/job_cost.py                     # 1, 2, 3 and 4 CPU workers
    python bench/job_cost.py --workers 2 --iters 50 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, label, reduction="sum")


def plain_times(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> List[float]:
    """Seconds per iteration of the plain PyTorch loop (same math, same process)."""
    model = build(args.layers, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = x.chunk(args.microbatches), y.chunk(args.microbatches)
    times = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        for xm, ym in zip(xs, ys):
            loss_fn(model(xm), ym).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[args.warmup :]


def roundpipe_times(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, workers: int) -> List[float]:
    """Seconds per iteration of RoundPipe on ``workers`` CPU workers."""
    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig

    roundpipe.configure(devices=f"cpu:{workers}")
    model = RoundPipe(
        build(args.layers, args.width), model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches)
    )
    opt = torch.optim.SGD(model.optim_parameters(), lr=1e-4)
    times = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        times.append(time.perf_counter() - t0)
    model.synchronize()
    return times[args.warmup :]


def measure(args: argparse.Namespace) -> Dict[str, object]:
    torch.set_num_threads(1)
    x = torch.randn(args.rows * args.microbatches, args.width)
    y = torch.randn(args.rows * args.microbatches, args.width)
    jobs = 2 * args.layers * args.microbatches
    plain = statistics.median(plain_times(args, x, y)) / jobs
    rows = []
    for w in args.workers:
        rp = statistics.median(roundpipe_times(args, x, y, w)) / jobs
        # The plain loop again after each run: a drifting machine shows in the reference too.
        ref = min(plain, statistics.median(plain_times(args, x, y)) / jobs)
        rows.append({"workers": w, "runtime_us": rp * 1e6, "plain_us": ref * 1e6, "ratio": rp / ref})
    return {
        "layers": args.layers,
        "width": args.width,
        "microbatches": args.microbatches,
        "jobs_per_iteration": jobs,
        "rows": rows,
    }


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4], help="CPU worker counts to measure")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if any(w < 1 for w in args.workers):
        p.error("--workers: each count must be at least 1")
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.layers} x Linear({args.width}), {args.microbatches} microbatches: "
        f"{result['jobs_per_iteration']} jobs per iteration"
    )
    print("workers  runtime us/job  plain us/job  ratio")
    for r in result["rows"]:  # type: ignore[union-attr]
        print(f"{r['workers']:>7}  {r['runtime_us']:>14.1f}  {r['plain_us']:>12.1f}  {r['ratio']:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
