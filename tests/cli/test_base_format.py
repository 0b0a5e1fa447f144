"""``roundpipe train --base-format``: the flag's checks, and a LoRA run over an NF4 base that resumes exactly
and exports a merged bf16 checkpoint equal to PEFT's merge over the dequantized base."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from roundpipe.cli.checkpoint import load_tensors
from roundpipe.cli.config import ConfigError, merge
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.export import export
from roundpipe.cli.train import run

from .local_model import chat_rows, make_local_model, word_tokenizer


@pytest.fixture(autouse=True)
def _restore_process_state(restore_process_state: None) -> None:
    """The run below trains in this process (see conftest.restore_process_state)."""


def test_the_flag_names_its_choices_and_needs_lora() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_train_args(["--base-format", "nf4"])
    assert "lora_r=0" in exc.value.what and "--lora-r" in exc.value.fix
    with pytest.raises(ConfigError) as exc:
        merge({}, dict(base_format="nf5", lora_r=4))
    assert "nf5" in exc.value.what and "did you mean 'nf4'" in exc.value.what
    assert "bf16, fp8, int8, nf4" in exc.value.fix
    assert parse_train_args(["--base-format", "fp8", "--lora-r", "4"]).cfg.base_format == "fp8"


def _config(tmp_path: Any, model_dir: str, out: str, **keys: Any) -> Any:
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in chat_rows()) + "\n")
    fields = dict(model=model_dir, data=str(data), seq_len=24, pack=False, batch_size=4, microbatches=2, steps=4)
    fields.update(lr=3e-2, warmup_steps=0, lora_r=4, base_format="nf4", devices="cpu:1", output_dir=out)
    return merge({}, {**fields, "log_every": 1000, "eval_examples": 0, **keys})


def test_an_nf4_base_run_resumes_exactly_and_exports_merged(tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from roundpipe.host.formats import FrozenWeight

    model_dir = make_local_model(str(tmp_path / "model"), word_tokenizer(), tie=False)
    full = run(_config(tmp_path, model_dir, str(tmp_path / "full")), out=lambda m: None)
    frozen = {n: p for n, p in full.model.hf_model.named_parameters() if isinstance(p, FrozenWeight)}
    assert frozen and all(".base_layer." in n for n in frozen)
    # A quantized base's checkpoint holds the adapters alone: the base is rebuilt from the model directory.
    weights = load_tensors(os.path.join(full.checkpoint, "model.safetensors"))
    assert weights and all("lora_" in n for n in weights)
    run(_config(tmp_path, model_dir, str(tmp_path / "split"), stop_at=2), out=lambda m: None)
    second = run(*parse_train_args(["--resume", "--output-dir", str(tmp_path / "split")])[::2], out=lambda m: None)
    again = load_tensors(os.path.join(second.checkpoint, "model.safetensors"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)

    out = str(tmp_path / "merged")
    export(full.checkpoint, out)
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    got = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    # PEFT's merge over a plain model whose base weights are the dequantized ones.
    with open(os.path.join(full.checkpoint, "source.json")) as f:
        dtype = getattr(torch, json.load(f)["dtype"])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    ref = get_peft_model(ref, LoraConfig.from_pretrained(os.path.join(full.checkpoint, "lora")))
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in frozen.items():
            params[name].copy_(w.dequantize())
        for name, t in weights.items():
            params[name].copy_(t)
    want = ref.merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)

    adapter = str(tmp_path / "adapter")
    export(full.checkpoint, adapter, merge_lora=False)
    saved = load_tensors(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(saved) == len(weights) and all("lora_" in k for k in saved)


def test_a_builtin_over_an_int8_base_exports_what_it_computes(tmp_path) -> None:
    """A built-in's random base is drawn from the run's seed, so export rebuilds the same one: the merged
    export computes the trained model's logits."""
    from transformers import AutoModelForCausalLM

    cfg = merge({}, dict(model="tiny", lora_r=4, base_format="int8", steps=2, batch_size=4, devices="cpu:1"))
    cfg = merge({}, {**cfg.to_dict(), "output_dir": str(tmp_path / "run"), "log_every": 1000, "eval_examples": 0})
    result = run(cfg, out=lambda m: None)
    export(result.checkpoint, str(tmp_path / "merged"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True).eval()
    ids = torch.tensor([list(b"abcdef>")] * 2)
    with torch.no_grad():
        want, got = result.model.logits(ids), hf(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
