"""What a finished training call still holds on the GPU when the next call plans (one GPU).

The runtime sizes the room for stage inputs on the device from ``capacity = cap - memory_allocated`` at
the start of a call. A finished call's last job leaves its tensors in the device's ``InterStreamMemManager``
until they are flushed; before the planner flushed them itself (``device.get_min_capacity``) every call
after the first planned with that much less (a qwen3-8b LoRA slice: 76.48 GiB of an 80 GiB cap). This prints
the capacity each call's plan reads, and ``memory_allocated`` after the call, after a 1-element allocation
(blocks freed on other streams' events) and after ``gc.collect()`` (reference cycles).

    RPP_GPU_MEMORY=80GiB python bench/stale_memory_check.py --workload qwen3-8b --lora 16 --layers 2 --seq 8192
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import build_roundpipe  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="qwen3-8b")
    p.add_argument("--lora", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("roundpipe").setLevel(logging.DEBUG)
    import roundpipe
    from roundpipe.devices import device

    _, model = build_roundpipe(args.workload, args.lora, args.layers)
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq))
    on_gpu = torch.cuda.is_available()

    def allocated() -> str:
        return f"{torch.cuda.memory_allocated() / 2**30:.3f} GiB" if on_gpu else "n/a (no GPU)"

    for call in range(args.calls):
        print(f"call {call}: capacity the plan reads {device.get_min_capacity() / 2**30:.3f} GiB", flush=True)
        model.train_step(input_ids=ids, labels=ids)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        if on_gpu:
            torch.cuda.synchronize()
        print(f"  after the call: allocated {allocated()}")
        if on_gpu:
            torch.empty(1, device="cuda")
        print(f"  after a 1-element allocation: {allocated()}")
        gc.collect()
        print(f"  after gc.collect(): {allocated()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
