"""`roundpipe train` configuration: YAML + flags precedence, --print-config, one-line user errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml
from helpers import ROOT

from roundpipe.cli import main
from roundpipe.cli.config import TASK_PROFILE, ConfigError, TrainConfig
from roundpipe.cli.config_flags import parse_train_args


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_flags_override_yaml_and_task_profile(tmp_path) -> None:
    cfg_file = write(tmp_path / "c.yaml", "lr: 0.01\nbatch_size: 16\nlora-r: 4\nbetas: [0.8, 0.9]\n")
    cfg, print_config, given, overwrite = parse_train_args(["--config", cfg_file, "--lr", "0.5", "--no-async-step"])
    assert (cfg.lr, cfg.batch_size, cfg.lora_r, cfg.betas, cfg.async_step) == (0.5, 16, 4, [0.8, 0.9], False)
    assert cfg.steps == TASK_PROFILE["steps"]  # no data file: the built-in task's profile fills the rest
    assert not print_config and not overwrite and set(given) == {"lr", "batch_size", "lora_r", "betas", "async_step"}


def test_data_file_uses_plain_defaults(tmp_path) -> None:
    data = write(tmp_path / "d.txt", "hello")
    cfg = parse_train_args(["--data", data]).cfg
    assert cfg.lr == TrainConfig.lr and cfg.steps is None and cfg.plan == "auto"


def test_print_config_shows_merged_yaml(tmp_path, capsys) -> None:
    cfg_file = write(tmp_path / "c.yaml", "seed: 7\n")
    assert main(["train", "--config", cfg_file, "--lora-targets", "q_proj", "v_proj", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["seed"] == 7 and shown["lora_targets"] == ["q_proj", "v_proj"] and shown["task"] == "reverse"
    assert set(shown) == set(TrainConfig().to_dict())


@pytest.mark.parametrize(
    "args, yaml_text, expect",
    [
        ([], "lerning_rate: 0.1\n", "unknown config key 'lerning_rate'"),
        ([], "lr: [1, 2\n", "is not valid YAML"),
        (["--data", "/nonexistent/train.jsonl"], None, "data file '/nonexistent/train.jsonl' not found"),
        (["--batch-size", "2", "--microbatches", "4"], None, "batch_size=2 is smaller than microbatches=4"),
        (["--lr", "fast"], None, "lr='fast' is not a number"),
        (["--dtype", "float8"], None, "dtype='float8' is not supported"),
        (["--frobnicate"], None, "unrecognized arguments: --frobnicate"),
        (["--task", "sudoku"], None, "unknown task 'sudoku'"),
        (["--steps", "10", "--stop-at", "20"], None, "stop_at=20 is after the last step"),
        (["--stage-inputs", "fp16"], None, "stage_inputs='fp16' is not a choice"),
    ],
)
def test_user_errors_are_one_line_with_a_fix(tmp_path, capsys, args, yaml_text, expect) -> None:
    if yaml_text is not None:
        args = ["--config", write(tmp_path / "c.yaml", yaml_text)] + args
    assert main(["train"] + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("roundpipe: error: ") and expect in err[0] and " — " in err[0], err[0]


def test_help_lists_every_key(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert all("--" + name.replace("_", "-") in text for name in TrainConfig().to_dict())


def test_every_key_is_documented() -> None:
    path = os.path.join(ROOT, "docs", "training.md")
    with open(path) as f:
        text = f.read()
    assert [k for k in TrainConfig().to_dict() if f"| `{k}` |" not in text] == []


def test_config_error_names_a_fix() -> None:
    with pytest.raises(ConfigError) as info:
        parse_train_args(["--config", "/nonexistent.yaml"])
    assert info.value.fix == "pass an existing YAML file to --config"


def test_console_script_no_traceback(tmp_path) -> None:
    """The installed entry point (python -m roundpipe) exits 2 with one line for a model error found
    after start-up (seq_len above the model's limit), not with a traceback."""
    data = write(tmp_path / "d.txt", "some text " * 50)
    env = {**os.environ, "RPP_DEVICES": "cpu:1", "RPP_PROGRESS": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "roundpipe",
            "train",
            "--data",
            data,
            "--seq-len",
            "4096",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines == [
        "roundpipe: error: seq_len=4096 exceeds the model's limit (max_position_embeddings=1024) — add "
        "--rope-scaling yarn:4, or lower --seq-len to at most 1024"
    ], proc.stderr


def test_print_config_shows_the_values_the_run_uses(tmp_path, capsys) -> None:
    """Keys left to a default that depends on the model, the data or the devices show the value the
    run will use, not null."""
    assert main(["train", "--print-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["seq_len"], shown["steps"], shown["microbatches"], shown["warmup_steps"]) == (
        14,
        600,
        1,
        50,
    )  # the task's profile
    text = write(tmp_path / "d.txt", "".join(chr(97 + i % 26) for i in range(3000)))  # 3001 tokens: 5 rows of 512
    assert (
        main(
            [
                "train",
                "--print-config",
                "--data",
                text,
                "--batch-size",
                "2",
                "--devices",
                "cpu:2",
                "--warmup-steps",
                "7",
            ]
        )
        == 0
    )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["seq_len"], shown["steps"], shown["microbatches"], shown["warmup_steps"]) == (
        512,
        3,
        2,
        2,
    )  # warmup capped below steps
    assert "task" not in shown  # a data file replaces it: the output works as a --config file again
    assert parse_train_args(["--config", write(tmp_path / "c.yaml", yaml.safe_dump(shown))]).cfg.steps == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, code, expect",
    [
        (["train", "--help"], 0, "--lora-r"),
        (["export", "--help"], 0, "--merge-lora"),
        (["--version"], 0, "roundpipe 0.1.0"),
        (["train", "--version"], 0, "roundpipe 0.1.0"),
        (["train", "--lr", "-1e-3"], 2, "lr=-0.001 must be positive"),
        (["train", "--batch-size", "2", "--microbatches", "4"], 2, "batch_size=2 is smaller than microbatches=4"),
    ],
)
def test_help_version_and_config_errors_answer_without_torch(tmp_path, args, code, expect) -> None:
    """Answered before torch (or transformers) is imported: well under a second alone; 3 s allows for a
    loaded CI machine, where importing torch alone takes longer."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "roundpipe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        cwd=str(tmp_path),
    )
    seconds = time.monotonic() - start
    assert proc.returncode == code, proc.stderr[-2000:]
    assert expect in proc.stdout + proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "roundpipe.cli" in imported and not imported & {"torch", "transformers", "numpy"}, sorted(
        imported & {"torch", "transformers", "numpy"}
    )
    assert seconds < 3.0, f"{args} took {seconds:.1f} s"
