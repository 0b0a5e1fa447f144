"""Profiler annotations: each device job is a named range on its worker thread (RPP_PROFILER=torch), so
a trace shows which layer group issued which work; without a profiler no label is even built."""

from __future__ import annotations

import threading
from typing import Iterator, List, Tuple

import pytest
import torch
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, settings
from roundpipe.devices import profile


@pytest.fixture
def torch_profiler_type(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(profile, "PROFILER_TYPE", "torch")
    yield


def _train_once(plan: ModelExecutePlan) -> List[Tuple[str, int]]:
    torch.manual_seed(0)
    model = RoundPipe(
        nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]),
        name="mlp",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        model.forward_backward(input_args=(torch.randn(4, 8),), loss_fn=lambda out, _: out.sum())
        model.synchronize()
    return [(e.name, e.thread) for e in prof.events() if e.name.startswith("roundpipe model")]


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_each_device_job_is_a_named_range_on_its_worker_thread(workers: str, torch_profiler_type: None) -> None:
    from roundpipe import settings

    plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 1), range(1, 3), range(3, 4)])
    with settings.overridden(debug_split_fused="1"):  # the fused job in parts, as on GPUs
        jobs = _train_once(plan)
    assert sorted(name for name, _ in jobs) == sorted(
        [
            "roundpipe model 'mlp' forward layers 0-1",
            "roundpipe model 'mlp' forward layer 2",
            # two devices, two microbatches: the fused job runs in two parts, one per device
            "roundpipe model 'mlp' fused forward-backward part 0 layer 3",
            "roundpipe model 'mlp' fused forward-backward part 1 layer 3",
            "roundpipe model 'mlp' backward layers 1-2",
            "roundpipe model 'mlp' backward layer 0",
        ]
    )
    # Issued by the device controller threads (two workers), not by the main thread.
    main = threading.main_thread().native_id
    threads = {tid for _, tid in jobs}
    assert main not in threads and len(threads) == 2


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_no_labels_without_a_profiler(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "PROFILER_TYPE", None)
    assert _train_once(ModelExecutePlan.layerwise(4, "fused")) == []
    assert profile.annotate("x").__class__.__name__ == "nullcontext"


def test_profiler_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in [("torch", "torch"), (" NVTX ", "nvtx"), ("", None), ("0", None)]:
        monkeypatch.setenv("RPP_PROFILER", value)
        assert settings.PROFILER.get() == expected
    monkeypatch.setenv("RPP_PROFILER", "nsys")
    with pytest.raises(ValueError, match="RPP_PROFILER='nsys': expected `torch`"):
        settings.PROFILER.get()
