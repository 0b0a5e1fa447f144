"""Data parallel with the gradients reduced on the devices (``enable_data_parallel(reduce_on="device")``).

On CPU workers the device path runs with gloo, exactly the code NCCL runs on GPUs (the collectives are
issued by the device threads at the end of each backward job, before the gradient download). The
multi-rank tests launch ``torchrun --standalone --nproc-per-node 2`` on ``tests/dist_scripts/dp_device.py``:

* one launch runs every exactness scenario (5 steps of 2 ranks equal one process trained on the
  concatenated batches, fp32, < 1e-6; each also reports how far a run on one rank's share lands):
  full fine-tune (``nn.Sequential``, a tiny Qwen3 with tied embeddings) and LoRA, 1 and 2 CPU workers
  per rank, automatic plans (and plans forced to differ between ranks), asynchronous and synchronous
  steps, gradient accumulation over two calls, uneven token counts with ``normalize_by``, an
  ``AutoRoundPipe`` whose host parameter is reduced on the host; plus two refusals: ``normalize_by``
  after the backward with unequal counts, and mixed-up reductions caught by the step's order check;
* a rank that dies in the middle of a backward makes the other fail at once with an error naming
  rank, collective, layer and device; a rank that skips a training call makes both fail clearly.

A GPU test (2 CUDA devices) compares NCCL device reduction, host reduction and one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import helpers
import pytest
import test_distributed
import torch
import torch.distributed as dist
from helpers import small_mlp, train_small_mlp
from torch import nn

from roundpipe import distributed as rdist
from roundpipe.distributed import device_order, device_reduce, enable, sharding
from roundpipe.planning.plan import ModelExecutePlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "dp_device.py")
EXACT = 1e-6

EXACT_SCENARIOS = [
    "mlp",  # full fine-tune, 1 worker per rank, asynchronous steps, a weight no rank uses
    "mlp-2dev-sync-accum",  # 2 workers per rank, synchronous steps, two calls per step
    "mlp-2dev-skew",  # rank 1's own automatic plan differs: the ranks must agree on rank 0's
    "auto",  # AutoRoundPipe: the body on the devices, the host parameter on the host
    "qwen-2dev",  # tiny Qwen3 full fine-tune, tied embeddings (a parameter shared by two layers)
    "lora-uneven",  # LoRA, uneven token counts, normalize_by before the backward
    "lora-2dev-accum",  # LoRA, 2 workers per rank, two calls per step
]


def torchrun(args: List[str], tmp_path: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`helpers.torchrun` of the device-reduction script, one thread per rank, the devices as the
    scenario sets them (150 s unless ``timeout`` says otherwise)."""
    return helpers.torchrun(SCRIPT, args, tmp_path, **{"timeout": 150, "devices": None, **kwargs})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """All scenarios of one launch (torch start-up dominates a launch on 2 cores)."""
    tmp = tmp_path_factory.mktemp("dp_device")
    out = os.path.join(str(tmp), "result.json")
    names = EXACT_SCENARIOS + ["late-normalize", "order-check"]
    res = torchrun(["--scenarios", ",".join(names), "--out", out], tmp)
    assert res.returncode == 0, res.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------
# Exactness against one process on the concatenated batch
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", EXACT_SCENARIOS)
def test_device_reduction_equals_one_process_on_the_whole_batch(runs: Dict[str, Any], name: str) -> None:
    r = runs[name]
    assert r["world"] == 2 and r["dp_steps"] == 5
    assert r["max_diff"] < EXACT, r
    # The check can fail: training on one rank's share alone lands orders of magnitude further away.
    assert r["local_only_diff"] > 1e3 * EXACT, r
    if name.startswith(("mlp", "auto")):
        # The weight 'c' is used by no rank: it must keep .grad = None (SGD's weight decay would move a zero grad).
        assert r["c_moved"] == 0.0, r
    # Tiny buckets: several collectives per layer and step (packed and in place).
    assert r["collectives"] > 2 * r["dp_steps"], r


@pytest.mark.timeout(180)
def test_ranks_agree_on_the_plan(runs: Dict[str, Any]) -> None:
    """Rank 1's own plan (one layer per stage) differs from rank 0's: it ran rank 0's at every call."""
    assert runs["mlp-2dev-skew"]["adopted_plans"][0] == 0
    assert runs["mlp-2dev-skew"]["adopted_plans"][1] == 5


@pytest.mark.timeout(180)
def test_normalize_by_after_the_backward_is_refused_on_every_rank(runs: Dict[str, Any]) -> None:
    err = runs["late-normalize"]["error"]
    assert "normalize_by came after this step's backward" in err and "counts (3, 5)" in err, err
    assert "Call normalize_by before the step's first forward/backward" in err


@pytest.mark.timeout(180)
def test_mixed_up_reductions_are_refused_before_the_optimizer_step(runs: Dict[str, Any]) -> None:
    """Without the plan agreement the ranks run different plans on layers of one size: the gradients
    pair up silently, and the step's order check must refuse the step."""
    err = runs["order-check"]["error"]
    assert "ran in a different order on ranks [1] than on rank 0" in err and "the step is refused" in err, err


# ---------------------------------------------------------------------------------------------------------
# Failures: no hang, a clear error
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_rank_dying_in_the_backward_makes_the_other_fail_clearly(tmp_path: Any) -> None:
    t0 = time.time()
    res = torchrun(["--scenarios", "mlp-2dev", "--fail", "dead"], tmp_path, survivors=True)
    assert res.returncode != 0
    assert "rank 1: injected failure (dead) in the backward of step 2" in res.stderr
    assert "DataParallelError: rank 0/2: all_reduce of the gradients of layer" in res.stderr, res.stderr[-3000:]
    assert "Another rank probably died or stalled" in res.stderr
    assert time.time() - t0 < 60


@pytest.mark.timeout(120)
def test_a_rank_skipping_a_training_call_is_reported_on_every_rank(tmp_path: Any) -> None:
    res = torchrun(["--scenarios", "mlp", "--fail", "skip"], tmp_path)
    assert res.returncode != 0
    for rank in (0, 1):
        assert f"DataParallelError: rank {rank}/2: training call 1 of step" in res.stderr, res.stderr[-3000:]
    assert (
        "the ranks are at different training calls (rank 0: call 1 of step 3, rank 1: call 1 of step 4)" in res.stderr
    )
    assert "Give every rank at least one row" in res.stderr


# ---------------------------------------------------------------------------------------------------------
# GPU: NCCL device reduction vs host reduction vs one process (run by hand on a 2-GPU machine)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_device_reduction_matches_host_reduction_and_one_process(tmp_path: Any) -> None:
    out = os.path.join(str(tmp_path), "gpu.json")
    env = {k: v for k, v in os.environ.items() if k != "RPP_DEVICES"}  # init_from_env gives rank r cuda:r
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            "--cuda",
            "--scenarios",
            "gpu",
            "--steps",
            "6",
            "--lr",
            "0.02",
            "--out",
            out,
        ],
        cwd=str(tmp_path),
        env=dict(env, PYTHONPATH=ROOT, RPP_DIST_TIMEOUT_S="60"),
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert res.returncode == 0, res.stderr[-5000:]
    with open(out) as f:
        r = json.load(f)["gpu"]
    assert r["device_backend"] == "nccl"
    # bf16 weights and gradients, fp32 masters: the three runs differ by rounding only, far less than a
    # run on one rank's share differs from the whole batch.
    for mode in ("device", "host"):
        rel = max(abs(a - b) / abs(b) for a, b in zip(r[f"{mode}_losses"], r["ref_losses"]))
        assert rel < 2e-2, (mode, r)
        assert r[f"{mode}_vs_ref"] < 0.1 * r["local_only_vs_ref"], (mode, r)
    assert r["device_vs_host"] < 0.1 * r["local_only_vs_ref"], r


# ---------------------------------------------------------------------------------------------------------
# Single-process pieces
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_type", ["train", "fused"])
def test_plans_survive_the_encoding_of_the_agreement(run_type: str) -> None:
    for plan in (
        ModelExecutePlan.layerwise(7, run_type),
        ModelExecutePlan([range(0, 3), range(3, 7)], [range(0, 2), range(2, 5), range(5, 7)]).for_run_type(run_type, 7),
    ):
        header = [
            0,
            0,
            0,
            7,
            1,
            0,
            1,
            len(plan.fwd_plan),
            len(plan.bwd_plan),
        ]  # step, call, model, layers, devices, position, type
        row = device_order.encode_plan(header, plan, 9).tolist()
        assert device_order.decode_plan(row, 9) == plan


def test_layer_buckets_depend_only_on_the_parameters() -> None:
    """Bucket 0 is packed and starts with one presence count per parameter; a gradient of at least a
    bucket is reduced in place; small ones are packed up to the bucket size, in parameter order."""

    bucket_bytes = 256  # 64 fp32 values
    shapes = [(8,), (100,), (4, 4), (10,), (70,), (3,), (60,)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    got = [(x.indices, x.packed, x.nflags, x.numel) for x in device_reduce.layer_buckets(params, None, bucket_bytes)]
    assert got == [([0, 2, 3, 5], True, 7, 37), ([1], False, 0, 100), ([4], False, 0, 70), ([6], True, 0, 60)]
    got = [(x.indices, x.packed, x.dtype) for x in device_reduce.layer_buckets(params, torch.float64, bucket_bytes)]
    # Another reduction dtype: nothing in place (a copy is needed anyway), packed up to 32 doubles.
    assert all(p for _, p, _ in got) and all(d == torch.float64 for _, _, d in got)
    assert [i for idx, _, _ in got for i in idx] == list(range(len(shapes)))


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_reduce_on_choice_on_cpu_workers(workers: str) -> None:
    assert enable.choose_reduce_on("auto", False) == ("host", None)  # nothing to gain on CPU workers
    assert enable.choose_reduce_on("device", False) == ("device", "gloo")
    assert enable.choose_reduce_on("host", False) == ("host", None)
    assert enable.choose_reduce_on("auto", True) == ("host", None)
    with pytest.raises(ValueError, match="reduce_on='gpu'"):
        enable.choose_reduce_on("gpu", False)


one_rank_group = test_distributed.one_rank_group  # the fixture: a 1-rank gloo group in this process


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_one_rank_device_mode_is_plain_training(workers: str, one_rank_group: None) -> None:
    ref = train_small_mlp(small_mlp(), 3)
    model = small_mlp()
    dp = rdist.enable_data_parallel(model, reduce_on="device")
    assert dp.reduce_on == "device" and dp.device is None  # one rank: nothing to reduce, nothing hooked
    assert torch.equal(train_small_mlp(model, 3), ref)
    dp.close()


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_device_mode_setup_errors(workers: str, one_rank_group: None) -> None:
    model = small_mlp()
    with pytest.raises(ValueError, match="process_group works with reduce_on='host' only"):
        rdist.enable_data_parallel(model, process_group=dist.new_group(backend="gloo"), reduce_on="device")
    with pytest.raises(NotImplementedError, match="reduce_on='device'"):
        rdist.enable_data_parallel(model, backend="nccl")  # type: ignore[arg-type]


def test_a_stalled_nccl_collective_is_named_by_the_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor (CUDA only) with stand-in events: ready but never done for longer than the timeout."""
    from roundpipe.devices import threads

    class Ev:
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

    class Red:
        def error(self, what: str, nbytes: int, waited: float, exc: BaseException) -> rdist.DataParallelError:
            return rdist.DataParallelError(f"rank 0/2: {what} failed after {waited:.1f} s: {exc}")

    monkeypatch.setattr(device_reduce, "timeout_s", lambda: 0.3)
    threads.clear_failure()
    mon = device_reduce.CollectiveMonitor(Red())  # type: ignore[arg-type]
    try:
        mon.add(Ev(True), Ev(True), "finished", 8)
        mon.add(Ev(True), Ev(False), "all_reduce of the gradients of layer 3 of model 'm' on device cuda:0", 8)
        deadline = time.time() + 5
        while threads.current_failure() is None and time.time() < deadline:
            time.sleep(0.05)
        err = threads.clear_failure()
        assert isinstance(err, rdist.DataParallelError), err
        assert "layer 3 of model 'm' on device cuda:0" in str(err)
    finally:
        mon.stop()


def test_a_share_without_rows_is_refused_on_every_rank_in_device_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank computes the same bounds, so every rank raises before any collective."""
    monkeypatch.setattr(sharding, "_device_reductions", {1: "m"})
    for rank in (0, 1):
        with pytest.raises(
            rdist.DataParallelError, match=r"a batch of 1 rows for 2 ranks leaves rank\(s\) \[0\] without rows"
        ):
            rdist.shard((torch.zeros(1, 3), torch.zeros(1)), rank, 2)
    assert rdist.shard(torch.zeros(2, 3), 1, 2).shape == (1, 3)
    monkeypatch.setattr(sharding, "_device_reductions", {})
    assert rdist.shard(torch.zeros(1, 3), 0, 2).shape == (0, 3)  # host reduction: the rank may skip its call
