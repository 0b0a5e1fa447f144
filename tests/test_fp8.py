"""FP8 GEMMs (``fp8=True``, roundpipe.models.fp8) against plain PyTorch references that apply the same casts.

* the CPU emulation of ``torch._scaled_mm`` equals ``torch._scaled_mm`` on CPU;
* a frozen fp8 base: one fused LoRA projection, and whole tiny models through RoundPipe on CPU workers
  (fused layer ops and module by module, sequence tiles), equal in float64 (1e-10) PEFT's LoRA over the
  dequantized fp8 base whose GEMMs quantize the activation (forward) and the scaled output gradient
  (backward) per row to e4m3, written here independently;
* trained weights: a full fine-tune through RoundPipe equals the same model converted by torchao's float8
  training recipe and run eagerly on CPU; the head, norms and embedding stay as they were;
* an MoE model converts only its attention projections;
* the errors: a GPU without FP8, a base not stored as fp8, a per-call fp8, ``--fp8`` without ``--base-format fp8``;
* ``roundpipe train --fp8`` trains the tiny built-in, full fine-tune and LoRA over an fp8 base (about 4 s);
* like with like, in float32 (whole models, on a GPU and as the CPU analogues that measure the bounds): plain PEFT
  over the same bytes, torchao's recipe; on a GPU one bf16 projection equals the CPU emulation to bf16 rounding.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, Tuple

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import LORA_PROJECTIONS, rel_err
from torch import nn

import roundpipe
from roundpipe import models, settings
from roundpipe.host.formats import FrozenWeight, quantize_frozen
from roundpipe.models import fp8, kernels, lora
from roundpipe.runtime.run_config import RoundPipeRunConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_fused_lora import add_lora  # noqa: E402
from test_kernels import op_calls  # noqa: E402, F401 -- the fixture
from test_models import grads, make_batch, tiny_model  # noqa: E402

TOL = 1e-10  # float64 throughout
E4M3 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------------
# The reference: plain PyTorch, the same casts
# ---------------------------------------------------------------------------------------------------------


def ref_quantized(x: torch.Tensor) -> torch.Tensor:  # x: [rows, k] float64
    """``x`` rounded through e4m3 with a float32 scale ``amax / 448`` per row, back in float64."""
    scale = (x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).float().double()
    return (x / scale).clamp(-448.0, 448.0).to(E4M3).double() * scale


class _RefFp8Gemms(torch.autograd.Function):
    """``y = q(x) W^T`` and ``dx = q(dy * s) D`` over ``W = D * s[:, None]`` (D the e4m3 bytes, s the row scales)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(data, scale)
        w = data.double() * scale.double()[:, None]  # [out, in]: the dequantized fp8 base
        return (ref_quantized(x.reshape(-1, x.shape[-1])) @ w.t()).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        data, scale = ctx.saved_tensors
        g = ref_quantized(dy.reshape(-1, dy.shape[-1]) * scale.double()[None, :])
        return (g @ data.double()).view(*dy.shape[:-1], -1), None, None


def gpu_quantized(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:  # x: [rows, k] float32
    """``x`` as e4m3 [rows, k] and its float32 scales ``amax / 448`` [rows, 1] (the GPU reference's casts)."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x / scale).clamp(-448.0, 448.0).to(E4M3).contiguous(), scale  # row-major, as _scaled_mm takes it


def gpu_unit_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a: [m, k], b: [k, n] column-major, e4m3
    """``a @ b`` in float32 [m, n]: ``torch._scaled_mm`` with unit scales (a float32 output takes no row scales)."""
    one = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)


class _GpuRefFp8Gemms(torch.autograd.Function):
    """:class:`_RefFp8Gemms` in float32 on a GPU, the GEMMs by ``torch._scaled_mm`` over the same e4m3 bytes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(data, scale)
        xq, sx = gpu_quantized(x.reshape(-1, x.shape[-1]))
        return (gpu_unit_mm(xq, data.t()) * sx * scale[None, :]).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        data, scale = ctx.saved_tensors
        gq, sg = gpu_quantized(dy.reshape(-1, dy.shape[-1]) * scale[None, :])
        return (gpu_unit_mm(gq, data.t().contiguous().t()) * sg).view(*dy.shape[:-1], -1), None, None


class RefFp8Linear(nn.Module):
    """A frozen fp8 projection in plain PyTorch (the reference model's base layers): float64 on CPU, float32
    with ``torch._scaled_mm`` on a GPU."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.data, self.scale = data, scale
        self.in_features, self.out_features = data.shape[1], data.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        gemms = _GpuRefFp8Gemms if x.is_cuda else _RefFp8Gemms
        return gemms.apply(x, self.data, self.scale)


def fp8_base_pair(
    targets: Any, seed: int = 0, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> Tuple[nn.Module, nn.Module]:
    """A tiny Qwen3 in ``dtype`` with LoRA on ``targets`` and its frozen base packed as fp8, and the reference on
    ``device``: the same PEFT model with every packed projection replaced by :class:`RefFp8Linear` over the same
    bytes."""
    model = add_lora(tiny_model("qwen3", seed).to(dtype), targets, 8)
    ref = copy.deepcopy(model)
    quantize_frozen(model, "fp8")
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and isinstance(mod.weight, FrozenWeight):
            parent, _, attr = name.rpartition(".")
            data, scale = mod.weight.packed["data"].to(device), mod.weight.packed["scale"].to(device)
            setattr(ref.get_submodule(parent), attr, RefFp8Linear(data, scale))
    return model, ref.to(device)


def reference_step(model: nn.Module, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The unsplit model's loss (cross entropy in the logits' dtype) and its gradients."""
    logits = model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"][:, 1:].reshape(-1)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(labels.numel(), -1), labels, ignore_index=-100)
    loss.backward()
    return loss.detach(), grads(model)


def assert_close(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert got.keys() == ref.keys() and got
    for name in ref:
        assert rel_err(got[name], ref[name]) < tol, f"{name}: {rel_err(got[name], ref[name]):.2e}"


@pytest.fixture
def fp8_calls(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Counts of FP8 forward and input-gradient GEMMs (from any worker thread)."""
    calls = {"forward": 0, "grad_input": 0}
    forward_mm, grad_input_mm = fp8.forward_mm, fp8.grad_input_mm

    def counting_forward(*args: Any) -> torch.Tensor:
        calls["forward"] += 1
        return forward_mm(*args)

    def counting_grad(*args: Any) -> torch.Tensor:
        calls["grad_input"] += 1
        return grad_input_mm(*args)

    monkeypatch.setattr(fp8, "forward_mm", counting_forward)
    monkeypatch.setattr(fp8, "grad_input_mm", counting_grad)
    settings.configure(compile=False)
    return calls


# ---------------------------------------------------------------------------------------------------------
# The GEMM
# ---------------------------------------------------------------------------------------------------------


def test_emulation_equals_cpu_scaled_mm() -> None:
    """The emulated GEMM is what ``torch._scaled_mm`` computes on CPU, bit for bit (rowwise scales)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 64, generator=g).to(E4M3)
    b = torch.randn(32, 64, generator=g).to(E4M3)
    sa, sb = torch.rand(48, 1, generator=g) + 0.5, torch.rand(1, 32, generator=g) + 0.5
    for out_dtype in (torch.float32, torch.bfloat16):
        want = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        assert torch.equal(fp8.emulated_scaled_mm(a, b.t(), sa, sb, out_dtype), want)


def test_scales_after_a_unit_scaled_gemm() -> None:
    """The fallback of GPUs without rowwise ``torch._scaled_mm`` (unit scales, the row scales after it) gives
    the rowwise result to float32 rounding (checked with ``torch._scaled_mm`` on CPU)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(48, 64, generator=g).to(E4M3)
    b = torch.randn(32, 64, generator=g).to(E4M3)
    sa, sb = torch.rand(48, 1, generator=g) + 0.5, torch.rand(1, 32, generator=g) + 0.5
    want = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert rel_err(fp8.unit_scaled_mm(a, b.t()) * sa * sb, want) < 1e-6


def test_grad_input_gemm_is_one_op_with_its_shape() -> None:
    """The input-gradient GEMM is one registered op (so a compiled layer cannot hoist the GPU's transposed weight
    copy into its forward): its fake kernel's shape and dtype match the real one, and it computes ``dy W``.
    (``opcheck``'s schema test multiplies the fp8 inputs, which CPU kernels do not.)"""
    g = torch.Generator().manual_seed(2)
    gq = torch.randn(48, 32, generator=g).to(E4M3)
    sg = torch.rand(48, 1, generator=g) + 0.5
    data = torch.randn(32, 64, generator=g).to(E4M3)
    for out_dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(
            torch.ops.roundpipe.fp8_grad_input_gemm, (gq, sg, data, out_dtype), test_utils=("test_faketensor",)
        )
        want = fp8.emulated_scaled_mm(gq, data, sg, torch.ones(1, 64), out_dtype)
        assert torch.equal(torch.ops.roundpipe.fp8_grad_input_gemm(gq, sg, data, out_dtype), want)


def test_quantize_rows() -> None:
    """Per-row scales ``amax / 448``; the largest value of a row maps to 448; a zero row stays zero."""
    x = torch.randn(5, 40, dtype=torch.float64)
    x[3] = 0
    q, s = fp8.quantize_rows(x)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (5, 1)
    assert torch.equal(q.double() * s.double(), ref_quantized(x))
    assert q.double().abs().amax(dim=1)[[0, 1, 2, 4]].eq(448).all() and q[3].double().eq(0).all()


@pytest.mark.parametrize("adapter", [True, False], ids=["lora", "plain"])
def test_one_projection_equals_reference(adapter: bool) -> None:
    """One projection over a frozen fp8 weight (the fused LoRA linear, or the plain fp8 linear): output and
    the input, A and B gradients equal the reference (float64)."""
    torch.manual_seed(0)
    fw = FrozenWeight.quantize(torch.randn(48, 64, dtype=torch.float64) / 8, "fp8")
    data, scale = fw.packed["data"], fw.packed["scale"]
    a = (torch.randn(8, 64, dtype=torch.float64) / 8).requires_grad_(adapter)
    b = (torch.randn(48, 8, dtype=torch.float64) / 8).requires_grad_(adapter)
    x = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, 48, dtype=torch.float64)
    proj = lora.LoraWeights(lora.Fp8Base(data, scale), a, b, 1.75) if adapter else lora.Fp8Base(data, scale)
    y = lora.linear(x, proj)
    got = torch.autograd.grad(y, [x, a, b] if adapter else [x], dy)
    xr = x.detach().clone().requires_grad_(True)
    yr = _RefFp8Gemms.apply(xr, data, scale)
    if adapter:
        yr = yr + (xr @ a.t()) @ b.t() * 1.75
    want = torch.autograd.grad(yr, [xr, a, b] if adapter else [xr], dy)
    assert y.dtype == torch.float64 and rel_err(y, yr) < TOL
    for g_, w_ in zip(got, want):
        assert rel_err(g_, w_) < TOL
    # The fp8 casts matter: the same projection without them differs by far more than the tolerance.
    plain = torch.nn.functional.linear(x, fw.dequantize())
    assert rel_err(y if not adapter else y - (x @ a.t()) @ b.t() * 1.75, plain) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# A frozen fp8 base through RoundPipe
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workers, fused, microbatches",
    [("cpu:2", True, 2), ("cpu:3", False, 3)],
    ids=["fused cpu:2 mb2", "modules cpu:3 mb3"],
    indirect=["workers"],
)
def test_lora_over_fp8_base_equals_reference(workers: str, fp8_calls: Dict[str, int], fused: bool, microbatches: int):
    """LoRA on q / v (the other projections plain fp8) over an fp8 base: the loss and every LoRA gradient
    equal the reference's to 1e-10, with the layers run as fused ops and module by module (the modules'
    ``F.linear`` over the device fp8 weight takes the same FP8 GEMMs)."""
    model, ref = fp8_base_pair(["q_proj", "v_proj"])
    batch = make_batch(padding=False)
    ref_loss, ref_grads = reference_step(ref, batch)
    run = RoundPipeRunConfig(num_microbatch=microbatches)
    rp = models.wrap_model(model, model_run_config=run, base_format="fp8", fp8=True, fused_kernels=fused)
    assert rp.model_run_config.fp8
    loss = rp.train_step(**batch)
    assert rel_err(loss, ref_loss) < TOL
    assert_close(grads(model), ref_grads)
    # Every projection of every microbatch forward (and recomputed), every input gradient but the first
    # layer's q / k / v (the frozen embedding's output needs none).
    projections = 7 * model.config.num_hidden_layers
    assert fp8_calls["forward"] >= 2 * projections * microbatches
    assert fp8_calls["grad_input"] == (projections - 3) * microbatches


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_sequence_tiles_over_fp8_base(
    workers: str,
    fp8_calls: Dict[str, int],
    op_calls: Dict[str, int],  # noqa: F811 -- the fixture
) -> None:
    """The tiled pre / post-attention parts take the same fp8 projections: equal to the reference."""
    model, ref = fp8_base_pair(["q_proj", "v_proj", "down_proj"])
    batch = make_batch(padding=False, batch=2, seq=24)
    ref_loss, ref_grads = reference_step(ref, batch)
    with settings.overridden(seq_tile=8):  # through the top-level wrapper this time
        run = RoundPipeRunConfig(num_microbatch=2, fp8=True)
        rp = roundpipe.wrap_model_to_roundpipe(model, model_run_config=run, base_format="fp8", fused_kernels=True)
        loss = rp.train_step(**batch)
    assert op_calls.get("pre_attention", 0) > 0 and op_calls.get("post_attention", 0) > 0
    assert fp8_calls["forward"] > 0 and fp8_calls["grad_input"] > 0
    assert rel_err(loss, ref_loss) < TOL
    assert_close(grads(model), ref_grads)


# ---------------------------------------------------------------------------------------------------------
# Trained weights: torchao's float8 training recipe
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers, fused", [("cpu:2", True), ("cpu:3", False)], indirect=["workers"])
def test_full_fine_tune_equals_torchao(
    workers: str,
    fused: bool,
    op_calls: Dict[str, int],  # noqa: F811 -- the fixture
) -> None:
    """A full fine-tune with fp8=True equals, bit for bit, the model converted by torchao's
    ``convert_to_float8_training`` (decoder projections only) run unsplit on CPU: the logits and every gradient
    from a fixed gradient of the logits (float32; one microbatch, since tensorwise scales are taken over the
    whole tensor), with the layers run as the whole-layer op (its eager path is Hugging Face's ops in their
    order) and module by module. A loss would not do: its float32 rounding differs in the last bits between
    the chunked loss and Hugging Face's, and the e5m2 casts of the gradients turn that into a few flips."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_model("qwen3")
    ref = copy.deepcopy(model)
    convert_to_float8_training(ref, module_filter_fn=lambda m, fqn: ".layers." in f".{fqn}")
    ids = make_batch(padding=False)["input_ids"]
    ref_logits = ref(input_ids=ids).logits
    seed = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(3))
    ref_logits.backward(seed)
    ref_grads = grads(ref)
    settings.configure(compile=False)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=1, fp8=True), fused_kernels=fused)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {n for n, m in ref.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == 7 * model.config.num_hidden_layers and "lm_head" not in converted
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    out = rp(input_ids=ids)
    out.logits.backward(seed)
    assert (op_calls.get("decoder_layer", 0) > 0) == fused
    got = grads(model)
    assert torch.equal(out.logits, ref_logits) and got.keys() == ref_grads.keys() and got
    assert all(torch.equal(got[n], ref_grads[n]) for n in got), [
        n for n in got if not torch.equal(got[n], ref_grads[n])
    ]


def test_trained_filter_keeps_head_router_and_adapters() -> None:
    linear = nn.Linear(32, 32)
    assert fp8.trained_filter(linear, "model.layers.0.mlp.gate_proj")
    for fqn in ("lm_head", "model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj.lora_A.default", "model.x"):
        assert not fp8.trained_filter(linear, fqn)
    assert not fp8.trained_filter(nn.Linear(32, 24), "model.layers.0.mlp.up_proj")  # not a multiple of 16
    frozen = nn.Linear(32, 32).requires_grad_(False)
    assert not fp8.trained_filter(frozen, "model.layers.0.mlp.up_proj")


def test_moe_converts_only_the_attention_projections() -> None:
    """In an MoE model the router and the experts (fused expert tensors, not ``nn.Linear``s) stay as they were;
    the attention projections take torchao's recipe."""
    from torchao.float8.float8_linear import Float8Linear

    from roundpipe.models.configs import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    routers = {n: type(m) for n, m in model.named_modules() if n.endswith("mlp.gate")}
    fp8.prepare(model, True)
    converted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert routers and {n: type(model.get_submodule(n)) for n in routers} == routers


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def test_gpu_without_fp8_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fp8.check_capabilities([(9, 0), (8, 9)])
    with pytest.raises(ValueError, match=r"GPU 1 has compute capability 8\.6.*remove fp8=True \(--fp8"):
        fp8.check_capabilities([(9, 0), (8, 6)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.0"):
        models.wrap_model(tiny_model("qwen3"), fp8=True)


def test_fp8_needs_a_base_stored_as_fp8() -> None:
    model = add_lora(tiny_model("qwen3"), ["q_proj"], 8)
    with pytest.raises(ValueError, match=r"kept as bfloat16|kept as float32.*base_format='fp8'"):
        models.wrap_model(model, fp8=True)
    with pytest.raises(ValueError, match=r"kept as int8.*base_format='fp8'"):
        models.wrap_model(model, fp8=True, base_format="int8")


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_fp8_is_chosen_at_wrap_time(workers: str) -> None:
    """A call's run config cannot switch fp8; the keyword and the model's config must agree."""
    with pytest.raises(ValueError, match="disagree"):
        fp8.wants_fp8(False, RoundPipeRunConfig(fp8=True))
    with pytest.raises(ValueError, match="fp8='maybe'"):
        RoundPipeRunConfig(fp8="maybe")  # type: ignore[arg-type]
    rp = models.wrap_model(tiny_model("qwen3"))
    batch = make_batch(padding=False)
    with pytest.raises(ValueError, match="fp8 is chosen when the model is wrapped"):
        rp(**batch, roundpipe_run_config=RoundPipeRunConfig(fp8=True))


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_a_roundpipe_built_directly_needs_converted_layers(workers: str) -> None:
    """``RoundPipe(model, model_run_config=RoundPipeRunConfig(fp8=True))`` over layers nobody converted is an
    error naming the wrappers (it would run them in bf16 without a word); after ``fp8.prepare`` it builds, and
    the projections are torchao's ``Float8Linear``s, as the wrappers make them."""
    from torchao.float8.float8_linear import Float8Linear

    def converted(m: nn.Module) -> int:
        return sum(isinstance(x, Float8Linear) for x in m.modules())

    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match=r"wrap_model_to_roundpipe\(model, fp8=True\)"):
        roundpipe.RoundPipe(model, model_run_config=RoundPipeRunConfig(fp8=True))
    assert fp8.unconverted(model) and converted(model) == 0
    fp8.prepare(model, True)
    roundpipe.RoundPipe(model, model_run_config=RoundPipeRunConfig(fp8=True))
    wrapped = tiny_model("qwen3")
    models.wrap_model(wrapped, fp8=True)
    assert not fp8.unconverted(model) and converted(model) == converted(wrapped) > 0


def test_cli_fp8_flag(tmp_path: Any) -> None:
    """``--fp8`` is a train flag; with LoRA it needs ``--base-format fp8``."""
    from roundpipe.cli.config import ConfigError
    from roundpipe.cli.config_flags import parse_train_args

    out = ["--output-dir", str(tmp_path)]
    cfg = parse_train_args(["--fp8", "--lora-r", "8", "--base-format", "fp8", *out]).cfg
    assert cfg.fp8 and cfg.base_format == "fp8"
    assert parse_train_args(["--fp8", *out]).cfg.fp8  # a full fine-tune: torchao's recipe
    with pytest.raises(ConfigError, match="--base-format fp8"):
        parse_train_args(["--fp8", "--lora-r", "8", *out])
    assert not parse_train_args(out).cfg.fp8


@pytest.mark.parametrize("lora_args", [[], ["--lora-r", "8", "--base-format", "fp8"]], ids=["full", "lora"])
def test_cli_trains_with_fp8(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, restore_process_state: None, lora_args: Any
) -> None:
    """``roundpipe train --fp8`` (two steps of the tiny built-in on two CPU workers) converts the model's
    projections (a full fine-tune to torchao's recipe, a LoRA base to its fp8 bytes) and trains."""
    from roundpipe.cli import main

    seen = {}
    prepare = fp8.prepare

    def spying_prepare(model: nn.Module, enabled: bool) -> None:
        prepare(model, enabled)
        seen["float8"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        seen["fp8 bases"] = sum(getattr(p, "format", None) is fp8.FP8_COMPUTE for p in model.parameters())

    monkeypatch.setattr(fp8, "prepare", spying_prepare)
    argv = ["train", "--fp8", "--steps", "2", "--eval-examples", "0", "--devices", "cpu:2", "--batch-size", "4"]
    argv += ["--output-dir", str(tmp_path / "run"), *lora_args]
    assert main(argv) == 0
    assert (seen["fp8 bases"] > 0 and seen["float8"] == 0) if lora_args else (seen["float8"] > 0)


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_fp8_base_within_fp8_tolerance_of_bf16() -> None:
    """A bf16 LoRA projection over an fp8 base on the GPU (``torch._scaled_mm``): the output and input
    gradient equal the CPU emulation to bf16 rounding, and are within fp8 tolerance of the bf16 GEMMs over
    the dequantized base."""
    fp8.check_hardware()
    torch.manual_seed(0)
    fw = FrozenWeight.quantize(torch.randn(1024, 2048) / 32, "fp8")
    data, scale = fw.packed["data"].cuda(), fw.packed["scale"].cuda()
    w = fw.dequantize(device="cuda", dtype=torch.bfloat16)
    a = (torch.randn(16, 2048, device="cuda") / 32).requires_grad_(True)
    b = (torch.randn(1024, 16, device="cuda") / 32).requires_grad_(True)
    x = torch.randn(4, 512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)

    def run(proj: Any, xin: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        xin = xin.detach().requires_grad_(True)
        y = lora.linear(xin, proj)
        return (y, *torch.autograd.grad(y, [xin, a, b], dy.to(xin.device)))

    got = run(lora.LoraWeights(lora.Fp8Base(data, scale), a, b, 2.0), x)
    bf16 = run(lora.LoraWeights(w, a, b, 2.0), x)
    cpu_proj = lora.LoraWeights(lora.Fp8Base(data.cpu(), scale.cpu()), a.detach().cpu(), b.detach().cpu(), 2.0)
    xc = x.detach().cpu().requires_grad_(True)
    yc = lora.linear(xc, cpu_proj)
    (dxc,) = torch.autograd.grad(yc, [xc], dy.cpu())
    assert rel_err(got[0].float().cpu(), yc.float()) < 2**-7 and rel_err(got[1].float().cpu(), dxc.float()) < 2**-7
    for g_, ref in zip(got, bf16):
        assert rel_err(g_.float(), ref.float()) < 0.08  # the CPU emulation here: 0.026 (y, dx), 0 (A, B)


# ---------------------------------------------------------------------------------------------------------
# Whole models on a GPU, like with like: the same fp8 recipe on two paths that differ only in rounding
# ---------------------------------------------------------------------------------------------------------

# In float32: runs of one fp8 recipe that differ at bf16 rounding (2^-8) flip ~3% of the e4m3 roundings (ulp 2^-3),
# each flip moves its row's next GEMM enough to flip more, and over ~20 quantized GEMMs the difference reaches fp8's
# own. On CPU workers (bf16 tiny Qwen3, LoRA r8 on every projection over an fp8 base, 4 x 64 tokens, 3 seeds) the
# worst gradient's relative error, fused layer vs module by module: 0.18-0.21; fp8 off: 0.21-0.28. At float32
# rounding a flip is rare and stays in its token's row. Bounds per gradient from 16 seeds of the CPU analogues:
LORA_BOUND = 0.1  # float32 vs float64, the same bytes: 0-0.052, compiled vs eager 0.0007; fp8 off: 0.17-0.26
FT_BOUND = 0.25  # weights moved by float32 rounding: 0-0.18, compiled vs eager 0.13; unconverted: 0.30-0.62


def assert_like_with_like(
    got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], without_fp8: Dict[str, torch.Tensor], bound: float
) -> None:
    """Every gradient of ``got`` within ``bound`` of ``want``'s, and those of the same model run without fp8 not
    all within it: the bound tells the fp8 recipe from none, so the fp8 GEMMs ran."""
    assert got.keys() == want.keys() == without_fp8.keys() and got
    errs = {n: rel_err(got[n], want[n]) for n in want}
    worst = max(errs, key=errs.get)
    assert errs[worst] < bound, f"{worst}: {errs[worst]:.3f} (bound {bound})"
    off = max(rel_err(without_fp8[n], want[n]) for n in want)
    assert off > bound, f"without fp8 within the bound too: {off:.3f}"


def lora_fp8_grads(model: nn.Module, batch: Dict[str, torch.Tensor], use_fp8: bool = True) -> Dict[str, torch.Tensor]:
    """The LoRA gradients of one train step (two microbatches, the whole-layer op) of ``model`` over its fp8 base
    through RoundPipe on the current workers: FP8 GEMMs, or without ``use_fp8`` plain ones over the dequantized base."""
    kw: Dict[str, Any] = dict(base_format="fp8", fp8=use_fp8, fused_kernels=True)
    models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=2), **kw).train_step(**batch)
    assert not kernels.DECODER_LAYER.failed and (kernels.DECODER_LAYER.compiled or settings.DISABLE_TORCH_COMPILE.get())
    return grads(model)


def torchao_logit_grads(
    model: nn.Module, ids: torch.Tensor, seed: torch.Tensor, convert: bool = True
) -> Dict[str, torch.Tensor]:  # ids: [batch, seq] on the device to run on; seed: [batch, seq, vocab]
    """The gradients (on CPU) from ``seed`` on the logits of a copy of ``model`` on ``ids``'s device, converted by
    torchao's float8 training as the wrappers convert it (unless not ``convert``): plain PyTorch."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ref = copy.deepcopy(model).to(ids.device)
    if convert:
        convert_to_float8_training(ref, module_filter_fn=fp8.trained_filter, config=Float8LinearConfig())
    ref(input_ids=ids).logits.backward(seed.to(ids.device))
    return {n: g.cpu() for n, g in grads(ref).items()}


def roundpipe_logit_grads(model: nn.Module, ids: torch.Tensor, seed: torch.Tensor) -> Dict[str, torch.Tensor]:
    """A copy of ``model`` through RoundPipe with fp8=True on the current workers (one microbatch: tensorwise
    scales are taken over the whole tensor): its gradients from the gradient ``seed`` of the logits."""
    model = copy.deepcopy(model)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=1, fp8=True), fused_kernels=True)
    out = rp(input_ids=ids)
    out.logits.backward(seed.to(out.logits.device))
    assert not kernels.DECODER_LAYER.failed and (kernels.DECODER_LAYER.compiled or settings.DISABLE_TORCH_COMPILE.get())
    return grads(model)


def rounding_jitter(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every weight moved by at most one float32 rounding (relative 2^-24): what a
    different kernel's order of operations does to a result."""
    model, g = copy.deepcopy(model), torch.Generator().manual_seed(100)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + (torch.rand(p.shape, generator=g) - 0.5) * 2**-23)
    return model


BOTH = ["cpu:1", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def on_gpu(workers: str) -> bool:
    """Whether the test runs on the GPU, and there: the fused layer compiled, float32 GEMMs (not TF32's 10 bits)."""
    if not workers.startswith("cuda"):
        return False
    assert torch.get_float32_matmul_precision() == "highest"
    fp8.check_hardware()
    settings.configure(compile=True)
    kernels.reset()
    return True


@pytest.mark.parametrize("workers", BOTH, indirect=True)
def test_lora_over_fp8_base_like_with_like(workers: str) -> None:
    """LoRA on every projection over an fp8 base (float32) through RoundPipe, within :data:`LORA_BOUND` of plain
    PEFT over the same bytes (:class:`RefFp8Linear`), and without fp8 not. On CPU workers (the analogue the bound
    is measured by) the reference is float64: different at float32 rounding. On the GPU it runs on the same GPU,
    its GEMMs ``torch._scaled_mm`` too: a GPU's FP8 accumulation rounds unlike the emulation's float32 sums (per
    projection, :func:`test_gpu_fp8_base_within_fp8_tolerance_of_bf16` compares them to bf16 rounding)."""
    gpu = on_gpu(workers)
    dev = "cuda" if gpu else "cpu"
    model, ref = fp8_base_pair(LORA_PROJECTIONS, dtype=torch.float32, device=dev)
    without = copy.deepcopy(model)
    batch = make_batch(padding=False, batch=4, seq=64)
    _, want = reference_step(ref if gpu else ref.double(), {k: batch[k].to(dev) for k in ("input_ids", "labels")})
    got = lora_fp8_grads(model, batch)
    assert gpu or any(rel_err(got[n], want[n]) > 1e-6 for n in want)  # a real rounding difference
    assert_like_with_like(got, want, lora_fp8_grads(without, batch, use_fp8=False), LORA_BOUND)


@pytest.mark.parametrize("workers", BOTH, indirect=True)
def test_full_fine_tune_like_with_like(workers: str) -> None:
    """A full fine-tune (float32) through RoundPipe with fp8=True within :data:`FT_BOUND` of torchao's
    ``convert_to_float8_training`` of the same model (the same ``trained_filter`` and config) run eagerly, and
    the model unconverted not. On CPU workers (the analogue the bound is measured by) the reference's weights are
    moved by float32 rounding (eagerly on CPU the two agree bit for bit); on the GPU it runs on the same GPU."""
    gpu = on_gpu(workers)
    model = tiny_model("qwen3", 1)
    ids = make_batch(padding=False, batch=4, seq=64)["input_ids"]
    seed = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    ref_ids = ids.cuda() if gpu else ids
    want = torchao_logit_grads(model if gpu else rounding_jitter(model), ref_ids, seed)
    without = torchao_logit_grads(model, ref_ids, seed, convert=False)
    got = roundpipe_logit_grads(model, ids, seed)
    assert gpu or any(rel_err(got[n], want[n]) > 1e-6 for n in want)
    assert_like_with_like(got, want, without, FT_BOUND)
