"""The garbage collector at a model's first step (``roundpipe.host.step_cycle``): once per process, garbage
collected first, then every survivor frozen."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

import pytest

from roundpipe.host import step_cycle
from tests.helpers import ROOT


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Record ``gc.collect`` / ``gc.freeze`` instead of running them (this test process is not frozen)."""
    seen: List[str] = []
    monkeypatch.setattr(step_cycle.gc, "collect", lambda *a: seen.append("collect") or 0)
    monkeypatch.setattr(step_cycle.gc, "freeze", lambda: seen.append("freeze"))
    monkeypatch.setattr(step_cycle, "_gc_frozen", False)
    return seen


def test_freeze_collects_first_and_happens_once(calls: List[str]) -> None:
    assert step_cycle.freeze_garbage_collector() is True
    assert step_cycle.freeze_garbage_collector() is False  # once per process
    assert calls == ["collect", "freeze"]


SCRIPT = r"""
import gc, json, weakref
import torch
from torch import nn
import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

class Node:
    pass

torch.manual_seed(0)
layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
model = RoundPipe(layers, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=2))
opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
x, y = torch.randn(4, 8), torch.randn(4, 8)
gc.disable()  # only an explicit collection may find the cycle below
cycle = Node(); cycle.me = cycle; dead = weakref.ref(cycle); del cycle  # garbage only a collection finds
loss_fn = lambda out, label: torch.nn.functional.mse_loss(out, label)
out = {"before": gc.get_freeze_count()}
model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
out["after_call"] = gc.get_freeze_count()
model.step(lambda: (opt.step(), opt.zero_grad()))
out["after_step"] = gc.get_freeze_count()
out["cycle_collected"] = dead() is None
model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
model.step(lambda: (opt.step(), opt.zero_grad()))
model.synchronize()
out["after_second_step"] = gc.get_freeze_count()
print(json.dumps(out))
"""


def test_the_first_step_collects_then_freezes_once() -> None:
    """A real model on a CPU worker: nothing frozen before the first step; the survivors are frozen there
    (and not again), and garbage alive before it was collected, not frozen."""
    import json

    env = dict(
        os.environ,
        RPP_DEVICES="cpu:1",
        RPP_DISABLE_TORCH_COMPILE="1",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["before"] == out["after_call"] == 0, out
    assert out["after_step"] > 10_000, out  # torch's and roundpipe's objects, the model's
    assert out["after_second_step"] <= out["after_step"], out  # (reference counting still frees some)
    assert out["cycle_collected"], out
