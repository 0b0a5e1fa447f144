"""Rotary positions past a config's limit: the limit each scaling gives, the scaling a spec sets, the tables the
preset hands its decoder layers (against transformers' own rotary embedding built from the config.json a model
family ships), and a YaRN model trained past its pretrained length (against the Hugging Face model)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err

from roundpipe import models, rope_scaling
from roundpipe.models import configs
from roundpipe.runtime.run_config import RoundPipeRunConfig

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

ORIGINAL = 16
"""The tiny models' pretrained length (``max_position_embeddings`` before scaling)."""

FACTOR = 4

SHIPPED: Dict[str, Dict[str, Any]] = {
    "none": dict(max_position_embeddings=ORIGINAL),
    "linear": dict(max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "linear", "factor": FACTOR}),
    "dynamic": dict(max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": FACTOR}),
    # as Qwen documents YaRN: the pretrained length named, max_position_embeddings the stretched one
    "yarn": dict(
        max_position_embeddings=ORIGINAL * FACTOR,
        rope_scaling={"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL},
    ),
    # as Llama-3.1's config.json writes it
    "llama3": dict(
        max_position_embeddings=ORIGINAL * FACTOR,
        rope_scaling={
            "rope_type": "llama3",
            "factor": FACTOR,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
}
"""Per scaling type, the config fields a model directory carries when it ships with that scaling."""


def shipped_config(family: str, kind: str) -> Any:
    """The config transformers reads from a config.json written with :data:`SHIPPED`'s fields."""
    fields = {**configs.TINY, **SHIPPED[kind]}
    return configs.config_class(family).from_dict(fields)


def scaled_config(family: str, kind: str) -> Any:
    """A tiny config of ``ORIGINAL`` positions with the scaling set by :func:`rope_scaling.with_rope_scaling`."""
    spec = "none" if kind == "none" else f"{kind}:{FACTOR}"
    return models.with_rope_scaling(configs.tiny_config(family, max_position_embeddings=ORIGINAL), spec)


# ---------------------------------------------------------------------------------------------------------
# The limit and the spec
# ---------------------------------------------------------------------------------------------------------


def test_limits_of_released_configs() -> None:
    """The limit of the configs as the families ship them, read from the dict and through transformers alike."""
    qwen3_yarn = {
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    llama31 = {
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    linear = {"model_type": "llama", "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2}}
    plain = {"model_type": "qwen3", "max_position_embeddings": 40960, "rope_scaling": None}
    for config, want in ((qwen3_yarn, 131072), (llama31, 131072), (linear, 8192), (plain, 40960)):
        assert rope_scaling.position_limit(json.loads(json.dumps(config))) == want
        read = transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))
        assert rope_scaling.position_limit(read) == want, config
    assert rope_scaling.describe_limit(qwen3_yarn) == "131072: yarn factor 4 of original_max_position_embeddings=32768"


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_spec_sets_what_the_family_ships(kind: str) -> None:
    """``with_rope_scaling(config, "yarn:4")`` gives the config a directory shipped with that scaling has, on a
    ``PretrainedConfig`` and on a config.json dict; it survives save_pretrained."""
    got, want = scaled_config("qwen3", kind), shipped_config("qwen3", kind)
    assert got.rope_parameters == want.rope_parameters
    assert got.max_position_embeddings == want.max_position_embeddings
    assert rope_scaling.position_limit(got) == ORIGINAL * FACTOR
    raw = {**configs.TINY, "max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
    rope_scaling.with_rope_scaling(raw, f"{kind}:{FACTOR}")
    assert rope_scaling.position_limit(raw) == ORIGINAL * FACTOR
    assert raw["rope_parameters"] == got.rope_parameters
    reread = configs.config_class("qwen3").from_dict(json.loads(got.to_json_string()))
    assert reread.rope_parameters == got.rope_parameters and rope_scaling.position_limit(reread) == ORIGINAL * FACTOR
    back = rope_scaling.with_rope_scaling(got, "none")
    assert back.rope_parameters["rope_type"] == "default" and rope_scaling.position_limit(back) == ORIGINAL


@pytest.mark.parametrize("spec", ["yarn:0", "foo:2", "yarn:x", "yarn", "linear:0.5", ""])
def test_bad_specs_name_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        rope_scaling.parse_spec(spec)
    assert str(info.value) == f"rope scaling {spec!r} is not one of {rope_scaling.SPEC_FORMS}"
    assert "\n" not in str(info.value)


def test_fitting_factor() -> None:
    """The suggested YaRN factor: the sequence over the pretrained length, up to a power of two."""
    qwen3 = {"max_position_embeddings": 40960}
    assert [rope_scaling.fitting_factor(qwen3, n) for n in (40961, 131072, 163840, 262144)] == [2, 4, 4, 8]


# ---------------------------------------------------------------------------------------------------------
# The tables the decoder layers get
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "linear", "dynamic", "yarn", "llama3"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tables_equal_transformers(family: str, kind: str) -> None:
    """The cos / sin (YaRN's attention scaling in them) the preset's prefix hands the fused and tiled decoder
    layers, at positions past the pretrained length (the whole sequence, and a tile of it by its positions),
    equal the rotary embedding of the Hugging Face model shipped with that scaling."""
    torch.manual_seed(0)
    seq = ORIGINAL * FACTOR if kind != "none" else ORIGINAL
    model = transformers.AutoModelForCausalLM.from_config(scaled_config(family, kind)).double()
    reference = transformers.AutoModelForCausalLM.from_config(shipped_config(family, kind)).double()
    prefix = models.build_preset(model).layers[0]
    ids = torch.randint(1, configs.TINY["vocab_size"], (2, seq))
    x = prefix.embed_tokens(ids)
    positions = torch.arange(seq).unsqueeze(0)
    want = reference.model.rotary_emb(x, positions)
    first = prefix(input_ids=ids)["position_embeddings"]
    again = prefix(input_ids=ids)["position_embeddings"]  # kept for the length, but for dynamic NTK
    assert all(a is b for a, b in zip(first, again)) == (kind != "dynamic")
    assert all(torch.equal(a, b) for got in (first, again) for a, b in zip(got, want)), kind
    tile = torch.arange(seq // 2, seq).unsqueeze(0).expand(2, -1)
    got = prefix(input_ids=ids[:, seq // 2 :], position_ids=tile)["position_embeddings"]
    assert all(torch.allclose(a, b[:, seq // 2 :].expand_as(a), rtol=0, atol=1e-12) for a, b in zip(got, want))
    scaling = reference.model.rotary_emb.attention_scaling
    assert torch.allclose(want[0][0, 0], torch.full_like(want[0][0, 0], scaling))  # cos(0) times the scaling
    assert (scaling > 1) == (kind == "yarn")
    if kind != "none":  # the scaling changed the tables past the pretrained length
        plain = transformers.AutoModelForCausalLM.from_config(shipped_config(family, "none")).double()
        assert not torch.allclose(plain.model.rotary_emb(x, positions)[0], want[0])


# ---------------------------------------------------------------------------------------------------------
# Training past the pretrained length
# ---------------------------------------------------------------------------------------------------------


def _grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("tiles", [1, 2])
def test_yarn_model_trains_past_its_pretrained_length(workers: str, tiles: int) -> None:
    """A tiny Qwen3 given YaRN x4 by the Python call, trained by RoundPipe on CPU workers at 3x its pretrained
    length (whole, and as two tiles of one sequence): loss and every gradient equal the Hugging Face model's."""
    torch.manual_seed(0)
    config = models.with_rope_scaling(configs.tiny_config("qwen3", max_position_embeddings=ORIGINAL), "yarn:4")
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    seq = 3 * ORIGINAL
    ids = torch.randint(1, configs.TINY["vocab_size"], (2, seq))
    batch = dict(input_ids=ids, labels=ids)
    logits = model(input_ids=ids).logits  # the loss in float64 (transformers' own takes it in float32)
    vocab = logits.shape[-1]
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    ref_loss.backward()
    ref = _grads(model)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=1 if tiles > 1 else 2))
    loss = rp.train_step(**batch, run_config=RoundPipeRunConfig(sequence_tiles=tiles))
    assert rel_err(loss, ref_loss) < 1e-10
    got = _grads(model)
    assert got.keys() == ref.keys()
    for name, grad in ref.items():
        assert rel_err(got[name], grad) < 1e-10, name


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_past_the_limit_without_scaling_is_refused(workers: str) -> None:
    """Unscaled, a sequence past the limit is one error naming both fixes as Python calls, before any job."""
    model = transformers.AutoModelForCausalLM.from_config(
        configs.tiny_config("qwen3", max_position_embeddings=ORIGINAL)
    )
    rp = models.wrap_model(model)
    ids = torch.randint(1, configs.TINY["vocab_size"], (1, 3 * ORIGINAL))
    with pytest.raises(ValueError) as info:
        rp.train_step(input_ids=ids, labels=ids)
    assert str(info.value) == (
        "seq_len=48 exceeds the model's limit (max_position_embeddings=16) — scale its rotary positions with "
        "roundpipe.models.with_rope_scaling(config, 'yarn:4') before from_pretrained(..., config=config), or use "
        "sequences of at most 16 tokens"
    )
    assert all(p.grad is None for p in model.parameters())
