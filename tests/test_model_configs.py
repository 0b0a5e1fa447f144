"""``roundpipe.models.configs``: the tiny and the named configs tests and benchmarks build from one place."""

from __future__ import annotations

import pytest
import torch

from roundpipe import flavors
from roundpipe.cli.model_names import BUILTIN_MODELS
from roundpipe.models import configs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sorted(configs.CONFIG_CLASSES))
def test_tiny_config_of_every_family_builds_a_small_model(family: str) -> None:
    """Each family's tiny config is of its own class, with the shared sizes and its MoE extras; the model
    it builds runs a forward on a few tokens."""
    config = configs.tiny_config(family)
    assert type(config).__name__ == configs.CONFIG_CLASSES[family] and config.model_type == family
    for key, value in {**configs.TINY, **configs.TINY_MOE.get(family, {})}.items():
        assert getattr(config, key) == value, key
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    assert sum(p.numel() for p in model.parameters()) < 200_000
    ids = torch.randint(1, config.vocab_size, (2, 6))
    assert model(input_ids=ids).logits.shape == (2, 6, config.vocab_size)


def test_overrides_win_and_unknown_families_are_named() -> None:
    config = configs.tiny_config("llama", num_hidden_layers=1, hidden_size=16, head_dim=4, attn_implementation="sdpa")
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (1, 16, 4)
    assert config._attn_implementation == "sdpa" and config.intermediate_size == configs.TINY["intermediate_size"]
    with pytest.raises(KeyError, match="known: .*'qwen3'"):
        configs.tiny_config("gpt2")


@pytest.mark.parametrize("name", sorted(flavors.QWEN3))
def test_flavor_config_has_the_flavor_sizes(name: str) -> None:
    """The benchmark's config of a named size, and the CLI's built-in of the same name, carry the
    flavor's sizes."""
    flavor = flavors.QWEN3[name]
    config = configs.flavor_config(name, num_hidden_layers=1)
    assert isinstance(config, transformers.Qwen3Config) and config.num_hidden_layers == 1
    fields = flavor.config_fields()
    assert fields["num_hidden_layers"] == flavor.layers
    for key, value in fields.items():
        if key != "num_hidden_layers":
            assert getattr(config, key) == value, key
    assert config.max_position_embeddings == 40960 and not config.use_cache
    assert fields.items() <= BUILTIN_MODELS[name].items()  # every flavor is a built-in of `roundpipe train`
