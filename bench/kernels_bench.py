"""One Qwen3 decoder layer: Hugging Face eager vs RoundPipe's fused kernels (roundpipe.models.kernels), and with
``--tiling`` sequence tiling (roundpipe.models.tiling) vs the whole sequence.

Times what RoundPipe runs per layer and microbatch: a forward without grad (the pipelined forward), and a forward
with grad + backward (the recompute and backward), for Hugging Face's layer and the fused one (the whole layer as one
op). Besides the time until the GPU is
done it reports the host CPU time spent issuing the work (the calling thread's CPU time): on several GPUs the device
threads share one interpreter lock, so that is what bounds them. Default shape: Qwen3-1.7B, 4 x 4096 tokens, bf16,
sdpa. Checks that the fused layer's output and gradients (input and every parameter) agree with Hugging Face's within
bf16 rounding: both are compared with an fp32 copy of the layer, and the fused error must not exceed the eager one by
more than a rounding margin.

``--tiling`` runs, through the preset's ``DecoderLayerStage``, the forward without grad, then the recompute with grad
(inside ``RecomputeCtx``) and its backward of ``--layers`` layers, one sequence per length of ``--seqs``: the time
(minimum of ``--iters`` rounds, the variants in turn within each round so clock drift affects them alike) and the peak
GPU memory above the parameters, the input and the output gradient, untiled (``RPP_SEQ_TILE=0``) and tiled, for full
fine-tuning and LoRA (r=16 on every projection).

    python bench/kernels_bench.py                 # device machine, < 60 s with compilation
    python bench/kernels_bench.py --cpu --tiny    # CPU smoke (tests/test_kernels.py runs it)
    python bench/kernels_bench.py --tiling --fused --seqs 32768,65536 --variants untiled,16384,8192   # Qwen3-8B layer
    python bench/kernels_bench.py --tiling --cpu --tiny --seqs 64,128 --tile 32 --iters 1           # smoke
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from roundpipe import settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import LORA_TARGETS, WORKLOADS, workload_config  # noqa: E402


def random_layers(config: Any, layers: int = 1) -> List[nn.Module]:
    """``layers`` seeded Qwen3 decoder layers of ``config``: norms around 1 (not exactly 1, so their weight
    multiply matters), matrices N(0, 0.02)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(0)
    out = []
    for i in range(layers):
        layer = Qwen3DecoderLayer(config, layer_idx=i)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
        out.append(layer)
    return out


def build_layer(shape: str, dtype: torch.dtype, device: torch.device) -> Tuple[nn.Module, nn.Module, object]:
    """A randomly initialised Qwen3 decoder layer, its rotary embedding and config."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = workload_config(shape, layers=1)
    layer = random_layers(config)[0]
    return layer.to(device=device, dtype=dtype), Qwen3RotaryEmbedding(config).to(device), config


def layer_inputs(
    layer_config: object, rotary: nn.Module, batch: int, seq: int, dtype: torch.dtype, device: torch.device
):
    """Hidden states, (cos, sin) and the causal mask as the RoundPipe prefix builds them."""
    from transformers.masking_utils import create_causal_mask

    from roundpipe.models.preset import _call_mask_function

    hidden = layer_config.hidden_size
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, seq, hidden, generator=g).to(device=device, dtype=dtype)
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    cos, sin = rotary(x, position_ids)
    mask = _call_mask_function(
        create_causal_mask,
        config=layer_config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=None,
        position_ids=position_ids,
    )
    grad_out = torch.randn(batch, seq, hidden, generator=g).to(device=device, dtype=dtype)
    return x, (cos, sin), mask, position_ids, grad_out


def run_layer(
    layer: nn.Module,
    x: torch.Tensor,
    pos: Tuple[torch.Tensor, torch.Tensor],
    mask,
    position_ids,
    grad_out=None,
    collect=True,
):
    """Forward (and backward when ``grad_out`` is given); returns output, input grad, parameter grads
    (the latter only with ``collect``)."""
    x = x.detach().requires_grad_(grad_out is not None)
    out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pos, use_cache=False)
    out = out[0] if isinstance(out, tuple) else out
    if grad_out is None:
        return out, None, {}
    out.backward(grad_out)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()} if collect else {}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(got, ref) -> Dict[str, float]:
    """Relative error of output, input grad and each parameter grad of ``got`` w.r.t. ``ref``."""
    out, gx, gp = got
    r_out, r_gx, r_gp = ref
    errs = {"output": rel_err(out, r_out), "grad input": rel_err(gx, r_gx)}
    errs.update({f"grad {n}": rel_err(gp[n], r_gp[n]) for n in r_gp})
    return errs


def timed(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> Tuple[float, float]:
    """Median milliseconds of ``fn`` until the device is done, and median host CPU milliseconds of this
    thread while it issues ``fn`` (before the wait for the device)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: List[float] = []
    cpu: List[float] = []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append((time.thread_time() - c0) * 1e3)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]


# ---- --tiling: one sequence through a stage of decoder layers, tiled and untiled ----------------------------


def build_stages(
    shape: str, layers: int, lora: bool, fused: bool, dtype: torch.dtype, device: torch.device
) -> Tuple[List[nn.Module], nn.Module]:
    """``layers`` randomly initialised Qwen3 decoder layers as preset stages, and the rotary embedding."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from roundpipe.models import kernels
    from roundpipe.models.preset import DecoderLayerStage

    config = workload_config(shape, layers=layers, max_position_embeddings=1 << 20)
    stages = []
    for layer in random_layers(config, layers):
        if lora:
            import peft

            layer = peft.inject_adapter_in_model(
                peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS), layer
            )
            for name, p in layer.named_parameters():
                p.requires_grad_("lora_" in name)
        layer = layer.to(device=device, dtype=dtype)
        if fused:
            kernels.fuse_layer(layer)
        stages.append(DecoderLayerStage(layer, "full_attention", None))
    return stages, Qwen3RotaryEmbedding(config).to(device)


def step(stages: List[nn.Module], state: Dict[str, Any], grad: torch.Tensor) -> None:
    """Forward without grad, then recompute with grad and backward, as a RoundPipe backward job."""
    with torch.no_grad():
        s = state
        for stage in stages:
            s = stage(s)
    x = state["hidden_states"].detach().requires_grad_()
    s = dict(state, hidden_states=x)
    from roundpipe.runtime.context import RecomputeCtx

    with RecomputeCtx(None):
        for stage in stages:
            s = stage(s)
    s["hidden_states"].backward(grad)
    for stage in stages:
        stage.zero_grad(set_to_none=True)


def measure(
    stages: List[nn.Module],
    rotary: nn.Module,
    hidden: int,
    seq: int,
    variants: List[str],
    iters: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Dict[str, Tuple[float, float]]:
    """Per variant (``untiled`` or ``T``, tokens per tile): (min ms of :func:`step` over ``iters`` rounds
    run variant after variant, peak GiB above what was allocated before it: the parameters, the input
    and the output gradient)."""
    x = torch.randn(1, seq, hidden, device=device, dtype=dtype)
    pos = torch.arange(seq, device=device)[None]
    cos, sin = rotary(x, pos)
    state = {
        "hidden_states": x,
        "masks": {"full_attention": None},
        "position_ids": pos,
        "position_embeddings": (cos, sin),
        "router": None,
        "attention_mask": None,
    }
    grad = torch.randn_like(x)
    cuda = device.type == "cuda"

    def configure(variant: str) -> None:
        settings.configure(seq_tile=0 if variant == "untiled" else int(variant))

    times: Dict[str, List[float]] = {v: [] for v in variants}
    peaks: Dict[str, float] = {}
    for v in variants:  # warm-up (compilation) and peak memory
        configure(v)
        step(stages, state, grad)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(stages, state, grad)
            peaks[v] = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            peaks[v] = float("nan")
    for _ in range(iters):
        for v in variants:
            configure(v)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(stages, state, grad)
            if cuda:
                torch.cuda.synchronize()
            times[v].append((time.perf_counter() - t0) * 1e3)
    return {v: (min(times[v]), peaks[v]) for v in variants}


def parse_args(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    p.add_argument("--tiny", action="store_true", help="the tiny layer (2 x 32 tokens unless --batch / --seq)")
    p.add_argument("--shape", choices=WORKLOADS, default=None, help="default: qwen3-1.7b; with --tiling qwen3-8b")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--no-compile", action="store_true", help="fused ops eager (torch.compile off)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--tiling", action="store_true", help="sequence tiling vs the whole sequence (see above)")
    p.add_argument("--seqs", default="4096,8192,16384,32768", help="with --tiling: sequence lengths")
    p.add_argument("--tile", type=int, default=16384, help="with --tiling: tokens per tile")
    p.add_argument("--variants", default="", help="with --tiling: untiled, T (tokens per tile); default untiled,--tile")
    p.add_argument("--layers", type=int, default=1, help="with --tiling: decoder layers in the stage")
    p.add_argument("--modes", default="full,lora", help="with --tiling: full, lora")
    p.add_argument("--fused", action="store_true", help="with --tiling: fused kernels (compiled unless disabled)")
    return p.parse_args(argv)


def main(argv: Any = None) -> Dict[str, float]:
    args = parse_args(argv)
    if args.tiling:
        return tiling_main(args)
    from roundpipe.models import kernels

    t_start = time.perf_counter()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = "tiny" if args.tiny else args.shape or "qwen3-1.7b"
    batch = args.batch or (2 if args.tiny else 4)
    seq = args.seq or (32 if args.tiny else 4096)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    iters = args.iters if args.iters is not None else (2 if args.tiny else 10)
    variants = [("layer", {})]
    names = ["hf"] + [v for v, _ in variants]
    settings.configure(compile=not args.no_compile)
    try:
        hf, rotary, config = build_layer(shape, dtype, device)
        fused = copy.deepcopy(hf)
        swapped = kernels.fuse_layer(fused)
        ref32 = copy.deepcopy(hf).float()
        x, pos, mask, position_ids, grad_out = layer_inputs(config, rotary, batch, seq, dtype, device)
        pos32 = tuple(t.float() for t in pos)

        # Correctness of the fused variants (their first calls also compile: timed separately).
        eager = run_layer(hf, x, pos, mask, position_ids, grad_out)
        ref = run_layer(ref32, x.float(), pos32, mask, position_ids, grad_out.float())
        e_eager = errors(eager, ref)
        checks: Dict[str, Dict[str, Any]] = {}
        for variant, chosen in variants:
            with settings.overridden(**chosen):
                t0 = time.perf_counter()
                with torch.no_grad():
                    run_layer(fused, x, pos, mask, position_ids)
                got = run_layer(fused, x, pos, mask, position_ids, grad_out)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
            e_fused, e_vs = errors(got, ref), errors(got, eager)
            worst = max(e_fused, key=lambda k: e_fused[k] - 1.25 * e_eager[k])
            margin = 1.25 * e_eager[worst] + (2e-3 if dtype == torch.bfloat16 else 1e-6)
            checks[variant] = dict(
                ok=e_fused[worst] <= margin,
                worst=worst,
                err=e_fused[worst],
                margin=margin,
                fused_err=max(e_fused.values()),
                vs=max(e_vs.values()),
                compile_s=compile_s,
            )
        ok = all(c["ok"] for c in checks.values())

        # Timing.
        def fwd(layer: nn.Module) -> Callable[[], object]:
            def step() -> None:
                with torch.no_grad():
                    run_layer(layer, x, pos, mask, position_ids)

            return step

        def fwd_bwd(layer: nn.Module) -> Callable[[], object]:
            return lambda: run_layer(layer, x, pos, mask, position_ids, grad_out, collect=False)

        res = {}
        for name, layer, chosen in [("hf", hf, {})] + [(v, fused, c) for v, c in variants]:
            with settings.overridden(**chosen):
                res[f"{name}_fwd_ms"], res[f"{name}_fwd_cpu_ms"] = timed(fwd(layer), warmup, iters, device)
                res[f"{name}_fwd_bwd_ms"], res[f"{name}_fwd_bwd_cpu_ms"] = timed(fwd_bwd(layer), warmup, iters, device)
    finally:
        settings.unconfigure(settings.DISABLE_TORCH_COMPILE.name)

    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"Qwen3 decoder layer {shape} (hidden {config.hidden_size}, intermediate {config.intermediate_size}), "
        f"{batch} x {seq} tokens, {args.dtype}, sdpa, {dev_name}, torch {torch.__version__}; fused: "
        f"{', '.join(n or '(layer)' for n in swapped)}; compile {'off' if args.no_compile else 'on'}"
    )
    print(
        "first fused forward + backward (incl. compile): "
        + ", ".join(f"{v} {c['compile_s']:.1f} s" for v, c in checks.items())
    )
    heads = " | ".join(f"fused {v} ms" for v, _ in variants)
    print(f"| pass | HF eager ms | {heads} | layer speed-up | host CPU ms: {' / '.join(names)} |")
    print("|---|---|" + "---|" * len(variants) + "---|---|")
    per_layer = {n: res[f"{n}_fwd_ms"] + res[f"{n}_fwd_bwd_ms"] for n in names}
    per_layer_cpu = {n: res[f"{n}_fwd_cpu_ms"] + res[f"{n}_fwd_bwd_cpu_ms"] for n in names}
    passes = [("forward, no grad", {n: res[f"{n}_fwd_ms"] for n in names}, {n: res[f"{n}_fwd_cpu_ms"] for n in names})]
    passes.append(
        (
            "forward + backward",
            {n: res[f"{n}_fwd_bwd_ms"] for n in names},
            {n: res[f"{n}_fwd_bwd_cpu_ms"] for n in names},
        )
    )
    passes.append(("RoundPipe per layer (both)", per_layer, per_layer_cpu))
    for label, ms, cpu in passes:
        cells = " | ".join(f"{ms[n]:.3f}" for n in names)
        print(f"| {label} | {cells} | {ms['hf'] / ms['layer']:.2f}x | {' / '.join(f'{cpu[n]:.2f}' for n in names)} |")
    for variant, c in checks.items():
        print(
            f"fused {variant}: rel. error vs fp32 layer, worst of output/grads {c['fused_err']:.2e} (HF eager "
            f"{max(e_eager.values()):.2e}), vs HF eager {c['vs']:.2e}; agreement "
            f"{'OK' if c['ok'] else 'FAILED'}: worst "
            f"relative to eager is {c['worst']!r}: {c['err']:.2e} vs eager {e_eager[c['worst']]:.2e} (limit "
            f"{c['margin']:.2e})"
        )
    print(f"agreement {'OK' if ok else 'FAILED'}; total {time.perf_counter() - t_start:.1f} s")
    if not ok:
        raise SystemExit(1)
    return dict(
        res,
        ok=float(ok),
        speedup=per_layer["hf"] / per_layer["layer"],
        compile_s=max(c["compile_s"] for c in checks.values()),
        fused_vs_hf=max(c["vs"] for c in checks.values()),
    )


def tiling_main(args: argparse.Namespace) -> Dict[str, float]:
    """``--tiling``: the table of time (GiB) per mode, length and variant; returns each cell's time in ms."""
    torch._dynamo.config.recompile_limit = 64  # every variant in one process: more shapes than training sees
    shape = "tiny" if args.tiny else args.shape or "qwen3-8b"
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    hidden = workload_config(shape).hidden_size
    print(
        f"shape {shape}, {args.layers} layer(s), tile {args.tile}, fused={args.fused}, {dtype}, "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    variants = args.variants.split(",") if args.variants else ["untiled", str(args.tile)]
    iters = args.iters or 3
    print("| mode | seq | " + " | ".join(f"{v} ms (GiB)" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    out: Dict[str, float] = {}
    try:
        for mode in args.modes.split(","):
            stages, rotary = build_stages(shape, args.layers, mode == "lora", args.fused, dtype, device)
            for seq in (int(s) for s in args.seqs.split(",")):
                res = measure(stages, rotary, hidden, seq, variants, iters, device, dtype)
                base = res[variants[0]][0]
                cells = [
                    f"{t:.1f} ({m:.2f})" + ("" if v == variants[0] else f" {100 * (t / base - 1):+.1f}%")
                    for v, (t, m) in res.items()
                ]
                out.update({f"{mode}_{seq}_{v}_ms": t for v, (t, _) in res.items()})
                print(f"| {mode} | {seq} | " + " | ".join(cells) + " |", flush=True)
            del stages, rotary
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        settings.unconfigure(settings.SEQ_TILE.name)
    return out


if __name__ == "__main__":
    main()
