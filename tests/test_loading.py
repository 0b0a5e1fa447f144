"""The layer-by-layer loader against transformers and PEFT: a sharded checkpoint read into each base format
computes transformers' own logits (bf16 base: exactly; quantized: exactly those of a model whose weights are
the dequantized ones), LoRA starts where ``get_peft_model`` starts under the same seed, bad checkpoints get
one clear error, random weights build without a bf16 copy, and loading into NF4 stays near the final footprint
(tests/test_loading_memory.py)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from roundpipe.host.formats import FrozenWeight
from roundpipe.loading import LoadError, build_random, load_pretrained
from roundpipe.models.configs import tiny_config

#: Small shards: each decoder layer spans files, so the index and the per-file reads are exercised.
SHARD = "20KB"


def write_checkpoint(path: str, family: str, tie: bool, **fields: Any) -> str:
    """A tiny model of ``family`` (random init, seed 0) saved as sharded safetensors in fp32."""
    torch.manual_seed(0)
    config = tiny_config(family, tie_word_embeddings=tie, hidden_size=64, intermediate_size=128, **fields)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, max_shard_size=SHARD)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    """An untied Llama and a tied Qwen3, both sharded."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": write_checkpoint(str(root / "llama"), "llama", tie=False),
        "qwen3": write_checkpoint(str(root / "qwen3"), "qwen3", tie=True),
    }


IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 4], [3, 3, 64, 12, 90, 11, 0, 8]])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_bf16_base_load_computes_transformers_logits(checkpoints: Dict[str, str], family: str, dtype: Any) -> None:
    path = checkpoints[family]
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    want_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    got_model = load_pretrained(path, "bf16", None, dtype)
    with torch.no_grad():
        assert torch.equal(got_model(input_ids=IDS).logits, want_model(input_ids=IDS).logits)
    got, want = dict(got_model.named_buffers()), dict(want_model.named_buffers())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # rotary inv_freq
    tied = got_model.lm_head.weight is got_model.model.embed_tokens.weight
    assert tied == (family == "qwen3")


@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_a_quantized_base_computes_the_dequantized_models_logits(checkpoints: Dict[str, str], fmt: str) -> None:
    """Through RoundPipe on a CPU worker (a FrozenWeight has no host matmul), in float64."""
    import roundpipe

    path, dtype = checkpoints["llama"], torch.float64
    lora = lambda: LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")  # noqa: E731
    torch.manual_seed(3)
    model = load_pretrained(path, fmt, lora(), dtype)
    frozen = {n: p for n, p in model.named_parameters() if isinstance(p, FrozenWeight)}
    assert len(frozen) == 3 * 7 and all(not p.requires_grad for p in frozen.values())  # the head stays plain
    torch.manual_seed(3)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lora()).eval()
    params = dict(ref.named_parameters())
    for name, w in frozen.items():  # the loader's packing is FrozenWeight.quantize of transformers' weight
        packed = FrozenWeight.quantize(params[name].detach(), fmt).packed
        assert all(torch.equal(w.packed[k], packed[k]) for k in packed), name
    with torch.no_grad():
        for name, w in frozen.items():
            params[name].copy_(w.dequantize())
        want = ref(input_ids=IDS).logits
        got = roundpipe.wrap_model_to_roundpipe(model, base_format=fmt)(input_ids=IDS).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "init, dtype, bias",
    [(True, torch.bfloat16, False), ("gaussian", torch.float64, False), (False, torch.float32, True)],
)
def test_lora_starts_where_peft_starts(checkpoints: Dict[str, str], init: Any, dtype: Any, bias: bool) -> None:
    """Same seed, same adapters, bit for bit: the draws of ``get_peft_model`` on a materialized model, in its
    order and dtypes (fp32 draws, cast to the base dtype, bf16 upcast to fp32)."""
    path = checkpoints["qwen3"]
    lora = lambda: LoraConfig(  # noqa: E731
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=init, lora_bias=bias
    )
    torch.manual_seed(11)
    want = dict(get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lora()).named_parameters())
    after_peft = torch.rand(2)
    torch.manual_seed(11)
    got = dict(load_pretrained(path, "bf16", lora(), dtype).named_parameters())
    assert torch.equal(torch.rand(2), after_peft)  # the same draws, no more
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert (p.dtype, p.requires_grad) == (got[name].dtype, got[name].requires_grad), name
        assert torch.equal(p, got[name]), name


def test_expert_lora_starts_where_peft_starts(tmp_path) -> None:
    """LoRA on a mixture of experts' 3-D expert weights (``target_parameters``): PEFT stacks r rows per expert
    (``lora_A`` [r x experts, in]); the loader draws the same adapters, bit for bit, as ``get_peft_model``."""
    path = write_checkpoint(str(tmp_path / "oss"), "gpt_oss", tie=False)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = lambda: LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=experts)  # noqa: E731
    torch.manual_seed(5)
    want = dict(
        get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora()).named_parameters()
    )
    torch.manual_seed(5)
    got = dict(load_pretrained(path, "bf16", lora(), torch.float32).named_parameters())
    assert got.keys() == want.keys()
    stacked = [n for n in want if "experts" in n and "lora_A" in n]
    assert stacked and all(want[n].shape[0] == 2 * 4 for n in stacked)  # r x num_local_experts of tiny_config
    for name, p in want.items():
        assert p.shape == got[name].shape and torch.equal(p, got[name]), name


def test_lora_settings_the_loader_cannot_reproduce_are_refused(checkpoints: Dict[str, str]) -> None:
    path = checkpoints["llama"]
    with pytest.raises(LoadError, match="init_lora_weights='pissa'.*use init_lora_weights=True"):
        load_pretrained(path, "nf4", LoraConfig(r=4, target_modules="all-linear", init_lora_weights="pissa"))
    with pytest.raises(LoadError, match="use_dora=True.*set use_dora=False"):
        load_pretrained(path, "nf4", LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    with pytest.raises(LoadError, match="without lora every weight trains"):
        load_pretrained(path, "nf4", None)
    with pytest.raises(ValueError, match="base_format='nf5'"):
        load_pretrained(path, "nf5", LoraConfig(r=4, target_modules="all-linear"))


def _edit_index(path: str, edit: Any) -> None:
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    edit(data["weight_map"])
    with open(index, "w") as f:
        json.dump(data, f)


def test_a_checkpoint_that_does_not_fit_gets_one_clear_error(checkpoints: Dict[str, str], tmp_path) -> None:
    def copy(name: str) -> str:
        return shutil.copytree(checkpoints["llama"], str(tmp_path / name))

    missing = copy("missing")
    _edit_index(missing, lambda m: m.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LoadError, match=r"has no tensor 'model.layers.1.mlp.up_proj.weight'.*pass the directory"):
        load_pretrained(missing)
    shape = copy("shape")
    with open(os.path.join(shape, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(shape, "config.json"), "w") as f:
        json.dump({**config, "intermediate_size": 96}, f)
    with pytest.raises(LoadError, match=r"model.layers.0.mlp.gate_proj.weight in .*model-000\d\d-of-000\d\d"):
        load_pretrained(shape)
    extra = copy("extra")
    with open(os.path.join(extra, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 2}, f)
    with pytest.raises(LoadError, match=r"holds 'model.layers.2.*that LlamaForCausalLM of this config has no place"):
        load_pretrained(extra)
    gone = copy("gone")
    os.remove(os.path.join(gone, "model-00002-of-" + sorted(os.listdir(gone))[-2].split("-of-")[1]))
    with pytest.raises(LoadError, match=r"lists model-00002-of-.*copy every shard"):
        load_pretrained(gone)
    with pytest.raises(LoadError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(str(tmp_path))
    with pytest.raises(LoadError, match="'qwen3_moe' is a mixture of experts.*wrap_model_to_roundpipe"):
        build_random(tiny_config("qwen3_moe"))


def test_random_weights_build_straight_into_the_format() -> None:
    """The frozen base drawn packed, the rest with the model's init, LoRA as PEFT's; RoundPipe runs it."""
    import roundpipe

    config = tiny_config("llama", hidden_size=64, intermediate_size=128)
    model = build_random(config, "nf4", LoraConfig(r=4, target_modules="all-linear"), torch.float32)
    hf = model.get_base_model()
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    frozen = [p for p in model.parameters() if isinstance(p, FrozenWeight)]
    assert len(frozen) == 3 * 7
    w = frozen[0].dequantize(dtype=torch.float32)
    assert 0.5 * config.initializer_range < w.std() < 1.5 * config.initializer_range
    assert torch.equal(hf.model.norm.weight, torch.ones(64))
    assert hf.model.embed_tokens.weight.std() > 0
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and all(p.dtype == torch.float32 and not p.any() for p in b)
    want = AutoModelForCausalLM.from_config(config).model.rotary_emb.inv_freq
    assert torch.equal(hf.model.rotary_emb.inv_freq, want)
    with torch.no_grad():
        logits = roundpipe.wrap_model_to_roundpipe(model, base_format="nf4")(input_ids=IDS).logits
    assert logits.shape == (2, 8, 128) and torch.isfinite(logits).all()


def test_from_pretrained_and_from_config_return_the_causal_lm_preset(checkpoints: Dict[str, str]) -> None:
    import roundpipe

    lora = LoraConfig(r=4, target_modules="all-linear")
    rp = roundpipe.from_pretrained(checkpoints["qwen3"], base_format="int8", lora=lora, dtype=torch.float32)
    assert type(rp).__name__ == "RoundPipeForCausalLM"
    rp2 = roundpipe.from_config(tiny_config("qwen3"), base_format="fp8", lora=lora, dtype=torch.float32)
    with torch.no_grad():
        assert rp(input_ids=IDS).logits.shape == rp2(input_ids=IDS).logits.shape == (2, 8, 128)
