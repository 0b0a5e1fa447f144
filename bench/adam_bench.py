"""Host Adam throughput: roundpipe.optim.Adam against torch.optim.AdamW (fused, foreach), fp32 on CPU.

Two layouts, with the tensor counts and sizes of real models:

* ``dense``: a stack of LLaMA-shaped decoder layers (q/k/v/o, gate/up/down, two norms): full training.
* ``lora``: rank-16 LoRA adapters on all seven projections of such layers: fine-tuning, many small
  tensors.

All candidates use AdamW semantics (weight_decay=0.01, decoupled). The one-pass candidates run
interleaved, round by round, so drifts in the machine's memory bandwidth hit them alike; foreach (which
allocates temporaries as large as the model every step) runs alone afterwards, so that its allocations do
not disturb the others. The table reports the median step time. One fp32 Adam step moves at least 28
bytes per parameter (read p, g, m, v; write p, m, v): the GB/s column is that floor over the step time.

    python bench/adam_bench.py                      # 10M and 100M params, both layouts, all cores
    python bench/adam_bench.py --threads 2 --sizes 10M,100M,300M --layouts dense --repeats 30
    python bench/adam_bench.py --threads 2 --busy-cores 1   # one core kept busy by another process

``--busy-cores N`` starts N spinning processes for the duration: in RoundPipe the optimizer thread
shares the host with the main and device threads, so its speed under contention matters too.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import platform
import statistics
import time
from typing import Dict, List, Tuple

import torch

import roundpipe.optim

BYTES_PER_PARAM = 28


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1], 1)
    return int(float(s.rstrip("KMBG")) * mult)


def layer_shapes(total: int, layout: str) -> List[Tuple[int, ...]]:
    """Decoder-layer (or LoRA adapter) shapes adding up to about ``total`` parameters."""
    if layout == "dense":
        h = 512 if total < 50 * 10**6 else 1024
    else:
        h = 2048 if total < 50 * 10**6 else 4096
    inter = (8 * h // 3 + 255) // 256 * 256
    if layout == "dense":
        layer = [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter), (h,), (h,)]
        tail = [(h,)]
    elif layout == "lora":
        r = 16
        projections = [(h, h)] * 4 + [(inter, h), (inter, h), (h, inter)]
        layer = [s for out_f, in_f in projections for s in ((r, in_f), (out_f, r))]
        tail = []
    else:
        raise ValueError(layout)
    per_layer = sum(torch.Size(s).numel() for s in layer)
    n_layers = max(1, round(total / per_layer))
    return layer * n_layers + tail


def make_optimizer(name: str, shapes: List[Tuple[int, ...]]) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kw = dict(lr=1e-4, weight_decay=0.01)
    if name.startswith("roundpipe"):
        return roundpipe.optim.Adam(params, decoupled_weight_decay=True, **kw)
    if name == "torch AdamW fused=True":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name == "torch AdamW foreach=True":
        return torch.optim.AdamW(params, foreach=True, **kw)
    raise ValueError(name)


CANDIDATES: Dict[str, str] = {
    # candidate name -> RPP_DEBUG_ADAM_IMPL while it steps
    "roundpipe Adam (cpp)": "cpp",
    "roundpipe Adam (torch fused path)": "torch",
    "torch AdamW fused=True": "",
    "torch AdamW foreach=True": "",
}
# Candidates that allocate step temporaries; timed alone, after the others.
ALONE = ("torch AdamW foreach=True",)


def timed_step(opt: torch.optim.Optimizer, impl: str) -> float:
    os.environ["RPP_DEBUG_ADAM_IMPL"] = impl or "auto"
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def bench_candidates(
    shapes: List[Tuple[int, ...]], names: List[str], repeats: int, warmup: int
) -> Dict[str, List[float]]:
    opts = {name: make_optimizer(name, shapes) for name in names}
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        for name in names:  # interleaved: one step of each candidate per round
            dt = timed_step(opts[name], CANDIDATES[name])
            if r >= warmup:
                times[name].append(dt)
    del opts
    gc.collect()
    return times


def bench_size(total: int, layout: str, names: List[str], repeats: int, warmup: int) -> List[Dict[str, object]]:
    shapes = layer_shapes(total, layout)
    n = sum(torch.Size(s).numel() for s in shapes)
    times: Dict[str, List[float]] = {}
    together = [name for name in names if name not in ALONE]
    if together:
        times.update(bench_candidates(shapes, together, repeats, warmup))
    for name in names:
        if name in ALONE:
            times.update(bench_candidates(shapes, [name], repeats, warmup))
    rows = []
    for name in names:
        med = statistics.median(times[name])
        rows.append(
            dict(
                name=name,
                layout=layout,
                n=n,
                tensors=len(shapes),
                ms=med * 1e3,
                best_ms=min(times[name]) * 1e3,
                pps=n / med,
            )
        )
    return rows


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,100M", help="comma-separated total parameter counts")
    ap.add_argument("--layouts", default="dense,lora", help="comma-separated: dense, lora")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated candidate names (substring match)")
    ap.add_argument("--busy-cores", type=int, default=0, help="keep N cores busy with spinning processes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(CANDIDATES)
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",")]
        names = [n for n in names if any(k in n.lower() for k in keys)]

    # Build the C++ kernel before timing anything.
    roundpipe.optim.adam._adam_kernel()

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy_cores)]
    for proc in spinners:
        proc.start()
    busy = f", {args.busy_cores} core(s) kept busy" if args.busy_cores else ""
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}){busy}, median of {args.repeats} steps\n"
    )
    try:
        run_table(args, names)
    finally:
        for proc in spinners:
            proc.terminate()
            proc.join()


def run_table(args: argparse.Namespace, names: List[str]) -> None:
    print(
        "| layout | params | tensors | implementation | step (ms, median) | best (ms) | params/s | GB/s (28 "
        "B/param) | vs fused |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for layout in args.layouts.split(","):
        for size in args.sizes.split(","):
            rows = bench_size(parse_size(size), layout.strip(), names, args.repeats, args.warmup)
            fused = next((r for r in rows if r["name"] == "torch AdamW fused=True"), None)
            for r in rows:
                rel = f"{r['pps'] / fused['pps']:.2f}x" if fused else "-"
                print(
                    f"| {r['layout']} | {r['n'] / 1e6:.1f}M | {r['tensors']} | {r['name']} | {r['ms']:.1f} "
                    f"| {r['best_ms']:.1f} | {r['pps'] / 1e6:.0f}M | {r['pps'] * BYTES_PER_PARAM / 1e9:.1f} | {rel} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
