"""Shared fixtures: run each test on a chosen set of RoundPipe workers (CPU workers, or CUDA)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from roundpipe import device, threads

CUDA = torch.cuda.is_available()
# CPU workers always; the CUDA variant of the same tests runs where a GPU exists.
WORKER_SPECS = ["cpu:1", "cpu:2", "cpu:3"] + (["cuda:0"] if CUDA else [])


def use_devices(spec: str) -> None:
    """Re-create the device pool from ``spec`` (an RPP_DEVICES value)."""
    os.environ["RPP_DEVICES"] = spec
    device.reset_devices()


@pytest.fixture
def workers(request: pytest.FixtureRequest) -> Iterator[str]:
    """Parametrize indirectly with an RPP_DEVICES value; yields the torch device type under test."""
    spec = request.param
    if spec.startswith("cuda") and not CUDA:
        pytest.skip("needs CUDA")
    old = os.environ.get("RPP_DEVICES")
    use_devices(spec)
    yield spec
    threads.clear_failure()
    if old is None:
        os.environ.pop("RPP_DEVICES", None)
    else:
        os.environ["RPP_DEVICES"] = old
    device.reset_devices()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def restore_process_state() -> Iterator[None]:
    """In-process training runs (the CLI) set RPP_DEVICES and the torch.compile switch for the process,
    and may leave a worker failure recorded: undo all of it afterwards."""
    from roundpipe import models  # imported here: test_models sets RPP_DISABLE_TORCH_COMPILE before its import

    old_env = {k: os.environ.get(k) for k in ("RPP_DEVICES", "RPP_PROGRESS")}
    old_compile = models.DISABLE_TORCH_COMPILE
    os.environ["RPP_PROGRESS"] = "0"
    yield
    threads.clear_failure()
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    models.DISABLE_TORCH_COMPILE = old_compile
    device.reset_devices()
