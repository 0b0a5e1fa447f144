"""``roundpipe train --gpu-memory 24GiB --host-memory 100GiB``: the caps of ``RPP_GPU_MEMORY`` /
``RPP_HOST_MEMORY`` as flags, read as ``roundpipe plan`` reads them. The flag wins over the variable, a
run's ``config.yaml`` keeps it so ``--resume`` runs under the same caps, and a bad size is one line."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from roundpipe import settings
from roundpipe.cli import main, plan
from roundpipe.cli.config import ConfigError, merge
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.memory_caps import size_bytes
from roundpipe.cli.train import Recipe, run
from roundpipe.cli.train_state import resume_config
from roundpipe.utils import GiB


@pytest.fixture(autouse=True)
def _restore_process_state(restore_process_state: None) -> None:
    """The runs here configure this process's devices and caps (see conftest.restore_process_state)."""


@pytest.mark.parametrize("text, gib", [("24GiB", 24.0), ("24GB", 24e9 / GiB), ("20000MiB", 20000 / 1024), ("24", 24.0)])
def test_train_reads_a_size_as_plan_does(text: str, gib: float) -> None:
    cfg = parse_train_args(["--gpu-memory", text, "--host-memory", text]).cfg
    assert (cfg.gpu_memory, cfg.host_memory) == (text, text)
    assert (
        size_bytes(cfg.gpu_memory)
        == plan.parser().parse_args(["--model", "tiny", "--seq-len", "8", "--gpu-memory", text]).gpu_memory
    )
    assert size_bytes(text) == pytest.approx(gib * GiB)
    settings.configure(gpu_memory=text)  # what the run configures: the setting's own parser agrees
    assert settings.GPU_MEMORY_GIB.get() == pytest.approx(gib)


@pytest.mark.parametrize("flag, value", [("--gpu-memory", "lots"), ("--host-memory", "-4GiB"), ("--gpu-memory", "0")])
def test_a_bad_size_is_one_line(capsys, flag: str, value: str) -> None:
    assert main(["train", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    key = flag[2:].replace("-", "_")
    assert (
        err == f"roundpipe: error: {key}={value!r} is not a size — set {flag} to a size such as 24GiB, 24GB or 20000MiB"
    )
    with pytest.raises(ConfigError, match="host_memory='a lot' is not a size"):
        merge({"host_memory": "a lot"}, {})  # a YAML key is checked alike


def test_the_flag_wins_over_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RPP_GPU_MEMORY", "8GiB")
    monkeypatch.setenv("RPP_HOST_MEMORY", "4GiB")
    Recipe(merge({}, {"devices": "cpu:1"}))._set_devices()
    assert (settings.GPU_MEMORY_GIB.get(), settings.HOST_MEMORY_GIB.get()) == (8.0, 4.0)  # no flag: the variables
    Recipe(merge({}, {"devices": "cpu:1", "gpu_memory": "24GiB", "host_memory": "100GiB"}))._set_devices()
    assert (settings.GPU_MEMORY_GIB.get(), settings.HOST_MEMORY_GIB.get()) == (24.0, 100.0)


def test_resume_keeps_the_caps(tmp_path, monkeypatch, caplog) -> None:
    """The first run's caps are in its config.yaml; ``--resume`` without the flags runs under them, not under the
    variables of the resuming shell; a flag given at resume changes them without the "changed" warning."""
    out = str(tmp_path / "run")
    keys = dict(devices="cpu:1", steps=2, stop_at=1, log_every=1000, eval_examples=0, output_dir=out)
    run(merge({}, dict(keys, gpu_memory="24GiB", host_memory="100GiB")), out=lambda m: None)
    with open(os.path.join(out, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert (saved["gpu_memory"], saved["host_memory"]) == ("24GiB", "100GiB")
    monkeypatch.setenv("RPP_HOST_MEMORY", "4GiB")
    args = parse_train_args(["--resume", "--output-dir", out])
    cfg = resume_config(args.cfg, args.given)
    assert (cfg.gpu_memory, cfg.host_memory) == ("24GiB", "100GiB")
    settings.unconfigure("RPP_GPU_MEMORY", "RPP_HOST_MEMORY")  # the first run's choice, undone: the shell's 4 GiB
    assert settings.HOST_MEMORY_GIB.get() == 4.0
    result = run(args.cfg, args.given, out=lambda m: None)
    assert result.step == 2 and settings.HOST_MEMORY_GIB.get() == 100.0
    args = parse_train_args(["--resume", "--output-dir", out, "--host-memory", "64GiB"])
    caplog.clear()
    assert resume_config(args.cfg, args.given).host_memory == "64GiB"
    assert not [r for r in caplog.records if "resuming with changed" in r.getMessage()]


def test_out_of_memory_is_one_line_and_a_smaller_batch_trains_in_the_same_process(
    tmp_path, monkeypatch, capsys
) -> None:
    """A device out of memory mid-step (simulated: a training call of more than 4 rows raises as the
    allocator would) ends the run with one line that names the flags to change; a run with a smaller
    --batch-size then trains in the same process."""
    from roundpipe.cli.pipeline import PipelineModel

    real = PipelineModel.forward_backward
    calls = {"n": 0}

    def fits_4_rows(self, input_ids, *args, **kwargs):
        calls["n"] += 1
        if input_ids.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(PipelineModel, "forward_backward", fits_4_rows)
    args = ["train", "--steps", "2", "--devices", "cpu:1", "--eval-examples", "4", "--microbatches", "2"]
    assert main([*args, "--output-dir", str(tmp_path / "big"), "--batch-size", "8"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("roundpipe: error:")]
    assert lines == [
        "roundpipe: error: CUDA out of memory. Tried to allocate 20.00 GiB (simulated) — lower --batch-size or raise "
        "--microbatches (smaller activations), or lower --gpu-memory (RPP_GPU_MEMORY: smaller stages); --resume "
        "continues from the newest checkpoint (docs/resolve-oom.md)"
    ]
    assert calls["n"] == 1  # the first step's call
    assert main([*args, "--output-dir", str(tmp_path / "small"), "--batch-size", "4"]) == 0
    assert calls["n"] > 1
