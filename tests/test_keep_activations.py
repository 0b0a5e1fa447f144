"""Kept stages (``RPP_DEBUG_KEEP_ACTIVATIONS``): a backward stage whose forward keeps its autograd graph on the device
back-propagates through it instead of recomputing, with the same gradients bit for bit; the planner keeps only
what fits the room the plan leaves, and ``roundpipe plan`` says what keeping would take and save."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import transformers

import roundpipe
from roundpipe import RoundPipeRunConfig, settings
from roundpipe.models import configs
from roundpipe.planning import budget, keep
from roundpipe.planning.plan import ModelExecutePlan
from roundpipe.planning.planner import ActivationCosts
from roundpipe.runtime import jobs
from tests.helpers import LORA_PROJECTIONS, with_lora

Grads = Dict[str, torch.Tensor]
pytestmark = pytest.mark.stream_checks  # a missing wait between the kept forward and its backward fails here


def _train(
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    grain: str = "stage",
    microbatches: int = 3,
    lora: bool = False,
    plan: Optional[ModelExecutePlan] = None,
    dropout: float = 0.0,
) -> Tuple[torch.Tensor, Grads, List[Tuple[range, int]]]:
    """One forward_backward of a tiny Qwen3 (LoRA on every projection with ``lora``; attention dropout
    ``dropout``) under ``RPP_DEBUG_KEEP_ACTIVATIONS=mode``: the loss, the gradients, and the (stage,
    microbatch) pairs that ran through a kept graph."""
    torch.manual_seed(0)
    config = configs.tiny_config("qwen3", attention_dropout=dropout)
    model = transformers.AutoModelForCausalLM.from_config(config).float().train()
    if lora:
        model = with_lora(model, LORA_PROJECTIONS, seed=1)
    kept: List[Tuple[range, int]] = []
    real = jobs.kept_backward

    def spy(run: Any, dev: Any, layers: range, m: int, grads: List[Optional[torch.Tensor]]) -> Any:
        kept.append((layers, m))
        return real(run, dev, layers, m, grads)

    monkeypatch.setattr(jobs, "kept_backward", spy)
    with settings.overridden(debug_keep_activations=mode):
        cfg = RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=grain, execute_plan=plan)
        rp = roundpipe.wrap_model_to_roundpipe(model, model_run_config=cfg)
        ids = torch.randint(0, 100, (6, 10), generator=torch.Generator().manual_seed(1))
        loss = rp.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        rp.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, kept


def _assert_same(a: Tuple[torch.Tensor, Grads, Any], b: Tuple[torch.Tensor, Grads, Any]) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_kept_stages_give_the_recompute_gradients(
    workers: str, lora: bool, grain: str, microbatches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    recompute = _train("0", monkeypatch, grain, microbatches, lora)
    assert recompute[2] == []
    kept = _train("1", monkeypatch, grain, microbatches, lora)
    # Every stage but the fused last one ran through its kept graph, once per microbatch.
    assert len(kept[2]) >= microbatches and len(kept[2]) % microbatches == 0
    _assert_same(recompute, kept)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_a_kept_stage_across_forward_groups(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand plan whose forward groups cut through the kept stage: the forward is cut to match."""
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 1), range(1, 3), range(3, 5)], keep=[range(1, 3)])
    recompute = _train("0", monkeypatch, plan=plan, microbatches=2)
    kept = _train("auto", monkeypatch, plan=plan, microbatches=2)
    assert sorted({r for r, _ in kept[2]}, key=lambda r: r.start) == [range(1, 3)]
    _assert_same(recompute, kept)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_kept_dropout_draws_the_forward_masks(workers: str, grain: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With dropout the kept forward is the one draw of each mask (the recompute replays it from saved RNG
    states): the same loss and gradients, for a plan whose forward groups are the backward stages already
    (cutting the forward anew would change the order, and so the masks, of each layer's draws)."""
    plan = ModelExecutePlan([range(0, 2), range(2, 4)], [range(0, 2), range(2, 4), range(4, 5)])
    recompute = _train("0", monkeypatch, grain, plan=plan, dropout=0.3)
    kept = _train("1", monkeypatch, grain, plan=plan, dropout=0.3)
    assert {r for r, _ in kept[2]} == {range(0, 2), range(2, 4)}
    _assert_same(recompute, kept)


@pytest.mark.parametrize("workers", ["cpu:2", "cpu:3"], indirect=True)
def test_several_devices_never_keep(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round robin gives a stage's backward any device: forced keeping keeps nothing there."""
    recompute = _train("0", monkeypatch, microbatches=2)
    forced = _train("1", monkeypatch, microbatches=2)
    assert forced[2] == []
    _assert_same(recompute, forced)


@pytest.mark.parametrize("workers", ["cpu:1"], indirect=True)
def test_auto_keeps_only_with_room(workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` keeps nothing on CPU workers; on a GPU (a CPU worker taken for one here, its room the host's)
    the planner keeps, and with no room it keeps nothing."""
    assert _train("auto", monkeypatch, microbatches=2)[2] == []
    real = keep.decide
    monkeypatch.setattr(keep, "decide", lambda *a, **k: real(*a[:-1], True, **k))
    assert _train("auto", monkeypatch, microbatches=2)[2]
    monkeypatch.setattr(budget, "device_keep_room", lambda *a, **k: 0.0)
    assert _train("auto", monkeypatch, microbatches=2)[2] == []


def _costs(n: int) -> ActivationCosts:
    return ActivationCosts(kept=[100.0] * n, peak=[150.0] * n, checkpoint=[20.0] * n, gpu_limit=1e4, host_limit=1e9)


def test_decide_fits_the_room() -> None:
    """Each kept stage costs its layers and, per microbatch, its layers' kept bytes: the planner keeps what
    fits the room the backward-stage inputs leave, best saving per byte first, and cuts the forward to match."""
    plan = ModelExecutePlan([range(0, 3), range(3, 6)], [range(0, 2), range(2, 4), range(4, 6), range(6, 8)])
    a, sizes, fwd = _costs(8), [10.0] * 8, [1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0]
    stage = keep.stage_cost(a, range(2, 4), sizes, 3)
    assert stage == 3 * 200.0 + 20.0
    inputs = 40.0  # the inputs of stages 2-3 and 4-5 (the first is the model's, the fused one's is handed over)

    def decide(room: float, mode: str = "auto", devices: int = 1, run_type: str = "fused") -> ModelExecutePlan:
        return keep.decide(plan, run_type, devices, False, 3, sizes, fwd, True, a, room, True, mode)  # type: ignore[arg-type]

    assert decide(0.0).keep == () and decide(0.0).fwd_plan == plan.fwd_plan
    assert decide(stage).keep == ()  # the inputs come first
    one = decide(inputs + stage)
    assert one.keep == (range(2, 4),) and one.keep_bytes == stage and one.keep_saves_ms == 3 * 10.0
    assert one.fwd_plan == [range(0, 2), range(2, 4), range(4, 6)]
    one.check_valid(8, "fused")
    assert repr(one).endswith("keep=[2-3] (0.00 GiB, 30 ms of recompute saved a call))")
    two = decide(inputs + 2 * stage + 1)
    assert two.keep == (range(0, 2), range(2, 4)) and two.keep_bytes <= 2 * stage + 1
    assert decide(1e9).keep == (range(0, 2), range(2, 4), range(4, 6))  # never the fused last stage
    assert decide(1e9, mode="0").keep == ()
    assert decide(0.0, mode="1").keep == (range(0, 2), range(2, 4), range(4, 6))
    assert decide(1e9, devices=2).keep == () and decide(1e9, mode="1", run_type="train").keep == ()
    assert keep.decide(plan, "fused", 1, False, 3, sizes, fwd, True, None, 1e9, True, "auto").keep == ()  # no profile
    hand = ModelExecutePlan(plan.fwd_plan, plan.bwd_plan, keep=[range(2, 4)])
    assert keep.decide(hand, "fused", 1, False, 3, sizes, fwd, True, a, 0.0, True, "auto").keep == (range(2, 4),)
    with pytest.raises(ValueError, match="not a backward stage"):
        keep.decide(
            ModelExecutePlan(plan.fwd_plan, plan.bwd_plan, keep=[range(1, 4)]),
            "fused",
            1,
            False,
            3,
            sizes,
            fwd,
            True,
            a,
            0.0,
            True,
            "auto",
        )
    assert keep.decide(plan, "fused", 1, False, 3, sizes, fwd, True, a, 1e9, False, "auto").keep == ()  # CPU workers


def test_refine_forward() -> None:
    fwd = [range(0, 3), range(3, 6), range(6, 8)]
    assert keep.refine_forward(fwd, [range(2, 7)]) == [range(0, 2), range(2, 7), range(7, 8)]
    assert keep.refine_forward(fwd, [range(3, 6)]) == fwd
    assert keep.refine_forward(fwd, []) == fwd
    with pytest.raises(ValueError, match="keep"):
        ModelExecutePlan(fwd, [range(0, 2), range(2, 8)], keep=[range(2, 8)]).check_valid(8, "train")


@pytest.mark.gpu
def test_kept_stages_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one GPU, deterministic kernels: the same gradients bit for bit, full fine-tune and LoRA. Hugging
    Face's modules run eagerly (fused kernels off): a compiled layer's graph without autograd (the recompute
    path's forward) and with it (the kept forward) are two compilations, which need not round alike."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with settings.overridden(devices="cuda:0", debug_fused_kernels="0"):
            for lora in (False, True):
                recompute = _train("0", monkeypatch, lora=lora)
                kept = _train("1", monkeypatch, lora=lora)
                assert kept[2]
                _assert_same(recompute, kept)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _plan(argv: List[str], capsys: pytest.CaptureFixture) -> str:
    from roundpipe.cli import plan as plan_cli

    plan_cli.main(argv)
    return capsys.readouterr().out


def test_roundpipe_plan_prints_what_keeping_takes_and_saves(capsys: pytest.CaptureFixture) -> None:
    """One GPU with room keeps stages within it (a line says so); a small GPU keeps none; two GPUs never keep."""
    step = ["--model", "qwen3-1.7b", "--seq-len", "4096", "--batch-size", "8", "--microbatches", "8"]
    host = ["--host-memory", "500GiB"]
    big = json.loads(_plan([*step, *host, "--gpu-memory", "141GiB", "--json"], capsys))["keep"]
    assert big["candidates"] == 28 and 0 < big["stages"] <= 28
    assert 0 < big["gpu_bytes"] <= big["room"] and big["saved_flops"] > 0 and 0 < big["share"] <= 0.25
    text = _plan([*step, *host, "--gpu-memory", "141GiB"], capsys)
    assert f"keep activations: {big['stages']} of 28 backward stages" in text and "TFLOP a step" in text
    small = json.loads(_plan([*step, *host, "--gpu-memory", "8GiB", "--json"], capsys))["keep"]
    assert small["stages"] == 0 and small["stage_bytes"] > small["room"]
    assert "keep activations" not in _plan([*step, *host, "--gpu-memory", "8GiB"], capsys)
    two = json.loads(_plan([*step, *host, "--gpu-memory", "141GiB", "--gpus", "2", "--json"], capsys))["keep"]
    assert two["candidates"] == two["stages"] == 0
