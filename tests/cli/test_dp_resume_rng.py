"""A data-parallel ``roundpipe train --resume`` restores each rank's own RNG state.

Two ranks under torchrun (CPU workers, gloo) train a LoRA model with dropout on an uneven row split
(3 rows: 1 on one rank, 2 on the other), so the ranks' dropout masks draw different amounts from their
generators and their RNG states part after the first step. Resuming from the step-2 checkpoint must
repeat the uninterrupted run bit for bit; a rank that took another rank's state (rank 0's, the one
the checkpoint also keeps for resuming with another layout) would draw other masks from step 3 on.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Dict, List

import helpers
import pytest
import torch

from roundpipe.cli.checkpoint import load_tensors, load_torch

ARGS = [
    "--steps",
    "4",
    "--batch-size",
    "3",
    "--lora-r",
    "4",
    "--lora-dropout",
    "0.2",
    "--save-every",
    "2",
    "--keep-checkpoints",
    "3",
    "--eval-examples",
    "0",
    "--log-every",
    "1",
    "--no-progress",
]


def _train(args: List[str], tmp_path: Any) -> None:
    """``torchrun --nproc-per-node 2 -m roundpipe train ARGS`` with one CPU worker per rank."""
    env = {"RPP_PROGRESS": "0", "RPP_DIST_MAIN_TIMEOUT_S": "30"}
    res = helpers.torchrun("-m", ["roundpipe", "train", *args], tmp_path, env=env, timeout=150)
    assert res.returncode == 0, res.stderr[-4000:]


def _metrics(out: str) -> List[Dict[str, str]]:
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in csv.DictReader(f)]


def _checkpoint(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step-{step:07d}")


@pytest.mark.timeout(300)
def test_resume_with_dropout_and_uneven_rows_restores_each_ranks_rng(tmp_path: Any) -> None:
    full = str(tmp_path / "full")
    _train([*ARGS, "--output-dir", full], tmp_path)
    trainer = load_torch(os.path.join(_checkpoint(full, 2), "trainer.pt"))
    by_rank = trainer["rng_by_rank"]  # type: ignore[index]
    # The test can fail: the ranks' generators really differ at the checkpoint (rank 0's is also "rng").
    assert len(by_rank) == 2 and not torch.equal(by_rank[0]["torch"], by_rank[1]["torch"])
    assert torch.equal(trainer["rng"]["torch"], by_rank[0]["torch"])  # type: ignore[index]
    resumed = str(tmp_path / "resumed")
    _train(["--resume", _checkpoint(full, 2), "--output-dir", resumed], tmp_path)
    assert _metrics(resumed) == _metrics(full)[2:]
    got = load_tensors(os.path.join(_checkpoint(resumed, 4), "optim", "master.safetensors"))
    want = load_tensors(os.path.join(_checkpoint(full, 4), "optim", "master.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
