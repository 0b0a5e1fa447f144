"""Mistakes that need no model are answered before torch and transformers load: an output directory
holding an earlier run or one that cannot be written, a missing or empty data file, a mistyped model
name (with the name probably meant), ``--overwrite`` with ``--resume``. Each is one line, status 2, and
takes well under a second. Also: ``--dtype bf16`` and the other short dtype names are aliases."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

import pytest
import yaml
from helpers import ROOT

from roundpipe.cli.config import ConfigError, merge
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.export import parse_export_args

HEAVY = {"torch", "transformers", "numpy"}


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def earlier_run(d: str) -> Tuple[List[str], List[str]]:
    out = os.path.join(d, "run")
    os.makedirs(os.path.join(out, "checkpoints"))
    write(os.path.join(out, "metrics.csv"), b"step,loss\n")
    return ["--output-dir", out], [f"output_dir {out} already holds a run (metrics.csv, checkpoints)", "--overwrite"]


def unwritable_output_dir(d: str) -> Tuple[List[str], List[str]]:
    target = os.path.join(write(os.path.join(d, "a-file"), b""), "out")
    return ["--output-dir", target], [f"cannot write to output_dir {target}", "pick a writable --output-dir"]


def missing_data(d: str) -> Tuple[List[str], List[str]]:
    path = os.path.join(d, "train.jsonl")
    return ["--data", path], [f"data file '{path}' not found", "--data"]


def empty_data(d: str) -> Tuple[List[str], List[str]]:
    path = write(os.path.join(d, "train.jsonl"), b"")
    return ["--data", path], [f"data file '{path}' is empty", "one JSON object per line"]


def blank_text(d: str) -> Tuple[List[str], List[str]]:
    path = write(os.path.join(d, "notes.txt"), b" \n\n\t\n")
    return ["--data", path], [f"data file '{path}' is empty", "put the training text in it"]


def mistyped_model(d: str) -> Tuple[List[str], List[str]]:
    return ["--model", "Qwen3-8B"], ["model 'Qwen3-8B' is neither a local directory", "(did you mean 'qwen3-8b'?)"]


def hub_id(d: str) -> Tuple[List[str], List[str]]:
    return ["--model", "Qwen/Qwen3-8B"], ["(nothing is downloaded)", "hf download Qwen/Qwen3-8B --local-dir DIR"]


def overwrite_and_resume(d: str) -> Tuple[List[str], List[str]]:
    args = ["--resume", "--overwrite", "--output-dir", os.path.join(d, "run")]
    return args, ["--overwrite and --resume are both given"]


Case = Callable[[str], Tuple[List[str], List[str]]]
CASES: Dict[str, Case] = {
    f.__name__: f
    for f in (earlier_run, unwritable_output_dir, missing_data, empty_data, blank_text, mistyped_model, hub_id)
    + (overwrite_and_resume,)
}


def run(args: List[str], cwd: str, importtime: bool) -> Tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, RPP_DEVICES="cpu:1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "roundpipe", "train", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    return proc, time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_answered_before_torch_loads(tmp_path, case: str) -> None:
    args, fragments = CASES[case](str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    proc, _ = run(args, str(tmp_path), importtime=True)
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("import time:")]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("roundpipe: error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    imported = {l.rsplit("|", 1)[-1].strip() for l in proc.stderr.splitlines() if l.startswith("import time:")}
    assert "roundpipe.cli" in imported and not imported & HEAVY, sorted(imported & HEAVY)
    assert sorted(os.listdir(tmp_path)) == before  # the checks leave nothing behind
    # Well under a second: the best of three tries, so that a busy machine's moment does not decide it.
    assert min(run(args, str(tmp_path), importtime=False)[1] for _ in range(3)) < 1.0


def test_short_dtype_names_are_aliases(tmp_path) -> None:
    cfg = parse_train_args(["--dtype", "bf16", "--master", "BF16", "--optim-state", "fp32"]).cfg
    assert (cfg.dtype, cfg.master, cfg.optim_state) == ("bfloat16", "bfloat16", "float32")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"dtype": "torch.float16"}))
    assert parse_train_args(["--config", str(config)]).cfg.dtype == "float16"
    assert merge({}, {"dtype": "fp32"}).dtype == "float32"
    assert parse_export_args(["ckpt", "out", "--dtype", "bf16"]).dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"dtype='bf8' is not supported — use one of auto, .* \(or bf16, fp32"):
        parse_train_args(["--dtype", "bf8"])


#: What must answer without torch or transformers, with RPP_DEVICES unset (``import roundpipe`` then counts GPUs),
#: and the exit status: the answers of the command line that need no model.
NO_MODEL_NEEDED = {
    "import roundpipe": (["-c", "import roundpipe"], 0),
    "--help": (["-m", "roundpipe", "--help"], 0),
    "--version": (["-m", "roundpipe", "--version"], 0),
    "train --help": (["-m", "roundpipe", "train", "--help"], 0),
    "plan --help": (["-m", "roundpipe", "plan", "--help"], 0),
    "export --help": (["-m", "roundpipe", "export", "--help"], 0),
    "train, a bad flag value": (["-m", "roundpipe", "train", "--lr", "fast"], 2),
    "train, a bad memory cap": (["-m", "roundpipe", "train", "--gpu-memory", "lots"], 2),
    "train, an unknown model": (["-m", "roundpipe", "train", "--model", "qwen3-9b"], 2),
    "train, --resume of nothing": (["-m", "roundpipe", "train", "--resume", "--output-dir", "no-run-here"], 2),
    "plan, an unknown model": (["-m", "roundpipe", "plan", "--model", "qwen3-9b", "--seq-len", "8"], 2),
    "plan, a bad flag value": (["-m", "roundpipe", "plan", "--model", "tiny", "--seq-len", "many"], 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(NO_MODEL_NEEDED))
def test_instant_answers_load_neither_torch_nor_transformers(tmp_path, case: str) -> None:
    """``--help``, ``--version`` and configuration errors leave torch and transformers unimported, also when
    no ``RPP_DEVICES`` says the pool (the GPU count comes from NVML or the environment). The time is printed,
    not asserted: the module list is what decides it, a loaded machine's clock would not."""
    args, status = NO_MODEL_NEEDED[case]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RPP_DEVICES", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    report = "; import sys; print('HEAVY', sorted(m for m in %r if m in sys.modules))" % sorted(HEAVY)
    if args[0] == "-c":
        cmd = [sys.executable, "-c", args[1] + report]
    else:  # run the command inside a wrapper that reports sys.modules when it exits, whatever its status
        wrap = "import atexit, runpy, sys; sys.argv = ['roundpipe', *sys.argv[1:]]; "
        wrap += "atexit.register(lambda: print('HEAVY', sorted(m for m in %r if m in sys.modules)))" % sorted(HEAVY)
        wrap += "; runpy.run_module('roundpipe', run_name='__main__')"
        cmd = [sys.executable, "-c", wrap, *args[2:]]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    print(f"{case}: {elapsed:.2f} s")
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    if status == 2:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("roundpipe: error: "), proc.stderr
    heavy = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY ")]
    assert heavy == ["HEAVY []"], (heavy, proc.stderr[-2000:])
