"""Convergence and numerics against the plain run: compact optimizer state, compact stage inputs, repeatability.

Subcommands (``python bench/convergence.py SUBCOMMAND --help`` for each one's options):

* ``optimizer``: a tiny Qwen3 language model (hidden 128, 2 layers, byte vocabulary) trained on CPU on the
  repository's own text (README.md and docs/*.md as bytes; the last 10% held out) with fp32 Adam and each
  compact mode of ``roundpipe.optim.Adam`` (bf16 or int8 moments, bf16 masters with stochastic, Kahan or
  nearest rounding), same weights and batches; fp32-master modes train the fp32 model, bf16-master modes
  the same weights cast to bf16. Prints the final held-out losses against fp32 Adam's and writes the curves
  to docs/img/compact_convergence.png (matplotlib, a bench-only dependency; skipped without it).
* ``stage-inputs``: the same training with the backward stages' inputs exact (bf16), then compact
  (``--format`` fp8 or int8, ``RPP_STAGE_INPUTS``): the final losses (last step, mean of the last 10), the
  mean over all steps, their ratios. ``--workload task`` (default) is ``roundpipe train``'s built-in task
  (the tiny Qwen3 learning to reverse strings) run with ``--plan layerwise`` (its default plan keeps no
  stage input), with a control run (exact, seed 1: near the end the task's loss is ~0.01, where any
  perturbation moves it by tens of percent); ``--seeds N`` compares the means over seeds 0..N-1. A bench
  workload (tiny, qwen3-0.6b, ..., qwen3-8b) trains on one fixed batch of random tokens instead.
* ``grad-cosine``: one training step of a workload's model (random weights and tokens, ``--seq`` tokens,
  LoRA with ``--lora R``) with exact, then compact stage inputs: the cosine similarity of the two steps'
  parameter gradients (all trainable parameters; and the worst tensor's). ``--repeat`` adds a second exact
  step: the run-to-run floor (GPU kernels that add in a varying order differ between identical steps).
* ``block-errors``: the relative RMS error of the stage-input round trip per block size, on Gaussian
  values with and without outlier channels.
* ``repeat``: the same tiny bf16 Qwen3 trained twice in one process on the current pool (``RPP_DEVICES``):
  the first call's host gradients compared bit for bit, then the losses of a few Adam steps.

Stage inputs kept in the GPU's free room stay exact, so the stage-input subcommands keep every stage input
on the host (``RPP_DEBUG_DEVICE_SAVED_GB=0``), where the compact format applies; ``"compacted"`` counts the
tensors encoded (0 would mean the comparison compared nothing).

    python bench/convergence.py optimizer --steps 600 --lr 2e-3 --modes 1,2,4,5
    python bench/convergence.py stage-inputs --format int8 --seeds 5
    python bench/convergence.py grad-cosine --repeat --workload qwen3-8b --lora 16 --seq 32768 --format int8
    python bench/convergence.py block-errors
    python bench/convergence.py repeat --steps 6
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # this checkout's roundpipe and train_bench
from train_bench import WORKLOADS, add_lora, build_model  # noqa: E402

from roundpipe.models.configs import tiny_config  # noqa: E402

SAVED_GB = "RPP_DEBUG_DEVICE_SAVED_GB"
"""The setting that keeps stage inputs on the device (0: every one through the host)."""


# ---- optimizer: compact Adam state against fp32 Adam ------------------------------------------------------

MODES: List[Tuple[str, Dict[str, str]]] = [
    ("fp32 Adam", {}),
    ("bf16 state", {"state_dtype": "bfloat16"}),
    ("int8 state", {"state_dtype": "int8"}),
    ("bf16 master SR, fp32 state", {"master": "bfloat16"}),
    ("int8 state, bf16 master SR", {"state_dtype": "int8", "master": "bfloat16"}),
    ("int8 state, bf16 master Kahan", {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "kahan"}),
    ("int8 state, bf16 master nearest", {"state_dtype": "int8", "master": "bfloat16", "master_rounding": "nearest"}),
]


def corpus() -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors of README.md + docs/*.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    data = torch.tensor(list(b"\n\n".join(f.read_bytes() for f in files)), dtype=torch.long)
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def make_model(seed: int) -> torch.nn.Module:
    """A tiny Qwen3 causal LM with byte vocabulary."""
    from transformers import Qwen3ForCausalLM

    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2, head_dim=32)
    cfg = tiny_config("qwen3", **shape, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.02)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> List[torch.Tensor]:
    """``n`` batches of random windows (fixed by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        out.append(torch.stack([data[i : i + seq] for i in idx.tolist()]))
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, held: List[torch.Tensor]) -> float:
    """Mean held-out cross-entropy (nats per byte)."""
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.float().item() for b in held]
    model.train()
    return sum(losses) / len(losses)


def train(
    kw: Dict[str, str], args: argparse.Namespace, train_b: List[torch.Tensor], held: List[torch.Tensor]
) -> Tuple[List[float], float]:
    """Train one mode; returns (smoothed train losses, final held-out loss)."""
    import roundpipe.optim

    model = make_model(args.seed)
    if kw.get("master") == "bfloat16":
        model = model.to(torch.bfloat16)
    opt = roundpipe.optim.Adam(
        model.parameters(), lr=args.lr, weight_decay=0.01, decoupled_weight_decay=True, seed=args.seed, **kw
    )  # type: ignore[arg-type]
    curve: List[float] = []
    ema = None
    for b in train_b:
        loss = model(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        val = loss.float().item()
        ema = val if ema is None else 0.95 * ema + 0.05 * val
        curve.append(ema)
    return curve, evaluate(model, held)


def optimizer(args: argparse.Namespace) -> None:
    """``optimizer``: every picked mode trained, the table of final held-out losses, the plot."""
    train_data, held_data = corpus()
    train_b = batches(train_data, args.steps, args.batch, args.seq, seed=1)
    held = batches(held_data, 8, args.batch, args.seq, seed=2)
    curves: Dict[str, List[float]] = {}
    finals: Dict[str, float] = {}
    picked = sorted({0, *(int(k) for k in args.modes.split(",") if k.strip())}) if args.modes else range(len(MODES))
    for name, kw in [MODES[k] for k in picked]:
        t0 = time.perf_counter()
        curves[name], finals[name] = train(kw, args, train_b, held)
        print(f"{name}: held-out loss {finals[name]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = finals[MODES[0][0]]
    print(f"\n{args.steps} steps, batch {args.batch} x {args.seq} bytes, lr {args.lr}, seed {args.seed}")
    print("| optimizer | final held-out loss | vs fp32 Adam |\n|---|---|---|")
    for name, val in finals.items():
        print(f"| {name} | {val:.4f} | {(val - base) / base * 100:+.2f}% |")
    if args.no_plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(curve, label=f"{name} ({finals[name]:.3f})", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (EMA 0.95), nats/byte")
    ax.set_title("tiny Qwen3 on the repo's docs: fp32 Adam vs compact state (CPU)")
    ax.set_ylim(top=min(ax.get_ylim()[1], curves[MODES[0][0]][0] * 0.8 + 1.0))
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")


# ---- stage inputs: exact against compact ----------------------------------------------------------------


def task_losses(mode: str, args: argparse.Namespace, out_dir: str, seed: int = 0) -> List[float]:
    """Per-step losses of ``roundpipe train`` on the built-in task with ``--stage-inputs mode``."""
    cmd = [sys.executable, "-m", "roundpipe", "train", "--steps", str(args.steps), "--plan", "layerwise"]
    cmd += ["--seed", str(seed)]
    cmd += ["--stage-inputs", mode, "--output-dir", out_dir, "--overwrite", "--eval-examples", "0"]
    cmd += ["--log-every", str(max(1, args.steps // 4)), "--no-tensorboard", "--no-progress"]
    if args.seq:
        cmd += ["--seq-len", str(args.seq)]
    env = dict(os.environ, RPP_PROGRESS="0", **{SAVED_GB: "0"})
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=sys.stderr)
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def build(args: argparse.Namespace) -> Tuple[torch.nn.Module, Any]:
    """The workload's Hugging Face model (random weights; LoRA adapters with ``--lora``) wrapped in a
    RoundPipe that keeps every stage input on the host."""
    import roundpipe

    # Drawn on the GPU where there is one (seconds for an 8B model), then kept on the host, as RoundPipe requires.
    hf = build_model(args.workload, "cuda" if torch.cuda.is_available() else "cpu").to("cpu")
    if args.lora:
        torch.manual_seed(1)
        hf = add_lora(hf, args.lora)
        for name, p in hf.named_parameters():  # lora_B starts at 0: give it values, so that every adapter learns
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=1))
    if args.plan == "layerwise":  # every decoder layer's input kept (and compacted): the most rounding
        model.model_run_config.execute_plan = roundpipe.ModelExecutePlan.layerwise(model.num_layers, "fused")
    return hf, model


def tokens(vocab: int, seq: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)


class Counter:
    """Counts ``stage_codec.encode`` calls (the stage inputs the compact run compacted) and, for int8, the
    blocks it kept in fp8 (a negative scale: a value dwarfing its block's others)."""

    def __init__(self) -> None:
        from roundpipe.runtime import stage_codec

        self.n, self.blocks, self.fp8_blocks, self.codec, self.encode = 0, 0, 0, stage_codec, stage_codec.encode

        def counted(*a: Any, **k: Any) -> Any:
            self.n += 1
            packed = self.encode(*a, **k)
            if packed.fmt == "int8":
                self.blocks += packed.scales.numel()
                self.fp8_blocks += int((packed.scales < 0).sum())
            return packed

        stage_codec.encode = counted  # type: ignore[assignment]


def _cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x * y).sum() / (x.norm() * y.norm()))


def grad_cosine(args: argparse.Namespace) -> Dict[str, Any]:
    """One step's gradients with exact and compact (``--format``) stage inputs (see the module docstring)."""
    import roundpipe

    hf, model = build(args)
    ids = tokens(hf.config.vocab_size, args.seq)
    trained = [(n, p) for n, p in hf.named_parameters() if p.requires_grad]
    grads: Dict[str, List[torch.Tensor]] = {}
    counter = Counter()
    t0 = time.perf_counter()
    # --repeat: exact stage inputs a second time, the run-to-run floor of the cosine (GPU kernels that add in
    # a varying order, e.g. flash attention's backward, differ between two identical steps).
    c = args.format
    for mode in ("bf16", c) + (("bf16 again",) if args.repeat else ()):
        for _, p in trained:
            p.grad = None
        run_config = roundpipe.RoundPipeRunConfig(stage_inputs=mode.split()[0])
        loss = model.train_step(input_ids=ids, labels=ids, run_config=run_config)
        model.synchronize()
        grads[mode] = [p.grad.detach().float().flatten().clone() for _, p in trained]
        print(f"{mode}: loss {float(loss):.6f}", file=sys.stderr)
    # Sums in float64, tensor by tensor: a float32 cosine over hundreds of millions of values is off by far
    # more than the 1e-3 looked for (it gave 1.09 on qwen3-0.6b).
    pairs = (("bf16", c), ("bf16", "bf16"), (c, c))
    dot, aa, bb = (sum(float((x.double() * y.double()).sum()) for x, y in zip(grads[p], grads[q])) for p, q in pairs)
    per = [(_cosine(x, y), n) for (n, _), x, y in zip(trained, grads["bf16"], grads[c]) if x.norm() > 0]
    worst = min(per)
    floor = {}
    if args.repeat:
        d2, a2, b2 = (
            sum(float((x.double() * y.double()).sum()) for x, y in zip(grads[p], grads[q]))
            for p, q in (("bf16", "bf16 again"), ("bf16", "bf16"), ("bf16 again", "bf16 again"))
        )
        floor = {
            "repeat_grad_cosine": d2 / (a2 * b2) ** 0.5,
            "repeat_grad_rel_err": max(0.0, a2 + b2 - 2 * d2) ** 0.5 / a2**0.5,
        }
    return {
        "mode": "grad-cosine",
        "format": c,
        "workload": args.workload,
        "seq": args.seq,
        "lora": args.lora,
        "plan": args.plan,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(next(hf.parameters()).dtype),
        "grad_cosine": dot / (aa * bb) ** 0.5,
        "grad_rel_err": max(0.0, aa + bb - 2 * dot) ** 0.5 / aa**0.5,
        "worst_tensor_cosine": worst[0],
        "worst_tensor": worst[1],
        "tensors": len(per),
        "compacted": counter.n,
        "int8_blocks_in_fp8": f"{counter.fp8_blocks} of {counter.blocks}" if c == "int8" else None,
        "seconds": round(time.perf_counter() - t0, 1),
        **floor,
    }


def workload_losses(mode: str, args: argparse.Namespace) -> List[float]:
    """Per-step losses of ``--steps`` Adam steps on one fixed random batch (the model memorises it)."""
    import roundpipe

    hf, model = build(args)
    ids = tokens(hf.config.vocab_size, args.seq)
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=args.lr)
    cfg = roundpipe.RoundPipeRunConfig(stage_inputs=mode)
    out = []
    for _ in range(args.steps):
        out.append(float(model.train_step(input_ids=ids, labels=ids, run_config=cfg)))
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    model.synchronize()
    return out


def losses(args: argparse.Namespace) -> Dict[str, Any]:
    """Final losses of the same training with exact and compact (``--format``) stage inputs."""
    t0 = time.perf_counter()
    runs: Dict[str, List[float]] = {}
    counter = Counter() if args.workload != "task" else None
    c = args.format
    for mode in ("bf16", c) + (("control",) if args.workload == "task" and args.control else ()):
        if args.workload == "task":
            with tempfile.TemporaryDirectory() as d:
                runs[mode] = task_losses("bf16" if mode == "control" else mode, args, d, seed=int(mode == "control"))
        else:
            runs[mode] = workload_losses(mode, args)
    last = {m: sum(v[-10:]) / len(v[-10:]) for m, v in runs.items()}
    mean = {m: sum(v) / len(v) for m, v in runs.items()}
    control = {}
    if "control" in runs:  # the spread of another seed, exact stage inputs: what a 'ratio' is measured against
        control = {"control_loss": runs["control"][-1], "control_ratio": runs["control"][-1] / runs["bf16"][-1]}
        control["control_last10_ratio"] = last["control"] / last["bf16"]
        control["control_mean_ratio"] = mean["control"] / mean["bf16"]
    return {
        "mode": "loss",
        "workload": args.workload,
        "seq": args.seq or "task default",
        "lora": args.lora,
        "steps": args.steps,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "loss_bf16": runs["bf16"][-1],
        f"loss_{c}": runs[c][-1],
        "ratio": runs[c][-1] / runs["bf16"][-1],
        "last10_bf16": last["bf16"],
        f"last10_{c}": last[c],
        "last10_ratio": last[c] / last["bf16"],
        "mean_ratio": mean[c] / mean["bf16"],
        "first_step_equal": runs[c][0] == runs["bf16"][0],
        **control,
        "compacted": counter.n if counter is not None else "see the runs' logs",
        "seconds": round(time.perf_counter() - t0, 1),
    }


def seed_losses(args: argparse.Namespace) -> Dict[str, Any]:
    """The built-in task's final losses at ``--seeds`` seeds, exact and compact (``--format``) stage inputs at
    each seed: the task's last steps land anywhere on a steep slope (one seed ends 44x another), so one pair's
    final-step ratio measures that slope; the means over seeds, and each pair's ratio beside the spread of the
    exact runs across seeds, say whether the format moves the final loss."""
    t0 = time.perf_counter()
    c = args.format
    final: Dict[str, List[float]] = {"bf16": [], c: []}
    last10: Dict[str, List[float]] = {"bf16": [], c: []}
    for seed in range(args.seeds):
        for mode in ("bf16", c):
            with tempfile.TemporaryDirectory() as d:
                run = task_losses(mode, args, d, seed=seed)
            final[mode].append(run[-1])
            last10[mode].append(sum(run[-10:]) / len(run[-10:]))

    def mean(v: List[float]) -> float:
        return sum(v) / len(v)

    exact = final["bf16"]
    return {
        "mode": "seeds",
        "steps": args.steps,
        "seeds": args.seeds,
        "final_bf16": [round(v, 5) for v in exact],
        f"final_{c}": [round(v, 5) for v in final[c]],
        "pair_ratios": [round(b / a, 3) for a, b in zip(exact, final[c])],
        "mean_final_bf16": mean(exact),
        f"mean_final_{c}": mean(final[c]),
        "mean_final_ratio": mean(final[c]) / mean(exact),
        "mean_last10_ratio": mean(last10[c]) / mean(last10["bf16"]),
        "exact_spread_max_over_min": max(exact) / min(exact),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def block_errors(args: argparse.Namespace) -> Dict[str, Any]:
    """Relative RMS error of the fp8 round trip per block size (and int8's at 32 and 128), on hidden-state-like
    values: ``--size`` x ``--size`` Gaussian values, and the same with three outlier channels (the "massive
    activations" of LLM hidden states reach 1e3-1e4x the median); the error is measured on the ordinary
    channels, the ones an outlier's scale coarsens (a block whose largest value is 2**15 times another's holds
    that one as an fp8 subnormal)."""
    from roundpipe.runtime import stage_codec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=g)
    out: Dict[str, Any] = {"mode": "block-errors"}
    outlier_channels = torch.tensor([7, 1500, 3001]) * args.size // 4096
    for name, factor in (("gaussian", 1.0), *((f"outliers_{f:.0e}x", f) for f in (1e3, 1e4, 3e4, 1e5))):
        y = x.clone()
        y[:, outlier_channels] *= factor
        keep = torch.ones(y.shape[1], dtype=torch.bool)
        keep[outlier_channels] = False
        row: Dict[str, float] = {}
        for block in (32, 64, 128, 256, 512, 4096):
            err = stage_codec.roundtrip(y.to(torch.bfloat16), block).float() - y.to(torch.bfloat16).float()
            ref = y.to(torch.bfloat16).float()
            row[str(block)] = round((err[:, keep].norm() / ref[:, keep].norm()).item(), 5)
        for block in (32, 128):  # int8 beside it: absmax scales, so an outlier coarsens its block's others
            ref = y.to(torch.bfloat16).float()
            err = stage_codec.roundtrip(y.to(torch.bfloat16), block, "int8").float() - ref
            row[f"int8_{block}"] = round((err[:, keep].norm() / ref[:, keep].norm()).item(), 5)
        out[name] = row
    out["bytes_per_value"] = {str(b): stage_codec.bytes_per_value(b) for b in (32, 64, 128, 256, 512, 4096)}
    return out


# ---- repeat: is a run repeatable? --------------------------------------------------------------------------


REPEAT_BATCH, REPEAT_ACCUM, REPEAT_LR, REPEAT_SEQ, REPEAT_VOCAB = 4, 2, 3e-3, 12, 128


def repeat_batches(steps: int) -> List[Dict[str, torch.Tensor]]:
    """``steps`` x ``REPEAT_ACCUM`` batches of counting sequences (the first three labels masked)."""
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, REPEAT_VOCAB - 3, (steps * REPEAT_ACCUM * REPEAT_BATCH,), generator=g)
    ids = (starts[:, None] + torch.arange(REPEAT_SEQ)) % (REPEAT_VOCAB - 3) + 3
    labels = ids.clone()
    labels[:, :3] = -100
    return [
        {
            "input_ids": ids[k * REPEAT_BATCH : (k + 1) * REPEAT_BATCH],
            "labels": labels[k * REPEAT_BATCH : (k + 1) * REPEAT_BATCH],
        }
        for k in range(steps * REPEAT_ACCUM)
    ]


def repeat_train(steps: int) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """One run: the first call's host gradients and each step's mean loss."""
    from transformers import Qwen3ForCausalLM

    import roundpipe

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(tiny_config("qwen3", tie_word_embeddings=True)).to(torch.bfloat16)
    run_config = roundpipe.RoundPipeRunConfig(num_microbatch=2)
    model = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=run_config, optim_dtype=torch.float32)
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=REPEAT_LR, decoupled_weight_decay=True)
    data, first, losses = repeat_batches(steps), {}, []
    for k in range(steps):
        total = 0.0
        for j in range(REPEAT_ACCUM):
            total += model.forward_backward(
                input_kwargs=data[k * REPEAT_ACCUM + j], loss_fn=lambda out, _: out.loss
            ).item()
            if not first:
                model.synchronize()
                first = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        def step_fn() -> None:
            torch.nn.utils.clip_grad_norm_(list(model.optim_parameters()), 1.0)
            opt.step()
            opt.zero_grad()

        model.step(step_fn)
        losses.append(total / REPEAT_ACCUM)
    model.synchronize()
    return first, losses


def repeat(args: argparse.Namespace) -> None:
    """``repeat``: two runs compared."""
    import roundpipe

    warnings.filterwarnings("ignore", message=".*named_parameters")  # the bf16 parameters' gradients are compared
    (g1, l1), (g2, l2) = repeat_train(args.steps), repeat_train(args.steps)
    diff = {n: (g1[n].float() - g2[n].float()).abs().max().item() for n in g1}
    worst = max(diff, key=diff.get)
    same = "equal" if max(diff.values()) == 0 else "DIFFER"
    print(
        f"{roundpipe.get_num_devices()} device(s): first call's gradients {same}"
        f" (largest difference {diff[worst]:.3g} in {worst}); losses run 1 {[round(x, 5) for x in l1]}, run 2 "
        f"{[round(x, 5) for x in l2]}, largest relative difference "
        f"{max(abs(a - b) / abs(b) for a, b in zip(l1, l2)):.3g}"
    )


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    o = sub.add_parser("optimizer", help="compact Adam state against fp32 Adam (tiny model, CPU)")
    o.add_argument("--steps", type=int, default=300)
    o.add_argument("--batch", type=int, default=16)
    o.add_argument("--seq", type=int, default=128)
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--modes", default="", help="comma-separated indices into MODES (default all; 0, fp32, always)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--out", default=str(ROOT / "docs" / "img" / "compact_convergence.png"))
    stage = argparse.ArgumentParser(add_help=False)  # the options of the stage-input subcommands
    stage.add_argument("--workload", default="task", help="task (the built-in task), or one of " + ", ".join(WORKLOADS))
    stage.add_argument("--seq", type=int, default=0, help="tokens per sequence (task: its own length; else 1024)")
    stage.add_argument("--lora", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    stage.add_argument("--format", choices=("fp8", "int8"), default="fp8", help="the compact stage-input format")
    stage.add_argument(
        "--plan",
        choices=("layerwise", "auto"),
        default="layerwise",
        help="a workload's plan (layerwise: all compacted)",
    )
    s = sub.add_parser("stage-inputs", parents=[stage], help="losses with exact and compact stage inputs")
    s.add_argument("--steps", type=int, default=200, help="optimizer steps")
    s.add_argument("--lr", type=float, default=1e-4, help="learning rate of a workload's training")
    s.add_argument("--no-control", dest="control", action="store_false", help="task: no control run (exact, seed 1)")
    s.add_argument("--seeds", type=int, default=0, help="task: exact and compact at seeds 0..N-1, means compared")
    g = sub.add_parser("grad-cosine", parents=[stage], help="one step's gradient cosine, exact vs compact")
    g.add_argument("--repeat", action="store_true", help="also a second exact step (the run-to-run floor)")
    b = sub.add_parser("block-errors", help="round-trip error per block size")
    b.add_argument("--size", type=int, default=4096, help="rows and columns of the values")
    r = sub.add_parser("repeat", help="the same tiny model trained twice on the pool, compared")
    r.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    if args.command == "optimizer":
        return optimizer(args)
    if args.command == "repeat":
        return repeat(args)
    os.environ[SAVED_GB] = "0"  # every stage input through the host (see the module docstring)
    if args.command == "block-errors":
        print(json.dumps(block_errors(args)))
        return None
    if args.workload != "task" and not args.seq:
        args.seq = 1024
    if args.command == "grad-cosine":
        if args.workload == "task":
            p.error("grad-cosine takes a workload's model: --workload tiny, qwen3-0.6b, ..., qwen3-8b")
        print(json.dumps(grad_cosine(args)))
    elif args.seeds:
        if args.workload != "task" or args.seeds < 2:
            p.error("--seeds: the built-in task (--workload task) at 2 seeds or more")
        print(json.dumps(seed_losses(args)))
    else:
        print(json.dumps(losses(args)))
    return None


if __name__ == "__main__":
    main()
