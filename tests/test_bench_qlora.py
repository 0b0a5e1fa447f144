"""The bench's resident QLoRA baseline (``bench/benchlib/qlora.py``) is the model a user gets from transformers'
bitsandbytes loader: built part by part from the meta device, its frozen linears are ``Linear4bit`` with the NF4
codes and double-quantized scales bitsandbytes computes for the same bf16 weights, and with PEFT's LoRA over it
the loss and the adapters' gradients equal those of ``from_pretrained(..., BitsAndBytesConfig(...))``.
bitsandbytes' CPU backend quantizes and runs ``Linear4bit`` forward and backward, so this runs in CI."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, Tuple

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes", reason="the QLoRA baseline needs bitsandbytes")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _bench() -> Tuple[Any, Any]:
    """``train_bench`` and ``benchlib.qlora``, imported from ``bench/`` as the script imports them."""
    sys.path.insert(0, BENCH)
    try:
        import train_bench
        from benchlib import qlora
    finally:
        sys.path.pop(0)
    return train_bench, qlora


def _hf_and_ours(tmp_path: Any, device: str) -> Tuple[nn.Module, nn.Module, Dict[str, torch.Tensor]]:
    """The tiny workload in bf16 (random weights) loaded by transformers with NF4 double quantization, the same
    weights through the bench's builder, and those bf16 weights by name."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    train_bench, qlora = _bench()
    plain = train_bench.build_model("tiny", "cpu").to(torch.bfloat16)
    weights = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.save_pretrained(tmp_path)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map=device)

    def init(prefix: str, part: nn.Module) -> None:
        part.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})

    ours = qlora.build_qlora(train_bench.build_model("tiny", "meta"), init, device)
    return hf, ours, weights


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_base_is_what_transformers_bitsandbytes_loads(tmp_path: Any, device: str) -> None:
    """Every decoder linear is a ``Linear4bit`` whose packed codes, absmax, its double quantization and offset
    equal ``bnb.functional.quantize_4bit`` of the bf16 weight and transformers' load; embedding, norms and the
    (tied) head stay bf16 and equal; the rotary tables equal."""
    _, qlora = _bench()
    hf, ours, weights = _hf_and_ours(tmp_path, device)
    assert ours.is_loaded_in_4bit and ours.lm_head.weight is ours.model.embed_tokens.weight
    theirs = dict(hf.named_modules())
    linears = 0
    for name, mod in ours.named_modules():
        assert type(mod) is type(theirs[name]), name
        if isinstance(mod, bnb.nn.Linear4bit):
            linears += 1
            ref, state = bnb.functional.quantize_4bit(
                weights[f"{name}.weight"].to(device), blocksize=64, compress_statistics=True, quant_type="nf4"
            )
            got = mod.weight.quant_state
            assert mod.weight.data.device.type == device and mod.compute_dtype == torch.bfloat16
            for q in (state, theirs[name].weight.quant_state):
                assert torch.equal(mod.weight.data, ref) and got.quant_type == q.quant_type == "nf4"
                assert got.nested and got.blocksize == q.blocksize == 64 and got.shape == q.shape
                assert torch.equal(got.absmax, q.absmax) and torch.equal(got.offset, q.offset)
                assert torch.equal(got.state2.absmax, q.state2.absmax) and torch.equal(got.code, q.code)
    assert linears == 7 * ours.config.num_hidden_layers
    expected = 0  # NF4 with double quantization: 4 bits, a uint8 absmax per 64, an fp32 one per 256 of those
    for (name, p), (_, q) in zip(ours.named_parameters(), hf.named_parameters(), strict=True):
        if not isinstance(p, bnb.nn.Params4bit):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
            expected += 2 * p.numel()
        else:
            n = math.prod(p.quant_state.shape)
            expected += n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + 4 * (16 + 256)  # + the two code tables
    assert qlora.held_bytes(ours) == expected
    # The tables may be computed on the host or the GPU (a last-bit difference in pow): fp32's tolerance.
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("device", DEVICES)
def test_qlora_lora_trains_only_adapters_equal_to_transformers_load(tmp_path: Any, device: str) -> None:
    """PEFT's LoRA on the bench's targets over the built base (with the bench's checkpointing) and over
    transformers' load (without): PEFT's ``lora.Linear4bit`` on every projection, only the adapters train, and
    the loss and every adapter gradient are bit for bit equal on CPU (the same bf16 dequantize-and-matmul), within
    bf16 rounding on a GPU."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    train_bench, _ = _bench()
    hf, ours, _ = _hf_and_ours(tmp_path, device)
    ours.gradient_checkpointing_enable()
    models = []
    for model in (hf, ours):
        torch.manual_seed(0)
        models.append(train_bench.add_lora(model, 4))
    models[1].enable_input_require_grads()  # as the bench does under reentrant checkpoints
    gen = torch.Generator().manual_seed(1)
    adapters = {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in models[0].named_parameters() if "lora_" in n}
    ids = torch.randint(0, 128, (2, 16), generator=gen).to(device)
    results = []
    for model in models:
        model.train()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(adapters), sorted(trainable ^ set(adapters))[:3]
        layers = [m for m in model.modules() if isinstance(m, LoraLinear4bit)]
        assert len(layers) == 7 * model.config.num_hidden_layers
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in adapters:
                    p.copy_(adapters[n])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(adapters) and all(g.abs().sum() > 0 for g in grads.values())
        results.append((loss.detach(), grads))
    (loss_hf, grads_hf), (loss_ours, grads_ours) = results
    assert torch.isfinite(loss_ours)
    if device == "cpu":
        assert torch.equal(loss_ours, loss_hf)
        for n in adapters:
            assert torch.equal(grads_ours[n], grads_hf[n]), n
    else:  # a GPU's attention backward accumulates in a nondeterministic order: equal within bf16 rounding
        assert abs(loss_ours - loss_hf) <= 2**-8 * abs(loss_hf)
        for n in adapters:
            assert (grads_ours[n] - grads_hf[n]).abs().max() <= 2**-7 * grads_hf[n].abs().max(), n


def test_qlora_refuses_what_it_cannot_be() -> None:
    """QLoRA needs ``--lora`` and a dense model (bitsandbytes leaves fused 3-D expert weights in bf16): the bench
    says so before it builds anything, and the builder refuses a mixture of experts."""
    train_bench, qlora = _bench()
    with pytest.raises(SystemExit, match="add --lora N"):
        train_bench.main(["--workload", "tiny", "--baselines", "qlora"])
    with pytest.raises(SystemExit, match="fused 3-D expert weight"):
        train_bench.main(["--workload", "tiny-moe", "--lora", "4", "--baselines", "liger,qlora-nockpt"])
    with pytest.raises(ValueError, match="qlora: bitsandbytes quantizes nn.Linear weights only"):
        qlora.build_qlora(train_bench.build_model("tiny-moe", "meta"), lambda prefix, part: None, "cpu")


@pytest.mark.gpu
def test_qlora_baselines_run_in_the_bench() -> None:
    """``--baselines qlora,qlora-nockpt`` on the tiny workload: both rows measured, beside RoundPipe's."""
    import subprocess

    # ROOT first, the caller's own path kept: bitsandbytes may be installed outside site-packages.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    argv = ["--workload", "tiny", "--lora", "4", "--seq", "64", "--batch", "4", "--warmup", "1", "--iters", "1"]
    argv += ["--baselines", "qlora,qlora-nockpt"]
    res = subprocess.run(
        [sys.executable, "bench/train_bench.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| gpu-resident bitsandbytes NF4 QLoRA")]
    assert len(rows) == 2 and "no checkpointing" in rows[1], res.stdout[-2000:]
    assert all(float(r.split("|")[2].replace(",", "")) > 0 and "base NF4" in r for r in rows), rows
