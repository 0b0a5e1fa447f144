"""Sequential presets reproduce the Hugging Face model: loss and every parameter gradient.

Two executors run the preset layers:
* ``emulate_forward`` / ``emulate_forward_backward`` below: RoundPipe's semantics run sequentially
  (split the batch into microbatches, each layer's forward saves its recompute data, the backward
  recomputes every layer from it, outputs merged as RoundPipe merges them);
* the real RoundPipe on two CPU workers.
Everything is fp32 with tiny random models; rel. error is ||a - b|| / ||b|| per tensor.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Dict, Iterator, List

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from roundpipe import models, settings
from roundpipe.models import configs, families
from roundpipe.models.loss import count_loss_tokens
from roundpipe.models.preset import CausalLMPrefix, CausalLMPreset
from roundpipe.runtime.context import ForwardCtx, RecomputeCtx
from roundpipe.runtime.run_config import RoundPipeRunConfig

# Tiny models: intra-op threads only add synchronisation overhead (8x slower on the 2-core CI).
torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")

TOL = 1e-5
FAMILIES = ["qwen3", "llama", "qwen3_moe", "gpt_oss", "qwen2", "mistral"]

# ---------------------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------------------

VOCAB = configs.TINY["vocab_size"]
MIXED_LAYERS = ["full_attention", "sliding_attention", "full_attention"]
SLIDING = dict(layer_types=MIXED_LAYERS, sliding_window=4, use_sliding_window=True)
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)
TINY_OVERRIDES: Dict[str, Dict[str, Any]] = {
    "qwen3": dict(SLIDING, tie_word_embeddings=True),
    "llama": {},
    "qwen2": SLIDING,
    "mistral": dict(sliding_window=4),
    # layer 1 is dense (mlp_only_layers): it must not contribute to the router loss.
    "qwen3_moe": dict(ROUTER_LOSS, mlp_only_layers=[1]),
    "gpt_oss": ROUTER_LOSS,
}
"""What each family's test model sets beyond :func:`roundpipe.models.configs.tiny_config`."""


def tiny_config(family: str) -> Any:
    """A 3-layer config of ``family``; sliding windows (4) shorter than the test sequences (10)."""
    return configs.tiny_config(family, **TINY_OVERRIDES[family])


def tiny_model(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family)).float()


def make_batch(padding: bool, batch: int = 6, seq: int = 10, seed: int = 1) -> Dict[str, torch.Tensor]:
    """Token ids, attention mask and labels (-100 on padding); left padding in two rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding:
        mask[1, :3] = 0
        mask[batch - 2, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 4] = -100  # an ignored label inside a sequence
    return {"input_ids": ids, "attention_mask": mask if padding else None, "labels": labels}


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert got.keys() == ref.keys()
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"{worst}: rel err {errs[worst]:.2e}"


def hf_reference(model: nn.Module, batch: Dict[str, torch.Tensor], **kwargs: Any):
    """Loss of the unsplit Hugging Face model and its parameter gradients."""
    out = model(**{k: v for k, v in batch.items() if v is not None}, **kwargs)
    out.loss.backward()
    return out.loss.detach(), grads(model)


def hf_microbatch_aux_reference(model: nn.Module, batch: Dict[str, torch.Tensor], num_microbatch: int):
    """What ``train_step`` computes for an MoE model: the whole batch's mean token loss plus the router
    loss of each microbatch weighted by its share of the (unpadded) tokens."""
    ce = model(**{k: v for k, v in batch.items() if v is not None}, output_router_logits=False).loss
    mask = batch["attention_mask"]
    total = float(mask.sum()) if mask is not None else batch["input_ids"].numel()
    aux = 0.0
    for m in range(num_microbatch):
        part = {k: torch.tensor_split(v, num_microbatch)[m] for k, v in batch.items() if v is not None}
        out = model(**part, output_router_logits=True)
        tokens = float(part["attention_mask"].sum()) if mask is not None else part["input_ids"].numel()
        aux = aux + out.aux_loss * (tokens / total)
    loss = ce + model.router_aux_loss_coef * aux
    loss.backward()
    return loss.detach(), grads(model)


# ---------------------------------------------------------------------------------------------------------
# RoundPipe semantics, sequentially
# ---------------------------------------------------------------------------------------------------------


def _split(tree: Any, num: int) -> List[Any]:
    leaves, spec = tree_flatten(tree)
    batch = next(t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1)
    parts: List[List[Any]] = [[] for _ in range(num)]
    for leaf in leaves:
        pieces = (
            torch.tensor_split(leaf, num)
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch
            else [leaf] * num
        )
        for p, x in zip(parts, pieces):
            p.append(x)
    return [tree_unflatten(p, spec) for p in parts]


def _merge(outs: List[Any]) -> Any:
    flat = [tree_flatten(o) for o in outs]
    merged = []
    for leaves in zip(*[f[0] for f in flat]):
        x = leaves[0]
        if isinstance(x, torch.Tensor):
            merged.append(torch.cat(leaves) if x.dim() >= 1 else torch.stack(leaves))
        else:
            merged.append(x)
    return tree_unflatten(merged, flat[0][1])


def _run_microbatch(layers: nn.Sequential, kwargs: Dict[str, Any], saved_log: List[Any]) -> Any:
    """Forward of every layer recording what it saves (graph dropped), then the backward recompute of
    every layer from its saved data, with gradients."""
    saved: List[Any] = []
    x: Any = None
    for i, layer in enumerate(layers):
        box: List[Any] = []
        with ForwardCtx(lambda *d: box.append(d)), torch.enable_grad():
            y = layer(**kwargs) if i == 0 else layer(x)
        saved.append(box[0] if box else None)
        x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    saved_log.append(saved)
    for i, layer in enumerate(layers):
        with RecomputeCtx(saved[i]):
            x = layer(**kwargs) if i == 0 else layer(x)
    return x


def emulate_forward(layers: nn.Sequential, kwargs: Dict[str, Any], num_microbatch: int, saved_log=None) -> Any:
    """``RoundPipe.forward``: merged outputs, connected to autograd."""
    log = [] if saved_log is None else saved_log
    return _merge([_run_microbatch(layers, kw, log) for kw in _split(kwargs, num_microbatch)])


def emulate_forward_backward(
    layers: nn.Sequential, kwargs: Dict[str, Any], loss_fn: Callable[[Any, Any], torch.Tensor], num_microbatch: int
) -> torch.Tensor:
    """``RoundPipe.forward_backward``: backward of the sum of per-microbatch losses."""
    total = torch.zeros(())
    for kw in _split(kwargs, num_microbatch):
        loss = loss_fn(_run_microbatch(layers, kw, []), None)
        loss.backward()
        total = total + loss.detach()
    return total


# ---------------------------------------------------------------------------------------------------------
# Emulated RoundPipe
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "ones"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reads_nothing_back_from_the_device(family: str, mask: str) -> None:
    """Without position ids and without padding (no attention mask, or an all-ones one), the first
    stage (embedding, rotary tables, masks) issues no op that would make the device thread wait for the
    GPU (transformers' packed-sequence check on default positions, and its padding check of an all-ones
    mask, did: ``if (...).all()`` on a device tensor, once per microbatch)."""
    from helpers import SyncRecorder

    preset = models.build_preset(tiny_model(family))
    ids = make_batch(False)["input_ids"]
    ones = torch.ones_like(ids) if mask == "ones" else None
    kwargs = preset.forward_kwargs(input_ids=ids, labels=ids, attention_mask=ones)
    with torch.no_grad(), SyncRecorder() as rec:
        state = preset.layers[0](**kwargs)
    assert state["hidden_states"].shape[:2] == ids.shape
    assert not rec.syncs, rec.syncs
    # The counted-token number for the head, read on the host later without a wait.
    assert state["num_loss_tokens"].item() == count_loss_tokens(ids)


def test_all_ones_attention_mask_equals_no_mask() -> None:
    """An all-ones mask is dropped on the host (same result as transformers with it); a mask with
    padding, or one given with position ids, is kept."""
    model = tiny_model("qwen3")
    batch = make_batch(False)
    ref_loss, ref_grads = hf_reference(model, dict(batch, attention_mask=torch.ones_like(batch["input_ids"])))
    preset = models.build_preset(model)
    ones = torch.ones_like(batch["input_ids"])
    assert "attention_mask" not in preset.forward_kwargs(input_ids=batch["input_ids"], attention_mask=ones)
    assert "attention_mask" in preset.forward_kwargs(
        input_ids=batch["input_ids"], attention_mask=ones, position_ids=torch.arange(10).expand(6, -1)
    )
    assert "attention_mask" in preset.forward_kwargs(**make_batch(True))
    rp = models.wrap_model(model, model_run_config=RUN3)
    loss = rp.train_step(**dict(batch, attention_mask=ones))
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


def test_router_statistics_read_nothing_back() -> None:
    """MoE router statistics without a mask count experts with scatter_add (bincount would make a GPU
    wait for its output size): no syncing op, and the counts of bincount."""
    from helpers import SyncRecorder

    from roundpipe.models.preset import MoESpec, accumulate_router_stats

    moe = MoESpec(
        router_class=nn.Linear, output_index=0, num_experts=8, top_k=2, aux_loss_coef=0.01, output_router_logits=True
    )
    logits = torch.randn(50, 8)
    zero = (torch.zeros(8), torch.zeros(8), torch.zeros(()))
    with SyncRecorder() as rec:
        tokens, probs, rows = accumulate_router_stats(zero, logits, None, moe)
    assert not rec.syncs, rec.syncs
    selected = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
    assert torch.equal(tokens, torch.bincount(selected.reshape(-1), minlength=8).float())
    assert float(rows) == 50


@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("family", FAMILIES)
def test_preset_forward_matches_hf(family: str, padding: bool) -> None:
    """forward(labels) + loss.backward() over 3 microbatches == the unsplit HF model (MoE: with the
    router aux loss of the whole batch)."""
    model = tiny_model(family)
    batch = make_batch(padding)
    ref_loss, ref_grads = hf_reference(model, batch)
    preset = models.build_preset(model)
    saved: List[Any] = []
    merged = emulate_forward(preset.layers, preset.forward_kwargs(**batch), 3, saved)
    out = preset.build_output(merged)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    assert out.logits is None  # no full logits in a training forward unless asked
    # The prefix computed masks and rotary tables once and its recompute reused them.
    assert all(s[0] is not None for s in saved)
    if preset.spec.moe is not None:
        assert out.aux_loss is not None and preset.num_router_layers == (2 if family == "qwen3_moe" else 3)


@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("family", FAMILIES)
def test_preset_train_step_matches_hf(family: str, padding: bool) -> None:
    """forward_backward with the preset's per-microbatch loss_fn: loss and gradients of the batch mean."""
    model = tiny_model(family)
    batch = make_batch(padding)
    preset = models.build_preset(model)
    if preset.spec.moe is not None:
        ref_loss, ref_grads = hf_microbatch_aux_reference(model, batch, 3)
    else:
        ref_loss, ref_grads = hf_reference(model, batch)
    kwargs = preset.forward_kwargs(**batch, return_logits=False)
    loss = emulate_forward_backward(preset.layers, kwargs, preset.microbatch_loss_fn(kwargs), 3)
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_logits_and_logits_to_keep(family: str) -> None:
    model = tiny_model(family).eval()
    batch = make_batch(padding=True)
    del batch["labels"]
    preset = models.build_preset(model)
    with torch.no_grad():
        ref = model(**batch).logits
        got = preset.build_output(emulate_forward(preset.layers, preset.forward_kwargs(**batch), 3)).logits
        ref_last = model(**batch, logits_to_keep=2).logits
        got_last = preset.build_output(
            emulate_forward(preset.layers, preset.forward_kwargs(**batch, logits_to_keep=2), 3)
        ).logits
    assert got.shape == ref.shape and rel_err(got, ref) < TOL
    assert got_last.shape == ref_last.shape == (6, 2, VOCAB) and rel_err(got_last, ref_last) < TOL


def test_inputs_embeds_and_position_ids() -> None:
    """inputs_embeds instead of input_ids, explicit per-row position ids (split with the batch)."""
    model = tiny_model("llama")
    batch = make_batch(padding=False)
    embeds = model.model.embed_tokens(batch["input_ids"]).detach()
    position_ids = torch.arange(10).repeat(6, 1) + torch.arange(6).unsqueeze(1)
    ref_loss, ref_grads = hf_reference(
        model, {"inputs_embeds": embeds, "labels": batch["labels"], "position_ids": position_ids}
    )
    ref_grads.pop("model.embed_tokens.weight", None)
    preset = models.build_preset(model)
    kwargs = preset.forward_kwargs(inputs_embeds=embeds, position_ids=position_ids, labels=batch["labels"])
    out = preset.build_output(emulate_forward(preset.layers, kwargs, 3))
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


def test_preset_shares_parameters() -> None:
    """Pipeline layers hold the model's own parameters (tied embedding included), never copies."""
    model = tiny_model("qwen3")
    preset = models.build_preset(model)
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in preset.layers.parameters()} == own
    assert preset.layers[0].embed_tokens.weight is preset.layers[-1].lm_head.weight
    assert isinstance(preset.layers[0], CausalLMPrefix) and len(preset.layers) == 3 + 2


def _shrunk_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    sizes = dict(
        configs.TINY,
        moe_intermediate_size=32,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        shared_expert_intermediate_size=32,
        bos_token_id=1,
        eos_token_id=2,
    )
    for k, v in sizes.items():
        if hasattr(config, k):
            setattr(config, k, v)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = MIXED_LAYERS
    for k, v in list(vars(config).items()):  # make multipliers / scales matter
        if (
            isinstance(v, float)
            and v
            and "rope" not in k
            and any(w in k for w in ("multiplier", "scaling", "logit_scale", "softcap"))
        ):
            setattr(config, k, v * 0.7)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits, config.router_aux_loss_coef = True, 0.1
    return config


@pytest.mark.parametrize("model_type", families.verified_model_types())
def test_verified_families(model_type: str) -> None:
    """Every model type the family table calls verified: whole-batch loss and gradients over 2
    microbatches, from the type's default config shrunk."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} not in this transformers")
    torch.manual_seed(0)
    # eval(): no router jitter noise (PhiMoE), which would draw different random numbers per microbatch.
    model = transformers.AutoModelForCausalLM.from_config(_shrunk_config(model_type)).float().eval()
    batch = make_batch(padding=True, batch=4)
    ref_loss, ref_grads = hf_reference(model, batch)
    preset = models.build_preset(model)
    out = preset.build_output(emulate_forward(preset.layers, preset.forward_kwargs(**batch), 2))
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


def test_unknown_models_raise_naming_the_class(caplog: pytest.LogCaptureFixture) -> None:
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    with pytest.raises(NotImplementedError, match="Toy"):
        models.build_preset(Toy())
    classifier = transformers.Qwen3ForSequenceClassification(tiny_config("qwen3"))
    with pytest.raises(NotImplementedError, match="Qwen3ForSequenceClassification"):
        models.build_preset(classifier)
    with pytest.raises(NotImplementedError, match="Qwen3ForSequenceClassification"):
        models.wrap_model(classifier)


def test_unverified_layout_gets_generic_preset_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama")
    model.config.model_type = "my_llama_fork"
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        preset = models.build_preset(model)
    assert isinstance(preset, CausalLMPreset) and "not verified" in caplog.text


def test_disable_torch_compile_flag() -> None:
    assert settings.DISABLE_TORCH_COMPILE.get() == (os.environ.get("RPP_DISABLE_TORCH_COMPILE") == "1")


# ---------------------------------------------------------------------------------------------------------
# Real RoundPipe (two CPU workers, 3 microbatches)
# ---------------------------------------------------------------------------------------------------------

RUN3 = RoundPipeRunConfig(num_microbatch=3)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("family", FAMILIES)
def test_roundpipe_matches_hf(workers: str, family: str, padding: bool) -> None:
    _check_roundpipe_against_hf(family, padding)


def _check_roundpipe_against_hf(family: str, padding: bool) -> None:
    """forward + backward, then the fused train_step, of the wrapped model equal Hugging Face's."""
    model = tiny_model(family)
    batch = make_batch(padding)
    ref_loss, ref_grads = hf_reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RUN3)
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)

    if rp.preset.spec.moe is not None:
        ref_loss, ref_grads = hf_microbatch_aux_reference(model, batch, 3)
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_stage_inputs_on_the_device_match_hf(workers: str, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RPP_DEBUG_DEVICE_SAVED_GB on one device: the decoder stages' saved inputs (hidden states with the masks
    and rotary tables of the state) stay on the device; forward + backward and the fused train_step
    still equal Hugging Face."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "1")
    _check_roundpipe_against_hf(family, padding=True)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_roundpipe_logits_and_shimming(workers: str, tmp_path) -> None:
    model = tiny_model("qwen3").eval()
    batch = make_batch(padding=True)
    del batch["labels"]
    with torch.no_grad():
        ref = model(**batch).logits
    rp = models.wrap_model(model, model_run_config=RUN3)
    with torch.no_grad():
        got = rp(**batch).logits
    assert rel_err(got, ref) < TOL
    assert rp.config is model.config and rp.generation_config is model.generation_config
    rp.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        assert rel_err(reloaded(**batch).logits, ref) < TOL


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_roundpipe_recompute_reuses_prefix_masks(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks and rotary tables are built once per microbatch; the backward recompute reuses them."""
    calls = []
    original = CausalLMPrefix._masks
    monkeypatch.setattr(CausalLMPrefix, "_masks", lambda self, *a: calls.append(1) or original(self, *a))
    rp = models.wrap_model(tiny_model("qwen3"), model_run_config=RUN3)
    rp(**make_batch(padding=True)).loss.backward()
    assert len(calls) == 3


def test_prefix_keeps_the_rotary_tables_of_default_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix computes the rotary tables of default positions once per device and length and hands the
    same tensors to later microbatches (the values the rotary module gives); positions the caller gives,
    another length, a rotary variant whose tables may change, or a sequence above the limit are computed."""
    from roundpipe.models import preset as preset_mod

    prefix = models.build_preset(tiny_model("qwen3")).layers[0]
    calls: List[int] = []
    rotary = prefix.rotary_emb
    original = type(rotary).forward
    monkeypatch.setattr(type(rotary), "forward", lambda self, x, pos: calls.append(1) or original(self, x, pos))
    ids = torch.randint(1, VOCAB, (2, 10))
    first = prefix(input_ids=ids)["position_embeddings"]
    again = prefix(input_ids=ids.flip(0))["position_embeddings"]
    assert len(calls) == 1 and all(a is b for a, b in zip(first, again))
    embeds = prefix.embed_tokens(ids)
    want = original(rotary, embeds, torch.arange(10).unsqueeze(0))
    assert all(torch.equal(a, b) for a, b in zip(first, want))
    positions = torch.arange(10).unsqueeze(0).expand(2, -1)
    given = prefix(input_ids=ids, position_ids=positions)["position_embeddings"]
    assert len(calls) == 2 and all(torch.equal(a.expand_as(b), b) for a, b in zip(first, given))
    prefix(input_ids=ids[:, :7])
    assert len(calls) == 3
    prefix(input_ids=ids)
    assert len(calls) == 4  # one length kept per device: 7 replaced 10
    monkeypatch.setattr(preset_mod, "ROPE_CACHE_MAX_TOKENS", 9)
    prefix(input_ids=ids)
    prefix(input_ids=ids)
    assert len(calls) == 6
    monkeypatch.setattr(preset_mod, "ROPE_CACHE_MAX_TOKENS", 32768)
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    prefix(input_ids=ids)
    prefix(input_ids=ids)
    assert len(calls) == 8


# ---------------------------------------------------------------------------------------------------------
# The family table, SUPPORTED_MODELS and third-party presets
# ---------------------------------------------------------------------------------------------------------


def test_supported_models_is_the_table() -> None:
    """SUPPORTED_MODELS lists the verified types of the table, each mapped to the built-in preset; every
    model type is in one record only; the fused-kernel classes are the ones the table names."""
    from roundpipe.models import kernels

    assert models.SUPPORTED_MODELS == {t: models.BUILTIN for t in families.verified_model_types()}
    assert {"qwen3", "llama", "qwen3_moe", "gpt_oss", "mistral", "cohere"} <= set(models.SUPPORTED_MODELS)
    assert not {"nanochat", "granitemoe", "hyperclovax"} & set(models.SUPPORTED_MODELS)
    listed = [t for f in families.FAMILIES for t in f.model_types]
    assert len(listed) == len(set(listed)) == len(families.BY_MODEL_TYPE)
    with pytest.raises(ValueError, match="'qwen3' is in families 'qwen3' and 'again'"):
        families._index((*families.FAMILIES, families.ModelFamily("again", ("qwen3",))))
    named = {
        getattr(importlib.import_module(f.fused_kernels.module), cls)
        for f in families.FAMILIES
        if f.fused_kernels is not None
        for cls in (f.fused_kernels.decoder_layer, f.fused_kernels.attention, f.fused_kernels.mlp, f.fused_kernels.norm)
    }
    assert set(kernels.fused_base_classes()) == named and len(named) == 8  # Qwen3 and Llama


@pytest.mark.parametrize("family", FAMILIES)
def test_family_specs(family: str) -> None:
    """What the records say reaches the spec: fused kernels (Qwen3, Llama), mask quirk (GPT-OSS), MoE."""
    spec = models.build_preset(tiny_model(family)).spec
    assert spec.fused_kernels == (family in ("qwen3", "llama"))
    assert spec.mask_uses_position_ids == (family != "gpt_oss")
    assert (spec.moe is not None) == (family in ("qwen3_moe", "gpt_oss"))


def test_moe_family_without_router_recorder_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM: router logits recorder not found"):
        models.family_spec(tiny_model("llama"), families.family_of("qwen3_moe"))


def test_unverified_table_entries_get_overrides_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Granite-MoE: not verified (warning), but Granite's multipliers from its record."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "granitemoe" not in CONFIG_MAPPING:
        pytest.skip("granitemoe not in this transformers")
    config = _shrunk_config("granitemoe")
    model = transformers.AutoModelForCausalLM.from_config(config)
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        spec = models.build_preset(model).spec
    assert "not verified" in caplog.text
    assert spec.embedding_multiplier == config.embedding_multiplier and spec.logit_scale == 1.0 / config.logits_scaling


def test_incompatible_types_are_refused() -> None:
    model = tiny_model("llama")
    model.config.model_type = "diffllama"
    with pytest.raises(
        NotImplementedError, match=r"LlamaForCausalLM: no RoundPipe sequential preset \(model_type='diffllama'\)"
    ):
        models.build_preset(model)


def test_registering_a_type_for_the_builtin_preset(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SUPPORTED_MODELS[type] = SUPPORTED_MODELS["llama"]``: the standard preset, without the warning."""
    model = tiny_model("llama")
    model.config.model_type = "my_llama_fork"
    monkeypatch.setitem(models.SUPPORTED_MODELS, "my_llama_fork", models.SUPPORTED_MODELS["llama"])
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        preset = models.build_preset(model)
    assert isinstance(preset, CausalLMPreset) and "not verified" not in caplog.text


def test_disable_torch_compile_is_a_view_of_the_setting() -> None:
    """Reading ``roundpipe.models.DISABLE_TORCH_COMPILE`` reads the setting; assigning it configures it."""
    import roundpipe

    assert models.DISABLE_TORCH_COMPILE is settings.DISABLE_TORCH_COMPILE.get()
    roundpipe.configure(compile=True)
    assert models.DISABLE_TORCH_COMPILE is False
    roundpipe.configure(compile=False)
    assert models.DISABLE_TORCH_COMPILE is True
    models.DISABLE_TORCH_COMPILE = False
    assert settings.DISABLE_TORCH_COMPILE.get() is False and models.DISABLE_TORCH_COMPILE is False
    models.DISABLE_TORCH_COMPILE = True
    assert settings.DISABLE_TORCH_COMPILE.get() is True
    from roundpipe.models import DISABLE_TORCH_COMPILE

    assert DISABLE_TORCH_COMPILE is True and "DISABLE_TORCH_COMPILE" not in vars(models)


SPEC_PRESET = '''
"""A third-party preset in RoundPipe's layout: a spec builder."""
from roundpipe.models.preset import default_spec

MODEL_CLASS = {model_class!r}
CALLS = []


def build_spec(model):
    CALLS.append(type(model).__name__)
    return default_spec(model, logit_scale=0.5)
'''

WRAP_PRESET = '''
"""A third-party preset in the public layout: wrap_model."""
from roundpipe.models.causal_lm import RoundPipeForCausalLM
from roundpipe.models.preset import CausalLMPreset, default_spec

CALLS = []


def wrap_model(model, **roundpipe_kwargs):
    wrapped = RoundPipeForCausalLM(model, preset=CausalLMPreset(model, default_spec(model)), **roundpipe_kwargs)
    CALLS.append((wrapped, roundpipe_kwargs))
    return wrapped
'''


class MyForCausalLM(transformers.LlamaForCausalLM):
    """A user's subclass of a built-in family's class: the Llama preset refuses it by name."""


@pytest.fixture
def third_party(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], Any]]:
    """``register(source, key)``: write ``source`` as a module in ``tmp_path`` (put on ``sys.path``),
    register it as ``SUPPORTED_MODELS[key]`` and return it imported; all undone after the test."""
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    names: List[str] = []

    def register(source: str, key: str) -> Any:
        name = f"my_preset_{len(names)}"
        names.append(name)
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.setitem(models.SUPPORTED_MODELS, key, name)
        return importlib.import_module(name)

    yield register
    for name in names:
        sys.modules.pop(name, None)


def _my_model(kind: str) -> nn.Module:
    """``class``: a subclass of LlamaForCausalLM (model type llama); ``type``: a Llama with its own model type."""
    torch.manual_seed(0)
    if kind == "class":
        return MyForCausalLM(tiny_config("llama")).float()
    model = tiny_model("llama")
    model.config.model_type = "my_type"
    return model


@pytest.mark.parametrize("kind", ["type", "class"])
def test_third_party_spec_preset(
    kind: str, third_party: Callable[[str, str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module exposing ``build_spec``, registered under the model type or the class name, builds the
    preset of ``build_preset`` / ``wrap_model`` / ``wrap_model_to_roundpipe``; its spec is used (a logit
    scale the Hugging Face model does not have, checked against its logits)."""
    import roundpipe

    model = _my_model(kind)
    key = "MyForCausalLM" if kind == "class" else "my_type"
    module = third_party(SPEC_PRESET.format(model_class=type(model).__name__), key)
    if kind == "class":  # the table alone refuses the subclass
        with pytest.raises(
            NotImplementedError, match="MyForCausalLM: the 'llama' preset supports LlamaForCausalLM only"
        ):
            with monkeypatch.context() as m:
                m.delitem(models.SUPPORTED_MODELS, key)
                models.build_preset(model)
    preset = models.build_preset(model)
    assert preset.spec.logit_scale == 0.5 and module.CALLS == [type(model).__name__]
    batch = make_batch(padding=True)
    del batch["labels"]
    with torch.no_grad():
        ref = model(**batch).logits * 0.5
        got = preset.build_output(emulate_forward(preset.layers, preset.forward_kwargs(**batch), 3)).logits
    assert rel_err(got, ref) < TOL
    rp = models.wrap_model(model, model_run_config=RUN3)
    assert rp.preset.spec.logit_scale == 0.5
    rp = roundpipe.wrap_model_to_roundpipe(model, model_run_config=RUN3)
    assert rp.preset.spec.logit_scale == 0.5 and len(module.CALLS) == 3


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
@pytest.mark.parametrize("kind", ["type", "class"])
def test_third_party_wrap_model_preset(workers: str, kind: str, third_party: Callable[[str, str], Any]) -> None:
    """A module exposing ``wrap_model(model, **roundpipe_kwargs)``, registered under the model type or the
    class name: ``roundpipe.models.wrap_model`` returns what it returns, keyword arguments passed on."""
    model = _my_model(kind)
    module = third_party(WRAP_PRESET, "MyForCausalLM" if kind == "class" else "my_type")
    rp = models.wrap_model(model, model_run_config=RUN3, name="mine")
    assert module.CALLS == [(rp, {"model_run_config": RUN3, "name": "mine"})]
    batch = make_batch(padding=True)
    ref_loss, ref_grads = hf_reference(model, batch)
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    with pytest.raises(TypeError, match="wraps models itself"):
        models.build_preset(model)


def test_wrap_model_to_roundpipe_uses_a_third_party_wrap_model(third_party: Callable[[str, str], Any]) -> None:
    import roundpipe

    model = _my_model("type")
    module = third_party(WRAP_PRESET, "my_type")
    rp = roundpipe.wrap_model_to_roundpipe(model, model_run_config=RUN3)
    assert module.CALLS and module.CALLS[0][0] is rp


def test_bad_registrations_name_the_entry(
    third_party: Callable[[str, str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _my_model("type")
    monkeypatch.setitem(models.SUPPORTED_MODELS, "my_type", "no_such_preset_module")
    with pytest.raises(ImportError, match=r"SUPPORTED_MODELS\['my_type'\] = 'no_such_preset_module'"):
        models.wrap_model(model)
    third_party("X = 1\n", "my_type")
    with pytest.raises(TypeError, match="exposes neither build_spec"):
        models.wrap_model(model)
    third_party(SPEC_PRESET.format(model_class="OtherForCausalLM"), "my_type")
    with pytest.raises(
        NotImplementedError, match="LlamaForCausalLM: the 'my_type' preset .* supports OtherForCausalLM only"
    ):
        models.build_preset(model)


# ---------------------------------------------------------------------------------------------------------
# The forward arguments, defined once
# ---------------------------------------------------------------------------------------------------------


def test_forward_signatures_come_from_one_definition() -> None:
    """``forward``, ``train_step`` and ``forward_kwargs`` take the arguments of ``CausalLMInputs`` (what
    Hugging Face's Trainer reads to keep dataset columns), positionally or by name."""
    import dataclasses
    import inspect

    from roundpipe.models.causal_lm import RoundPipeForCausalLM
    from roundpipe.models.inputs import ALL_ARGS, BATCH_ARGS, CausalLMInputs

    assert ALL_ARGS == tuple(f.name for f in dataclasses.fields(CausalLMInputs))
    assert BATCH_ARGS == ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "shift_labels")
    forward = list(inspect.signature(RoundPipeForCausalLM.forward).parameters)
    assert forward == ["self", *ALL_ARGS, "roundpipe_run_config", "unused"]
    step = list(inspect.signature(RoundPipeForCausalLM.train_step).parameters)
    assert step[:4] == ["self", "input_ids", "attention_mask", "labels"] and set(step[1:-2]) <= set(ALL_ARGS)
    assert step[-2:] == ["run_config", "scale_loss"]
    assert list(inspect.signature(CausalLMPreset.forward_kwargs).parameters) == ["self", *ALL_ARGS]

    preset = models.build_preset(tiny_model("llama"))
    batch = make_batch(padding=True)
    by_name = preset.forward_kwargs(**batch, logits_to_keep=2)
    positional = preset.forward_kwargs(
        batch["input_ids"], batch["attention_mask"], None, None, batch["labels"], None, None, 2
    )
    assert by_name.keys() == positional.keys() == {"input_ids", "attention_mask", "labels", "options"}
    assert (
        by_name["options"]
        == positional["options"]
        == {"return_logits": False, "logits_to_keep": 2, "loss_chunk_size": None}
    )
    with pytest.raises(TypeError, match="labelz"):
        preset.forward_kwargs(input_ids=batch["input_ids"], labelz=batch["labels"])
    with pytest.raises(TypeError, match="options"):
        preset.layers[0](input_ids=batch["input_ids"], options={}, labelz=batch["labels"])


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_train_step_positional_and_forward_extras(workers: str) -> None:
    """``train_step(ids, mask, labels)`` as before; Hugging Face-only arguments: ignored when unset,
    refused otherwise."""
    model = tiny_model("llama")
    batch = make_batch(padding=True)
    ref_loss, ref_grads = hf_reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RUN3)
    import inspect

    assert list(inspect.signature(rp.forward).parameters)[:3] == ["input_ids", "attention_mask", "position_ids"]
    loss = rp.train_step(batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    with torch.no_grad():
        out = rp(**batch, use_cache=False, return_dict=True, past_key_values=None)
    assert rel_err(out.loss, ref_loss) < TOL
    with pytest.raises(NotImplementedError, match="KV cache"):
        rp(**batch, use_cache=True)
    with pytest.raises(TypeError, match="output_attentions"):
        rp(**batch, output_attentions=True)
