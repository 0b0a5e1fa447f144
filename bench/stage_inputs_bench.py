"""Compact stage inputs (``RPP_STAGE_INPUTS=fp8`` or ``int8``, ``roundpipe.runtime.stage_codec``) against exact ones
(bf16: the run dtype): the same training with the backward stages' inputs kept exact, then compact (``--format``,
default fp8), compared.

Modes (each prints one JSON line):

* loss (default): ``--steps`` optimizer steps from the same weights on the same data, once per format;
  the final losses (last step, and the mean of the last 10 steps: single steps are noisy), the mean
  over all steps, and their ratios. ``--workload task`` (default) is ``roundpipe train``'s built-in task
  (the tiny Qwen3 learning to reverse strings), run as ``python -m roundpipe train`` with ``--plan
  layerwise`` (the task's default plan, ``single``, runs the whole model in one stage: no stage input
  would be kept) and the task's sequence length unless ``--seq`` is given; with a control run: exact
  stage inputs, seed 1 (near the end the task's loss is ~0.01, where any perturbation moves it by tens
  of percent). Another workload (``bench/train_bench.py``'s shapes: tiny, qwen3-0.6b, ..., qwen3-8b)
  trains on one fixed batch of random tokens (it learns to repeat it).
* ``--seeds N`` (the built-in task): exact and compact at seeds 0..N-1; each seed's pair ratio, and the ratio of
  the mean final losses over the seeds (what a single pair's last steps cannot say).
* ``--grad-cosine``: one training step of a workload's model (random weights, random tokens,
  ``--seq`` tokens, LoRA with ``--lora R``) with exact, then fp8 stage inputs: the cosine similarity of
  the two steps' parameter gradients (all trainable parameters flattened; and the worst tensor's). With
  ``--plan layerwise`` (default) every decoder layer's input is kept, and compacted.

Stage inputs kept in the GPU's free room stay exact, so the script sets ``RPP_DEBUG_DEVICE_SAVED_GB=0``: every
stage input goes through the host, where the compact format applies. ``"compacted"`` counts the tensors
encoded in the fp8 run (0 would mean the comparison compared nothing).

    python bench/stage_inputs_bench.py                                    # loss, built-in task, 200 steps
    python bench/stage_inputs_bench.py --format int8 --seeds 5            # the same at five seeds, means compared
    python bench/stage_inputs_bench.py --grad-cosine --workload tiny --seq 1024
    python bench/stage_inputs_bench.py --grad-cosine --workload qwen3-8b --lora 16 --seq 32768   # on a GPU
    python bench/stage_inputs_bench.py --block-errors                     # error of each block size
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
from typing import Any, Dict, List, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]  # this checkout's roundpipe and train_bench
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def task_losses(mode: str, args: argparse.Namespace, out_dir: str, seed: int = 0) -> List[float]:
    """Per-step losses of ``roundpipe train`` on the built-in task with ``--stage-inputs mode``."""
    cmd = [sys.executable, "-m", "roundpipe", "train", "--steps", str(args.steps), "--plan", "layerwise"]
    cmd += ["--seed", str(seed)]
    cmd += ["--stage-inputs", mode, "--output-dir", out_dir, "--overwrite", "--eval-examples", "0"]
    cmd += ["--log-every", str(max(1, args.steps // 4)), "--no-tensorboard", "--no-progress"]
    if args.seq:
        cmd += ["--seq-len", str(args.seq)]
    env = dict(os.environ, RPP_DEBUG_DEVICE_SAVED_GB="0", RPP_PROGRESS="0")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=sys.stderr)
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def build(args: argparse.Namespace) -> Tuple[torch.nn.Module, Any]:
    """The workload's Hugging Face model (random weights; LoRA adapters with ``--lora``) wrapped in a
    RoundPipe that keeps every stage input on the host."""
    from train_bench import build_model

    import roundpipe

    # Drawn on the GPU where there is one (seconds for an 8B model), then kept on the host, as RoundPipe requires.
    hf = build_model(args.workload, "cuda" if torch.cuda.is_available() else "cpu").to("cpu")
    if args.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        hf = get_peft_model(hf, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=LORA_TARGETS))
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
    values: 4096 x 4096 Gaussian rows, and the same with three outlier channels (the "massive activations" of
    LLM hidden states reach 1e3-1e4x the median); the error is measured on the ordinary channels, the ones an
    outlier's scale coarsens (a block whose largest value is 2**15 times another's holds that one as an
    fp8 subnormal)."""
    from roundpipe.runtime import stage_codec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4096, generator=g)
    out: Dict[str, Any] = {"mode": "block-errors"}
    outlier_channels = torch.tensor([7, 1500, 3001])
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="task", help="task (the built-in task; loss mode), or a bench workload")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (task: its own length; else 1024)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of the loss mode")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of a workload's loss mode")
    p.add_argument("--grad-cosine", action="store_true", help="one step's gradient cosine, exact vs --format")
    p.add_argument("--format", choices=("fp8", "int8"), default="fp8", help="the compact stage-input format compared")
    p.add_argument(
        "--plan",
        choices=("layerwise", "auto"),
        default="layerwise",
        help="a workload's plan (default: one layer "
        "per stage, every decoder layer's input compacted; auto: the planner's)",
    )
    p.add_argument(
        "--no-control", dest="control", action="store_false", help="task: skip the control run (exact, seed 1)"
    )
    p.add_argument(
        "--repeat", action="store_true", help="--grad-cosine: also a second exact step (the run-to-run cosine floor)"
    )
    p.add_argument("--block-errors", action="store_true", help="round-trip error per block size")
    p.add_argument(
        "--seeds", type=int, default=0, help="task: exact and compact at seeds 0..N-1, the means over seeds compared"
    )
    args = p.parse_args()
    os.environ["RPP_DEBUG_DEVICE_SAVED_GB"] = "0"  # every stage input through the host (see the module docstring)
    if args.block_errors:
        print(json.dumps(block_errors(args)))
        return
    if args.workload != "task" and not args.seq:
        args.seq = 1024
    if args.grad_cosine:
        if args.workload == "task":
            p.error("--grad-cosine takes a workload's model: --workload tiny, qwen3-0.6b, ..., qwen3-8b")
        print(json.dumps(grad_cosine(args)))
        return
    if args.seeds:
        if args.workload != "task" or args.seeds < 2:
            p.error("--seeds: the built-in task (--workload task) at 2 seeds or more")
        print(json.dumps(seed_losses(args)))
        return
    print(json.dumps(losses(args)))


if __name__ == "__main__":
    main()
