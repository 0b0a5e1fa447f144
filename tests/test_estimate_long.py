"""The estimate at long context for wide layers: what a sequence tile of the MLP holds with PEFT's fp32 adapters
(measured from the saved tensors of a tiled Llama layer on CPU), and the longest context searched over shorter
sequence tiles (``RPP_SEQ_TILE``), as ``roundpipe plan`` reports and proposes it."""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

from roundpipe.cli import plan  # noqa: E402
from roundpipe.planning import estimate, memory_terms  # noqa: E402
from roundpipe.utils import GiB  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _post_tile_saved_bytes(lora: bool, tile: int, fused: bool = False) -> Dict[str, Any]:
    """Bytes autograd saves for one post-attention tile of a bf16 Llama layer (``o_proj``, the norm, the MLP) run
    with grad as a tiled backward recomputes it, besides its inputs and the weights; frozen projections, and with
    ``lora`` PEFT adapters on all seven in fp32 (PEFT's default upcast); ``fused``: the layer's fused kernels (the
    eager path of the compiled ops GPUs run, the adapters as the fused LoRA linear); with the layer's estimate
    terms."""
    from test_tiling import _make_layer

    from roundpipe.models import kernels, tiling
    from roundpipe.models.causal_lm import _module_extra_per_token, _pre_attention_extra_per_token

    base, layer = _make_layer("llama", lora=lora)
    if fused:
        kernels.fuse_layer(layer)
    base = base.to(torch.bfloat16)
    for name, p in base.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            p.data = p.data.float()
    shape = estimate.ModelShape.from_config(base.config)
    lt = tiling._LayerTiles(layer, tiling.tile_bounds(tile, tile))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tile, shape.hidden, generator=g).to(torch.bfloat16).requires_grad_(True)
    a = torch.randn(1, tile, shape.q_dim, generator=g).to(torch.bfloat16).requires_grad_(True)
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lt.post_tile(x, a)
    skip = {t.untyped_storage().data_ptr() for t in (x, a, *layer.parameters())}
    out.float().sum().backward()  # the graph is whole: its backward runs
    return {
        "fused": lt.post_op is not None,
        "saved": sum(v for k, v in storages.items() if k not in skip),
        "shape": shape,
        "extra": _module_extra_per_token(layer, shape),
        "pre": _pre_attention_extra_per_token(layer, shape),
    }


def test_mlp_tile_counts_what_fp32_adapters_save_per_tile() -> None:
    """PEFT's fp32 adapters on o / gate / up / down each save a cast copy of their input for every MLP tile of a
    tiled backward (3.3 GiB at a 16,384-token tile of a 70B layer): what they add to one tile's saved tensors
    (LoRA against the frozen layer without adapters) equals what ``decoder_layer_bytes`` adds to its MLP-tile term
    for them, within 15%; the runtime's own count (``pre_extra_per_token=None``) adds nothing."""
    tile, n = 64, 1024
    lora, frozen = _post_tile_saved_bytes(True, tile), _post_tile_saved_bytes(False, tile)
    measured = lora["saved"] - frozen["saved"]
    shape = lora["shape"]
    post = lora["extra"] - lora["pre"]  # what decoder_layer_bytes adds to its MLP-tile term for them
    assert post == memory_terms.lora_bytes_per_token(shape, 4) - memory_terms.lora_pre_attention_bytes_per_token(
        shape, 4
    )
    added = memory_terms.mlp_tile_bytes(shape, n, tile, 2, post) - memory_terms.mlp_tile_bytes(shape, n, tile, 2)
    assert measured > 0.3 * frozen["saved"], (measured, frozen["saved"])
    assert abs(added - measured) / measured < 0.15, (added, measured)
    # A wide MLP (the 70B layer's): the tile's term is the layer's peak, and the adapters' bytes are in it.
    wide = estimate.ModelShape.builtin("llama3.1-70b")
    extra, pre = memory_terms.lora_bytes_per_token(wide, 16), memory_terms.lora_pre_attention_bytes_per_token(wide, 16)
    peak = memory_terms.decoder_layer_bytes(wide, 65536, 16384, True, 2, False, extra, pre)[1]
    assert peak >= memory_terms.mlp_tile_bytes(wide, 65536, 16384, 2, extra - pre)
    args = (shape, n, tile, True, 2, False)
    planned = memory_terms.decoder_layer_bytes(*args, lora["extra"], None)[1]
    assert planned == memory_terms.decoder_layer_bytes(*args, 0.0, None)[1]


def test_tile_choices_halve_down_to_the_smallest() -> None:
    assert estimate.tile_choices(16384) == [16384, 8192, 4096, 2048]
    assert estimate.tile_choices(3000) == [3000]
    assert estimate.tile_choices(0) == [0]


def test_longest_context_over_shorter_tiles() -> None:
    """A 70B NF4 LoRA sequence under 24 GiB: at the default 16,384-token tile 65,536 tokens do not fit (the MLP
    tile and the pre-attention graph kept at full length below 16 tiles); searched over the tile's halvings the
    longest context reaches them with a shorter tile, whose estimate is the step's at that tile."""
    shape = estimate.ModelShape.builtin("llama3.1-70b")
    kw: Dict[str, Any] = dict(lora_rank=16, base_format="nf4", stage_inputs="bf16", grad_buffers=1)
    gpu, host = 24 * GiB, 1024 * GiB
    one, _ = estimate.longest_context(shape, gpu, host, tile=16384, **kw)
    seq, fit = estimate.longest_context(shape, gpu, host, tiles=estimate.tile_choices(16384), **kw)
    assert one < 65536 <= seq and fit is not None and fit.tile < 16384
    again = estimate.estimate(shape, seq, layers_per_stage=fit.layers_per_stage, gpu_bytes=gpu, tile=fit.tile, **kw)
    assert again.peak_gpu_bytes == fit.peak_gpu_bytes <= gpu


def test_plan_proposes_a_shorter_seq_tile(capsys: pytest.CaptureFixture[str]) -> None:
    """``roundpipe plan`` for the 70B sequence of 65,536 tokens under 24 GiB: short at the setting's tile, it proposes
    the largest shorter ``--seq-tile`` that fits; with that flag the step fits (exit 0) and the JSON says the tile."""
    argv = ["--model", "llama3.1-70b", "--lora-r", "16", "--base-format", "nf4", "--seq-len", "65536"]
    argv += ["--gpu-memory", "24GiB", "--host-memory", "125GiB", "--stage-inputs", "bf16"]
    assert plan.main(argv) == 1
    out = capsys.readouterr().out
    proposed = [line for line in out.splitlines() if "--seq-tile" in line]
    assert len(proposed) == 1 and "(fits)" in proposed[0], out
    tile = int(proposed[0].split("--seq-tile ")[1].split()[0])
    assert tile in estimate.tile_choices(16384)[1:]
    assert "RPP_SEQ_TILE=" in out.splitlines()[-1]
    assert plan.main(argv + ["--seq-tile", str(tile), "--json"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)
    assert got["fits"] and got["seq_tile"] == tile and got["peak_gpu_bytes"] <= 24 * GiB
    assert plan.main(argv + ["--seq-tile", "-1"]) == 2
    assert "--seq-tile" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "peft-modules"])
def test_gpu_peak_of_a_tiled_70b_layer_at_65k_tokens(fused: bool) -> None:
    """One Llama-3.1-70B-shaped bf16 decoder layer, LoRA r16 on all projections (fp32 adapters, frozen base), as
    the runtime runs it before its backward (a tiled recompute, then the backward) at 65,536 tokens in tiles of
    4,096: the peak CUDA memory beyond the weights, the input and the output gradient against the estimate's
    ``decoder_layer_bytes`` peak (the 70B one-sequence row under 24 GiB rests on it), with PEFT's modules and with
    the fused kernels (``fused_lora_bytes_per_token``): within 10%. Prints both."""
    import peft
    import transformers

    from roundpipe import settings
    from roundpipe.models import kernels, tiling
    from roundpipe.models.causal_lm import _module_extra_per_token, _pre_attention_extra_per_token
    from roundpipe.runtime.context import RecomputeCtx

    n, tile = 65536, 4096
    cfg = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=1,
        vocab_size=128,
        attn_implementation="sdpa",
        max_position_embeddings=n,
    )
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    base = model.get_base_model()
    layer = base.model.layers[0]
    if fused:
        kernels.fuse_layer(layer)
    shape = estimate.ModelShape.from_config(cfg)
    extra, pre = _module_extra_per_token(layer, shape), _pre_attention_extra_per_token(layer, shape)
    x = torch.randn(1, n, 8192, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    pos = torch.arange(n, device="cuda")[None]
    cos, sin = base.model.rotary_emb(x, pos)
    dout = torch.randn_like(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with settings.overridden(seq_tile=tile):
        with RecomputeCtx(None):
            out = tiling.maybe_tiled_forward(layer, x, None, pos, (cos, sin))
        assert out is not None, "the layer did not tile"
        out.backward(dout)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    if fused:
        extra, pre = memory_terms.fused_lora_bytes_per_token(shape, 16)
    _, peak = memory_terms.decoder_layer_bytes(shape, n, tile, True, 2, False, extra, pre)
    got, want = measured / GiB, peak / GiB
    print(f"\n70B layer, {n} tokens, tiles of {tile}, fused={fused}: peak {got:.2f} GiB, estimate {want:.2f} GiB")
    assert abs(measured - peak) / peak < 0.10, (measured / GiB, peak / GiB)


def test_fused_lora_terms_are_what_the_fused_ops_save() -> None:
    """With the fused kernels (their eager path, which saves what the compiled ops do for the fused LoRA linear) the
    adapters add to a tiled layer only the layer's own inputs and the rank-r products: per MLP tile and in the
    pre-attention graph a recompute of 8 tiles keeps, LoRA against the frozen layer equals
    ``fused_lora_bytes_per_token`` within 15%, far below PEFT's fp32 copies."""
    tile = 64
    lora, frozen = _post_tile_saved_bytes(True, tile, fused=True), _post_tile_saved_bytes(False, tile, fused=True)
    assert lora["fused"] and frozen["fused"]
    shape = lora["shape"]
    whole, pre = memory_terms.fused_lora_bytes_per_token(shape, 4)
    measured = (lora["saved"] - frozen["saved"]) / tile
    assert abs((whole - pre) - measured) / measured < 0.15, (whole - pre, measured)
    peft = memory_terms.lora_bytes_per_token(shape, 4) - memory_terms.lora_pre_attention_bytes_per_token(shape, 4)
    assert measured < 0.5 * peft
    seq = 512  # 8 tiles
    from test_budget import _tiled_recompute_saved_bytes

    saved = [_tiled_recompute_saved_bytes(lo, seq, tile, "llama", fused=True, frozen=True)[0] for lo in (True, False)]
    measured_pre = (saved[0] - saved[1]) / seq
    assert abs(pre - measured_pre) / measured_pre < 0.15, (pre, measured_pre)


def test_estimate_with_fused_lora_counts_the_fused_terms_in_tiled_layers_only() -> None:
    """``estimate(fused_lora=True)``: a tiled 70B layer (65,536 tokens, 4 tiles of 16,384) keeps its pre-attention
    graph and MLP tile without PEFT's fp32 copies, so the step's GPU peak is lower by at least those copies' share;
    an untiled step (16,384 tokens) and the host side are unchanged."""
    shape = estimate.ModelShape.builtin("llama3.1-70b")
    kw: Dict[str, Any] = dict(lora_rank=16, base_format="nf4", stage_inputs="bf16", grad_buffers=1, tile=16384)
    peft, fused = (estimate.estimate(shape, 65536, fused_lora=f, **kw) for f in (False, True))
    copies = 65536 * 12 * shape.hidden  # PEFT's three fp32 copies of the attention input in the kept graph
    assert peft.peak_gpu_bytes - fused.peak_gpu_bytes >= 0.9 * copies
    assert peft.host_parts == fused.host_parts
    short = [estimate.estimate(shape, 16384, fused_lora=f, **kw) for f in (False, True)]
    assert short[0].gpu_parts == short[1].gpu_parts
