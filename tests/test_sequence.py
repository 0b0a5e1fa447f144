"""One sequence cut into tiles over the pool (``RoundPipeRunConfig(sequence_tiles=T)``, roundpipe.runtime.sequence):
loss and every gradient equal the unsplit sequence's, in float64 on 1-3 CPU workers, at several tile
counts (even and uneven), both recompute grains, LoRA, stages of one and several layers, layers tiled
inside (``RPP_SEQ_TILE``) or not; and the refusals.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import LORA_PROJECTIONS, rel_err, with_lora
from torch import nn

from roundpipe import models, settings
from roundpipe.devices import device as device_mod
from roundpipe.models import configs
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.runtime import sequence
from roundpipe.runtime.run_config import RoundPipeRunConfig

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_models import VOCAB, grads  # noqa: E402

pytestmark = pytest.mark.stream_checks  # run with RPP_DEBUG_CHECK_STREAMS=1 (tests/conftest.py)

TOL = 1e-10
HF_TOL = 1e-6  # fp64 against Hugging Face itself: its RMSNorms round through fp32 (as in test_tiling)


def _model(family: str, lora: bool) -> nn.Module:
    torch.manual_seed(0)
    tied = dict(tie_word_embeddings=True) if family == "qwen3" else {}
    config = configs.tiny_config(family, attn_implementation="sdpa", **tied)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    return with_lora(model, LORA_PROJECTIONS, seed=7) if lora else model


def _batch(rows: int = 2, seq: int = 22) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, 5] = -100
    labels[-1, 11] = -100  # an ignored target at a tile boundary of 2 tiles
    return {"input_ids": ids, "labels": labels}


def _reference(model: nn.Module, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    with settings.overridden(seq_tile=0):
        out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), grads(model)


def _assert_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == ref.keys()
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"{worst}: rel err {errs[worst]:.2e}"


# Layers: 0 prefix, 1-3 decoder layers, 4 head; one layer per stage, or stages of two and three layers.
PLANS = {
    "auto": None,
    "staged": ModelExecutePlan([range(0, 2), range(2, 5)], [range(0, 2), range(2, 5)]),
}


@pytest.mark.parametrize(
    "workers,family,lora,tiles,grain,plan,seq_tile,attention",
    [
        ("cpu:1", "qwen3", False, 2, "stage", "auto", 0, "auto"),
        ("cpu:2", "qwen3", False, 2, "stage", "auto", 0, "bias"),
        ("cpu:3", "qwen3", True, 3, "layer", "staged", 0, "auto"),
        ("cpu:2", "qwen3", True, 3, "layer", "staged", 0, "auto"),
        ("cpu:3", "llama", False, 4, "layer", "auto", 4, "bias"),
        ("cpu:1", "llama", True, 5, "stage", "staged", 3, "auto"),
        ("cpu:2", "llama", True, 5, "stage", "staged", 3, "split"),
    ],
    indirect=["workers"],
)
def test_tiles_equal_the_unsplit_sequence(
    workers: str, family: str, lora: bool, tiles: int, grain: str, plan: str, seq_tile: int, attention: str
) -> None:
    """fp64: ``train_step`` and ``forward`` + ``loss.backward()`` over ``tiles`` tiles (22 tokens: 11 + 11,
    8 + 7 + 7, 6 + 6 + 5 + 5, 5 + 5 + 4 + 4 + 4) give the loss and gradients of the same model run on the
    unsplit sequence to 1e-10, and Hugging Face's to its fp32 norms' rounding; with either tile attention
    (``RPP_DEBUG_TILE_ATTENTION``: split blocks, the default on CPU workers, or one masked call)."""
    settings.configure(debug_tile_attention=attention)
    model = _model(family, lora)
    batch = _batch()
    hf_loss, hf_grads = _reference(model, batch)
    settings.configure(seq_tile=seq_tile)
    whole = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain, execute_plan=PLANS[plan])
    ref_loss = models.wrap_model(model, model_run_config=whole).train_step(**batch)
    ref_grads = grads(model)
    assert rel_err(ref_loss, hf_loss) < HF_TOL
    _assert_close(ref_grads, hf_grads, HF_TOL)
    cfg = RoundPipeRunConfig(sequence_tiles=tiles, recompute_grain=grain, execute_plan=PLANS[plan])
    rp = models.wrap_model(model, model_run_config=cfg)
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    _assert_close(grads(model), ref_grads, TOL)
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss.detach(), ref_loss) < TOL
    _assert_close(grads(model), ref_grads, TOL)
    with torch.no_grad():  # an evaluation: forward jobs only
        assert rel_err(rp(**batch).loss, ref_loss) < TOL


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_tiles_accumulate_and_train_like_the_unsplit_model(workers: str) -> None:
    """Three synchronous Adam steps on the tiled call move the weights as on the unsplit sequence."""
    ref_model, model = _model("qwen3", False), _model("qwen3", False)
    batch = _batch()
    runs = []
    for m, cfg in ((ref_model, RoundPipeRunConfig(num_microbatch=1)), (model, RoundPipeRunConfig(sequence_tiles=3))):
        rp = models.wrap_model(m, model_run_config=cfg)
        opt = torch.optim.Adam(rp.optim_parameters(), lr=1e-2)
        runs.append((rp, opt))
    for _ in range(3):
        for rp, opt in runs:
            rp.train_step(**batch)
            rp.step(lambda opt=opt: (opt.step(), opt.zero_grad()), is_async=False)
    for rp, _ in runs:
        rp.synchronize()
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert rel_err(q, p) < 1e-9, name


@pytest.mark.parametrize("attention,scale", [("split", None), ("split", 0.3), ("bias", None), ("bias", 0.3)])
@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_attend_matches_full_causal_attention_with_gqa(workers: str, attention: str, scale: Optional[float]) -> None:
    """The tile attention (prefix + own keys, bottom-right causal, key heads repeated) equals the rows of
    full causal attention, forward and gradients, through the key/value accumulators: as two flash
    blocks merged by their log-sum-exp (``tile_attention``) and as one masked call."""
    settings.configure(debug_tile_attention=attention)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=scale
    ).transpose(1, 2)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]

    dev = device_mod.get_devices()[0]
    seq = sequence.SequenceRun.from_lengths([5, 4, 3])
    fwd = seq.job_store(dev, backward=False)
    outs = []
    with torch.no_grad():
        for m in range(3):
            s, e = seq.starts[m], seq.starts[m + 1]
            with sequence.tile(fwd, m):
                outs.append(sequence.attend(0, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale, 0.0))
    assert rel_err(torch.cat(outs, 1), ref) < TOL
    fwd.finish(keep=True)
    bwd = seq.job_store(dev, backward=True)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for m in (2, 1, 0):
        s, e = seq.starts[m], seq.starts[m + 1]
        parts = [t.detach()[:, :, s:e].clone().requires_grad_() for t in (q, k, v)]
        with sequence.tile(bwd, m):
            out = sequence.attend(0, *parts, scale, 0.0)
        (out * w[:, s:e]).sum().backward()
        for g, p in zip(got, parts):
            g[:, :, s:e] = p.grad
    for g, r in zip(got, ref_grads):
        assert rel_err(g, r) < TOL


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_tiles_refuse_what_they_cannot_compute(workers: str) -> None:
    model = _model("llama", False)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(sequence_tiles=2))
    batch = _batch()
    with pytest.raises(ValueError, match="padding"):
        mask = torch.ones_like(batch["input_ids"])
        mask[0, 0] = 0
        rp.train_step(**batch, attention_mask=mask)
    with pytest.raises(ValueError, match="more than the sequence"):
        rp.train_step(input_ids=batch["input_ids"][:, :1], labels=batch["labels"][:, :1])
    with pytest.raises(ValueError, match="forward_backward"):
        rp.forward_backward(input_kwargs=dict(batch))
    with pytest.raises(ValueError, match="sequence_tiles"):
        RoundPipeRunConfig(sequence_tiles=0)
    eager = transformers.AutoModelForCausalLM.from_config(
        configs.tiny_config("llama", attn_implementation="eager")
    ).double()
    rp2 = models.wrap_model(eager, model_run_config=RoundPipeRunConfig(sequence_tiles=2))
    with pytest.raises(ValueError, match="sdpa"):
        rp2.train_step(**batch)
    assert sequence.active() is None


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_the_planner_counts_a_jobs_keys_and_values(workers: str) -> None:
    """The activation profile the planner budgets with: a tile's decoder layer keeps what the same-sized
    microbatch keeps plus its keys and values over the whole sequence with float32 accumulators, and
    peaks higher by the [prefix, tile] attention inputs too (hand-computed)."""
    from roundpipe.batch import Batch
    from roundpipe.models.sequence_inputs import split_along_sequence
    from roundpipe.runtime.run_config import ResolvedRunConfig

    model = _model("llama", False)
    rp = models.wrap_model(model)
    seq, tiles = 24, 3
    ids = torch.randint(1, 64, (1, seq))
    pos = torch.arange(seq)[None]
    kwargs = {"input_ids": ids, "position_ids": pos, "options": {}}
    tiled_cfg = ResolvedRunConfig(
        RoundPipeRunConfig(sequence_tiles=tiles, num_microbatch=tiles, split_input=split_along_sequence),
        RoundPipeRunConfig(),
    )
    plain_cfg = ResolvedRunConfig(RoundPipeRunConfig(num_microbatch=1), RoundPipeRunConfig())
    small = {"input_ids": ids[:, : seq // tiles], "position_ids": pos[:, : seq // tiles], "options": {}}
    tiled = rp.activation_profile(Batch((), kwargs, tiled_cfg), "stage")
    plain = rp.activation_profile(Batch((), small, plain_cfg), "stage")
    config = model.config
    kv_dim = config.num_key_value_heads * config.head_dim
    q_dim = config.num_attention_heads * config.head_dim
    e = 8  # float64
    kv = seq * kv_dim * 2 * (e + 4)
    prefix = seq * 2 * (2 * q_dim + kv_dim) * e
    for i in range(1, 1 + config.num_hidden_layers):
        assert tiled.kept[i] == plain.kept[i] + kv
        assert tiled.peak[i] == plain.peak[i] + kv + prefix
