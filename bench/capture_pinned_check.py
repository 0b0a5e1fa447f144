"""Does freeing a pinned block during a thread-local CUDA graph capture break later pinned allocations?

Each case runs in a fresh subprocess (a failure is sticky for the process) and prints one line:
- ``torch-captured``: a pinned scalar copied on stream S, dropped by another thread while S captures
  (what ``transfer.HostScalar`` did on the compute stream before it used a side stream);
- ``torch-side``: the same copy on a side stream that never captures;
- ``hostscalar``: ``roundpipe.runtime.transfer.HostScalar`` made on S, dropped during the capture.

    python3 bench/capture_pinned_check.py
"""

from __future__ import annotations

import subprocess
import sys

CASE = r"""
import threading, torch
case = {case!r}
s, side = torch.cuda.Stream(), torch.cuda.Stream()
x = torch.arange(8, device="cuda", dtype=torch.float32)
held = []
for _ in range(4):
    if case == "hostscalar":
        from roundpipe.runtime.transfer import HostScalar
        with torch.cuda.stream(s):
            held.append(HostScalar((x > 2).sum()))
        continue
    h = torch.empty((), pin_memory=True)
    with torch.cuda.stream(s):
        v = (x > 2).sum()
        if case == "torch-side":
            side.wait_stream(s)
            with torch.cuda.stream(side):
                h.copy_(v, non_blocking=True)
        else:
            h.copy_(v, non_blocking=True)
    held.append(h)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    g.capture_begin(capture_error_mode="thread_local")
    y = x * 2
    t = threading.Thread(target=held.clear)
    t.start(); t.join()
    g.capture_end()
g.replay(); torch.cuda.synchronize()
try:
    for _ in range(4):
        torch.empty(1024, pin_memory=True).fill_(1)
    print(case, "ok: pinned allocations after the capture work")
except Exception as e:
    print(case, "FAILED:", str(e).splitlines()[0])
"""


def main() -> None:
    for case in ("torch-captured", "torch-side", "hostscalar"):
        r = subprocess.run([sys.executable, "-c", CASE.format(case=case)], capture_output=True, text=True, timeout=120)
        out = r.stdout.strip() or r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        print(out if isinstance(out, str) else f"{case} crashed: {out[0]}", flush=True)


if __name__ == "__main__":
    main()
