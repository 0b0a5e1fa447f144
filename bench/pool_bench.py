"""The GPU pool, side by side: one model trained on 1, 2, ... N GPUs of one machine in one process, with
and without graphed jobs, and where each iteration's time goes.

The model is built and wrapped once; between configurations the device pool is re-created
(``roundpipe.configure(devices=...)``) and the plans are dropped, so every row runs the same weights,
optimizer and batch on the same machine. Per row: tokens/s, the ratio to the first row of its graph
mode, and per iteration:

* with ``--busy``, each GPU's busy share and idle gaps in one more, profiled iteration;
* each RoundPipe thread's CPU seconds (device threads, the optimizer thread, the main thread);
* the interpreter lock: a probe thread sleeps 1 ms at a time and measures how late it wakes (the
  time a thread waits for the lock once it wants it).

``--sequence-tiles N`` trains one long sequence over the pool instead: N tiles on several devices, the
whole sequence on one (``--tile-modes`` compares the tiles' attention modes on any device count).

    python bench/pool_bench.py --workload qwen3-1.7b --batch 16 --devices 1,2,4 --graphs 0,1
    # CPU smoke:
    RPP_DEVICES=cpu:2 python bench/pool_bench.py --workload tiny --seq 64 --batch 4 --devices 1,2 --iters 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import (  # noqa: E402
    WORKLOADS,
    add_lora,
    build_model,
    busy_fraction,
    cuda_sync,
    thread_cpu_seconds,
)


class GilProbe:
    """A thread that sleeps ``period_s`` at a time and records how late it wakes: a sleeping thread
    needs the interpreter lock back to continue, so its lateness is the wait any thread sees for the
    lock (near zero when it is free)."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.late: List[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="gil-probe", daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(self.period_s)
            self.late.append(time.perf_counter() - t - self.period_s)

    def __enter__(self) -> "GilProbe":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def summary(self) -> Dict[str, float]:
        late = sorted(self.late) or [0.0]
        return {
            "gil_wait_mean_ms": 1e3 * statistics.fmean(late),
            "gil_wait_p90_ms": 1e3 * late[int(0.9 * (len(late) - 1))],
        }


def run_config(
    model: Any,
    opt: Any,
    ids: torch.Tensor,
    args: argparse.Namespace,
    devices: str,
    graphs: str,
    peer: str = "auto",
    tile_mode: str = "",
) -> Dict[str, Any]:
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    from roundpipe.planning.timer import ModelTimer

    roundpipe.configure(devices=devices, debug_graphs=graphs, debug_peer_handoff=peer)
    n = roundpipe.get_num_devices()
    n_mb = args.microbatches or 2 * n
    model.model_run_config = RoundPipeRunConfig(num_microbatch=n_mb)
    if tile_mode:  # --tile-modes: "none" the whole sequence, else tiles attending this way (any device count)
        roundpipe.configure(debug_tile_attention=tile_mode if tile_mode != "none" else "auto")
        tiled = tile_mode != "none"
        n_mb = args.sequence_tiles if tiled else 1
        model.model_run_config = RoundPipeRunConfig(
            sequence_tiles=args.sequence_tiles if tiled else None, num_microbatch=None if tiled else 1
        )
    elif args.sequence_tiles:  # one sequence over the pool: tiles on several devices, the whole one on one
        n_mb = args.sequence_tiles if n > 1 else 1
        model.model_run_config = RoundPipeRunConfig(
            sequence_tiles=args.sequence_tiles if n > 1 else None, num_microbatch=1 if n == 1 else None
        )
    # A fresh start for every row, as a new process would have: no plan, and no timings (the previous
    # row's, or this row's first calls on devices that compile their kernels, would steer the plan).
    model.plan_cache.clear()
    old = model.model_timer
    model.model_timer = ModelTimer(old.n_layers, old.layer_sizes)

    def step(batch: torch.Tensor = ids) -> None:
        model.train_step(input_ids=batch, labels=batch)
        if args.no_step:  # the pipeline alone, gradients dropped
            model.zero_grad(set_to_none=True)
            return
        model.step(lambda: (opt.step(), opt.zero_grad()))

    # Long sequences warm up on their first tokens (kernels, graphs, the optimizer's first step); the
    # plan for the full length is then made in the first timed call, as in a real run's first step.
    warm = ids[:, : args.warmup_seq] if args.warmup_seq else ids
    for _ in range(args.warmup):
        step(warm)
    cuda_sync()
    cpu0 = thread_cpu_seconds()
    times = []
    with GilProbe() as probe:
        for _ in range(args.iters):
            t0 = time.perf_counter()
            step()
            cuda_sync()
            times.append(time.perf_counter() - t0)
            print(f"  iteration {len(times)}: {times[-1]:.3f} s", flush=True)  # a run cut by a time limit keeps these
    cpu1 = thread_cpu_seconds()
    row: Dict[str, Any] = {
        "devices": n,
        "graphs": graphs,
        "peer_handoff": peer,
        "microbatches": n_mb,
        "s_per_iter": statistics.median(times),
        "iter_s": [round(t, 3) for t in times],  # each timed iteration (the first at a new length pins host blocks)
        "tokens_per_s": ids.numel() / statistics.median(times),
        "plan": repr(next(iter(model.plan_cache.plans.values()), [None])[0]),
        "fwd_ms_per_layer_median": round(statistics.median(model.model_timer.get_estimate("fused")[1][1:-1]), 3),
        "bwd_ms_per_layer_median": round(statistics.median(model.model_timer.get_estimate("fused")[2][1:-1]), 3),
        "thread_cpu_s_per_iter": {
            k: round((cpu1[k] - cpu0.get(k, 0.0)) / args.iters, 3)
            for k in cpu1
            if k.startswith("roundpipe") or k == "MainThread"
        },
        **probe.summary(),
    }
    devs = roundpipe.devices.device.get_devices()
    row["graph_captures"] = sum(d.graphs.captures for d in devs)
    row["graph_replays"] = sum(d.graphs.replays for d in devs)
    row["graph_refused"] = sum(len(d.graphs.refused) for d in devs)
    row["graph_error"] = next((d.graphs.last_error for d in devs if d.graphs.last_error), "")
    if args.busy and torch.cuda.is_available():
        row["gpu_busy"] = busy_fraction(step)
    return row


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=WORKLOADS, default="qwen3-1.7b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument(
        "--devices", default="1,2,4", help="GPU counts (the first k GPUs), e.g. 1,2,4; on CPU: worker counts"
    )
    p.add_argument("--graphs", default="0,1", help="RPP_DEBUG_GRAPHS values to run, e.g. 0,1")
    p.add_argument(
        "--peer",
        default="auto",
        help="RPP_DEBUG_PEER_HANDOFF values to run, e.g. 0,1 (hand-overs between GPUs as peer copies; auto: default)",
    )
    p.add_argument("--microbatches", type=int, default=0, help="default: 2 per device")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-seq", type=int, default=0, help="warm up on the first N tokens only (long sequences)")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--busy", action="store_true", help="profile one more iteration per row: each GPU's busy share")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    p.add_argument(
        "--sequence-tiles",
        type=int,
        default=0,
        help="one sequence over the pool: this many tiles on several devices (the whole sequence on one)",
    )
    p.add_argument(
        "--tile-modes",
        default="",
        help="with --sequence-tiles, rows per device count for each of these: none (the whole sequence), bias, split "
        "(RPP_DEBUG_TILE_ATTENTION), e.g. none,bias,split on one GPU: what the tiles cost beside the whole sequence",
    )
    p.add_argument("--no-step", action="store_true", help="skip the optimizer: the pipeline alone")
    p.add_argument("--json", default="", help="append each row as a JSON line to this file")
    args = p.parse_args(argv)

    import roundpipe

    cuda = torch.cuda.is_available()
    counts = [int(c) for c in args.devices.split(",")]
    if cuda and max(counts) > torch.cuda.device_count():
        p.error(f"--devices {args.devices}: this machine has {torch.cuda.device_count()} GPUs")
    hf = build_model(args.workload, "cpu")
    n_params = sum(q.numel() for q in hf.parameters())
    if args.lora:
        hf = add_lora(hf, args.lora)
    model = roundpipe.wrap_model_to_roundpipe(hf, optim_dtype=torch.float32)
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5, decoupled_weight_decay=True)
    ids = torch.randint(0, hf.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(
        f"{args.workload} ({n_params / 1e9:.2f}B params), {args.batch} x {args.seq}; "
        f"{torch.cuda.get_device_name(0) if cuda else 'CPU workers'}"
    )
    base: Dict[str, float] = {}
    modes = [m for m in args.tile_modes.split(",") if m] if args.sequence_tiles else []
    rows = [
        (g, q, c, m)
        for g in args.graphs.split(",")
        for q in args.peer.split(",")
        for c in counts
        for m in modes or [""]
    ]
    for graphs, peer, c, mode in rows:
        if c:
            devices = (f"cuda:{','.join(str(i) for i in range(c))}") if cuda else f"cpu:{c}"
            row = run_config(model, opt, ids, args, devices, graphs, peer, mode)
            row["tile_mode"] = mode
            base.setdefault(graphs, row["tokens_per_s"])
            row["vs_first"] = row["tokens_per_s"] / base[graphs]
            row["tflops_per_gpu"] = 6 * n_params * row["tokens_per_s"] / 1e12 / c
            print(
                f"graphs={graphs} peer={peer} {c} device(s){' tiles ' + mode if mode else ''}, "
                f"{row['microbatches']} microbatches: "
                f"{row['tokens_per_s']:,.0f} tokens/s "
                f"({row['vs_first']:.2f}x), {row['s_per_iter']:.3f} s/iter, {row['tflops_per_gpu']:.0f} "
                "TFLOP/s per GPU; "
                f"GIL wait mean {row['gil_wait_mean_ms']:.2f} ms p90 {row['gil_wait_p90_ms']:.2f} ms; "
                f"captures {row['graph_captures']} replays {row['graph_replays']} refused "
                f"{row['graph_refused']} {row['graph_error']}"
            )
            print(
                f"  plan {row['plan']}; timer per middle layer fwd {row['fwd_ms_per_layer_median']} ms, bwd "
                f"{row['bwd_ms_per_layer_median']} ms; iterations (s) {row['iter_s']}"
            )
            print(f"  thread CPU s/iter {row['thread_cpu_s_per_iter']}")
            if "gpu_busy" in row:
                print(f"  GPU busy {row['gpu_busy']}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"workload": args.workload, "batch": args.batch, "seq": args.seq, **row}) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
