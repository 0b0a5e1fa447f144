"""``roundpipe plan`` on a step that does not fit: it names the short side and by how much, and lists levers
whose effects are the estimate's own numbers (each compared here with ``estimate.estimate`` called directly),
and a lever said to fit does fit: ``plan`` with its flags added exits 0."""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any, Dict, List

import pytest
from helpers import ROOT

from roundpipe.cli import plan
from roundpipe.cli.config_flags import build_parser
from roundpipe.planning import estimate, memory_terms
from roundpipe.utils import GiB

HOST_SHORT = ["--model", "qwen3-8b", "--seq-len", "131072", "--lora-r", "16", "--gpu-memory", "24GiB"]
HOST_SHORT += ["--host-memory", "23.5GiB", "--stage-inputs", "bf16"]
GPU_SHORT = ["--model", "qwen3-8b", "--seq-len", "262144", "--lora-r", "16", "--gpu-memory", "24GiB"]
GPU_SHORT += ["--host-memory", "200GiB", "--stage-inputs", "bf16"]
FULL = ["--model", "qwen3-8b", "--seq-len", "131072", "--gpu-memory", "24GiB", "--host-memory", "23.5GiB"]
FULL += ["--stage-inputs", "bf16"]


def planned(capsys, argv: List[str]) -> Dict[str, Any]:
    status = plan.main([*argv, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == (0 if result["fits"] else 1)
    return result


def direct(seq_len: int, gpu: float, host: float, **kw: Any) -> estimate.Estimate:
    """The estimate called directly, with plan's choice of layers per backward stage spelled out."""
    shape = estimate.ModelShape.builtin("qwen3-8b")
    base: Dict[str, Any] = dict(batch_size=1, microbatches=1, devices=1, sequence_tiles=1, stage_inputs="bf16")
    base.update(optimizer_bytes_per_param=12.0, lora_rank=16)
    base.update(kw)
    tries = [estimate.estimate(shape, seq_len, layers_per_stage=g, gpu_bytes=gpu, **base) for g in range(1, 5)]
    return next((e for e in tries if e.peak_gpu_bytes <= gpu and e.peak_host_bytes <= host), tries[0])


def by_change(result: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {lever["change"].split(" (")[0]: lever for lever in result["levers"]}


def test_host_short_names_the_side_and_the_levers(capsys) -> None:
    result = planned(capsys, HOST_SHORT)
    gpu, host = 24 * GiB, 23.5 * GiB
    e = direct(131072, gpu, host)
    assert not result["fits"] and result["peak_host_bytes"] == e.peak_host_bytes
    assert result["short"] == {"gpu": 0.0, "host": e.peak_host_bytes - host}
    levers = by_change(result)
    compact = direct(
        131072, gpu, host, optimizer_bytes_per_param=memory_terms.optimizer_state_bytes("int8", "bfloat16")
    )
    int8 = direct(131072, gpu, host, stage_inputs="int8")
    seq, fit = estimate.longest_context(
        estimate.ModelShape.builtin("qwen3-8b"), gpu, host, lora_rank=16, stage_inputs="bf16", devices=1
    )
    expect = {
        "--optim-state int8 --master bfloat16": compact,
        "--stage-inputs int8": int8,
        f"--seq-len {seq}": fit,
    }
    for change, e in expect.items():
        lever = levers[change]
        assert (lever["peak_gpu_bytes"], lever["peak_host_bytes"]) == (e.peak_gpu_bytes, e.peak_host_bytes), change
    nf4 = direct(131072, gpu, host, base_format="nf4")
    lever = levers["--base-format nf4"]
    assert (lever["peak_gpu_bytes"], lever["peak_host_bytes"]) == (nf4.peak_gpu_bytes, nf4.peak_host_bytes)
    assert nf4.host_parts["weights"] < e.host_parts["weights"] / 2
    assert "--lora-r 16" not in levers  # already LoRA: not offered again
    assert levers[f"--seq-len {seq}"]["fits"] and 0 < seq < 131072
    assert levers["--host-memory 55GiB"]["fits"]
    plan.main(HOST_SHORT)
    text = capsys.readouterr().out
    assert "this step does NOT fit 24.0 GiB per GPU and 23.5 GiB of host memory: host short by " in text
    assert f"host short by {(e_host := result['peak_host_bytes'] - host) / GiB:.1f} GiB (needs " in text and e_host > 0
    assert f"  --stage-inputs int8 (RPP_STAGE_INPUTS=int8): GPU {int8.peak_gpu_bytes / GiB:.1f} GiB, " in text
    assert (
        f"host {int8.peak_host_bytes / GiB:.1f} GiB (host still {(int8.peak_host_bytes - host) / GiB:.1f} GiB short)"
        in text
    )
    assert (
        f"  --seq-len {seq}: GPU {fit.peak_gpu_bytes / GiB:.1f} GiB, host {fit.peak_host_bytes / GiB:.1f} GiB (fits)"
        in text
    )


FP8 = ["--base-format", "fp8", "--fp8"]


@pytest.mark.parametrize(
    "argv",
    [HOST_SHORT, GPU_SHORT, FULL, HOST_SHORT + FP8, FULL + ["--fp8"]],
    ids=["host short", "GPU short", "full fine-tune", "host short, fp8", "full fine-tune, fp8"],
)
def test_a_lever_said_to_fit_fits(capsys, argv: List[str]) -> None:
    """Each lever's flags added to the command: ``plan`` then says what the lever said (its numbers too). With
    ``--fp8`` a lever to LoRA keeps the base fp8 (``--base-format fp8``), one to NF4 drops FP8 (``--no-fp8``)."""
    result = planned(capsys, argv)
    assert result["levers"] and not result["fits"]
    for lever in result["levers"]:
        if not lever["available"] or lever["change"].startswith("together"):
            continue
        if "--fp8" in argv and "--base-format" in lever["argv"]:
            assert (lever["argv"][-1] == "--no-fp8") if "nf4" in lever["argv"] else ("fp8" in lever["argv"]), lever
        again = planned(capsys, [*argv, *lever["argv"]])  # a later flag wins in argparse
        assert again["fits"] == lever["fits"], lever
        assert (again["peak_gpu_bytes"], again["peak_host_bytes"]) == (
            lever["peak_gpu_bytes"],
            lever["peak_host_bytes"],
        )


def test_gpu_short_offers_the_gpu_that_fits(capsys) -> None:
    result = planned(capsys, GPU_SHORT)
    assert result["short"]["host"] == 0 and result["short"]["gpu"] > 0
    (more,) = [lever for lever in result["levers"] if lever["change"].startswith("--gpu-memory")]
    n = int(more["argv"][1][: -len("GiB")])
    assert more["fits"] and more["peak_gpu_bytes"] <= n * GiB
    below = direct(262144, (n - 1) * GiB, 200 * GiB)
    assert below.peak_gpu_bytes > (n - 1) * GiB  # the least whole GiB that fits


def test_a_full_fine_tune_is_offered_lora_and_the_levers_together(capsys) -> None:
    result = planned(capsys, FULL)
    levers = by_change(result)
    lora = direct(131072, 24 * GiB, 23.5 * GiB, lora_rank=16)
    assert (levers["--lora-r 16"]["peak_host_bytes"], levers["--lora-r 16"]["fits"]) == (lora.peak_host_bytes, False)
    (together,) = [lever for lever in result["levers"] if lever["change"].startswith("together")]
    assert "--lora-r 16" in together["change"] and "--stage-inputs int8" in together["change"]
    again = planned(capsys, [*FULL, *together["argv"]])
    assert (again["fits"], again["peak_host_bytes"]) == (together["fits"], together["peak_host_bytes"])


def qwen3_8b_dir(path: Any) -> str:
    """Qwen3-8B's config.json as released (40,960 positions), alone in a directory."""
    from roundpipe.cli.model_names import BUILTIN_MODELS

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(BUILTIN_MODELS["qwen3-8b"], model_type="qwen3", architectures=["Qwen3ForCausalLM"]), f)
    return str(path)


def recipe() -> str:
    """docs/long-context.md's opening recipe section."""
    with open(os.path.join(ROOT, "docs", "long-context.md")) as f:
        text = f.read()
    return text.split("## Recipe: plan, then train\n", 1)[1].split("\n## ", 1)[0]


def test_the_long_context_recipe_prints_what_it_shows(capsys, monkeypatch, tmp_path) -> None:
    """Each ``roundpipe plan`` of the recipe prints the output block under it; each ``roundpipe train`` after it
    takes the plan's flags (the memory caps too); the measured rows are benchmarks.md's."""
    monkeypatch.delenv("RPP_STAGE_INPUTS", raising=False)
    blocks = re.findall(r"```(\w*)\n(.*?)```", recipe(), flags=re.S)
    plans = 0
    for i, (kind, body) in enumerate(blocks):
        if kind != "bash":  # an output block (its text is no command line)
            continue
        command = shlex.split(body.replace("\\\n", " "))
        if command[:2] != ["roundpipe", "plan"]:
            continue
        plans += 1
        status = plan.main(command[2:])
        assert capsys.readouterr().out == blocks[i + 1][1], body
        if status == 0:  # the train command under it runs with the same flags
            train = shlex.split(blocks[i + 2][1].replace("\\\n", " "))
            assert train[:2] == ["roundpipe", "train"]
            ns = build_parser().parse_args(train[2:])
            flags = dict(zip(command[2::2], command[3::2]))
            for flag, value in flags.items():
                if flag != "--model":
                    assert str(getattr(ns, flag[2:].replace("-", "_"))) == value, (flag, train)
            # A Qwen3-8B directory (its config.json, without weights) with the train command's scaling: the same plan.
            model = qwen3_8b_dir(tmp_path / os.path.basename(ns.model))
            assert plan.main([*command[2:], "--model", model, "--rope-scaling", ns.rope_scaling]) == 0
            shown = blocks[i + 1][1].split("\n", 1)[1]
            assert capsys.readouterr().out.split("\n", 1)[1] == shown
    assert plans == 3
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        bench = f.read()
    rows = [line for line in recipe().splitlines() if line.startswith("| ") and "bench/long_context.py" in line]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        tokens, gpu, date, *figures, command = cells[1:]
        same = [line for line in bench.splitlines() if command in line and f"| {tokens} | {gpu} | {date} |" in line]
        assert len(same) == 1, row
        assert all(f" {x} " in same[0].replace("*", "") for x in figures if x), (row, same[0])
