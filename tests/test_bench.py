"""The benchmark scripts run in a tiny CPU configuration, so they cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "argv",
    [
        ["bench/train_bench.py", "--workload", "tiny", "--seq", "32", "--batch", "4", "--warmup", "1", "--iters", "1", "--compare-plans",
         "--compare-kernels"],
        ["bench/train_bench.py", "--workload", "tiny", "--seq", "32", "--batch", "4", "--warmup", "1", "--iters", "1", "--lora", "2"],
        ["bench/core_bench.py", "--layers", "3", "--hidden", "32", "--tokens", "64", "--warmup", "1", "--iters", "1"],
        ["bench/adam_bench.py", "--sizes", "1M", "--repeats", "2", "--threads", "1"],
    ],
    ids=["train_bench", "train_bench_lora", "core_bench", "adam_bench"],
)
def test_bench_script_runs(argv: list) -> None:
    env = dict(os.environ, RPP_DEVICES="cpu:2", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "|" in res.stdout  # the results table
