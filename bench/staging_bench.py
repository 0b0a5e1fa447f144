"""The asynchronous step's staging pass on its own: every fp32 optimizer copy of a model rounded into its bf16
staging buffer, once with one torch ``copy_`` per tensor (the pass before) and once batched through the C++
rounding (``roundpipe.optim.step.copy_into``), at the optimizer thread's thread count. Prints GB/s (6 bytes a
parameter: fp32 read, bf16 written) and the ratio.

    python bench/staging_bench.py --workload qwen3-1.7b --threads 12
    python bench/staging_bench.py --workload tiny --threads 2 --reps 2       # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import WORKLOADS  # noqa: E402  (the workload shapes)

from roundpipe import flavors  # noqa: E402


def shapes(workload: str) -> List[torch.Size]:
    """The parameter shapes of ``workload``'s Qwen3 model (built on the meta device: no memory)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, inter, layers, heads, kv, tied = WORKLOADS[workload]
    config = Qwen3Config(
        vocab_size=512 if workload == "tiny" else flavors.QWEN3_VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16 if workload == "tiny" else flavors.QWEN3_HEAD_DIM,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return [p.shape for p in model.parameters()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="qwen3-1.7b")
    p.add_argument("--threads", type=int, default=12, help="intra-op threads (RPP_OPTIM_THREADS' role)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    from roundpipe.optim import build
    from roundpipe.optim import step as optim_step

    build.get_optim_function("adam")  # the staging uses the rounding once Adam's library is loaded
    torch.set_num_threads(args.threads)
    srcs = [torch.randn(s) for s in shapes(args.workload)]
    dsts = [torch.empty(s.shape, dtype=torch.bfloat16) for s in srcs]
    n = sum(s.numel() for s in srcs)

    def per_tensor() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def batched() -> None:
        optim_step.copy_into(dsts, srcs)

    times = {}
    for name, fn in (("torch copy_ per tensor", per_tensor), ("batched kernel", batched)) * 2:
        fn()
        t = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        times[name] = statistics.median(t)
    ref = [s.to(torch.bfloat16) for s in srcs[:3]]
    assert all(torch.equal(a, b) for a, b in zip(dsts[:3], ref)), "the kernel's rounding differs from copy_"
    print(f"{args.workload}: {len(srcs)} tensors, {n / 1e9:.2f}B parameters, {args.threads} threads")
    for name, sec in times.items():
        print(f"  {name}: {sec * 1e3:.1f} ms, {6 * n / sec / 1e9:.1f} GB/s")
    print(f"  batched / per tensor: {times['torch copy_ per tensor'] / times['batched kernel']:.2f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
