"""Data-parallel scaling of RoundPipe: throughput of W ranks vs one, loss curve vs one process, and a
time-per-iteration model for W nodes.

Weak scaling: each rank trains ``--batch-per-rank`` sequences per step (global batch = that x W), so
W ranks should process W times the tokens of one rank per unit of time if the gradient all-reduce is
hidden. The loss curve of W ranks must equal that of ONE process trained on the same global batches
(same seed; the DP reduction is exact up to rounding), which is a separate 1-rank run with
``--batch-per-rank`` x W.

Acceptance run (nvidia-h200-x2, one GPU per rank; ``--gpus-per-rank 1`` pins rank r to cuda:r). The
2-rank run measures both gradient reductions, one after the other with a fresh model each
(``--reduce-on host device``: gloo on the host gradients, NCCL on the GPUs before the download), and
writes ``two.host.json`` and ``two.device.json``:

    B=4; S=4096; A="--model qwen3-1.7b --seq $S --steps 20 --warmup 4 --threads 16"
    torchrun --standalone --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank $B       --out one.json
    torchrun --standalone --nproc-per-node 1 bench/dp_bench.py $A --batch-per-rank $((2*B)) --out ref.json
    torchrun --standalone --nproc-per-node 2 bench/dp_bench.py $A --batch-per-rank $B --reduce-on host device \
        --out two.json
    python bench/dp_bench.py --compare one.json two.device.json --loss-ref ref.json   # exit 1 if < 1.8x or off curve
    python bench/dp_bench.py --compare one.json two.host.json --loss-ref ref.json

With a single ``--reduce-on`` mode (default ``auto``: device with NCCL on GPUs, host otherwise) the
result goes to ``--out`` itself.

CPU smoke (CI; 2 CPU-worker ranks, tiny model):

    torchrun --nproc-per-node 2 bench/dp_bench.py --model tiny --seq 32 --batch-per-rank 4 --steps 3 --warmup 1

Scaling model (no run; prints the table of docs/multi-node.md, ``--plot`` writes a figure):

    python bench/dp_bench.py --simulate --params 1.72e9 --iter-s 1.68 --net-gbps 100 200 400
    python bench/dp_bench.py --calibrate one.json two.json               # model vs a measured 2-rank run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------------------
# Scaling model
# ---------------------------------------------------------------------------------------------------------


def allreduce_s(grad_bytes: float, ranks: int, gbps: float, latency_s: float, buckets: int) -> float:
    """Ring all-reduce time: each rank sends and receives 2(W-1)/W of the data, plus per-call latency
    (2(W-1) hops per bucket). ``gbps`` is the per-rank network bandwidth in Gbit/s."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * grad_bytes / (gbps * 1e9 / 8) + 2 * (ranks - 1) * latency_s * buckets


def iteration_s(t1: float, reduce_s: float, fwd_frac: float, optim_s: float, is_async: bool = True) -> float:
    """Steady-state time per iteration of one rank with the host all-reduce of ``reduce_s``.

    Asynchronous step (RoundPipe's default): step k's kernel reduces, then copies the gradients to the
    masters unit by unit, then runs the optimizer (``optim_s``), while iteration k+1 runs forward (F)
    and then backward (B = t1 - F). Backward of k+1 starts with the last layer, whose gradient buffer
    the kernel frees only after the whole reduction; so the period is
    ``max(max(F, R) + B, R + optim_s)``: the reduction is free while it is shorter than the forward.
    Synchronous step: everything serialises, ``t1 + R``.
    """
    if not is_async:
        return t1 + reduce_s
    f = fwd_frac * t1
    return max(max(f, reduce_s) + (t1 - f), reduce_s + optim_s)


def simulate(args: argparse.Namespace) -> int:
    grad_bytes = args.params * args.grad_bytes_per_param
    t1 = args.iter_s
    nodes = [1, 2, 4, 8, 16, 32]
    rows = []
    for gbps in args.net_gbps:
        for n in nodes:
            r = allreduce_s(grad_bytes, n, gbps, args.latency_us * 1e-6, args.buckets)
            t = iteration_s(t1, r, args.fwd_frac, args.optim_s)
            rows.append((gbps, n, r, t, n * t1 / t))
    print(
        f"model: {args.params / 1e9:.2f}B params, {grad_bytes / 1e9:.2f} GB of gradients, one-node iteration "
        f"{t1:.2f} s "
        f"(forward {args.fwd_frac:.0%}), host optimizer {args.optim_s:.2f} s, {args.buckets} buckets, "
        f"{args.latency_us:g} us per hop"
    )
    print("| network Gbit/s | nodes | all-reduce s | s / iteration | speedup | efficiency |")
    print("|---|---|---|---|---|---|")
    for gbps, n, r, t, s in rows:
        print(f"| {gbps:g} | {n} | {r:.2f} | {t:.2f} | {s:.2f}x | {s / n:.0%} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for gbps in args.net_gbps:
            pts = [(n, t) for g, n, _, t, _ in rows if g == gbps]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{gbps:g} Gbit/s")
        ax.axhline(t1, color="gray", ls="--", lw=1, label="one node")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes (one RoundPipe rank each)")
        ax.set_ylabel("seconds per iteration (weak scaling)")
        ax.set_title(f"{args.params / 1e9:.2f}B params, gloo host all-reduce")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


def calibrate(one_path: str, two_path: str, fwd_frac: float) -> int:
    """Predict the measured W-rank iteration from the 1-rank run and the measured network numbers.

    Two limits: "overlapped" (the reduction runs on spare host cores while the devices compute, the
    GPU case) and "serialised" (no spare core: each rank's CPU workers, optimizer thread and gloo share
    the same cores, the CPU-worker case): ``t1 + R``.
    """
    one, two = _load(one_path), _load(two_path)
    t1, tw, w = one["s_per_iter"], two["s_per_iter"], two["world"]
    r_meas = two["reduce_s_per_step"]
    r_pred = allreduce_s(two["grad_bytes"], w, two["net_gbps"], two["latency_s"], two["collectives_per_step"])
    over = iteration_s(t1, r_pred, fwd_frac, one["optim_s_est"])
    serial = iteration_s(t1, r_pred, fwd_frac, one["optim_s_est"], is_async=False)
    print(f"1 rank: {t1:.3f} s/iter; {w} ranks measured: {tw:.3f} s/iter, reduction {r_meas:.3f} s/step")
    print(
        f"all-reduce model: {r_pred:.3f} s ({two['grad_bytes'] / 2**20:.1f} MiB, bus {two['net_gbps']:.2f} Gbit/s, "
        f"{two['latency_s'] * 1e6:.0f} us per hop, {two['collectives_per_step']:.0f} calls)"
    )
    for name, t in (("overlapped", over), ("serialised", serial)):
        print(
            f"predicted {name}: {t:.3f} s/iter ({(t - tw) / tw:+.0%} vs measured), speedup {w * t1 / t:.2f}x "
            f"(measured {w * t1 / tw:.2f}x)"
        )
    return 0


# ---------------------------------------------------------------------------------------------------------
# Measured run (torchrun)
# ---------------------------------------------------------------------------------------------------------


def global_batch(step: int, rows: int, seq: int, vocab: int) -> Tuple[Any, Any]:
    """A learnable synthetic batch: each row counts up from a random start by a random stride (mod
    vocab), so the loss falls within a few steps and loss curves are comparable. Same on every rank."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(seq).unsqueeze(0)) % vocab
    return ids, ids.clone()


def measure_network(group: Any, bucket_mb: float, device: Any = "cpu") -> Tuple[float, float]:
    """Bus bandwidth (Gbit/s, ring-corrected) and small-message latency of a DP group, with tensors on
    ``device`` (the host for the gloo gradient group, a GPU for an NCCL device group)."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def seconds_per_all_reduce(t: torch.Tensor, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            dist.all_reduce(t, group=group)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t, group=group)
        sync()
        return (time.perf_counter() - t0) / reps

    w = dist.get_world_size(group)
    lat = seconds_per_all_reduce(torch.zeros(8, device=device), 3, 20) / (2 * (w - 1))
    big = torch.zeros(max(int(bucket_mb * 2**20), 16 * 2**20) // 4, device=device)  # large enough to be bandwidth-bound
    dt = seconds_per_all_reduce(big, 1, 5)
    gbps = 2 * (w - 1) / w * big.numel() * 4 * 8 / 1e9 / max(dt - 2 * (w - 1) * lat, 1e-9)
    return gbps, lat


def run(args: argparse.Namespace) -> int:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    import torch

    if args.gpus_per_rank and torch.cuda.is_available() and not os.environ.get("RPP_DEVICES"):
        first = local_rank * args.gpus_per_rank
        os.environ["RPP_DEVICES"] = "cuda:" + ",".join(str(first + i) for i in range(args.gpus_per_rank))
        torch.cuda.set_device(first)  # no CUDA context of this rank on another rank's GPU
    if args.pin_cores:  # CPU weak scaling: rank r owns cores [r*k, (r+1)*k), whatever its thread count
        k = args.pin_cores
        os.sched_setaffinity(0, set(range(local_rank * k, (local_rank + 1) * k)))
    from roundpipe.host.optim_thread import rank_share

    threads = args.threads or (
        rank_share(os.cpu_count() or 1, local_world) if local_world > 1 else (os.cpu_count() or 1)
    )
    torch.set_num_threads(threads)
    os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "0" if torch.cuda.is_available() else "1")
    sys.path.insert(0, HERE)
    import train_bench  # the Qwen3 workloads and their builder

    from roundpipe import distributed as rdist

    env = rdist.init_from_env()
    rank, world = env.rank, env.world_size
    modes = list(dict.fromkeys(args.reduce_on)) if world > 1 else ["none"]
    if args.reduce_only and world > 1:
        modes = ["host"]  # random host gradients: only the host reduction can be timed alone
    for mode in modes:
        out = args.out
        if out and len(modes) > 1:
            root, ext = os.path.splitext(out)
            out = f"{root}.{mode}{ext or '.json'}"
        code = run_one(args, mode, out, rank, world, threads, train_bench)
        if code:
            return code
        gc.collect()  # the next mode builds a fresh model: let this one's host memory go first
    rdist.destroy()
    return 0


def shape_overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The config fields ``--shape`` (hidden, intermediate, layers, heads, kv heads; tied embeddings) and
    ``--vocab`` change in the ``--model`` workload."""
    out: Dict[str, Any] = {"vocab_size": args.vocab} if args.vocab else {}
    if args.shape:
        hidden, inter, layers, heads, kv = (int(x) for x in args.shape.split(","))
        out.update(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            tie_word_embeddings=True,
        )
    return out


def run_one(
    args: argparse.Namespace, mode: str, out: Optional[str], rank: int, world: int, threads: int, train_bench: Any
) -> int:
    """Build the model, train ``--steps`` steps with data parallel reducing on ``mode``, write ``out``."""
    import torch

    import roundpipe
    from roundpipe import RoundPipeRunConfig
    from roundpipe import distributed as rdist
    from roundpipe.models.loss import count_loss_tokens

    hf = train_bench.build_model(args.model, "cpu", **shape_overrides(args))
    if args.lora:
        import peft

        torch.manual_seed(1)
        hf = peft.get_peft_model(
            hf, peft.LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear")
        )
    vocab = hf.config.vocab_size
    n_mb = args.microbatches or 2 * roundpipe.get_num_devices()
    model = roundpipe.wrap_model_to_roundpipe(
        hf, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=n_mb)
    )
    dp = (
        rdist.enable_data_parallel(
            model,
            bucket_mb=args.bucket_mb,
            max_in_flight=args.in_flight,
            reduce_on=mode,
            shard_optimizer=args.shard_optimizer,
        )
        if world > 1
        else None
    )
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=args.lr, decoupled_weight_decay=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in hf.parameters() if p.requires_grad)
    if dp is not None and dp.device is not None:  # the device group of local device 0 (NCCL on GPUs)
        net = measure_network(dp.device.groups[0], args.bucket_mb, roundpipe.devices.device.device_list[0].device)
    else:
        net = measure_network(dp.group, args.bucket_mb) if dp is not None else (float("nan"), float("nan"))

    optim_times: List[float] = []

    def step_fn() -> None:  # on the optimizer thread, after the all-reduce and the copy to the masters
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        optim_times.append(time.perf_counter() - t0)

    if args.reduce_only:
        if dp is None:
            raise SystemExit("--reduce-only needs at least 2 ranks (torchrun --nproc-per-node 2 ...)")
        return reduce_only(args, model, dp, rank, world, grad_bytes, net)
    sums: List[float] = []
    counts: List[float] = []
    rdist.barrier()
    t_start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            model.synchronize()  # time steady state only
            rdist.barrier()
            t_start = time.perf_counter()
        ids, labels = rdist.shard(global_batch(step, args.batch_per_rank * world, args.seq, vocab))
        n = count_loss_tokens(labels)
        if dp is not None:
            # Global token mean, even if shares count different tokens. Before the backward: the
            # device reduction applies the weight on the GPU (this order works for both modes).
            dp.normalize_by(n)
        loss = model.train_step(input_ids=ids, labels=labels)
        model.step(step_fn, is_async=not args.sync)
        sums.append(float(loss) * n)
        counts.append(float(n))
    model.synchronize()
    elapsed = time.perf_counter() - t_start
    timed = args.steps - args.warmup
    # Global mean loss per step (token-weighted), reduced once at the end: no per-step sync point.
    red = rdist.all_reduce_scalars(sums + counts, "sum")
    losses = [s / c for s, c in zip(red[: args.steps], red[args.steps :])]
    tokens = args.batch_per_rank * world * args.seq * timed
    optim_s = sum(optim_times[args.warmup :]) / max(len(optim_times) - args.warmup, 1)  # for the scaling model
    hist = list(dp.stats.history)[args.warmup :] if dp is not None else []
    result: Dict[str, Any] = {
        "model": args.model,
        "lora": args.lora,
        "world": world,
        "reduce_on": dp.reduce_on if dp is not None else "none",
        "reduce_backend": (dp.device.backend if dp.device is not None else "gloo") if dp is not None else "none",
        "devices_per_rank": roundpipe.get_num_devices(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "batch_per_rank": args.batch_per_rank,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": threads,
        "s_per_iter": elapsed / max(timed, 1),
        "tokens_per_s": tokens / elapsed,
        "losses": losses,
        "grad_bytes": grad_bytes,
        # host: wall time of the step's reduction; device: the step's collectives' device time, summed
        "reduce_s_per_step": sum(hist) / len(hist) if hist else 0.0,
        "collectives_per_step": (dp.stats.collectives / max(dp.stats.steps, 1)) if dp is not None else 0,
        "net_gbps": net[0],
        "latency_s": net[1],
        "optim_s_est": optim_s,
        "shard_optimizer": bool(dp is not None and dp.step_sync is not None),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # shared pages count in every rank
    }
    if rank == 0:
        where = (
            f" ({result['reduce_on']}, "
            f"{result['reduce_backend']}{', sharded step' if result['shard_optimizer'] else ''})"
            if dp is not None
            else ""
        )
        print(
            f"| {args.model}{' lora r=%d' % args.lora if args.lora else ''} | {world} rank(s) x "
            f"{result['devices_per_rank']} device(s){where} | "
            f"{result['tokens_per_s']:,.0f} tok/s | {result['s_per_iter']:.3f} s/iter | reduce "
            f"{result['reduce_s_per_step']:.3f} s/step | "
            f"optim {optim_s:.3f} s/step | peak RSS {result['peak_rss_gb']:.1f} GB | loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f} |",
            flush=True,
        )
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    if dp is not None:
        dp.close()
    rdist.barrier()  # every rank is done with this model before the next mode starts
    return 0


def reduce_only(
    args: argparse.Namespace, model: Any, dp: Any, rank: int, world: int, grad_bytes: int, net: Tuple[float, float]
) -> int:
    """Time the gradient reduction alone: random host gradients, synchronous steps, no compute."""
    import statistics

    import torch

    params = [p for p in model.model.parameters() if p.requires_grad]
    for _ in range(args.steps):
        for p in params:
            p.grad = torch.randn_like(p)
        model.step(lambda: None, is_async=False)
    hist = list(dp.stats.history)[args.warmup :] if dp is not None else [0.0]
    med = statistics.median(hist)
    if rank == 0:
        print(
            f"| reduce only | {world} ranks | {grad_bytes / 2**20:.1f} MiB | buckets {args.bucket_mb:g} MiB x "
            f"{args.in_flight} in flight | "
            f"{dp.stats.collectives / max(dp.stats.steps, 1):.0f} calls/step | median {med * 1e3:.1f} ms | "
            f"{2 * (world - 1) / world * grad_bytes * 8 / 1e9 / med:.2f} Gbit/s bus (raw {net[0]:.2f}) |"
        )
    return 0


def _load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def compare(one_path: str, many_path: str, ref_path: Optional[str], min_speedup: float, loss_rtol: float) -> int:
    """Acceptance: W ranks give >= min_speedup x one rank's tokens/s; loss curve equals the reference."""
    one, many = _load(one_path), _load(many_path)
    speedup = many["tokens_per_s"] / one["tokens_per_s"]
    ok = speedup >= min_speedup
    mode = (
        f" (gradients reduced on the {many['reduce_on']}, {many.get('reduce_backend', '?')})"
        if "reduce_on" in many
        else ""
    )
    print(
        f"throughput: 1 rank {one['tokens_per_s']:,.0f} tok/s, {many['world']} ranks{mode} "
        f"{many['tokens_per_s']:,.0f} tok/s: "
        f"{speedup:.2f}x (need >= {min_speedup}x) {'ok' if speedup >= min_speedup else 'FAIL'}"
    )
    if ref_path:
        ref = _load(ref_path)
        if ref["batch_per_rank"] * ref["world"] != many["batch_per_rank"] * many["world"]:
            print("loss reference has another global batch; rerun it with --batch-per-rank = per-rank batch x ranks")
            return 1
        n = min(len(ref["losses"]), len(many["losses"]))
        worst = max(abs(a - b) / abs(b) for a, b in zip(many["losses"][:n], ref["losses"][:n]))
        print(
            f"loss curve, first {n} steps: worst relative difference {worst:.2e} (tolerance {loss_rtol:g}) "
            f"{'ok' if worst <= loss_rtol else 'FAIL'}"
        )
        ok = ok and worst <= loss_rtol
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="qwen3-1.7b", help="a bench/train_bench.py workload: tiny, qwen3-0.6b, qwen3-1.7b, ..."
    )
    p.add_argument(
        "--shape", default=None, help="custom model: hidden,intermediate,layers,heads,kv_heads (with --model NAME)"
    )
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the workload's)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--microbatches", type=int, default=0, help="default: 2 per device")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--in-flight", type=int, default=2, help="gradient buckets in flight at once")
    p.add_argument("--sync", action="store_true", help="synchronous optimizer step")
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="enable_data_parallel(shard_optimizer=True): the host step shared by a host's ranks",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (default: all cores for one rank; for several, roundpipe.optim_thread.rank_share)",
    )
    p.add_argument("--gpus-per-rank", type=int, default=1, help="rank r uses GPUs r*k..; 0: leave RPP_DEVICES alone")
    p.add_argument("--pin-cores", type=int, default=0, help="pin rank r to cores [r*k, (r+1)*k) (CPU scaling runs)")
    p.add_argument(
        "--reduce-only", action="store_true", help="time the host gradient all-reduce alone (random gradients)"
    )
    p.add_argument(
        "--reduce-on",
        nargs="+",
        choices=["auto", "host", "device"],
        default=["auto"],
        help="where the 2+ rank run reduces the gradients: host (gloo, optimizer thread), device (NCCL on GPUs, "
        "gloo on CPU workers, before the download), auto; several: one run each, --out X.json -> X.MODE.json",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs=2, metavar=("ONE_RANK_JSON", "W_RANKS_JSON"))
    p.add_argument("--loss-ref", default=None, help="1-rank run on the same global batch")
    p.add_argument("--min-speedup", type=float, default=1.8)
    p.add_argument("--loss-rtol", type=float, default=2e-2, help="bf16 tolerance of the loss curve")
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--calibrate", nargs=2, metavar=("ONE_RANK_JSON", "W_RANKS_JSON"))
    p.add_argument("--params", type=float, default=1.72e9)
    p.add_argument("--grad-bytes-per-param", type=float, default=2.0, help="2: bf16 gradients")
    p.add_argument("--iter-s", type=float, default=1.68, help="one node's seconds per iteration")
    p.add_argument("--fwd-frac", type=float, default=0.3, help="forward share of an iteration")
    p.add_argument("--optim-s", type=float, default=0.35, help="host optimizer seconds per step")
    p.add_argument("--net-gbps", type=float, nargs="+", default=[25, 100, 400])
    p.add_argument("--latency-us", type=float, default=30.0)
    p.add_argument("--buckets", type=int, default=140)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare[0], args.compare[1], args.loss_ref, args.min_speedup, args.loss_rtol)
    if args.calibrate:
        return calibrate(args.calibrate[0], args.calibrate[1], args.fwd_frac)
    if args.simulate:
        return simulate(args)
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
