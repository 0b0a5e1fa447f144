"""Whether several GPUs' first expandable segments, made at once, fail: torch's process-wide choice of the
segments' handle type (``roundpipe.devices.allocator.settle_expandable_handle_type`` says how it races).

Each trial is a fresh process (the type is chosen once per process) with ``expandable_segments:True``: it
starts a CUDA context on every GPU without allocating, then one thread per GPU allocates at the same moment (a
barrier). ``--arm raw`` does only that; ``--arm settled`` first calls roundpipe's settle, as the pool does.
Prints one line per arm: trials, failures and their errors.

    python tests/handle_type_race.py --trials 24               # both arms, 8 processes at a time
    python tests/handle_type_race.py --arm settled --trials 4 --json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(arm: str) -> None:
    """One trial: print a JSON list of the errors the GPUs' simultaneous first allocations raised."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit("needs at least 2 GPUs")
    for i in range(n):
        torch.cuda.synchronize(i)  # the context, without an allocation
    if arm == "settled":
        from roundpipe.devices import allocator

        allocator.settle_expandable_handle_type([torch.device("cuda", i) for i in range(n)])
    barrier = threading.Barrier(n)
    errors: List[str] = []

    def first_allocation(i: int) -> None:
        barrier.wait()
        try:
            torch.empty(64 << 20, dtype=torch.uint8, device=f"cuda:{i}")
            torch.cuda.synchronize(i)
        except Exception as exc:  # noqa: BLE001 - the error is the measurement
            errors.append(f"cuda:{i}: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    threads = [threading.Thread(target=first_allocation, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(errors))


def trial(arm: str) -> List[str]:
    env = dict(os.environ, PYTORCH_ALLOC_CONF="expandable_segments:True", PYTHONPATH=ROOT)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", arm],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    if out.returncode != 0 or not lines:
        return [f"process exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"]
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=["raw", "settled", "both"], default="both")
    p.add_argument("--trials", type=int, default=24, help="fresh processes per arm")
    p.add_argument("--parallel", type=int, default=8, help="processes at a time")
    p.add_argument("--json", action="store_true", help="print each arm's result as one JSON line")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    arms = ["raw", "settled"] if args.arm == "both" else [args.arm]
    for arm in arms:
        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(trial, [arm] * args.trials))
        failed = [r for r in results if r]
        kinds: Dict[str, int] = collections.Counter(e.split(": ", 1)[1] for r in failed for e in r)
        row = {"arm": arm, "trials": args.trials, "failed": len(failed), "errors": dict(kinds)}
        print(json.dumps(row) if args.json else f"{arm}: {len(failed)} of {args.trials} trials failed {dict(kinds)}")


if __name__ == "__main__":
    main()
