"""``roundpipe plan`` on a mixture of experts (Qwen3-MoE, GPT-OSS): the parameters it counts are the model's own
(every expert, the router, GPT-OSS's biases and sinks), its LoRA count is PEFT's over attention and the experts
(``target_parameters``), and what it does not model (a packed base, FP8, other mixtures) it refuses in one line."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from roundpipe.cli import plan

from .runner import roundpipe

BUDGET = ["--gpu-memory", "24GiB", "--host-memory", "128GiB"]


def moe_dir(root: Any, family: str) -> str:
    """A tiny ``family`` config written as a model directory (no weights: plan reads config.json alone)."""
    from roundpipe.models.configs import tiny_config

    path = os.path.join(str(root), family)
    tiny_config(family).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_counts_the_parameters_and_the_lora_adapters_of_the_model(tmp_path, family: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from roundpipe.models.configs import tiny_config

    shape, _ = plan.model_shape(moe_dir(tmp_path, family))
    config = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape.experts == 4 and shape.params() == sum(p.numel() for p in model.parameters())
    lora = LoraConfig(
        r=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, lora)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == config.num_hidden_layers * shape.lora_params(4)


def test_prints_the_experts_and_refuses_what_it_does_not_model(tmp_path) -> None:
    path = moe_dir(tmp_path, "gpt_oss")
    proc = roundpipe(["plan", "--model", path, "--seq-len", "256", *BUDGET], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "mixture of experts: 4 experts of width" in proc.stdout and "2 a token" in proc.stdout
    mixtral = os.path.join(str(tmp_path), "mixtral")
    os.makedirs(mixtral)
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=99)
    with open(os.path.join(mixtral, "config.json"), "w") as f:
        json.dump(dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, **fields), f)
    cases = [
        ([path, "--lora-r", "4", "--base-format", "nf4"], "is a mixture of experts, and the plan models a packed"),
        ([path, "--fp8"], "is a mixture of experts, and the plan models a packed base and FP8 GEMMs"),
        ([mixtral], "model_type 'mixtral': the mixtures of experts modelled are Qwen3-MoE and GPT-OSS"),
    ]
    for args, fragment in cases:
        proc = roundpipe(["plan", "--model", *args, "--seq-len", "256", *BUDGET], str(tmp_path))
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr
