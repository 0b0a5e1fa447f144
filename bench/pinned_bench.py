"""Host-device copy speed of torch's pinned allocation vs RoundPipe's exact-size pinned buffers.

torch's caching host allocator rounds each pinned block up to a power of two; ``roundpipe.devices.memory.pinned_empty``
maps exactly the size and registers it with CUDA. This checks that the second copies as fast as the
first (both directions, several sizes), and prints the host bytes each one takes.

    python3 bench/pinned_bench.py [--sizes-mib 20 96 600] [--reps 20]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from roundpipe.devices import memory


def gbps(copy: Callable[[], None], nbytes: int, reps: int) -> float:
    copy()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        copy()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[20.0, 96.0, 600.0])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_bench needs a CUDA device")
    stream = torch.cuda.Stream()
    print("| size MiB | buffer | host MiB taken | H2D GB/s | D2H GB/s | allocate + pin ms |")
    print("|---|---|---|---|---|---|")
    for mib in args.sizes_mib:
        n = int(mib * 2**20) // 2
        dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        for name, make in (
            ("torch pin_memory", lambda n=n: torch.empty(n, dtype=torch.bfloat16, pin_memory=True)),
            ("roundpipe exact", lambda n=n: memory.pinned_empty((n,), torch.bfloat16)),
        ):
            t = time.perf_counter()
            host = make()
            host.fill_(1.0)
            ms = (time.perf_counter() - t) * 1e3
            taken = 1 << (2 * n - 1).bit_length() if name.startswith("torch") else 2 * n
            with torch.cuda.stream(stream):
                up = gbps(lambda d=dev, h=host: d.copy_(h, non_blocking=True), 2 * n, args.reps)
                down = gbps(lambda d=dev, h=host: h.copy_(d, non_blocking=True), 2 * n, args.reps)
            assert host.is_pinned(), name
            print(f"| {mib:g} | {name} | {taken / 2**20:.0f} | {up:.1f} | {down:.1f} | {ms:.0f} |")
            del host


if __name__ == "__main__":
    main()
