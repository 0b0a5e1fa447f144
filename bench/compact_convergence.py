"""Convergence of the compact Adam state against fp32 Adam: a tiny Qwen3 language model on CPU.

The model is a Hugging Face ``Qwen3ForCausalLM`` built from a small config (hidden 128, 2 layers, 4 heads,
byte vocabulary of 256) and trained on the repository's own text (README.md and docs/*.md as bytes; the
last 10% held out). Every run starts from the same weights and sees the same batches; only the optimizer
(``roundpipe.optim.Adam``) differs. fp32-master modes train the fp32 model; bf16-master modes train the
same weights cast to bf16 (the bf16 parameters are the masters). Prints the final held-out losses and
their difference to fp32 Adam, and writes the curves to docs/img/compact_convergence.png (matplotlib,
a bench-only dependency; the plot is skipped without it).

    python bench/compact_convergence.py                    # 300 steps, a few minutes on 2 cores
    python bench/compact_convergence.py --steps 100 --no-plot
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from roundpipe.optim import Adam

ROOT = Path(__file__).resolve().parent.parent
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
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
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
    model = make_model(args.seed)
    if kw.get("master") == "bfloat16":
        model = model.to(torch.bfloat16)
    opt = Adam(model.parameters(), lr=args.lr, weight_decay=0.01, decoupled_weight_decay=True, seed=args.seed, **kw)  # type: ignore[arg-type]
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


def main() -> None:
    """Run every mode and report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--modes",
        default="",
        help="comma-separated indices into MODES (default: all; 0 is the fp32 baseline, always run)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "compact_convergence.png"))
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
