"""Host <-> GPU copy bandwidth per GPU, alone and with every GPU copying at once (pinned memory), and with
``--pinned`` the copy speed of torch's pinned allocation against RoundPipe's exact-size pinned buffers.

Each GPU gets its own pinned host buffer, allocated by a thread bound to that GPU; H2D, D2H and both
directions at once are timed per GPU with CUDA events, first one GPU at a time, then all together
(one thread per GPU, started at a barrier). Prints GB/s per GPU and in total, and the machine's
topology (``nvidia-smi topo -m``, NUMA nodes) so a slow GPU can be traced to its socket.

``--pinned``: torch's caching host allocator rounds each pinned block up to a power of two;
``roundpipe.devices.memory.pinned_empty`` maps exactly the size and registers it with CUDA. Checks that the
second copies as fast as the first (both directions, several sizes) and prints the host bytes each takes.

    python bench/copy_bench.py --gib 1 --reps 5
    python bench/copy_bench.py --pinned --sizes-mib 20 96 600 --reps 20
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from typing import Callable, Dict, List

import torch


def _time_copies(
    dev: int, host: torch.Tensor, reps: int, mode: str, barrier: threading.Barrier, out: Dict[int, float]
) -> None:
    torch.cuda.set_device(dev)
    gpu = torch.empty_like(host, device=f"cuda:{dev}")
    host2 = torch.empty_like(host).pin_memory() if mode == "both" else None
    up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    gpu.copy_(host, non_blocking=True)  # warm up the path
    torch.cuda.synchronize(dev)
    barrier.wait()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    up.wait_event(start)
    down.wait_event(start)
    for _ in range(reps):
        if mode in ("h2d", "both"):
            with torch.cuda.stream(up):
                gpu.copy_(host, non_blocking=True)
        if mode == "d2h":
            with torch.cuda.stream(down):
                host.copy_(gpu, non_blocking=True)
        if mode == "both":
            with torch.cuda.stream(down):
                assert host2 is not None
                host2.copy_(gpu, non_blocking=True)
    torch.cuda.current_stream().wait_stream(up)
    torch.cuda.current_stream().wait_stream(down)
    end.record()
    end.synchronize()
    moved = host.numel() * host.element_size() * reps * (2 if mode == "both" else 1)
    out[dev] = moved / (start.elapsed_time(end) / 1e3) / 1e9


def measure(devices: List[int], hosts: Dict[int, torch.Tensor], reps: int, mode: str) -> Dict[int, float]:
    out: Dict[int, float] = {}
    barrier = threading.Barrier(len(devices))
    threads = [threading.Thread(target=_time_copies, args=(d, hosts[d], reps, mode, barrier, out)) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def gbps(copy: Callable[[], object], nbytes: int, reps: int) -> float:
    """GB/s of ``reps`` calls of ``copy`` moving ``nbytes`` each (after one untimed call)."""
    copy()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        copy()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def pinned(sizes_mib: List[float], reps: int) -> None:
    """``--pinned``: per size, torch's pinned block and RoundPipe's exact one: host bytes, H2D and D2H GB/s."""
    from roundpipe.devices import memory

    stream = torch.cuda.Stream()
    print("| size MiB | buffer | host MiB taken | H2D GB/s | D2H GB/s | allocate + pin ms |")
    print("|---|---|---|---|---|---|")
    for mib in sizes_mib:
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
                up = gbps(lambda d=dev, h=host: d.copy_(h, non_blocking=True), 2 * n, reps)
                down = gbps(lambda d=dev, h=host: h.copy_(d, non_blocking=True), 2 * n, reps)
            assert host.is_pinned(), name
            print(f"| {mib:g} | {name} | {taken / 2**20:.0f} | {up:.1f} | {down:.1f} | {ms:.0f} |")
            del host


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="buffer size per GPU")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pinned", action="store_true", help="torch's pinned blocks vs RoundPipe's exact-size ones")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[20.0, 96.0, 600.0], help="with --pinned")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("copies between the host and a GPU need a CUDA device")
    if args.pinned:
        pinned(args.sizes_mib, args.reps)
        return 0
    for cmd in (["nvidia-smi", "topo", "-m"], ["lscpu"]):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"{cmd[0]}: {exc}"
        lines = (
            text.splitlines()
            if cmd[0] == "nvidia-smi"
            else [ln for ln in text.splitlines() if "NUMA" in ln or "Model name" in ln or ln.startswith("CPU(s)")]
        )
        print("\n".join(lines))
    n = torch.cuda.device_count()
    numel = int(args.gib * 2**30) // 2
    hosts: Dict[int, torch.Tensor] = {}

    def alloc(d: int) -> None:
        torch.cuda.set_device(d)
        hosts[d] = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)

    for d in range(n):
        t = threading.Thread(target=alloc, args=(d,))
        t.start()
        t.join()
    for mode in ("h2d", "d2h", "both"):
        alone = {d: measure([d], hosts, args.reps, mode)[d] for d in range(n)}
        together = measure(list(range(n)), hosts, args.reps, mode)
        print(
            f"{mode}: alone {' '.join(f'{alone[d]:.1f}' for d in range(n))} GB/s; all {n} at once "
            f"{' '.join(f'{together[d]:.1f}' for d in range(n))} GB/s (total {sum(together.values()):.1f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
