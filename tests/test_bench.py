"""The benchmark scripts run in a tiny CPU configuration, so they cannot rot: each one's ``--help``, and each
one (or each mode with its own code path) on a tiny model with CPU workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py"))


def run(argv: List[str], workers: int = 1) -> subprocess.CompletedProcess:
    """``python bench/<argv>`` with ``workers`` CPU workers, from the repository root."""
    env = dict(os.environ, RPP_DEVICES=f"cpu:{workers}", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=230, check=False
    )


# Runs several scripts one after another in one process (``runpy``, as ``python script.py`` would), so that
# the interpreter and torch start once per group: prints each run's standard output, as a JSON list.
DRIVER = """
import contextlib, io, json, runpy, sys
outs = []
for argv in json.loads(sys.argv[1]):
    print("running", argv, file=sys.stderr, flush=True)
    sys.argv, out = argv, io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), (argv, exc.code, out.getvalue()[-2000:])
    outs.append(out.getvalue())
print(json.dumps(outs))
"""


def run_group(argvs: List[List[str]], workers: int = 1) -> List[str]:
    """The standard output of each ``bench/`` command line in ``argvs``, run in one process in turn."""
    env = dict(os.environ, RPP_DEVICES=f"cpu:{workers}", PYTHONPATH=ROOT)
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(argvs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_bench_stays_small() -> None:
    """At most eleven scripts, each within the line limit."""
    assert len(SCRIPTS) <= 11, SCRIPTS
    for name in SCRIPTS:
        with open(os.path.join(BENCH, name)) as f:
            assert sum(1 for _ in f) <= 600, name


@pytest.mark.timeout(120)
def test_every_script_has_a_help_that_imports_no_model_library() -> None:
    """``--help`` of every script in one process: it prints the usage and exits 0, and loads neither
    transformers nor peft (nor builds anything) on the way."""
    code = (
        "import contextlib, io, runpy, sys\n"
        f"for name in {SCRIPTS!r}:\n"
        "    sys.argv = [name, '--help']\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        f"            runpy.run_path({BENCH!r} + '/' + name, run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), (name, exc.code)\n"
        "    else:\n"
        "        raise AssertionError(name + ': --help did not exit')\n"
        "    assert 'usage:' in out.getvalue(), name\n"
        "print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))\n"
    )
    env = dict(os.environ, RPP_DEVICES="cpu:1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


TINY = ["--workload", "tiny", "--seq", "32"]

GROUPS = {
    # name: (CPU workers, [(command line, a line of its expected output), ...])
    "training": (
        2,
        [
            (
                ["bench/train_bench.py", *TINY, "--batch", "4", "--warmup", "1", "--iters", "1", "--lora", "2"]
                + ["--compare-plans", "--compare-kernels"],
                "| roundpipe (2 device, layerwise plan",
            ),
            (  # LoRA over an NF4 base built layer by layer, beside a bf16 base
                ["bench/train_bench.py", *TINY, "--batch", "4", "--warmup", "0", "--iters", "1", "--lora", "2"]
                + ["--base-format", "nf4,bf16"],
                "auto plan, HF kernels, nf4 base) |",
            ),
            (  # a mixture of experts, transformers' eager experts
                ["bench/train_bench.py", "--workload", "tiny-moe", "--seq", "32", "--batch", "4", "--warmup", "0"]
                + ["--iters", "1", "--layers", "1", "--experts", "eager", "--fp8", "both"],
                "auto plan, HF kernels, fp8 GEMMs) |",
            ),
            (  # LoRA on a mixture of experts: attention and the experts' fused weights
                ["bench/train_bench.py", "--workload", "tiny-moe", "--seq", "32", "--batch", "4", "--warmup", "0"]
                + ["--iters", "1", "--layers", "1", "--experts", "eager", "--lora", "2"],
                "LoRA r=2 on k_proj/o_proj/q_proj/v_proj, mlp.experts.gate_up_proj, mlp.experts.down_proj,",
            ),
            (["bench/user_script.py", *TINY, "--batch", "2", "--steps", "1", "--declared", "--step-phases"], "phases"),
        ],
    ),
    "pool": (  # the scripts that choose their own device count last: the choice stays for the process
        1,
        [
            (
                ["bench/dp_bench.py", "--model", "tiny", "--seq", "32", "--batch-per-rank", "2", "--steps", "2"]
                + ["--warmup", "1", "--gpus-per-rank", "0"],
                "| tiny | 1 rank(s) x 1 device(s)",
            ),
            (["bench/dp_bench.py", "--simulate", "--net-gbps", "10", "100"], "| 100 |"),
            (
                ["bench/long_context.py", "--workload", "tiny", "--layers", "2", "--lengths", "256"]
                + ["--warmup-len", "64", "--skip-baseline", "--memory-detail"],
                "plan at 256",
            ),
            (
                ["bench/job_cost.py", "--workers", "1", "2", "--iters", "2", "--warmup", "1", "--layers", "4"]
                + ["--rounds", "2", "--plan", "layerwise"],
                "layerwise plan",
            ),
            (
                ["bench/pool_bench.py", *TINY, "--batch", "4", "--devices", "2", "--graphs", "0,1"]
                + ["--warmup", "1", "--iters", "1"],
                "graphs=1 peer=auto 2 device(s)",
            ),
            (
                ["bench/pool_bench.py", "--workload", "tiny", "--seq", "128", "--batch", "1", "--devices", "1"]
                + ["--graphs", "0", "--sequence-tiles", "4", "--tile-modes", "none,split"]
                + ["--warmup", "1", "--iters", "1"],
                "tiles split",
            ),
        ],
    ),
    "host optimizer": (
        1,
        [
            (
                ["bench/host_step_bench.py", "--mode", "impls", "--sizes", "1M", "--layouts", "lora", "--repeats", "2"]
                + ["--threads", "1"],
                "lora",
            ),
            (
                ["bench/host_step_bench.py", "--params", "256K", "--layers", "2", "--copy-mib", "16", "--repeats", "1"]
                + ["--threads", "1"],
                "| one tensor per expert | 206 |",
            ),
            (
                ["bench/host_step_bench.py", "--mode", "staging", "--sizes", "13M", "--repeats", "2", "--threads", "1"],
                "| Adam pass, bf16 write fused",
            ),
            (
                ["bench/convergence.py", "optimizer", "--steps", "3", "--batch", "2", "--seq", "32", "--modes", "2"]
                + ["--no-plot"],
                "| int8 state |",
            ),
        ],
    ),
    "layers": (
        1,
        [
            (
                ["bench/kernels_bench.py", "--cpu", "--tiny", "--no-compile", "--warmup", "0", "--iters", "1"],
                "agreement OK",
            ),
            (
                ["bench/kernels_bench.py", "--tiling", "--cpu", "--tiny", "--seqs", "64", "--tile", "32"]
                + ["--iters", "1"],
                "| lora | 64 |",
            ),
            (["bench/convergence.py", "block-errors", "--size", "256"], '"int8_128"'),
            (["bench/convergence.py", "repeat", "--steps", "2"], "first call's gradients equal"),
        ],
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", list(GROUPS))
def test_scripts_run_on_cpu_workers(group: str) -> None:
    """Each script, and each mode with a code path of its own, on a tiny model: it finishes and prints its result."""
    workers, runs = GROUPS[group]
    outs = run_group([argv for argv, _ in runs], workers)
    for (argv, expect), out in zip(runs, outs):
        assert expect in out, (argv, out[-3000:])


@pytest.mark.timeout(240)
def test_convergence_stage_inputs_compacts_and_compares() -> None:
    """One step's gradients with exact and int8 stage inputs agree to a cosine near 1 and stage inputs were
    compacted; the loss comparison trains the same tiny model with both and starts from the same loss."""
    grads, losses = run_group(
        [
            ["bench/convergence.py", "grad-cosine", "--repeat", "--format", "int8", *TINY, "--lora", "4"],
            ["bench/convergence.py", "stage-inputs", "--format", "int8", *TINY, "--steps", "2"],
        ]
    )
    out = json.loads(grads.strip().splitlines()[-1])
    assert out["compacted"] > 0 and out["grad_cosine"] > 0.99 and out["repeat_grad_cosine"] == pytest.approx(1.0)
    kept_fp8, blocks = (int(n) for n in out["int8_blocks_in_fp8"].split(" of "))
    assert blocks > 0 and 0 <= kept_fp8 <= blocks
    out = json.loads(losses.strip().splitlines()[-1])
    assert out["first_step_equal"] and out["compacted"] > 0 and out["ratio"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_copy_bench_without_a_gpu_says_so() -> None:
    """Host-device copies need a GPU: without one the script refuses with a usage error, not a traceback."""
    res = run(["bench/copy_bench.py", "--pinned", "--sizes-mib", "1", "--reps", "1"])
    assert res.returncode == 2 and "need a CUDA device" in res.stderr


def _split_gaps(events: list, **kwargs: str) -> list:
    sys.path.insert(0, BENCH)
    try:
        from train_bench import split_gaps
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
    # Without job ranges (no RPP_PROFILER=torch) the idle time is not split, and not called "between groups".
    plain = _split_gaps([e for e in events if e["cat"] != "user_annotation"])[0]
    assert plain.unattributed == plain.kernels and "idle 0.0 ms (13.0%, 2 gaps)" in plain.describe(100)
    assert "between layer groups" not in plain.describe(100)


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
    sys.path.insert(0, BENCH)
    try:
        import train_bench
    finally:
        sys.path.pop(0)
    from roundpipe import flavors
    from roundpipe.cli.model_names import BUILTIN_MODELS
    from roundpipe.planning import estimate

    assert list(flavors.QWEN3) == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
    assert flavors.QWEN3["qwen3-1.7b"] == flavors.Flavor(2048, 6144, 28, 16, 8, tied=True)  # WORKLOADS.md
    assert train_bench.WORKLOADS == ["tiny", "tiny-moe", *flavors.QWEN3, *flavors.LLAMA3, *train_bench.MOE_WORKLOADS]
    c = train_bench.workload_config("qwen3-30b-a3b")  # Qwen3-30B-A3B's shape; its 6-layer slice: 4.36B parameters
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (48, 128, 8, 768)
    sliced = train_bench.build_model("qwen3-30b-a3b", "meta", layers=6)
    assert round(sum(p.numel() for p in sliced.parameters()) / 1e9, 2) == 4.36
    c = train_bench.workload_config("llama3.1-70b")  # Llama-3.1-70B's shape
    assert (type(c).__name__, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        "LlamaConfig",
        8192,
        28672,
        80,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size, c.head_dim) == (64, 8, 128256, 128)
    assert not c.tie_word_embeddings and c.rope_parameters["rope_type"] == "llama3"
    shape = estimate.ModelShape.builtin("llama3.1-70b")
    assert (shape.hidden, shape.layers, shape.vocab, shape.tied) == (8192, 80, 128256, False)
    for name, f in flavors.QWEN3.items():
        c = train_bench.workload_config(name)
        assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (f.hidden, f.intermediate, f.layers)
        assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (f.heads, f.kv_heads, f.tied)
        assert train_bench.workload_config(name, layers=2).num_hidden_layers == 2
        shape = estimate.ModelShape.builtin(name)
        assert (shape.hidden, shape.layers, shape.head_dim, shape.vocab) == (f.hidden, f.layers, 128, 151936)
        config = BUILTIN_MODELS[name]
        assert (config["hidden_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (
            f.hidden,
            f.kv_heads,
            f.tied,
        )
    assert set(BUILTIN_MODELS) == {"tiny", *flavors.BUILTIN}  # one list: plan and train take the same names


def _train_bench() -> object:
    sys.path.insert(0, BENCH)
    try:
        import train_bench
    finally:
        sys.path.pop(0)
    return train_bench


def _adapted(model: object) -> set:
    """What LoRA adapts in ``model``: each adapted module's last name, ``experts.<name>`` per expert parameter."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper):
            out.add(f"experts.{mod.parameter_name}")
        elif isinstance(mod, LoraLayer):
            out.add(name.rsplit(".", 1)[-1])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3"])
def test_lora_adapts_attention_and_experts_of_a_mixture_of_experts(family: str) -> None:
    """``--lora`` on a mixture of experts adapts q/k/v/o and both fused expert weights (PEFT's
    ``target_parameters``: r rows per expert), the router frozen; on a dense model the seven projections."""
    import transformers

    from roundpipe.models.configs import tiny_config

    tb = _train_bench()
    model = tb.add_lora(transformers.AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=1)), 2)
    if family == "qwen3":
        assert _adapted(model) == set(tb.LORA_TARGETS)
        return
    assert _adapted(model) == {"q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"}
    expert_a = [p for n, p in model.named_parameters() if ".experts." in n and "lora_A" in n]
    assert [p.shape[0] for p in expert_a] == [2 * 4, 2 * 4]  # r x the tiny config's four experts
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert "mlp.experts.gate_up_proj" in tb.lora_what(family) and "q_proj" in tb.lora_what(family)


def _gpt_oss() -> object:
    from roundpipe.models.configs import tiny_config

    return tiny_config("gpt_oss", num_hidden_layers=1, hidden_size=64, intermediate_size=64)  # blocks of 32 inputs


def _expert_bytes(model: object) -> int:
    from roundpipe.utils import host_nbytes

    return sum(host_nbytes(p) for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))


def test_mxfp4_random_build_keeps_experts_about_4x_smaller_than_bf16() -> None:
    """The random GPT-OSS build in mxfp4 holds its expert weights at 4.25 bits per element (16 / 4.25 = 3.76x
    fewer host bytes than bf16), and the bench's count from shapes alone agrees with both builds' bytes."""
    import torch
    import transformers

    from roundpipe.loading import build_random
    from roundpipe.utils import host_nbytes

    tb = _train_bench()
    lora = tb.lora_config("gpt_oss", 2)
    built = {f: build_random(_gpt_oss(), f, lora, torch.bfloat16) for f in ("bf16", "mxfp4")}
    assert any(type(p).__name__ == "FrozenWeight" for p in built["mxfp4"].parameters())
    ratio = _expert_bytes(built["bf16"]) / _expert_bytes(built["mxfp4"])
    assert ratio == pytest.approx(16 / 4.25, rel=0.01)
    with torch.device("meta"):
        shapes = transformers.AutoModelForCausalLM.from_config(_gpt_oss(), dtype=torch.bfloat16).requires_grad_(False)
    for f, model in built.items():
        frozen = sum(host_nbytes(p) for p in {id(p): p for p in model.parameters() if not p.requires_grad}.values())
        assert tb.base_host_bytes(shapes, f) == frozen, f


def test_gpt_oss_120b_workload_has_the_published_shape() -> None:
    """GPT-OSS-120B's config: 36 layers of 128 experts, 4 per token, at GPT-OSS-20B's widths; 116.8B parameters."""
    tb = _train_bench()
    c = tb.workload_config("gpt-oss-120b")
    assert (type(c).__name__, c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok) == (
        "GptOssConfig",
        36,
        128,
        4,
    )
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2880,
        2880,
        64,
        8,
        64,
    )
    assert (c.vocab_size, c.sliding_window, c.tie_word_embeddings) == (201088, 128, False)
    model = tb.build_model("gpt-oss-120b", "meta")
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 116.8
