"""Shared fixtures: run each test on a chosen set of RoundPipe workers (CPU workers, or CUDA)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from roundpipe import settings
from roundpipe.devices import device, threads

# Under pytest-xdist (README's test command runs two test processes on a 2-core machine) a subprocess that a test
# starts (`roundpipe train`, a bench script) would otherwise open an OpenMP team of every core, whose threads spin
# against the other test process: one intra-op thread each, as the test processes themselves run after collection.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

CUDA = torch.cuda.is_available()
# CPU workers always; the CUDA variant of the same tests runs where a GPU exists.
WORKER_SPECS = ["cpu:1", "cpu:2", "cpu:3"] + (["cuda:0"] if CUDA else [])


def use_devices(spec: str) -> None:
    """Re-create the device pool from ``spec`` (an RPP_DEVICES value)."""
    settings.configure(devices=spec)


@pytest.fixture(autouse=True)
def _isolate_settings() -> Iterator[None]:
    """Whatever a test chooses through ``roundpipe.configure`` (an in-process CLI run included) ends with
    it: later tests see the environment's settings and a fresh device pool."""
    saved = settings.snapshot()
    yield
    settings.restore(saved)  # re-creates the device pool if RPP_DEVICES changed


@pytest.fixture(autouse=True)
def _stream_checks(request: pytest.FixtureRequest, _isolate_settings: None) -> Iterator[None]:
    """Tests marked ``stream_checks`` (the concurrency-heavy files) run with ``RPP_DEBUG_CHECK_STREAMS=1``:
    every access of a CPU worker's stream, and of the host threads inside RoundPipe calls, is checked for
    order (``roundpipe.devices.cpu_streams``), so a missing wait fails here as it would corrupt data on a GPU.
    Once, with the checks: the suite does not run them twice."""
    if request.node.get_closest_marker("stream_checks") is None:
        yield
        return
    with settings.overridden(debug_check_streams="1"):
        yield


@pytest.fixture
def workers(request: pytest.FixtureRequest) -> Iterator[str]:
    """Parametrize indirectly with an RPP_DEVICES value; yields the torch device type under test."""
    spec = request.param
    if spec.startswith("cuda") and not CUDA:
        pytest.skip("needs CUDA")
    use_devices(spec)
    yield spec
    threads.clear_failure()
    settings.unconfigure(settings.DEVICES.name)
    device.reset_devices()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def restore_process_state() -> Iterator[None]:
    """In-process training runs (the CLI) choose devices and the torch.compile switch for the process
    (``roundpipe.configure``, undone by ``_isolate_settings``) and may leave a worker failure recorded:
    undo that too, with progress bars off meanwhile."""
    saved = settings.snapshot()
    settings.configure(progress=False)
    yield
    threads.clear_failure()
    settings.restore(saved)
    device.reset_devices()
