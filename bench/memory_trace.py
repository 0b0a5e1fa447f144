"""What fills the GPU at a training step's peak: one step under torch's allocator history, replayed to the
moment of the highest allocated total, with the blocks alive then grouped by the code that allocated
them (the innermost frame in roundpipe, peft or transformers). Prints ``roundpipe.planning.estimate``'s
parts beside it, so a gap between estimate and measured peak has names.

A slice of the model keeps its width and fewer of its layers (``--layers``): per-layer memory is the
same, and the model builds in seconds.

    python3 bench/memory_trace.py --workload qwen3-8b --lora 16 --layers 2 --seq 32768 --tile 4096
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import build_roundpipe  # noqa: E402
from train_bench import WORKLOADS  # noqa: E402

from roundpipe.utils import GiB

OURS = ("roundpipe", "peft", "transformers")


def where(frames: List[Dict[str, Any]]) -> str:
    """The innermost frame in our code or the libraries the model runs (else the innermost one)."""
    for f in frames:
        name = f.get("filename", "")
        if any(f"/{p}/" in name for p in OURS):
            short = name.split("/site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    f = frames[0] if frames else {}
    return f"{f.get('filename', '?')}:{f.get('line')} {f.get('name')}"


def peak_blocks(trace: List[Dict[str, Any]]) -> Tuple[int, Dict[int, Tuple[int, List[Dict[str, Any]]]]]:
    """(peak allocated bytes, the blocks alive at that moment) from one device's allocator trace."""
    live: Dict[int, Tuple[int, List[Dict[str, Any]]]] = {}
    total = best = best_at = 0
    for k, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > best:
                best, best_at = total, k
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    live, total = {}, 0
    for ev in trace[: best_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return best, live


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="qwen3-8b")
    p.add_argument("--lora", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--tile", type=int, default=0, help="RPP_SEQ_TILE for the run (0: the setting's default)")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    if args.tile:
        os.environ["RPP_SEQ_TILE"] = str(args.tile)
    from roundpipe import flavors
    from roundpipe.planning import estimate

    hidden, inter, layers, heads, kv, tied = WORKLOADS[args.workload]
    hf, model = build_roundpipe(args.workload, args.lora, args.layers)
    cfg = hf.config
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq))
    model.train_step(input_ids=ids[:, :2048], labels=ids[:, :2048])  # warm-up: kernels, plan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model.train_step(input_ids=ids, labels=ids)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, live = peak_blocks(trace)
    groups: Dict[str, List[int]] = collections.defaultdict(list)
    for size, frames in live.values():
        groups[where(frames)].append(size)
    print(
        f"{args.workload} {'LoRA r=%d' % args.lora if args.lora else 'full'}, {args.layers} layers, {args.seq:,} tokens"
    )
    print(
        f"max_memory_allocated {measured / GiB:.2f} GiB; peak in the trace {peak / GiB:.2f} GiB ({len(trace)} events)"
    )
    print("| allocated at | blocks | GiB | bytes per token |")
    print("|---|---|---|---|")
    for name, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"| {name} | {len(sizes)} | {sum(sizes) / GiB:.3f} | {sum(sizes) / args.seq:,.0f} |")
    shape = estimate.ModelShape(
        hidden=hidden, intermediate=inter, layers=args.layers, heads=heads, kv_heads=kv,
        head_dim=flavors.QWEN3_HEAD_DIM, vocab=flavors.QWEN3_VOCAB, tied=tied,
    )  # fmt: skip
    e = estimate.estimate(shape, seq_len=args.seq, lora_rank=args.lora, gpu_bytes=None)
    print("estimate:", e.describe().splitlines()[1].strip())


if __name__ == "__main__":
    main()
