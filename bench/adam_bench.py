"""The host optimizer step on CPU, in three modes.

``--mode impls`` (default): roundpipe.optim.Adam against torch.optim.AdamW (fused, foreach), fp32.

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

``--mode compact``: the compact Adam state (bf16 or int8 moments, bf16 masters with stochastic, Kahan or
nearest rounding) against the fp32 C++ Adam, each over the same parameter count in 4M-element tensors.
The fp32 baseline reads fp32 gradients; ``fp32 Adam, bf16 grad`` is the RoundPipe case (bf16 host
gradients of fp32 masters); compact modes with a bf16 master read bf16 gradients (the model's own).

``--mode staging``: the C++ kernel's Adam pass over fp32 masters from bf16 gradients with and without its
fused bf16 write (each work item rounds its updated masters into the gradient buffer, the staging buffer
of a declared step function, while they are in cache), against the pass plus a separate staging copy
(what an undeclared step function gets), in 12.6M-element tensors (one qwen3-1.7b MLP projection).

Every mode runs its candidates interleaved, one step each per round, and reports medians.

    python bench/adam_bench.py --mode compact --threads 2          # 40M params
    python bench/adam_bench.py --mode staging --sizes 400M --threads 12
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

import roundpipe
import roundpipe.optim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
    roundpipe.configure(debug_adam_impl=impl or "auto")
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


def compact_table(args: argparse.Namespace, total: int) -> None:
    """``--mode compact``: the compact state's candidates against the fp32 C++ Adam."""
    tensor = 4 * 2**20
    n = max(1, total // tensor) * tensor
    steps = {name: compact_step(n, tensor, kw, pd, gd) for name, kw, pd, gd in COMPACT}
    times = interleaved(steps, args.warmup, args.repeats)
    base = statistics.median(times[COMPACT[0][0]])
    print(f"{n / 1e6:.0f}M params, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| candidate | ms / step | G params/s | vs fp32 C++ Adam |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {n / med / 1e9:.2f} | {base / med:.2f}x |")


COMPACT: List[Tuple[str, Dict[str, str], torch.dtype, torch.dtype]] = [
    # name, Adam's keyword arguments, parameter dtype, gradient dtype
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


def compact_step(
    total: int, tensor: int, kw: Dict[str, str], p_dtype: torch.dtype, g_dtype: torch.dtype
) -> Callable[[], object]:
    """A step function over ``total`` parameters of one compact candidate."""
    ps = []
    for _ in range(max(1, total // tensor)):
        p = nn.Parameter(torch.randn(tensor).to(p_dtype))
        if g_dtype != p_dtype:
            p.grad_dtype = None
        p.grad = torch.randn(tensor).to(g_dtype)
        ps.append(p)
    opt = roundpipe.optim.Adam(ps, lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True, **kw)  # type: ignore[arg-type]
    return opt.step


def interleaved(steps: Dict[str, Callable[[], object]], warmup: int, repeats: int) -> Dict[str, List[float]]:
    """Seconds of each candidate's calls, one call of each per round, after ``warmup`` rounds."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for r in range(warmup + repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def staging_table(args: argparse.Namespace, total: int) -> None:
    """``--mode staging``: the Adam pass alone, with its fused bf16 write, and followed by the staging copy."""
    from roundpipe.optim.adam import _adam_kernel
    from roundpipe.optim.fp32_step import KernelBatch

    tensor = 12_582_912  # one 6144 x 2048 projection (qwen3-1.7b's MLP)
    group = dict(betas=(0.9, 0.999), lr=1e-5, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    group["decoupled_weight_decay"] = False
    n = max(1, round(total / tensor))
    kernel = _adam_kernel("adam")
    if kernel is None:
        raise SystemExit("the C++ Adam kernel could not be built on this machine (see roundpipe.optim.build)")
    masters = [torch.randn(tensor) for _ in range(n)]
    grads = [torch.randn(tensor).bfloat16() for _ in range(n)]  # also the staging buffers, as in the runtime
    m = [torch.zeros(tensor) for _ in range(n)]
    v = [torch.zeros(tensor) for _ in range(n)]
    counts = [torch.zeros(()) for _ in range(n)]

    def adam(fused: bool) -> None:
        batch = KernelBatch()
        for i in range(n):
            batch.add(masters[i], grads[i], m[i], v[i], None, counts[i])
            batch.add_output(grads[i] if fused else None)
        batch.run(kernel, group)

    def staged() -> None:
        adam(False)
        for g, p in zip(grads, masters):
            g.copy_(p)  # stage_params: torch's rounding copy, one call per tensor

    steps: Dict[str, Callable[[], object]] = {
        "Adam pass alone": lambda: adam(False),
        "Adam pass, bf16 write fused (declared step function)": lambda: adam(True),
        "Adam pass, then the staging copy (undeclared)": staged,
    }
    times = interleaved(steps, max(args.warmup, 1), args.repeats)  # a first round warms the pages, the threads
    print(
        f"{n * tensor / 1e6:.0f}M parameters in {n} tensors, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    base = statistics.median(times["Adam pass alone"])
    print("| candidate | ms / step | vs the pass alone |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1e3 * med:.1f} | {med / base:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["impls", "compact", "staging"], default="impls")
    ap.add_argument("--sizes", default=None, help="comma-separated parameter counts (default 10M,100M; 40M; 88M)")
    ap.add_argument("--layouts", default="dense,lora", help="impls: comma-separated, dense, lora")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20; 10; 7)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3; 1; 1)")
    ap.add_argument("--only", default=None, help="impls: comma-separated candidate names (substring match)")
    ap.add_argument("--busy-cores", type=int, default=0, help="keep N cores busy with spinning processes")
    args = ap.parse_args()
    defaults = {"impls": ("10M,100M", 20, 3), "compact": ("40M", 10, 1), "staging": ("88M", 7, 1)}[args.mode]
    args.sizes = args.sizes or defaults[0]
    args.repeats = args.repeats if args.repeats is not None else defaults[1]
    args.warmup = args.warmup if args.warmup is not None else defaults[2]
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
        if args.mode == "impls":
            run_table(args, names)
        for size in args.sizes.split(",") if args.mode != "impls" else []:
            (compact_table if args.mode == "compact" else staging_table)(args, parse_size(size))
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
