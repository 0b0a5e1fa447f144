"""Is a run repeatable? The same tiny bf16 Qwen3 (tied embedding and head) trained twice in one process on the
current pool (``RPP_DEVICES``, default all GPUs): the first call's host gradients compared bit for bit, then the
losses of a few Adam steps (two calls per step, clipping), as the Trainer GPU test runs them.

    python bench/repeat_losses.py --steps 6    # RPP_DEBUG_GRAPHS=0 / RPP_DEBUG_SPLIT_FUSED=0 / ... to isolate a cause
"""

from __future__ import annotations

import argparse
import warnings
from typing import Dict, List, Tuple

import torch
import transformers

import roundpipe
from roundpipe import RoundPipeRunConfig

BATCH, ACCUM, LR, SEQ, VOCAB = 4, 2, 3e-3, 12, 128


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.1,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def batches(steps: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, VOCAB - 3, (steps * ACCUM * BATCH,), generator=g)
    ids = (starts[:, None] + torch.arange(SEQ)) % (VOCAB - 3) + 3
    labels = ids.clone()
    labels[:, :3] = -100
    return [
        {"input_ids": ids[k * BATCH : (k + 1) * BATCH], "labels": labels[k * BATCH : (k + 1) * BATCH]}
        for k in range(steps * ACCUM)
    ]


def train(steps: int) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    model = roundpipe.wrap_model_to_roundpipe(
        tiny(), model_run_config=RoundPipeRunConfig(num_microbatch=2), optim_dtype=torch.float32
    )
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=LR, decoupled_weight_decay=True)
    data, first, losses = batches(steps), {}, []
    for k in range(steps):
        total = 0.0
        for j in range(ACCUM):
            total += model.forward_backward(input_kwargs=data[k * ACCUM + j], loss_fn=lambda out, _: out.loss).item()
            if not first:
                model.synchronize()
                first = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        def step_fn() -> None:
            torch.nn.utils.clip_grad_norm_(list(model.optim_parameters()), 1.0)
            opt.step()
            opt.zero_grad()

        model.step(step_fn)
        losses.append(total / ACCUM)
    model.synchronize()
    return first, losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*named_parameters")  # the bf16 parameters' gradients are compared
    (g1, l1), (g2, l2) = train(args.steps), train(args.steps)
    diff = {n: (g1[n].float() - g2[n].float()).abs().max().item() for n in g1}
    worst = max(diff, key=diff.get)
    same = "equal" if max(diff.values()) == 0 else "DIFFER"
    print(
        f"{roundpipe.get_num_devices()} device(s): first call's gradients {same}"
        f" (largest difference {diff[worst]:.3g} in {worst}); losses run 1 {[round(x, 5) for x in l1]}, run 2 "
        f"{[round(x, 5) for x in l2]}, largest relative difference "
        f"{max(abs(a - b) / abs(b) for a, b in zip(l1, l2)):.3g}"
    )


if __name__ == "__main__":
    main()
