"""Long context: the longest sequence one optimizer step completes at, for a model and a training mode,
RoundPipe beside the GPU-resident Hugging Face baseline (Liger kernels, gradient checkpointing) at the
lengths where the baseline fits.

Batch 1, random token ids, labels = inputs (WORKLOADS.md's random Qwen3 shapes). Warm-up at a short
length first (compilation, pinned buffers), then one step per length in ascending order until a step
fails (out of GPU or host memory) or the time budget would be exceeded. Per length: s/step, tokens/s,
TFLOP/s with attention counted, peak GPU (max_memory_allocated), peak host RSS (sampled during the
step), and the estimate of ``roundpipe.planning.estimate`` beside the measured peaks.

FLOPs per step: 6 x trainable-or-frozen params x tokens for a full fine-tune (forward, backward of
activations and of weights), 4 x params x tokens with LoRA (no weight gradients of the frozen
matrices), plus causal attention 6 x layers x seq^2 x q_dim (forward 2 x seq^2 x q_dim over the causal
half of QK^T and PV, backward twice that). Recompute is not counted (it is the runtime's cost).

    python bench/long_context.py --workload qwen3-8b --lora 16 --lengths 65536,131072,262144
    RPP_GPU_MEMORY=24GiB python bench/long_context.py --workload qwen3-8b --lora 16 --lengths 65536,131072
    python bench/long_context.py --workload tiny --lengths 256,512 --skip-baseline     # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import WORKLOADS, add_lora, build_model, workload_config  # noqa: E402

MAX_POSITIONS = 1 << 21
"""The models' position limit here: the lengths measured go past the released models' 40,960."""


@dataclass
class Result:
    system: str
    seq: int
    ok: bool
    s_per_step: float = float("nan")
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    peak_gpu_gib: float = float("nan")
    peak_host_gib: float = float("nan")
    estimate_gpu_gib: float = float("nan")
    estimate_host_gib: float = float("nan")
    note: str = ""


def step_flops(model: torch.nn.Module, seq: int, lora: bool) -> float:
    """Model + attention FLOPs of one training step at batch 1 (see the module docstring)."""
    cfg = model.config
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    q_dim = cfg.num_attention_heads * cfg.head_dim
    return (4 if lora else 6) * n * seq + 6 * cfg.num_hidden_layers * seq * seq * q_dim


class PeakRSS:
    """Samples this process's resident memory every 50 ms while active: the peak of one step (the
    process-lifetime ``ru_maxrss`` would carry earlier, longer steps' peaks)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def __enter__(self) -> "PeakRSS":
        self.peak = self._proc.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _reset_gpu_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _gpu_peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def measure(system: str, seq: int, step: Callable[[torch.Tensor], None], flops: float, vocab: int) -> Result:
    """One step at ``seq`` tokens: its time, throughput and memory peaks; a failure is a result too."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    gc.collect()
    _reset_gpu_peak()
    try:
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            step(ids)
            dt = time.perf_counter() - t0
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "out of memory" not in str(exc).lower():
            raise
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return Result(system, seq, False, note=first[:200])
    return Result(system, seq, True, dt, seq / dt, flops / dt / 1e12, _gpu_peak_gib(), rss.peak / 2**30)


def build_roundpipe(workload: str, lora: int, layers: int = 0) -> Tuple[torch.nn.Module, Any]:
    """(the Hugging Face model, its RoundPipe): the workload (``layers``: a slice), LoRA of rank ``lora`` on
    all seven projections (0: full fine-tune), fp32 optimizer copies, one microbatch."""
    import roundpipe
    from roundpipe import RoundPipeRunConfig

    hf = build_model(workload, layers=layers, max_position_embeddings=MAX_POSITIONS)
    if lora:
        hf = add_lora(hf, lora)
    model = roundpipe.wrap_model_to_roundpipe(
        hf, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=1)
    )
    return hf, model


def roundpipe_results(args: argparse.Namespace, lengths: List[int]) -> List[Result]:
    import roundpipe

    hf, model = build_roundpipe(args.workload, args.lora, args.layers)
    if torch.cuda.is_available():  # what the runtime plans to: the GPU before this process holds anything on it
        from roundpipe.devices import device as device_mod

        _START_CAPACITY["bytes"] = float(device_mod.get_min_capacity())
    lora = args.lora > 0
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    base = hf.get_base_model() if lora else hf

    def step(ids: torch.Tensor) -> None:
        model.train_step(input_ids=ids, labels=ids)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    out = []
    warm = measure("roundpipe warm-up", args.warmup_len, step, step_flops(base, args.warmup_len, lora), vocab)
    print(f"warm-up at {args.warmup_len}: {'ok' if warm.ok else warm.note} ({warm.s_per_step:.1f} s)", flush=True)
    for seq in lengths:
        r = measure("roundpipe", seq, step, step_flops(base, seq, lora), vocab)
        est = estimate_for(args, seq)
        if est is not None:
            r.estimate_gpu_gib, r.estimate_host_gib = est
        if args.memory_detail and torch.cuda.is_available():
            print(f"peak GPU reserved at {seq}: {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB", flush=True)
        if args.memory_detail:
            plans = model.plan_cache.plans
            print(f"plan at {seq}: {[p[0] for p in plans.values()][-1:]}", flush=True)
        print(json.dumps(asdict(r)), flush=True)
        out.append(r)
        if not r.ok or (args.budget_s and r.s_per_step * 4.5 > args.budget_s - (time.perf_counter() - T0)):
            break  # the next length (about 4x the attention work) would not finish in the budget
    return out


#: The GPU capacity seen before the first step (``estimate_for``): measured after a step, the blocks the
#: run still holds would shrink it, and with it the room the estimate gives stage inputs on the GPU.
_START_CAPACITY: Dict[str, float] = {}


def estimate_for(args: argparse.Namespace, seq: int) -> Optional[tuple]:
    """The memory estimate (peak GPU GiB, peak host GiB) for this run."""
    from roundpipe.planning import estimate

    shape = estimate.ModelShape.from_config(workload_config(args.workload, args.layers))
    # The GPU the runtime plans to (RPP_GPU_MEMORY's cap included): on one GPU the stage inputs its room holds stay
    # there.
    gpu_bytes = _START_CAPACITY.get("bytes")
    e = estimate.estimate(shape, seq_len=seq, batch_size=1, lora_rank=args.lora, gpu_bytes=gpu_bytes)
    if getattr(args, "memory_detail", False):
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in e.gpu_parts.items())
        print(f"estimate at {seq}: GPU GiB {parts}; layers per stage {e.layers_per_stage}", flush=True)
    return e.peak_gpu_bytes / 2**30, e.peak_host_bytes / 2**30


def baseline_results(args: argparse.Namespace, lengths: List[int]) -> List[Result]:
    """GPU-resident Hugging Face with Liger kernels (WORKLOADS.md baseline b), per-layer checkpointing."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3()
        name = "gpu-resident HF + Liger"
    except ImportError:
        name = "gpu-resident HF (no Liger: liger-kernel not installed)"
    lora = args.lora > 0
    out: List[Result] = []
    try:
        model = build_model(args.workload, "cuda", max_position_embeddings=MAX_POSITIONS)
    except torch.OutOfMemoryError:
        return [Result(name, lengths[0], False, note="the model does not fit on the GPU")]
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    base = model
    if lora:
        model = add_lora(model, args.lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)

    def step(ids: torch.Tensor) -> None:
        ids = ids.cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    measure(name + " warm-up", args.warmup_len, step, 0.0, base.config.vocab_size)
    for seq in lengths:
        r = measure(name, seq, step, step_flops(base, seq, lora), base.config.vocab_size)
        print(json.dumps(asdict(r)), flush=True)
        out.append(r)
        if not r.ok:
            break
    model = opt = base = None  # noqa: F841
    gc.collect()
    torch.cuda.empty_cache()
    return out


T0 = time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="qwen3-8b")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    p.add_argument("--lengths", default="65536,131072,262144", help="comma-separated sequence lengths, ascending")
    p.add_argument("--warmup-len", type=int, default=4096)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--baseline-only", action="store_true")
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop before a length that would not finish within this many seconds of the start",
    )
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="a slice: the workload's width with this many decoder layers (0: all); the estimate is the slice's",
    )
    p.add_argument(
        "--memory-detail",
        action="store_true",
        help="also print, per length, the estimate's parts, the reserved GPU peak and the stage inputs the runtime "
        "kept on the device",
    )
    args = p.parse_args()
    if args.memory_detail:
        handler = logging.StreamHandler(sys.stdout)
        handler.addFilter(lambda rec: "backward-stage inputs on the device" in rec.getMessage())
        logging.getLogger("roundpipe").addHandler(handler)
        logging.getLogger("roundpipe").setLevel(logging.DEBUG)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    results: List[Result] = []
    if torch.cuda.is_available() and not args.skip_baseline:
        results += baseline_results(args, lengths)
    if not args.baseline_only:
        results += roundpipe_results(args, lengths)
    cap = os.environ.get("RPP_GPU_MEMORY", "")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"\n{args.workload} {'LoRA r=%d' % args.lora if args.lora else 'full fine-tune'}, batch 1, device "
        f"{device}{', GPU capped at ' + cap if cap else ''}"
    )
    print("| system | seq | s/step | tokens/s | TFLOP/s | peak GPU GiB (estimate) | peak host GiB (estimate) | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.ok:
            print(
                f"| {r.system} | {r.seq:,} | {r.s_per_step:.1f} | {r.tokens_per_s:,.0f} | {r.tflops:.0f} | "
                f"{r.peak_gpu_gib:.1f} ({r.estimate_gpu_gib:.1f}) | {r.peak_host_gib:.1f} "
                f"({r.estimate_host_gib:.1f}) | {r.note} |"
            )
        else:
            print(f"| {r.system} | {r.seq:,} | fails | | | | | {r.note} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
