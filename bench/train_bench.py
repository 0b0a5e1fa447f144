"""Training throughput: RoundPipe beside the GPU-resident Hugging Face baselines on the Qwen3 workloads of
shared/bench/WORKLOADS.md, in one process, side by side.

Random init, bf16 weights. RoundPipe keeps fp32 master weights and Adam state on the host and steps
asynchronously; the baselines keep everything on one GPU with per-layer gradient checkpointing and fused
AdamW, with Hugging Face's kernels (eager) or Liger's, or (``qlora``) Liger's over a bitsandbytes NF4 base.
Prints one row per system: tokens/s, TFLOP/s (6 x params x tokens), peak GPU GiB, host memory, ratio to each
baseline. ``--lora N``: LoRA (PEFT's, resident).

This module is also the benchmarks' shared part: the workloads, the model builder, LoRA, the timing loop.

    python bench/train_bench.py --workload qwen3-1.7b                  # device machine
    python bench/train_bench.py --workload tiny --seq 64 --batch 4     # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import re
import resource
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib.gaps import busy_fraction, cuda_sync, split_gaps  # noqa: E402, F401 (the other scripts import them here)

from roundpipe import flavors, settings  # noqa: E402
from roundpipe.utils import BASE_FORMATS  # noqa: E402  (the --base-format names, without torch)

MOE_WORKLOADS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, tie_word_embeddings=False,
        ),
    ),
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
            sliding_window=128, tie_word_embeddings=False,
        ),
    ),
}  # fmt: skip
"""The mixture-of-experts shapes (their published configs, random weights): family and config fields;
``--layers N`` takes a slice of the first N layers, ``--experts`` transformers' experts implementation."""
# GPT-OSS-120B: GPT-OSS-20B's widths, 36 layers of 128 experts (its published config).
MOE_WORKLOADS["gpt-oss-120b"] = (
    "gpt_oss",
    dict(MOE_WORKLOADS["gpt-oss-20b"][1], num_hidden_layers=36, num_local_experts=128),
)

WORKLOADS = ["tiny", "tiny-moe", *flavors.BUILTIN, *MOE_WORKLOADS]
"""The bench workloads: the Qwen3 and Llama-3.1 sizes of ``roundpipe.flavors``, the mixtures of experts, and
``tiny`` / ``tiny-moe`` for CPU smoke runs."""

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""LoRA's modules on a dense model: the seven decoder projections."""

MOE_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_LORA_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""LoRA on a mixture of experts (Qwen3-MoE, GPT-OSS): the attention projections, and the experts' fused 3-D
weights as PEFT adapts parameters (``target_parameters``); the router stays frozen."""

TINY_WORKLOAD = dict(tie_word_embeddings=True, max_position_embeddings=40960, attn_implementation="sdpa")
"""What the ``tiny`` workload adds to the shared tiny config (``roundpipe.models.configs.TINY``)."""


def workload_config(name: str, layers: int = 0, **overrides: Any) -> Any:
    """The config of a workload (``Qwen3Config``, ``LlamaConfig`` for the Llama-3.1 sizes); ``layers``: a slice
    with its width and this many decoder layers."""
    from roundpipe.cli.model_names import BUILTIN_MODELS
    from roundpipe.models.configs import config_class, flavor_config, tiny_config

    if layers:
        overrides["num_hidden_layers"] = layers
    if name == "tiny":
        return tiny_config("qwen3", **{**TINY_WORKLOAD, **overrides})
    if name == "tiny-moe":
        return tiny_config("qwen3_moe", **{**TINY_WORKLOAD, **overrides})
    if name in MOE_WORKLOADS:
        family, fields = MOE_WORKLOADS[name]
        fields = dict(fields, max_position_embeddings=131072, use_cache=False)
        if family != "gpt_oss":  # GPT-OSS's attention sinks have no sdpa path in transformers: its default
            fields["attn_implementation"] = "sdpa"
        return config_class(family)(**{**fields, **overrides})
    if flavors.BUILTIN[name].family == "qwen3":
        return flavor_config(name, **overrides)
    fields = dict(BUILTIN_MODELS[name], use_cache=False, attn_implementation="sdpa")  # the released rotary scaling
    return config_class("llama")(**{**fields, **overrides})


def family(name: str) -> str:
    """The ``model_type`` of a workload."""
    if name in ("tiny", "tiny-moe"):
        return "qwen3_moe" if name == "tiny-moe" else "qwen3"
    return MOE_WORKLOADS[name][0] if name in MOE_WORKLOADS else flavors.BUILTIN[name].family


def model_args(args: argparse.Namespace) -> Dict[str, Any]:
    """``build_model`` / ``workload_config`` arguments of ``--layers`` and ``--experts``."""
    experts = {"experts_implementation": args.experts} if getattr(args, "experts", None) else {}
    return dict(layers=getattr(args, "layers", 0), **experts)


def build_model(name: str, device: str = "cpu", layers: int = 0, **overrides: Any) -> torch.nn.Module:
    """A model of the workload's shape with random weights (matrices N(0, 0.02), norms 1), built in
    bf16 (fp32 on a machine without a GPU) without a first fp32 copy, on ``device`` (``meta``: shapes only)."""
    from transformers import AutoModelForCausalLM

    config = workload_config(name, layers, **overrides)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    if device == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied head its own empty tensor
    # The rotary tables are buffers computed at construction, not weights: build them for real (fp32).
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    fill_random(model, seed=0)
    return model


def lora_config(model_type: str, rank: int) -> Any:
    """``--lora``'s ``peft.LoraConfig`` for a model family (alpha = 2 x rank): the seven projections of a dense
    model; attention and the experts (:data:`EXPERT_LORA_PARAMETERS`) of a mixture of experts."""
    from peft import LoraConfig

    from roundpipe.models.families import family_of

    if getattr(family_of(model_type), "moe", False):
        return LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=MOE_LORA_MODULES, target_parameters=EXPERT_LORA_PARAMETERS
        )
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)


def lora_what(model_type: str) -> str:
    """What ``--lora`` adapts on a family, for the bench's note."""
    targets = lora_config(model_type, 1)
    return "on " + "/".join(sorted(targets.target_modules)) + "".join(f", {p}" for p in targets.target_parameters or [])


def layer_by_layer(args: argparse.Namespace) -> bool:
    """Whether roundpipe's loader builds the workload part by part (``build_random``: dense families, GPT-OSS);
    another mixture of experts is built whole, its base packed at the wrap."""
    from roundpipe.loading.skeleton import LOADABLE_MOE
    from roundpipe.models.families import family_of

    model_type = family(args.workload)
    return not getattr(family_of(model_type), "moe", False) or model_type in LOADABLE_MOE


def build_base_format(args: argparse.Namespace, base_format: str) -> torch.nn.Module:
    """The workload with LoRA (``--lora``) over random frozen weights drawn straight into ``base_format``
    (``roundpipe.loading.build_random``: a 70B base in NF4 needs about 40 GB of host memory, never 140)."""
    from roundpipe.loading import build_random

    torch.manual_seed(0)
    lora = lora_config(family(args.workload), args.lora)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return build_random(workload_config(args.workload, **model_args(args)), base_format, lora, dtype)


def base_host_bytes(model: torch.nn.Module, base_format: str, element_bytes: int = 2) -> int:
    """Host bytes of a frozen ``model``'s base (every weight but LoRA's) in ``base_format``, from its shapes alone
    (a meta-device model works): each weight ``default_targets`` packs at its packed size (never the head), every
    other one at ``element_bytes`` per element (bf16)."""
    from roundpipe.host.formats import default_targets, expert_layout
    from roundpipe.planning.frozen_terms import packed_weight_bytes

    targets = default_targets(model, base_format) if base_format != "bf16" else ()
    head = model.get_output_embeddings()
    seen, total = set(), 0
    for name, mod in model.named_modules():
        for attr, p in mod._parameters.items():
            if p is None or id(p) in seen or "lora_" in name:
                continue
            seen.add(id(p))
            transposed = expert_layout(mod, attr)
            if "experts" in targets and transposed is not None:
                experts, a, b = p.shape  # [experts, in, out] when transposed, else [experts, out, in]
                rows, cols = (b, a) if transposed else (a, b)
                total += experts * (packed_weight_bytes(rows, cols, base_format) - 16 * 4) + 16 * 4  # one table
            elif "linear" in targets and isinstance(mod, torch.nn.Linear) and attr == "weight" and mod is not head:
                total += packed_weight_bytes(p.shape[0], p.shape[1], base_format, element_bytes)
            else:
                total += p.numel() * element_bytes
    return total


def fill_random(model: torch.nn.Module, seed: int, std: float = 0.02, chunk: int = 1 << 24) -> None:
    """Matrices and embeddings N(0, std), norm weights 1, biases 0 (Hugging Face's Qwen3 init), written
    by a thread per core (one core's ``normal_`` would take minutes for an 8B model): each 16M-element
    chunk has its own generator, so the result depends on the seed and the chunk size only."""
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
        gen = torch.Generator(device=job[1].device).manual_seed(seed * 1_000_003 + job[0])
        job[1].normal_(0.0, std, generator=gen)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fill, enumerate(jobs)))


def add_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with PEFT's LoRA adapters of ``rank`` on :func:`lora_config`'s targets for its family."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model.config.model_type, rank))


def timed(
    step: Callable[[], None],
    warmup: int,
    iters: int,
    sync: Callable[[], None],
    progress: Optional[Callable[[int, float], None]] = None,
) -> List[float]:
    """Seconds of each of ``iters`` calls of ``step`` (each followed by ``sync``) after ``warmup`` calls."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress(i, times[-1])
    return times[warmup:]


def thread_cpu_seconds() -> Dict[str, float]:
    """CPU seconds used so far by each live thread, by name (the main thread, RoundPipe's device and
    optimizer threads): a thread near 1 CPU second per wall second issues work as fast as it can."""
    out: Dict[str, float] = {}
    for th in threading.enumerate():
        try:
            out[th.name] = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        except (OSError, TypeError, AttributeError):
            pass
    return out


def host_rss() -> int:
    """This process's resident memory in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


@dataclass
class Row:
    system: str
    tokens_per_s: float
    peak_gpu_gib: float
    host_gib: float
    note: str = ""


BASELINES = ("eager", "liger", "eager-nockpt", "liger-nockpt", "qlora", "qlora-nockpt")
"""The resident baselines: Hugging Face's kernels or Liger's, with per-layer checkpointing or (``-nockpt``) without;
``qlora``: Liger's over a bitsandbytes NF4 base (``benchlib.qlora``), ``--lora`` only."""


def bench_baseline(args: argparse.Namespace, ids: torch.Tensor, kind: str = "eager") -> Row:
    """The same model resident on one GPU, fused AdamW on the GPU, per-layer gradient checkpointing unless ``kind``
    ends in ``-nockpt``; ``liger``: Liger's kernels (fused RMSNorm, rotary, SwiGLU, linear cross-entropy). With
    ``--lora`` the model gets PEFT's adapters (the optimizer steps only those). Liger patches transformers' Qwen3
    classes for the rest of the process, so its baselines run last. ``qlora``: Liger's, the frozen linears in NF4."""
    qlora, checkpointing = kind.startswith("qlora"), not kind.endswith("-nockpt")
    liger = qlora or kind.startswith("liger")
    name = ("gpu-resident bitsandbytes NF4 QLoRA" if qlora else "gpu-resident HF baseline") + (" + Liger" * liger)
    name += "" if checkpointing else ", no checkpointing"
    name += f", PEFT LoRA r{args.lora}" if args.lora else ""
    if qlora and importlib.util.find_spec("bitsandbytes") is None:
        return Row(name, float("nan"), float("nan"), float("nan"), "bitsandbytes is not installed")
    if liger:
        patch = f"apply_liger_kernel_to_{family(args.workload)}"  # Liger's patch of this model family
        try:
            import liger_kernel.transformers as liger_kernels
        except ImportError:
            return Row(name, float("nan"), float("nan"), float("nan"), "liger-kernel is not installed")
        if not hasattr(liger_kernels, patch):
            return Row(name, float("nan"), float("nan"), float("nan"), f"liger-kernel has no {patch}")
        getattr(liger_kernels, patch)()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = opt = None
    try:
        if qlora:  # made layer by layer on the GPU, each layer's bf16 weights freed once quantized
            from benchlib.qlora import build_qlora, held_bytes

            meta = build_model(args.workload, "meta", **model_args(args))
            model = build_qlora(meta, lambda prefix, part: fill_random(part, seed=zlib.crc32(prefix.encode())), "cuda")
        else:
            model = build_model(args.workload, "cuda", **model_args(args))
        if checkpointing:
            model.gradient_checkpointing_enable()
        if args.lora:
            model = add_lora(model, args.lora)
            if checkpointing:
                model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
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
            f"base NF4 {held_bytes(model) / 1024**3:.3g} GiB on the GPU" if qlora else "",
        )
    except torch.OutOfMemoryError:
        row = Row(name, float("nan"), float("nan"), float("nan"), "does not fit on the GPU")
    finally:
        model = opt = None  # noqa: F841
        gc.collect()
        torch.cuda.empty_cache()
    return row


def fixed_plan(name: str, num_layers: int) -> Any:
    """A fixed plan for side-by-side runs: 'layerwise' (one layer per group), or 'fwdK': forward groups of K
    layers, backward one layer per group (what the hand-overs between forward groups cost)."""
    from roundpipe import ModelExecutePlan

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
    """RoundPipe on every visible device: the workload wrapped, Adam on the host, ``plan`` (auto or fixed),
    Hugging Face's kernels where ``fused`` is False, the frozen base of ``--lora`` in ``args.base_format`` (one)."""
    base_format = args.base_format
    import roundpipe
    from roundpipe import RoundPipeRunConfig

    rss0 = host_rss()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if args.lora and (base_format != "bf16" or args.workload in flavors.LLAMA3) and layer_by_layer(args):
        hf = build_base_format(args, base_format)
        n_params = sum(p.numel() for p in hf.parameters() if p.requires_grad)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB: the build's peak, the base's bytes
        print(f"built layer by layer, {base_format} base: {time.perf_counter() - t0:.1f} s, peak RSS {peak:.1f} GiB")
    else:
        hf = build_model(args.workload, "cpu", **model_args(args))
        if args.master == "bfloat16":  # bf16 masters are the bf16 weights (on CPU workers the model is fp32)
            hf = hf.to(torch.bfloat16)
        if args.lora:
            hf = add_lora(hf, args.lora)
            n_params = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    n_mb = args.microbatches or 2 * roundpipe.get_num_devices()
    # --master bfloat16: the optimizer steps the bf16 weights themselves (no fp32 copy on the host).
    optim_dtype = None if args.master == "bfloat16" else torch.float32
    run_config = RoundPipeRunConfig(num_microbatch=n_mb)
    model = roundpipe.wrap_model_to_roundpipe(
        hf,
        optim_dtype=optim_dtype,
        model_run_config=run_config,
        fused_kernels=fused,
        base_format=base_format,
        fp8=getattr(args, "fp8_on", False) or None,
    )
    from roundpipe.utils import host_nbytes

    # After the wrap, which packs the frozen weights of a base built whole (Qwen3-MoE) in place.
    base_bytes = sum(host_nbytes(p) for p in {id(p): p for p in hf.parameters() if not p.requires_grad}.values())
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

    def step() -> None:
        model.train_step(input_ids=ids, labels=ids)
        if args.no_step:  # the pipeline alone, gradients dropped: what the optimizer adds
            model.zero_grad(set_to_none=True)
            return
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=not args.sync_step)

    def progress(i: int, t: float) -> None:
        if (args.iters >= 20 and (i + 1) % 10 == 0) or t >= 5.0:  # long runs report as they go (flushed)
            mem = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else float("nan")
            msg = f"iteration {i + 1}: {t:.3f} s, host RSS {host_rss() / 2**30:.2f} GiB, GPU {mem / 2**30:.1f} GiB"
            print(msg, flush=True)

    times = timed(step, args.warmup, args.iters, cuda_sync, progress)
    note = busy_fraction(step, args.trace) + "; " if args.profile and torch.cuda.is_available() else ""
    model.synchronize()
    host = host_rss() - rss0
    peak = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else float("nan")
    print(f"roundpipe per-iteration seconds: {[round(t, 3) for t in times]}")
    print(f"roundpipe plan of the last iteration: {model.last_plan}")
    what = (
        f"LoRA r={args.lora} {lora_what(family(args.workload))}, {n_params / 1e6:.1f}M trainable"
        if args.lora
        else f"{host / n_params:.1f} bytes/param host"
    )
    if (args.optim_state, args.master) != ("float32", "float32"):
        what += f", Adam state {args.optim_state}, master {args.master}"
    if args.lora:
        what += f", base {base_format} {base_bytes / 1024**3:.3g} GiB on the host"
    kernels = ", fused kernels" if model.preset.fused_kernels else ", HF kernels"
    base = (f", {base_format} base" if args.lora else "") + (", fp8 GEMMs" if getattr(args, "fp8_on", False) else "")
    row = Row(
        f"roundpipe ({roundpipe.get_num_devices()} device, {plan} plan{kernels}{base})",
        ids.numel() / (sum(times) / len(times)),
        peak,
        host / 1024**3,
        f"{note}{what}",
    )
    model = opt = hf = None  # noqa: F841
    gc.collect()
    return row


def print_table(args: argparse.Namespace, n_params: int, rows: List[Row], baselines: List[Row]) -> None:
    """The results as a Markdown table, each row's ratio to every baseline that ran."""
    print(
        f"\n{args.workload}: {n_params / 1e9:.2f}B params, batch {args.batch} x {args.seq}, device "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.1f} GiB"
    )
    refs = [b for b in baselines if b.tokens_per_s == b.tokens_per_s] or rows[:1]
    ratio_heads = " | ".join(f"ratio to {b.system.split(' (')[0]}" for b in refs)
    print(f"| system | tokens/s | TFLOP/s | peak GPU GiB | host GiB | {ratio_heads} | note |")
    print("|---|---|---|---|---|" + "---|" * len(refs) + "---|")
    for r in rows:
        ratios = " | ".join(f"{r.tokens_per_s / b.tokens_per_s:.2f}" for b in refs)
        print(
            f"| {r.system} | {r.tokens_per_s:,.0f} | {6 * n_params * r.tokens_per_s / 1e12:.1f} | "
            f"{r.peak_gpu_gib:.1f} | {r.host_gib:.1f} | {ratios} | {r.note} |"
        )


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=0, help="default: 2 per device")
    p.add_argument("--baseline-microbatches", type=int, default=2, help="gradient accumulation steps of the baseline")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--sync-step", action="store_true", help="synchronous optimizer steps (is_async=False)")
    p.add_argument("--no-step", action="store_true", help="skip the optimizer: the pipeline alone")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--only-baselines", action="store_true", help="the resident baselines alone, no roundpipe rows")
    p.add_argument(
        "--baselines",
        default="eager,liger",
        help="GPU-resident baselines, run after roundpipe, comma-separated: " + ", ".join(BASELINES),
    )
    p.add_argument(
        "--plan", default="auto", type=_plan_name, help="auto, layerwise or fwdK (forward groups of K layers)"
    )
    p.add_argument("--compare-plans", action="store_true", help="also run roundpipe with the one-layer-per-group plan")
    p.add_argument("--compare-kernels", action="store_true", help="also run roundpipe with Hugging Face's own kernels")
    p.add_argument("--compare-tiling", action="store_true", help="also run roundpipe untiled (RPP_SEQ_TILE=0)")
    p.add_argument(
        "--profile", action="store_true", help="profile one more iteration: each GPU's busy share, idle gaps"
    )
    p.add_argument("--trace", default="", help="with --profile: write a chrome trace of that iteration here (.gz ok)")
    p.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on the projections, MoE: attention and experts (0: full)"
    )
    p.add_argument("--optim-state", default="float32", choices=["float32", "bfloat16", "int8"], help="Adam moments")
    p.add_argument("--master", default="float32", choices=["float32", "bfloat16"], help="bfloat16: the weights")
    p.add_argument("--master-rounding", default="stochastic", choices=["stochastic", "kahan", "nearest"])
    p.add_argument(
        "--base-format", default="bf16", help="--lora's frozen base: bf16, fp8, int8, nf4; bf16,nf4: side by side"
    )
    p.add_argument("--layers", type=int, default=0, help="a slice: the first N decoder layers at full width")
    p.add_argument("--experts", choices=["grouped_mm", "batched_mm", "eager"], help="transformers' MoE experts")
    p.add_argument(
        "--fp8",
        default="off",
        choices=["off", "on", "both"],
        help="roundpipe's FP8 GEMMs (fp8=True); both: side by side",
    )
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    formats = args.base_format.split(",")
    if set(formats) - set(BASE_FORMATS) or (formats != ["bf16"] and not args.lora):
        raise SystemExit(f"--base-format: a comma list of {', '.join(BASE_FORMATS)}; any but bf16 needs --lora N")
    kinds = [k.strip() for k in args.baselines.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(BASELINES))
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown}; choose from {', '.join(BASELINES)}")
    probe = build_model(args.workload, "meta", **model_args(args))
    if any(k.startswith("qlora") for k in kinds) and not args.skip_baseline:
        from benchlib.qlora import qlora_refusal

        if why := qlora_refusal(probe, args.lora):
            raise SystemExit(f"--baselines qlora: {why}")
    n_params = sum(t.numel() for t in {id(t): t for t in probe.parameters()}.values())
    ids = torch.randint(0, probe.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    del probe
    if torch.cuda.is_available():
        ids = ids.pin_memory()
    t_load = time.perf_counter()
    if args.workload == "llama3.1-70b" and "bf16" in formats:
        raise SystemExit(f"{args.workload}: {2 * n_params / 1024**3:.0f} GiB in bf16; use --base-format nf4")
    fp8s = {"off": [False], "on": [True], "both": [False, True]}[args.fp8]  # one row per base format and fp8
    # LoRA's FP8 GEMMs read a base stored as fp8: with --fp8 both, the other bases run without them.
    combos = [(f, x) for f in formats for x in fp8s if not (x and args.lora and f != "fp8" and args.fp8 == "both")]
    each = [argparse.Namespace(**{**vars(args), "base_format": f, "fp8_on": x}) for f, x in combos]
    rows = [] if args.only_baselines else [bench_roundpipe(a, ids, n_params, plan=args.plan) for a in each]
    args = each[0]  # the comparisons below: the first format
    print(f"roundpipe: model build + wrap + warm-up + timed iterations {time.perf_counter() - t_load:.1f} s")
    if args.compare_plans:
        rows.append(bench_roundpipe(args, ids, n_params, plan="layerwise"))
    if args.compare_kernels:
        rows.append(bench_roundpipe(args, ids, n_params, fused=False))
    if args.compare_tiling:
        with settings.overridden(seq_tile=0):
            rows.append(bench_roundpipe(args, ids, n_params))
            rows[-1].system += " untiled (RPP_SEQ_TILE=0)"
    baselines: List[Row] = []
    fits = not torch.cuda.is_available() or 2 * n_params <= torch.cuda.get_device_properties(0).total_memory
    if not fits and not args.skip_baseline:  # the QLoRA baselines hold the base in NF4: they run
        print(f"bf16 baselines skipped: {args.workload} in bf16 ({2 * n_params / 1024**3:.0f} GiB) exceeds the GPU")
        kinds = [k for k in kinds if k.startswith("qlora")]
    if torch.cuda.is_available() and not args.skip_baseline:
        # Liger patches the model classes for the rest of the process: its baselines run after the others.
        last = sorted(kinds, key=lambda k: k.startswith(("liger", "qlora")))
        baselines = [bench_baseline(args, ids, kind) for kind in last]
    print_table(args, n_params, baselines + rows, baselines)


if __name__ == "__main__":
    main()
