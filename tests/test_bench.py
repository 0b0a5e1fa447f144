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
        [
            "bench/train_bench.py",
            "--workload",
            "tiny",
            "--seq",
            "32",
            "--batch",
            "4",
            "--warmup",
            "1",
            "--iters",
            "1",
            "--compare-plans",
            "--compare-kernels",
        ],
        [
            "bench/train_bench.py",
            "--workload",
            "tiny",
            "--seq",
            "32",
            "--batch",
            "4",
            "--warmup",
            "1",
            "--iters",
            "1",
            "--lora",
            "2",
        ],
        ["bench/core_bench.py", "--layers", "3", "--hidden", "32", "--tokens", "64", "--warmup", "1", "--iters", "1"],
        ["bench/adam_bench.py", "--sizes", "1M", "--repeats", "2", "--threads", "1"],
        ["bench/fused_staging_bench.py", "--params", "13M", "--rounds", "2", "--threads", "1"],
    ],
    ids=["train_bench", "train_bench_lora", "core_bench", "adam_bench", "fused_staging_bench"],
)
def test_bench_script_runs(argv: list) -> None:
    env = dict(os.environ, RPP_DEVICES="cpu:2", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "|" in res.stdout  # the results table


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "argv, expect",
    [
        (["bench/job_cost.py", "--workers", "1", "2", "--iters", "3", "--warmup", "2", "--layers", "6"], "ratio"),
        (
            ["bench/job_cost.py", "--workers", "2", "--iters", "2", "--warmup", "1", "--layers", "4"]
            + ["--rounds", "2", "--plan", "layerwise"],
            "layerwise plan",
        ),
        (
            ["bench/pool_bench.py", "--workload", "tiny", "--seq", "32", "--batch", "4", "--devices", "1,2"]
            + ["--graphs", "0,1", "--warmup", "1", "--iters", "1"],
            "iteration 1:",
        ),
        (
            ["bench/user_script.py", "--workload", "tiny", "--seq", "32", "--batch", "2", "--steps", "1"],
            "final synchronize",
        ),
        (
            ["bench/user_script.py", "--workload", "tiny", "--seq", "32", "--batch", "2", "--steps", "1"]
            + ["--step-phases"],
            "optimizer step phases",
        ),
        (
            ["bench/user_script.py", "--workload", "tiny", "--seq", "32", "--batch", "2", "--steps", "1"]
            + ["--declared", "--step-phases"],
            "optimizer step phases",
        ),
        (
            ["bench/pool_bench.py", "--workload", "tiny", "--seq", "128", "--batch", "1", "--devices", "1"]
            + ["--graphs", "0", "--sequence-tiles", "4", "--tile-modes", "none,split", "--warmup", "1", "--iters", "1"],
            "tiles split",
        ),
        (
            ["bench/tile_profile.py", "--workload", "tiny", "--lora", "4", "--layers", "2", "--seq", "128"]
            + ["--tiles", "4", "--modes", "split"],
            "== 4 tiles, split",
        ),
        (
            ["bench/long_context.py", "--workload", "tiny", "--layers", "2", "--lengths", "256", "--skip-baseline"]
            + ["--memory-detail"],
            "plan at 256",
        ),
        (
            ["bench/stage_inputs_bench.py", "--grad-cosine", "--repeat", "--format", "int8", "--workload", "tiny"]
            + ["--lora", "4", "--seq", "128"],
            "int8_blocks_in_fp8",
        ),
        (["bench/stage_inputs_bench.py", "--format", "int8", "--seeds", "2", "--steps", "4"], '"mean_final_ratio"'),
    ],
    ids=[
        "job_cost",
        "job_cost_layerwise",
        "pool_bench",
        "user_script",
        "user_script_phases",
        "user_script_declared",
        "pool_bench_tiles",
        "tile_profile",
        "long_context",
        "stage_inputs",
        "stage_inputs_seeds",
    ],
)
def test_pool_scripts_run(argv: list, expect: str) -> None:
    """The pool's benchmarks (per-job cost, 1..N devices side by side, a user's own script) on CPU workers."""
    env = dict(os.environ, RPP_DEVICES="cpu:1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stderr[-3000:]
    assert expect in res.stdout


def _split_gaps(events: list, **kwargs: str) -> list:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from gpu_gaps import split_gaps
    finally:
        sys.path.pop(0)
    return split_gaps(events, **kwargs)


def _x(cat: str, ts: float, dur: float, tid: int = 1, name: str = "k", **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_gpu_gaps_split_between_and_inside_groups() -> None:
    job_a, job_b = "roundpipe model 'm' forward layer 0", "roundpipe model 'm' forward layer 1"
    events = [
        _x("user_annotation", 0, 100, tid=7, name=job_a),
        _x("user_annotation", 0, 5, tid=7, name="wait cpu.is_idle"),  # nested, not a job: ignored
        _x("user_annotation", 100, 100, tid=8, name=job_b),
        # launches on the device threads (runtime and driver API), correlation ids 1..5
        _x("cuda_runtime", 10, 1, tid=7, correlation=1),
        _x("cuda_driver", 20, 1, tid=7, correlation=2),
        _x("cuda_runtime", 110, 1, tid=8, correlation=3),
        _x("cuda_runtime", 300, 1, tid=8, correlation=4),  # outside any job
        # device 0: k1 [50, 60), k2 [65, 80) same job -> 5 us inside; k3 [90, 95) other job -> 10 us between;
        # an overlapping kernel [58, 62) extends k1's busy interval; memcpy is not compute
        _x("kernel", 50, 10, correlation=1, device=0),
        _x("kernel", 58, 4, correlation=1, device=0),
        _x("gpu_memcpy", 62, 30, correlation=9, device=0),
        _x("kernel", 65, 15, correlation=2, device=0),
        _x("kernel", 90, 5, correlation=3, device=0),
        # device 1: a kernel with no job next to one with a job -> between (never flatters the planner)
        _x("kernel", 0, 10, correlation=3, device=1),
        _x("kernel", 30, 10, correlation=4, device=1),
    ]
    d0, d1 = _split_gaps(events)
    assert (d0.device, d0.busy_us, d0.span_us) == (0, 12 + 15 + 5, 45)
    assert (d0.within_us, d0.within_count, d0.between_us, d0.between_count) == (3, 1, 10, 1)
    assert (d0.kernels, d0.unattributed) == (4, 0)
    assert (d1.between_us, d1.within_us, d1.unattributed) == (20, 0, 1)
    assert "idle between layer groups 0.0 ms (10.0%" in d0.describe(wall_us=100)


def test_gpu_gaps_backward_kernels_from_autograd_thread_get_the_running_job() -> None:
    job_a, job_b = "roundpipe model 'm' backward layer 1", "roundpipe model 'm' backward layer 0"
    events = [
        _x("user_annotation", 0, 100, tid=7, name=job_a),
        _x("user_annotation", 100, 100, tid=7, name=job_b),
        _x("user_annotation", 0, 200, tid=9, name="roundpipe model 'other' forward layer 0"),  # another GPU's thread
        _x("cuda_runtime", 10, 1, tid=7, correlation=1),  # device thread
        _x("cuda_runtime", 20, 1, tid=8, correlation=2),  # autograd's worker thread, during job a
        _x("cuda_runtime", 120, 1, tid=8, correlation=3),  # during job b
        _x("cuda_runtime", 130, 1, tid=9, correlation=4),
        _x("kernel", 10, 5, correlation=1, device=0),
        _x("kernel", 20, 5, correlation=2, device=0),
        _x("kernel", 120, 5, correlation=3, device=0),
        _x("kernel", 130, 5, correlation=4, device=1),
    ]
    d0, _ = _split_gaps(events)
    assert (d0.unattributed, d0.within_us, d0.between_us) == (0, 5, 95)
    assert d0.head_us is None and "before the first kernel" not in d0.describe(200)
    # With a window around the iteration: idle before the first kernel and after the last.
    d0, d1 = _split_gaps(events + [_x("user_annotation", -4, 150, tid=1, name="iteration")], window="iteration")
    assert (d0.head_us, d0.tail_us, d1.head_us, d1.tail_us) == (14, 21, 134, 11)
    assert "idle before the first kernel 0.0 ms (7.0%), after the last 0.0 ms (10.5%)" in d0.describe(200)


def test_one_flavor_table_feeds_the_cli_the_estimate_and_the_benches() -> None:
    """The Qwen3 sizes are written once (``roundpipe.flavors``): ``roundpipe train``'s built-in names
    (the WORKLOADS.md sizes), the estimate's shapes and the benchmarks' workloads are read from it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import train_bench
    finally:
        sys.path.pop(0)
    from roundpipe import flavors
    from roundpipe.cli.model_names import BUILTIN_MODELS
    from roundpipe.planning import estimate

    assert list(flavors.QWEN3) == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
    assert flavors.QWEN3["qwen3-1.7b"] == flavors.Flavor(2048, 6144, 28, 16, 8, tied=True)  # WORKLOADS.md
    for name, f in flavors.QWEN3.items():
        assert train_bench.WORKLOADS[name] == (f.hidden, f.intermediate, f.layers, f.heads, f.kv_heads, f.tied)
        shape = estimate.ModelShape.builtin(name)
        assert (shape.hidden, shape.layers, shape.head_dim, shape.vocab) == (f.hidden, f.layers, 128, 151936)
        if f.workload:
            config = BUILTIN_MODELS[name]
            assert (config["hidden_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (
                f.hidden,
                f.kv_heads,
                f.tied,
            )
        else:
            assert name not in BUILTIN_MODELS  # qwen3-32b: the estimate and the benches only
    assert set(BUILTIN_MODELS) == {"tiny"} | {n for n, f in flavors.QWEN3.items() if f.workload}
