"""LoRA on a mixture of experts' expert weights as PEFT defines it (``LoraConfig(target_parameters=...)``, which
wraps the fused 3-D ``gate_up_proj`` / ``down_proj`` parameters of transformers' experts): the adapters train
through RoundPipe with PEFT's own modules, their gradients equal to a plain PEFT model's in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from test_formats import _grads
from test_models import make_batch

from roundpipe import models
from roundpipe.models.configs import tiny_config
from roundpipe.runtime.run_config import RoundPipeRunConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model() -> torch.nn.Module:
    """A tiny Qwen3-MoE (eager experts: grouped_mm has no float64) with LoRA r4 on q / v and on the experts,
    every B drawn nonzero (PEFT starts them at zero, which would leave every A gradient zero)."""
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", experts_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS)
    model = peft.get_peft_model(model, lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize(
    "workers,microbatches,grain", [("cpu:2", 2, "stage"), ("cpu:1", 3, "layer")], indirect=["workers"]
)
def test_expert_lora_gradients_equal_peft(workers: str, microbatches: int, grain: str) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    batch = make_batch(padding=True)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:].reshape(-1)
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels)
    ref_loss.backward()
    ref_grads = _grads(ref)
    expert_adapters = [n for n in ref_grads if ".experts." in n]
    assert len(expert_adapters) == 2 * 2 * model.config.num_hidden_layers  # A and B of both expert parameters
    config = RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=grain)
    loss = models.wrap_model(model, model_run_config=config).train_step(**batch)
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and all("lora_" in n for n in got)
    assert abs(float(loss) - ref_loss.item()) < 1e-10
    for n in ref_grads:
        assert (got[n] - ref_grads[n]).abs().max() <= 1e-10 * ref_grads[n].abs().max(), n
