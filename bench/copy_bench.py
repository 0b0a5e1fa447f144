"""Host <-> GPU copy bandwidth per GPU, alone and with every GPU copying at once (pinned memory).

Each GPU gets its own pinned host buffer, allocated by a thread bound to that GPU; H2D, D2H and both
directions at once are timed per GPU with CUDA events, first one GPU at a time, then all together
(one thread per GPU, started at a barrier). Prints GB/s per GPU and in total, and the machine's
topology (``nvidia-smi topo -m``, NUMA nodes) so a slow GPU can be traced to its socket.

    python bench/copy_bench.py --gib 1 --reps 5
"""

from __future__ import annotations

import argparse
import subprocess
import threading
from typing import Dict, List

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="buffer size per GPU")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
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
