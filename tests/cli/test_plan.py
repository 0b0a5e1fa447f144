"""``roundpipe plan`` as a new user meets it: it refuses what ``roundpipe train`` refuses (a sequence
beyond the model's ``max_position_embeddings``, more microbatches than sequences), estimates the compact
optimizer state with train's flags, shows one host figure, exits alike in text and ``--json``, and
answers a config it cannot read (GPT-2's, broken JSON) with one line."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List

import pytest

from roundpipe.cli import plan
from roundpipe.planning import estimate, memory_terms
from roundpipe.utils import GiB

from .runner import roundpipe

BUDGET = ["--gpu-memory", "80GiB", "--host-memory", "128GiB"]


def config_dir(root: Any, name: str, **config: Any) -> str:
    path = os.path.join(str(root), name)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def qwen3_dir(root: Any, max_positions: int = 2048) -> str:
    """A small Qwen3-layout config.json (no weights: plan reads the config alone)."""
    shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    shape.update(num_key_value_heads=2)
    return config_dir(
        root, "qwen3", model_type="qwen3", head_dim=64, vocab_size=1000, max_position_embeddings=max_positions, **shape
    )


def one_line(capsys: pytest.CaptureFixture, argv: List[str], *fragments: str) -> str:
    """``plan`` answers ``argv`` with status 2 and one ``roundpipe: error: what — fix`` line holding the fragments."""
    assert plan.main(argv) == 2
    out = capsys.readouterr()
    lines = [l for l in out.err.splitlines() if l.strip()]
    assert out.out == "" and len(lines) == 1, out.err
    assert lines[0].startswith("roundpipe: error: ") and " — " in lines[0], out.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def test_refuses_what_train_refuses(tmp_path, capsys) -> None:
    model = qwen3_dir(tmp_path)
    assert plan.main(["--model", model, "--seq-len", "2048", *BUDGET]) == 0
    capsys.readouterr()
    # The words of roundpipe train's refusal (tests/cli/test_config.py).
    one_line(
        capsys, ["--model", model, "--seq-len", "4096", *BUDGET],
        "seq_len=4096 exceeds the model's limit (max_position_embeddings=2048) — add --rope-scaling yarn:2, or lower "
        "--seq-len to at most 2048",
    )  # fmt: skip
    more = ["--batch-size", "2", "--microbatches", "4"]
    one_line(capsys, ["--model", model, "--seq-len", "64", *more], "batch_size=2 is smaller than microbatches=4")
    one_line(capsys, ["--model", model, "--seq-len", "64", "--lora-r", "-1"], "--lora-r=-1 is negative")
    one_line(capsys, ["--model", model, "--seq-len", "0"], "--seq-len=0 must be positive")
    one_line(capsys, ["--model", model, "--seq-len", "8", "--optim-state", "int4"], "optim_state='int4' is not")
    one_line(capsys, ["--model", model, "--seq-len", "64", "--bogus"], "unrecognized arguments: --bogus", "plan --help")
    # A built-in architecture has no limit: train extends its rotary tables for the built-in task.
    assert plan.main(["--model", "qwen3-8b", "--seq-len", "131072", "--lora-r", "16", *BUDGET, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    one_line(capsys, ["--model", "qwen3-8B", "--seq-len", "64"], "(did you mean 'qwen3-8b'?)", "qwen3-32b")


def test_compact_optimizer_state_as_train_takes_it(capsys) -> None:
    """``--optim-state`` / ``--master`` / ``--master-rounding`` change the host optimizer bytes by the
    table of docs/optimizer.md; ``bf16`` is accepted as in train."""
    n = estimate.ModelShape.builtin("qwen3-8b").params()

    def host_optimizer(*flags: str) -> float:
        plan.main(["--model", "qwen3-8b", "--seq-len", "4096", *BUDGET, "--json", *flags])
        return json.loads(capsys.readouterr().out)["host_parts"]["optimizer"]

    default = host_optimizer()
    for flags, per_param in (
        ((), 12.0),
        (("--optim-state", "bfloat16"), 8.0),
        (("--optim-state", "int8"), 6.0 + 1 / 32),
        (("--master", "bfloat16"), 10.0),
        (("--optim-state", "int8", "--master", "bf16"), 4.0 + 1 / 32),
        (("--optim-state", "int8", "--master", "bfloat16", "--master-rounding", "kahan"), 6.0 + 1 / 32),
    ):
        got = host_optimizer(*flags)
        assert got - default == pytest.approx((per_param - 12.0) * n, rel=1e-9), flags
    assert memory_terms.optimizer_state_bytes() == 12.0
    assert memory_terms.optimizer_state_bytes("int8", "bfloat16") == 4.0 + 1 / 32


def test_fp8_stage_inputs_as_train_takes_them(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--stage-inputs fp8`` counts the host checkpoints at 1 byte and a float32 scale per 128 values (all
    36 on the host here: none kept on the GPU); a value train refuses is refused here too."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "0")

    def checkpoints(*flags: str) -> float:
        plan.main(["--model", "qwen3-8b", "--seq-len", "262144", "--lora-r", "16", *BUDGET, "--json", *flags])
        return json.loads(capsys.readouterr().out)["host_parts"]["checkpoints"]

    side = 262144 * memory_terms.side_bytes_per_token(estimate.ModelShape.builtin("qwen3-8b"))
    assert checkpoints("--stage-inputs", "bf16") - side == 36 * 262144 * 8192
    assert checkpoints("--stage-inputs", "fp8") - side == 36 * 262144 * (4096 + 128)
    assert checkpoints("--stage-inputs", "int8") - side == 36 * 262144 * (4096 + 512)
    one_line(capsys, ["--model", "qwen3-8b", "--seq-len", "64", "--stage-inputs", "int4"], "invalid choice: 'int4'")


def test_one_host_figure_and_the_same_exit_status_in_text_and_json(capsys) -> None:
    """A host size that is not a whole number of GiB reads the same on every line; a step that does not
    fit exits 1 in text and in JSON, one that fits 0 in both."""
    budget = ["--gpu-memory", "24GiB", "--host-memory", "23.5GiB"]
    for seq, want in (("4096", 0), ("1048576", 1)):
        args = ["--model", "qwen3-0.6b", "--seq-len", seq, "--lora-r", "16", *budget]
        assert plan.main(args) == want
        text = capsys.readouterr().out
        assert set(re.findall(r"([\d.]+) GiB of host memory", text)) == {"23.5"}, text
        assert set(re.findall(r"([\d.]+) GiB per GPU", text)) == {"24.0"}, text
        assert plan.main(args + ["--json"]) == want
        got: Dict[str, Any] = json.loads(capsys.readouterr().out)
        assert got["fits"] is (want == 0) and got["host_memory"] == 23.5 * GiB


@pytest.mark.timeout(120)
def test_a_config_it_cannot_read_is_one_line(tmp_path) -> None:
    """Through the real command: GPT-2's config (other key names), broken JSON, a JSON list."""
    gpt2 = config_dir(tmp_path, "gpt2", model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=9)
    broken = os.path.join(str(tmp_path), "broken")
    os.makedirs(broken)
    with open(os.path.join(broken, "config.json"), "w") as f:
        f.write('{"hidden_size": 4,')
    listed = config_dir(tmp_path, "listed")
    with open(os.path.join(listed, "config.json"), "w") as f:
        f.write("[1, 2]")
    cases = [
        (gpt2, "(model_type 'gpt2') has no integer hidden_size, intermediate_size, num_hidden_layers"),
        (broken, "cannot read " + os.path.join(broken, "config.json") + " (JSONDecodeError: "),
        (listed, "config.json is not a JSON object"),
    ]
    for model, fragment in cases:
        for extra in ([], ["--json"]):
            proc = roundpipe(["plan", "--model", model, "--seq-len", "128", *extra], str(tmp_path))
            lines = [l for l in proc.stderr.splitlines() if l.strip()]
            assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
            assert lines[0].startswith("roundpipe: error: ") and fragment in lines[0], lines[0]
