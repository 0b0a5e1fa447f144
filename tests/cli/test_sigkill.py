"""A process killed (SIGKILL) in the middle of writing a checkpoint loses nothing: the previous
checkpoint stays the latest and loadable, and resuming from it reproduces the uninterrupted run. A newest
checkpoint damaged afterwards (truncated) is reported in one line, and the resume takes the one before it.

Every run is a subprocess: a run in this process would choose devices and the compile switch for the
process (``roundpipe.configure``), and the test checks that nothing of the sort reaches later tests."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from helpers import ROOT, kill_when_written
from safetensors.torch import load_file

from roundpipe import settings
from roundpipe.cli.checkpoint import resolve_checkpoint

from .runner import roundpipe

ARGS = [
    "--steps",
    "6",
    "--save-every",
    "2",
    "--batch-size",
    "4",
    "--microbatches",
    "2",
    "--devices",
    "cpu:1",
    "--eval-examples",
    "4",
]

KILLED_RUN = textwrap.dedent(
    """
    import sys, time
    from roundpipe.cli import checkpoint as ckpt
    from roundpipe.cli import main

    marker, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    original = ckpt.save_checkpoint

    def save_then_hang(output_dir, step, write, keep, meta=None):
        def write_partly(tmp):
            write(tmp)
            if step == 4:  # files of step 4 are written, its manifest and rename are not
                open(marker, "w").close()
                time.sleep(120)
        return original(output_dir, step, write_partly, keep, meta)

    ckpt.save_checkpoint = save_then_hang
    sys.exit(main(["train", "--output-dir", out, *args]))
    """
)


@pytest.mark.timeout(240)
def test_sigkill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path) -> None:
    before = (dict(settings._overrides), {k: v for k, v in os.environ.items() if k.startswith("RPP_")})
    killed, full = str(tmp_path / "killed"), str(tmp_path / "full")
    marker = str(tmp_path / "writing")
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        RPP_PROGRESS="0",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    kill_when_written(["-c", KILLED_RUN, marker, killed, *ARGS], env, marker)

    latest = resolve_checkpoint("latest", killed)
    assert latest.endswith("step-0000002"), latest  # the half-written step 4 is not taken

    for args in (["--resume", "--output-dir", killed], ["--output-dir", full]):
        proc = roundpipe(["train", *args, *ARGS], str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(os.path.join(resolve_checkpoint("latest", killed), "model.safetensors"))
    b = load_file(os.path.join(resolve_checkpoint("latest", full), "model.safetensors"))
    assert resolve_checkpoint("latest", killed).endswith("step-0000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        dict(settings._overrides),
        {k: v for k, v in os.environ.items() if k.startswith("RPP_")},
    ) == before  # nothing leaks


@pytest.mark.timeout(240)
def test_resume_passes_over_a_truncated_newest_checkpoint(tmp_path) -> None:
    out = str(tmp_path / "run")
    proc = roundpipe(["train", "--output-dir", out, *ARGS], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    newest = resolve_checkpoint("latest", out)
    assert newest.endswith("step-0000006")
    # Copied out: load_file maps the file, and reading a mapping past the truncation is a bus error.
    want = {k: v.clone() for k, v in load_file(os.path.join(newest, "model.safetensors")).items()}
    with open(os.path.join(newest, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)

    proc = roundpipe(["train", "--resume", "--output-dir", out, *ARGS], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    told = [line for line in proc.stderr.splitlines() if "resuming from" in line]
    assert told == [
        f"roundpipe: WARNING: checkpoint {newest} is corrupt: model.safetensors does not match its sha256 in "
        f"manifest.json: resuming from {newest[: -len('6')]}4 instead"
    ], proc.stderr[-3000:]
    again = resolve_checkpoint("latest", out)
    assert again == newest  # steps 5 and 6 ran again, and step 6 was saved anew
    got = load_file(os.path.join(again, "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
