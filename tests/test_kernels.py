"""Fused decoder-layer kernels (roundpipe.models.kernels) reproduce Hugging Face's modules.

* each fused module vs the Hugging Face module, forward and backward, fp32 / fp64 / bf16 (eager path);
* the compiled path (inductor on the CPU) on small shapes, and the bench's tiny mode;
* compile behaviour: no recompiles per layer, upload or iteration; a failed compile falls back once;
* whole Qwen3 / Llama models through RoundPipe (two CPU workers) with the kernels on vs Hugging Face;
* the option: auto / on / off, per instance only, reversible.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err, with_lora
from torch import nn

from roundpipe import models, settings
from roundpipe.models import configs, fused_ops, kernels
from roundpipe.runtime.run_config import RoundPipeRunConfig

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")
from test_models import assert_grads_close, grads, hf_reference, make_batch, tiny_model  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

TOL = 1e-5  # whole models, as tests/test_models.py
OP_TOL = {torch.float32: 1e-6, torch.float64: 1e-6}  # fp64: Hugging Face's norm computes in fp32 too
RUN3 = RoundPipeRunConfig(num_microbatch=3)


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused ops on their eager path (torch.compile off)."""
    settings.configure(compile=False)


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch):
    """Fused ops compiled (inductor) with fresh caches; the stream checks off, since they run compiled layers
    eagerly (dynamo does not trace under their dispatch mode: ``roundpipe.devices.cpu_streams``)."""
    settings.configure(compile=True, debug_check_streams="0")
    kernels.reset()
    yield
    kernels.reset()


# ---------------------------------------------------------------------------------------------------------
# One module at a time
# ---------------------------------------------------------------------------------------------------------


def _config(family: str) -> Any:
    """One layer, hidden 32, MLP 48, sdpa."""
    return configs.tiny_config(family, intermediate_size=48, num_hidden_layers=1, attn_implementation="sdpa")


def _module(
    kind: str, dtype: torch.dtype
) -> Tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor], torch.Tensor]:
    """A Hugging Face module with non-trivial weights, how to call it, and its input."""
    family = "llama" if kind.startswith("llama") else "qwen3"
    config = _config(family)
    torch.manual_seed(0)
    if kind in ("rmsnorm", "qk_norm"):
        # qk_norm: a q_norm on [batch, seq, heads, head_dim] input
        mod = qwen3.Qwen3RMSNorm(8 if kind == "qk_norm" else 32, eps=1e-6)
        x = torch.randn(2, 5, 4, 8) if kind == "qk_norm" else torch.randn(2, 5, 32)
        call = lambda m, x: m(x)  # noqa: E731
    elif kind.endswith("mlp"):
        mod = (llama.LlamaMLP if family == "llama" else qwen3.Qwen3MLP)(config)
        x = torch.randn(2, 5, 32)
        call = lambda m, x: m(x)  # noqa: E731
    else:
        mod = (llama.LlamaAttention if family == "llama" else qwen3.Qwen3Attention)(config, layer_idx=0)
        x = torch.randn(2, 5, 32)
        rotary = (llama.LlamaRotaryEmbedding if family == "llama" else qwen3.Qwen3RotaryEmbedding)(config)
        pos = rotary(x, torch.arange(5).unsqueeze(0))
        call = lambda m, x: m(x, position_embeddings=tuple(t.to(x.dtype) for t in pos), attention_mask=None)[0]  # noqa: E731
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    return mod.to(dtype), call, x.to(dtype)


def _forward_backward(mod: nn.Module, call: Callable, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = call(mod, x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    res = {"out": out.detach(), "grad x": x.grad}
    res.update({f"grad {n}": p.grad for n, p in mod.named_parameters()})
    return res


def _check_against_hf(kind: str, dtype: torch.dtype) -> None:
    mod, call, x = _module(kind, dtype)
    fused = copy.deepcopy(mod)
    assert kernels.fuse_layer(fused), kind
    assert kernels.is_fused(fused) and isinstance(fused, type(mod))
    ref, got = _forward_backward(mod, call, x), _forward_backward(fused, call, x)
    assert ref.keys() == got.keys()
    for name in ref:
        assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape, name
        if dtype in OP_TOL:
            assert rel_err(got[name], ref[name]) < OP_TOL[dtype], (
                f"{kind} {dtype} {name}: {rel_err(got[name], ref[name]):.2e}"
            )
        else:  # bf16: within bf16 rounding
            torch.testing.assert_close(got[name], ref[name], rtol=1.6e-2, atol=1e-2 * ref[name].abs().max().item())


KINDS = ["rmsnorm", "qk_norm", "qwen3_attention", "llama_attention", "qwen3_mlp", "llama_mlp"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_module_matches_hf(eager: None, kind: str, dtype: torch.dtype) -> None:
    """Eager fused path (on the CPU even bitwise equal to Hugging Face's, all three dtypes)."""
    _check_against_hf(kind, dtype)


def test_rms_norm_rounding_order() -> None:
    """The fp32 normalised value is rounded to bf16 before the weight multiply (Hugging Face's order,
    not F.rms_norm's with a weight), bitwise on the CPU."""
    x = torch.randn(64, 256).to(torch.bfloat16)
    w = (1 + torch.randn(256)).to(torch.bfloat16)
    hf = qwen3.Qwen3RMSNorm(256)
    hf.weight.data.copy_(w)
    hf = hf.to(torch.bfloat16)
    with torch.no_grad():
        ref = hf(x)
        assert torch.equal(kernels.rms_norm_reference(x, w, 1e-6), ref)
        assert torch.equal(kernels.rms_norm_eager(x, w, 1e-6), ref)


def test_compiled_path_and_bench_tiny_mode(compiled: None, capsys: pytest.CaptureFixture) -> None:
    """The compiled (inductor) path on the CPU, in one test (a cold compile takes ~30 s on 2 cores):
    ``bench/kernels_bench.py --cpu --tiny``, a bf16 Qwen3 decoder layer with RMSNorm, q/k norm +
    rotary and SwiGLU compiled, forward without grad and forward + backward: output, input gradient
    and every parameter gradient agree with Hugging Face's within bf16 rounding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import kernels_bench
    finally:
        sys.path.pop(0)
    res = kernels_bench.main(["--cpu", "--tiny", "--warmup", "0", "--iters", "1"])
    out = capsys.readouterr().out
    assert res["ok"] == 1.0 and "agreement OK" in out and "| forward + backward |" in out
    assert res["fused_vs_hf"] < 1e-2  # bf16 rounding (bitwise equal on the CPU: emulate_precision_casts)
    assert all(not op.failed for op in kernels.OPS)
    # the whole layer ran compiled, as one op
    assert {op.fn.__name__ for op in kernels.OPS if op.compiled} == {"decoder_layer"}


# ---------------------------------------------------------------------------------------------------------
# The whole decoder layer as one op
# ---------------------------------------------------------------------------------------------------------


def _decoder_layer(
    family: str, dtype: torch.dtype, **config: Any
) -> Tuple[nn.Module, Tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A Hugging Face decoder layer with non-trivial weights, its rotary tables and an input."""
    cfg = _config(family)
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    cls = (
        (llama.LlamaDecoderLayer, llama.LlamaRotaryEmbedding)
        if family == "llama"
        else (qwen3.Qwen3DecoderLayer, qwen3.Qwen3RotaryEmbedding)
    )
    layer = cls[0](cfg, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    x = torch.randn(2, 5, 32)
    pos = tuple(t.to(dtype) for t in cls[1](cfg)(x, torch.arange(5).unsqueeze(0)))
    return layer.to(dtype), pos, x.to(dtype)


def _layer_results(layer: nn.Module, x: torch.Tensor, **kwargs: Any) -> Dict[str, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = layer(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    res = {"out": out.detach(), "grad x": x.grad}
    res.update({f"grad {n}": p.grad for n, p in layer.named_parameters() if p.requires_grad})
    return res


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Counts of fused-op calls by function name."""
    calls: Dict[str, int] = {}
    original = kernels.FusedOp.__call__

    def counting(op: kernels.FusedOp, *args: Any) -> Any:
        calls[op.fn.__name__] = calls.get(op.fn.__name__, 0) + 1
        return original(op, *args)

    monkeypatch.setattr(kernels.FusedOp, "__call__", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_whole_layer_matches_hf(eager: None, op_calls: Dict[str, int], family: str, dtype: torch.dtype) -> None:
    """An unmasked call runs the whole layer as one op; on the eager path its output and every gradient
    are bitwise Hugging Face's (the same ops in the same order), in all three dtypes."""
    hf, pos, x = _decoder_layer(family, dtype)
    fused = copy.deepcopy(hf)
    assert "" in kernels.fuse_layer(fused) and kernels.is_fused(fused)
    ref = _layer_results(hf, x, attention_mask=None, position_embeddings=pos)
    assert not op_calls
    got = _layer_results(fused, x, attention_mask=None, position_embeddings=pos)
    assert op_calls == {"decoder_layer": 1}
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), f"{family} {dtype} {name}: {rel_err(got[name], ref[name]):.2e}"


def _causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


FALLBACKS = ["mask", "hook", "backward hook", "lora", "dropout", "kwargs", "bias", "eager attention"]


@pytest.mark.parametrize("case", FALLBACKS)
def test_whole_layer_falls_back_to_modules(eager: None, op_calls: Dict[str, int], case: str) -> None:
    """Calls the one op would not compute as Hugging Face does run the fused modules instead: a mask, a
    forward or backward hook on a submodule (it still fires), PEFT DoRA adapters, attention dropout in
    training, extra keyword arguments, projection biases, another attention implementation."""
    config = {"attention_bias": True} if case == "bias" else {"attention_dropout": 0.5} if case == "dropout" else {}
    hf, pos, x = _decoder_layer("llama" if case == "bias" else "qwen3", torch.float64, **config)
    if case == "eager attention":
        hf.self_attn.config._attn_implementation = "eager"
    fused = copy.deepcopy(hf)
    kernels.fuse_layer(fused)
    kwargs: Dict[str, Any] = dict(attention_mask=None, position_embeddings=pos)
    fired = []
    if case == "mask":
        kwargs["attention_mask"] = _causal_mask(x.shape[1]).to(x.dtype)
    elif case == "hook":
        fused.mlp.register_forward_hook(lambda m, i, o: fired.append(1))
    elif case == "backward hook":
        fused.self_attn.o_proj.register_full_backward_hook(lambda m, gi, go: fired.append(1))
    elif case == "lora":
        peft = pytest.importorskip("peft")
        # DoRA: an adapter the fused LoRA linear does not cover (tests/test_fused_lora.py: those it does)
        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False, use_dora=True)
        hf, fused = peft.get_peft_model(hf, cfg), peft.get_peft_model(fused, copy.deepcopy(cfg))
        fused.load_state_dict(hf.state_dict())
    elif case == "dropout":  # eval: no dropout, the one op; training: HF's own dropout path
        hf.eval(), fused.eval()
        _layer_results(fused, x, **kwargs)
        fused.zero_grad(set_to_none=True)
        assert op_calls.pop("decoder_layer") == 1
        hf.train(), fused.train()
        torch.manual_seed(3)
    elif case == "kwargs":
        kwargs["output_attentions"] = False
    ref = _layer_results(hf, x, **kwargs) if case != "dropout" else None
    if case == "dropout":
        torch.manual_seed(3)
        ref = _layer_results(hf, x, **kwargs)
        torch.manual_seed(3)
    got = _layer_results(fused, x, **kwargs)
    assert "decoder_layer" not in op_calls and op_calls, op_calls  # the fused modules ran
    if case in ("hook", "backward hook"):
        assert fired == [1]
    for name in ref:
        assert rel_err(got[name], ref[name]) < OP_TOL[torch.float64], name


def test_whole_layer_compiles_once_for_all_layers(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one shape share one graph per grad mode: the function takes the weights as tensors.
    aot_eager: dynamo's guards and caches without code generation."""
    monkeypatch.setattr(fused_ops, "COMPILE_BACKEND", "aot_eager")
    layers = []
    for seed in range(3):
        hf, pos, x = _decoder_layer("qwen3", torch.float32)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(seed * 0.01)
        fused = copy.deepcopy(hf)
        kernels.fuse_layer(fused)
        layers.append((hf, fused))
    for hf, fused in layers:
        with torch.no_grad():
            torch.testing.assert_close(
                fused(x, position_embeddings=pos), hf(x, position_embeddings=pos), rtol=1e-6, atol=1e-6
            )
        got, ref = _layer_results(fused, x, position_embeddings=pos), _layer_results(hf, x, position_embeddings=pos)
        for name in ref:
            assert rel_err(got[name], ref[name]) < OP_TOL[torch.float32], name
    assert _cache_entries(kernels.DECODER_LAYER) == 2 and not kernels.DECODER_LAYER.failed  # no_grad, grad
    # Another sequence length: the dimension becomes dynamic (one more graph per mode), still compiled.
    hf, fused = layers[0]
    cos, sin = pos
    pos7 = (torch.cat([cos, cos[:, :2]], 1), torch.cat([sin, sin[:, :2]], 1))
    x7 = torch.randn(2, 7, x.shape[-1])
    got, ref = _layer_results(fused, x7, position_embeddings=pos7), _layer_results(hf, x7, position_embeddings=pos7)
    for name in ref:
        assert rel_err(got[name], ref[name]) < OP_TOL[torch.float32], name
    # (dynamo remembers dynamic dimensions per function name across copies: after the other tests the
    # first graphs may already be dynamic and serve this length too)
    assert 2 <= _cache_entries(kernels.DECODER_LAYER) <= 3 and not kernels.DECODER_LAYER.failed


# ---------------------------------------------------------------------------------------------------------
# Compile behaviour
# ---------------------------------------------------------------------------------------------------------


def _cache_entries(op: kernels.FusedOp) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(fn.__code__)) for fn in op.copies.values())


@pytest.mark.parametrize("padding", [True, False], ids=["mask", "causal"])
@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_no_recompile_per_layer_upload_or_iteration(
    workers: str, compiled: None, padding: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through RoundPipe (new device copies of every layer at every upload), each op compiles once per
    grad mode (forward without grad, recompute with grad), whatever the number of layers and steps.
    Either way the sliding-window layer (its mask is not None) runs the ops per module and the
    full-attention layers (0 and 2) run as one op where a microbatch has no padding (with padding: the
    middle one of three).
    aot_eager: dynamo's guards and caches as with inductor, without code generation."""
    from torch._dynamo.utils import counters

    from roundpipe.models import loss

    monkeypatch.setattr(fused_ops, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(loss, "_maybe_compiled", lambda fn, compile: fn)  # the loss stays eager here
    model = tiny_model("qwen3")  # 3 layers
    batch = make_batch(padding=padding)
    ref_loss, ref_grads = hf_reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RUN3, fused_kernels=True)
    counters.clear()
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    ops = (kernels.RMS_NORM, kernels.QK_NORM_ROPE, kernels.SWIGLU, kernels.DECODER_LAYER)
    first = [_cache_entries(op) for op in ops]
    graphs = counters["stats"]["unique_graphs"]
    assert all(1 <= n <= 2 for n in first), first  # forward without grad, recompute with grad
    for _ in range(2):
        rp(**batch).loss.backward()
        rp.train_step(**batch)
    grads(model)
    assert [_cache_entries(op) for op in ops] == first
    assert counters["stats"]["unique_graphs"] == graphs
    assert not kernels.ROPE.copies and all(not op.failed for op in kernels.OPS)


def test_one_compiled_copy_per_device() -> None:
    """Each device gets its own copy of the function (own code object, so its own dynamo cache and
    recompile limit); the same device always gets the same one. Nothing is compiled until called."""
    op = kernels.FusedOp(kernels.swiglu, kernels.swiglu)
    a, b = op.compiled_for(torch.device("cuda", 0)), op.compiled_for(torch.device("cuda", 1))
    assert a is not b and op.compiled_for(torch.device("cuda", 0)) is a
    codes = {fn.__code__ for fn in op.copies.values()}
    assert len(codes) == 2 and kernels.swiglu.__code__ not in codes
    assert {fn.__name__ for fn in op.copies.values()} == {"swiglu_cuda0", "swiglu_cuda1"}


def test_compile_failure_falls_back_once(compiled: None, caplog: pytest.LogCaptureFixture) -> None:
    def unsupported(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True refuses this
        return x * 2

    op = kernels.FusedOp(unsupported, lambda x: x * 2)
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        assert torch.equal(op(x), x * 2)
        assert torch.equal(op(x), x * 2)
    assert op.failed
    warnings = [r for r in caplog.records if "fused kernels" in r.getMessage()]
    assert len(warnings) == 1 and "unsupported" in warnings[0].getMessage()


# ---------------------------------------------------------------------------------------------------------
# Whole models through RoundPipe
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("padding", [True, False], ids=["padding", "no padding"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_roundpipe_with_fused_kernels_matches_hf(
    workers: str, eager: None, family: str, padding: bool, op_calls: Dict[str, int]
) -> None:
    """Loss and gradients as Hugging Face's, forward and train_step, with the fused layers running as
    one op where a microbatch has no mask and per module where it has one."""
    model = tiny_model(family)
    batch = make_batch(padding=padding)
    ref_loss, ref_grads = hf_reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RUN3, fused_kernels=True)
    assert rp.preset.fused_kernels
    out = rp(**batch)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)
    calls = op_calls
    attention = "qk_norm_rope" if family == "qwen3" else "rope"
    if padding:
        # The padded microbatches (0 and 2 of 3) per module, at least once per layer (3), padded
        # microbatch (2) and pass (forward, recompute); the microbatch without padding has no mask
        # (Hugging Face skips an all-ones one), so its full-attention layers run as one op.
        assert calls.keys() == {"rms_norm_reference", attention, "swiglu", "decoder_layer"}
        assert calls["rms_norm_reference"] == 2 * calls[attention] == 2 * calls["swiglu"] >= 2 * 3 * 2 * 2
    else:
        # Every full-attention layer (Qwen3: 0 and 2; the sliding-window layer 1 has a mask) as one op,
        # at least once per layer, microbatch (3) and pass (forward without grad, forward, recompute).
        whole = 2 if family == "qwen3" else 3
        assert calls["decoder_layer"] >= whole * 3 * 3
        if family == "qwen3":
            assert calls["decoder_layer"] == 2 * calls["swiglu"] == 2 * calls[attention]
        else:
            assert calls.keys() == {"decoder_layer"}


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_lora_with_fused_kernels_matches_peft(workers: str, eager: None) -> None:
    """PEFT adapters inside fused attention and MLP modules train as in PEFT."""
    pytest.importorskip("peft")
    model = with_lora(tiny_model("qwen3"), ["q_proj", "k_proj", "gate_proj"])
    batch = make_batch(padding=True)
    ref_loss, ref_grads = hf_reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RUN3, fused_kernels=True)
    assert kernels.is_fused(model.get_base_model().model.layers[0].self_attn)
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_grads_close(grads(model), ref_grads)


# ---------------------------------------------------------------------------------------------------------
# The option
# ---------------------------------------------------------------------------------------------------------


def test_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPP_DEVICES", "cpu:2")
    monkeypatch.delenv(settings.DEBUG_FUSED_KERNELS.name, raising=False)
    assert kernels.resolve(None) is False and kernels.resolve("auto") is False  # CPU workers: off
    assert kernels.resolve(True) is True and kernels.resolve("on") is True and kernels.resolve(False) is False
    monkeypatch.setenv(settings.DEBUG_FUSED_KERNELS.name, "1")
    assert kernels.resolve(None) is True
    monkeypatch.setenv(settings.DEBUG_FUSED_KERNELS.name, "0")
    assert kernels.resolve(None) is False
    with pytest.raises(ValueError, match="fused_kernels"):
        kernels.resolve("sometimes")
    # auto on GPUs needs torch.compile (and Triton)
    monkeypatch.setenv("RPP_DEVICES", "cuda")
    settings.configure(compile=False)
    assert kernels.auto_enabled() is False


def test_option_is_per_instance_and_reversible() -> None:
    model, other = tiny_model("qwen3"), tiny_model("qwen3")
    preset = models.build_preset(model)  # auto on the CPU: off
    assert not preset.fused_kernels and not any(kernels.is_fused(m) for m in model.modules())
    assert preset.set_fused_kernels(True)
    layer = model.model.layers[0]
    assert type(layer.mlp).__name__ == "RoundPipeFusedQwen3MLP" and isinstance(layer.mlp, qwen3.Qwen3MLP)
    assert kernels.base_class(layer.self_attn.q_norm) is qwen3.Qwen3RMSNorm
    assert not kernels.is_fused(model.model.norm)  # decoder layers only
    assert not any(kernels.is_fused(m) for m in other.modules())  # other instances untouched
    assert qwen3.Qwen3MLP.forward is not type(layer.mlp).forward
    # The same parameters, state dict, pickling
    assert list(model.state_dict()) == list(other.state_dict())
    clone = pickle.loads(pickle.dumps(layer))
    assert type(clone.mlp) is type(layer.mlp) and torch.equal(clone.mlp.up_proj.weight, layer.mlp.up_proj.weight)
    assert not preset.set_fused_kernels(False)
    assert not any(kernels.is_fused(m) for m in model.modules()) and type(layer.mlp) is qwen3.Qwen3MLP


def test_unsupported_families_stay_hf() -> None:
    """Families without verified fused kernels (generic preset, MoE) are left alone even when asked."""
    for family in ("qwen2", "qwen3_moe"):
        model = tiny_model(family)
        preset = models.build_preset(model)
        assert not preset.set_fused_kernels(True)
        assert not any(kernels.is_fused(m) for m in model.modules())
    # A Qwen3 MLP with another activation keeps its own forward.
    config = _config("qwen3")
    config.hidden_act = "gelu"
    assert kernels.fuse_layer(qwen3.Qwen3MLP(config)) == []
