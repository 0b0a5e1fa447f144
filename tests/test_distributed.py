"""Data parallel over torch.distributed (roundpipe.distributed), on CPU workers with gloo.

The multi-rank tests launch ``torchrun --standalone --nproc-per-node 2`` (a free port is picked by the
c10d rendezvous) on ``tests/dist_scripts/dp_train.py`` with one CPU worker per rank, and check:

* exactness: 5 steps of 2 ranks equal one process trained on the concatenated batches (fp32, < 1e-6),
  for an ``nn.Sequential`` RoundPipe, an ``AutoRoundPipe`` with a host parameter, and a tiny Qwen3 with
  LoRA through ``wrap_model_to_roundpipe`` / ``train_step``; asynchronous and synchronous steps; every
  check also reports how far a run on one rank's share lands, so the tolerance is known to be tight;
* replicas hold bit-identical parameters; a parameter without gradient anywhere is left alone;
* resume from a checkpoint with 2 ranks repeats the uninterrupted run bit for bit;
* a rank that dies or stalls makes the other fail with an error naming the rank and the collective,
  within the collective timeout (no hang).

Every test runs with the stream checks (``stream_checks``), the ranks included: a rank's optimizer thread that
reduces, clips or steps a gradient before synchronizing its download fails here (~1 s more for the file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import helpers
import pytest
import torch
import torch.distributed as dist
from helpers import small_mlp, train_small_mlp
from torch import nn

from roundpipe import distributed as rdist
from roundpipe import settings
from roundpipe.runtime.grad_sync import GradSync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist_scripts", "dp_train.py")
EXACT = 1e-6

pytestmark = pytest.mark.stream_checks


def torchrun(args: List[str], tmp_path: Any, script: str = SCRIPT, **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`helpers.torchrun` of ``script`` (the data-parallel script by default); one CPU worker and one
    thread per rank. The ranks check their streams and host threads as this process does (this file is
    marked ``stream_checks``): the reductions, the clipping and the asynchronous steps of every rank run checked."""
    env = {settings.DEBUG_CHECK_STREAMS.name: settings.DEBUG_CHECK_STREAMS.get(), **(kwargs.pop("env", None) or {})}
    return helpers.torchrun(script, args, tmp_path, env=env, **kwargs)


def train(tmp_path: Any, *args: str) -> Dict[str, Any]:
    out = os.path.join(str(tmp_path), "result.json")
    res = torchrun([*args, "--out", out], tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------
# Exactness against one process on the concatenated batch
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--model", "mlp"], id="sequential-async"),
        pytest.param(["--model", "mlp", "--sync"], id="sequential-sync"),
        pytest.param(["--model", "auto"], id="autoroundpipe-async"),
        pytest.param(["--model", "lora"], id="lora-async"),
        pytest.param(["--model", "lora", "--uneven"], id="lora-uneven-tokens-async"),
        pytest.param(
            ["--model", "lora", "--uneven", "--sync", "--bucket-mb", "25"], id="lora-uneven-tokens-sync-one-bucket"
        ),
    ],
)
def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path: Any, args: List[str]) -> None:
    r = train(tmp_path, *args, "--reference")
    assert r["world"] == 2 and r["dp_steps"] == 5
    assert r["max_diff"] < EXACT, r
    # The check can fail: training on one rank's share alone lands orders of magnitude further away.
    assert r["local_only_diff"] > 1e3 * EXACT, r
    if args[1] in ("mlp", "auto"):
        # 'c' is used by no rank: it must keep .grad = None (SGD's weight decay would move a zero grad).
        assert r["c_moved"] == 0.0
    # Small buckets: several collectives per step (metadata + packed + in-place buckets).
    assert r["collectives"] >= 2 * r["dp_steps"]


@pytest.mark.timeout(120)
def test_uneven_token_counts_need_normalize_by(tmp_path: Any) -> None:
    """Without ``normalize_by`` the ranks' local means are averaged with equal weights: not the global mean."""
    r = train(tmp_path, "--model", "lora", "--uneven", "--no-normalize", "--reference")
    assert r["max_diff"] > 1e3 * EXACT, r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", ["", "fp32"], ids=["bf16-reduce", "fp32-reduce"])
def test_bf16_gradients_keep_replicas_identical(tmp_path: Any, reduce_dtype: str) -> None:
    """bf16 weights and gradients (fp32 masters): replicas bit-identical, close to the one-process run.

    Asynchronous steps: bf16 on CPU is slow enough that the optimizer kernel regularly finishes after
    the next step() call (the race test_async_step_results_do_not_depend_on_optimizer_timing pins)."""
    args = ["--model", "mlp", "--dtype", "bf16", "--reference"] + (
        ["--reduce-dtype", reduce_dtype] if reduce_dtype else []
    )
    r = train(tmp_path, *args)  # the script itself fails if the ranks' parameters differ
    assert r["max_diff"] < 0.05 * r["local_only_diff"], r


@pytest.mark.timeout(120)
def test_different_models_on_ranks_are_refused(tmp_path: Any) -> None:
    res = torchrun(["--model", "mlp", "--mismatch"], tmp_path)
    assert res.returncode != 0
    assert "trainable parameters differ between ranks (group ranks [1] differ from rank 0)" in res.stderr


@pytest.mark.timeout(120)
def test_main_thread_helpers_with_two_ranks(tmp_path: Any) -> None:
    res = torchrun([], tmp_path, script=os.path.join(ROOT, "tests", "dist_scripts", "helpers_check.py"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 0: helpers ok" in res.stdout and "rank 1: helpers ok" in res.stdout


# ---------------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resume_with_two_ranks_repeats_the_uninterrupted_run(tmp_path: Any) -> None:
    ckpt = os.path.join(str(tmp_path), "ckpt.pt")
    full = train(tmp_path, "--model", "mlp", "--save-at", "3", "--ckpt", ckpt)  # checkpoints at 3, runs on to 5
    assert os.path.exists(ckpt)
    resumed = train(tmp_path, "--model", "mlp", "--resume", "--ckpt", ckpt)
    assert resumed["start"] == 3 and resumed["dp_steps"] == 2
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["digest"] == full["digest"]  # bit-identical parameters after step 5


# ---------------------------------------------------------------------------------------------------------
# The host optimizer step sharded across the ranks of a host (shard_optimizer=True)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--model", "mlp"], id="sequential-sgd-async"),
        pytest.param(
            ["--model", "mlp", "--optim", "adamw", "--clip", "0.5", "--sync"], id="sequential-adamw-clip-sync"
        ),
        pytest.param(["--model", "auto", "--optim", "adamw"], id="autoroundpipe-adamw-async"),
        pytest.param(["--model", "lora", "--optim", "rpadam", "--clip", "1.0"], id="lora-roundpipe-adam-clip-async"),
    ],
)
def test_sharded_step_equals_one_process_and_keeps_each_state_once(tmp_path: Any, args: List[str]) -> None:
    """Each rank steps only its units, yet the replicas equal one process on the whole batch (the
    clipping in step_fn sees the global norm); every parameter's moments live on exactly one rank."""
    r = train(tmp_path, *args, "--shard", "--reference")
    assert r["max_diff"] < EXACT and r["local_only_diff"] > 1e3 * EXACT, r
    assert r["hidden_steps"] == 5 and r["owned"] == r["total_params"] and 0 < r["owned_here"] < r["total_params"], r
    # mlp / auto: 'c' has a gradient nowhere, so no rank has state for it (and it must not move).
    no_grad = 1 if args[1] in ("mlp", "auto") else 0
    assert r["state_entries"] == r["masters"] - no_grad, r
    if no_grad:
        assert r["c_moved"] == 0.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [2, 3])
def test_sharded_step_is_bit_identical_to_the_replicated_one(tmp_path: Any, nproc: int) -> None:
    """Sharding changes who computes an update, not its arithmetic: the same masters, bit for bit."""
    runs = {}
    for shard in (False, True):
        out = os.path.join(str(tmp_path), f"r{int(shard)}.json")
        res = torchrun(
            ["--model", "mlp", "--optim", "adamw", "--clip", "0.5", "--out", out] + (["--shard"] if shard else []),
            tmp_path,
            nproc=nproc,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        with open(out) as f:
            runs[shard] = json.load(f)
    assert runs[True]["digest"] == runs[False]["digest"] and runs[True]["losses"] == runs[False]["losses"]
    assert runs[True]["owned_here"] < runs[True]["total_params"]


@pytest.mark.timeout(150)
def test_sharded_checkpoint_gathers_the_moments_and_resumes_exactly(tmp_path: Any) -> None:
    """``full_optimizer_state_dict`` brings every rank's moments to rank 0; loading that state on both
    ranks (each drops what it does not own) repeats the uninterrupted run bit for bit."""
    ckpt = os.path.join(str(tmp_path), "ckpt.pt")
    common = ["--model", "mlp", "--optim", "adamw", "--shard", "--ckpt", ckpt]
    full = train(tmp_path, *common, "--save-at", "3")
    state = torch.load(ckpt, weights_only=True)["optim"]["state"]
    assert len(state) == full["state_entries"] and all("exp_avg" in v for v in state.values())
    resumed = train(tmp_path, *common, "--resume")
    assert resumed["start"] == 3 and resumed["losses"] == full["losses"][3:]
    assert resumed["digest"] == full["digest"]
    assert resumed["state_entries"] == full["state_entries"]  # the loaded foreign moments were dropped


@pytest.mark.timeout(120)
def test_sharded_step_with_a_dead_rank_fails_clearly(tmp_path: Any) -> None:
    """The step's barriers and the shared masters do not turn a dead peer into a hang."""
    t0 = time.time()
    res = torchrun(["--model", "mlp", "--shard", "--fail-at", "2", "--fail-how", "exit"], tmp_path, survivors=True)
    assert res.returncode != 0
    assert "DataParallelError: rank 0/2:" in res.stderr and "Another rank probably died or stalled" in res.stderr, (
        res.stderr[-3000:]
    )
    assert time.time() - t0 < 60


@pytest.mark.timeout(120)
def test_sharded_step_refuses_a_master_moved_out_of_shared_memory(tmp_path: Any) -> None:
    """``master.data = ...`` after sharding would leave the peers reading a stale copy: refused."""
    res = torchrun(["--model", "mlp", "--shard", "--replace-master-at", "2"], tmp_path)
    assert res.returncode != 0
    assert "no longer lies in the host's shared memory" in res.stderr and "copy_" in res.stderr, res.stderr[-3000:]


@pytest.mark.timeout(120)
def test_sharded_step_refuses_the_streamed_step(tmp_path: Any) -> None:
    res = torchrun(["--model", "mlp", "--shard"], tmp_path, env={"RPP_STEP_MODE": "streamed"})
    assert res.returncode != 0
    assert "RPP_STEP_MODE=streamed" in res.stderr and "shard_optimizer=False" in res.stderr, res.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# Failures: no hang, a clear error
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_dead_rank_makes_the_other_fail_clearly(tmp_path: Any) -> None:
    t0 = time.time()
    # Rank 0 is left to report on its own (what happens on another node, where no local agent sees the dead rank).
    res = torchrun(["--model", "mlp", "--fail-at", "2", "--fail-how", "exit"], tmp_path, survivors=True)
    elapsed = time.time() - t0
    assert res.returncode != 0
    assert "rank 1: injected failure (exit) at step 2" in res.stderr
    assert "DataParallelError: rank 0/2:" in res.stderr and "Another rank probably died or stalled" in res.stderr, (
        res.stderr[-3000:]
    )
    assert elapsed < 60


@pytest.mark.timeout(120)
def test_a_stalled_rank_times_out_instead_of_hanging(tmp_path: Any) -> None:
    t0 = time.time()
    res = torchrun(
        ["--model", "mlp", "--fail-at", "2", "--fail-how", "hang"], tmp_path, env={"RPP_DIST_TIMEOUT_S": "3"}
    )
    elapsed = time.time() - t0
    assert res.returncode != 0
    assert "DataParallelError: rank 0/2:" in res.stderr, res.stderr[-3000:]
    assert "collective timeout 3 s" in res.stderr and "Timed out" in res.stderr
    assert elapsed < 60  # 3 s timeout + start-up, not the 1-hour sleep


# ---------------------------------------------------------------------------------------------------------
# The benchmark script (CPU smoke): it runs, and 2 ranks reproduce the 1-rank loss curve
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_dp_bench_smoke_and_loss_curve(tmp_path: Any) -> None:
    bench = os.path.join(ROOT, "bench", "dp_bench.py")
    common = ["--model", "tiny", "--seq", "32", "--steps", "3", "--warmup", "1", "--lr", "1e-3"]
    two = os.path.join(str(tmp_path), "two.json")
    ref = os.path.join(str(tmp_path), "ref.json")
    res = torchrun(common + ["--batch-per-rank", "2", "--out", two], tmp_path, script=bench, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 rank(s)" in res.stdout
    res = torchrun(common + ["--batch-per-rank", "4", "--out", ref], tmp_path, nproc=1, script=bench, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]

    def same_curve(run: str) -> None:
        cmp = subprocess.run(
            [
                sys.executable,
                bench,
                "--compare",
                ref,
                run,
                "--loss-ref",
                ref,
                "--min-speedup",
                "0",
                "--loss-rtol",
                "1e-5",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cmp.returncode == 0, cmp.stdout + cmp.stderr

    same_curve(two)
    with open(two) as f:
        r = json.load(f)
    assert r["world"] == 2 and r["collectives_per_step"] >= 2 and r["grad_bytes"] > 0
    # The host step shared by the two ranks (--shard-optimizer): the same loss curve.
    sharded = os.path.join(str(tmp_path), "sharded.json")
    res = torchrun(
        common + ["--batch-per-rank", "2", "--shard-optimizer", "--out", sharded], tmp_path, script=bench, timeout=150
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sharded step" in res.stdout
    same_curve(sharded)


# ---------------------------------------------------------------------------------------------------------
# Single-process pieces: sharding, environment, setup errors, one-rank group
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_are_contiguous_and_cover_the_batch(n: int, world: int) -> None:
    t = torch.arange(n * 2).reshape(n, 2)
    parts = [rdist.shard(t, r, world) for r in range(world)]
    assert torch.equal(torch.cat(parts), t)  # rank order concatenation gives the global batch back
    assert max(p.shape[0] for p in parts) - min(p.shape[0] for p in parts) <= 1
    assert [list(rdist.shard(n, r, world)) for r in range(world)] == [
        list(range(n))[slice(*rdist.shard_bounds(n, r, world))] for r in range(world)
    ]


def test_shard_structures() -> None:
    ids, labels = torch.arange(8).reshape(4, 2), torch.arange(4)
    a, b = rdist.shard((ids, labels), 1, 2)
    assert torch.equal(a, ids[2:]) and torch.equal(b, labels[2:])
    d = rdist.shard({"input_ids": ids, "labels": labels}, 0, 2)
    assert torch.equal(d["input_ids"], ids[:2]) and torch.equal(d["labels"], labels[:2])
    assert rdist.shard(list("abcde"), 1, 2) == ["c", "d", "e"]
    assert rdist.shard({"attention_mask": None}, 1, 2) == {"attention_mask": None}
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        rdist.shard(4, 2, 2)
    with pytest.raises(TypeError):
        rdist.shard(object(), 0, 2)


def test_outside_torchrun_is_a_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    env = rdist.init_from_env()
    assert env == rdist.DistEnv() and not env.distributed and env.is_main
    assert not dist.is_initialized()
    assert rdist.is_main_process() and rdist.get_world_size() == 1
    assert rdist.broadcast_object({"a": 1}) == {"a": 1} and rdist.all_reduce_scalars([2.0, 3.0]) == [2.0, 3.0]
    assert rdist.any_across_ranks(True) and not rdist.any_across_ranks(False)
    rdist.barrier()
    rdist.assert_same_across_ranks(7, "anything")


@pytest.mark.parametrize(
    "var, fn, default",
    [
        ("RPP_DIST_TIMEOUT_S", rdist.timeout_s, rdist.DEFAULT_TIMEOUT_S),
        ("RPP_DIST_MAIN_TIMEOUT_S", rdist.main_timeout_s, rdist.DEFAULT_MAIN_TIMEOUT_S),
    ],
)
def test_timeout_settings(monkeypatch: pytest.MonkeyPatch, var: str, fn: Any, default: float) -> None:
    monkeypatch.delenv(var, raising=False)
    assert fn() == default
    monkeypatch.setenv(var, "12.5")
    assert fn() == 12.5
    for bad in ("abc", "0", "-3"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            fn()


def test_the_package_exports_its_public_names() -> None:
    """``roundpipe.distributed`` is a package; its ``__init__`` re-exports the public API, nothing private."""
    assert set(rdist.__all__) == {
        "DEFAULT_MAIN_TIMEOUT_S",
        "DEFAULT_TIMEOUT_S",
        "DataParallel",
        "DataParallelError",
        "DataParallelStats",
        "DistEnv",
        "ReduceOn",
        "all_reduce_scalars",
        "any_across_ranks",
        "assert_same_across_ranks",
        "barrier",
        "broadcast_object",
        "current_env",
        "destroy",
        "enable_data_parallel",
        "get_rank",
        "get_world_size",
        "init_from_env",
        "is_main_process",
        "main_timeout_s",
        "shard",
        "shard_bounds",
        "timeout_s",
    }
    assert all(hasattr(rdist, name) for name in rdist.__all__)
    # Errors print under the public name, wherever the class is defined.
    assert (
        f"{rdist.DataParallelError.__module__}.{rdist.DataParallelError.__qualname__}"
        == "roundpipe.distributed.DataParallelError"
    )


def test_enable_needs_an_initialized_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        rdist.enable_data_parallel(small_mlp())


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real (1-rank) gloo default group in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_one_rank_data_parallel_is_plain_training(workers: str, one_rank_group: None) -> None:
    ref = train_small_mlp(small_mlp(), 4)
    model = small_mlp()
    dp = rdist.enable_data_parallel(model)
    assert model.grad_sync is dp
    assert isinstance(dp, GradSync)  # the one interface the core calls
    got = train_small_mlp(model, 4, dp)
    assert torch.equal(got, ref)
    assert dp.stats.steps == 4 and dp.stats.collectives == 0  # nothing to exchange with one rank
    dp.close()
    assert model.grad_sync is None


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_setup_errors(workers: str, one_rank_group: None) -> None:
    with pytest.raises(TypeError, match="needs a RoundPipe model"):
        rdist.enable_data_parallel(nn.Linear(2, 2))  # type: ignore[arg-type]
    model = small_mlp()
    with pytest.raises(NotImplementedError, match="docs/multi-node.md"):
        rdist.enable_data_parallel(model, backend="nccl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_mb"):
        rdist.enable_data_parallel(model, bucket_mb=0)
    rdist.enable_data_parallel(model)
    with pytest.raises(ValueError, match="already data parallel"):
        rdist.enable_data_parallel(model)
    with pytest.raises(ValueError, match=">= 0"):
        model.grad_sync.normalize_by(-1)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_normalize_by_twice_in_one_step_is_reported(workers: str, one_rank_group: None) -> None:
    from roundpipe.host.optim_thread import OptimizerStepError

    model = small_mlp()
    dp = rdist.enable_data_parallel(model)
    dp.normalize_by(4)
    dp.normalize_by(4)
    with pytest.raises(OptimizerStepError, match="normalize_by called twice"):
        model.synchronize()


# ---------------------------------------------------------------------------------------------------------
# The asynchronous step when the optimizer kernel is slow (as when it waits for a slower peer)
# ---------------------------------------------------------------------------------------------------------


def _slow_kernel_run(slow: bool) -> torch.Tensor:
    import time as _time

    model = small_mlp()
    opt = torch.optim.SGD(list(model.optim_parameters()), lr=0.05)
    calls = [0]

    class SlowSync:  # a data-parallel all-reduce waiting for a slow peer (roundpipe.runtime.grad_sync.GradSync)
        step_sync = None

        def on_step_launch(self) -> None:
            pass

        def reduce_host(self, params: List[nn.Parameter]) -> None:
            if slow and calls[0] % model.num_layers == 0:
                _time.sleep(0.1)
            calls[0] += 1

        def agree_plan(self, model: Any, run_type: str, plan: Any) -> Any:
            return plan

        def layer_reducer(self, model: Any, layer_id: int) -> None:
            return None

    model.grad_sync = SlowSync()

    def step_fn() -> None:
        if slow:
            _time.sleep(0.05)  # a host optimizer step on a large model
        opt.step()
        opt.zero_grad(set_to_none=True)

    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        model.step(step_fn, is_async=True)
    model.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.optim_parameters()])


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_async_step_results_do_not_depend_on_optimizer_timing(workers: str) -> None:
    assert torch.equal(_slow_kernel_run(slow=True), _slow_kernel_run(slow=False))


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sharded_step_deals_layers_out_by_size(ranks: int) -> None:
    """Largest first to the least loaded rank: every rank's share within one layer of the others', and
    the same answer wherever it is computed (every rank computes it alone)."""
    from roundpipe.distributed.optim_shard import assign_owners

    sizes = [311, 50, 52, 50, 48, 50, 51, 0, 49, 50]  # an embedding and decoder layers, one empty unit
    owners = assign_owners(sizes, ranks)
    assert owners == assign_owners(list(sizes), ranks) and set(owners) == set(range(ranks))
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(ranks)]
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    if ranks == 2:
        assert max(loads) - min(loads) <= 52  # the embedding's rank also takes layers once it is the lighter one
