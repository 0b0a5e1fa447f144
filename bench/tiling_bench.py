"""Sequence tiling (roundpipe.models.tiling) on one Qwen3 decoder layer: time and GPU memory, tiled vs not.

Runs what RoundPipe runs per layer and microbatch, through the preset's ``DecoderLayerStage``: a
forward without grad (the pipelined forward), then the recompute with grad (inside ``RecomputeCtx``)
and its backward. ``--layers 2`` runs a stage of two layers, where the first layer's output is read by
the second during the recompute. Reports, per sequence length, the time of forward + recompute +
backward (median of ``--iters``) and the peak GPU memory above the parameters and the input, untiled
(``RPP_SEQ_TILE=0``) and tiled, for full fine-tuning and LoRA (r=16 on every projection). Variants
run in turn within each round, so clock and thermal drift affect them alike; the minimum is reported.

    python bench/tiling_bench.py --fused --seqs 32768,65536 --variants untiled,16384,8192   # GPU, Qwen3-8B layer
    python bench/tiling_bench.py --cpu --tiny --seqs 64,128 --tile 32 --iters 1  # smoke
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from roundpipe import flavors, settings
from roundpipe.models import kernels
from roundpipe.models.preset import DecoderLayerStage
from roundpipe.runtime.context import RecomputeCtx

SHAPES = {
    # hidden, intermediate, heads, kv heads, head_dim: Qwen3 flavors (roundpipe.flavors), and a tiny layer
    **{
        name: (f.hidden, f.intermediate, f.heads, f.kv_heads, f.head_dim)
        for name, f in flavors.QWEN3.items()
        if name in ("qwen3-8b", "qwen3-1.7b")
    },
    "tiny": (64, 192, 4, 2, 16),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(
    shape: str, layers: int, lora: bool, fused: bool, dtype: torch.dtype, device: torch.device
) -> Tuple[List[nn.Module], nn.Module]:
    """``layers`` randomly initialised Qwen3 decoder layers as preset stages, and the rotary embedding."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hidden, inter, heads, kv, head_dim = SHAPES[shape]
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=1 << 20,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    stages = []
    for i in range(layers):
        layer = Qwen3DecoderLayer(config, layer_idx=i)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
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


def profile(
    stages: List[nn.Module],
    rotary: nn.Module,
    hidden: int,
    seq: int,
    tile: int,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """The GPU kernels of one :func:`step` (after a warm-up), by total time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    measure(stages, rotary, hidden, seq, ["untiled" if tile == 0 else str(tile)], 1, device, dtype)  # warm-up
    settings.configure(seq_tile=tile)
    x = torch.randn(1, seq, hidden, device=device, dtype=dtype)
    pos = torch.arange(seq, device=device)[None]
    state = {
        "hidden_states": x,
        "masks": {"full_attention": None},
        "position_ids": pos,
        "position_embeddings": rotary(x, pos),
        "router": None,
        "attention_mask": None,
    }
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(stages, state, torch.randn_like(x))
        torch.cuda.synchronize()
    print(f"--- seq {seq}, tile {tile} ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="--shape tiny")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--seqs", default="4096,8192,16384,32768")
    ap.add_argument("--tile", type=int, default=16384)
    ap.add_argument(
        "--variants", default="", help="comma-separated: untiled, T (tokens per tile); default: untiled,--tile"
    )
    ap.add_argument(
        "--pre-tiles",
        type=int,
        default=None,
        help="tiling.PRE_TILES_IN_RECOMPUTE (1: the pre-attention part always tiled)",
    )
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--fused", action="store_true", help="fused kernels (compiled unless RPP_DISABLE_TORCH_COMPILE=1)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the GPU kernels of one step, untiled and tiled, per sequence length",
    )
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # every variant in one process: more shapes than training sees
    if args.pre_tiles is not None:
        from roundpipe.models import tiling

        tiling.PRE_TILES_IN_RECOMPUTE = args.pre_tiles
    shape = "tiny" if args.tiny else args.shape
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    print(
        f"shape {shape} {SHAPES[shape]}, {args.layers} layer(s), tile {args.tile}, fused={args.fused}, {dtype}, "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    variants = args.variants.split(",") if args.variants else ["untiled", str(args.tile)]
    print("| mode | seq | " + " | ".join(f"{v} ms (GiB)" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for mode in args.modes.split(","):
        stages, rotary = build(shape, args.layers, mode == "lora", args.fused, dtype, device)
        for seq in (int(s) for s in args.seqs.split(",")):
            if args.profile:
                for tile in (0, args.tile):
                    profile(stages, rotary, SHAPES[shape][0], seq, tile, device, dtype)
                continue
            res = measure(stages, rotary, SHAPES[shape][0], seq, variants, args.iters, device, dtype)
            base = res[variants[0]][0]
            cells = [
                f"{t:.1f} ({m:.2f})" + ("" if v == variants[0] else f" {100 * (t / base - 1):+.1f}%")
                for v, (t, m) in res.items()
            ]
            print(f"| {mode} | {seq} | " + " | ".join(cells) + " |", flush=True)
        del stages, rotary
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
