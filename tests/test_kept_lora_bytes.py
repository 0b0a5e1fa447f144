"""What a LoRA decoder layer run as the whole-layer op (fused LoRA linear) keeps for its backward:
``memory_terms.fused_lora_kept_bytes_per_token`` against the tensors autograd saves (saved-tensor hooks, unique
storages) over one forward, eager and compiled; the runtime's activation profile and its choice of kept stages
by that count, over a bf16 base and over an fp8 one with FP8 GEMMs; on a GPU, the memory a forward with
autograd leaves allocated.

About 45 s on 2 cores: inductor compiles the tiny layer three times on CPU (fp32 and bf16 adapters save
different tensors compiled, and the fp8 base's GEMMs are other ops), the only way to count what the compiled op
saves; the rest takes under a second."""

from __future__ import annotations

import os
from typing import Any, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from roundpipe import models, settings  # noqa: E402
from roundpipe.models import causal_lm, configs, fp8, fused_ops, kernels  # noqa: E402
from roundpipe.planning import budget, estimate, keep, keep_estimate, memory_terms  # noqa: E402
from roundpipe.planning.plan import ModelExecutePlan  # noqa: E402
from roundpipe.runtime.batch import Batch  # noqa: E402
from roundpipe.runtime.run_config import ResolvedRunConfig, RoundPipeRunConfig  # noqa: E402

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WIDTHS = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# The count and the term agree to the byte at these widths and at qwen3-1.7b's / qwen3-8b's; 1% leaves room for a
# torch release that saves one more per-row scalar (4 bytes a token).
TOL = 0.01


def fused_lora_layer(
    widths: dict, r: int = 8, device: str = "cpu", adapters: torch.dtype = torch.float32, in_fp8: bool = False
) -> Tuple[nn.Module, Any]:
    """A bf16 Qwen3 decoder layer with PEFT LoRA (``adapters``: fp32 is PEFT's default upcast) on all seven
    projections, fused as the runtime fuses it (``kernels.fuse_layer``: the whole-layer op with the fused LoRA
    linear); ``in_fp8``: its base weights as a device copy of an fp8 base under FP8 GEMMs (``fp8.Fp8Weight``,
    e4m3 bytes and a scale per row; emulated off a GPU)."""
    cfg = configs.tiny_config("qwen3", **widths)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    holder = nn.Sequential(qwen3.Qwen3DecoderLayer(cfg, layer_idx=0).to(torch.bfloat16))
    model = peft.get_peft_model(holder, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL))
    layer = model.base_model.model[0].to(device)
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapters)
    for m in layer.modules():
        if in_fp8 and isinstance(getattr(m, "base_layer", None), nn.Linear):
            w = m.base_layer.weight  # packed as an fp8 base, and its device copy as FP8 GEMMs upload it
            weight = fp8.FP8_COMPUTE.device_weight(fp8.FP8_COMPUTE.quantize(w.data), w.shape, w.dtype)
            m.base_layer.weight = nn.Parameter(weight, requires_grad=False)
    kernels.fuse_layer(layer)
    assert kernels.runs_whole_layer(layer)
    return layer, cfg


def saved_bytes(layer: nn.Module, cfg: Any, x: torch.Tensor) -> Tuple[float, torch.Tensor]:  # x: [1, seq, hidden]
    """(bytes of the distinct storages one forward of ``layer`` saves for its backward, its weights and the rotary
    tables aside; the output)."""
    cos, sin = qwen3.Qwen3RotaryEmbedding(cfg).to(x.device)(x, torch.arange(x.shape[1], device=x.device)[None])
    weights = [w for w in (*layer.parameters(), *layer.buffers(), cos, sin) if not isinstance(w, fp8.Fp8Weight)]
    fp8_parts = [t for w in layer.parameters() if isinstance(w, fp8.Fp8Weight) for t in (w.data_fp8, w.scale)]
    skip = {t.untyped_storage().data_ptr() for t in (*weights, *fp8_parts)}
    seen = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = None if isinstance(t, fp8.Fp8Weight) else t.untyped_storage()  # a weight: its parts are skipped
        if s is not None and s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, attention_mask=None, position_embeddings=(cos, sin))
    return float(sum(seen.values())), y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize(
    "adapters, in_fp8",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32 adapters", "bf16 adapters", "fp32 adapters, fp8 GEMMs"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_kept_term_is_what_the_fused_lora_layer_saves(compiled: bool, adapters: torch.dtype, in_fp8: bool) -> None:
    """The term (with the adapters' products as the runtime's profile reads them off the layer) equals the
    saved-tensor bytes of one forward, eager and compiled (inductor on CPU), the whole-layer op having run; over
    an fp8 base with FP8 GEMMs too, whose inputs' quantization leaves no float32 copy for the graph to keep."""
    layer, cfg = fused_lora_layer(WIDTHS, adapters=adapters, in_fp8=in_fp8)
    shape = memory_terms.ModelShape.from_config(cfg)
    tokens = 128
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with settings.overridden(compile=compiled):
        fused_ops.reset()
        got, y = saved_bytes(layer, cfg, x)
        assert causal_lm._whole_layer_compiled() == compiled and not fused_ops.DECODER_LAYER.failed
    fused_ops.reset()
    products, layer_dtype = causal_lm._fused_adapter_bytes(layer, shape)
    assert layer_dtype == (adapters == torch.bfloat16)
    assert products == memory_terms.lora_products_per_token(8, adapters.itemsize)  # r=8, seven projections
    term = tokens * memory_terms.fused_lora_kept_bytes_per_token(shape, products, 2, compiled, layer_dtype)
    assert abs(got - term) <= TOL * term, (got, term)
    # Below the modules' count the peak still uses (compiled, a third of it at qwen3-8b's widths).
    modules = memory_terms.module_layer_bytes_per_token(shape) + causal_lm._module_extra_per_token(layer, shape)
    assert got < tokens * modules
    y.float().sum().backward()  # the graph is whole
    assert layer.self_attn.q_proj.lora_A["default"].weight.grad is not None


def _profile(monkeypatch: pytest.MonkeyPatch, compiled: bool, fp8: bool = False) -> Tuple[Any, Any, list]:
    """A tiny Qwen3 with PEFT LoRA on every projection wrapped with fused kernels on (CPU workers; ``fp8``: over
    an fp8 base with FP8 GEMMs), its activation profile for 2 microbatches of 2 x 32 tokens, and its layers'
    device bytes."""
    monkeypatch.setattr(causal_lm, "_whole_layer_compiled", lambda: compiled)
    cfg = configs.tiny_config("qwen3", **WIDTHS, num_hidden_layers=6)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL))
    run = RoundPipeRunConfig(num_microbatch=2)
    extra: dict = dict(base_format="fp8", fp8=True) if fp8 else {}
    rp = models.wrap_model(hf, model_run_config=run, fused_kernels=True, **extra)
    ids = torch.zeros(4, 32, dtype=torch.long)
    profile = rp.activation_profile(Batch((), {"input_ids": ids, "labels": ids}, ResolvedRunConfig(run, run)), "stage")
    return memory_terms.ModelShape.from_config(cfg), profile, rp.layer_device_bytes("fused")


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_fp8_lora_layers_are_kept_by_the_fused_count(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8 GEMMs over an fp8 base the op saves what it saves in bf16 (the term above counts both): such a
    layer keeps that count in the runtime's profile, and ``roundpipe plan``'s keep estimate keeps as many
    stages as in bf16 or more (its weights take half the bytes)."""
    shape, profile, _ = _profile(monkeypatch, compiled=True, fp8=True)
    t = 2 * 32
    fused = t * memory_terms.fused_lora_kept_bytes_per_token(shape, memory_terms.lora_products_per_token(8), 2, True)
    for i in range(1, 7):
        assert profile.kept[i] == pytest.approx(fused)
    s8 = memory_terms.ModelShape.builtin("qwen3-8b")
    args = dict(lora_rank=16, microbatches=2, gpu_bytes=139 * 2**30, base_format="fp8")
    plain = keep_estimate.keep_estimate(s8, estimate.estimate(s8, 4096, 8, **args))
    with_fp8 = keep_estimate.keep_estimate(s8, estimate.estimate(s8, 4096, 8, fp8=True, **args))
    assert with_fp8.stage_bytes <= plain.stage_bytes and with_fp8.stages >= plain.stages >= 28


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_the_plan_keeps_stages_by_the_fused_count(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's profile gives each fused LoRA layer the term's kept bytes (compiled or eager, as the op
    runs), its peak the modules' count; the planner's kept stages are those the term fits in the room (three at a
    room the modules' count would fit one in), and ``roundpipe plan``'s estimate keeps by the same term."""
    shape, eager, layer_bytes = _profile(monkeypatch, compiled=False)
    _, profile, _ = _profile(monkeypatch, compiled=True)
    t = 2 * 32
    adapters = memory_terms.lora_products_per_token(8)
    decoder = range(1, 7)
    for i in decoder:
        assert eager.kept[i] == t * memory_terms.fused_lora_kept_bytes_per_token(shape, adapters, 2, False)
        assert profile.kept[i] == t * memory_terms.fused_lora_kept_bytes_per_token(shape, adapters, 2, True)
        assert profile.peak[i] == eager.peak[i]  # the peak stays the modules' count
    module_kept = t * (memory_terms.module_layer_bytes_per_token(shape) + memory_terms.lora_bytes_per_token(shape, 8))
    assert profile.kept[1] < eager.kept[1] < module_kept

    plan = ModelExecutePlan(
        [range(0, 7), range(7, 8)], [range(0, 2), *(range(i, i + 1) for i in range(2, 7)), range(7, 8)]
    )
    costs = budget.costs(profile, 1e12, 0.0)
    inputs = keep.checkpoint_bytes(plan.bwd_plan, costs, True)
    stage = keep.stage_cost(costs, range(3, 4), layer_bytes, 2)
    fwd = [0.0, 0.0] + [1.0] * (len(layer_bytes) - 2)  # the first stage (with the embedding) saves least
    room = inputs + 3 * stage + 1
    modules = 2 * module_kept + layer_bytes[3]
    assert modules < room - inputs < 2 * modules  # one stage at the modules' count
    chosen = keep.decide(plan, "fused", 1, False, 2, layer_bytes, fwd, False, costs, room, True, "auto")
    assert chosen.keep == (range(2, 3), range(3, 4), range(4, 5)) and chosen.keep_bytes == 3 * stage

    e = estimate.estimate(
        memory_terms.ModelShape.builtin("qwen3-8b"), 4096, 8, lora_rank=16, microbatches=2, gpu_bytes=139 * 2**30
    )
    k = keep_estimate.keep_estimate(memory_terms.ModelShape.builtin("qwen3-8b"), e)
    s8 = memory_terms.ModelShape.builtin("qwen3-8b")
    per_token = memory_terms.fused_lora_kept_bytes_per_token(s8, memory_terms.lora_products_per_token(16))
    layer = e.device_bytes_per_layer + 8 * s8.lora_params(16)
    assert k.stage_bytes == 2 * 4 * 4096 * per_token + layer


@pytest.mark.gpu
@pytest.mark.parametrize(
    "compiled, in_fp8", [(True, False), (False, False), (True, True)], ids=["compiled", "eager", "compiled, fp8"]
)
def test_gpu_kept_fused_lora_layer_memory_is_the_term(compiled: bool, in_fp8: bool) -> None:
    """On one GPU, a qwen3-1.7b-shaped fused LoRA layer (r=16, fp32 adapters; ``in_fp8``: over an fp8 base with
    FP8 GEMMs) at 4096 tokens: the memory its forward with autograd leaves allocated (what a kept stage holds: the
    saved tensors, its input among them, less its output, which the next layer holds as its input) is within 10%
    of the term compiled, and at most the term eager (CPU's count, an upper bound there)."""
    if in_fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or later")
    widths = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    layer, cfg = fused_lora_layer(widths, r=16, device="cuda", in_fp8=in_fp8)
    shape = memory_terms.ModelShape.from_config(cfg)
    tokens = 4096
    products, layer_dtype = causal_lm._fused_adapter_bytes(layer, shape)
    term = tokens * memory_terms.fused_lora_kept_bytes_per_token(shape, products, 2, compiled, layer_dtype)
    cos, sin = qwen3.Qwen3RotaryEmbedding(cfg).to("cuda")(
        torch.zeros(1, device="cuda", dtype=torch.bfloat16), torch.arange(tokens, device="cuda")[None]
    )
    with settings.overridden(compile=compiled):
        fused_ops.reset()
        for _ in range(2):  # the first call compiles
            x = torch.randn(1, tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            y = layer(x, attention_mask=None, position_embeddings=(cos, sin))
            torch.cuda.synchronize()
            output, given = y.untyped_storage().nbytes(), x.untyped_storage().nbytes()
            held = torch.cuda.memory_allocated() - before - output + given
            y.float().sum().backward()
            del y
        assert causal_lm._whole_layer_compiled() == compiled and not fused_ops.DECODER_LAYER.failed
    fused_ops.reset()
    print(
        f"\nfused LoRA layer, {tokens} tokens, compiled={compiled}, fp8={in_fp8}: "
        f"{held / tokens:.0f} B/token, term {term / tokens:.0f}"
    )
    if compiled:
        assert abs(held - term) <= 0.10 * term, (held, term)
    else:
        assert held <= 1.10 * term, (held, term)
