"""The built-in default run, as README's first command starts it: no arguments besides the task.

Acceptance: a small Qwen3 model learns to reverse 6-letter strings to >= 90% exact match on held-out
strings, the whole command (start-up, 600 steps, evaluation, plot) within 5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ACCURACY = 0.90
SECONDS = 300


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 60)
def test_default_task_learns_within_five_minutes(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RPP_DEVICES"}  # the real default device pool
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "roundpipe", "train", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=SECONDS + 30,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(proc.stdout)
    assert summary["accuracy"] >= ACCURACY, proc.stdout
    assert seconds < SECONDS, f"took {seconds:.0f}s"
    assert "held-out exact match:" in proc.stdout and (tmp_path / "loss.png").is_file()
