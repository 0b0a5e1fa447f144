"""MXFP4: the codec against a reference written here from the OCP Microscaling spec, its dequantize equal to
transformers' of GPT-OSS's blocks and scales, 3-D expert weights, and LoRA gradients through RoundPipe on a tiny
GPT-OSS whose experts are MXFP4 equal to PEFT's over the dequantized experts."""

from __future__ import annotations

import math
import os

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import pytest
import torch

from roundpipe.host.formats import FrozenWeight, adopt_mxfp4, host_nbytes
from roundpipe.host.formats.mxfp4 import E2M1_VALUES, e2m1_codes, packed_nbytes

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _ref_code(x: float) -> int:
    """The spec's E2M1 conversion of one value: the nearest magnitude (saturating at 6), a tie to the even
    code (mantissa bit 0), the sign in bit 3."""
    a = min(abs(x), 6.0)  # E2M1 has no infinity: beyond 6 saturates
    d = [abs(a - m) for m in MAGNITUDES]
    best = min(d)
    near = [i for i, v in enumerate(d) if v == best]
    code = next((i for i in near if i % 2 == 0), near[0])
    return code | (8 if x < 0 or (x == 0 and math.copysign(1.0, x) < 0) else 0)


def _ref_quantize(w: torch.Tensor):
    """Reference packing of a 2-D ``w`` [rows, cols] (cols a multiple of 32), one block at a time: the E8M0 code
    ``floor(log2(amax)) - 2 + 127`` (0 for a zero block), the elements divided by ``2 ** (code - 127)`` and converted,
    two a byte, the first in the low nibble."""
    rows, cols = w.shape
    blocks = torch.zeros(rows, cols // 32, 16, dtype=torch.uint8)
    scales = torch.zeros(rows, cols // 32, dtype=torch.uint8)
    for r in range(rows):
        for g in range(cols // 32):
            vals = [float(v) for v in w[r, g * 32 : (g + 1) * 32]]
            amax = max(abs(v) for v in vals)
            code = 0 if amax == 0 else min(254, max(0, math.frexp(amax)[1] - 1 - 2 + 127))
            scale = 2.0 ** (code - 127)
            codes = [_ref_code(v / scale) for v in vals]
            scales[r, g] = code
            for k in range(16):
                blocks[r, g, k] = codes[2 * k] | codes[2 * k + 1] << 4
    return blocks, scales


def _ref_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float64 from the reference's bytes: each code's value times its block's power of two."""
    rows, groups, _ = blocks.shape
    out = torch.empty(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            s = 2.0 ** (int(scales[r, g]) - 127)
            for k in range(16):
                b = int(blocks[r, g, k])
                out[r, g * 32 + 2 * k] = E2M1_VALUES[b & 15] * s
                out[r, g * 32 + 2 * k + 1] = E2M1_VALUES[b >> 4] * s
    return out


def _weight(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.05).to(dtype)


def test_e2m1_codes_on_and_near_the_midpoints() -> None:
    """Every magnitude, every midpoint (a tie: the even code) and one step either side, past 6, and signs."""
    mags = torch.tensor(MAGNITUDES, dtype=torch.float64)
    mids = (mags[1:] + mags[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), mags])
    values = torch.cat([near, torch.tensor([6.5, 7.99, 8.0, 1e30]), torch.tensor([1e-30, 0.0])])
    values = torch.cat([values, -values])
    got = e2m1_codes(values)
    assert got.tolist() == [_ref_code(float(v)) for v in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_equals_the_reference(dtype) -> None:
    """Packed bytes and dequantized values equal the reference's, with a zero block, a block of one tiny value
    and blocks whose largest value sits exactly on a power of two."""
    w = _weight((6, 96), dtype)
    w[1, :32] = 0
    w[2, 32:64] = 0
    w[2, 40] = 1e-20
    w[3, 64:] = w[3, 64:] / w[3, 64:].abs().max() * 0.25  # amax exactly 2^-2
    fw = FrozenWeight.quantize(w, "mxfp4")
    blocks, scales = _ref_quantize(w.double())
    assert torch.equal(fw.packed["blocks"], blocks) and torch.equal(fw.packed["scales"], scales)
    out = fw.dequantize()
    assert out.dtype == dtype and out.shape == w.shape
    assert torch.equal(out, _ref_dequantize(blocks, scales).to(dtype))
    # the error: half a step (the step in [4, 6] x scale is 2 x scale, scale = 2 ** floor(log2(amax)) / 4) but for the
    # values in (6, 8) x scale, which saturate at 6 x scale: 2 x scale at most
    amax = w.double().abs().view(6, 3, 32).amax(dim=-1, keepdim=True)
    bound = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30)))) / 2
    assert ((out.double() - w.double()).abs().view(6, 3, 32) <= bound * 1.0001).all()


def test_unaligned_columns_pad() -> None:
    """Inputs not a multiple of 32 pad with zeros: the same bytes as the padded weight, the padding dropped."""
    w = _weight((5, 40))
    fw = FrozenWeight.quantize(w, "mxfp4")
    padded = torch.nn.functional.pad(w, (0, 24))
    ref = FrozenWeight.quantize(padded, "mxfp4")
    assert torch.equal(fw.packed["blocks"], ref.packed["blocks"])
    assert torch.equal(fw.dequantize(), ref.dequantize()[:, :40])


def _transformers_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_adopted_checkpoint_bytes_equal_transformers(dtype) -> None:
    """A GPT-OSS checkpoint's ``*_blocks`` / ``*_scales`` (every byte value, every finite scale code) adopted as
    they are dequantize to transformers' ``convert_moe_packed_tensors``: shape [experts, in, out], bit for bit."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 24, 4), generator=g, dtype=torch.uint8)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)  # codes 0 (2^-127) to 254
    fw = adopt_mxfp4(blocks, scales, dtype)
    ref = _transformers_dequantize(blocks, scales, dtype)
    assert fw.shape == ref.shape == (3, 128, 24) and fw.dtype == dtype
    got = fw.dequantize()
    same = (got == ref) | (got.isnan() & ref.isnan())
    assert same.all()
    with pytest.raises(ValueError, match="blocks"):
        adopt_mxfp4(blocks[..., :8], scales)


def test_requantizing_dequantized_mxfp4_is_exact() -> None:
    """A model transformers loaded with its MXFP4 experts dequantized, packed again under mxfp4, holds the same
    values: every E2M1 value times a power of two is one again under the spec's scale rule (a block whose largest
    value is under 4 gets a smaller scale, and its values double into the set)."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 16, 3, 16), generator=g, dtype=torch.uint8)
    blocks[0, :4, 0] &= 0x33  # blocks whose values stay within 1.5
    scales = torch.randint(110, 140, (2, 16, 3), generator=g, dtype=torch.uint8)
    plain = _transformers_dequantize(blocks, scales, torch.bfloat16)
    again = FrozenWeight.quantize(plain, "mxfp4", transposed=True)
    assert torch.equal(again.dequantize(), plain)


def test_quantized_experts_round_trip_through_transformers() -> None:
    """A transposed 3-D weight [experts, in, out] (GPT-OSS's ``gate_up_proj``) quantized here packs in the
    checkpoint's layout: transformers' dequantize of its bytes is ours, and ours equals the 2-D packing of each
    expert's transpose."""
    w = _weight((3, 64, 48))
    fw = FrozenWeight.quantize(w, "mxfp4", transposed=True)
    assert fw.packed["blocks"].shape == (3, 48, 2, 16) and fw.packed["scales"].shape == (3, 48, 2)
    got = fw.dequantize()
    assert torch.equal(got, _transformers_dequantize(fw.packed["blocks"], fw.packed["scales"], torch.float32))
    for e in range(3):
        assert torch.equal(got[e], FrozenWeight.quantize(w[e].T.contiguous(), "mxfp4").dequantize().T)


def test_dequantize_in_chunks_and_into_a_slot(monkeypatch) -> None:
    from roundpipe.host.formats import codecs

    fw = FrozenWeight.quantize(_weight((4, 64, 96), torch.bfloat16), "mxfp4", transposed=True)
    whole = fw.dequantize()
    monkeypatch.setattr(codecs, "DEQUANT_CHUNK", 64 * 5)  # 5 rows of an expert at a time
    assert torch.equal(fw.dequantize(), whole)
    monkeypatch.setattr(codecs, "DEQUANT_CHUNK", 64 * 96 * 3)  # 3 experts at a time, then the last one
    assert torch.equal(fw.dequantize(), whole)
    slot = torch.empty(4, 64, 96, dtype=torch.bfloat16)
    assert fw.dequantize_into(fw.packed, slot) is slot and torch.equal(slot, whole)


@pytest.mark.parametrize("shape,transposed", [((256, 1024), False), ((8, 128, 256), True)])
def test_random_is_packed_directly(shape, transposed) -> None:
    g = torch.Generator().manual_seed(0)
    fw = FrozenWeight.random(shape, "mxfp4", generator=g, transposed=transposed)
    w = fw.dequantize()
    assert w.shape == shape and w.dtype == torch.bfloat16
    assert abs(float(w.float().std()) - 0.02) < 0.002 and torch.isfinite(w.float()).all()
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(FrozenWeight.random(shape, "mxfp4", generator=g2, transposed=transposed).dequantize(), w)


def test_host_bytes_are_a_quarter_of_bf16() -> None:
    """4.25 bits per value (17 bytes per block of 32) and a 64-byte table: 3.76x smaller than bf16 (GPT-OSS's
    reduction dimension, 2880; fewer experts and outputs here)."""
    fw = FrozenWeight.random((2, 2880, 576), "mxfp4", transposed=True)
    assert host_nbytes(fw) == packed_nbytes(576, 2880, 2) == 2 * 576 * 90 * 17 + 64
    assert 3.76 < fw.numel() * 2 / host_nbytes(fw) < 3.77


@pytest.mark.gpu
def test_gpu_dequantize_equals_the_host() -> None:
    """Unpacked on the GPU (bf16, float32), an MXFP4 weight equals the host's unpacking; packed on the GPU, the
    bytes equal the host's."""
    w = _weight((4, 2880, 512))
    fw = FrozenWeight.quantize(w, "mxfp4", transposed=True)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(fw.dequantize(device="cuda", dtype=dtype).cpu(), fw.dequantize(dtype=dtype))
    on_gpu = FrozenWeight.quantize(w.cuda(), "mxfp4", transposed=True)
    assert all(torch.equal(on_gpu.packed[k], fw.packed[k]) for k in fw.packed)


# ---- 3-D weights of the other formats, and a GPT-OSS model ---------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "int8", "nf4"])
def test_3d_weights_of_the_other_formats(fmt) -> None:
    """The other formats pack an expert weight [experts, a, b] as its rows flattened [experts * a, b]: the same
    values as the 2-D packing of that matrix, unpacked into a 3-D slot."""
    w = _weight((3, 32, 64), torch.bfloat16)
    fw = FrozenWeight.quantize(w, fmt)
    flat = FrozenWeight.quantize(w.reshape(96, 64), fmt)
    assert fw.shape == w.shape and torch.equal(fw.dequantize(), flat.dequantize().view(3, 32, 64))
    slot = torch.empty(3, 32, 64, dtype=torch.bfloat16)
    assert fw.dequantize_into(fw.packed, slot) is slot and torch.equal(slot, fw.dequantize())
    r = FrozenWeight.random((3, 32, 64), fmt, generator=torch.Generator().manual_seed(0)).dequantize()
    assert r.shape == (3, 32, 64) and abs(float(r.float().std()) - 0.02) < 0.003


def _gpt_oss(dtype: torch.dtype, seed: int = 0):
    import transformers

    from roundpipe.models.configs import tiny_config

    torch.manual_seed(seed)
    # eager experts: grouped_mm has no float64
    return transformers.AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), experts_implementation="eager").to(
        dtype
    )


def test_quantize_frozen_packs_the_experts_as_shipped() -> None:
    """``mxfp4`` on GPT-OSS packs what the release ships in MXFP4: each layer's ``gate_up_proj`` and
    ``down_proj`` (transposed layout); their biases, the router, attention, embeddings and head keep their tensors.
    ``targets`` packs the attention too; another format packs the Linears as before."""
    from helpers import with_lora

    from roundpipe.host.formats import default_targets, frozen_weights, quantize_frozen

    model = with_lora(_gpt_oss(torch.float32), ["q_proj", "v_proj"], seed=1)
    assert default_targets(model, "mxfp4") == ("experts",) and default_targets(model, "nf4") == ("linear",)
    experts = model.base_model.model.model.layers[0].mlp.experts
    dense = experts.gate_up_proj.detach().clone()
    saved = quantize_frozen(model, "mxfp4")
    packed = frozen_weights(model)
    assert sorted({n.rsplit(".", 1)[-1] for n in packed}) == ["down_proj", "gate_up_proj"] and len(packed) == 6
    assert all(p.format.transposed and p.format.name == "mxfp4" for p in packed.values())
    assert not isinstance(experts.gate_up_proj_bias, FrozenWeight)
    assert experts.gate_up_proj.shape == dense.shape == (4, 32, 128)
    assert saved == sum(p.numel() * 4 - host_nbytes(p) for p in packed.values())
    err = (experts.gate_up_proj.dequantize() - dense).abs().max()
    assert err <= dense.abs().max() / 2  # MXFP4's worst case: half the block's binade
    more = with_lora(_gpt_oss(torch.float32), ["q_proj"], seed=1)
    quantize_frozen(more, "mxfp4", targets=("linear", "experts"))
    assert any("k_proj" in n for n in frozen_weights(more)) and any(
        "q_proj.base_layer" in n for n in frozen_weights(more)
    )
    with pytest.raises(ValueError, match="targets='attention'"):
        quantize_frozen(more, "mxfp4", targets=("attention",))


@pytest.mark.parametrize(
    "workers,microbatches",
    [("cpu:2", 2), ("cpu:1", 3), pytest.param("cuda:0", 2, marks=pytest.mark.gpu)],
    indirect=["workers"],
)
def test_lora_grads_over_mxfp4_experts(workers, microbatches) -> None:
    """float64 LoRA gradients (on the attention projections) through RoundPipe on a tiny GPT-OSS whose experts
    are MXFP4 (``wrap_model(base_format="mxfp4")``) equal PEFT's over the dequantized experts, to 1e-10 (on a GPU
    too, against the reference on that GPU: the packed experts uploaded and unpacked there)."""
    from helpers import with_lora
    from test_formats import _dequantized_reference, _grads
    from test_models import make_batch

    from roundpipe import models
    from roundpipe.host.formats import frozen_weights, quantize_frozen
    from roundpipe.runtime.run_config import RoundPipeRunConfig

    model = with_lora(_gpt_oss(torch.float64), ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    quantize_frozen(model, "mxfp4")
    # The reference runs where the workers do: the rotary tables are float32 math, whose results differ between a
    # CPU and a GPU in the last bits (a 5e-9 relative difference in the loss), so like is compared with like.
    where = "cuda" if workers.startswith("cuda") else "cpu"
    ref = _dequantized_reference(model).to(where)
    batch = make_batch(padding=True)
    logits = ref(input_ids=batch["input_ids"].to(where), attention_mask=batch["attention_mask"].to(where)).logits
    ref_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1).to(where), ignore_index=-100
    )
    ref_loss.backward()
    ref_grads = {n: g.cpu() for n, g in _grads(ref).items()}
    rp = models.wrap_model(model, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches), base_format="mxfp4")
    assert len(frozen_weights(model)) == 6
    loss = rp.train_step(**batch)
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and all("lora_" in n for n in got) and len(got) == 3 * 4 * 2
    assert loss.dtype == torch.float64 and abs(float(loss) - ref_loss.item()) < 1e-10
    for n in ref_grads:
        assert (got[n] - ref_grads[n]).abs().max() <= 1e-10 * ref_grads[n].abs().max(), n


# ---- the loader: a random build, and a checkpoint as GPT-OSS ships it ----------------------------------------
def test_random_build_packs_the_experts_directly() -> None:
    """``build_random`` of a GPT-OSS config under mxfp4: the experts drawn packed (N(0, initializer_range), no
    bf16 copy), their biases zero and the router and sinks by the model's init, LoRA on attention as PEFT's."""
    from peft import LoraConfig

    from roundpipe.host.formats import frozen_weights
    from roundpipe.loading import build_random
    from roundpipe.models.configs import tiny_config

    config = tiny_config("gpt_oss")
    model = build_random(config, "mxfp4", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), torch.float32)
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    packed = frozen_weights(model)
    assert len(packed) == 6 and all(p.format.name == "mxfp4" and p.format.transposed for p in packed.values())
    layer = model.get_base_model().model.layers[0]
    w = layer.mlp.experts.gate_up_proj.dequantize()
    assert w.shape == (4, 32, 128) and 0.8 * 0.1 < float(w.std()) < 1.2 * 0.1
    assert not layer.mlp.experts.gate_up_proj_bias.any() and layer.mlp.router.weight.std() > 0
    assert layer.self_attn.sinks.std() > 0 and not isinstance(layer.self_attn.q_proj.base_layer.weight, FrozenWeight)


def _write_mxfp4_checkpoint(path) -> tuple:
    """A tiny GPT-OSS saved by transformers, its experts rewritten as the release stores them (``*_blocks``,
    ``*_scales``); returns the plain model and the blocks and scales by parameter name."""
    from safetensors.torch import load_file, save_file

    model = _gpt_oss(torch.float32)
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    stored = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        fw = FrozenWeight.quantize(tensors.pop(name), "mxfp4", transposed=True)
        tensors[name + "_blocks"], tensors[name + "_scales"] = fw.packed["blocks"], fw.packed["scales"]
        stored[name] = (fw.packed["blocks"], fw.packed["scales"])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return model, stored


def test_a_shipped_mxfp4_checkpoint_loads_as_its_bytes(tmp_path) -> None:
    """Under mxfp4 the loader keeps a GPT-OSS checkpoint's expert blocks and scales as they are (no
    re-quantization); under bf16 it dequantizes them as transformers does. RoundPipe's logits over the MXFP4 load
    equal the plain load's Hugging Face logits."""
    from peft import LoraConfig

    import roundpipe
    from roundpipe.host.formats import frozen_weights
    from roundpipe.loading import load_pretrained

    model, stored = _write_mxfp4_checkpoint(str(tmp_path))
    lora = LoraConfig(r=4, target_modules=["q_proj"])
    packed = load_pretrained(str(tmp_path), "mxfp4", lora, torch.float32)
    got = {n.replace("base_model.model.", ""): p for n, p in frozen_weights(packed).items()}
    assert got.keys() == stored.keys()
    for n, (blocks, scales) in stored.items():
        assert torch.equal(got[n].packed["blocks"], blocks) and torch.equal(got[n].packed["scales"], scales)
    plain = load_pretrained(str(tmp_path), "bf16", None, torch.float32)
    params = dict(plain.named_parameters())
    for n, (blocks, scales) in stored.items():
        assert torch.equal(params[n], _transformers_dequantize(blocks, scales, torch.float32))
    assert torch.equal(params["model.layers.1.self_attn.q_proj.weight"], model.model.layers[1].self_attn.q_proj.weight)
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = plain(input_ids=ids).logits
        out = roundpipe.wrap_model_to_roundpipe(packed, base_format="mxfp4")(input_ids=ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
