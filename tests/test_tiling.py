"""Sequence tiling inside decoder layers (roundpipe.models.tiling) computes what the untiled layer does.

* one layer, tiled vs Hugging Face's forward, fp64: output, input gradient, every parameter gradient
  (Qwen3 / Llama, plain, fused-kernel modules, LoRA, padding and sliding-window masks, uneven tiles),
  also as a recompute whose output is deferred and filled by the next stage;
* whole models through RoundPipe (CPU workers, both recompute grains, stages of several layers) vs the
  plain Hugging Face / PEFT model in fp64: loss and every gradient to 1e-10;
* the memory bound: inside a tiled layer no tensor of ``intermediate_size`` columns has more rows than
  one tile, forward and backward, and the graph saves no such tensor;
* dropout per tile replays its masks in backward (gradcheck), the RNG state is given back;
* fallbacks (hooks, other families, short sequences, the setting off) and the setting's validation.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import LORA_PROJECTIONS, rel_err, with_lora
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe import models, settings
from roundpipe.models import configs, fused_ops, kernels, tiling
from roundpipe.models.preset import _call_mask_function
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.runtime.context import RecomputeCtx
from roundpipe.runtime.run_config import RoundPipeRunConfig

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_models import grads, make_batch, tiny_model  # noqa: E402

TOL = 1e-10  # fp64: tiling changes only which rows a matmul computes at once


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _layer_config(family: str, layer_type: str = "full_attention") -> Any:
    """One layer, hidden 32, MLP 96, vocab 64, sdpa; a Qwen3 sliding-window layer's window is 5."""
    sliding = dict(layer_types=[layer_type], sliding_window=5, use_sliding_window=True) if family == "qwen3" else {}
    sizes = dict(intermediate_size=96, num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa")
    return configs.tiny_config(family, **sizes, **sliding)


def _make_layer(
    family: str, lora: bool = False, dropout: float = 0.0, layer_type: str = "full_attention"
) -> Tuple[nn.Module, nn.Module]:
    """A one-layer fp64 model with non-trivial weights (LoRA adapters active when asked) and its layer."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_layer_config(family, layer_type)).double()
    for p in model.model.layers[0].parameters():
        nn.init.normal_(p, 0.0, 0.2)
    if lora:
        model = with_lora(model, LORA_PROJECTIONS, std=0.2, dropout=dropout)
    base = model.get_base_model() if lora else model
    return base, base.model.layers[0]


def _inputs(base: nn.Module, batch: int, seq: int, padding: bool, layer_type: str = "full_attention", seed: int = 1):
    """Hidden states (requiring grad), the layer's mask as the preset builds it, positions, rotary tables."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 32, generator=g, dtype=torch.float64).requires_grad_()
    mask2d = None
    if padding:
        mask2d = torch.ones(batch, seq, dtype=torch.long)
        mask2d[-1, :3] = 0
    fn = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
    mask = _call_mask_function(fn, config=base.config, inputs_embeds=x, attention_mask=mask2d, past_key_values=None)
    pos = torch.arange(seq)[None]
    cos, sin = base.model.rotary_emb(x, pos)
    return x, mask, pos, (cos, sin)


def _param_grads(layer: nn.Module) -> Dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out


def _assert_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert got.keys() == ref.keys() and ref
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"{worst}: rel err {errs[worst]:.2e}"


class _CallCounter:
    """Counts calls of a module's forward by wrapping the instance's ``forward`` (no hook: a hook would
    turn tiling off), and of the fused op that replaces the module's part when the layer is plain and
    fused (``op``: a name in roundpipe.models.tiling)."""

    def __init__(self, module: nn.Module, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        module.forward = self._counted(module.forward)
        monkeypatch.setattr(tiling, op, self._counted(getattr(tiling, op)))

    def _counted(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        return call


# ---------------------------------------------------------------------------------------------------------
# Tiles and the setting
# ---------------------------------------------------------------------------------------------------------


def test_tiles_cover_the_sequence_and_the_setting_decides() -> None:
    assert tiling.tile_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tiling.tile_bounds(8, 4) == [(0, 4), (4, 8)]
    assert tiling.rows_per_tile(1, 8192, 8192) == 8192  # one tile: untiled
    assert tiling.rows_per_tile(1, 8193, 8192) == 8192
    assert tiling.rows_per_tile(4, 4096, 8192) == 2048  # a tile counts the tokens of every row
    assert tiling.rows_per_tile(1, 100_000, 0) == 100_000  # 0: off
    assert settings.SEQ_TILE.get() == 16384 or settings.SEQ_TILE.is_set()
    with settings.overridden(seq_tile=16):
        assert tiling.rows_per_tile(2, 10) == 8
    with pytest.raises(ValueError, match="RPP_SEQ_TILE"):
        os.environ["RPP_SEQ_TILE"] = "-1"
        try:
            settings.SEQ_TILE.get()
        finally:
            del os.environ["RPP_SEQ_TILE"]


# ---------------------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------------------

LAYER_CASES = [
    # family, lora, padding, layer type, fused-kernel modules (eager)
    ("qwen3", False, False, "full_attention", False),
    ("qwen3", True, True, "full_attention", False),
    ("qwen3", False, False, "sliding_attention", True),
    ("qwen3", True, False, "full_attention", True),
    ("llama", False, True, "full_attention", False),
    ("llama", True, False, "full_attention", False),
    ("llama", False, False, "full_attention", True),
]


@pytest.mark.parametrize("family,lora,padding,layer_type,fused", LAYER_CASES)
@pytest.mark.parametrize("mode", ["grad", "recompute", "recompute-pre-tiled"])
def test_tiled_layer_equals_untiled(
    family: str, lora: bool, padding: bool, layer_type: str, fused: bool, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output, input gradient and every trainable parameter's gradient of one layer, 13 positions in
    tiles of 4 (last tile 1). As a recompute the output is deferred (a placeholder without memory until
    materialize()), and the pre-attention part runs untiled below PRE_TILES_IN_RECOMPUTE tiles."""
    base, layer = _make_layer(family, lora=lora, layer_type=layer_type)
    if fused:
        settings.configure(compile=False)
        assert kernels.fuse_layer(layer)
    x, mask, pos, pe = _inputs(base, 2, 13, padding, layer_type)
    assert tiling.tileable(layer)
    ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    g = torch.randn_like(ref)
    ref.backward(g)
    ref_grads = dict(_param_grads(layer), x=x.grad)
    x.grad = None

    if mode == "recompute-pre-tiled":
        monkeypatch.setattr(tiling, "PRE_TILES_IN_RECOMPUTE", 1)
    mlp = _CallCounter(layer.mlp, "POST_ATTENTION", monkeypatch)
    q_proj = _CallCounter(layer.self_attn.q_proj, "PRE_ATTENTION", monkeypatch)
    with RecomputeCtx(None) if mode != "grad" else torch.enable_grad():
        out = tiling.tiled_forward(layer, x, mask, pos, pe, rows=4)
    assert q_proj.calls == (1 if mode == "recompute" else 4)
    if mode == "grad":
        assert mlp.calls == 4 and tiling.materialize(out) is out
    else:
        assert mlp.calls == 0 and out.untyped_storage().nbytes() <= 8  # deferred: a placeholder
        out = tiling.materialize(out)
        assert mlp.calls == 4
    assert rel_err(out, ref) < TOL
    out.backward(g)
    assert mlp.calls == 8  # the backward recomputes each tile once
    assert q_proj.calls == (1 if mode == "recompute" else 8)
    _assert_close(dict(_param_grads(layer), x=x.grad), ref_grads)


def test_compiled_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fused kernels and plain projections each tile's pre- and post-attention part is one
    compiled op (aot_eager here: the same graphs as inductor without code generation): forward, a
    recompute and its backward equal Hugging Face's in fp32; the ops compiled, they did not fall back."""
    monkeypatch.setattr(fused_ops, "COMPILE_BACKEND", "aot_eager")
    settings.configure(compile=True)
    tiling.PRE_ATTENTION.reset()
    tiling.POST_ATTENTION.reset()
    base, layer = _make_layer("qwen3")
    layer.float()
    assert kernels.fuse_layer(layer)
    x, mask, pos, pe = _inputs(base, 1, 13, False)
    x = x.detach().float().requires_grad_()
    pe = tuple(t.float() for t in pe)
    ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    ref.backward(torch.ones_like(ref))
    ref_grads = dict(_param_grads(layer), x=x.grad)
    x.grad = None
    with torch.no_grad():
        assert rel_err(tiling.tiled_forward(layer, x, mask, pos, pe, rows=4), ref) < 1e-5
    with RecomputeCtx(None):
        out = tiling.materialize(tiling.tiled_forward(layer, x, mask, pos, pe, rows=4))
    out.backward(torch.ones_like(out))
    assert rel_err(out, ref) < 1e-5
    _assert_close(dict(_param_grads(layer), x=x.grad), ref_grads, tol=1e-5)
    for op in (tiling.PRE_ATTENTION, tiling.POST_ATTENTION):
        assert op.compiled and not op.failed
        op.reset()


def test_no_grad_forward_and_frozen_input() -> None:
    """Without grad (RoundPipe's forward pass) the tiled layer runs without autograd; with a frozen
    input (the first layer of a LoRA model) the adapters still get their gradients."""
    base, layer = _make_layer("qwen3", lora=True)
    x, mask, pos, pe = _inputs(base, 1, 11, False)
    x = x.detach()
    with torch.no_grad():
        ref0 = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        assert rel_err(tiling.tiled_forward(layer, x, mask, pos, pe, rows=3), ref0) < TOL
    layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe).sum().backward()
    ref = _param_grads(layer)
    tiling.tiled_forward(layer, x, mask, pos, pe, rows=3).sum().backward()
    _assert_close(_param_grads(layer), ref)


# ---------------------------------------------------------------------------------------------------------
# Memory: one tile of intermediate-size tensors at a time
# ---------------------------------------------------------------------------------------------------------


class _LargestWithColumns(TorchDispatchMode):
    """Records the most rows of any tensor an op creates whose last dimension is ``columns`` (tensors
    shaped like ``weight``, the down projection's weight and its gradient, left out)."""

    def __init__(self, columns: int, weight: torch.Size) -> None:
        super().__init__()
        self.columns, self.weight = columns, weight
        self.rows = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.columns and t.shape != self.weight:
                self.rows = max(self.rows, t.numel() // self.columns)
        return out


@pytest.mark.parametrize("lora", [False, True])
def test_tiling_bounds_the_intermediate_tensors(lora: bool) -> None:
    """Forward, recompute and backward of a layer over 2 x 64 positions: untiled, the MLP's gate/up/act
    tensors have 128 rows of intermediate_size (96) columns; tiled by 8 positions, never more than 16.
    The tiled graph saves no intermediate-size tensor at all."""
    base, layer = _make_layer("llama", lora=lora)
    x, mask, pos, pe = _inputs(base, 2, 64, False)
    inter = base.config.intermediate_size
    weights = {p.data_ptr() for p in layer.parameters()}

    def run(tiled: bool) -> Tuple[int, List[torch.Size]]:
        saved: List[torch.Size] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in weights:  # parameters (and views of them) are no activations
                saved.append(t.shape)
            return t

        with _LargestWithColumns(inter, base.model.layers[0].mlp.down_proj.weight.shape) as rec:
            with torch.no_grad():  # RoundPipe's forward pass
                tiling.tiled_forward(layer, x, mask, pos, pe, rows=8) if tiled else layer(x, position_embeddings=pe)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), RecomputeCtx(None):
                out = (
                    tiling.tiled_forward(layer, x, mask, pos, pe, rows=8) if tiled else layer(x, position_embeddings=pe)
                )
            out.backward(torch.ones_like(out))
        return rec.rows, saved

    rows, saved = run(tiled=False)
    assert rows == 2 * 64 and torch.Size([2, 64, inter]) in saved
    rows, saved = run(tiled=True)
    assert rows == 2 * 8
    assert not any(s[-1] == inter for s in saved), saved


# ---------------------------------------------------------------------------------------------------------
# Dropout: per-tile RNG states replayed in backward
# ---------------------------------------------------------------------------------------------------------


def test_dropout_masks_replay_in_backward() -> None:
    """LoRA dropout (training mode) draws a mask per tile. A recompute from the forward pass's RNG state
    draws the same masks (so the pre-attention part stays tiled there), each tile's backward draws them
    again, and the gradients equal those of the untiled layer applying the tiles' masks concatenated;
    the caller's RNG state is given back after the backward."""
    base, layer = _make_layer("qwen3", lora=True, dropout=0.3)
    layer.train()
    x, mask, pos, pe = _inputs(base, 2, 7, False)
    drops = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Dropout)}
    assert len(drops) == len(LORA_PROJECTIONS)
    drawn: Dict[str, List[torch.Tensor]] = {n: [] for n in drops}
    for name, mod in drops.items():

        def forward(
            t: torch.Tensor, inner: Callable[..., torch.Tensor] = mod.forward, name: str = name
        ) -> torch.Tensor:
            out = inner(t)
            drawn[name].append(out != 0)
            return out

        mod.forward = forward  # no hook: a hook would turn tiling off

    torch.manual_seed(123)
    with torch.no_grad():  # RoundPipe's forward pass, then the recompute from the same RNG state
        plain = tiling.tiled_forward(layer, x, mask, pos, pe, rows=3)  # tiles of 3, 3, 1 positions
    forward_masks = {n: list(v) for n, v in drawn.items()}
    assert all(len(v) == 3 for v in forward_masks.values())
    for v in drawn.values():
        v.clear()
    torch.manual_seed(123)
    with RecomputeCtx(None):
        out = tiling.materialize(tiling.tiled_forward(layer, x, mask, pos, pe, rows=3))
    assert torch.equal(out, plain)
    assert all(all(torch.equal(a, b) for a, b in zip(drawn[n], forward_masks[n])) for n in drawn)
    g = torch.randn_like(out)
    state = torch.get_rng_state()
    out.backward(g)
    assert torch.equal(torch.get_rng_state(), state)
    for name, masks in drawn.items():
        assert len(masks) == 6 and all(torch.equal(a, b) for a, b in zip(masks[3:], masks[:3])), name
    got = dict(_param_grads(layer), x=x.grad)
    x.grad = None

    for name, mod in drops.items():
        full = torch.cat(forward_masks[name], dim=1)
        mod.forward = lambda t, full=full, p=mod.p: t * (full.to(t.dtype) / (1 - p))
    ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    assert rel_err(out, ref) < TOL
    ref.backward(g)
    _assert_close(got, dict(_param_grads(layer), x=x.grad))


# ---------------------------------------------------------------------------------------------------------
# Fallbacks
# ---------------------------------------------------------------------------------------------------------


def test_fallbacks() -> None:
    """Hooks on the layer or a submodule, other families and a non-Linear projection keep the layer
    untiled; so do short inputs and the setting 0."""
    base, layer = _make_layer("llama")
    assert tiling.tileable(layer)
    handle = layer.mlp.up_proj.register_forward_hook(lambda *a: None)
    assert not tiling.tileable(layer)
    handle.remove()
    handle = layer.register_forward_pre_hook(lambda *a: None)
    assert not tiling.tileable(layer)
    handle.remove()
    other = copy.deepcopy(layer)
    other.self_attn.q_proj = nn.Sequential(other.self_attn.q_proj)
    assert not tiling.tileable(other)
    qwen2 = tiny_model("qwen2").model.layers[0]
    assert not tiling.tileable(qwen2)

    x, mask, pos, pe = _inputs(base, 2, 10, False)
    with settings.overridden(seq_tile=20):  # 2 x 10 tokens: one tile
        assert tiling.maybe_tiled_forward(layer, x, mask, pos, pe) is None
    with settings.overridden(seq_tile=0):
        assert tiling.maybe_tiled_forward(layer, x, mask, pos, pe) is None
    with settings.overridden(seq_tile=8):
        out = tiling.maybe_tiled_forward(layer, x, mask, pos, pe)
        assert out is not None and rel_err(out, layer(x, position_embeddings=pe)) < TOL


def test_which_layers_tile_is_the_family_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiling names no family: the records with ``tiles`` give the classes (Qwen3 and Llama), a table
    without it tiles nothing, and ``tiles`` without the class names is refused."""
    import dataclasses

    from roundpipe.models import families, tile_choice

    assert [f.name for f in families.FAMILIES if f.tiles] == ["qwen3", "llama"]
    _, layer = _make_layer("llama")
    assert tiling.tileable(layer)
    untiled = tuple(dataclasses.replace(f, tiles=False) for f in families.FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", untiled)
    monkeypatch.setattr(tile_choice, "_classes", None)  # the classes are read once, from the table
    assert not tiling.tileable(layer)
    with pytest.raises(ValueError, match="tiles=True needs fused_kernels"):
        families.ModelFamily("nameless", ("nameless",), tiles=True)


# ---------------------------------------------------------------------------------------------------------
# Whole models through RoundPipe
# ---------------------------------------------------------------------------------------------------------


def _count_tiled(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    calls = [0]
    inner = tiling.tiled_forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(tiling, "tiled_forward", counted)
    return calls


def _fp64_model(family: str, lora: bool) -> nn.Module:
    model = tiny_model(family).double()
    return with_lora(model, LORA_PROJECTIONS, seed=7) if lora else model


def _reference(
    model: nn.Module, batch: Dict[str, Optional[torch.Tensor]]
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    with settings.overridden(seq_tile=0):
        out = model(**{k: v for k, v in batch.items() if v is not None})
    out.loss.backward()
    return out.loss.detach(), grads(model)


# Layers: 0 prefix, 1-3 decoder layers, 4 head. Backward stages of two and three layers, so a deferred
# output is filled by the next decoder layer (stage grain) and by the head (forward + loss.backward).
STAGED = ModelExecutePlan([range(0, 5)], [range(0, 2), range(2, 5)])

MODEL_CASES = [
    # family, lora, padding (Qwen3's tiny config has sliding-window layers: masks either way), tiles from
    # which the recompute tiles the pre-attention part too (3 tiles here)
    ("qwen3", False, True, 16),
    ("qwen3", True, False, 1),
    ("llama", False, False, 1),
    ("llama", True, True, 16),
]


HF_TOL = 1e-6  # fp64 vs Hugging Face: its norms and both losses round through fp32 (observed 6e-8)


def _roundpipe_run(model: nn.Module, batch: Dict[str, Optional[torch.Tensor]], run: RoundPipeRunConfig, tile: int):
    """``train_step``, then ``forward`` + ``loss.backward()``: (loss, gradients) of each."""
    settings.configure(seq_tile=tile)
    rp = models.wrap_model(model, model_run_config=run)
    loss = rp.train_step(**batch)
    fused = (loss, grads(model))
    out = rp(**batch)
    out.loss.backward()
    return fused, (out.loss.detach(), grads(model))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("family,lora,padding,pre_tiles", MODEL_CASES)
def test_roundpipe_tiled_equals_untiled(
    workers: str, grain: str, family: str, lora: bool, padding: bool, pre_tiles: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp64, 6 x 10 tokens in 3 microbatches of 2 x 10, tiles of 8 tokens (4 + 4 + 2 positions):
    ``train_step`` and ``forward`` + ``loss.backward()`` give the untiled run's loss and gradients to
    1e-10, and Hugging Face's (whose fp32 round trips in the norms and the loss differ from RoundPipe's
    chunked fp32 loss at ~1e-7, tiled or not)."""
    model = _fp64_model(family, lora)
    batch = make_batch(padding)
    ref_loss, ref_grads = _reference(model, batch)
    run = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain, execute_plan=STAGED)
    untiled = _roundpipe_run(model, batch, run, tile=0)
    calls = _count_tiled(monkeypatch)
    monkeypatch.setattr(tiling, "PRE_TILES_IN_RECOMPUTE", pre_tiles)
    tiled = _roundpipe_run(model, batch, run, tile=8)
    assert calls[0] > 0
    for (loss, got), (loss0, got0) in zip(tiled, untiled):
        assert rel_err(loss, loss0) < TOL
        _assert_close(got, got0)
        assert rel_err(loss, ref_loss) < HF_TOL
        _assert_close(got, ref_grads, tol=HF_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpu_compiled_kernels_tiled_bf16(family: str) -> None:
    """On a GPU with the compiled fused kernels: a tiled bf16 layer (causal sdpa, no mask) stays within
    bf16 rounding of the untiled one, output and gradients."""
    settings.configure(compile=True)
    kernels.reset()
    base, layer = _make_layer(family)
    layer = layer.to("cuda", torch.bfloat16)
    kernels.fuse_layer(layer)
    x = torch.randn(1, 1000, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(1000, device="cuda")[None]
    pe = tuple(t.to("cuda", torch.bfloat16) for t in base.model.rotary_emb(x.float().cpu(), pos.cpu()))
    ref = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    ref.float().square().sum().backward()
    ref_grads = dict(_param_grads(layer), x=x.grad)
    x.grad = None
    out = tiling.tiled_forward(layer, x, None, pos, pe, rows=256)
    out.float().square().sum().backward()
    assert rel_err(out, ref) < 1e-2
    _assert_close(dict(_param_grads(layer), x=x.grad), ref_grads, tol=3e-2)
    kernels.reset()
