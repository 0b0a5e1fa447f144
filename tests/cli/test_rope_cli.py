"""``--rope-scaling`` on ``roundpipe plan`` and ``roundpipe train``: a sequence past a model directory's limit is
planned and trained with the scaling, refused without it by one line naming both fixes; checkpoints and exports
carry the scaling in their config.json."""

from __future__ import annotations

import json
import os
from typing import List

import pytest
import torch

from roundpipe import flavors
from roundpipe.cli import main, plan
from roundpipe.cli.train import Recipe

from .local_model import make_local_model, word_tokenizer
from .test_plan import BUDGET, config_dir, one_line, qwen3_dir
from .test_train import compare_export, config


@pytest.fixture(autouse=True)
def _restore_process_state(restore_process_state: None) -> None:
    """The training test trains in this process (see conftest.restore_process_state)."""


def qwen3_8b_yarn_dir(root: str) -> str:
    """A Qwen3-8B-shaped config.json with YaRN x4 added as Qwen documents it (no weights: plan reads the config)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    shape = flavors.QWEN3["qwen3-8b"].config_fields()
    return config_dir(root, "qwen3-8b", model_type="qwen3", max_position_embeddings=40960, rope_scaling=yarn, **shape)


def test_plan_past_the_limit(tmp_path, capsys) -> None:
    model = qwen3_dir(tmp_path)  # max_position_embeddings 2048
    one_line(
        capsys, ["--model", model, "--seq-len", "8192", *BUDGET],
        "seq_len=8192 exceeds the model's limit (max_position_embeddings=2048) — add --rope-scaling yarn:4, or lower "
        "--seq-len to at most 2048",
    )  # fmt: skip
    assert plan.main(["--model", model, "--seq-len", "8192", "--rope-scaling", "yarn:4", *BUDGET]) == 0
    assert plan.main(["--model", model, "--seq-len", "4096", "--rope-scaling", "linear:2", *BUDGET]) == 0
    capsys.readouterr()
    one_line(capsys, ["--model", model, "--seq-len", "8192", "--rope-scaling", "yarn:2", *BUDGET], "yarn:4")
    for bad in ("yarn:0", "foo:2", "yarn:x"):
        one_line(
            capsys, ["--model", model, "--seq-len", "64", "--rope-scaling", bad],
            f"rope_scaling={bad!r} is not a rotary scaling — use yarn:F, linear:F, dynamic:F, llama3:F or none",
        )  # fmt: skip
    # The directory's own YaRN: Qwen3-8B reaches 131,072 tokens, and 262,144 wants a larger factor.
    qwen = qwen3_8b_yarn_dir(str(tmp_path))
    assert plan.main(["--model", qwen, "--seq-len", "131072", "--lora-r", "16", *BUDGET, "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["peak_gpu_bytes"] > 0
    one_line(
        capsys, ["--model", qwen, "--seq-len", "262144"],
        "exceeds the model's limit (131072: yarn factor 4 of original_max_position_embeddings=32768) — add "
        "--rope-scaling yarn:8",
    )  # fmt: skip
    assert plan.main(["--model", qwen, "--seq-len", "262144", "--rope-scaling", "yarn:8", *BUDGET, "--json"]) in (0, 1)


def words(n: int) -> str:
    tok_words = "what is the color of sky grass sun snow blue green yellow white it say hello hi please thanks".split()
    return " ".join(tok_words[i % len(tok_words)] for i in range(n))


def test_train_past_the_limit(tmp_path, capsys) -> None:
    """LoRA on a local model of 128 positions at 200 tokens: refused without scaling (one line, both fixes), trained
    with ``--rope-scaling yarn:2``; the checkpoint, its resume config and the export carry the scaling, and the
    export computes the trained model's logits past the original limit."""
    tok = word_tokenizer()
    model_dir = make_local_model(str(tmp_path / "model"), tok)
    data = tmp_path / "d.txt"
    data.write_text(words(2000))
    capsys.readouterr()  # what saving the model printed
    argv: List[str] = ["train", "--model", model_dir, "--data", str(data), "--seq-len", "200", "--devices", "cpu:1"]
    assert main([*argv, "--output-dir", str(tmp_path / "refused")]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert err == [
        "roundpipe: error: seq_len=200 exceeds the model's limit (max_position_embeddings=128) — add --rope-scaling "
        "yarn:2, or lower --seq-len to at most 128"
    ]
    assert main([*argv, "--rope-scaling", "yarn:0", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "rope_scaling='yarn:0' is not a rotary scaling — use yarn:F" in capsys.readouterr().err

    cfg = config(
        model=model_dir,
        data=str(data),
        seq_len=200,
        rope_scaling="yarn:2",
        batch_size=2,
        microbatches=2,
        steps=2,
        lora_r=4,
        output_dir=str(tmp_path / "run"),
    )
    recipe = Recipe(cfg, out=lambda msg: None)
    recipe.setup()
    result = recipe.train()
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
    for saved in (os.path.join(result.checkpoint, "hf"), None):
        if saved is None:
            compare_export(result, str(tmp_path / "export"), torch.tensor([tok(words(200))["input_ids"]]), atol=1e-5)
            saved = str(tmp_path / "export")
        with open(os.path.join(saved, "config.json")) as f:
            written = json.load(f)
        assert written["max_position_embeddings"] == 256, saved
        assert {k: written["rope_parameters"][k] for k in scaling} == scaling, saved
    with open(os.path.join(result.checkpoint, "config.yaml")) as f:
        assert "rope_scaling: yarn:2" in f.read()
