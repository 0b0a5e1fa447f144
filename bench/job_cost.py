"""The runtime's own cost per job, without a GPU: a tiny layer stack where the math is negligible, so
what an iteration costs beyond a plain PyTorch loop is the runtime's bookkeeping (dispatch, events,
tracker, transfers, Python calls), the cost every backend pays per job.

The stack: ``--layers`` x ``nn.Linear(--width, --width)``, ``--microbatches`` microbatches of
``--rows`` rows, ``forward_backward`` + ``step`` (SGD) per iteration, torch at one intra-op thread.
The reference: the same math in the same process as a plain PyTorch loop (per microbatch forward,
loss, backward; one SGD step). Both are divided by the number of layer-microbatch jobs of an
iteration, forward and backward counted as two (``2 x layers x microbatches``). Per worker count the
two alternate in rounds and each round compares its own two medians (``measure``).

    python bench/job_cost.py                     # 1, 2, 3 and 4 CPU workers
    python bench/job_cost.py --workers 2 --iters 50 --rounds 7 --json
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


class PlainLoop:
    """The reference: the same math as a plain PyTorch loop (same process, same inputs)."""

    def __init__(self, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model = build(args.layers, args.width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.xs, self.ys = x.chunk(args.microbatches), y.chunk(args.microbatches)

    def times(self, n: int) -> List[float]:
        """Seconds of each of ``n`` iterations."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            for xm, ym in zip(self.xs, self.ys):
                loss_fn(self.model(xm), ym).backward()
            self.opt.step()
            self.opt.zero_grad()
            out.append(time.perf_counter() - t0)
        return out


class RuntimeLoop:
    """The same iteration on RoundPipe with ``workers`` CPU workers (``forward_backward`` + asynchronous ``step``)."""

    def __init__(self, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, workers: int) -> None:
        import roundpipe
        from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

        roundpipe.configure(devices=f"cpu:{workers}")
        plan = ModelExecutePlan.layerwise(args.layers, "train") if args.plan == "layerwise" else None
        self.model = RoundPipe(
            build(args.layers, args.width),
            model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches, execute_plan=plan),
        )
        self.opt = torch.optim.SGD(self.model.optim_parameters(), lr=1e-4)
        self.x, self.y = x, y

    def times(self, n: int) -> List[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.model.forward_backward(input_args=(self.x,), label=self.y, loss_fn=loss_fn)
            self.model.step(lambda: (self.opt.step(), self.opt.zero_grad()))
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.model.synchronize()


def measure(args: argparse.Namespace) -> Dict[str, object]:
    """Per worker count: after the warm-up, ``--rounds`` rounds of ``--iters`` plain iterations followed by
    ``--iters`` runtime iterations; each round's ratio compares the medians of the same round, so a machine
    that drifts (a shared 2-core CI box does) moves both sides; the row is the median round."""
    torch.set_num_threads(1)
    x = torch.randn(args.rows * args.microbatches, args.width)
    y = torch.randn(args.rows * args.microbatches, args.width)
    jobs = 2 * args.layers * args.microbatches
    plain = PlainLoop(args, x, y)
    plain.times(args.warmup)
    rows = []
    for w in args.workers:
        rt = RuntimeLoop(args, x, y, w)
        rt.times(args.warmup)
        rounds = []
        for _ in range(args.rounds):
            ref = statistics.median(plain.times(args.iters)) / jobs
            rp = statistics.median(rt.times(args.iters)) / jobs
            rt.model.wait_optimizer()  # the last step off the plain loop's cores (untimed; changes no result)
            rounds.append((rp / ref, rp, ref))
        rt.close()
        ratio, rp, ref = sorted(rounds)[len(rounds) // 2]
        rows.append(
            {
                "workers": w,
                "runtime_us": rp * 1e6,
                "plain_us": ref * 1e6,
                "ratio": ratio,
                "round_ratios": [round(r[0], 3) for r in rounds],
            }
        )
    return {
        "layers": args.layers,
        "width": args.width,
        "microbatches": args.microbatches,
        "jobs_per_iteration": jobs,
        "rounds": args.rounds,
        "plan": args.plan,
        "rows": rows,
    }


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3, 4], help="CPU worker counts to measure")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument(
        "--plan",
        choices=("auto", "layerwise"),
        default="auto",
        help="auto: the planner's (on CPU workers one fused job of every layer); layerwise: one job per layer and "
        "pass, as a GPU plan's 30-40 jobs of one to three layers",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="iterations per side and round")
    p.add_argument("--rounds", type=int, default=7, help="alternating plain / runtime rounds per worker count")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if any(w < 1 for w in args.workers):
        p.error("--workers: each count must be at least 1")
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters: at least 1")
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.layers} x Linear({args.width}), {args.microbatches} microbatches, {args.plan} plan: "
        f"{result['jobs_per_iteration']} layer-microbatch jobs per iteration"
    )
    print("workers  runtime us/job  plain us/job  ratio  (each round's ratio)")
    for r in result["rows"]:  # type: ignore[union-attr]
        rounds = " ".join(f"{v:.2f}" for v in r["round_ratios"])
        print(f"{r['workers']:>7}  {r['runtime_us']:>14.1f}  {r['plain_us']:>12.1f}  {r['ratio']:>5.2f}x  ({rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
