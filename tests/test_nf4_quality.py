"""LoRA over an NF4 base reaches the loss it reaches over the bf16 base: ``bench/nf4_quality.py`` shortened.

A hidden-256 Qwen3 layer pretrained briefly in plain PyTorch on the bench's synthetic language, saved as a Hugging
Face checkpoint, then fine-tuned with LoRA r16 on the shifted language through ``roundpipe.from_pretrained`` with
each base format (same adapters' init, same batches, two CPU workers). The issue's target is 2% after 300 steps;
the bench measures 0.04% there (docs/benchmarks.md), and this shortened run 0.02% to 0.17% over seeds 0-2 (the
base on its own language: 0.01% to 0.09%). The bound here, 0.5%, is three times the largest of those, and it
fails for an NF4 base whose block scales are off by 1.25x (+1.4% to +1.8% over those seeds) or 2x (+3.9% to
+5.3%), so it measures the base and not the adapters alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Iterator

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import nf4_quality as bench  # noqa: E402

BOUND = 0.005
"""NF4 final loss / bf16 final loss may differ from 1 by this much (see the module doc)."""

SHORT = ["--steps", "20", "--pretrain-steps", "40", "--layers", "1", "--length", "8", "--vocab", "32", "--tail", "10"]
"""The bench's defaults but for a run of seconds: hidden 256, LoRA r16, one layer, 8-symbol halves."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for the file: the pretraining's matrices are small, and each of the two CPU workers
    (created with the process's count) then computes on one core instead of four threads sharing two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(one_thread: None, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The pretrained checkpoint (and its losses) and the two languages, built once for the file."""
    args = bench.parser().parse_args(SHORT)
    pre_lang = bench.pretrain_language(args.vocab, args.length, args.noise, args.seed)
    path = str(tmp_path_factory.mktemp("nf4_quality"))
    pretrained = bench.summarize({"losses": bench.pretrain(path, pre_lang, args)}, args.tail)
    lang = bench.shifted_language(pre_lang, args.seed)
    return {"args": args, "path": path, "pre": pre_lang, "lang": lang, "pretrained": pretrained}


def fine_tune(setup: Dict[str, Any], fmt: str) -> Dict[str, Any]:
    """The bench's fine-tune of the pretrained checkpoint with base ``fmt``, summarized."""
    args: argparse.Namespace = setup["args"]
    return bench.summarize(bench.fine_tune(setup["path"], setup["lang"], setup["pre"], fmt, args), args.tail)


@pytest.fixture(scope="module")
def bf16(setup: Dict[str, Any]) -> Dict[str, Any]:
    """The reference: the bf16 base's run, on two CPU workers (once for both tests)."""
    from roundpipe import settings

    with settings.overridden(devices="cpu:2"):
        return fine_tune(setup, "bf16")


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
def test_an_nf4_base_reaches_the_bf16_base_loss(workers: str, setup: Dict[str, Any], bf16: Dict[str, Any]) -> None:
    nf4 = fine_tune(setup, "nf4")
    assert setup["pretrained"]["final"] < 0.8 * setup["pretrained"]["first"]  # the base learnt its language
    assert bf16["final"] < 0.9 * bf16["first"]  # the adapters learn the shifted task
    assert abs(nf4["base_loss"] / bf16["base_loss"] - 1) < BOUND  # before any adapting
    assert abs(nf4["final"] / bf16["final"] - 1) < BOUND, (nf4["final"], bf16["final"])
    assert nf4["losses"] != bf16["losses"]  # two bases, not one


@pytest.mark.parametrize("workers", ["cpu:2"], indirect=True)
@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_the_bound_fails_for_wrong_nf4_scales(
    workers: str, factor: float, setup: Dict[str, Any], bf16: Dict[str, Any], monkeypatch
) -> None:
    """Every NF4 block scale times ``factor`` (the double quantization's factors divided, its mean multiplied)."""
    from roundpipe.host.formats import get_format

    nf4 = get_format("nf4")
    real = nf4.quantize

    def scaled(w: Any) -> Dict[str, Any]:  # w: [out, in]
        packed = real(w)
        return {**packed, "factors": packed["factors"] / factor, "mean": packed["mean"] * factor}

    monkeypatch.setattr(nf4, "quantize", scaled)
    wrong = fine_tune(setup, "nf4")
    assert wrong["final"] / bf16["final"] - 1 > BOUND, (wrong["final"], bf16["final"])
