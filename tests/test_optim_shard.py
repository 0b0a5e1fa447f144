"""The sharded host optimizer step (``roundpipe.distributed.optim_shard``) under adverse timing and
irregular call patterns, bit for bit against the replicated step.

Each test launches ``torchrun --nproc-per-node 2`` on ``tests/dist_scripts/shard_step.py`` twice: once
with the step shared by the ranks (``--shard``), once with every rank stepping everything, and compares
every rank's losses, masters and weights exactly. Every rank trains on the same whole batch, so the
replicas agree with or without a gradient reduction.

* A slow reader: rank 1 copies the updated masters into its model slowly while rank 0 races ahead.
  Without a gradient reduction (``--sync-via shard-only``), only the shard's "read" barrier keeps
  rank 0 from writing the next step's masters while rank 1 still copies the previous ones. (With
  ``enable_data_parallel``, the reduction's collective at the start of each step orders them too.)
* Resyncs: evaluations between a training call and ``step()``, a changing number of calls per step
  (the weights a call moved into the step's buffers are settled first) and a synchronous step among
  asynchronous ones, through the real data-parallel step; and on every rank each master's version
  counter moves at each step, also where the other rank wrote it (the step protocol compares version
  counters to tell whether the weights are current, ``ParamBuffers.weights_current``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import helpers
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "shard_step.py")


def _run(tmp_path: Any, name: str, args: List[str]) -> Dict[str, Any]:
    """One 2-rank run of the script; its result (every rank's losses and digests)."""
    out = os.path.join(str(tmp_path), f"{name}.json")
    res = helpers.torchrun(SCRIPT, [*args, "--out", out], tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def _assert_same_runs(sharded: Dict[str, Any], replicated: Dict[str, Any]) -> None:
    """Every rank of the sharded run computed exactly what the replicated run did."""
    assert 0 < sharded["owned_here"] < sharded["total_params"], sharded  # both ranks own a share
    for rank, (got, want) in enumerate(zip(sharded["ranks"], replicated["ranks"])):
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        assert got["evals"] == want["evals"], rank
        assert got["masters"] == want["masters"] and got["weights"] == want["weights"], rank


@pytest.mark.timeout(240)
def test_sharded_step_waits_for_a_slow_peer_to_copy_the_masters(tmp_path: Any) -> None:
    """Rank 1 takes 20 ms per unit to copy the masters into its model; rank 0 must not write the next
    step's masters meanwhile, or rank 1 trains on a mix of two versions (its losses, then everyone's
    masters, leave the replicated run's)."""
    common = ["--sync-via", "shard-only", "--schedule", "1,1,1,1,1", "--slow-rank", "1", "--slow-s", "0.02"]
    replicated = _run(tmp_path, "replicated", common)
    sharded = _run(tmp_path, "sharded", [*common, "--shard"])
    _assert_same_runs(sharded, replicated)


@pytest.mark.timeout(240)
def test_sharded_step_with_resyncs_equals_the_replicated_step(tmp_path: Any) -> None:
    """Evaluations between a call and ``step()``, one to three calls per step and a synchronous step,
    rank 1 slow to copy the masters: the sharded data-parallel step stays bit-identical."""
    schedule = "1,1e1,2,1,e1,3,1s,1,1e,2,1"
    common = ["--sync-via", "dp", "--schedule", schedule, "--slow-rank", "1", "--slow-s", "0.005"]
    replicated = _run(tmp_path, "replicated", common)
    sharded = _run(tmp_path, "sharded", [*common, "--shard"])
    _assert_same_runs(sharded, replicated)
    assert len(sharded["ranks"][0]["evals"]) == 3 and len(sharded["ranks"][0]["losses"]) == 16
    # On every rank each master's version counter moved at each of the 11 steps, as if this rank had
    # written it, also where the other rank stepped it (``ParamBuffers.weights_current`` reads them).
    assert all(r["version_moves"] >= 11 for r in sharded["ranks"]), sharded["ranks"]
