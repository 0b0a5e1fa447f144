"""The host Adam step against this host's memory bandwidth, and against torch's implementations.

``--mode bandwidth`` (default), three tables:

1. **Copy bandwidth**: ``dst.copy_(src)`` of a large fp32 tensor on one thread and on all threads (GB/s counts
   the bytes read plus the bytes written, as STREAM's copy does), and an in-place ``a.add_(b)`` (read two,
   write one: the access pattern of an in-place optimizer step, with no write-allocate reads).
2. **Adam per state layout**: ``roundpipe.optim.Adam`` over ``--params`` parameters in 4M-element tensors, for
   each layout (fp32 master and moments; the compact ones). Bytes per parameter count what one step must stream:
   read param, grad and every state tensor, write param and every state tensor, and the bf16 copy of the new
   weights where the runtime has the kernel write it for the upload (``bf16 out``). The fraction is the step's
   GB/s over the multi-threaded copy's.
3. **The way the runtime calls it**: the parameters of ``--layers`` mixture-of-experts layers (attention,
   router, experts) stepped per layer in forward order as a streamed step does (one call per layer, each layer's
   bf16 weights written in the pass), with the experts as one 3-d tensor per projection or as one tensor per
   expert; beside it the same parameters in one call, and the Python cost alone (the kernel replaced by a no-op):
   the per-call and per-tensor overhead.

``--mode impls``: roundpipe.optim.Adam against torch.optim.AdamW (fused, foreach), fp32 AdamW (weight decay
0.01, decoupled), over ``--sizes`` parameters in two layouts with the tensor counts of real models: ``dense``
(LLaMA-shaped decoder layers) and ``lora`` (rank-16 adapters on the seven projections: many small tensors).
The one-pass candidates run interleaved, round by round; foreach (temporaries as large as the model) runs
alone afterwards. ``--busy-cores N`` keeps N cores busy meanwhile (the runtime's main and device threads
share the host with the step).

``--mode staging``: the kernel's pass over fp32 masters from bf16 gradients with and without its fused bf16
write (the staging buffer of a declared step function), against the pass plus a separate staging copy (an
undeclared step function), in 12.6M-element tensors.

    python bench/host_step_bench.py                          # 32M parameters, all threads
    python bench/host_step_bench.py --params 400M --threads 12
    python bench/host_step_bench.py --params 1M --repeats 1 --copy-mib 16   # smoke test (CI)
    python bench/host_step_bench.py --mode impls --threads 2 --sizes 10M,100M --busy-cores 1
    python bench/host_step_bench.py --mode staging --sizes 400M --threads 12
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

import roundpipe
import roundpipe.optim
import roundpipe.optim.adam as adam_mod
from roundpipe.host.step import Publisher
from roundpipe.optim import Adam

BYTES_PER_PARAM = 28  # impls: one fp32 Adam step's floor (read p, g, m, v; write p, m, v)
TENSOR = 4 * 2**20  # elements per tensor in the layout table
HYPER = dict(lr=1e-4, weight_decay=0.01, decoupled_weight_decay=True)

# name, Adam's keyword arguments, parameter dtype, gradient dtype, bf16 output written by the kernel
LAYOUTS: List[Tuple[str, Dict[str, str], torch.dtype, torch.dtype, bool]] = [
    ("fp32 master+moments, fp32 grad", {}, torch.float32, torch.float32, False),
    ("fp32 master+moments, bf16 grad", {}, torch.float32, torch.bfloat16, False),
    ("fp32 master+moments, bf16 grad, bf16 out", {}, torch.float32, torch.bfloat16, True),
    ("bf16 moments, fp32 master", {"state_dtype": "bfloat16"}, torch.float32, torch.bfloat16, False),
    ("int8 moments, fp32 master", {"state_dtype": "int8"}, torch.float32, torch.bfloat16, False),
    ("bf16 moments, bf16 master (SR)", {"state_dtype": "bfloat16", "master": "bfloat16"}, torch.bfloat16,
     torch.bfloat16, False),
    ("int8 moments, bf16 master (SR)", {"state_dtype": "int8", "master": "bfloat16"}, torch.bfloat16,
     torch.bfloat16, False),
    ("int8 moments, bf16 master (Kahan)", {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "kahan"},
     torch.bfloat16, torch.bfloat16, False),
]  # fmt: skip


def parse_size(s: str) -> int:
    """``"32M"`` -> 32_000_000 (K, M, G/B suffixes)."""
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1], 1)
    return int(float(s.rstrip("KMBG")) * mult)


def median_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(mib: int, threads: int, warmup: int, repeats: int) -> Dict[str, float]:
    """GB/s of a copy on one thread and on ``threads``, and of an in-place add on ``threads``."""
    n = mib * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)  # fault the pages in
    out: Dict[str, float] = {}
    for label, th in (("copy_, 1 thread", 1), (f"copy_, {threads} threads", threads)):
        torch.set_num_threads(th)
        out[label] = 2 * n * 4 / median_s(lambda: dst.copy_(src), warmup, repeats) / 1e9
    out[f"add_ (in place), {threads} threads"] = 3 * n * 4 / median_s(lambda: dst.add_(src), warmup, repeats) / 1e9
    torch.set_num_threads(threads)
    return out


def make_params(
    shapes: Sequence[Tuple[int, ...]], p_dtype: torch.dtype, g_dtype: torch.dtype, seed: int = 0
) -> List[nn.Parameter]:
    """Parameters of ``shapes`` with random gradients (a bf16 gradient of an fp32 parameter as the runtime hands it)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(p_dtype))
        if g_dtype != p_dtype:
            p.grad_dtype = None  # a gradient of another dtype (torch >= 2.10)
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(g_dtype)
        params.append(p)
    return params


def streamed_bytes(opt: Adam, out: bool) -> int:
    """Bytes one step streams: read p, g and the state, write p and the state (and a bf16 copy if ``out``)."""
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = [t for k, t in opt.state[p].items() if k != "step" and isinstance(t, Tensor)]
            size = p.numel() * p.element_size()
            total += (
                2 * size + p.grad.numel() * p.grad.element_size() + 2 * sum(t.numel() * t.element_size() for t in state)
            )
            total += 2 * p.numel() if out else 0
    return total


class UnitPublisher(Publisher):
    """The runtime's per-layer call pattern without a model: ``roundpipe.optim.Adam`` asks it for the layer plan
    and each layer's bf16 weights, which the kernel writes in its pass (``host.step.Publisher``)."""

    def __init__(self, layers: List[List[Tensor]]) -> None:  # noqa: D107 - no LayerAttribute here
        self.units = [(None, ps) for ps in layers]  # type: ignore[misc]
        self.masters = layers
        self.unit_of = {id(m): k for k, ms in enumerate(layers) for m in ms}
        self.published = [False] * len(layers)
        self.weights = {id(p): torch.empty(p.shape, dtype=torch.bfloat16) for ps in layers for p in ps}

    def outputs(self, k: int) -> Dict[int, Tensor]:
        return {id(p): self.weights[id(p)] for p in self.masters[k]}

    def done(self, k: int, written: Sequence[Tensor] = ()) -> None:
        self.published[k] = True

    def step(self, opt: Adam) -> None:
        """One optimizer step through this plan, as the streamed step runs it."""
        self.published = [False] * len(self.masters)
        with self.active():
            opt.step()


def layout_table(args: argparse.Namespace, copy_gbps: float) -> None:
    n = max(1, args.params // TENSOR)
    size = min(TENSOR, args.params)
    print(f"\n### Adam per state layout: {n * size / 1e6:.1f}M parameters in {n} tensors, median of {args.repeats}\n")
    print(
        "| layout | ms / step | G params/s | bytes / param | GB/s | of copy bandwidth |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, kw, p_dtype, g_dtype, out in LAYOUTS:
        params = make_params([(size,)] * n, p_dtype, g_dtype)
        opt = Adam(params, **HYPER, **kw)  # type: ignore[arg-type]
        fn: Callable[[], object] = functools.partial(UnitPublisher([params]).step, opt) if out else opt.step
        sec = median_s(fn, args.warmup, args.repeats)
        nbytes = streamed_bytes(opt, out)
        total = n * size
        gbps = nbytes / sec / 1e9
        print(
            f"| {name} | {sec * 1e3:.1f} | {total / sec / 1e9:.2f} | {nbytes / total:.2f} | {gbps:.1f} "
            f"| {gbps / copy_gbps:.0%} |",
            flush=True,
        )


def moe_layer_shapes(per_layer: int, per_expert_tensors: bool) -> List[Tuple[int, ...]]:
    """One mixture-of-experts decoder layer of about ``per_layer`` parameters, Qwen3-MoE proportions (hidden h,
    experts of h * 3/8, 32 experts): attention, norms, router, then the experts' projections."""
    experts = 32
    h = 64
    while True:
        inter = 3 * h // 8
        total = 4 * h * h + 2 * h + experts * h + experts * 3 * inter * h
        if total >= per_layer or h >= 8192:
            break
        h += 64
    attn: List[Tuple[int, ...]] = [(h, h)] * 4 + [(h,), (h,), (experts, h)]
    if per_expert_tensors:
        return attn + [(inter, h), (inter, h), (h, inter)] * experts
    return attn + [(experts, 2 * inter, h), (experts, h, inter)]


def runtime_table(args: argparse.Namespace, copy_gbps: float) -> None:
    per_layer = max(1, args.params // args.layers)
    print(
        f"\n### The runtime's calls: {args.layers} MoE layers, fp32 masters, bf16 gradients, median of {args.repeats}\n"
    )
    print(
        "| experts as | tensors | M params | call pattern | ms / step | G params/s | GB/s | of copy bandwidth "
        "| Python only (ms) |\n|---|---:|---:|---|---:|---:|---:|---:|---:|"
    )
    for per_expert in (False, True):
        shapes = moe_layer_shapes(per_layer, per_expert)
        layers = [make_params(shapes, torch.float32, torch.bfloat16, seed=i) for i in range(args.layers)]
        flat = [p for ps in layers for p in ps]
        total = sum(p.numel() for p in flat)
        for pattern in ("one call", "per layer, bf16 out"):
            opt = Adam(flat, **HYPER)  # type: ignore[arg-type]
            per_layer_calls = pattern != "one call"
            fn: Callable[[], object] = (
                functools.partial(UnitPublisher(layers).step, opt) if per_layer_calls else opt.step
            )
            sec = median_s(fn, args.warmup, args.repeats)
            nbytes = streamed_bytes(opt, per_layer_calls)
            python_only = _python_only(fn, args)
            gbps = nbytes / sec / 1e9
            print(
                f"| {'one tensor per expert' if per_expert else '3-d tensors'} | {len(flat)} | {total / 1e6:.1f} "
                f"| {pattern} | {sec * 1e3:.1f} | {total / sec / 1e9:.2f} | {gbps:.1f} | {gbps / copy_gbps:.0%} "
                f"| {python_only * 1e3:.2f} |",
                flush=True,
            )


def _python_only(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Median seconds of ``fn`` with the C++ kernel replaced by a no-op: the Python side of a step."""
    real = adam_mod._adam_kernel

    def noop_kernel(*_a: object, **_k: object) -> Optional[Callable[..., int]]:
        return lambda *a: 0

    adam_mod._adam_kernel = noop_kernel  # type: ignore[assignment]
    try:
        return median_s(fn, 1, max(3, args.repeats))
    finally:
        adam_mod._adam_kernel = real


def numa_nodes() -> str:
    """``lscpu``'s NUMA line, if it has one."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("NUMA node(s)")), "unknown")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["bandwidth", "impls", "staging"], default="bandwidth")
    ap.add_argument("--params", type=parse_size, default=parse_size("32M"), help="bandwidth: parameters (32M)")
    ap.add_argument("--layers", type=int, default=4, help="bandwidth: MoE layers of the runtime table (4)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="bandwidth: MiB per copy buffer (1024; above the L3)")
    ap.add_argument("--table", choices=["copy", "layouts", "runtime"], default=None, help="bandwidth: one table")
    ap.add_argument("--sizes", default=None, help="impls, staging: comma-separated parameter counts (10M,100M; 88M)")
    ap.add_argument("--layouts", default="dense,lora", help="impls: comma-separated, dense, lora")
    ap.add_argument("--only", default=None, help="impls: comma-separated candidate names (substring match)")
    ap.add_argument("--busy-cores", type=int, default=0, help="impls: keep N cores busy with spinning processes")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per candidate (5; 20; 7)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per candidate (1; 3; 1)")
    args = ap.parse_args()
    defaults = {"bandwidth": ("", 5, 1), "impls": ("10M,100M", 20, 3), "staging": ("88M", 7, 1)}[args.mode]
    args.sizes = args.sizes or defaults[0]
    args.repeats = args.repeats if args.repeats is not None else defaults[1]
    args.warmup = args.warmup if args.warmup is not None else defaults[2]
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    adam_mod._adam_kernel("adam")  # build the kernels before timing anything
    adam_mod._adam_kernel("compact_adam")
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy_cores)]
    for proc in spinners:
        proc.start()
    busy = f", {args.busy_cores} core(s) kept busy" if args.busy_cores else ""
    print(
        f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), NUMA nodes: {numa_nodes()}{busy}\n"
    )
    try:
        if args.mode == "impls":
            names = list(CANDIDATES)
            if args.only:
                keys = [k.strip().lower() for k in args.only.split(",")]
                names = [n for n in names if any(k in n.lower() for k in keys)]
            run_table(args, names)
        elif args.mode == "staging":
            for size in args.sizes.split(","):
                staging_table(args, parse_size(size))
        else:
            bandwidth_tables(args, threads)
    finally:
        for proc in spinners:
            proc.terminate()
            proc.join()


def bandwidth_tables(args: argparse.Namespace, threads: int) -> None:
    """``--mode bandwidth``: the copy bandwidth, then the layouts and the runtime's calls against it."""
    bw = copy_bandwidth(args.copy_mib, threads, args.warmup, args.repeats)
    print(f"### Copy bandwidth ({args.copy_mib} MiB per buffer)\n\n| operation | GB/s |\n|---|---:|")
    for name, gbps in bw.items():
        print(f"| {name} | {gbps:.1f} |")
    copy_gbps = bw[f"copy_, {threads} threads"]
    if args.table in (None, "layouts"):
        layout_table(args, copy_gbps)
    if args.table in (None, "runtime"):
        runtime_table(args, copy_gbps)


if __name__ == "__main__":
    main()
