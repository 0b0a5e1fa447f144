"""Training throughput: RoundPipe vs. the GPU-resident Hugging Face baseline on the Qwen3 workloads of
shared/bench/WORKLOADS.md, in one process, side by side.

Full fine-tune: random init, bf16 weights. RoundPipe keeps fp32 master weights and Adam state on the
host and steps asynchronously; the baseline keeps everything on the GPU with per-layer gradient
checkpointing and fused AdamW. Prints one row per system: tokens/s, TFLOP/s (6 x params x tokens),
peak GPU GiB, host memory, ratio to the baseline.

    python bench/train_bench.py --workload qwen3-1.7b                  # device machine
    python bench/train_bench.py --workload tiny --seq 64 --batch 4     # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import psutil
import torch

from roundpipe import flavors, settings

WORKLOADS = {
    # name: hidden, intermediate, layers, heads, kv heads, tied; the Qwen3 sizes from the package's one
    # table (roundpipe.flavors), and "tiny" for CPU smoke runs (head_dim 16, vocab 512)
    "tiny": (64, 128, 2, 4, 2, True),
    **{name: (f.hidden, f.intermediate, f.layers, f.heads, f.kv_heads, f.tied) for name, f in flavors.QWEN3.items()},
}


def build_model(name: str, device: str = "cpu", vocab: Optional[int] = None) -> torch.nn.Module:
    """A Qwen3 model of the workload's shape with random weights (matrices N(0, 0.02), norms 1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, inter, layers, heads, kv, tied = WORKLOADS[name]
    config = Qwen3Config(
        vocab_size=vocab or (512 if name == "tiny" else flavors.QWEN3_VOCAB),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=flavors.QWEN3_HEAD_DIM if name != "tiny" else 16,
        tie_word_embeddings=tied,
        max_position_embeddings=40960,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" or torch.cuda.is_available() else torch.float32
    # Built directly in the target dtype: an fp32 qwen3-32b would need 131 GB of host memory on the way.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if device != "cpu":
            with torch.device(device):
                model = Qwen3ForCausalLM(config)
        else:  # on the host: skeleton on meta, filled by all cores (Hugging Face's init is one core's normal_)
            with torch.device("meta"):
                model = Qwen3ForCausalLM(config)
            model.to_empty(device="cpu")
            model.tie_weights()  # to_empty gives the tied head its own empty tensor
            # Buffers (the rotary frequencies) are computed at construction: rebuild their modules on the host.
            for mname, mod in list(model.named_modules()):
                if any(True for _ in mod.buffers(recurse=False)):
                    parent, _, attr = mname.rpartition(".")
                    setattr(model.get_submodule(parent), attr, type(mod)(config=config))
            fill_random(model, seed=0)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype)


def fill_random(model: torch.nn.Module, seed: int, std: float = 0.02, chunk: int = 1 << 24) -> None:
    """Matrices and embeddings N(0, std), norm weights 1, biases 0 (Hugging Face's Qwen3 init), written
    by a thread per core: each 16M-element chunk has its own generator, so the result depends on the seed
    and the chunk size only, not on the thread count."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for name, param in model.named_parameters():
        flat = param.data.view(-1)
        if "norm" in name:
            flat.fill_(1.0)
        elif name.endswith(".bias"):
            flat.zero_()
        else:
            jobs.extend(flat[i : i + chunk] for i in range(0, flat.numel(), chunk))

    def fill(job: Tuple[int, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + job[0])
        job[1].normal_(0.0, std, generator=gen)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fill, enumerate(jobs)))


@dataclass
class Row:
    system: str
    tokens_per_s: float
    peak_gpu_gib: float
    host_gib: float
    note: str = ""


def timed(
    step: Callable[[], None],
    warmup: int,
    iters: int,
    sync: Callable[[], None],
    progress: Optional[Callable[[int, float], None]] = None,
) -> List[float]:
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress(i, times[-1])
    return times[warmup:]


def cuda_sync() -> None:
    """Wait for every GPU (RoundPipe spreads work over all visible devices)."""
    for d in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.synchronize(d)


def bench_baseline(args: argparse.Namespace, ids: torch.Tensor, liger: bool = False) -> Row:
    """The same model resident on one GPU, gradient checkpointing, fused AdamW on the GPU; with ``liger``
    Liger's kernels (fused RMSNorm, rotary, SwiGLU, linear cross-entropy: WORKLOADS.md baseline b).
    Liger patches transformers' Qwen3 classes for the rest of the process, so it runs last."""
    name = "gpu-resident HF baseline" + (" + Liger" if liger else "")
    if liger:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        except ImportError:
            return Row(name, float("nan"), float("nan"), float("nan"), "liger-kernel is not installed")
        apply_liger_kernel_to_qwen3()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        model = build_model(args.workload, "cuda")
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        # The same microbatches as RoundPipe (gradient accumulation; equal-sized microbatches, so the mean of
        # their mean losses is the batch's mean loss): same work, and the logits of one microbatch at a time.
        chunks = ids.cuda().chunk(args.baseline_microbatches)

        def step() -> None:
            for c in chunks:
                (model(input_ids=c, labels=c).loss / len(chunks)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = timed(step, args.warmup, args.iters, cuda_sync)
        row = Row(
            f"{name} ({len(chunks)} microbatches)",
            ids.numel() / (sum(times) / len(times)),
            torch.cuda.max_memory_allocated() / 1024**3,
            float("nan"),
        )
    except torch.OutOfMemoryError:
        row = Row(name, float("nan"), float("nan"), float("nan"), "does not fit on the GPU")
    finally:
        model = opt = None  # noqa: F841
        gc.collect()
        torch.cuda.empty_cache()
    return row


ITERATION = "train_bench iteration"  # the profiler range around the profiled iteration


def busy_fraction(step: Callable[[], None], trace: str = "", gpu_only: bool = False) -> str:
    """GPU compute busy share of one iteration (merged kernel time / wall time) per GPU, from the profiler;
    prints each GPU's longest idle gaps with the kernels around them, and writes a chrome trace when
    ``trace`` is set (gzipped if it ends in .gz). With ``RPP_PROFILER=torch`` it prints instead each
    GPU's idle time between layer groups, inside them, and before / after its kernels (``gpu_gaps``).
    ``gpu_only``: record device activity alone, so the host threads run at their own pace in the trace
    (kernels and copies per stream; no CPU ranges)."""
    from roundpipe.devices import profile

    # With RPP_PROFILER=torch RoundPipe marks each job (layer group) on its device thread; recording CPU
    # activity on all threads then lets gpu_gaps give every kernel its group (costs some host time).
    by_group = profile.PROFILER_TYPE == "torch"
    acts = [torch.profiler.ProfilerActivity.CUDA] + (
        [torch.profiler.ProfilerActivity.CPU] if (trace or by_group) and not gpu_only else []
    )
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True) if by_group else None
    with torch.profiler.profile(activities=acts, experimental_config=config) as prof:
        t0 = time.perf_counter()
        with torch.profiler.record_function(ITERATION):
            step()
            cuda_sync()
        wall = (time.perf_counter() - t0) * 1e6
    if gpu_only and trace:
        prof.export_chrome_trace(trace)
    elif trace or by_group:
        import json
        import tempfile

        from gpu_gaps import split_gaps

        path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        if by_group:  # kernels only: the job ranges also appear on the GPU timeline and are not work
            opener = __import__("gzip").open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                devices = split_gaps(json.load(f)["traceEvents"], window=ITERATION)
            if not trace:
                os.remove(path)
            for d in devices:
                print(d.describe(wall))
            shares = [f"{d.busy_us / wall:.0%}, idle between groups {d.between_us / wall:.1%}" for d in devices]
            return f"GPU busy {'/'.join(shares)} of {wall / 1e3:.0f} ms (CPU also profiled)"
    per_device: dict = {}
    copies: List[Tuple[float, float, str]] = []  # (start, end, name) of every copy, to show those inside a gap
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            per_device.setdefault(e.device_index, []).append((e.time_range.start, e.time_range.end, e.name))
        elif e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("Memcpy"):
            copies.append((e.time_range.start, e.time_range.end, e.name))
    t_first = min(k[0][0] for k in (sorted(v) for v in per_device.values())) if per_device else 0.0
    shares = []
    for dev, kernels in sorted(per_device.items()):
        kernels.sort()
        busy, end, last, gaps = 0.0, None, "", []
        for s, e, name in kernels:
            if end is None or s > end:
                if end is not None:
                    gaps.append((s - end, end - t_first, last, name))
                busy, end = busy + e - s, e
            elif e > end:
                busy, end = busy + e - end, e
            if e >= (end or e):
                last = name
        gaps.sort(reverse=True)
        total_gap = sum(g[0] for g in gaps)
        span = (kernels[-1][1] - kernels[0][0]) / 1e3
        print(
            f"GPU {dev}: busy {busy / wall:.0%} of the iteration; kernels from "
            f"{(kernels[0][0] - t_first) / 1e3:.1f} to "
            f"{(end - t_first) / 1e3:.1f} ms (span {span:.0f} ms); idle gaps: {len(gaps)} totalling "
            f"{total_gap / 1e3:.1f} ms; longest:"
        )
        for g, at, before, after in gaps[:12]:
            print(f"  {g / 1e3:7.2f} ms at {at / 1e3:8.1f} ms  after {before[:60]!r}  before {after[:60]!r}")
        if gaps and gaps[0][0] > 20e3:  # the copies running during the longest gap (did compute wait for one?)
            lo = gaps[0][1] + t_first
            inside = [c for c in copies if c[1] > lo and c[0] < lo + gaps[0][0]]
            print(
                f"  copies during the longest gap: {len(inside)}, "
                f"{sum(min(c[1], lo + gaps[0][0]) - max(c[0], lo) for c in inside) / 1e3:.1f} ms"
            )
            for c in sorted(inside, key=lambda c: c[0] - c[1])[:5]:
                print(f"    {(c[1] - c[0]) / 1e3:7.2f} ms from {(c[0] - t_first) / 1e3:8.1f} ms: {c[2][:50]}")
        shares.append(f"{busy / wall:.0%}")
    return f"GPU busy {'/'.join(shares)} of {wall / 1e3:.0f} ms"


class WaitLog:
    """Diagnostic (``--wait-log``): the RoundPipe threads' blocking waits on named events and semaphores
    (``roundpipe.devices.threads``) of at least ``min_ms``, per iteration: which thread waited for what, when
    (from the iteration's start) and how long."""

    def __init__(self, min_ms: float = 5.0) -> None:
        import threading

        from roundpipe.devices import threads

        self.min_s = min_ms / 1e3
        self.lock = threading.Lock()
        self.start = time.perf_counter()
        self.rows: List[Tuple[float, float, str, str]] = []
        log = self

        def timed_wait(orig: Callable[..., bool], name_of: Callable[[Any], str]) -> Callable[..., bool]:
            def wait(obj: Any, *a: Any, **k: Any) -> bool:
                t = time.perf_counter()
                ok = orig(obj, *a, **k)
                d = time.perf_counter() - t
                if d >= log.min_s:
                    with log.lock:
                        log.rows.append((t - log.start, d, threading.current_thread().name, name_of(obj)))
                return ok

            return wait

        threads.AnnotatedEvent.wait = timed_wait(threads.AnnotatedEvent.wait, lambda e: e.name)  # type: ignore[method-assign]
        threads.AnnotatedSemaphore.acquire = timed_wait(threads.AnnotatedSemaphore.acquire, lambda s: s.name)  # type: ignore[method-assign]

    def report(self, what: str) -> None:
        """Print the waits since the last report (longest first) and start the next iteration's clock."""
        with self.lock:
            rows, self.rows = sorted(self.rows, key=lambda r: -r[1]), []
        print(f"waits >= {self.min_s * 1e3:.0f} ms in {what}: {len(rows)}, {sum(r[1] for r in rows):.3f} s in all")
        for at, d, thread, name in rows[:10]:
            print(f"  wait {d * 1e3:7.1f} ms from {at * 1e3:7.1f} ms: {thread} on {name}")
        self.start = time.perf_counter()


class GcTimer:
    """Seconds the interpreter spends in garbage collection (all threads wait: it holds the interpreter
    lock), per generation, through ``gc.callbacks``; ``take()`` returns and resets the totals."""

    def __init__(self) -> None:
        self.totals = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.totals[info.get("generation", 2)] += time.perf_counter() - self._start

    def take(self) -> List[float]:
        out, self.totals = self.totals, [0.0, 0.0, 0.0]
        return out


def thread_cpu_seconds() -> Dict[str, float]:
    """CPU seconds used so far by each live thread, by name (the main thread, roundpipe's device and
    optimizer threads): a thread near 1 CPU second per wall second issues work as fast as it can."""
    out: Dict[str, float] = {}
    for th in threading.enumerate():
        try:
            out[th.name] = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        except (OSError, TypeError, AttributeError):
            pass
    return out


def host_allocs(step: Callable[[], None], iters: int = 2) -> None:
    """Where pinned blocks are created during ``iters`` more iterations: torch's host caching allocator
    calls cudaHostAlloc when no cached block fits (tens of ms for a large block, holding a driver lock
    the other device threads' launches wait for). Prints each creation's size and RoundPipe call site
    (``torch.empty(..., pin_memory=True)`` calls from Python; others show as the count's remainder)."""
    import collections
    import traceback

    stats = torch.cuda.host_memory_stats
    orig = torch.empty
    sites: collections.Counter = collections.Counter()

    def empty(*a: Any, **k: Any) -> torch.Tensor:
        if not k.get("pin_memory"):
            return orig(*a, **k)
        n0 = stats().get("num_host_alloc", 0)
        out = orig(*a, **k)
        if stats().get("num_host_alloc", 0) > n0:
            frames = [f for f in traceback.extract_stack(limit=16)[:-1] if "/roundpipe/" in f.filename][-3:]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
            sites[(out.numel() * out.element_size() >> 20, where)] += 1
        return out

    s0 = stats()
    torch.empty = empty  # type: ignore[assignment]
    try:
        for _ in range(iters):
            step()
        cuda_sync()
    finally:
        torch.empty = orig  # type: ignore[assignment]
    s1 = stats()
    n = s1.get("num_host_alloc", 0) - s0.get("num_host_alloc", 0)
    ms = (s1.get("host_alloc_time.total", 0) - s0.get("host_alloc_time.total", 0)) / 1e3
    print(
        f"host allocs over {iters} more iterations: {n} cudaHostAlloc, {ms:.1f} ms; from "
        f"torch.empty(pin_memory=True): {sum(sites.values())}"
    )
    for (mib, where), c in sites.most_common(10):
        print(f"  {c} x {mib} MiB at {where}")


def runtime_frames(names: Dict[int, str]) -> Iterator[Tuple[str, Any]]:
    """``(thread name, current frame)`` of the main thread and RoundPipe's threads (``names`` caches the
    names of thread ids seen before)."""
    for ident, frame in sys._current_frames().items():
        name = names.get(ident)
        if name is None:
            th = next((x for x in threading.enumerate() if x.ident == ident), None)
            name = names[ident] = th.name if th else str(ident)
        if name == "MainThread" or name.startswith("roundpipe"):
            yield name, frame


def sample_stacks(step: Callable[[], None], iters: int = 2, period_s: float = 0.002) -> None:
    """Where RoundPipe's threads spend one iteration: sample every thread's innermost RoundPipe frame every
    ``period_s`` and print the most frequent lines per thread (a line that calls into torch counts while
    the call runs, GIL held or not). The sampler's own oversleep measures how long a thread waits for
    the GIL: near zero when the GIL is free, milliseconds when Python threads queue for it."""
    import collections
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    late: List[float] = []
    names = {}
    done = threading.Event()

    def where(frame: Any) -> str:
        f, inner = frame, None
        while f is not None:  # innermost frame inside roundpipe/ (skip torch, stdlib)
            if "/roundpipe/" in f.f_code.co_filename and inner is None:
                inner = f
            f = f.f_back
        f = inner or frame
        return f"{os.path.relpath(f.f_code.co_filename, root)}:{f.f_lineno} {f.f_code.co_name}"

    def sampler() -> None:
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(period_s)
            late.append(time.perf_counter() - t - period_s)
            for name, frame in runtime_frames(names):
                counts[name][where(frame)] += 1

    th = threading.Thread(target=sampler, name="stack-sampler", daemon=True)
    th.start()
    for _ in range(iters):
        step()
    cuda_sync()
    done.set()
    th.join()
    late.sort()
    print(
        f"GIL probe: sampler oversleep mean {1e3 * sum(late) / max(len(late), 1):.2f} ms, "
        f"p90 {1e3 * late[int(0.9 * (len(late) - 1))]:.2f} ms, max {1e3 * late[-1]:.2f} ms over {len(late)} samples"
    )
    for name, c in sorted(counts.items()):
        total = sum(c.values())
        print(f"stacks of {name} ({total} samples):")
        for line, n in c.most_common(8):
            print(f"  {100 * n / total:5.1f}%  {line}")


def stack_timeline(step: Callable[[], None], bucket_ms: float = 20.0, period_s: float = 0.002) -> None:
    """What each RoundPipe thread does over one iteration, in time: sample every thread's innermost
    RoundPipe frame (and the innermost frame of all, e.g. a torch call) every ``period_s``, and print per
    ``bucket_ms`` window the most frequent one per thread. Finds what a thread runs while the GPU idles
    (a gap no event wait explains: the thread is busy, or waits in a C call or for the interpreter lock)."""
    import collections
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    samples: List[Tuple[float, str, str]] = []
    names: Dict[int, str] = {}
    done = threading.Event()

    def where(frame: Any) -> str:
        f, inner = frame, None
        while f is not None:
            if "/roundpipe/" in f.f_code.co_filename and inner is None:
                inner = f
            f = f.f_back
        g = inner or frame
        top = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
        return f"{os.path.relpath(g.f_code.co_filename, root)}:{g.f_lineno} {g.f_code.co_name} <- {top}"

    t0 = time.perf_counter()

    def sampler() -> None:
        while not done.is_set():
            time.sleep(period_s)
            t = 1e3 * (time.perf_counter() - t0)
            for name, frame in runtime_frames(names):
                samples.append((t, name, where(frame)))

    th = threading.Thread(target=sampler, name="stack-sampler", daemon=True)
    th.start()
    step()
    cuda_sync()
    done.set()
    th.join()
    buckets: Dict[Tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for t, name, w in samples:
        buckets[(name, int(t // bucket_ms))][w] += 1
    for name in sorted({n for n, _ in buckets}):
        print(f"timeline of {name} ({bucket_ms:.0f} ms windows; most frequent frame, share of samples):")
        for (n, b), c in sorted(buckets.items()):
            if n == name:
                w, k = c.most_common(1)[0]
                print(f"  {b * bucket_ms:7.0f} ms {100 * k / sum(c.values()):4.0f}%  {w}")


def simulated_ms(model: Any, plan: Any, n_mb: int) -> str:
    """The planner's model of one iteration (compute only, from the timer's per-layer estimates) on this
    many devices and on one: what the round-robin pipeline would take if transfers were free."""
    import roundpipe
    from roundpipe.planning.planner import simulate_iteration

    _, fwd_t, bwd_t = model.model_timer.get_estimate("fused")
    devices = roundpipe.get_num_devices()
    from roundpipe.runtime.partial_grads import split_enabled, split_parts

    parts = split_parts(devices, n_mb, False, split_enabled())
    sim = simulate_iteration("fused", plan.fwd_plan, plan.bwd_plan, fwd_t, bwd_t, devices, n_mb, parts)
    one = simulate_iteration("fused", plan.fwd_plan, plan.bwd_plan, fwd_t, bwd_t, 1, n_mb)
    mid_f, mid_b = fwd_t[1:-1] or fwd_t, bwd_t[1:-1] or bwd_t
    per_layer = (
        f"timer estimates per microbatch (ms): first layer fwd {fwd_t[0]:.2f} / bwd {bwd_t[0]:.2f}, "
        f"middle layers fwd {sum(mid_f) / len(mid_f):.2f} ({min(mid_f):.2f}-{max(mid_f):.2f}) / "
        f"bwd {sum(mid_b) / len(mid_b):.2f} ({min(mid_b):.2f}-{max(mid_b):.2f}), "
        f"last layer fwd {fwd_t[-1]:.2f} / bwd {bwd_t[-1]:.2f}"
    )
    return f"simulated compute-only iteration {sim:.0f} ms on {devices} device(s) ({one:.0f} ms on one); {per_layer}"


def fixed_plan(name: str, num_layers: int) -> Any:
    """A fixed plan for side-by-side runs: 'layerwise' (one layer per group), or 'fwdK': forward groups of K
    layers, backward one layer per group (how much the hand-overs between forward groups cost on 2 GPUs)."""
    from roundpipe.planning.plan import ModelExecutePlan

    if name == "layerwise":
        return ModelExecutePlan.layerwise(num_layers, "train")
    k = int(name[3:])
    fwd = [range(i, min(i + k, num_layers)) for i in range(0, num_layers, k)]
    return ModelExecutePlan(fwd, [range(i, i + 1) for i in range(num_layers)])


def _plan_name(value: str) -> str:
    if value in ("auto", "layerwise") or re.fullmatch(r"fwd[1-9][0-9]*", value):
        return value
    raise argparse.ArgumentTypeError(f"--plan: auto, layerwise or fwdK (forward groups of K layers), got {value!r}")


def bench_roundpipe(
    args: argparse.Namespace, ids: torch.Tensor, n_params: int, plan: str = "auto", fused: Optional[bool] = None
) -> Row:
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    from roundpipe.run_config import ResolvedRunConfig

    rss0 = psutil.Process().memory_info().rss
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_load = time.perf_counter()
    hf = build_model(args.workload, "cpu")
    if args.master == "bfloat16":  # bf16 masters are the bf16 weights (on CPU workers the model is fp32)
        hf = hf.to(torch.bfloat16)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        hf = get_peft_model(hf, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=targets))
        n_params = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    n_mb = args.microbatches or 2 * roundpipe.get_num_devices()
    # --master bfloat16: the optimizer steps the bf16 weights themselves (no fp32 copy on the host).
    optim_dtype = None if args.master == "bfloat16" else torch.float32
    model = roundpipe.wrap_model_to_roundpipe(
        hf, optim_dtype=optim_dtype, model_run_config=RoundPipeRunConfig(num_microbatch=n_mb), fused_kernels=fused
    )
    if plan != "auto":
        model.model_run_config = RoundPipeRunConfig(
            num_microbatch=n_mb, execute_plan=fixed_plan(plan, model.num_layers)
        )
    opt = roundpipe.optim.Adam(
        model.optim_parameters(),
        lr=1e-5,
        decoupled_weight_decay=True,
        state_dtype=args.optim_state,
        master=args.master,
        master_rounding=args.master_rounding,
    )

    # Whether the host optimizer keeps up: how long its step takes (on the optimizer thread) and how
    # long the main thread waits in model.step() for the previous step to release the layers.
    optim_s: List[float] = []
    wait_s: List[float] = []

    def step_fn() -> None:
        t = time.perf_counter()
        if not args.noop_step:
            opt.step()
        opt.zero_grad()
        optim_s.append(time.perf_counter() - t)

    call_s: List[float] = []  # per iteration: the training call (main thread), then model.step() below

    def step() -> None:
        t = time.perf_counter()
        model.train_step(input_ids=ids, labels=ids)
        call_s.append(time.perf_counter() - t)
        if args.no_step:  # diagnostic: the pipeline alone, gradients dropped
            model.zero_grad(set_to_none=True)
            return
        t = time.perf_counter()
        model.step(step_fn, is_async=not args.sync_step)
        wait_s.append(time.perf_counter() - t)

    rss: List[float] = []

    profiled = {int(k) for k in args.profile_timed.split(",") if k} if torch.cuda.is_available() else set()
    waits = WaitLog() if args.wait_log else None

    def tracked_step() -> None:
        timed_index = len(rss) - args.warmup + 1  # 1 = the first timed iteration
        if timed_index == args.stack_timeline:  # diagnostic: what each thread runs, in time, in this timed iteration
            stack_timeline(step)
        elif timed_index in profiled:  # diagnostic: this timed iteration's GPU idle gaps (device activity only)
            print(f"timed iteration {timed_index}: " + busy_fraction(step, "", True), flush=True)
        else:
            step()
        rss.append(psutil.Process().memory_info().rss / 1024**3)

    def progress(i: int, t: float) -> None:
        # Long runs report as they go (flushed), so a run cut short by a time limit still leaves numbers.
        if args.iters >= 20 and (i + 1) % 10 == 0:
            print(f"iteration {i + 1}: {t:.3f} s, host RSS {rss[-1]:.2f} GiB", flush=True)

    cpu0 = thread_cpu_seconds()

    first_step_s: List[float] = []

    # Pinned blocks torch's host caching allocator creates per iteration (cudaHostAlloc: slow, and it
    # holds a driver lock the device threads' launches wait for): when the pool stops growing.
    pinned_per_iter: List[Tuple[int, float]] = []
    last_host: List[Dict[str, Any]] = [torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}]

    def gpu_segments_total() -> int:
        """cudaMalloc'd segments so far, over all devices."""
        if not torch.cuda.is_available():
            return 0
        return sum(torch.cuda.memory_stats(d).get("segment.all.allocated", 0) for d in range(torch.cuda.device_count()))

    gpu_segments: List[int] = []  # segments created per iteration
    last_segments = [gpu_segments_total()]
    plans_seen: List[
        Any
    ] = []  # the model's cached plans after each iteration: (key, fwd groups, bwd groups, timer version)

    gc_timer = GcTimer()
    gc_per_iter: List[List[float]] = []

    def timed_progress(i: int, t: float) -> None:
        if waits is not None:
            waits.report(f"iteration {i + 1} (warm-up {args.warmup})")
        gc_per_iter.append(gc_timer.take())
        if args.gc_freeze and i == args.warmup - 1:  # diagnostic: no full collections of the model's objects later
            gc.collect()
            gc.freeze()
        if args.pause_after_warmup and i == args.warmup - 1:  # diagnostic: the warm-up's step done before timing
            model.wait_optimizer()
            time.sleep(args.pause_after_warmup)
        if torch.cuda.is_available():
            h = torch.cuda.host_memory_stats()
            prev = last_host[0]
            pinned_per_iter.append(
                (
                    h.get("num_host_alloc", 0) - prev.get("num_host_alloc", 0),
                    (h.get("host_alloc_time.total", 0) - prev.get("host_alloc_time.total", 0)) / 1e3,
                )
            )
            last_host[0] = h
            segs = gpu_segments_total()
            gpu_segments.append(segs - last_segments[0])
            last_segments[0] = segs
        plans_seen.append(
            sorted((str(k), len(p.fwd_plan), len(p.bwd_plan), v) for k, (p, v) in getattr(model, "_plans", {}).items())
        )
        if i == 0:  # issue "steady from the first step": model load (build + wrap) to the first step's end
            first_step_s.append(time.perf_counter() - t_load)
        if i == args.warmup - 1:  # warm-up done: count thread CPU time over the timed iterations only
            cpu0.update(thread_cpu_seconds())
        progress(i, t)

    times = timed(tracked_step, args.warmup, args.iters, cuda_sync, timed_progress)
    if pinned_per_iter:
        print(
            "pinned blocks created per iteration (warm-up first; count, ms in cudaHostAlloc): "
            + ", ".join(f"{n} {ms:.0f}" for n, ms in pinned_per_iter)
        )
    print(
        "seconds in garbage collection per iteration (warm-up first; generations 0/1/2): "
        + ", ".join("/".join(f"{x:.3f}" for x in g) for g in gc_per_iter)
    )
    if gpu_segments:
        print("GPU segments (cudaMalloc) per iteration (warm-up first): " + ", ".join(str(n) for n in gpu_segments))
    changes = [i for i in range(1, len(plans_seen)) if plans_seen[i] != plans_seen[i - 1]]
    print(
        f"plans after iteration 1: {plans_seen[0] if plans_seen else None}; "
        f"changed after iterations {[i + 1 for i in changes]}: {[plans_seen[i] for i in changes]}"
    )
    cpu1 = thread_cpu_seconds()
    per_iter = {
        k: (v - cpu0.get(k, 0.0)) / args.iters
        for k, v in cpu1.items()
        if k == "MainThread" or k.startswith("roundpipe")
    }
    print(
        f"thread CPU seconds per iteration (wall {sum(times) / len(times):.3f} s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per_iter.items()))
    )
    if args.iters >= 20:  # steadiness of host memory over a long run: RSS after warm-up vs at the end
        k = args.warmup
        print(
            f"host RSS GiB after iteration {k}: {rss[k]:.2f}, {k + args.iters // 2}: {rss[k + args.iters // 2]:.2f}, "
            f"{k + args.iters - 1}: {rss[-1]:.2f} (growth {100 * (rss[-1] / rss[k] - 1):+.1f}%)"
        )
    notes = (
        [busy_fraction(step, args.trace, args.trace_gpu_only) for _ in range(args.profile_iters)]
        if args.profile and torch.cuda.is_available()
        else []
    )
    note = " | ".join(notes) + "; " if notes else ""
    if args.sample_stacks:
        sample_stacks(step)
    if args.host_allocs and torch.cuda.is_available():
        host_allocs(step)
    model.synchronize()
    host = psutil.Process().memory_info().rss - rss0
    if torch.cuda.is_available():  # of that growth: torch's caching pinned allocator (activation copies)
        hs = torch.cuda.host_memory_stats()
        print(
            f"roundpipe host RSS growth {host / 1024**3:.2f} GiB; torch's pinned block cache holds "
            f"{hs.get('reserved_bytes.current', 0) / 1024**3:.2f} GiB of it "
            f"({hs.get('allocated_bytes.current', 0) / 1024**3:.2f} GiB in use)"
        )
    peak = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else float("nan")
    auto_plan = model.resolve_plan(
        ResolvedRunConfig(RoundPipeRunConfig(), model.model_run_config), "fused"
    )  # the model's own (auto) plan
    print(f"roundpipe plan: {auto_plan}")
    print(f"roundpipe {simulated_ms(model, auto_plan, n_mb)}")
    print(f"roundpipe per-iteration seconds: {[round(t, 3) for t in times]}")
    if first_step_s and len(times) >= 2:
        steady = statistics.median(times[1:])
        print(
            f"roundpipe model load to the end of the first step: {first_step_s[0]:.1f} s; first timed iteration "
            f"{times[0]:.3f} s = {times[0] / steady:.3f}x the median of the later ones ({steady:.3f} s)"
        )
    if optim_s:
        timed_steps = slice(args.warmup, args.warmup + args.iters)
        print(
            f"roundpipe optimizer step seconds: {[round(t, 3) for t in optim_s[timed_steps]]}; "
            f"main thread waited in model.step(): {[round(t, 3) for t in wait_s[timed_steps]]}"
        )
        # Where the first timed iteration's time goes: the warm-up steps, and per iteration (warm-up first)
        # the training call's return (its jobs all issued and the loss read) against the whole iteration.
        print(
            f"roundpipe warm-up step seconds: {[round(t, 3) for t in optim_s[: args.warmup]]}; training call "
            "seconds per "
            f"iteration (warm-up first): {[round(t, 3) for t in call_s]}"
        )
    what = (
        f"LoRA r={args.lora}, {n_params / 1e6:.1f}M trainable"
        if args.lora
        else f"{host / n_params:.1f} bytes/param host"
    )
    if (args.optim_state, args.master) != ("float32", "float32"):
        what += f", Adam state {args.optim_state}, master {args.master}"
    kernels = ", fused layers" if model.preset.fused_kernels else ", HF kernels"
    row = Row(
        f"roundpipe ({roundpipe.get_num_devices()} device, {plan} plan{kernels})",
        ids.numel() / (sum(times) / len(times)),
        peak,
        host / 1024**3,
        f"{note}{what}",
    )
    model = opt = hf = None  # noqa: F841
    gc.collect()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=0, help="default: 2 per device")
    p.add_argument("--baseline-microbatches", type=int, default=2, help="gradient accumulation steps of the baseline")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--sync-step", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--baselines",
        default="eager,liger",
        help="GPU-resident baselines, run after roundpipe: eager, liger (WORKLOADS.md)",
    )
    p.add_argument(
        "--compare-tiling", action="store_true", help="also run roundpipe with sequence tiling off (RPP_SEQ_TILE=0)"
    )
    p.add_argument(
        "--plan",
        default="auto",
        type=_plan_name,
        help="the execute plan: auto, layerwise (one layer per group) or fwdK (forward groups of K layers, backward "
        "one)",
    )
    p.add_argument("--compare-plans", action="store_true", help="also run roundpipe with the one-layer-per-group plan")
    p.add_argument("--compare-kernels", action="store_true", help="also run roundpipe with Hugging Face's own kernels")
    p.add_argument("--profile", action="store_true", help="report the GPU busy share of one iteration")
    p.add_argument(
        "--profile-iters", type=int, default=1, help="with --profile: profile this many iterations, one by one"
    )
    p.add_argument("--trace", default="", help="with --profile: write a chrome trace of that iteration here")
    p.add_argument(
        "--trace-gpu-only",
        action="store_true",
        help="with --trace: record GPU kernels and copies only (host threads unslowed)",
    )
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    p.add_argument(
        "--wait-log",
        action="store_true",
        help="diagnostic: the runtime threads' blocking waits (>= 5 ms) per iteration",
    )
    p.add_argument(
        "--profile-timed",
        default="",
        help="diagnostic: timed iterations (1 = the first) to profile on the GPU, e.g. 1,3: busy share, idle gaps",
    )
    p.add_argument(
        "--pause-after-warmup",
        type=float,
        default=0.0,
        help="diagnostic: wait for the optimizer, then sleep this long, before timing",
    )
    p.add_argument(
        "--gc-freeze", action="store_true", help="diagnostic: gc.collect(); gc.freeze() after the warm-up iterations"
    )
    p.add_argument(
        "--noop-step",
        action="store_true",
        help="diagnostic: the asynchronous step runs, without Adam (gradients zeroed only)",
    )
    p.add_argument("--no-step", action="store_true", help="diagnostic: skip the optimizer (pipeline alone)")
    p.add_argument(
        "--optim-state",
        default="float32",
        choices=["float32", "bfloat16", "int8"],
        help="Adam moments' dtype (docs/optimizer.md)",
    )
    p.add_argument(
        "--master",
        default="float32",
        choices=["float32", "bfloat16"],
        help="master weights (bfloat16: the weights themselves)",
    )
    p.add_argument(
        "--master-rounding",
        default="stochastic",
        choices=["stochastic", "kahan", "nearest"],
        help="with --master bfloat16",
    )
    p.add_argument(
        "--stack-timeline",
        type=int,
        default=0,
        metavar="K",
        help="diagnostic: the threads' most frequent frames per 20 ms window over timed iteration K (1 = the first)",
    )
    p.add_argument(
        "--sample-stacks",
        action="store_true",
        help="diagnostic: sample the threads' stacks over two more iterations (where they spend time, GIL waits)",
    )
    p.add_argument(
        "--host-allocs",
        action="store_true",
        help="diagnostic: where pinned host blocks are created over two more iterations",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="diagnostic: Python's thread switch interval in seconds (sys.setswitchinterval; 0: leave it)",
    )
    args = p.parse_args()
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)

    hidden, inter, layers, heads, kv, tied = WORKLOADS[args.workload]
    probe = build_model(args.workload, "meta")
    n_params = sum(t.numel() for t in {id(t): t for t in probe.parameters()}.values())
    vocab = probe.config.vocab_size
    del probe
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    if torch.cuda.is_available():
        ids = ids.pin_memory()
    rows: List[Row] = []
    t_load = time.perf_counter()
    rows.append(bench_roundpipe(args, ids, n_params, plan=args.plan))
    print(f"roundpipe: model build + wrap + warm-up + timed iterations {time.perf_counter() - t_load:.1f} s")
    if args.compare_plans:
        rows.append(bench_roundpipe(args, ids, n_params, plan="layerwise"))
    if args.compare_kernels:
        rows.append(bench_roundpipe(args, ids, n_params, fused=False))
    if args.compare_tiling:
        with settings.overridden(seq_tile=0):
            row = bench_roundpipe(args, ids, n_params)
            row.system += " untiled (RPP_SEQ_TILE=0)"
            rows.append(row)
    baselines: List[Row] = []
    if torch.cuda.is_available() and not args.skip_baseline and not args.lora:
        for kind in args.baselines.split(","):
            baselines.append(bench_baseline(args, ids, liger=kind.strip() == "liger"))
    rows = baselines + rows
    print(
        f"\n{args.workload}: {n_params / 1e9:.2f}B params, batch {args.batch} x {args.seq}, device "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.1f} GiB"
    )
    refs = [b for b in baselines if b.tokens_per_s == b.tokens_per_s] or rows[:1]
    print(
        "| system | tokens/s | TFLOP/s | peak GPU GiB | host GiB | "
        + " | ".join(f"ratio to {b.system.split(' (')[0]}" for b in refs)
        + " | note |"
    )
    print("|---|---|---|---|---|" + "---|" * len(refs) + "---|")
    for r in rows:
        ratios = " | ".join(f"{r.tokens_per_s / b.tokens_per_s:.2f}" for b in refs)
        print(
            f"| {r.system} | {r.tokens_per_s:,.0f} | {6 * n_params * r.tokens_per_s / 1e12:.1f} | "
            f"{r.peak_gpu_gib:.1f} | "
            f"{r.host_gib:.1f} | {ratios} | {r.note} |"
        )


if __name__ == "__main__":
    main()
