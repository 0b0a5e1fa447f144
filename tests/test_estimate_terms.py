"""Each term of the memory estimate (``roundpipe.planning.estimate``) and of the planner's GPU budget
(``roundpipe.planning.budget.gpu_budget``), pinned against numbers worked out by hand for stages of several
layers: with one layer per stage, a stage's weights, its "others" and ceil(layers / stage) cannot be
told apart from their one-layer forms.

The model shape is tiny so that every product can be checked on paper: hidden h = 64, MLP i = 128,
4 query heads and 2 key/value heads of 16 (q = 64, k = 32), 5 decoder layers, bf16 (e = 2); one step
of 2 rows of 100 tokens in 2 microbatches (t = 100 tokens per job), untiled, 2 decoder layers per
backward stage.
"""

from __future__ import annotations

from typing import List

import pytest

from roundpipe.devices import device
from roundpipe.planning import budget, estimate, memory_terms
from roundpipe.utils import GiB

MiB = float(1 << 20)


def _shape(vocab: int) -> estimate.ModelShape:
    return estimate.ModelShape(hidden=64, intermediate=128, layers=5, heads=4, kv_heads=2, head_dim=16, vocab=vocab)


def _estimate(vocab: int = 16, **kw: object) -> estimate.Estimate:
    args = dict(microbatches=2, tile=0, layers_per_stage=2, grad_buffers=1, optimizer_bytes_per_param=12)
    args.update(kw)
    return estimate.estimate(_shape(vocab), 100, 2, **args)  # type: ignore[arg-type]


# One decoder layer, t = 100 tokens, by hand (decoder_layer_bytes, untiled whole layer):
#   attention backward: t (e (h + 4q + 4k) + 4q + 2eq + 8 heads) = 100 (2 * 448 + 256 + 256 + 32) = 144,000
#   kept by its recompute: t (e (h + 2q + 2k) + 4 heads) = 100 (2 * 256 + 16) = 52,800
#   the MLP and projections a whole-layer op keeps: t e (3i + 2h + q + k) = 100 * 2 * 608 = 121,600
KEPT = 52_800 + 121_600  # 174,400
PEAK = 144_000 + 121_600  # 265,600
IO = 2 * 100 * 64 * 2  # the stage input and the output gradient: 25,600
SIDE = 100 * (2 * 16 * 2 + 16)  # rotary cos / sin, position ids, labels: 80 bytes per token, 8,000
OVERLAP = 2 * 100 * 64 * 2  # the neighbouring jobs' input upload and gradient download: 25,600
# Parameters of a layer: h q + 2 h k + q h = 12,288 (attention), 3 h i = 24,576 (MLP), 2 h + 2 * 16 = 160 (norms).
LAYER_PARAMS = 37_024


def test_gpu_stage_of_two_layers_counts_its_weights_others_and_overlap() -> None:
    """The backward stage of two decoder layers decides the GPU peak (a small vocabulary): the layer
    back-propagated at its peak, the other what its recompute keeps, the stage input and output
    gradient, the side tensors and the neighbouring jobs' two hidden-size tensors; its weights twice
    (running and prefetched stage) and its gradients once."""
    e = _estimate()
    assert e.gpu_parts["activations"] == PEAK + KEPT + IO + SIDE + OVERLAP == 499_200
    assert e.gpu_parts["weights"] == 2 * 2 * LAYER_PARAMS * 2 + 2 * LAYER_PARAMS * 2 == 444_288
    assert e.gpu_parts["runtime"] == memory_terms.GPU_OVERHEAD_BYTES and e.gpu_parts["saved inputs"] == 0
    assert e.gpu_bytes_per_token == 499_200 / 100
    # The layer grain keeps only the other layer's input (t h e = 12,800) instead of its recompute.
    layer = _estimate(recompute_grain="layer")
    assert layer.gpu_parts["activations"] == PEAK + 12_800 + IO + SIDE + OVERLAP == 337_600


def test_gpu_head_stage_counts_the_overlap_too() -> None:
    """A large vocabulary makes the fused last stage (head + last decoder layer) the GPU peak: the head's
    normed states, their gradient and two 8192-token chunks of fp32 logits, with the last layer's kept
    bytes, the stage input and gradient, the side tensors and the overlap."""
    e = _estimate(vocab=4096)
    head = 100 * 3 * 64 * 2 + 2 * 100 * 4096 * 4  # 38,400 + 3,276,800 (t < 8192: one chunk of t)
    assert e.gpu_parts["activations"] == head + KEPT + IO + SIDE + OVERLAP == 3_548_800
    # The untied embedding and head (4096 x 64 each, the head counted twice) and the last layer.
    assert e.gpu_parts["weights"] == 4096 * 64 * 2 * 2 + 4096 * 64 * 2 + LAYER_PARAMS * 2 == 1_646_912


def test_host_checkpoints_round_the_stage_count_up() -> None:
    """Five layers in stages of two make three backward stages (2 + 2 + 1): one input each per
    microbatch, 100 x 64 bf16 = 12,800 bytes rounded by the pinned allocator to 16,384; plus the side
    tensors of all 200 tokens once. Weights, optimizer and one gradient buffer per parameter."""
    e = _estimate()
    assert e.host_parts["checkpoints"] == 3 * 2 * 16_384 + 200 * 80 == 114_304
    assert e.host_bytes_per_token == 114_304 / 200
    params = 2 * 16 * 64 + 5 * LAYER_PARAMS + 64  # untied embedding and head, layers, final norm: 187,232
    assert e.host_parts["weights"] == params * 2 and e.host_parts["optimizer"] == params * (12 + 2)
    assert _estimate(pinned=False).host_parts["checkpoints"] == 3 * 2 * 12_800 + 200 * 80


def test_fp8_stage_inputs_on_the_host() -> None:
    """``stage_inputs='fp8'``: per stage input and microbatch an fp8 payload of 100 x 64 = 6,400 bytes
    (pinned: 8,192) and one float32 scale per token (64 values, one block of 128): 400 bytes (pinned:
    512); the side tensors as before. Nothing else changes."""
    e, exact = _estimate(stage_inputs="fp8"), _estimate(stage_inputs="bf16")
    assert e.host_parts["checkpoints"] == 3 * 2 * (8_192 + 512) + 200 * 80 == 68_224
    assert _estimate(stage_inputs="fp8", pinned=False).host_parts["checkpoints"] == 3 * 2 * (6_400 + 400) + 16_000
    assert {k: v for k, v in e.host_parts.items() if k != "checkpoints"} == {
        k: v for k, v in exact.host_parts.items() if k != "checkpoints"
    }
    assert e.gpu_parts == exact.gpu_parts
    # qwen3-8b at 524,288 tokens, one layer per stage: 36 inputs of 4,096 + 32 x 4 bytes per token instead
    # of 8,192 (the payload is a power of two, the scales 64 MiB each).
    q8 = estimate.ModelShape.builtin("qwen3-8b")
    big = {m: estimate.estimate(q8, 524_288, lora_rank=16, stage_inputs=m, tile=16384) for m in ("bf16", "fp8")}
    side = 524_288 * memory_terms.side_bytes_per_token(q8)
    assert big["bf16"].host_parts["checkpoints"] - side == 36 * 524_288 * 8_192  # 144 GiB
    assert big["fp8"].host_parts["checkpoints"] - side == 36 * 524_288 * (4_096 + 128)  # 74.25 GiB
    int8 = estimate.estimate(q8, 524_288, lora_rank=16, stage_inputs="int8", tile=16384)
    assert int8.host_parts["checkpoints"] - side == 36 * 524_288 * (4_096 + 512)  # 81 GiB: a scale per 32 values


def test_one_gpu_keeps_all_three_stage_inputs_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 4 GiB GPU the room (75% of what the step leaves) holds all 3 x 2 stage inputs, unrounded."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "auto")
    e = _estimate(gpu_bytes=4 * GiB)
    assert e.gpu_parts["saved inputs"] == 3 * 2 * 12_800
    assert e.host_parts["checkpoints"] == 200 * 80
    # Inputs kept on the GPU stay exact with fp8 stage inputs too (the runtime compacts host copies only).
    assert _estimate(gpu_bytes=4 * GiB, stage_inputs="fp8").gpu_parts == e.gpu_parts


# ---- the planner's GPU budget ------------------------------------------------------------------------
# A device of 4 GiB: 4 GiB * 0.92 - 1 GiB = 2744.32 MiB usable. Layers of 100, 300, 200 and 250 MiB;
# backward stages [0], [1, 2] (500 MiB of weights) and [3].
CAPACITY = 4 * GiB
SIZES = [100 * MiB, 300 * MiB, 200 * MiB, 250 * MiB]
PLAN = [range(0, 1), range(1, 3), range(3, 4)]
USABLE = CAPACITY * (1 - 0.08) - GiB


def _profile(kept_2: float) -> budget.ActivationProfile:
    """Layer 1 keeps 800 MiB, layer 2 ``kept_2``; back-propagating layer 1 takes 50 MiB more, layer 2 40."""
    kept: List[float] = [10 * MiB, 800 * MiB, kept_2, 10 * MiB]
    peak: List[float] = [20 * MiB, 850 * MiB, kept_2 + 40 * MiB, 20 * MiB]
    profile = budget.ActivationProfile(kept, peak, [0.0] * 4, tokens=8, seq_len=8, for_tokens=lambda n: profile)
    return profile


def test_gpu_budget_leaves_out_two_of_the_largest_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "get_min_capacity", lambda: int(CAPACITY))
    assert budget.gpu_budget(SIZES) == pytest.approx(USABLE - 2 * 300 * MiB, rel=1e-12)
    assert budget.gpu_budget([]) == pytest.approx(USABLE, rel=1e-12)


def test_a_stage_of_two_layers_fits_when_twice_its_weights_and_activations_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device holds the stage of layers 1-2 and the next one prefetched (as large: 2 x 500 MiB) plus
    the stage's activations (what both layers keep and the larger peak beyond it, 50 MiB): with layer 2
    keeping 850 MiB that is 1000 + 1650 + 50 = 2700 MiB (fits in 2744.32), with 900 MiB 2750 (does not).
    ``gpu_budget`` leaves out two of the largest layer, the planner's excess the rest of the stages."""
    monkeypatch.setattr(device, "get_min_capacity", lambda: int(CAPACITY))
    assert budget.still_fits(_profile(850 * MiB), SIZES, PLAN, fused=False)
    assert not budget.still_fits(_profile(900 * MiB), SIZES, PLAN, fused=False)
    # The room one device keeps stage inputs in: 75% of the budget less that stage (kept 1650, peak
    # beyond kept 50, its weights beyond the budget's two largest layers 2 x 200).
    room = budget.device_saved_room(_profile(850 * MiB), SIZES, PLAN)
    assert room == pytest.approx(0.75 * (USABLE - 600 * MiB - (1650 + 50 + 400) * MiB), rel=1e-9)


def test_sequence_tiles_terms_by_hand() -> None:
    """``sequence_tiles``: a job holds one tile's activations plus its layers' keys and values over the
    whole sequence (float32 gradient accumulators beside them) and one tile's prefix attention inputs;
    the host keeps every layer's keys and values, and the stage inputs of all tiles (as many bytes as
    the unsplit sequence's)."""
    from roundpipe.planning import estimate as est

    shape = est.ModelShape.builtin("qwen3-8b")
    seq, tiles, g, b = 8192, 4, 2, 2
    kw = dict(tile=0, layers_per_stage=g, pinned=False, grad_buffers=1)
    tiled = est.estimate(shape, seq, sequence_tiles=tiles, **kw)
    one_tile = est.estimate(shape, seq // tiles, **kw)
    whole = est.estimate(shape, seq, **kw)
    assert tiled.microbatches == tiles
    assert tiled.host_parts["keys/values"] == 2 * shape.layers * seq * shape.kv_dim * b
    assert tiled.host_parts["checkpoints"] == whole.host_parts["checkpoints"]
    # The larger of a stage of g layers and the head's job (the head and one layer) decides the peak.
    prefix = seq * 2 * (2 * shape.q_dim + shape.kv_dim) * b
    per_layer = seq * shape.kv_dim * 2 * (b + 4)
    layers = g if tiled.gpu_parts["weights"] == 2 * g * shape.layer_params() * b + g * shape.layer_params() * b else 1
    assert tiled.gpu_parts["weights"] == one_tile.gpu_parts["weights"]  # the same job decides both
    assert tiled.gpu_parts["activations"] - one_tile.gpu_parts["activations"] == layers * per_layer + prefix
    with pytest.raises(ValueError, match="sequence_tiles"):
        est.estimate(shape, seq, sequence_tiles=0)
