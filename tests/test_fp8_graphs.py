"""Graphed jobs over a frozen fp8 base under FP8 GEMMs (``fp8=True``), and the device bytes of such a layer.

* A graphed job's weight slots hold an fp8-computing projection as its device weight (``fp8.Fp8Weight`` over the
  slot's e4m3 bytes and row scales), as an eager job's upload does: LoRA over an fp8 base, with the jobs graphed
  (the CPU stand-in, ``RPP_DEBUG_GRAPHS=1``) and eager, equals the plain PyTorch reference of tests/test_fp8.py
  to 1e-10 (float64) and takes the same FP8 GEMMs, call for call (with the CPU streams' order checks on);
  a slot made for the other layout is refused by name.
* ``formats.module_device_bytes`` counts such a weight at the bytes its device weight holds (no unpacking), and
  the estimate's mirror of that count (the saved-input room) equals it.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from helpers import rel_err
from torch import nn

from roundpipe import ModelExecutePlan, models, settings
from roundpipe.devices import device as device_mod
from roundpipe.host.formats import (
    FrozenWeight,
    dequantize_transient_bytes,
    device_nbytes,
    module_device_bytes,
    quantize_frozen,
)
from roundpipe.models import fp8
from roundpipe.runtime.run_config import RoundPipeRunConfig

pytest.importorskip("peft")
pytest.importorskip("transformers")
from test_fp8 import TOL, assert_close, fp8_base_pair, fp8_calls, reference_step  # noqa: E402, F401 -- a fixture
from test_models import grads, make_batch  # noqa: E402


def _fp8_slots() -> List[Dict[str, torch.Tensor]]:
    """The packed parts the devices' graph slots hold (one dict per fp8-computing weight and slot)."""
    return [parts for d in device_mod.get_devices() for s in d.graphs.slots.values() for parts in s.packed if parts]


@pytest.mark.stream_checks  # the slots' uploads and reads ordered as on a GPU (tests/conftest.py)
@pytest.mark.parametrize(
    "workers, fused", [("cpu:1", True), ("cpu:2", False)], ids=["fused cpu:1", "modules cpu:2"], indirect=["workers"]
)
def test_graphed_lora_over_fp8_base_equals_reference(
    workers: str,
    fp8_calls: Dict[str, int],  # noqa: F811 -- the fixture
    fused: bool,
) -> None:
    """The same wrapped model, one step with eager jobs and three with graphed ones (warm-ups, the capture, then
    replays): every step's loss and LoRA gradients equal the reference's to 1e-10, every step takes the same FP8
    GEMMs, and the slots hold the fp8 bytes and scales the eager upload wraps (no bf16 copy of the base)."""
    model, ref = fp8_base_pair(["q_proj", "v_proj"])
    batch = make_batch(padding=False)
    ref_loss, ref_grads = reference_step(ref, batch)
    # A fixed plan (the planner's first one): its later ones, timed, may differ between the steps compared here.
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 3), range(3, 4), range(4, 5)])
    run = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    rp = models.wrap_model(model, model_run_config=run, base_format="fp8", fp8=True, fused_kernels=fused)
    counts = []
    for graphs in ("0", "1", "1", "1"):  # read once per call (``RPP_DEBUG_GRAPHS``)
        before = dict(fp8_calls)
        with settings.overridden(debug_graphs=graphs):
            loss = rp.train_step(**batch)
        assert rel_err(loss, ref_loss) < TOL, graphs
        assert_close(grads(model), ref_grads)
        counts.append({k: fp8_calls[k] - before[k] for k in before})
    assert counts[0]["forward"] > 0 and counts[0]["grad_input"] > 0
    assert all(c == counts[0] for c in counts[1:]), counts
    devs = device_mod.get_devices()
    assert sum(d.graphs.replays for d in devs) > 0
    # Each decoder layer's slot holds every projection that computes from fp8 as its bytes and scales (the other
    # layers' slots none): no slot tensor holds one of them unpacked.
    layer = model.base_model.model.model.layers[0]
    per_layer = sum(1 for p in layer.parameters() if isinstance(p, FrozenWeight) and p.format is fp8.FP8_COMPUTE)
    held = [sum(parts is not None for parts in s.packed) for d in devs for s in d.graphs.slots.values()]
    assert per_layer == 7 and per_layer in held and set(held) <= {0, per_layer}, held
    for parts in _fp8_slots():
        assert parts.keys() == {"data", "scale"} and parts["data"].dtype == torch.float8_e4m3fn
        assert parts["scale"].dtype == torch.float32 and parts["scale"].shape == parts["data"].shape[:1]


def test_module_device_bytes_counts_an_fp8_weight_as_its_device_weight() -> None:
    """A layer whose frozen projections compute from their fp8 bytes counts, per such weight, the bytes of the
    ``Fp8Weight`` its upload makes (e4m3 data and float32 row scales) and no unpacking transient; a projection
    left to unpack (features not multiples of 16) keeps its logical size and its transient."""
    torch.manual_seed(0)
    layer = nn.Module()
    layer.fast = nn.Linear(64, 32, bias=False)  # converted
    layer.slow = nn.Linear(24, 40, bias=False)  # 24 inputs: unpacked as without fp8
    layer.norm = nn.LayerNorm(64)
    layer.requires_grad_(False)
    layer.norm.requires_grad_(True)
    quantize_frozen(layer, "fp8", skip=())
    fast, slow = layer.fast.weight, layer.slow.weight
    unpacked = module_device_bytes(layer)
    fast.format = fp8.FP8_COMPUTE  # what ``fp8.enable_fp8_base`` sets on a decoder projection
    dev = fast.format.device_weight(fast.packed, fast.shape, fast.dtype)
    assert isinstance(dev, fp8.Fp8Weight)
    held = dev.data_fp8.nbytes + dev.scale.nbytes
    assert device_nbytes(fast) == fast.device_nbytes() == held == 32 * 64 + 4 * 32
    assert dequantize_transient_bytes(fast) == 0 and dequantize_transient_bytes(slow) > 0
    norm = sum(p.numel() * p.element_size() for p in layer.norm.parameters())
    expect = held + slow.numel() * slow.element_size() + norm + dequantize_transient_bytes(slow)
    assert module_device_bytes(layer) == expect
    # Before the conversion: the logical size and the larger transient (fp8 unpacks in place: its packed bytes).
    logical = (fast.numel() + slow.numel()) * fast.element_size() + norm
    assert unpacked == logical + max(fast.host_nbytes(), dequantize_transient_bytes(slow))
    # The slot a graphed job makes for it: the same tensors, by name.
    assert fast.device_parts() == (("data", (32, 64), torch.float8_e4m3fn), ("scale", (32,), torch.float32))
    assert slow.device_parts() is None


def test_a_slot_made_for_another_layout_is_an_error() -> None:
    """A weight whose format changed after its layer's slot was made is refused by name, never uploaded into a
    slot of the other layout (an fp8-computing weight unpacked to bf16, or the reverse)."""
    from roundpipe.devices import graphs
    from roundpipe.runtime import transfer

    lin = nn.Linear(32, 16, bias=False).requires_grad_(False)
    quantize_frozen(lin, "fp8", skip=())
    w = lin.weight
    plain_slot = graphs.LayerSlot(graphs.layer_signature(lin, transfer.slot_parts), torch.device("cpu"))
    w.format = fp8.FP8_COMPUTE
    packed_slot = graphs.LayerSlot(graphs.layer_signature(lin, transfer.slot_parts), torch.device("cpu"))
    assert plain_slot.packed == [None] and packed_slot.params == [None]
    dev: Any = transfer._upload_slot(packed_slot, 0, w)
    assert isinstance(dev, fp8.Fp8Weight) and dev.data_fp8 is packed_slot.packed[0]["data"]
    assert torch.equal(dev.data_fp8.view(torch.uint8), w.packed["data"].view(torch.uint8))
    with pytest.raises(ValueError, match="kept packed on the device"):
        transfer._upload_slot(plain_slot, 0, w)
    with pytest.raises(ValueError, match="graph slot holds them"):
        transfer._upload_frozen(w, torch.device("cpu"), out=torch.empty(16, 32))


@pytest.mark.parametrize("head_dim", [8, 4], ids=["all seven", "k and v of 8 features"])
def test_planner_counts_a_layer_as_the_runtime_does(monkeypatch: pytest.MonkeyPatch, head_dim: int) -> None:
    """The estimate's layer bytes for the saved-input room (its mirror of the runtime's count) equal the runtime's
    count of a LoRA decoder layer over an fp8 base under FP8 GEMMs (``module_device_bytes`` and the adapters'
    gradients): the converted projections at their fp8 bytes, the others' unpacking transient only."""
    import peft
    import transformers

    from roundpipe.models.configs import tiny_config
    from roundpipe.planning import estimate
    from roundpipe.utils import GiB, get_model_active_size

    config = tiny_config("qwen3", head_dim=head_dim)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    quantize_frozen(model, "fp8")
    assert fp8.enable_fp8_base(model) > 0
    layer = model.base_model.model.model.layers[0]
    runtime = module_device_bytes(layer) + get_model_active_size(layer)
    seen: List[float] = []

    def spy(*args: Any) -> float:
        seen.append(args[8])  # layer_device: a layer's weights and gradients on the device
        return real(*args)

    real = estimate.runtime_step_bytes
    monkeypatch.setattr(estimate, "runtime_step_bytes", spy)
    shape = estimate.ModelShape.from_config(config)
    estimate.estimate(shape, 16, lora_rank=8, base_format="fp8", tile=0, fp8=True, gpu_bytes=8 * GiB)
    assert seen == [runtime]


@pytest.mark.gpu
@pytest.mark.parametrize("workers", ["cuda:0"], indirect=True)
def test_gpu_graphed_fp8_base_equals_eager(workers: str) -> None:
    """Real CUDA graphs over an fp8 base under FP8 GEMMs (a float32 tiny Qwen3 with LoRA on every projection): the
    graphed steps (warm-ups, capture, replays) give the eager step's loss and gradients (float32, to 1e-4: the bf16
    GEMMs of an unpacked base would be a few percent off), and the slots hold the e4m3 bytes and row scales."""
    from test_fp8 import add_lora, tiny_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = add_lora(tiny_model("qwen3", 0), targets, 8)
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 3), range(3, 4), range(4, 5)])
    run = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    rp = models.wrap_model(model, model_run_config=run, base_format="fp8", fp8=True)
    batch = make_batch(padding=False, batch=4, seq=64)
    with settings.overridden(debug_graphs="0", debug_keep_activations="0"):
        want = float(rp.train_step(**batch))
    want_grads = grads(model)
    for _ in range(3):
        # Recomputed stages are the graphed ones: on a GPU with room the planner would keep every stage instead.
        with settings.overridden(debug_graphs="1", debug_keep_activations="0"):
            got = float(rp.train_step(**batch))
        got_grads = grads(model)
        assert abs(got - want) <= 1e-4 * abs(want)
        assert got_grads.keys() == want_grads.keys() and got_grads
        for name in want_grads:
            assert rel_err(got_grads[name], want_grads[name]) < 1e-4, name
    devs = device_mod.get_devices()
    assert sum(d.graphs.replays for d in devs) > 0, [d.graphs.last_error for d in devs]
    slots = _fp8_slots()
    assert slots and all(p["data"].dtype == torch.float8_e4m3fn and p["data"].is_cuda for p in slots)
