"""Where ``roundpipe train`` keeps its checkpoints, and which one a resume takes.

A checkpoint is a directory ``<output_dir>/checkpoints/step-<N>`` written in three moves (the mechanics
are ``roundpipe.checkpoint``'s, shared with the Python loop's ``roundpipe.save``):

1. every file goes into ``step-<N>.tmp`` (a crash here leaves the previous checkpoints untouched);
2. ``manifest.json`` lists each file with its size and sha256, then everything is fsync'ed;
3. the directory is renamed to ``step-<N>`` (atomic on POSIX) and ``latest`` is replaced atomically.

Only then are checkpoints beyond ``keep`` deleted. Re-saving a step that exists (a run resumed
before it) moves the old copy to ``step-<N>.old`` first and deletes it only once the new one is in
place; a crash between the two moves leaves ``step-<N>.old`` as that step's only copy, and it is
found, listed and kept as such. Loading verifies the manifest first, so a partial or corrupted
checkpoint is reported as such (with what to do) instead of failing somewhere in ``torch.load`` or,
worse, resuming from wrong weights.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Dict, List, Optional

from roundpipe.checkpoint import (
    MANIFEST,
    OLD_SUFFIX,
    CheckpointError,
    fsync_path,
    load_tensors,
    load_torch,
    save_tensors,
    save_torch,
    sha256_file,
    share_like_other_files,
    verify,
    write_atomically,
)
from roundpipe.cli.config import ConfigError

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def save_checkpoint(
    output_dir: str, step: int, write: Callable[[str], None], keep: int, meta: Optional[Dict[str, object]] = None
) -> str:
    """Write a checkpoint atomically; returns its directory.

    Args:
        write: Called with the (temporary) directory to fill.
        keep: Checkpoints to keep, this one included; older ones are deleted afterwards.
        meta: Small JSON-able facts stored in the manifest (step, loss, ...).
    """
    root = checkpoints_dir(output_dir)
    os.makedirs(root, exist_ok=True)
    final = write_atomically(os.path.join(root, step_dir_name(step)), write, {"step": step, **(meta or {})})
    _point_latest(root, os.path.basename(final))
    fsync_path(root)
    prune(root, keep)
    return final


def _point_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def list_checkpoints(root: str) -> List[str]:
    """Complete-looking checkpoint directories (with a manifest), oldest first: ``step-N``, or
    ``step-N.old`` where a re-save of step N stopped after moving the old copy aside."""
    if not os.path.isdir(root):
        return []
    found: Dict[int, str] = {}
    for name in os.listdir(root):
        m = _STEP_DIR.match(name[: -len(OLD_SUFFIX)] if name.endswith(OLD_SUFFIX) else name)
        path = os.path.join(root, name)
        if m and _complete(path) and (not name.endswith(OLD_SUFFIX) or int(m.group(1)) not in found):
            found[int(m.group(1))] = path  # step-N wins over step-N.old
    return [found[step] for step in sorted(found)]


def prune(root: str, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints, and leftovers of interrupted saves (a
    ``step-N.old`` only once ``step-N`` is complete: until then it is step N's only copy)."""
    kept = list_checkpoints(root)
    for path in kept[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    kept = kept[-keep:]
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith((".tmp", OLD_SUFFIX)) and os.path.isdir(path) and path not in kept:
            shutil.rmtree(path, ignore_errors=True)


RESUME_HINT = "train first, or pass a checkpoint directory (…/checkpoints/step-N) to --resume"


def resolve_checkpoint(ref: str, output_dir: str, hint: str = RESUME_HINT) -> str:
    """The checkpoint directory ``ref`` names: a checkpoint, a run's output dir, or 'latest'.
    ``hint``: the fix the error names when there is none (the caller's flag or command)."""
    if ref == "latest":
        ref = output_dir
    if os.path.isfile(os.path.join(ref, MANIFEST)) or _STEP_DIR.match(os.path.basename(os.path.normpath(ref))):
        if not os.path.isdir(ref):
            raise ConfigError(
                f"checkpoint {ref!r} not found", "pass a checkpoint directory, a run's output_dir or 'latest'"
            )
        return ref
    for root in (checkpoints_dir(ref), ref):
        pointer = os.path.join(root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer) as f:
                path = os.path.join(root, f.read().strip())
            for candidate in (path, path + OLD_SUFFIX):  # .old: its re-save was interrupted
                if os.path.isdir(candidate) and (candidate == path or _complete(candidate)):
                    return candidate
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise ConfigError(f"{ref!r} does not exist" if not os.path.exists(ref) else f"no checkpoint found in {ref!r}", hint)


def resolve_intact(ref: str, output_dir: str, warn: Callable[[str], None], hint: str = RESUME_HINT) -> str:
    """The checkpoint a resume of ``ref`` takes (:func:`resolve_checkpoint`'s). Where ``ref`` names a
    run (its output dir, or 'latest') rather than one checkpoint, a damaged newest checkpoint (truncated,
    corrupt, incomplete) is reported through ``warn`` in one line that names it, and the newest intact one
    before it is taken: a crash or a full disk should cost the steps since that one, not the run. A checkpoint
    named explicitly is returned unverified (its damage is :func:`verify_checkpoint`'s error)."""
    path = resolve_checkpoint(ref, output_dir, hint)
    if ref != "latest" and os.path.abspath(path) == os.path.abspath(ref):
        return path  # named explicitly: verify_checkpoint reports its damage as an error
    damaged: List[CheckpointError] = []
    others = [
        p for p in reversed(list_checkpoints(os.path.dirname(path))) if os.path.abspath(p) != os.path.abspath(path)
    ]
    for candidate in [path, *others]:
        try:
            verify(candidate, cached=True)
        except CheckpointError as e:
            damaged.append(e)
            continue
        for e in damaged:
            warn(f"{e.what}: resuming from {candidate} instead")
        return candidate
    raise ConfigError(
        f"{damaged[0].what}, and no intact checkpoint is left before it",
        "start the run again without --resume (with --overwrite)",
    )


def verify_checkpoint(path: str) -> Dict[str, object]:
    """The manifest of a checkpoint whose files are all present and intact (``roundpipe.checkpoint.verify``);
    ConfigError otherwise. A checkpoint verified once is not hashed again by this process (unless its
    manifest changes)."""
    try:
        return verify(path, cached=True)
    except CheckpointError as e:
        raise ConfigError(e.what, e.fix) from None


__all__ = [
    "checkpoints_dir",
    "list_checkpoints",
    "load_tensors",
    "load_torch",
    "resolve_checkpoint",
    "resolve_intact",
    "save_checkpoint",
    "save_tensors",
    "save_torch",
    "sha256_file",
    "share_like_other_files",
    "verify_checkpoint",
]
