"""Atomic, verifiable checkpoint directories.

A checkpoint is a directory ``<output_dir>/checkpoints/step-<N>`` written in three moves:

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

import hashlib
import json
import os
import re
import shutil
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from roundpipe.cli.config import ConfigError

if TYPE_CHECKING:  # imported where used: `roundpipe export --help` must not wait for torch
    import torch

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OLD_SUFFIX = ".old"  # the previous copy of a step being re-saved
FORMAT_VERSION = 1


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root: str) -> List[str]:
    out = []
    for base, _, names in os.walk(root):
        for name in names:
            out.append(os.path.relpath(os.path.join(base, name), root))
    return sorted(out)


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
    final = os.path.join(root, step_dir_name(step))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    files = {}
    for rel in _files(tmp):
        path = os.path.join(tmp, rel)
        _fsync(path)
        files[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files, **(meta or {})}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for base, dirs, _ in os.walk(tmp):
        for d in dirs:
            _fsync(os.path.join(base, d))
    _fsync(tmp)
    if os.path.exists(final):  # re-saving a step (e.g. after a resume): swap the old one out last
        old = final + _OLD_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _point_latest(root, os.path.basename(final))
    _fsync(root)
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
        m = _STEP_DIR.match(name[: -len(_OLD_SUFFIX)] if name.endswith(_OLD_SUFFIX) else name)
        path = os.path.join(root, name)
        if m and _complete(path) and (not name.endswith(_OLD_SUFFIX) or int(m.group(1)) not in found):
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
        if name.endswith((".tmp", _OLD_SUFFIX)) and os.path.isdir(path) and path not in kept:
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
            for candidate in (path, path + _OLD_SUFFIX):  # .old: its re-save was interrupted
                if os.path.isdir(candidate) and (candidate == path or _complete(candidate)):
                    return candidate
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise ConfigError(f"{ref!r} does not exist" if not os.path.exists(ref) else f"no checkpoint found in {ref!r}", hint)


_verified: Dict[Tuple[str, float], Dict[str, object]] = {}


def verify_checkpoint(path: str) -> Dict[str, object]:
    """The manifest of a checkpoint whose files are all present and intact; ConfigError otherwise.

    Hashing a large checkpoint takes a while, so a checkpoint verified once is not hashed again by
    this process (unless its manifest changes).
    """
    manifest_path = os.path.join(path, MANIFEST)
    key = (os.path.abspath(path), os.path.getmtime(manifest_path) if os.path.isfile(manifest_path) else -1.0)
    if key in _verified:
        return _verified[key]
    if not os.path.isfile(manifest_path):
        raise ConfigError(
            f"checkpoint {path} is incomplete (no {MANIFEST}: its save was interrupted)",
            "delete it and resume from an earlier checkpoint",
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(
            f"checkpoint {path} has a damaged {MANIFEST}", "delete it and resume from an earlier checkpoint"
        ) from None
    for rel, info in files.items():
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise ConfigError(f"checkpoint {path} is missing {rel}", "delete it and resume from an earlier checkpoint")
        if os.path.getsize(fpath) != info["bytes"] or sha256_file(fpath) != info["sha256"]:
            raise ConfigError(
                f"checkpoint {path} is corrupt: {rel} does not match its sha256 in {MANIFEST}",
                "delete it and resume from an earlier checkpoint",
            )
    _verified[key] = manifest
    return manifest


def save_torch(obj: object, path: str) -> None:
    """``torch.save`` (the state files of a checkpoint)."""
    import torch

    torch.save(obj, path)


def load_torch(path: str) -> object:
    """``torch.load`` of a file :func:`save_torch` wrote (host tensors, ``weights_only``)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def current_umask() -> int:
    """This process's umask: from ``/proc/self/status`` where the kernel tells it, else by setting and
    restoring it (a moment in which another thread's new file would get the same mask anyway)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_other_files(*roots: str) -> None:
    """Give the files under ``roots`` (files or directories) the permissions ``open()`` gives a new file,
    ``0o666 & ~umask``: safetensors writes its files 0600 (a private temporary file renamed into place),
    which would keep an exported model or a checkpoint from other users and containers."""
    mode = 0o666 & ~current_umask()
    for root in roots:
        paths = [root] if os.path.isfile(root) else [os.path.join(b, n) for b, _, names in os.walk(root) for n in names]
        for path in paths:
            if not os.path.islink(path):
                os.chmod(path, mode)


def save_tensors(tensors: Dict[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors file of ``tensors`` (host tensors; no two may share storage: pass tied weights once),
    with the permissions of the run's other files (:func:`share_like_other_files`)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    share_like_other_files(path)


def load_tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


__all__ = [
    "checkpoints_dir",
    "list_checkpoints",
    "load_tensors",
    "load_torch",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_tensors",
    "share_like_other_files",
    "verify_checkpoint",
]
