"""Where one sequence's tiles lose time beside the whole sequence on one GPU: a slice of the model (its width,
fewer layers) trains one step each way under the torch profiler (CUDA activity), and the top kernels, the
GPU's busy time and torch.compile's recompilations are printed side by side.

    python3 bench/tile_profile.py --workload qwen3-8b --lora 16 --layers 4 --seq 65536 --tiles 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import build_roundpipe  # noqa: E402


def kernels(prof: torch.profiler.profile) -> Tuple[float, List[Tuple[str, float, int]]]:
    """(GPU busy ms, [(kernel name, total ms, calls)] by total time) from a profile of CUDA activity."""
    per: Dict[str, List[float]] = {}
    spans = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((evt.time_range.start, evt.time_range.end))
        per.setdefault(evt.name[:90], []).append((evt.time_range.end - evt.time_range.start) / 1e3)
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    rows = sorted(((k, sum(v), len(v)) for k, v in per.items()), key=lambda r: -r[1])
    return busy / 1e3, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="qwen3-8b")
    p.add_argument("--lora", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--tiles", type=int, default=8)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--modes", default="split,bias", help="RPP_DEBUG_TILE_ATTENTION values of the tiled rows")
    args = p.parse_args()
    from roundpipe import RoundPipeRunConfig

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    hf, model = build_roundpipe(args.workload, args.lora, args.layers)
    ids = torch.randint(0, hf.config.vocab_size, (1, args.seq))
    import roundpipe

    rows = [("whole", RoundPipeRunConfig(num_microbatch=1), "auto")]
    rows += [
        (f"{args.tiles} tiles, {m}", RoundPipeRunConfig(sequence_tiles=args.tiles), m) for m in args.modes.split(",")
    ]
    for name, cfg, mode in rows:
        roundpipe.configure(debug_tile_attention=mode)
        model.model_run_config = cfg
        model.plan_cache.clear()
        for _ in range(2):  # warm-up at full length: kernels, plans, pinned blocks
            model.train_step(input_ids=ids, labels=ids)
        sync()
        import torch._dynamo.utils as dyn

        before = dict(dyn.counters["stats"])
        with torch.profiler.profile(activities=[activity]) as prof:
            t0 = time.perf_counter()
            model.train_step(input_ids=ids, labels=ids)
            sync()
            wall = time.perf_counter() - t0
        busy, rows = kernels(prof)
        after = dict(dyn.counters["stats"])
        print(
            f"\n== {name}: step {wall:.2f} s, GPU busy {busy / 1e3:.2f} s; "
            "dynamo stats change "
            f"{ {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} }"
        )
        print("| kernel | ms | calls |")
        for k, ms, n in rows[: args.top]:
            print(f"| {k} | {ms:,.0f} | {n} |")


if __name__ == "__main__":
    main()
