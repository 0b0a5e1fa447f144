"""LoRA (PEFT) through the presets: adapter gradients equal PEFT's, adapters save, training learns."""

from __future__ import annotations

import os

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err, with_lora
from test_models import TOL, assert_grads_close, emulate_forward, grads, make_batch, tiny_model
from torch import nn

from roundpipe import models
from roundpipe.runtime.run_config import RoundPipeRunConfig

peft = pytest.importorskip("peft")

# Attention + MLP adapters; the second variant also adapts the (untied) lm_head, so the loss takes the
# checkpointed per-chunk path for a non-Linear head.
TARGETS = {
    "qwen3": ["q_proj", "v_proj", "down_proj"],
    "llama": ["k_proj", "o_proj", "up_proj", "lm_head"],
}
RUN3 = RoundPipeRunConfig(num_microbatch=3)


def lora_model(family: str, seed: int = 0) -> nn.Module:
    return with_lora(tiny_model(family, seed), TARGETS[family], seed=seed + 1)


def peft_reference(peft_model: nn.Module, batch):
    out = peft_model(**{k: v for k, v in batch.items() if v is not None})
    out.loss.backward()
    return out.loss.detach(), grads(peft_model)


def trainable(model: nn.Module):
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lora_grads_match_peft_emulated(family: str) -> None:
    peft_model = lora_model(family)
    batch = make_batch(padding=True)
    ref_loss, ref_grads = peft_reference(peft_model, batch)
    assert set(ref_grads) == trainable(peft_model) and all("lora_" in n for n in ref_grads)
    preset = models.build_preset(peft_model)
    if "lm_head" in TARGETS[family]:
        assert type(preset.layers[-1].lm_head) is not nn.Linear  # LoRA-wrapped head: checkpointed chunks
    out = preset.build_output(emulate_forward(preset.layers, preset.forward_kwargs(**batch), 3))
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(peft_model), ref_grads)  # same keys: frozen weights get no gradient


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lora_grads_match_peft_roundpipe(workers: str, family: str) -> None:
    peft_model = lora_model(family)
    batch = make_batch(padding=True)
    ref_loss, ref_grads = peft_reference(peft_model, batch)
    rp = models.wrap_model(peft_model, model_run_config=RUN3)
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(peft_model), ref_grads)
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(peft_model), ref_grads)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_lora_save_pretrained_through_shim(workers: str, tmp_path) -> None:
    peft_model = lora_model("qwen3")
    rp = models.wrap_model(peft_model, model_run_config=RUN3)
    rp.save_pretrained(tmp_path)  # PeftModel.save_pretrained: the adapter only
    assert (tmp_path / "adapter_config.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    batch = make_batch(padding=True)
    del batch["labels"]
    base = tiny_model("qwen3")  # same seed: same base weights
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        ref = peft_model.eval()(**batch).logits
        assert rel_err(reloaded(**batch).logits, ref) < TOL


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_lora_training_lowers_loss(workers: str) -> None:
    """30 steps of AdamW on the adapter parameters only (base weights untouched)."""
    peft_model = lora_model("qwen3")
    frozen = {n: p.detach().clone() for n, p in peft_model.named_parameters() if not p.requires_grad}
    rp = models.wrap_model(peft_model, model_run_config=RUN3)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = make_batch(padding=True)
    losses = []
    for _ in range(30):
        losses.append(rp.train_step(**batch).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in peft_model.named_parameters() if n in frozen)
