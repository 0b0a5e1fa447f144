"""What a run leaves for others and for later: checkpointed and exported weights readable as the umask
allows (safetensors writes 0600), an export line that names the step, a resume from another working
directory that finds the run's data (relative paths are saved resolved), a done line after a resume that
agrees with the progress lines, a loss plot whose x axis shows whole steps, and a config of an unknown
``model_type`` answered with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest
from helpers import ROOT

from .runner import one_line_error, roundpipe

TASK = ["--steps", "3", "--batch-size", "4", "--eval-examples", "0"]


def run_with_umask(args: List[str], cwd: str, umask: int) -> subprocess.CompletedProcess:
    """``python -m roundpipe ARGS`` (one CPU worker) in a process whose umask is ``umask``."""
    env = dict(os.environ, RPP_DEVICES="cpu:1", RPP_PROGRESS="0")
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "roundpipe", *args]
    umask_it = lambda: os.umask(umask)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=umask_it)


def modes(root: str) -> Dict[str, int]:
    """Permission bits of every file under ``root`` by relative path."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = os.stat(path).st_mode & 0o777
    return out


@pytest.mark.timeout(600)
def test_weights_get_the_umasks_permissions_and_export_names_its_step(tmp_path) -> None:
    out = str(tmp_path / "run")
    proc = run_with_umask(["train", *TASK, "--save-every", "2", "--output-dir", out], str(tmp_path), 0o002)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = modes(out)
    assert "checkpoints/step-0000003/model.safetensors" in files
    assert "checkpoints/step-0000003/optim/master.safetensors" in files
    assert {path: mode for path, mode in files.items() if mode != 0o664} == {}  # weights as everything else
    exported = str(tmp_path / "hf")
    proc = run_with_umask(["export", out, exported], str(tmp_path), 0o022)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"exported step 3 ({os.path.join(out, 'checkpoints', 'step-0000003')}) -> {exported}"
    files = modes(exported)
    assert "model.safetensors" in files and {path: mode for path, mode in files.items() if mode != 0o644} == {}
    older = os.path.join(out, "checkpoints", "step-0000002")
    proc = run_with_umask(["export", older, str(tmp_path / "hf2")], str(tmp_path), 0o022)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"exported step 2 ({older}) -> "), proc.stdout


def progress_and_done(stdout: str) -> Dict[str, Any]:
    """The time of the last progress line and the time and tokens/s of the done line."""
    progress = re.findall(r"^step (\d+)/\d+ \|.*\| ([\d.k]+) tok/s \| (\d+:\d\d:\d\d)$", stdout, re.M)
    hms = r"(\d+:\d\d:\d\d)"
    done_line = rf"^done: step (\d+)/\d+ in {hms}(?: \({hms} since the resume\))?, ([\d.k]+) tokens/s"
    done = re.search(done_line, stdout, re.M)
    assert progress and done, stdout
    return {"progress": progress[-1], "done": done.groups()}


def seconds(hms: Optional[str]) -> int:
    h, m, s = (int(x) for x in (hms or "0:00:00").split(":"))
    return 3600 * h + 60 * m + s


def set_elapsed(checkpoint: str, elapsed: float) -> None:
    """Make ``checkpoint`` say its run trained ``elapsed`` seconds before it (its manifest updated to match)."""
    import torch

    from roundpipe.cli.checkpoint import sha256_file

    path = os.path.join(checkpoint, "trainer.pt")
    trainer = torch.load(path, weights_only=True)
    trainer["elapsed"] = elapsed
    torch.save(trainer, path)
    with open(os.path.join(checkpoint, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["trainer.pt"] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    with open(os.path.join(checkpoint, "manifest.json"), "w") as f:
        json.dump(manifest, f)


@pytest.mark.timeout(900)
def test_resume_from_another_directory_finds_the_data_and_reports_the_whole_run(tmp_path) -> None:
    """A run on a relative data path, stopped after step 2 and resumed from another directory by the
    checkpoint's absolute path: its config.yaml holds absolute paths, the run finds its data, and the
    done line's time and rate are the last progress line's (the whole run: an hour before the checkpoint,
    here), with the resumed part's own time beside it."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["train", "--data", "notes.txt", "--seq-len", "32", "--batch-size", "4", "--steps", "4", "--log-every", "1"]
    proc = roundpipe([*args, "--stop-at", "2", "--output-dir", "out"], str(work))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(work / "out" / "config.yaml") as f:
        saved = f.read()
    assert f"data: {work / 'notes.txt'}\n" in saved and f"output_dir: {work / 'out'}\n" in saved, saved
    checkpoint = str(work / "out" / "checkpoints" / "step-0000002")
    set_elapsed(checkpoint, 3600.0)
    proc = roundpipe(["train", "--resume", checkpoint, "--log-every", "1"], str(elsewhere))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(elsewhere) == []  # everything went to the run's own directory
    assert "resuming at step 2" in proc.stdout and "done: step 4/4" in proc.stdout
    got = progress_and_done(proc.stdout)
    (step, rate, shown), (done_step, total, this_run, done_rate) = got["progress"], got["done"]
    assert step == done_step == "4" and seconds(shown) >= 3600
    # The last progress line's time and rate (both at its step); the resumed part's own time beside it.
    assert (total, done_rate) == (shown, rate) and seconds(this_run) < 600
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["elapsed_s"] == pytest.approx(3600.0 + summary["seconds"])
    assert "resuming with changed" not in proc.stderr
    # The same relative data path given again (in the run's directory) is no change of the saved one.
    proc = roundpipe(["train", "--resume", "--output-dir", "out", "--data", "notes.txt", "--steps", "5"], str(work))
    assert proc.returncode == 0 and "done: step 5/5" in proc.stdout, proc.stderr[-3000:]
    assert "resuming with changed steps:" in proc.stderr, proc.stderr[-3000:]


def test_loss_plot_shows_whole_steps() -> None:
    from roundpipe.cli.metrics import metrics_figure

    for n in (2, 3, 7, 250):
        rows = [{"step": float(s), "loss": 2.0 / s, "lr": 1e-3} for s in range(1, n + 1)]
        fig = metrics_figure(rows)
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (n, ticks)
        import matplotlib.pyplot as plt

        plt.close(fig)


@pytest.mark.timeout(300)
def test_unknown_or_unsupported_model_type_is_one_short_line(tmp_path) -> None:
    """A model_type transformers does not know, and one it knows but RoundPipe has no preset for (GPT-2):
    one line each, short enough for a terminal line or two (not transformers' paragraphs of advice, not
    the list of every supported type)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from .local_model import word_tokenizer

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "qwen9", "hidden_size": 8}))
    (unknown / "tokenizer.json").write_text("{}")
    gpt2 = str(tmp_path / "gpt2")
    tokenizer = word_tokenizer()
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=len(tokenizer), **ids)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    data = tmp_path / "d.txt"
    data.write_text("hello hi please thanks " * 20)
    for model, fragments in (
        (str(unknown), [f"the model type 'qwen9' of {unknown} is unknown to transformers ", "pip install -U"]),
        (gpt2, ["not supported by RoundPipe (GPT2LMHeadModel: no RoundPipe sequential preset (model_type='gpt2'))"]),
    ):
        args = ["train", "--model", model, "--data", str(data), "--seq-len", "8", "--output-dir", str(tmp_path / "out")]
        line = one_line_error(roundpipe(args, str(tmp_path)), *fragments)
        # Short beside the path it names (a test's temporary directory is longer under some runners).
        assert len(line.replace(str(tmp_path), "<tmp>")) < 240 and "'llama'" not in line, line
