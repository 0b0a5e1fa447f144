"""Checkpoint directories: atomic replacement, manifest checks, 'latest', pruning."""

from __future__ import annotations

import os
import shutil

import pytest

from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli.config import ConfigError


def writer(payload: bytes):
    def write(d: str) -> None:
        os.makedirs(os.path.join(d, "sub"))
        with open(os.path.join(d, "weights.bin"), "wb") as f:
            f.write(payload)
        with open(os.path.join(d, "sub", "state.txt"), "w") as f:
            f.write("state")

    return write


def test_save_resolve_verify_prune(tmp_path) -> None:
    out = str(tmp_path)
    paths = [
        ckpt.save_checkpoint(out, step, writer(bytes([step]) * 100), keep=2, meta={"loss": 1.0 / step})
        for step in (1, 2, 3)
    ]
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(ckpt.checkpoints_dir(out))] == [
        "step-0000002",
        "step-0000003",
    ]
    assert not os.path.exists(paths[0])
    assert ckpt.resolve_checkpoint("latest", out) == paths[2] == ckpt.resolve_checkpoint(out, "elsewhere")
    assert ckpt.resolve_checkpoint(paths[1], out) == paths[1]
    manifest = ckpt.verify_checkpoint(paths[2])
    assert (
        manifest["step"] == 3
        and manifest["loss"] == 1 / 3
        and set(manifest["files"]) == {"weights.bin", os.path.join("sub", "state.txt")}
    )


def payload_of(path: str) -> bytes:
    """The ``weights.bin`` a checkpoint holds, after checking every file against its manifest."""
    ckpt.verify_checkpoint(path)
    with open(os.path.join(path, "weights.bin"), "rb") as f:
        return f.read()


def assert_only_complete_checkpoints(out: str) -> None:
    """What a later run sees: every checkpoint it lists verifies, and 'latest' is one of them."""
    listed = ckpt.list_checkpoints(ckpt.checkpoints_dir(out))
    assert listed and ckpt.resolve_checkpoint("latest", out) == listed[-1]
    for path in listed:
        ckpt.verify_checkpoint(path)


def test_interrupted_save_keeps_previous_checkpoint(tmp_path) -> None:
    out = str(tmp_path)
    good = ckpt.save_checkpoint(out, 1, writer(b"a" * 10), keep=3)

    def crash(d: str) -> None:
        writer(b"b" * 10)(d)
        raise KeyboardInterrupt  # killed half-way through writing

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(out, 2, crash, keep=3)
    assert ckpt.resolve_checkpoint("latest", out) == good and payload_of(good) == b"a" * 10
    assert_only_complete_checkpoints(out)
    ckpt.save_checkpoint(out, 2, writer(b"c" * 10), keep=3)  # the next save of that step works
    assert payload_of(ckpt.resolve_checkpoint("latest", out)) == b"c" * 10
    assert_only_complete_checkpoints(out)


def test_resave_of_a_step_replaces_it(tmp_path) -> None:
    """A run resumed before step 2 saves step 2 again: the new copy replaces the old one."""
    out = str(tmp_path)
    ckpt.save_checkpoint(out, 1, writer(b"1" * 10), keep=3)
    ckpt.save_checkpoint(out, 2, writer(b"old" * 10), keep=3)
    path = ckpt.save_checkpoint(out, 2, writer(b"new" * 10), keep=3)
    assert ckpt.resolve_checkpoint("latest", out) == path and payload_of(path) == b"new" * 10
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(ckpt.checkpoints_dir(out))] == [
        "step-0000001",
        "step-0000002",
    ]
    assert sorted(os.listdir(ckpt.checkpoints_dir(out))) == ["latest", "step-0000001", "step-0000002"]


@pytest.mark.parametrize("crash_at", ["move old aside", "move new in", "delete old"])
def test_crash_during_resave_leaves_last_good_checkpoint_loadable(tmp_path, monkeypatch, crash_at: str) -> None:
    """A re-save of step 2 dies at each point of replacing the old step-2 directory: 'latest' must
    still give a complete step-2 checkpoint (the old or the new one, never step 1 or nothing), and
    the next save must work and leave only complete checkpoints."""
    out = str(tmp_path)
    ckpt.save_checkpoint(out, 1, writer(b"1" * 10), keep=3)
    ckpt.save_checkpoint(out, 2, writer(b"old" * 10), keep=3)
    renames = {"n": 0}
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(src: str, dst: str) -> None:
        renames["n"] += 1
        if (crash_at, renames["n"]) in (("move old aside", 1), ("move new in", 2)):
            raise KeyboardInterrupt  # the process dies before this move
        real_rename(src, dst)

    def rmtree(path: str, *args: object, **kwargs: object) -> None:
        if crash_at == "delete old" and path.endswith(".old") and os.path.isdir(path):
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(out, 2, writer(b"new" * 10), keep=3)
    monkeypatch.undo()
    latest = ckpt.resolve_checkpoint("latest", out)
    assert payload_of(latest) in (b"old" * 10, b"new" * 10), latest
    assert_only_complete_checkpoints(out)
    assert len(ckpt.list_checkpoints(ckpt.checkpoints_dir(out))) == 2  # step 1 and one copy of step 2
    ckpt.save_checkpoint(out, 3, writer(b"3" * 10), keep=2)  # the run goes on; leftovers are cleaned
    assert [payload_of(p) for p in ckpt.list_checkpoints(ckpt.checkpoints_dir(out))] == [payload_of(latest), b"3" * 10]
    root = ckpt.checkpoints_dir(out)
    assert set(os.listdir(root)) - {"latest"} == {
        os.path.basename(p) for p in ckpt.list_checkpoints(root)
    }  # no leftovers


def test_corrupt_or_partial_checkpoint_is_reported(tmp_path) -> None:
    path = ckpt.save_checkpoint(str(tmp_path), 5, writer(b"x" * 1000), keep=1)
    with open(os.path.join(path, "weights.bin"), "r+b") as f:
        f.seek(500)
        f.write(b"y")  # same size, different content
    with pytest.raises(ConfigError, match=r"corrupt: weights.bin does not match its sha256") as info:
        ckpt.verify_checkpoint(path)
    assert info.value.fix == "delete it and resume from an earlier checkpoint"
    os.remove(os.path.join(path, "weights.bin"))
    with pytest.raises(ConfigError, match="is missing weights.bin"):
        ckpt.verify_checkpoint(path)
    os.remove(os.path.join(path, ckpt.MANIFEST))
    with pytest.raises(ConfigError, match="is incomplete"):
        ckpt.verify_checkpoint(path)


def test_missing_checkpoint_is_a_user_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint found"):
        ckpt.resolve_checkpoint("latest", str(tmp_path))


def test_resume_passes_over_a_damaged_newest_checkpoint(tmp_path) -> None:
    """A truncated newest checkpoint is reported in one line naming it, and the newest intact one before it is
    taken; named explicitly, it is an error; with none intact left, an error that says what to do."""
    out = str(tmp_path)
    first, second, third = (ckpt.save_checkpoint(out, step, writer(bytes([step]) * 100), keep=3) for step in (1, 2, 3))
    with open(os.path.join(third, "weights.bin"), "r+b") as f:
        f.truncate(50)
    warnings: list = []
    assert ckpt.resolve_intact("latest", out, warnings.append) == second
    assert ckpt.resolve_intact(out, "elsewhere", warnings.append) == second
    assert (
        warnings
        == [
            f"checkpoint {third} is corrupt: weights.bin does not match its sha256 in manifest.json: "
            f"resuming from {second} instead"
        ]
        * 2
    )
    assert ckpt.resolve_intact(third, out, warnings.append) == third  # named: its damage is an error of its own
    with pytest.raises(ConfigError, match="corrupt: weights.bin"):
        ckpt.verify_checkpoint(third)
    assert ckpt.resolve_intact(first, out, warnings.append) == first and len(warnings) == 2

    os.remove(os.path.join(second, ckpt.MANIFEST))  # an interrupted save: not listed at all
    warnings.clear()
    assert ckpt.resolve_intact("latest", out, warnings.append) == first
    assert warnings == [
        f"checkpoint {third} is corrupt: weights.bin does not match its sha256 in manifest.json: "
        f"resuming from {first} instead"
    ]
    only = ckpt.save_checkpoint(str(tmp_path / "other"), 1, writer(b"x" * 100), keep=3)
    with open(os.path.join(only, "sub", "state.txt"), "w") as f:
        f.write("stale")
    with pytest.raises(ConfigError, match="no intact checkpoint is left before it") as info:
        ckpt.resolve_intact("latest", str(tmp_path / "other"), warnings.append)
    assert info.value.fix == "start the run again without --resume (with --overwrite)"
