"""Frozen-weight formats: NF4 equal to torchao's, fp8/int8 within their rounding, the FrozenWeight's module
plumbing, and LoRA gradients through RoundPipe over a packed base equal to PEFT's over the dequantized one."""

from __future__ import annotations

import copy
import os
from typing import Any

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch
from helpers import with_lora
from test_models import make_batch
from torch import nn

import roundpipe
from roundpipe import models
from roundpipe.host.formats import (
    BASE_FORMATS,
    FrozenWeight,
    check_base_format,
    frozen_weights,
    host_nbytes,
    quantize_frozen,
)
from roundpipe.models.configs import tiny_config
from roundpipe.runtime.run_config import RoundPipeRunConfig

PACKED = ["fp8", "int8", "nf4"]


def _weight(shape=(128, 512), dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(dtype)


def test_check_base_format() -> None:
    assert [check_base_format(f) for f in BASE_FORMATS] == list(BASE_FORMATS)
    with pytest.raises(ValueError, match="base_format='nf5'.*bf16, fp8, int8, nf4"):
        check_base_format("nf5")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(128, 512), (256, 64 * 256)])
def test_nf4_equals_torchao(shape, dtype) -> None:
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    w = _weight(shape, dtype)
    ref = nf4_tensor.to_nf4(w, 64, 256)
    fw = FrozenWeight.quantize(w, "nf4")
    assert torch.equal(fw.packed["codes"], ref.quantized_data)
    assert torch.equal(fw.packed["scales"], ref.quantized_scalers)
    assert torch.equal(fw.packed["factors"], ref.quantization_factor)
    assert torch.equal(fw.packed["mean"], ref.scaler_mean)
    assert torch.equal(fw.packed["table"], ref.nf4)
    assert torch.equal(fw.dequantize(), ref.get_original_weight())


def test_nf4_unaligned_shape() -> None:
    """Element counts off the 64 / 256 grid pad (zeros, after the scale mean): the same as torchao's on
    the grid-aligned part, and within NF4 rounding everywhere."""
    w = _weight((33, 40), torch.float32)
    fw = FrozenWeight.quantize(w, "nf4")
    out = fw.dequantize()
    assert out.shape == w.shape and out.dtype == w.dtype
    err = (out - w).abs().max()
    assert err <= 0.2 * w.abs().max()  # the widest NF4 gap is 0.28 of a block's absmax


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_channel_formats_round_trip(fmt, dtype) -> None:
    w = _weight(dtype=dtype)
    w[3] = 0  # a zero row keeps scale 1
    fw = FrozenWeight.quantize(w, fmt)
    out = fw.dequantize()
    assert out.dtype == dtype and out.shape == w.shape
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    amax = w.double().abs().amax(dim=1, keepdim=True)
    err = (out.double() - w.double()).abs()
    if fmt == "int8":  # round to nearest: half a step of amax / 127 (plus the output dtype's rounding)
        bound = amax / 127 / 2 + w.double().abs() * _eps(dtype)
    else:  # e4m3 keeps 3 mantissa bits: relative error 2^-4, subnormals below 2^-6 of the scale step
        bound = w.double().abs() * 2.0**-4 + amax / 448 * 2.0**-9 + w.double().abs() * _eps(dtype)
    assert (err <= bound * 1.0001).all()
    assert fw.packed["scale"].dtype == torch.float32
    assert fw.packed["data"].dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@pytest.mark.parametrize("fmt", PACKED)
def test_frozen_weight_as_parameter(fmt) -> None:
    lin = nn.Linear(512, 128, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    w = lin.weight.detach().clone()
    saved = quantize_frozen(lin, fmt)
    p = lin.weight
    assert isinstance(p, nn.Parameter) and isinstance(p, FrozenWeight) and not p.requires_grad
    assert p.shape == (128, 512) and p.dtype == torch.bfloat16 and p.device.type == "cpu"
    assert dict(lin.named_parameters()).keys() == {"weight"}
    assert isinstance(p.data, FrozenWeight) and p.data.packed is p.packed  # .data, detach: aliases
    assert p.detach().packed is p.packed
    assert saved == w.numel() * 2 - host_nbytes(p) and host_nbytes(p) == p.host_nbytes()
    assert host_nbytes(w) == w.numel() * 2
    assert host_nbytes(p) < w.numel() * (2 if fmt != "nf4" else 0.6)
    clone = copy.deepcopy(lin).weight
    assert clone.packed is not p.packed and torch.equal(clone.dequantize(), p.dequantize())
    with pytest.raises(NotImplementedError, match=r"\.dequantize\(\)"):
        lin(torch.randn(2, 512, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match=r"\.dequantize\(\)"):
        p.copy_(w)
    other, parts = FrozenWeight.quantize(_weight((128, 512), seed=3), fmt), dict(p.packed)
    with torch.no_grad():
        p.copy_(other)  # in place, packed into packed (load_state_dict of a packed state)
    assert torch.equal(p.dequantize(), other.dequantize()) and all(p.packed[k] is v for k, v in parts.items())


def test_quantize_frozen_skips() -> None:
    model = with_lora(models_tiny(torch.float32), ["q_proj", "down_proj"], seed=1)
    before = {n: p for n, p in model.named_parameters()}
    quantize_frozen(model, "int8")
    packed = frozen_weights(model)
    assert packed and all(n.endswith(".weight") and "lora_" not in n for n in packed)
    assert any("q_proj.base_layer" in n for n in packed)  # PEFT's base layer
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in packed)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p is before[n]  # adapters untouched
    assert quantize_frozen(model, "bf16") == 0


def test_no_frozen_linear_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # trainable: nothing to pack
    with pytest.raises(ValueError, match="base_format='nf4'.*requires_grad=False"):
        roundpipe.RoundPipe(model, base_format="nf4")
    with pytest.raises(ValueError, match="base_format"):
        roundpipe.wrap_model_to_roundpipe(model, base_format="q4")


@pytest.mark.parametrize("fmt", PACKED)
def test_random_is_packed_directly(fmt) -> None:
    g = torch.Generator().manual_seed(0)
    fw = FrozenWeight.random((256, 1024), fmt, generator=g)
    w = fw.dequantize()
    assert w.shape == (256, 1024) and w.dtype == torch.bfloat16
    assert abs(float(w.float().std()) - 0.02) < 0.002 and torch.isfinite(w.float()).all()
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(FrozenWeight.random((256, 1024), fmt, generator=g2).dequantize(), w)


def models_tiny(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3")).to(dtype)


def _dequantized_reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose FrozenWeights are plain tensors of their dequantized values."""
    packed = frozen_weights(model)
    weights = {n: p.dequantize() for n, p in packed.items()}
    for n in packed:
        mod_name, _, attr = n.rpartition(".")
        model.get_submodule(mod_name)._parameters[attr] = None
    ref = copy.deepcopy(model)
    for n, w in weights.items():
        mod_name, _, attr = n.rpartition(".")
        ref.get_submodule(mod_name)._parameters[attr] = nn.Parameter(w, requires_grad=False)
        model.get_submodule(mod_name)._parameters[attr] = packed[n]
    return ref


def _grads(model: nn.Module):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "workers,fmt,microbatches",
    [("cpu:1", "nf4", 2), ("cpu:2", "int8", 3), ("cpu:3", "fp8", 1), ("cpu:2", "nf4", 3)],
    indirect=["workers"],
)
def test_lora_grads_over_packed_base(workers, fmt, microbatches) -> None:
    """float64 LoRA gradients through RoundPipe over a packed base equal PEFT's over the dequantized one."""
    model = with_lora(models_tiny(torch.float64), ["q_proj", "v_proj", "down_proj", "gate_proj"], seed=1)
    quantize_frozen(model, fmt)
    ref = _dequantized_reference(model)
    batch = make_batch(padding=True)
    # Hugging Face's own loss casts the logits to float32; the reference takes its cross entropy in float64.
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref_loss = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    ref_loss.backward()
    ref_grads = _grads(ref)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches), base_format=fmt)
    loss = rp.train_step(**batch)
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and all("lora_" in n for n in got)
    assert loss.dtype == torch.float64 and abs(float(loss) - float(ref_loss)) < 1e-10
    for n in ref_grads:
        assert (got[n] - ref_grads[n]).abs().max() <= 1e-10 * ref_grads[n].abs().max(), n


def _frozen_mlp(seed: int, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Blocks of a frozen 64 x 64 Linear (the base), tanh, and a trainable one: ``RoundPipe``'s own layers."""
    torch.manual_seed(seed)
    blocks = []
    for _ in range(3):
        base = nn.Linear(64, 64, bias=False).requires_grad_(False)
        blocks.append(nn.Sequential(base, nn.Tanh(), nn.Linear(64, 64)))
    return nn.Sequential(*blocks).to(dtype)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_roundpipe_sequential_over_packed_base(workers) -> None:
    model = _frozen_mlp(0)
    quantize_frozen(model, "nf4")
    ref = _dequantized_reference(model)
    x, y = torch.randn(6, 64, dtype=torch.float64), torch.randn(6, 64, dtype=torch.float64)
    nn.functional.mse_loss(ref(x), y).backward()
    ref_grads = _grads(ref)
    rp = roundpipe.RoundPipe(model, base_format="nf4", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert rp.layer_size[0] * 2**30 == sum(host_nbytes(p) for p in model[0].parameters())
    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) * 0.5)
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and len(got) == 6
    for n in ref_grads:  # mean over two microbatches of 3 rows, each halved: the full batch's mean
        assert (got[n] - ref_grads[n]).abs().max() <= 1e-10 * ref_grads[n].abs().max(), n


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_save_load_packed_base(workers, fmt, tmp_path) -> None:
    """``roundpipe.save`` keeps the packed base as it is held; ``load`` restores it (and the run) exactly,
    into a model whose base was packed from other weights; another format is refused."""

    def build(seed: int, base_format: str = fmt):
        model = roundpipe.RoundPipe(
            _frozen_mlp(seed, torch.float32),
            optim_dtype=torch.float32,
            base_format=base_format,
            model_run_config=RoundPipeRunConfig(num_microbatch=2),
        )
        return model, roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(4)]

    def train(model, opt, part):
        out = []
        for x, y in part:
            out.append(model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss))
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        return torch.stack(out)

    model, opt = build(0)
    train(model, opt, data[:2])
    roundpipe.save(model, opt, str(tmp_path / "ck"))
    after = train(model, opt, data[2:])
    model2, opt2 = build(5)
    roundpipe.load(model2, opt2, str(tmp_path / "ck"))
    for (n, p), (_, q) in zip(frozen_weights(model.model).items(), frozen_weights(model2.model).items()):
        assert all(torch.equal(p.packed[k], q.packed[k]) for k in p.packed), n
    assert torch.equal(train(model2, opt2, data[2:]), after)
    other, other_opt = build(0, "fp8" if fmt == "int8" else "int8")
    with pytest.raises(roundpipe.checkpoint.CheckpointError, match="base_format"):
        roundpipe.load(other, other_opt, str(tmp_path / "ck"))


@pytest.mark.parametrize("workers", ["cpu:1", "cpu:2"], indirect=True)
@pytest.mark.parametrize("fmt", ["fp8", "nf4"])
def test_graphed_jobs_dequantize_into_slots(workers, fmt) -> None:
    """Graphed jobs (the CPU stand-in, ``RPP_DEBUG_GRAPHS``) dequantize the packed base into the layers'
    slots: several training steps equal plain PyTorch over the dequantized weights, and the jobs replay."""
    from roundpipe import ModelExecutePlan, settings
    from roundpipe.devices import device as device_mod

    model = _frozen_mlp(2)
    quantize_frozen(model, fmt)
    ref = _dequantized_reference(model)
    plan = ModelExecutePlan([range(0, 2), range(2, 3)], [range(0, 1), range(1, 3)])
    with settings.overridden(debug_graphs="1"):
        rp = roundpipe.RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
        opt = torch.optim.SGD(rp.optim_parameters(), lr=0.05)
        opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
        for seed in range(5):
            torch.manual_seed(seed)
            x, y = torch.randn(6, 64, dtype=torch.float64), torch.randn(6, 64, dtype=torch.float64)
            loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
            rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            ref_loss = sum(((ref(a) - b) ** 2).sum() for a, b in zip(x.tensor_split(2), y.tensor_split(2)))
            ref_loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            assert abs(loss.item() - ref_loss.item()) <= 1e-10 * abs(ref_loss.item())
        rp.synchronize()
    devs = device_mod.get_devices()
    assert sum(d.graphs.replays for d in devs) > 0 and sum(len(d.graphs.refused) for d in devs) == 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert (p - q).abs().max() <= 1e-10 * q.abs().max(), n


@pytest.mark.parametrize("fmt", PACKED)
def test_dequantize_in_chunks(fmt, monkeypatch) -> None:
    """A weight unpacked in several chunks (and into given storage, as a graph slot) equals one unpacked whole."""
    from roundpipe.host.formats import codecs

    fw = FrozenWeight.quantize(_weight((96, 640)), fmt)
    whole = fw.dequantize()
    monkeypatch.setattr(codecs, "DEQUANT_CHUNK", 64 * 7)
    assert torch.equal(fw.dequantize(), whole)
    slot = torch.empty(96, 640, dtype=torch.bfloat16)
    assert fw.dequantize_into(fw.packed, slot) is slot and torch.equal(slot, whole)
    wide = fw.dequantize(dtype=torch.float32)  # nf4 unpacks in the weight's dtype; fp8 / int8 in float32
    assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), whole)


# ---- the estimate's terms ----------------------------------------------------------------------------------
def test_frozen_terms_equal_the_packings() -> None:
    """``planning.frozen_terms`` repeats the packings without torch: its byte counts are ``host_nbytes`` of
    real packed weights (aligned and unaligned shapes), its format names and chunk the host layer's."""
    from roundpipe.host.formats import codecs
    from roundpipe.planning import frozen_terms

    assert frozen_terms.DEQUANT_CHUNK == codecs.DEQUANT_CHUNK
    for rows, cols in [(128, 512), (33, 40), (96, 64 * 300)]:
        for fmt in BASE_FORMATS:
            w = _weight((rows, cols))
            got = host_nbytes(w) if fmt == "bf16" else host_nbytes(FrozenWeight.quantize(w, fmt))
            assert frozen_terms.packed_weight_bytes(rows, cols, fmt) == got, (rows, cols, fmt)
    fw = FrozenWeight.random((4096, 1024), "nf4")
    from roundpipe.host.formats import dequantize_transient_bytes

    expect = frozen_terms.packed_weight_bytes(4096, 1024, "nf4") + 4096 * 1024 * 6
    assert dequantize_transient_bytes(fw) == expect and dequantize_transient_bytes(torch.zeros(3)) == 0
    for fmt in BASE_FORMATS:  # the per-channel formats unpack in place: their packed bytes alone
        if fmt != "bf16":
            fw = FrozenWeight.random((4096, 1024), fmt)
            assert fw.format.unpacks_in_chunks == (fmt in frozen_terms.CHUNKED_FORMATS)
            chunk = frozen_terms.chunk_bytes(4096 * 1024, fmt)
            assert dequantize_transient_bytes(fw) == frozen_terms.packed_weight_bytes(4096, 1024, fmt) + chunk


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_per_channel_unpack_in_place_rounds_as_the_float32_product(fmt: str) -> None:
    """fp8 / int8 unpack in place (the codes cast into the weight, then scaled): bitwise what the product in
    float32 (float64 for float64) rounded once gives, for each weight dtype, into a new tensor and into a
    graph slot's storage, for 2-D weights and experts' 3-D ones packed as rows."""
    from roundpipe.host.formats.frozen import get_format

    torch.manual_seed(0)
    w = torch.randn(300, 257) * torch.logspace(-5, 3, 300)[:, None]
    w[7] = 0  # a zero row keeps scale 1
    form = get_format(fmt)
    packed = form.quantize(w)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        want = (packed["data"].to(cdt) * packed["scale"][:, None].to(cdt)).to(dtype)
        slot = torch.empty(w.shape, dtype=dtype)
        assert torch.equal(form.dequantize(packed, w.shape, dtype), want), dtype
        assert form.dequantize(packed, w.shape, dtype, out=slot) is slot and torch.equal(slot, want), dtype
    experts = form.quantize(torch.randn(4 * 32, 64))
    want = (experts["data"].float() * experts["scale"][:, None]).to(torch.bfloat16).view(4, 32, 64)
    assert torch.equal(form.dequantize(experts, (4, 32, 64), torch.bfloat16), want)


def test_estimate_of_a_packed_base() -> None:
    """A 70B Llama shape (Llama-3.1-70B's dimensions), LoRA r16: the NF4 base cuts the host weights by the
    projections' savings, uploads the packed bytes, and adds one weight's unpacking transient on the GPU."""
    from roundpipe.planning import frozen_terms
    from roundpipe.planning.estimate import ModelShape, estimate

    shape = ModelShape(8192, 28672, 80, 64, 8, 128, 128256)
    kw = dict(seq_len=4096, batch_size=8, lora_rank=16, microbatches=8, gpu_bytes=24 * 2**30)
    plain, nf4 = estimate(shape, **kw), estimate(shape, base_format="nf4", **kw)
    base = frozen_terms.frozen_base(shape, "nf4")
    assert plain.host_parts["weights"] - nf4.host_parts["weights"] == 80 * base.saved_per_layer
    assert base.layer_bf16_bytes / base.layer_host_bytes > 3.8  # 4 bits + scales: 3.88x smaller
    assert nf4.peak_host_bytes < 100 * 2**30 < plain.peak_host_bytes
    assert nf4.gpu_parts["unpacking"] == base.gpu_transient_bytes > 0
    assert nf4.upload_bytes_per_layer == plain.upload_bytes_per_layer - base.saved_per_layer
    assert 5 < nf4.dequantize_ms_per_layer < 7 and plain.dequantize_ms_per_layer == 0  # 0.86B at 140e9/s
    assert "frozen base in nf4" in nf4.describe() and "frozen base" not in plain.describe()
    with pytest.raises(ValueError, match="lora_rank"):
        estimate(shape, 4096, base_format="nf4")
    with pytest.raises(ValueError, match="base_format='q3'"):
        estimate(shape, 4096, lora_rank=16, base_format="q3")


def test_plan_cli_base_format(tmp_path, capsys) -> None:
    import json

    from roundpipe.cli import plan

    d = tmp_path / "llama70"
    d.mkdir()
    config = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
    config.update(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, model_type="llama")
    (d / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(d), "--seq-len", "4096", "--batch-size", "8", "--microbatches", "8", "--lora-r", "16"]
    argv += ["--gpu-memory", "24GiB", "--host-memory", "100GiB"]
    assert plan.main(argv + ["--json"]) == 1  # bf16: the host is short
    assert json.loads(capsys.readouterr().out)["short"]["host"] > 0
    assert plan.main(argv + ["--base-format", "nf4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["base_format"] == "nf4" and result["peak_host_bytes"] < 100 * 2**30
    assert result["peak_gpu_bytes"] <= 24 * 2**30 and result["dequantize_ms_per_layer"] > 0
    assert plan.main(argv + ["--base-format", "nf4"]) == 0
    assert "frozen base in nf4" in capsys.readouterr().out
    assert plan.main(argv[:-6] + argv[-4:] + ["--base-format", "int8"]) == 2  # no --lora-r
    assert "--base-format int8 packs the frozen base of a LoRA run" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_wrap_by_size_over_packed_base(workers) -> None:
    """``wrap_model_to_roundpipe(base_format=...)`` without a preset: packed once before the split (whose
    sizes count the packed bytes), and the gradients still PEFT's over the dequantized base."""
    model = with_lora(models_tiny(torch.float64), ["q_proj", "up_proj"], seed=1)
    ref = copy.deepcopy(model)
    modules = dict(model.named_modules())  # the wrapper keeps these objects (under other names)
    layer_bytes = sum(p.numel() * 8 for p in model.base_model.model.model.layers[0].parameters())
    rp = roundpipe.wrap_model_to_roundpipe(
        model,
        use_sequential_preset=False,
        lower_threshold=layer_bytes // 4,
        upper_threshold=layer_bytes // 2,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        base_format="int8",
    )
    packed = {n: m.weight for n, m in modules.items() if isinstance(getattr(m, "weight", None), FrozenWeight)}
    assert packed and isinstance(rp, roundpipe.AutoRoundPipe)
    # Packed, a decoder layer's host bytes fall under the threshold its float64 bytes exceed: one RoundPipe each.
    subs = [m for m in rp.model.modules() if isinstance(m, roundpipe.RoundPipe)]
    assert sum(type(m.model).__name__ == "Qwen3DecoderLayer" for m in subs) == 3
    for n, p in packed.items():
        ref.get_submodule(n).weight.data = p.dequantize()
    batch = make_batch(padding=True)
    kw = {k: v for k, v in batch.items() if k != "labels"}
    logits = ref(**kw).logits
    logits.square().mean().backward()
    ref_grads = _grads(ref)
    rp(**kw).logits.square().mean().backward()
    assert ref_grads and all("lora_" in n for n in ref_grads)
    for n, g in ref_grads.items():
        mod, _, attr = n.rpartition(".")
        got = getattr(modules[mod], attr).grad
        assert (got - g).abs().max() <= 1e-10 * g.abs().max(), n


def _bnb_4bit_model(path: Any, double_quant: bool) -> nn.Module:
    """The tiny Qwen3 (float32) loaded from ``path`` by Hugging Face with ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4")`` (its decoder projections become bitsandbytes ``Linear4bit``), with PEFT LoRA
    adapters over them (PEFT's bitsandbytes LoRA layers)."""
    import transformers

    models_tiny(torch.float32).save_pretrained(path)
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    return with_lora(model.train(), ["q_proj", "o_proj", "up_proj"], seed=1)


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("double_quant", [False, True])
def test_bitsandbytes_4bit_base_trains(workers, double_quant, tmp_path, monkeypatch) -> None:
    """A PEFT model over a bitsandbytes 4-bit base wraps with its packing kept (the Params4bit bytes and
    quantization state as they are) and its LoRA gradients equal PEFT's over bitsandbytes' own layers."""
    pytest.importorskip("bitsandbytes")
    model = _bnb_4bit_model(tmp_path, double_quant)
    import bitsandbytes

    data = {n: m.weight.data.clone() for n, m in model.named_modules() if type(m) is bitsandbytes.nn.Linear4bit}
    assert len(data) == 3 * 7
    batch = make_batch(padding=True)
    out = model(**{k: v for k, v in batch.items() if v is not None})
    out.loss.backward()
    ref_loss, ref_grads = out.loss.detach(), _grads(model)
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    packed = frozen_weights(model)
    assert len(packed) == 21 and all(p.format.name == "bnb-nf4" for p in packed.values())
    for n, d in data.items():  # the packed bytes kept as they are
        assert torch.equal(model.get_submodule(n).weight.packed["data"], d)
        assert ("absmax2" in model.get_submodule(n).weight.packed) == double_quant
    loss = rp.train_step(**batch)
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and all("lora_" in n for n in got)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for n in ref_grads:
        assert float((got[n] - ref_grads[n]).norm() / ref_grads[n].norm()) < 1e-5, n

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(bitsandbytes.functional, "dequantize_4bit", broken)
    with pytest.raises(RuntimeError, match=r"^bitsandbytes cannot unpack .* pass base_format='nf4' instead$"):
        next(iter(packed.values())).dequantize()


def test_flatten_round_trip() -> None:
    """The tensor-subclass protocol (``__tensor_flatten__`` / ``__tensor_unflatten__``) names each packed part
    apart from Tensor attributes (NF4's ``mean``, fp8's ``data``)."""
    for fmt in PACKED:
        fw = FrozenWeight.quantize(_weight(), fmt)
        names, meta = fw.__tensor_flatten__()
        inner = {n: getattr(fw, n) for n in names}
        assert all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in inner.values())
        back = FrozenWeight.__tensor_unflatten__(inner, meta, fw.shape, fw.stride())
        assert torch.equal(back.dequantize(), fw.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_nf4_codes_on_and_near_the_midpoints(dtype) -> None:
    """Values on, and one step either side of, every midpoint between NF4 levels (where the nearest level is a
    tie or a rounding away): the codes still equal torchao's."""
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from roundpipe.host.formats.nf4 import nf4_table

    table = nf4_table(dtype)
    mids = ((table[1:] + table[:-1]) / 2).to(dtype)
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    values = torch.cat([near, -near, table])
    values = torch.cat([values, torch.zeros(-values.numel() % 63, dtype=dtype)]).view(-1, 63)
    blocks = torch.cat([values, torch.ones(values.shape[0], 1, dtype=dtype)], dim=1)  # absmax 1: scaled as given
    w = blocks.repeat(256 // blocks.shape[0] + 1, 1)[:256]  # [256 blocks, 64]
    w = (w * 2.0 ** torch.arange(-4, 4, dtype=dtype).repeat(32)[:, None]).reshape(64, 256)  # exact block scales
    ref = nf4_tensor.to_nf4(w, 64, 256)
    fw = FrozenWeight.quantize(w, "nf4")
    assert torch.equal(fw.packed["codes"], ref.quantized_data)
    assert torch.equal(fw.dequantize(), ref.get_original_weight())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_codes_of_every_16bit_value(dtype) -> None:
    """Every finite 16-bit value in [-1, 1] (what a block's scaled values are) gets torchao's code."""
    nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from roundpipe.host.formats.nf4 import nearest_codes, nf4_table

    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values) & (values.abs() <= 1)]
    values = values[: values.numel() // 2 * 2]
    ref = nf4_tensor.NF4Tensor.quantize_tensor_nearest(values, nf4_table(dtype)).to(torch.uint8)
    assert torch.equal(nearest_codes(values, nf4_table(dtype)), ref[::2] << 4 | ref[1::2])
