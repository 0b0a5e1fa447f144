"""CPU workers compute with torch's thread count of the thread that created them, their matrix products
included: ``torch.set_num_threads`` sets MKL's count per thread, and a worker thread left at MKL's default
ran each product in an OpenMP team of every core whose threads spun between calls (``bench/job_cost.py``
on 2 cores: 2 workers 3.4x slower than 1)."""

from __future__ import annotations

import os
import threading
from typing import Iterator, Set

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, settings

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)


def _native_threads() -> Set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.fixture
def one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2+ cores")
def test_cpu_workers_start_no_thread_team_when_torch_runs_one_thread(one_thread: None) -> None:
    """With torch at one thread, training on 2 CPU workers (64-wide products, which MKL's own threading would split)
    starts no native thread besides the Python threads of the runtime."""
    before = _native_threads()
    settings.configure(devices="cpu:2")
    torch.manual_seed(0)
    model = RoundPipe(
        nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    x = torch.randn(16, 64)
    for _ in range(3):
        model.forward_backward(input_args=(x,), label=x, loss_fn=lambda out, y: (out - y).square().sum())
    model.synchronize()
    python = {t.native_id for t in threading.enumerate()}
    assert _native_threads() - before - python == set()
