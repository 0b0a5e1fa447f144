"""wrap_model_to_roundpipe: presets where they exist, otherwise wrapping submodules by size."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err, wrap_by_size
from test_models import TOL, assert_grads_close, grads, make_batch, tiny_model
from torch import nn

from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig
from roundpipe.models.causal_lm import RoundPipeForCausalLM
from roundpipe.wrapper import wrap_model_to_roundpipe

BLOCK_BYTES = (32 * 32 + 32) * 4  # 4224


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Toy(nn.Module):
    """embed (1152 B) -> ModuleList of 4 blocks -> Sequential of 3 blocks -> head (528 B)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.trunk = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.trunk(h))


def run(model: nn.Module, x: torch.Tensor):
    out = model(x)
    out.square().mean().backward()
    return out.detach(), grads(model)


workers2 = pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)


@workers2
def test_wraps_by_size(workers: str) -> None:
    toy = Toy()
    ref_model = copy.deepcopy(toy)
    trunk_config = RoundPipeRunConfig(num_microbatch=2)
    skipped = toy.blocks[2]
    wrapped = wrap_model_to_roundpipe(
        toy,
        lower_threshold=1000,
        upper_threshold=BLOCK_BYTES + 1,
        skip_modules=[skipped],
        override_config={toy.trunk: trunk_config},
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
        name="toy",
    )
    assert isinstance(wrapped, AutoRoundPipe) and wrapped.model is toy
    assert isinstance(toy.embed, RoundPipe) and toy.embed.name == "toy.embed"
    assert [isinstance(b, RoundPipe) for b in toy.blocks] == [True, True, False, True]
    assert toy.blocks[2] is skipped
    assert isinstance(toy.trunk, RoundPipe) and toy.trunk.num_layers == 3  # streamed child by child
    assert toy.trunk.model_run_config is trunk_config
    assert toy.blocks[0].model_run_config.num_microbatch == 3
    assert type(toy.head) is nn.Linear  # under lower_threshold: stays on the host

    x = torch.randn(6, 5, 8)
    out, g = run(wrapped, x)
    ref_out, ref_g = run(ref_model, x)
    assert rel_err(out, ref_out) < TOL
    rename = lambda n: n.replace(".model.", ".").replace("model.", "", 1)  # noqa: E731
    assert_grads_close({rename(n): v for n, v in g.items()}, ref_g)
    # Every trainable parameter is in the optimizer view, once.
    assert len(list(wrapped.optim_parameters())) == len(list(ref_model.parameters()))


@workers2
def test_root_that_fits_is_one_roundpipe(workers: str) -> None:
    seq = nn.Sequential(Block(), Block())
    ref_model = copy.deepcopy(seq)
    wrapped = wrap_model_to_roundpipe(seq, lower_threshold=0, upper_threshold=10 * BLOCK_BYTES)
    assert isinstance(wrapped, RoundPipe) and wrapped.num_layers == 2
    x = torch.randn(4, 32)
    assert rel_err(wrapped(x), ref_model(x)) < TOL


@workers2
def test_default_upper_threshold_splits_by_device_count(workers: str) -> None:
    toy = Toy()
    # upper = 31248 B / 3 with two workers: the root (31 KB) and the trunk (12.7 KB) exceed it; the trunk
    # is still one RoundPipe because each of its children fits.
    wrapped = wrap_model_to_roundpipe(toy, lower_threshold=0)
    assert isinstance(wrapped, AutoRoundPipe)
    assert isinstance(toy.trunk, RoundPipe) and toy.trunk.num_layers == 3
    assert not isinstance(toy.blocks, RoundPipe) and all(isinstance(b, RoundPipe) for b in toy.blocks)


@workers2
def test_skipped_descendant_prevents_wrapping_the_ancestor(workers: str) -> None:
    toy = Toy()
    wrap_model_to_roundpipe(toy, lower_threshold=0, upper_threshold=10**9, skip_modules=[toy.trunk[1]])
    assert isinstance(toy.embed, RoundPipe) and isinstance(toy.blocks[0], RoundPipe)
    assert not isinstance(toy.trunk, RoundPipe) and type(toy.trunk[1]) is Block
    assert isinstance(toy.trunk[0], RoundPipe) and isinstance(toy.head, RoundPipe)


def test_preset_required_but_missing_raises() -> None:
    with pytest.raises(NotImplementedError, match="Toy"):
        wrap_model_to_roundpipe(Toy(), use_sequential_preset=True)


@workers2
def test_hf_model_uses_preset(workers: str) -> None:
    model = tiny_model("qwen3")
    wrapped = wrap_model_to_roundpipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert isinstance(wrapped, RoundPipeForCausalLM)
    assert wrapped.num_layers == model.config.num_hidden_layers + 2


@workers2
def test_hf_model_without_preset_wrapped_by_size(workers: str) -> None:
    """use_sequential_preset=False: decoder layers become RoundPipes called by the HF forward."""
    model = tiny_model("llama")
    ref_model = copy.deepcopy(model)
    batch = make_batch(padding=True)
    wrapped = wrap_by_size(model, 3)
    assert isinstance(wrapped, AutoRoundPipe)
    assert all(isinstance(layer, RoundPipe) for layer in model.model.layers)
    out = wrapped(**batch)
    ref = ref_model(**batch)
    assert rel_err(out.loss, ref.loss) < TOL
    out.loss.backward()
    ref.loss.backward()
    got = {n.replace(".model.", "."): g for n, g in grads(model).items()}
    assert_grads_close(got, grads(ref_model))
    assert wrapped.config is model.config
