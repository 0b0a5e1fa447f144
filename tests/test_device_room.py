"""The GPU room a one-GPU step keeps its backward-stage inputs in: ``roundpipe plan``'s estimate
(``estimate.estimate(gpu_bytes=...)``) against the room the runtime computes from its own activation profile
(``budget.device_saved_room``), for a LoRA model whose embedding is its largest layer, as qwen3-8b's is."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RPP_DISABLE_TORCH_COMPILE", "1")

import roundpipe  # noqa: E402
from roundpipe.devices import device  # noqa: E402
from roundpipe.models import configs  # noqa: E402
from roundpipe.planning import budget, estimate, memory_terms  # noqa: E402
from roundpipe.runtime.batch import Batch  # noqa: E402
from roundpipe.runtime.run_config import ResolvedRunConfig, RoundPipeRunConfig  # noqa: E402
from roundpipe.utils import GiB

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ = 1 << 17
LAYERS = 48
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_model() -> tuple:
    """A bf16 Qwen3 of width 256 with 48 layers and a vocabulary that makes the embedding the largest layer,
    LoRA r=4 on every projection; its runtime profile at 131,072 tokens (computed, never run)."""
    cfg = configs.tiny_config(
        "qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=LAYERS, head_dim=64, vocab_size=8192,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS))
    rp = roundpipe.wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    run_cfg = ResolvedRunConfig(RoundPipeRunConfig(), rp.model_run_config)
    profile = rp.activation_profile(Batch((), {"input_ids": ids, "labels": ids}, run_cfg), "stage")
    return estimate.ModelShape.from_config(cfg), profile, rp.layer_device_bytes("fused")


@pytest.mark.parametrize("gpu_gib", [3.0, 3.5, 5.0, 8.0])
def test_the_estimate_keeps_as_many_stage_inputs_on_the_gpu_as_the_runtime_room_holds(
    gpu_gib: float, lora_model: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One backward stage per layer, the embedding's its own (as the runtime plans a host with room for every
    stage input: ``planner._activation_partition`` makes as many stages as the host allows): the runtime's room,
    charged per input with the rotary tables and position ids it carries, holds as many inputs as the estimate
    counts on the GPU, unless the estimate's own (larger) count of the step leaves less; at 5 and 8 GiB the
    runtime's room decides, at 3 GiB the estimate's remainder."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "auto")
    shape, profile, layer_bytes = lora_model
    gpu = gpu_gib * GiB
    monkeypatch.setattr(device, "get_min_capacity", lambda: int(gpu))
    plan = [range(i, i + 1) for i in range(len(layer_bytes))]
    room = budget.device_saved_room(profile, layer_bytes, plan)
    e = estimate.estimate(shape, SEQ, 1, lora_rank=4, gpu_bytes=gpu, pinned=False)
    raw = SEQ * memory_terms.checkpoint_bytes_per_token(shape, 2)
    charged = raw + SEQ * memory_terms.side_bytes_per_token(shape, 2)
    step = sum(v for k, v in e.gpu_parts.items() if k != "saved inputs")
    by_runtime, by_estimate = int(room // charged), int(max(0.0, gpu - step) // charged)
    assert e.gpu_parts["saved inputs"] == min(LAYERS, by_runtime, by_estimate) * raw
    assert (by_runtime < by_estimate) == (gpu_gib >= 5.0), (by_runtime, by_estimate)
    assert 0 < min(by_runtime, by_estimate) < LAYERS and e.peak_gpu_bytes <= gpu


@pytest.mark.parametrize(
    "seq,gpu_gib,stage_inputs,gpu_peak,host_peak",
    [(131072, 24, "bf16", 22.25, 54.1), (262144, 80, "int8", 57.25, 42.16)],
)
def test_plan_estimates_of_full_qwen3_8b_lora_are_the_measured_peaks(
    seq: int, gpu_gib: int, stage_inputs: str, gpu_peak: float, host_peak: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``roundpipe plan``'s figures for the full qwen3-8b, LoRA r=16, against one H200's peaks
    (docs/benchmarks.md): 131,072 tokens under a 24 GiB cap (GPU allocated 22.25 GiB, host RSS 54.1 GiB) and
    262,144 under an 80 GiB cap with int8 stage inputs (57.25 GiB, 42.16 GiB): within 10%, and each GPU figure
    within its cap (both runs completed)."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "auto")
    shape = estimate.ModelShape.builtin("qwen3-8b")
    e = estimate.estimate(shape, seq, lora_rank=16, gpu_bytes=gpu_gib * GiB, tile=16384, stage_inputs=stage_inputs)
    assert abs(e.peak_gpu_bytes / GiB / gpu_peak - 1) < 0.10, e.describe()
    assert e.peak_gpu_bytes <= gpu_gib * GiB
    assert abs(e.peak_host_bytes / GiB / host_peak - 1) < 0.10, e.describe()


@pytest.mark.parametrize(
    "seq,gpu_gib,stage_inputs,layers,gpu_peak,host_peak",
    [(65536, 24.0, "fp8", 1, 20.5, 83.9), (131072, 139.8, "bf16", 2, 103.9, 63.5)],
)
def test_plan_estimates_of_70b_nf4_lora_are_the_measured_peaks(
    seq: int, gpu_gib: float, stage_inputs: str, layers: int, gpu_peak: float, host_peak: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``roundpipe plan``'s figures for Llama-3.1-70B's shape over an NF4 base, LoRA r=16, one sequence in tiles of
    4,096, against one H200's peaks on a 125 GiB host (docs/benchmarks.md): 65,536 tokens under a 24 GiB cap with
    fp8 stage inputs (every layer a backward stage of its own, the embedding's too, as the runtime plans it; two
    stage inputs kept on the GPU) and 131,072 uncapped (stages of two layers): within 10%, each GPU figure within
    its GPU (``layers``: the decoder layers per backward stage ``roundpipe plan`` picks for that host)."""
    monkeypatch.setenv("RPP_DEBUG_DEVICE_SAVED_GB", "auto")
    shape = estimate.ModelShape.builtin("llama3.1-70b")
    e = estimate.estimate(
        shape, seq, lora_rank=16, base_format="nf4", gpu_bytes=gpu_gib * GiB, tile=4096, stage_inputs=stage_inputs,
        layers_per_stage=layers,
    )  # fmt: skip
    assert abs(e.peak_gpu_bytes / GiB / gpu_peak - 1) < 0.10, e.describe()
    assert e.peak_gpu_bytes <= gpu_gib * GiB
    assert abs(e.peak_host_bytes / GiB / host_peak - 1) < 0.10, e.describe()
