"""Do the compact training paths reach the loss of the plain one? A small real task, on CPU workers.

A small Qwen3 model (hidden 256 by default: NF4 error on a hidden-64 toy is harsher than on a large model) is
pretrained in plain PyTorch on a synthetic language, then saved as a Hugging Face checkpoint directory
(safetensors). Each sequence is ``x_1 .. x_L SEP y_1 .. y_L``: the x's a Markov chain over ``--vocab``
symbols (each row of its transition matrix a softmax of Gaussian logits: a few nats of entropy per token),
``y_i = f(x_i)`` for a fixed permutation ``f``, replaced by a uniform symbol with probability ``--noise``. The
base learns the chain's statistics and to copy through ``f`` over a distance of L + 1 positions. Neither half
has a zero loss floor (the chain's entropy, the noise's), so a few percent of loss is a real difference.

The fine-tuning task is a shifted one: half of the chain's rows drawn again and ``f`` composed with a
rotation of the symbols. It is learnt through ``roundpipe.from_pretrained`` twice, same init, same batches, same
steps (bf16 compute, RoundPipe's host Adam), the two runs of ``--compare``:

* ``base`` (the default): LoRA (r ``--lora-r``, every projection) over the base read as ``bf16`` and as ``nf4``.
* ``fp8``: a full fine-tune (every weight trained) in bf16 and with ``fp8=True``: the decoder layers'
  projections as torchao's ``Float8Linear`` (dynamic tensorwise e4m3 casts of input, weight and output
  gradient). CPU workers have no FP8 GEMMs: torchao's casts run as on a GPU and ``torch._scaled_mm`` computes
  over the fp8 values on CPU, so the rounding is FP8's; only the speed is not.

Printed per run: the loss of the model before training on its own language (the damage of NF4, or of the FP8
casts, to what was learnt), the first fine-tuning loss, the final loss (the mean of the last ``--tail`` steps'
training losses; every batch is fresh, so they are held-out losses); then the ratio of the final losses, second
run over first. Measured on two CPU workers, 2026-12-02 (docs/benchmarks.md):

* ``base``: bf16 1.6156, nf4 1.6150, ratio 0.9996 (318 s);
* ``fp8``: bf16 1.5961, fp8 1.5959, ratio 0.9999 (297 s: pretraining 53, bf16 78, fp8 164; emulated casts).

    RPP_DEVICES=cpu:2 python bench/quality.py --threads 1                  # 300 steps: the measured rows
    RPP_DEVICES=cpu:2 python bench/quality.py --threads 1 --compare fp8
    RPP_DEVICES=cpu:2 python bench/quality.py --threads 1 --steps 60 --pretrain-steps 200 --layers 1

``--threads 1`` on 2 cores: each CPU worker computes on one core (they take the process's thread count), and
the pretraining's small matrices gain nothing from a second thread. ``tests/test_quality.py`` runs shortened
versions against tighter bounds that a wrong path fails (NF4 scales off by 1.25x, fp8 weight scales off by 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's roundpipe


EVAL_BATCHES = 4
"""Batches of the pretraining language the base's own loss is measured on."""


@dataclass
class Language:
    """The synthetic language: a Markov chain over the symbols, a permutation the second half copies through."""

    transitions: torch.Tensor  # [vocab, vocab] row-stochastic
    start: torch.Tensor  # [vocab] the first symbol's distribution
    mapping: torch.Tensor  # [vocab] long, y = mapping[x]
    length: int  # L, symbols per half
    noise: float  # probability that a y is a uniform symbol instead


def pretrain_language(vocab: int, length: int, noise: float, seed: int, sharpness: float = 2.0) -> Language:
    """The pretraining language: random transitions (softmax of Gaussian logits times ``sharpness``), a
    random permutation."""
    g = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(sharpness * torch.randn(vocab, vocab, generator=g), dim=-1)
    start = torch.softmax(sharpness * torch.randn(vocab, generator=g), dim=-1)
    return Language(transitions, start, torch.randperm(vocab, generator=g), length, noise)


def shifted_language(base: Language, seed: int, rotate: int = 7, sharpness: float = 2.0) -> Language:
    """The fine-tuning language: half of ``base``'s transition rows drawn again, the mapping followed by a
    rotation of the symbols by ``rotate``."""
    g = torch.Generator().manual_seed(seed + 1)
    vocab = base.transitions.shape[0]
    transitions = base.transitions.clone()
    rows = torch.randperm(vocab, generator=g)[: vocab // 2]
    transitions[rows] = torch.softmax(sharpness * torch.randn(len(rows), vocab, generator=g), dim=-1)
    mapping = (base.mapping + rotate) % vocab
    return Language(transitions, base.start, mapping, base.length, base.noise)


def sample(lang: Language, batch: int, g: torch.Generator) -> torch.Tensor:
    """``batch`` sequences ``x_1 .. x_L SEP y_1 .. y_L`` [batch, 2L + 1] (SEP is symbol id ``vocab``)."""
    vocab, n = lang.transitions.shape[0], lang.length
    x = torch.empty(batch, n, dtype=torch.long)
    x[:, 0] = torch.multinomial(lang.start.expand(batch, vocab), 1, generator=g)[:, 0]
    for i in range(1, n):
        x[:, i] = torch.multinomial(lang.transitions[x[:, i - 1]], 1, generator=g)[:, 0]
    y = lang.mapping[x]
    flip = torch.rand(batch, n, generator=g) < lang.noise
    y = torch.where(flip, torch.randint(0, vocab, (batch, n), generator=g), y)
    sep = torch.full((batch, 1), vocab, dtype=torch.long)
    return torch.cat([x, sep, y], dim=1)


def model_config(vocab: int, length: int, hidden: int, layers: int) -> Any:
    """A Qwen3 config of ``hidden`` (head dim 64, intermediate 2x hidden) over the symbols, SEP and a pad."""
    from roundpipe.models.configs import tiny_config

    heads = max(1, hidden // 64)
    return tiny_config(
        "qwen3",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        vocab_size=vocab + 2,
        pad_token_id=vocab + 1,
        max_position_embeddings=2 * length + 2,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )


def pretrain(path: str, lang: Language, args: argparse.Namespace) -> List[float]:
    """Train a fresh model on ``lang`` in plain PyTorch (fp32 AdamW, cosine schedule) and save it to ``path``
    as a Hugging Face checkpoint (safetensors); returns the losses per step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(
        model_config(args.vocab, args.length, args.hidden, args.layers), dtype=torch.float32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.pretrain_lr, total_steps=args.pretrain_steps, pct_start=0.1)
    g = torch.Generator().manual_seed(args.seed + 100)
    losses = []
    for _ in range(args.pretrain_steps):
        ids = sample(lang, args.batch, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 matmuls (fast on CPUs with AMX)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad(), sched.step()
        losses.append(float(loss.detach()))
        if args.progress and len(losses) % 50 == 0:
            print(f"pretrain step {len(losses)}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    model.save_pretrained(path)
    return losses


@dataclass(frozen=True)
class Run:
    """One side of a comparison: how the pretrained checkpoint is read and trained."""

    name: str  # the row's label
    base_format: str  # how frozen weights are kept in host memory (a LoRA base)
    lora: bool  # LoRA on every projection (else every weight is trained)
    fp8: bool  # FP8 GEMMs in the decoder layers' projections


COMPARES: Dict[str, Tuple[Run, Run]] = {
    "base": (Run("bf16", "bf16", True, False), Run("nf4", "nf4", True, False)),
    "fp8": (Run("bf16", "bf16", False, False), Run("fp8", "bf16", False, True)),
}
"""``--compare``: the reference run, then the run measured against it."""


def fine_tune(path: str, lang: Language, pre_lang: Language, run: Run, args: argparse.Namespace) -> Dict[str, Any]:
    """Checkpoint ``path`` read and trained as ``run`` says (LoRA on every projection over a base kept as
    ``run.base_format``, or a full fine-tune; FP8 GEMMs or not) on ``lang`` through RoundPipe (bf16 compute,
    host Adam): the training loss per step, and the loss of the model before training (LoRA's adapters start at
    zero) on its own language ``pre_lang``. The adapters' init and the batches depend on ``args.seed`` alone, so
    two runs see the same of both."""
    from peft import LoraConfig

    import roundpipe

    lora = None
    if run.lora:
        lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", lora_dropout=0.0)
    torch.manual_seed(args.seed)
    model = roundpipe.from_pretrained(path, base_format=run.base_format, lora=lora, dtype=torch.bfloat16, fp8=run.fp8)
    adam = roundpipe.optim.Adam(model.optim_parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 300)
    with torch.no_grad():
        held = [sample(pre_lang, args.batch, g) for _ in range(EVAL_BATCHES)]
        base_loss = sum(float(model(input_ids=ids, labels=ids).loss) for ids in held) / EVAL_BATCHES
    g = torch.Generator().manual_seed(args.seed + 200)
    losses = []
    for _ in range(args.steps):
        ids = sample(lang, args.batch, g)
        losses.append(float(model.train_step(input_ids=ids, labels=ids)))
        model.step(lambda: (adam.step(), adam.zero_grad()))
        if args.progress and len(losses) % 50 == 0:
            print(f"{run.name} step {len(losses)}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    model.synchronize()
    float8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())  # torchao's recipe, fp8=True
    return {"base_loss": base_loss, "losses": losses, "float8_linears": float8}


def summarize(run: Dict[str, Any], tail: int) -> Dict[str, Any]:
    """``fine_tune``'s result with its first loss, its mean over the run and its final loss (the mean of the
    last ``tail`` steps)."""
    losses = run["losses"]
    last = losses[-tail:]
    return {**run, "first": losses[0], "mean": sum(losses) / len(losses), "final": sum(last) / len(last)}


def compare(args: argparse.Namespace) -> Dict[str, Any]:
    """Pretrain, then fine-tune once per run of ``COMPARES[args.compare]``: the losses, a summary per run
    (keyed by its name) and the ratio of the second run's final loss to the first's."""
    pre_lang = pretrain_language(args.vocab, args.length, args.noise, args.seed)
    lang = shifted_language(pre_lang, args.seed)
    out: Dict[str, Any] = {"args": vars(args)}
    runs = COMPARES[args.compare]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pre = pretrain(tmp, pre_lang, args)
        out["pretrain"] = {**summarize({"losses": pre}, args.tail), "seconds": round(time.perf_counter() - t0, 1)}
        for run in runs:
            t0 = time.perf_counter()
            out[run.name] = summarize(fine_tune(tmp, lang, pre_lang, run, args), args.tail)
            out[run.name]["seconds"] = round(time.perf_counter() - t0, 1)
    out["ratio"] = out[runs[1].name]["final"] / out[runs[0].name]["final"]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--compare",
        choices=sorted(COMPARES),
        default="base",
        help="base: LoRA over the base read as bf16 and as nf4; fp8: a full fine-tune in bf16 and with fp8=True",
    )
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per run")
    p.add_argument("--pretrain-steps", type=int, default=400, help="plain PyTorch steps of the base")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (head dim 64, intermediate 2x)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=48, help="symbols of the language (the model adds SEP and a pad)")
    p.add_argument("--length", type=int, default=24, help="symbols per half of a sequence")
    p.add_argument("--noise", type=float, default=0.1, help="probability that a copied symbol is uniform instead")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="the fine-tune's Adam learning rate")
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--tail", type=int, default=20, help="the final loss is the mean of this many last steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the whole result (every loss) as JSON")
    p.add_argument("--progress", action="store_true", help="a line on stderr every 50 steps")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the process; each CPU worker computes with this many (2 cores, cpu:2: 1)",
    )
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = compare(args)
    if args.json:
        print(json.dumps(out))
        return
    pre = out["pretrain"]
    print(f"pretrain: {args.pretrain_steps} steps, loss {pre['first']:.4f} -> {pre['final']:.4f} ({pre['seconds']} s)")
    label = {"base": "base", "fp8": "GEMMs (full fine-tune)"}[args.compare]
    print(
        f"| {label} | before, on its own task | first loss | final loss (last {args.tail} of {args.steps}) | seconds |"
    )
    print("|---|---|---|---|---|")
    runs = COMPARES[args.compare]
    for run in runs:
        r = out[run.name]
        print(f"| {run.name} | {r['base_loss']:.4f} | {r['first']:.4f} | {r['final']:.4f} | {r['seconds']} |")
    print(f"{runs[1].name} / {runs[0].name} final loss: {out['ratio']:.4f}")
    if args.compare == "fp8":
        print(f"fp8: {out['fp8']['float8_linears']} decoder projections as torchao Float8Linear (bf16: 0)")


if __name__ == "__main__":
    main()
