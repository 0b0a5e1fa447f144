"""Checkpoint directories: atomic replacement, manifest checks, 'latest', pruning."""

from __future__ import annotations

import os

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
    paths = [ckpt.save_checkpoint(out, step, writer(bytes([step]) * 100), keep=2, meta={"loss": 1.0 / step}) for step in (1, 2, 3)]
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(ckpt.checkpoints_dir(out))] == ["step-0000002", "step-0000003"]
    assert not os.path.exists(paths[0])
    assert ckpt.resolve_checkpoint("latest", out) == paths[2] == ckpt.resolve_checkpoint(out, "elsewhere")
    assert ckpt.resolve_checkpoint(paths[1], out) == paths[1]
    manifest = ckpt.verify_checkpoint(paths[2])
    assert manifest["step"] == 3 and manifest["loss"] == 1 / 3 and set(manifest["files"]) == {"weights.bin", os.path.join("sub", "state.txt")}


def test_interrupted_save_keeps_previous_checkpoint(tmp_path) -> None:
    out = str(tmp_path)
    good = ckpt.save_checkpoint(out, 1, writer(b"a" * 10), keep=3)

    def crash(d: str) -> None:
        writer(b"b" * 10)(d)
        raise KeyboardInterrupt  # killed half-way through writing

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(out, 2, crash, keep=3)
    assert ckpt.resolve_checkpoint("latest", out) == good
    ckpt.verify_checkpoint(good)
    assert os.path.isdir(os.path.join(ckpt.checkpoints_dir(out), "step-0000002.tmp"))
    ckpt.save_checkpoint(out, 2, writer(b"c" * 10), keep=3)  # the next save cleans the leftover up
    assert not os.path.exists(os.path.join(ckpt.checkpoints_dir(out), "step-0000002.tmp"))


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
