"""Fused LoRA linears (roundpipe.models.lora) inside the fused Qwen3 / Llama layer ops equal PEFT's modules.

* one PEFT LoRA projection: the fused linear's output and every gradient against PEFT's forward, float64
  (ranks 8 and 64, rslora) and float32 adapters over a bf16 base (PEFT's default upcast);
* whole tiny models through RoundPipe on CPU workers, float64: logits, loss and every LoRA gradient to
  1e-10 against the PEFT model, over 1-3 workers, 2 microbatch counts, both recompute grains, ranks 8 and
  64, rslora, LoRA on q/v only; a spy shows the whole-layer op and the fused LoRA linear ran;
* adapters the fused linear does not reproduce (dropout in training) keep PEFT's modules and still equal PEFT;
* the sequence-tiled path takes the same fused linear;
* on a GPU: the fused path within bf16 rounding of PEFT's, and a timing of a qwen3-1.7b-shaped layer.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Dict, List, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import models, settings
from roundpipe.models import configs, kernels, lora
from roundpipe.runtime.run_config import RoundPipeRunConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_kernels import op_calls as _op_calls  # noqa: E402, F401 -- the fixture
from test_models import grads, make_batch, tiny_model  # noqa: E402

TOL = 1e-10  # float64 throughout
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def spy(_op_calls: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:  # noqa: F811 -- the fixture
    """Counts of fused-op calls by function name (tests/test_kernels.py's ``op_calls``) and, as ``lora``, of
    fused LoRA linear applications (from any worker thread); the fused ops eager."""
    apply = lora._LoraLinear.apply

    def counting_apply(*args: Any) -> Any:
        _op_calls["lora"] = _op_calls.get("lora", 0) + 1
        return apply(*args)

    monkeypatch.setattr(lora._LoraLinear, "apply", staticmethod(counting_apply))
    settings.configure(compile=False)
    return _op_calls


def add_lora(
    model: nn.Module, targets: List[str], r: int, rslora: bool = False, dropout: float = 0.0, seed: int = 1
) -> nn.Module:
    """PEFT adapters with non-zero B (PEFT starts B at zero, leaving every A gradient zero)."""
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r + 3, use_rslora=rslora, lora_dropout=dropout, target_modules=targets)
    model = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def lora_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    got = grads(model)
    assert got and all("lora_" in n for n in got)
    return got


def assert_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        assert rel_err(got[name], ref[name]) < tol, f"{name}: {rel_err(got[name], ref[name]):.2e}"


# ---------------------------------------------------------------------------------------------------------
# One projection
# ---------------------------------------------------------------------------------------------------------


def _projection(r: int, rslora: bool, dtype: torch.dtype, adapter_dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 40, bias=False)).to(dtype)
    model = add_lora(base, ["0"], r, rslora)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(adapter_dtype)
    return model.base_model.model[0]


@pytest.mark.parametrize(
    "r, rslora, dtype, adapter",
    [
        (8, False, torch.float64, torch.float64),
        (64, True, torch.float64, torch.float64),
        (8, False, torch.bfloat16, torch.float32),
        (16, True, torch.bfloat16, torch.bfloat16),
    ],
    ids=["r8 fp64", "r64 rslora fp64", "r8 bf16 base fp32 adapter", "r16 rslora bf16"],
)
def test_fused_linear_matches_peft_module(r: int, rslora: bool, dtype: torch.dtype, adapter: torch.dtype) -> None:
    """Output, input gradient and A / B gradients of the fused linear against the PEFT module's forward:
    to rounding in float64, within bf16 rounding with a bf16 base (PEFT rounds its low-rank product and
    the scaling separately; the fused linear rounds the sum once)."""
    module = _projection(r, rslora, dtype, adapter)
    module.base_layer.weight.requires_grad_(r == 64)  # a trained base weight: its gradient too
    proj = lora.projection(module)
    assert isinstance(proj, lora.LoraWeights) and proj.a.shape == (r, 48)
    assert proj.scaling == module.scaling["default"] == (2 * r + 3) / (r**0.5 if rslora else r)
    x = torch.randn(3, 7, 48, dtype=dtype)
    dy = torch.randn(3, 7, 40, dtype=dtype)
    results = []
    for fn in (module, lambda t: lora.linear(t, proj)):
        xt = x.clone().requires_grad_(True)
        y = fn(xt)
        y.backward(dy)
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        w = module.base_layer.weight
        results.append({"y": y.detach(), "dx": xt.grad, "dA": a.grad, "dB": b.grad, "dW": w.grad})
        assert y.dtype == dtype and xt.grad.dtype == dtype and a.grad.dtype == adapter
        assert (w.grad is not None) == (r == 64)
        a.grad = b.grad = w.grad = None
    tol = TOL if dtype == torch.float64 else 2**-7
    assert_close(
        {k: v for k, v in results[1].items() if v is not None},
        {k: v for k, v in results[0].items() if v is not None},
        tol,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adapters_computed_in_the_base_dtype_match_peft_within_its_rounding(dtype: torch.dtype) -> None:
    """``RPP_DEBUG_LORA_COMPUTE=base``: float32 adapters over a bf16 / fp16 base run in the base's dtype. Output
    and every gradient against the PEFT module in float64 are within that dtype's rounding (no more than twice
    PEFT's own error, 2^-8 at least), the adapter gradients stay float32, and the path taken is another than
    PEFT's float32 one (the results differ); float32 inputs, or adapters of the base's dtype, are untouched."""
    module = _projection(16, False, dtype, torch.float32)
    exact = copy.deepcopy(module).double()
    x = torch.randn(3, 7, 48, dtype=dtype)
    dy = torch.randn(3, 7, 40, dtype=dtype)

    def run(fn, m: nn.Module, xin: torch.Tensor, dyin: torch.Tensor) -> Dict[str, torch.Tensor]:
        xt = xin.clone().requires_grad_(True)
        y = fn(xt)
        y.backward(dyin)
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        out = {"y": y.detach(), "dx": xt.grad, "dA": a.grad, "dB": b.grad}
        a.grad = b.grad = None
        return out

    ref = run(exact, exact, x.double(), dy.double())
    peft = run(module, module, x, dy)
    peft_fused = run(lambda t: lora.linear(t, lora.projection(module)), module, x, dy)
    with settings.overridden(debug_lora_compute="base"):
        proj = lora.projection(module)
        assert isinstance(proj, lora.LoraWeights) and proj.base_compute
        got = run(lambda t: lora.linear(t, proj), module, x, dy)
    assert got["dA"].dtype == got["dB"].dtype == torch.float32 and got["y"].dtype == dtype
    for name in ref:
        err, peft_err = rel_err(got[name].double(), ref[name]), rel_err(peft[name].double(), ref[name])
        assert err <= max(2 * peft_err, 2**-8), f"{name}: base dtype {err:.2e}, PEFT {peft_err:.2e}"
    assert any(not torch.equal(got[k], peft_fused[k]) for k in got)
    with settings.overridden(debug_lora_compute="base"):  # nothing to cast: PEFT's path, bit for bit
        wide = _projection(16, False, torch.float32, torch.float32)
        x32, dy32 = x.float(), dy.float()
        same = run(lambda t: lora.linear(t, lora.projection(wide)), wide, x32, dy32)
    plain = run(lambda t: lora.linear(t, lora.projection(wide)), wide, x32, dy32)
    assert all(torch.equal(same[k], plain[k]) for k in same)
    with settings.overridden(debug_lora_compute="base"):
        assert not lora.projection(_projection(16, False, dtype, dtype)).base_compute


def test_projection_rejects_what_it_would_not_reproduce() -> None:
    """Dropout in training, two active adapters, DoRA, a LoRA bias, a merged adapter: None (PEFT's modules);
    dropout in eval mode and a plain bias-free Linear: fused."""
    assert lora.projection(nn.Linear(4, 4)) is None and lora.projection(nn.Linear(4, 4, bias=False)) is not None

    def make(**kw: Any) -> nn.Module:
        cfg = peft.LoraConfig(r=2, target_modules=["0"], **kw)
        return peft.get_peft_model(nn.Sequential(nn.Linear(8, 8, bias=False)), cfg).base_model.model[0]

    dropout = make(lora_dropout=0.1)
    assert lora.projection(dropout) is None
    dropout.eval()
    assert lora.projection(dropout) is not None
    for kw in (dict(use_dora=True), dict(lora_bias=True)):
        assert lora.projection(make(**kw)) is None, kw
    merged = make()
    merged.merge()
    assert lora.projection(merged) is None


def test_whole_layer_with_adapters_is_planned_module_by_module(spy: Dict[str, int]) -> None:
    """A fused layer with fusable adapters runs as the whole-layer op (``runs_whole_layer``) and reports its
    adapters (``has_adapters``: the memory plan counts such a layer module by module); without adapters
    or with dropout in training, neither."""
    model = add_lora(tiny_model("llama").double(), ["q_proj", "v_proj"], 8)
    layer = model.get_base_model().model.layers[0]
    kernels.fuse_layer(layer)
    assert kernels.runs_whole_layer(layer) and lora.has_adapters(layer)
    plain = tiny_model("llama").model.layers[0]
    kernels.fuse_layer(plain)
    assert kernels.runs_whole_layer(plain) and not lora.has_adapters(plain)
    dropout = add_lora(tiny_model("llama"), ["q_proj"], 8, dropout=0.1).get_base_model().model.layers[0]
    kernels.fuse_layer(dropout)
    assert not kernels.runs_whole_layer(dropout) and not lora.has_adapters(dropout)


# ---------------------------------------------------------------------------------------------------------
# Whole models through RoundPipe
# ---------------------------------------------------------------------------------------------------------

# (family, workers, microbatches, recompute grain, rank, rslora, targets)
CASES = [
    ("qwen3", "cpu:1", 2, "stage", 8, False, ALL),
    ("qwen3", "cpu:2", 3, "layer", 64, True, ["q_proj", "v_proj"]),
    ("llama", "cpu:3", 3, "stage", 64, False, ["q_proj", "v_proj"]),
    ("llama", "cpu:2", 2, "layer", 8, True, ALL),
]


def _reference(model: nn.Module, batch: Dict[str, torch.Tensor]):
    """The PEFT model's logits, loss and LoRA gradients, the loss in float64 (Hugging Face's loss upcasts
    the logits to float32, which would round away the comparison)."""
    logits = model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"][:, 1:].reshape(-1)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), lora_grads(model)


@pytest.mark.parametrize(
    "workers, family, num_microbatch, grain, r, rslora, targets",
    [(w, f, m, g, r, s, t) for f, w, m, g, r, s, t in CASES],
    ids=[
        f"{f} {w} mb{m} {g} r{r}{' rslora' if s else ''} {'all' if t is ALL else 'qv'}" for f, w, m, g, r, s, t in CASES
    ],
    indirect=["workers"],
)
def test_roundpipe_fused_lora_matches_peft(
    workers: str, spy: Dict[str, int], family: str, num_microbatch: int, grain: str, r: int, rslora: bool, targets
) -> None:
    """Logits, loss and every LoRA gradient equal the PEFT model's (float64, 1e-10), forward + backward and
    train_step, with the full-attention layers run as the whole-layer op and their adapters fused."""
    model = add_lora(tiny_model(family).double(), targets, r, rslora)
    batch = make_batch(padding=False)
    ref_logits, ref_loss, ref_grads = _reference(model, batch)
    run = RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain)
    rp = models.wrap_model(model, model_run_config=run, fused_kernels=True)
    out = rp(**batch, return_logits=True)
    out.loss.backward()
    assert rel_err(out.logits, ref_logits) < TOL and rel_err(out.loss, ref_loss) < TOL
    assert_close(lora_grads(model), ref_grads)
    assert spy.get("decoder_layer", 0) > 0 and spy["lora"] >= spy.get("decoder_layer", 0) * (
        len(targets) if family == "llama" else 1
    )
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_close(lora_grads(model), ref_grads)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_dropout_falls_back_and_equals_peft(workers: str, spy: Dict[str, int]) -> None:
    """LoRA dropout in training: PEFT's modules (no whole-layer op, no fused linear), the same loss and
    gradients as PEFT with the same dropout draws (one microbatch, so the random streams line up)."""
    model = add_lora(tiny_model("llama").double(), ["q_proj", "v_proj"], 8, dropout=0.3)
    batch = make_batch(padding=False)
    torch.manual_seed(5)
    _, ref_loss, ref_grads = _reference(model, batch)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=1), fused_kernels=True)
    torch.manual_seed(5)
    out = rp(**batch)
    out.loss.backward()
    assert "decoder_layer" not in spy and "lora" not in spy and spy  # the fused modules ran, PEFT's adapters
    assert rel_err(out.loss, ref_loss) < TOL
    assert_close(lora_grads(model), ref_grads)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_sequence_tiles_take_the_fused_linear(workers: str, spy: Dict[str, int]) -> None:
    """Above the tile length the tiled parts run the compiled pre / post-attention ops with the adapters
    fused, and the gradients still equal PEFT's."""
    model = add_lora(tiny_model("llama").double(), ["q_proj", "v_proj", "down_proj"], 8)
    batch = make_batch(padding=False, batch=2, seq=24)
    _, ref_loss, ref_grads = _reference(model, batch)
    with settings.overridden(seq_tile=8):
        rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=2), fused_kernels=True)
        loss = rp.train_step(**batch)
    assert spy.get("pre_attention", 0) > 0 and spy.get("post_attention", 0) > 0 and spy["lora"] > 0
    assert rel_err(loss, ref_loss) < TOL
    assert_close(lora_grads(model), ref_grads)


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------


def _gpu_layer(shape: Dict[str, Any], adapter_dtype: torch.dtype, r: int = 16) -> Tuple[nn.Module, Any]:
    """A bf16 Qwen3 decoder layer on the GPU with LoRA on every projection (adapters in ``adapter_dtype``)."""
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    cfg = configs.tiny_config("qwen3")
    for k, v in shape.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = qwen3.Qwen3DecoderLayer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    holder = nn.Sequential(layer)
    model = add_lora(holder, ALL, r)
    for n, p in model.named_parameters():
        p.data = p.data.to("cuda", adapter_dtype if "lora_" in n else torch.bfloat16)
    return model.base_model.model[0], cfg


def _run(layer: nn.Module, cfg: Any, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    pos = qwen3.Qwen3RotaryEmbedding(cfg).to(x.device)(x, torch.arange(x.shape[1], device=x.device)[None])
    xt = x.detach().requires_grad_(True)
    y = layer(xt, attention_mask=None, position_embeddings=pos)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(torch.ones_like(y) / y.shape[-1])
    res = {"y": y.detach(), "dx": xt.grad}
    res.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    layer.zero_grad(set_to_none=True)
    return res


@pytest.mark.gpu
@pytest.mark.parametrize(
    "adapter, compute",
    [(torch.float32, "peft"), (torch.bfloat16, "peft"), (torch.float32, "base")],
    ids=["fp32 adapters", "bf16 adapters", "fp32 adapters computed in bf16"],
)
def test_gpu_fused_matches_peft_in_bf16(spy: Dict[str, int], adapter: torch.dtype, compute: str) -> None:
    """bf16 layer, LoRA r16 on all projections: the fused whole-layer op (compiled) and PEFT over Hugging
    Face's modules, each against the same layer in float64. The fused path's output and every gradient
    are within bf16 rounding: no more than twice PEFT's own error (2^-8 at least: both round to bf16,
    in different orders); with float32 adapters computed in bf16 (``RPP_DEBUG_LORA_COMPUTE=base``) as well."""
    settings.configure(compile=True, debug_lora_compute=compute)
    kernels.reset()
    shape = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    peft_layer, cfg = _gpu_layer(shape, adapter)
    exact, fused = copy.deepcopy(peft_layer).double(), copy.deepcopy(peft_layer)
    kernels.fuse_layer(fused)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    ref, hf, got = _run(exact, cfg, x.double()), _run(peft_layer, cfg, x), _run(fused, cfg, x)
    assert spy.get("decoder_layer", 0) == 1 and not kernels.DECODER_LAYER.failed  # compiled, no eager fallback
    assert ref.keys() == got.keys() == hf.keys()
    for name in ref:
        err, peft_err = rel_err(got[name].double(), ref[name]), rel_err(hf[name].double(), ref[name])
        assert err <= max(2 * peft_err, 2**-8), f"{name}: fused {err:.2e}, PEFT {peft_err:.2e}"


@pytest.mark.gpu
def test_gpu_timing_qwen3_1_7b_layer(spy: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward + backward of a qwen3-1.7b-shaped bf16 layer, LoRA r16 on all projections (fp32 adapters,
    PEFT's default), 4 x 4096 tokens: PEFT over Hugging Face's modules, the fused modules with the
    adapters unfused (the per-module path), and the fused whole-layer op with the fused LoRA linear,
    eager and compiled, and compiled with the adapters computed in bf16 (``RPP_DEBUG_LORA_COMPUTE=base``). Prints
    milliseconds and peak memory; asserts only that the fused op ran."""
    settings.configure(compile=True)
    kernels.reset()
    shape = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    hf_layer, cfg = _gpu_layer(shape, torch.float32)
    fused = copy.deepcopy(hf_layer)
    kernels.fuse_layer(fused)
    x = torch.randn(4, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    report = {}
    entries = (("peft", hf_layer), ("modules", fused), ("fused eager", fused), ("fused", fused), ("fused bf16", fused))
    for name, layer in entries:
        settings.configure(compile=name != "fused eager", debug_lora_compute="base" if name == "fused bf16" else "peft")
        with monkeypatch.context() as m:
            if name == "modules":
                m.setattr(lora, "_active_adapter", lambda module: None)
            before = spy.get("decoder_layer", 0)
            for _ in range(3):
                _run(layer, cfg, x)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(10):
                _run(layer, cfg, x)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / 10 * 1e3
            peak = torch.cuda.max_memory_allocated() / 2**30
            assert (spy.get("decoder_layer", 0) > before) == name.startswith("fused"), name
        report[name] = f"{ms:.2f} ms, peak {peak:.2f} GiB"
    assert not kernels.DECODER_LAYER.failed
    print(f"\nqwen3-1.7b layer, LoRA r16 all projections, 4 x 4096 tokens, forward + backward: {report}")
