"""The GPU count ``import roundpipe`` takes before CUDA starts (``roundpipe.devices.gpu_count``) is torch's NVML
count, without importing torch: ``CUDA_VISIBLE_DEVICES`` read as torch reads it, and the same answer for each
visible list given the same number of GPUs."""

from __future__ import annotations

import pytest
import torch

from roundpipe.devices import allocator, gpu_count

VISIBLE = ["", "0", "1", "0,1", "1,0", "0,1,2,3", "3", "0,0", "0,x,2", "1gpu2,2ampere", "-1", "0,-1,2", "7,0"]
VISIBLE += [" 0, 1", "GPU-aa,GPU-bb", "GPU-aa,GPU-aa", "GPU-aa,0"]


@pytest.mark.parametrize("var", VISIBLE)
def test_visible_devices_are_read_as_torch_reads_them(monkeypatch, var: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", var)
    assert gpu_count.visible_devices(var) == torch.cuda._parse_visible_devices()


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("var", [None, *[v for v in VISIBLE if not v.startswith("GPU-")]])
def test_count_is_torchs_nvml_count(monkeypatch, gpus: int, var) -> None:
    """With NVML reporting ``gpus`` GPUs to both, the counts agree for every visible list (torch's own
    ``_device_count_nvml`` is what roundpipe asked before)."""
    if var is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", var)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: gpus)
    monkeypatch.setattr(gpu_count, "physical_gpus", lambda: gpus)
    assert gpu_count.count_visible_gpus() == max(0, torch.cuda._device_count_nvml())


def test_pool_count_comes_from_the_environment_first(monkeypatch) -> None:
    monkeypatch.setattr(gpu_count, "physical_gpus", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for spec, expected in (("cpu:2", 0), ("cuda:0,1", 2), ("", 8), ("cuda", 8)):
        monkeypatch.setenv("RPP_DEVICES", spec)
        assert allocator.pool_gpus_from_environment() == expected, spec
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.setenv("RPP_DEVICES", "")
    assert allocator.pool_gpus_from_environment() == 2


def test_without_a_driver_there_are_no_gpus(monkeypatch, tmp_path) -> None:
    """No NVML library and no ``/proc/driver/nvidia``: no GPU; the proc entries count where NVML is missing."""
    import ctypes

    def no_library(name: str, *args, **kwargs):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.setattr(gpu_count, "PROC_GPUS", str(tmp_path / "missing"))
    assert gpu_count.physical_gpus() == 0
    for bus in ("0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(gpu_count, "PROC_GPUS", str(tmp_path))
    assert gpu_count.physical_gpus() == 3
