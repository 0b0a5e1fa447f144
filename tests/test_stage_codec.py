"""Compact stage inputs (``roundpipe.runtime.stage_codec``, ``RPP_STAGE_INPUTS=fp8``): the format's error bound per
block, which leaves it takes, a training step against a hand-made reference that applies the same round
trip to the stage inputs (exactly equal) and against exact stage inputs (close), the planner's and the
estimate's smaller checkpoints, and the setting's errors."""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import roundpipe  # noqa: E402
from roundpipe import RoundPipe, RoundPipeRunConfig, settings
from roundpipe.planning import estimate, memory_terms
from roundpipe.planning.plan import ModelExecutePlan  # noqa: E402
from roundpipe.runtime import stage_codec

FP8 = torch.float8_e4m3fn


def _scales_per_value(p: stage_codec.Packed) -> torch.Tensor:
    last = p.payload.shape[1]
    return p.scales.repeat_interleave(p.block, dim=1)[:, :last].reshape(p.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_within_fp8_rounding_of_each_block(dtype: torch.dtype) -> None:
    """Per block a power-of-two scale with amax / scale in (224, 448]; every value within half an fp8 ulp
    of it (2**-4 relative for normals, 2**-10 scale for subnormals); shape and dtype back; the last
    dimension (200) not a multiple of the block; deterministic bytes."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 200, generator=g) * torch.logspace(-4, 4, 200)).to(dtype)
    p = stage_codec.encode(x)
    assert p.payload.dtype == FP8 and p.payload.shape == (21, 200) and p.scales.shape == (21, 2)
    assert p.nbytes == 21 * 200 + 21 * 2 * 4
    mantissa, _ = torch.frexp(p.scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    amax = torch.stack([x.reshape(21, 200)[:, :128].abs().amax(1), x.reshape(21, 200)[:, 128:].abs().amax(1)], 1)
    ratio = amax.float() / p.scales
    assert torch.all((ratio > 224) & (ratio <= 448))
    y = stage_codec.decode(p)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.float() - x.float()).abs()
    assert torch.all(err <= torch.maximum(2.0**-4 * x.float().abs(), 2.0**-10 * _scales_per_value(p)))
    q = stage_codec.encode(x)
    assert torch.equal(q.payload.view(torch.uint8), p.payload.view(torch.uint8)) and torch.equal(q.scales, p.scales)
    assert torch.equal(stage_codec.roundtrip(y), y)  # decoded values are fp8 values: a fixed point


def _pure_int8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Hand-made absmax int8 round trip of ``rows x last`` float32 values, blocks of ``block``."""
    pad = -x.shape[1] % block
    b = torch.nn.functional.pad(x, (0, pad)).reshape(x.shape[0], -1, block)
    s = b.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((b / s).round().clamp(-127, 127) * s).reshape(x.shape[0], -1)[:, : x.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step_or_fp8_per_block(dtype: torch.dtype) -> None:
    """int8: per block of 32 either a scale ``amax / 127`` with every value within half a step, or (a
    negative scale, where the largest value is over ``FP8_BLOCK_RATIO`` times the RMS of the others) fp8's
    power of two and fp8's bound; each block decodes to what absmax int8 or fp8 alone gives it; 1.125
    bytes a value; deterministic bytes."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 200, generator=g) * torch.logspace(-4, 4, 200)).to(dtype)
    x[0, 0, 40] = 3e3  # an outlier: its block is better off in fp8
    p = stage_codec.encode(x, fmt="int8")
    assert p.fmt == "int8" and p.block == 32 and p.payload.dtype == torch.int8 and p.scales.shape == (21, 7)
    assert p.nbytes == 21 * 200 + 21 * 7 * 4 and stage_codec.bytes_per_value(fmt="int8") == 1.125
    xf = x.float().reshape(21, 200)
    amax = torch.nn.functional.pad(xf, (0, 24)).reshape(21, 7, 32).abs().amax(-1)
    fp8 = p.scales < 0
    assert fp8[0, 1] and 0 < fp8.sum() < fp8.numel()
    assert torch.equal(p.scales[~fp8], amax[~fp8] / 127)
    ratio = amax[fp8] / -p.scales[fp8]
    assert torch.all((ratio > 224) & (ratio <= 448)) and torch.all(torch.frexp(-p.scales[fp8])[0] == 0.5)
    y = stage_codec.decode(p)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.float() - x.float()).reshape(21, 200)
    s = p.scales.abs().repeat_interleave(32, dim=1)[:, :200]
    eps = torch.finfo(dtype).eps * xf.abs()
    int8_ok = err.abs() <= 0.5 * s * (1 + 1e-6) + eps
    fp8_ok = err.abs() <= torch.maximum(2.0**-4 * xf.abs(), 2.0**-10 * s) + eps
    in_fp8 = fp8.repeat_interleave(32, dim=1)[:, :200]
    assert torch.all(torch.where(in_fp8, fp8_ok, int8_ok))
    if dtype == torch.float32:  # each block as absmax int8 or as fp8 (blocks of 32) would give it
        ref = torch.where(in_fp8, stage_codec.roundtrip(xf, 32, "fp8"), _pure_int8(xf))
        assert torch.equal(y.reshape(21, 200), ref)
    blocks = torch.nn.functional.pad(xf, (0, 24)).reshape(21, 7, 32)
    others = torch.stack([b[b.abs() < b.abs().max()].square().sum() for b in blocks.reshape(-1, 32)]).reshape(21, 7)
    assert torch.equal(fp8, (others > 0) & (amax.square() > stage_codec.FP8_BLOCK_RATIO**2 * others / 31))
    q = stage_codec.encode(x, fmt="int8")
    assert torch.equal(q.payload, p.payload) and torch.equal(q.scales, p.scales)
    with pytest.raises(ValueError, match="fmt='int4'"):
        stage_codec.encode(x, fmt="int4")


def test_int8_is_closer_than_fp8_and_outliers_cost_it_no_more() -> None:
    """Gaussian hidden states: under a quarter of fp8's RMS error. Three channels 1e3x the rest (LLM
    "massive activations"): absmax int8 alone coarsens their blocks to 13% RMS on the ordinary channels;
    with those blocks kept in fp8 the error stays under half of fp8's everywhere."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(256, 4096, generator=g)
    rms = lambda y, ref, cols=slice(None): ((y - ref)[:, cols].norm() / ref[:, cols].norm()).item()  # noqa: E731
    assert rms(stage_codec.roundtrip(z, fmt="int8"), z) < 0.25 * rms(stage_codec.roundtrip(z), z)
    assert 0.02 < rms(stage_codec.roundtrip(z), z) < 0.03
    z[:, [7, 1500, 3001]] *= 1e3
    keep = torch.ones(4096, dtype=torch.bool)
    keep[[7, 1500, 3001]] = False
    assert rms(_pure_int8(z), z, keep) > 0.1
    assert rms(stage_codec.roundtrip(z, fmt="int8"), z, keep) < 0.5 * rms(stage_codec.roundtrip(z), z, keep)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_zero_and_non_finite_blocks(fmt: str) -> None:
    """An all-zero block decodes to zeros; a block with inf or NaN decodes to NaN, the others intact."""
    x = torch.ones(2, 256)
    x[0, :128] = 0
    x[1, 130] = float("inf")
    x[1, 140] = float("nan")
    y = stage_codec.roundtrip(x, fmt=fmt)
    block = stage_codec.BLOCKS[fmt]
    assert torch.all(y[0, :128] == 0) and torch.all(y[0, 128:] == 1) and torch.all(y[1, :128] == 1)
    assert torch.isnan(y[1, 128 : 128 + block]).all() and torch.all(y[1, 128 + block :] == 1)


def test_only_hidden_states_are_taken() -> None:
    """Floating tensors of 2+ dims the job did not receive; in a dict, only under ``hidden_states``
    (not rotary tables, masks, position ids, labels or 1-d router statistics)."""
    h, cos, sin = torch.randn(2, 5, 8), torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    state = {
        "hidden_states": h,
        "position_embeddings": (cos, sin),
        "position_ids": torch.arange(5)[None],
        "masks": {"full_attention": torch.zeros(2, 1, 5, 5)},
        "labels": torch.ones(2, 5, dtype=torch.long),
        "router": (torch.zeros(4),),
    }
    leaves, spec = pytree.tree_flatten(((state,), {}))
    assert [t is h for t in leaves] == stage_codec.hidden_leaves(leaves, spec)
    assert not any(stage_codec.hidden_leaves(leaves, spec, passthrough=[h]))
    plain, pspec = pytree.tree_flatten(((h, cos, torch.zeros(3)), {}))
    assert stage_codec.hidden_leaves(plain, pspec, passthrough=[cos]) == [True, False, False]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(200, 200), nn.GELU()) for _ in range(4)])


def _loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, label)


def _roundpipe_step(mode: str, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, List[torch.Tensor]]:
    net = _net()
    plan = ModelExecutePlan.layerwise(4, "fused")  # stage inputs at layers 1 and 2 kept on the host
    cfg = RoundPipeRunConfig(num_microbatch=2, stage_inputs=mode, execute_plan=plan)  # type: ignore[arg-type]
    loss = RoundPipe(net, model_run_config=cfg).forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    return float(loss), [p.grad for p in net.parameters()]


def _reference(x: torch.Tensor, y: torch.Tensor, kept: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """Plain PyTorch, stage by stage as RoundPipe runs the layerwise plan: the forward on exact values, the
    last stage (fused) from its exact input, each other stage recomputed from ``kept(its input)`` (the
    model's input, stage 0's, exact), microbatch by microbatch."""
    net = _net()
    for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
        with torch.no_grad():
            hs = [xm]
            for layer in net[:-1]:
                hs.append(layer(hs[-1]))
        h = hs[-1].detach().requires_grad_(True)
        _loss(net[-1](h), ym).backward()
        grad = h.grad
        for i in (2, 1, 0):
            inp = (kept(hs[i]) if i else hs[i]).detach().requires_grad_(i > 0)
            net[i](inp).backward(grad)
            grad = inp.grad
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
def test_training_step_equals_the_reference_with_the_same_round_trip(workers: str, fmt: str) -> None:
    """Compact stage inputs: the loss of the exact forward, gradients exactly those of the hand-made reference
    whose recomputes start from ``stage_codec.roundtrip`` of the stage inputs, and close to the exact run's
    (cosine > 0.999); bf16 equals the reference without the round trip."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 200, generator=g), torch.randn(8, 200, generator=g)
    loss8, grads8 = _roundpipe_step(fmt, x, y)
    loss16, grads16 = _roundpipe_step("bf16", x, y)
    assert loss8 == loss16
    for got, ref in zip(grads8, _reference(x, y, lambda t: stage_codec.roundtrip(t, fmt=fmt))):
        assert torch.equal(got, ref)
    for got, ref in zip(grads16, _reference(x, y, lambda t: t)):
        assert torch.equal(got, ref)
    a, b = torch.cat([t.flatten() for t in grads8]), torch.cat([t.flatten() for t in grads16])
    assert 0.999 < torch.nn.functional.cosine_similarity(a, b, dim=0).item() < 1.0


def test_the_setting_and_the_run_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``RPP_STAGE_INPUTS`` reads bf16 / fp8 / int8 (any case); a bad value is an error naming it, when the model is
    built and at a call; ``RoundPipeRunConfig(stage_inputs=...)`` wins over it and checks its value."""
    monkeypatch.delenv("RPP_STAGE_INPUTS", raising=False)
    assert settings.STAGE_INPUTS.get() == "bf16"
    monkeypatch.setenv("RPP_STAGE_INPUTS", "FP8")
    assert settings.STAGE_INPUTS.get() == "fp8"
    monkeypatch.setenv("RPP_STAGE_INPUTS", "Int8")
    assert settings.STAGE_INPUTS.get() == "int8"
    monkeypatch.setenv("RPP_STAGE_INPUTS", "fp16")
    with pytest.raises(ValueError, match="RPP_STAGE_INPUTS='fp16': expected `bf16`"):
        settings.STAGE_INPUTS.get()
    with pytest.raises(ValueError, match="RPP_STAGE_INPUTS"):
        RoundPipe(_net())
    monkeypatch.delenv("RPP_STAGE_INPUTS")
    model = RoundPipe(_net(), model_run_config=RoundPipeRunConfig(num_microbatch=1))
    monkeypatch.setenv("RPP_STAGE_INPUTS", "int4")
    with pytest.raises(ValueError, match="RPP_STAGE_INPUTS"):
        model.forward_backward(input_args=(torch.randn(2, 200),), label=torch.randn(2, 200), loss_fn=_loss)
    with pytest.raises(ValueError, match="RPP_STAGE_INPUTS"):
        roundpipe.configure(stage_inputs="e5m2")
    with pytest.raises(ValueError, match="stage_inputs='fp4': expected one of 'bf16', 'fp8', 'int8'"):
        RoundPipeRunConfig(stage_inputs="fp4")  # type: ignore[arg-type]


def test_every_copy_of_the_modes_agrees() -> None:
    """The modes come from one list (``settings.STAGE_INPUT_MODES``); the run config's type and the estimate's
    block sizes repeat it (the estimate imports no torch) and must agree with it."""
    import typing

    from roundpipe.cli.config import STAGE_INPUTS
    from roundpipe.runtime.run_config import StageInputs

    assert stage_codec.MODES == settings.STAGE_INPUT_MODES == STAGE_INPUTS == typing.get_args(StageInputs)
    assert ("bf16", *stage_codec.BLOCKS) == stage_codec.MODES and memory_terms.STAGE_CODEC_BLOCKS == stage_codec.BLOCKS


def test_estimate_term_and_block_size_agree() -> None:
    """The estimate's copy of the block sizes is the codec's; fp8 costs 1 byte and 4 / 128 per value, int8
    1 byte and 4 / 32."""
    assert memory_terms.STAGE_CODEC_BLOCKS == stage_codec.BLOCKS and memory_terms.STAGE_CODEC_BLOCK == stage_codec.BLOCK
    assert stage_codec.bytes_per_value() == 1 + 4 / 128
    shape = estimate.ModelShape.builtin("qwen3-8b")  # hidden 4096: 32 scales per token (fp8), 128 (int8)
    assert memory_terms.checkpoint_bytes_per_token(shape, 2, "fp8") == 4096 + 32 * 4
    assert memory_terms.checkpoint_bytes_per_token(shape, 2, "int8") == 4096 + 128 * 4
    assert memory_terms.checkpoint_bytes_per_token(shape, 2, "bf16") == 8192


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_causal_lm_keeps_its_hidden_states_compact_and_plans_for_it(
    workers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hugging Face preset, one layer per stage: only hidden states are encoded (one per kept stage input
    and microbatch, rotary tables and the rest exact), the gradients stay close to exact stage inputs'
    (cosine 0.9986 on this random model of hidden 32), and the planner's profile counts the compact
    checkpoints (payload and scales, each pinned-rounded)."""
    from test_budget import _profile
    from test_models import grads, make_batch, tiny_model

    hf = tiny_model("qwen3")
    batch = {k: v for k, v in make_batch(False, batch=4, seq=16).items() if v is not None}
    shapes: List[Any] = []
    real = stage_codec.encode
    monkeypatch.setattr(stage_codec, "encode", lambda t, *a, **k: (shapes.append(tuple(t.shape)), real(t, *a, **k))[1])
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for mode in ("bf16", "fp8"):
        model = copy.deepcopy(hf)
        n = len(roundpipe.wrap_model_to_roundpipe(model).layers)
        plan = ModelExecutePlan.layerwise(n, "fused")
        cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, stage_inputs=mode)  # type: ignore[arg-type]
        rp = roundpipe.wrap_model_to_roundpipe(model, model_run_config=cfg)
        rp.train_step(**batch)
        rp.synchronize()
        out[mode] = grads(model)
    hidden = hf.config.hidden_size
    # Layers: prefix, the decoder layers, the head (fused): inputs kept at every decoder layer, 2 microbatches.
    assert shapes == [(2, 16, hidden)] * (2 * hf.config.num_hidden_layers)
    a = torch.cat([t.flatten() for t in out["fp8"].values()])
    b = torch.cat([t.flatten() for t in out["bf16"].values()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() > 0.995
    rp16 = roundpipe.wrap_model_to_roundpipe(copy.deepcopy(hf), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    rp8 = roundpipe.wrap_model_to_roundpipe(
        copy.deepcopy(hf), model_run_config=RoundPipeRunConfig(num_microbatch=2, stage_inputs="fp8")
    )
    tokens, e = 2 * 16, 4  # per microbatch; float32 model
    scales = 4 * -(-hidden // stage_codec.BLOCK)
    pow2 = lambda b: 1 << (b - 1).bit_length()  # noqa: E731
    assert max(_profile(rp16, batch).checkpoint) == 2 * pow2(tokens * hidden * e)
    assert max(_profile(rp8, batch).checkpoint) == 2 * (pow2(tokens * hidden) + pow2(tokens * scales))


def test_roundpipe_train_passes_the_choice_to_the_model() -> None:
    """``roundpipe train --stage-inputs fp8`` reaches the model's run configuration (unset: the setting)."""
    from test_models import tiny_model

    from roundpipe.cli.config_flags import parse_train_args
    from roundpipe.cli.pipeline import PipelineModel

    assert parse_train_args(["--stage-inputs", "fp8"]).cfg.stage_inputs == "fp8"
    assert parse_train_args([]).cfg.stage_inputs is None
    assert PipelineModel(tiny_model("qwen3"), 1, stage_inputs="fp8").rp.model_run_config.stage_inputs == "fp8"
