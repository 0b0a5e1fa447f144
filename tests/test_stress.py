"""The core equality tests under stress: CPU workers compute concurrently (as GPUs do) and every wait on
a RoundPipe event or semaphore first sleeps a random time (``RPP_DEBUG_STRESS_DELAY_S``), so the device
threads, the main thread and the optimizer thread meet each fence in ever different orders.

Normally CPU workers compute under one lock, which would hide a missing fence between two workers'
compute, a transfer and the optimizer thread. Models here have no dropout: concurrent CPU workers share
torch's one CPU generator, so dropout masks are only reproducible under the lock.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import test_step
import torch
from helpers import rel_err, require_adam_kernel
from test_core import TOL, check_grads, make_model, reference_run

from roundpipe import RoundPipe, RoundPipeRunConfig, settings

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)

STRESS_S = 0.002
STRESS_WORKERS = ["cpu:2", "cpu:3"]


@pytest.fixture(autouse=True)
def stress() -> Iterator[None]:
    with settings.overridden(debug_stress_delay_s=STRESS_S):
        yield


def test_stress_mode_lets_cpu_workers_compute_at_once() -> None:
    """The switch itself: no compute lock, and waits are delayed."""
    import time

    from roundpipe.devices import backend
    from roundpipe.devices.threads import AnnotatedEvent

    assert backend.compute_guard(torch.device("cpu")) is not backend.cpu_compute_lock
    ev = AnnotatedEvent("t", set=True)
    t0 = time.perf_counter()
    for _ in range(50):
        ev.wait()
    assert time.perf_counter() - t0 > 50 * STRESS_S / 8  # random delays in [0, STRESS_S): mean STRESS_S / 2


@pytest.mark.parametrize("workers", STRESS_WORKERS, indirect=True)
@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_matches_pytorch_under_stress(workers: str, num_microbatch: int, grain: str) -> None:
    torch.manual_seed(0)
    dtype = torch.float64
    model = make_model(dtype, dropout=0.0)
    import copy

    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain))
    x = torch.randn(10, 8, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    w = torch.randn(10, 5, dtype=dtype)
    for _ in range(2):  # a second call: gradients accumulate, buffers (BatchNorm) move on
        out = rp(x)
        (out * w).sum().backward()
        out_ref = reference_run(ref, x_ref, num_microbatch)
        (out_ref * w).sum().backward()
        assert rel_err(out, out_ref) < TOL[dtype]
    assert rel_err(x.grad, x_ref.grad) < TOL[dtype]
    check_grads(model, ref, TOL[dtype])


@pytest.mark.parametrize("workers", STRESS_WORKERS, indirect=True)
def test_sync_steps_under_stress(workers: str) -> None:
    test_step.test_sync_step_equals_plain_pytorch(workers)


@pytest.mark.parametrize("workers", STRESS_WORKERS, indirect=True)
def test_async_steps_under_stress(workers: str) -> None:
    """The one-step-stale rule holds whatever order the optimizer thread and the devices meet in."""
    test_step.test_async_step_follows_one_step_stale_rule(workers)


@pytest.mark.parametrize("workers", STRESS_WORKERS, indirect=True)
def test_tied_parameters_under_stress(workers: str) -> None:
    test_step.test_tied_parameters_appear_once_and_sum_gradients(workers)


@pytest.mark.parametrize("workers", STRESS_WORKERS, indirect=True)
def test_mixed_schedule_under_stress(workers: str) -> None:
    """Asynchronous and synchronous steps, synchronize() and an edit of the optimizer parameters: the same
    losses twice, and pure asynchronous steps follow the one-step-stale reference."""
    test_step.test_staged_parameters_follow_the_one_step_stale_rule(workers)


@pytest.mark.parametrize("workers", ["cpu:3"], indirect=True)
def test_bf16_buffers_rotate_under_stress(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host buffers rotate between downloads, the optimizer and staging (the thread handoffs most
    exposed to ordering), in both step modes, two per parameter."""
    test_step.test_host_buffers_rotate_and_one_gradient_buffer_waits(workers, monkeypatch)


@pytest.mark.parametrize("workers", ["cpu:2", "cpu:3"], indirect=True)
@pytest.mark.parametrize("num_microbatch", [2, 5])
@pytest.mark.parametrize("fused", [True, False])
def test_split_fused_job_under_stress(
    workers: str, num_microbatch: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts of a split last backward group meet in any order and still sum to plain PyTorch's
    gradients."""
    import test_core

    test_core.test_split_fused_job_equals_pytorch(workers, num_microbatch, "stage", "1", fused, monkeypatch)


@pytest.mark.parametrize("workers, microbatches", [(2, 2), (3, 4)])
def test_fused_staging_under_stress(workers: int, microbatches: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_DEBUG_FUSED_STAGING: the optimizer writes the staging buffers while downloads of the next call may move
    them into the weights; under random delays every loss and weight still equals the staging pass."""
    import test_fused_staging

    require_adam_kernel()
    test_fused_staging.test_fused_staging_equals_the_staging_pass(None, workers, microbatches, monkeypatch)
