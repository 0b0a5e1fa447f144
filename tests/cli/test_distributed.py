"""``roundpipe train`` data parallel under torchrun: 2 ranks on CPU workers (gloo), against one process.

* ``torchrun --nproc-per-node 2 -m roundpipe train`` (uneven shards: 7 rows per batch, gradient
  accumulation) logs the losses and reaches the fp32 weights of one process on the same global
  batches, within 1e-6 relative;
* resuming with 2 ranks from its step-2 checkpoint repeats the uninterrupted 2-rank run bit for bit;
* rank 0 alone wrote the run's files: one metrics row per step, intact checkpoints, one log;
* a rank with no rows at all (batch of 1) takes part in every step, and a rank that fails makes the
  other stop at once with one line naming it.

One torchrun launch costs ~10 s on the 2-core CI machine (start-up and imports), so the 2-rank run is
shared by the tests that read it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from typing import Any, Dict, List, Optional

import pytest
import torch
from helpers import ROOT, launch_ranks

from roundpipe.cli import main
from roundpipe.cli.checkpoint import load_tensors, load_torch, verify_checkpoint

EXACT = 1e-6
# Uneven shards (rows 0-2 and 3-6 of every batch), two batches per step, a checkpoint every 2 steps.
ARGS = [
    "--steps",
    "4",
    "--batch-size",
    "7",
    "--grad-accum",
    "2",
    "--save-every",
    "2",
    "--keep-checkpoints",
    "3",
    "--eval-examples",
    "8",
    "--log-every",
    "1",
    "--no-progress",
]


def torchrun(
    args: List[str], cwd: str, nproc: int = 2, script: Optional[List[str]] = None, survivors: bool = False
) -> subprocess.CompletedProcess:
    """``roundpipe train`` (or ``script``) on ``nproc`` ranks: one CPU worker, one thread per rank. The ranks
    start with torchrun's environment directly (``helpers.launch_ranks``; ``survivors``: a failing rank's peers
    are left to end on their own, as ``helpers.torchrun`` says); ``torchrun --standalone`` itself runs in
    tests/cli/test_dp_resume_rng.py."""
    env = dict(
        os.environ,
        RPP_DEVICES="cpu:1",
        RPP_DISABLE_TORCH_COMPILE="1",
        RPP_PROGRESS="0",
        OMP_NUM_THREADS="1",
        RPP_DIST_TIMEOUT_S="30",  # a broken test fails well before the subprocess timeout
        RPP_DIST_MAIN_TIMEOUT_S="30",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    argv = script if script is not None else ["-m", "roundpipe", "train"]
    return launch_ranks(argv + args, nproc, env, cwd, timeout=120, stop_on_failure=not survivors)


@pytest.fixture
def _restore_process_state(restore_process_state: None) -> None:
    """An in-process run changes process state (see conftest.restore_process_state)."""


def one_process(args: List[str], out_dir: str) -> None:
    """The same command in this process, without torchrun (the reference)."""
    assert main(["train", *args, "--devices", "cpu:1", "--no-compile", "--output-dir", out_dir]) == 0


def rows(out_dir: str) -> List[Dict[str, str]]:
    with open(os.path.join(out_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def masters(out_dir: str, step: int) -> Dict[str, torch.Tensor]:
    return load_tensors(os.path.join(out_dir, "checkpoints", f"step-{step:07d}", "optim", "master.safetensors"))


def rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors."""
    assert set(a) == set(b)
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return num / den


def assert_close_rows(got: List[Dict[str, str]], want: List[Dict[str, str]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"] and g["lr"] == w["lr"]  # global tokens, same schedule
        for key in ("loss", "grad_norm"):
            assert abs(float(g[key]) - float(w[key])) <= EXACT * abs(float(w[key])), (key, g, w)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The shared 2-rank run: its output directory and its console output."""
    root = str(tmp_path_factory.mktemp("dp"))
    out = os.path.join(root, "run")
    res = torchrun(ARGS + ["--output-dir", out], root)
    assert res.returncode == 0, res.stderr[-4000:]
    return {"root": root, "out": out, "stdout": res.stdout, "stderr": res.stderr}


@pytest.mark.timeout(120)
def test_two_ranks_equal_one_process_on_the_global_batch(
    two_ranks: Dict[str, Any], tmp_path: Any, _restore_process_state: None
) -> None:
    ref = str(tmp_path / "one")
    one_process(ARGS, ref)
    assert_close_rows(rows(two_ranks["out"]), rows(ref))
    for step in (2, 4):
        diff = rel_diff(masters(two_ranks["out"], step), masters(ref, step))
        assert diff < EXACT, (step, diff)
    # The check can fail: the weights moved far more than the tolerance.
    assert rel_diff(masters(ref, 4), masters(ref, 2)) > 1e3 * EXACT
    with open(os.path.join(two_ranks["out"], "summary.json")) as f:
        two = json.load(f)
    with open(os.path.join(ref, "summary.json")) as f:
        one = json.load(f)
    assert two["accuracy"] == one["accuracy"] and two["step"] == 4
    assert "held-out exact match" in two_ranks["stdout"] and "data parallel: 2 ranks" in two_ranks["stdout"]


@pytest.mark.timeout(120)
def test_resume_with_two_ranks_repeats_the_uninterrupted_run(two_ranks: Dict[str, Any]) -> None:
    step2 = os.path.join(two_ranks["out"], "checkpoints", "step-0000002")
    trainer = load_torch(os.path.join(step2, "trainer.pt"))
    assert trainer["step"] == 2 and len(trainer["rng_by_rank"]) == 2  # type: ignore[index]
    out = os.path.join(two_ranks["root"], "resumed")
    res = torchrun(["--resume", step2, "--output-dir", out], two_ranks["root"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resuming at step 2 from {step2}" in res.stdout
    full = rows(two_ranks["out"])
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows(out)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in full[2:]
    ]
    got, want = masters(out, 4), masters(two_ranks["out"], 4)
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit


@pytest.mark.timeout(240)
def test_shared_optimizer_step_repeats_the_replicated_run_and_resumes(two_ranks: Dict[str, Any]) -> None:
    """``--shard-optimizer``: the same metrics and masters as the replicated 2-rank run, bit for bit; its
    checkpoint holds every parameter's moments (gathered from both ranks), and resuming from it
    repeats the uninterrupted run bit for bit."""
    out = os.path.join(two_ranks["root"], "sharded")
    res = torchrun(ARGS + ["--shard-optimizer", "--output-dir", out], two_ranks["root"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert "host optimizer step shared by the 2 ranks of this host" in res.stdout
    key = [(r["step"], r["loss"], r["grad_norm"]) for r in rows(out)]
    assert key == [(r["step"], r["loss"], r["grad_norm"]) for r in rows(two_ranks["out"])]
    for step in (2, 4):
        got, want = masters(out, step), masters(two_ranks["out"], step)
        assert all(torch.equal(got[k], want[k]) for k in want)
    step2 = os.path.join(out, "checkpoints", "step-0000002")
    state = load_torch(os.path.join(step2, "optim", "state.pt"))
    replicated = load_torch(os.path.join(two_ranks["out"], "checkpoints", "step-0000002", "optim", "state.pt"))
    assert sorted(state["state"]) == sorted(replicated["state"])  # type: ignore[index]
    for i, entry in replicated["state"].items():  # type: ignore[index]
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(state["state"][i][k])) for k, v in entry.items())  # type: ignore[index]
    resumed = os.path.join(two_ranks["root"], "sharded-resumed")
    res = torchrun(["--resume", step2, "--output-dir", resumed], two_ranks["root"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows(resumed)] == key[2:]
    got, want = masters(resumed, 4), masters(out, 4)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(120)
def test_only_rank_0_writes_and_logs(two_ranks: Dict[str, Any]) -> None:
    out = two_ranks["out"]
    assert [r["step"] for r in rows(out)] == ["1", "2", "3", "4"]  # one row per step, one header
    with open(os.path.join(out, "metrics.csv")) as f:
        assert f.read().count("step,loss") == 1
    ckpts = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step-0000002", "step-0000004"]  # no .tmp / .old leftovers
    for name in ("step-0000002", "step-0000004"):
        verify_checkpoint(os.path.join(ckpts, name))  # every file matches its sha256
    expected = {"config.yaml", "metrics.csv", "summary.json", "checkpoints"}
    assert expected <= set(os.listdir(out)) <= expected | {"loss.png", "tensorboard"}
    if os.path.isdir(os.path.join(out, "tensorboard")):
        assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1  # one event file: one writer
    # One console: every step logged once, by rank 0; the other rank stays quiet below warnings.
    assert [line.split(" |")[0] for line in two_ranks["stdout"].splitlines() if line.startswith("step ")] == [
        f"step {i}/4" for i in range(1, 5)
    ]
    assert two_ranks["stdout"].count("done: step 4/4") == 1
    assert not [
        line for line in two_ranks["stderr"].splitlines() if "rank 1: INFO" in line and "distributed:" not in line
    ]


@pytest.mark.timeout(120)
def test_a_rank_without_rows_takes_part_and_a_failing_rank_stops_the_other(
    tmp_path: Any, _restore_process_state: None
) -> None:
    """Batch of 1 row: rank 0 has none. Rank 1 fails in step 3: rank 0 stops with one line naming it."""
    args = [
        "--steps",
        "4",
        "--batch-size",
        "1",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "4",
        "--eval-examples",
        "0",
        "--no-progress",
    ]
    out, ref = str(tmp_path / "dp"), str(tmp_path / "one")
    t0 = time.time()
    res = torchrun(
        ["train", *args, "--output-dir", out],
        str(tmp_path),
        script=[os.path.join(ROOT, "tests", "dist_scripts", "cli_fail.py"), "1", "3"],
        survivors=True,
    )
    elapsed = time.time() - t0
    assert res.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 3" in res.stderr
    assert "roundpipe: error: rank 0: rank 1 failed during step 3: see its output" in res.stderr, res.stderr[-4000:]
    assert elapsed < 60  # not the collective timeouts
    # Steps 1 and 2 (rank 0 without rows) match one process on the same 1-row batches.
    one_process(args, ref)
    assert_close_rows(rows(out), rows(ref)[:2])
    assert rel_diff(masters(out, 2), masters(ref, 2)) < EXACT


# ---------------------------------------------------------------------------------------------------------
# Single process: the helpers do no communication
# ---------------------------------------------------------------------------------------------------------


def test_helpers_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from roundpipe.cli import parallel
    from roundpipe.cli.config import ConfigError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.start().world_size == 1 and parallel.rank_prefix() == ""
    assert parallel.everywhere(lambda: 3, "x") == 3 and parallel.on_main(lambda: "p", "x") == "p"
    assert parallel.sum_over_ranks(lambda: [1, 2.5], 2, "x") == [1.0, 2.5]
    assert parallel.gather_to_main({"a": 1}, "x") == [{"a": 1}]

    def fail() -> List[float]:
        raise ConfigError("bad", "fix it")

    with pytest.raises(ConfigError, match="bad — fix it"):
        parallel.sum_over_ranks(fail, 1, "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert parallel.rank_prefix() == "rank 1: "
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert parallel.rank_prefix() == ""
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        parallel.start()
