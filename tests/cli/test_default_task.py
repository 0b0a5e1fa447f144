"""The built-in default run, as README's first command starts it: no arguments besides the output dir.

Acceptance: a small Qwen3 model learns to reverse 6-letter strings, within the run's 600 steps, to >= 90%
exact match on 500 held-out strings, with the training loss of its last steps near zero. The criterion
is what the run computes, not how long it takes: on 2 shared CPU cores the wall-clock time varies
(2-3 minutes alone), and the timeout below only guards against a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from roundpipe.cli.metrics import read_metrics

ACCURACY = 0.90
STEPS = 600
FINAL_LOSS = 0.05  # mean loss of the last 50 steps; the measured runs end near 1e-3


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_task_learns(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RPP_DEVICES"}  # the real default device pool
    env.update(RPP_PROGRESS="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "roundpipe", "train", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == summary["total_steps"] == STEPS
    assert summary["accuracy"] >= ACCURACY, proc.stdout
    rows = read_metrics(str(tmp_path / "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    tail = [r["loss"] for r in rows[-50:]]
    assert sum(tail) / len(tail) < FINAL_LOSS, tail
    assert f"held-out exact match: {summary['accuracy']:.1%} (" in proc.stdout and (tmp_path / "loss.png").is_file()
