"""Run outputs of `roundpipe train`: LR schedule, metrics.csv across a resume, the plot, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from roundpipe.cli.metrics import MetricsWriter, plot_metrics, read_metrics
from roundpipe.cli.optimizer import WarmupCosine


def test_warmup_cosine_schedule() -> None:
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    ramp = [f(s) for s in range(11)]
    assert ramp == sorted(ramp) and ramp[0] == pytest.approx(1 / 11) and f(10) == 1.0
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    decay = [f(s) for s in range(10, 111)]
    assert decay == sorted(decay, reverse=True)
    assert WarmupCosine(0, 10, 0.0)(0) == 1.0 and WarmupCosine(0, 10, 0.0)(10) == pytest.approx(0.0, abs=1e-12)


def test_metrics_csv_drops_rows_after_the_resumed_step(tmp_path) -> None:
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(1, 8):
        w.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "tokens": 10 * step})
    w.close()
    w = MetricsWriter(str(tmp_path), resume_step=5, tensorboard=False)  # the run died at 7, resumed from 5
    for step in (6, 7, 8):
        w.write({"step": step, "loss": 2.0, "lr": 0.1, "grad_norm": 0.5})
    w.close()
    rows = read_metrics(os.path.join(tmp_path, "metrics.csv"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (
        rows[2]["loss"] == 1 / 3
        and rows[6]["loss"] == 2.0
        and rows[6]["grad_norm"] == 0.5
        and "grad_norm" not in rows[0]
    )
    png = plot_metrics(os.path.join(tmp_path, "metrics.csv"), os.path.join(tmp_path, "loss.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_checkpoints_then_resume_finishes(tmp_path) -> None:
    out = str(tmp_path / "run")
    env = {**os.environ, "RPP_DEVICES": "cpu:1", "RPP_PROGRESS": "0"}
    cmd = [
        sys.executable,
        "-m",
        "roundpipe",
        "train",
        "--steps",
        "5000",
        "--batch-size",
        "8",
        "--log-every",
        "10",
        "--eval-examples",
        "20",
        "--output-dir",
        out,
    ]
    # SIGINT at its default in the child, as a shell starts it (a test run started with `&` by a
    # non-interactive shell ignores SIGINT, and an ignored signal would be inherited).
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not os.path.isfile(os.path.join(out, "metrics.csv")):
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "continue with: roundpipe train --resume --output-dir" in stdout
    rows = read_metrics(os.path.join(out, "metrics.csv"))
    stopped = int(rows[-1]["step"])
    assert 0 < stopped < 5000 and os.path.isdir(os.path.join(out, "checkpoints", f"step-{stopped:07d}"))
    # Resume with a shorter run: the checkpoint's config plus the keys given now.
    resumed = subprocess.run(
        [sys.executable, "-m", "roundpipe", "train", "--resume", "--steps", str(stopped + 5), "--output-dir", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {stopped}" in resumed.stdout and "held-out exact match" in resumed.stdout
    assert [int(r["step"]) for r in read_metrics(os.path.join(out, "metrics.csv"))] == list(range(1, stopped + 6))
