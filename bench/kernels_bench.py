"""One Qwen3 decoder layer, Hugging Face eager vs RoundPipe's fused kernels (roundpipe.models.kernels).

Times what RoundPipe runs per layer and microbatch: a forward without grad (the pipelined forward), and a forward with
grad + backward (the recompute and backward), for Hugging Face's layer and the whole layer as one fused op. Besides the
time until the GPU is done it reports the host CPU time spent issuing the work (the calling thread's CPU time): on
several GPUs the device threads share one interpreter lock, so that is what bounds them. Default shape: Qwen3-1.7B
(hidden 2048, intermediate 6144, 16 heads, 8 kv heads, head_dim 128, qk-norm), 4 x 4096 tokens, bf16, sdpa. Checks that
the fused layer's output and gradients (input and every parameter) agree with Hugging Face's within bf16 rounding: both
are compared with an fp32 copy of the layer, and the fused error must not exceed the eager one by more than a rounding
margin.

    python bench/kernels_bench.py                 # device machine, < 60 s with compilation
    python bench/kernels_bench.py --cpu --tiny    # CPU smoke (tests/test_kernels.py runs it)
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from roundpipe import flavors, settings

SHAPES = {
    # hidden, intermediate, heads, kv heads, head_dim: Qwen3 flavors (roundpipe.flavors), and a tiny layer
    **{
        name: (f.hidden, f.intermediate, f.heads, f.kv_heads, f.head_dim)
        for name, f in flavors.QWEN3.items()
        if name in ("qwen3-1.7b",)
    },
    "tiny": (64, 128, 4, 2, 16),
}


def build_layer(shape: str, dtype: torch.dtype, device: torch.device) -> Tuple[nn.Module, nn.Module, object]:
    """A randomly initialised Qwen3 decoder layer, its rotary embedding and config."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hidden, inter, heads, kv, head_dim = SHAPES[shape]
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=40960,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            # norms around 1 (not exactly 1, so their weight multiply matters), matrices N(0, 0.02)
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
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


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    p.add_argument("--tiny", action="store_true", help="tiny layer, 2 x 32 tokens")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--no-compile", action="store_true", help="fused ops eager (torch.compile off)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)

    from roundpipe.models import kernels

    t_start = time.perf_counter()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = "tiny" if args.tiny else "qwen3-1.7b"
    batch = args.batch or (2 if args.tiny else 4)
    seq = args.seq or (32 if args.tiny else 4096)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    iters = args.iters if args.iters is not None else (2 if args.tiny else 10)
    settings.configure(compile=not args.no_compile)
    try:
        hf, rotary, config = build_layer(shape, dtype, device)
        fused = copy.deepcopy(hf)
        swapped = kernels.fuse_layer(fused)
        ref32 = copy.deepcopy(hf).float()
        x, pos, mask, position_ids, grad_out = layer_inputs(config, rotary, batch, seq, dtype, device)
        pos32 = tuple(t.float() for t in pos)

        # Correctness of the fused layer (its first calls also compile: timed separately).
        eager = run_layer(hf, x, pos, mask, position_ids, grad_out)
        ref = run_layer(ref32, x.float(), pos32, mask, position_ids, grad_out.float())
        e_eager = errors(eager, ref)
        checks: Dict[str, Dict[str, object]] = {}
        for variant in ("layer",):
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
        for name, layer in (("hf", hf), ("layer", fused)):
            res[f"{name}_fwd_ms"], res[f"{name}_fwd_cpu_ms"] = timed(fwd(layer), warmup, iters, device)
            res[f"{name}_fwd_bwd_ms"], res[f"{name}_fwd_bwd_cpu_ms"] = timed(fwd_bwd(layer), warmup, iters, device)
    finally:
        settings.unconfigure(settings.DISABLE_TORCH_COMPILE.name)

    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"Qwen3 decoder layer {shape} {SHAPES[shape]}, {batch} x {seq} tokens, {args.dtype}, sdpa, {dev_name}, "
        f"torch {torch.__version__}; fused: {', '.join(n or '(layer)' for n in swapped)}; compile "
        f"{'off' if args.no_compile else 'on'}"
    )
    print(
        "first fused forward + backward (incl. compile): "
        + ", ".join(f"{v} {c['compile_s']:.1f} s" for v, c in checks.items())
    )
    print("| pass | HF eager ms | fused layer ms | layer speed-up | host CPU ms: HF / layer |")
    print("|---|---|---|---|---|")
    for label, key in (("forward, no grad", "fwd"), ("forward + backward", "fwd_bwd")):
        ms = [res[f"{n}_{key}_ms"] for n in ("hf", "layer")]
        cpu = [res[f"{n}_{key}_cpu_ms"] for n in ("hf", "layer")]
        print(f"| {label} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[0] / ms[1]:.2f}x | {cpu[0]:.2f} / {cpu[1]:.2f} |")
    per_layer = {n: res[f"{n}_fwd_ms"] + res[f"{n}_fwd_bwd_ms"] for n in ("hf", "layer")}
    per_layer_cpu = {n: res[f"{n}_fwd_cpu_ms"] + res[f"{n}_fwd_bwd_cpu_ms"] for n in ("hf", "layer")}
    print(
        f"| RoundPipe per layer (both) | {per_layer['hf']:.3f} | {per_layer['layer']:.3f} | "
        f"{per_layer['hf'] / per_layer['layer']:.2f}x | {per_layer_cpu['hf']:.2f} / {per_layer_cpu['layer']:.2f} |"
    )
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


if __name__ == "__main__":
    main()
