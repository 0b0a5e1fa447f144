"""Checkpoint directories written atomically and verified on load, and the Python loop's save and resume.

A checkpoint directory is written in three moves: every file goes into ``<path>.tmp`` (a crash leaves an
earlier copy untouched); ``manifest.json`` lists each file with its size and sha256 and everything is
fsync'ed; the directory is renamed to ``<path>`` (atomic on POSIX). Loading verifies the manifest first, so
a partial or corrupt checkpoint is reported as such instead of resuming from wrong weights.
``roundpipe train`` lays its checkpoints out on these mechanics (``roundpipe.cli.checkpoint``).

:func:`save` / :func:`load` are the Python loop's pair: the weights the devices compute with, the optimizer
copies (masters), the optimizer state, the RNG states and the caller's own values (step, scheduler). With
asynchronous steps the weights are one step older than the masters; saving both is what lets a resumed
loop repeat the uninterrupted one exactly. Nothing here imports torch until it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

if TYPE_CHECKING:
    import torch

    from roundpipe.base import RoundPipeBase

MANIFEST = "manifest.json"
OLD_SUFFIX = ".old"  # the previous copy of a checkpoint being re-saved
FORMAT_VERSION = 1
_WEIGHTS, _MASTERS, _OPTIMIZER, _EXTRA = "weights.safetensors", "masters.safetensors", "optimizer.pt", "extra.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: ``what`` is wrong with it and ``fix`` says what to do."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} — {fix}")
        self.what, self.fix = what, fix


# ---- files -----------------------------------------------------------------------------------------
def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str) -> None:
    """fsync a file or a directory (so that a rename into it survives a crash)."""
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


def write_atomically(final: str, write: Callable[[str], None], meta: Optional[Dict[str, object]] = None) -> str:
    """Write checkpoint directory ``final`` atomically (the module docstring's three moves); returns it.

    Args:
        write: Called with the (temporary) directory to fill.
        meta: Small JSON-able facts stored in the manifest (step, loss, ...).
    """
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    files = {}
    for rel in _files(tmp):
        path = os.path.join(tmp, rel)
        fsync_path(path)
        files[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    manifest = {"format": FORMAT_VERSION, "files": files, **(meta or {})}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for base, dirs, _ in os.walk(tmp):
        for d in dirs:
            fsync_path(os.path.join(base, d))
    fsync_path(tmp)
    if os.path.exists(final):  # re-saving: swap the old copy out last
        old = final + OLD_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    return final


_verified: Dict[Any, Dict[str, object]] = {}


def verify(
    path: str, fix: str = "delete it and resume from an earlier checkpoint", cached: bool = False
) -> Dict[str, object]:
    """The manifest of a checkpoint whose files are all present and intact; :class:`CheckpointError`
    (naming ``fix``) otherwise. With ``cached``, a checkpoint verified once is not hashed again by this
    process (unless its manifest changes): hashing a large one takes a while, and a run reads it twice."""
    manifest_path = os.path.join(path, MANIFEST)
    key = (os.path.abspath(path), os.path.getmtime(manifest_path) if os.path.isfile(manifest_path) else -1.0)
    if cached and key in _verified:
        return _verified[key]
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MANIFEST}: its save was interrupted)", fix)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path} has a damaged {MANIFEST}", fix) from None
    for rel, info in files.items():
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {path} is missing {rel}", fix)
        if os.path.getsize(fpath) != info["bytes"] or sha256_file(fpath) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} does not match its sha256 in {MANIFEST}", fix)
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


# ---- RNG states ------------------------------------------------------------------------------------
def rng_state() -> Dict[str, Any]:
    """This process's torch, Python, NumPy (and CUDA) RNG states, loadable with ``weights_only``."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the Python loop's pair ------------------------------------------------------------------------
def _model_tensors(model: RoundPipeBase) -> Dict[str, torch.Tensor]:
    """The wrapped model's parameters (as the devices compute with them: one step behind the masters after
    an asynchronous step) and buffers, by name, each shared tensor once. A frozen weight in a packed format
    (``roundpipe.host.formats``) is saved as it is held, its packed tensors as ``packed:<name>/<part>``:
    the checkpoint is as small as the host copy, and loading restores it bit for bit without a re-quantize."""
    from roundpipe.utils import packed_parts

    out: Dict[str, torch.Tensor] = {}
    for n, p in model.model.named_parameters():
        packed = packed_parts(p)
        if packed is not None:
            out.update({f"packed:{n}/{k}": v for k, v in packed.items()})
        else:
            out[f"param:{n}"] = p.detach()
    out.update({f"buffer:{n}": b.detach() for n, b in model.model.named_buffers()})
    return out


def _check_pair(model: Any, optimizer: Any, what: str) -> None:
    from roundpipe.base import RoundPipeBase

    if not isinstance(model, RoundPipeBase):
        raise TypeError(f"roundpipe.{what}: model must be a RoundPipe or AutoRoundPipe, not {type(model).__name__}")
    if not (callable(getattr(optimizer, "state_dict", None)) and callable(getattr(optimizer, "load_state_dict", None))):
        raise TypeError(
            f"roundpipe.{what}: optimizer must be the optimizer built on model.optim_parameters() "
            f"(it has state_dict/load_state_dict), not {type(optimizer).__name__}"
        )


def save(model: RoundPipeBase, optimizer: Any, path: str, *, scheduler: Any = None, **extra: Any) -> str:
    """Save a Python training loop to directory ``path`` (written atomically, with checksums); returns it.

    Waits for the optimizer step in flight (``model.wait_optimizer()``: the weights stay as they are, so
    the run goes on exactly as if nothing had waited), then writes the model's weights, its optimizer
    copies, ``optimizer.state_dict()``, ``scheduler.state_dict()`` (read after the wait: a scheduler
    stepped inside the step function changes until then), the RNG states and ``extra``: values of the
    main thread (a step count, a data position) that ``torch.load(weights_only=True)`` reads back.
    :func:`load` restores them.
    """
    _check_pair(model, optimizer, "save")
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(f"roundpipe.save: scheduler has no state_dict(): {type(scheduler).__name__}")
    model.wait_optimizer()

    def write(d: str) -> None:
        save_tensors(_model_tensors(model), os.path.join(d, _WEIGHTS))
        save_tensors(model.optim_param_state_dict(), os.path.join(d, _MASTERS))
        save_torch(optimizer.state_dict(), os.path.join(d, _OPTIMIZER))
        sched = scheduler.state_dict() if scheduler is not None else None
        save_torch({"extra": extra, "scheduler": sched, "rng": rng_state()}, os.path.join(d, _EXTRA))

    return write_atomically(os.path.abspath(path), write, {"kind": "roundpipe.save"})


def load(model: RoundPipeBase, optimizer: Any, path: str, *, scheduler: Any = None) -> Dict[str, Any]:
    """Restore what :func:`save` wrote into ``model``, ``optimizer`` (built as for the saved run, the
    optimizer on ``model.optim_parameters()``), ``scheduler`` and the RNG states; returns the ``extra``
    values given to ``save``. The next ``forward_backward`` and ``step`` continue the saved run exactly."""
    import torch

    _check_pair(model, optimizer, "load")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist", "pass the directory roundpipe.save wrote")
    verify(path, "save again, or load an earlier checkpoint")
    model.wait_optimizer()
    saved = load_tensors(os.path.join(path, _WEIGHTS))
    masters = load_tensors(os.path.join(path, _MASTERS))
    own = _model_tensors(model)
    optim_own = dict(model.optim_named_parameters())
    rest: Any = load_torch(os.path.join(path, _EXTRA))
    if set(saved) != set(own) or set(masters) != set(optim_own):
        lacks = sorted((set(own) - set(saved)) | (set(optim_own) - set(masters)))[:3]
        extra_names = sorted((set(saved) - set(own)) | (set(masters) - set(optim_own)))[:3]
        raise CheckpointError(
            f"checkpoint {path} was saved for another model (it lacks {lacks} of this one and holds {extra_names})",
            "build the model as the saved run did (same layers, same trainable parameters, same base_format)",
        )
    files, ours = {**saved, **masters}, {**own, **optim_own}  # the two name spaces do not overlap
    resized = [n for n in ours if files[n].shape != ours[n].shape]
    if resized:
        n = resized[0]
        raise CheckpointError(
            f"checkpoint {path} holds {n} as {tuple(files[n].shape)}, this model as {tuple(ours[n].shape)}",
            "build the model with the sizes of the saved run",
        )
    recast = [n for n in ours if n.startswith("packed:") and files[n].dtype != ours[n].dtype]
    if recast:  # fp8 and int8 share part names and shapes: the dtype tells them apart
        n = recast[0]
        raise CheckpointError(
            f"checkpoint {path} holds the packed {n} as {files[n].dtype}, this model as {ours[n].dtype}",
            "build the model with the base_format of the saved run",
        )
    if (scheduler is None) != (rest["scheduler"] is None):
        raise CheckpointError(
            f"checkpoint {path} was saved {'without' if rest['scheduler'] is None else 'with'} a scheduler",
            "pass scheduler= to both roundpipe.save and roundpipe.load, or to neither",
        )
    with torch.no_grad():  # nothing is changed until every check has passed
        for name, t in own.items():
            t.copy_(saved[name])
        for name, m in optim_own.items():
            m.copy_(masters[name])
    optimizer.load_state_dict(load_torch(os.path.join(path, _OPTIMIZER)))
    if scheduler is not None:
        scheduler.load_state_dict(rest["scheduler"])
    set_rng_state(rest["rng"])
    return dict(rest["extra"])


__all__ = [
    "CheckpointError",
    "load",
    "load_tensors",
    "load_torch",
    "rng_state",
    "save",
    "save_tensors",
    "save_torch",
    "set_rng_state",
    "share_like_other_files",
    "verify",
    "write_atomically",
]
