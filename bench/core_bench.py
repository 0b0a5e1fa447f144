"""Core runtime benchmark: an MLP stack trained with RoundPipe vs. the same model resident on the GPU.

One process, both systems side by side on the same batch; prints tokens/s, peak GPU memory and the
ratio. Full fine-tune: bf16 weights, fp32 master weights + AdamW on the host for RoundPipe; bf16
weights + fused AdamW on the GPU for the baseline (per-layer activation checkpointing).

    python bench/core_bench.py --layers 12 --hidden 4096 --tokens 16384
    RPP_DEVICES=cpu:2 python bench/core_bench.py --layers 4 --hidden 64 --tokens 256 --iters 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe import RoundPipe, RoundPipeRunConfig


def block(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.GELU(), nn.Linear(4 * h, h, bias=False))


def build(layers: int, hidden: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block(hidden) for _ in range(layers)]).to(dtype)


def bench_roundpipe(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> tuple:
    model = RoundPipe(
        build(args.layers, args.hidden, args.dtype),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.microbatches),
    )
    params = list(model.optim_parameters())
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=1e-4)
    loss_fn = lambda out, label: nn.functional.mse_loss(out.float(), label.float())  # noqa: E731
    times = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        if args.optimizer != "none":
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=not args.sync_step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    model.synchronize()
    return times[args.warmup :], model


def bench_resident(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> list:
    dev = torch.device("cuda")
    model = build(args.layers, args.hidden, args.dtype).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    xd, yd = x.to(dev), y.to(dev)
    times = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        h = xd
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False)
        nn.functional.mse_loss(h.float(), yd.float()).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[args.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument(
        "--optimizer",
        choices=["adamw", "sgd", "none"],
        default="adamw",
        help="host optimizer for roundpipe ('none': forward_backward only, to isolate the pipeline)",
    )
    p.add_argument("--sync-step", action="store_true", help="is_async=False steps")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    args.dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    x = torch.randn(args.tokens, args.hidden, dtype=args.dtype)
    y = torch.randn(args.tokens, args.hidden, dtype=args.dtype)
    if torch.cuda.is_available():
        x, y = x.pin_memory(), y.pin_memory()
    params = args.layers * 8 * args.hidden**2
    rows = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rp_times, _ = bench_roundpipe(args, x, y)
    rp_tps = args.tokens / (sum(rp_times) / len(rp_times))
    rp_mem = torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else float("nan")
    rows.append(("roundpipe", rp_tps, rp_mem))
    if torch.cuda.is_available() and not args.no_baseline:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_times = bench_resident(args, x, y)
        rows.append(
            (
                "gpu-resident",
                args.tokens / (sum(base_times) / len(base_times)),
                torch.cuda.max_memory_allocated() / 1024**3,
            )
        )
    print(
        f"roundpipe optimizer={args.optimizer} sync_step={args.sync_step}; per-iteration seconds: "
        f"{[round(t, 3) for t in rp_times]}"
    )
    print(
        f"MLP stack: {args.layers} blocks, hidden {args.hidden}, {params / 1e9:.2f}B params, {args.tokens} "
        f"tokens/iter, {args.microbatches} microbatches"
    )
    print("| system | tokens/s | TFLOP/s (6·P·T) | peak GPU GiB | ratio |")
    print("|---|---|---|---|---|")
    base = rows[-1][1]
    for name, tps, mem in rows:
        print(f"| {name} | {tps:,.0f} | {6 * params * tps / 1e12:.1f} | {mem:.1f} | {tps / base:.2f} |")


if __name__ == "__main__":
    main()
