"""The output directory of a ``roundpipe train`` run: checked before anything loads, cleared on request.

A run owns these entries of its ``output_dir``: ``config.yaml``, ``metrics.csv``, ``summary.json``,
``loss.png``, ``checkpoints/`` and ``tensorboard/``. A new run (no ``--resume``) into a directory that
holds an earlier run's entries would mix the two (metrics overwritten, the new run's checkpoints pruned
against the old ones, ``export`` picking the old weights), so it is refused unless ``--overwrite``
asks to delete them first. Other files in the directory are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import List

from roundpipe.cli.config import ConfigError, TrainConfig

RUN_FILES = ("config.yaml", "metrics.csv", "summary.json", "loss.png")
RUN_DIRS = ("checkpoints", "tensorboard")


def earlier_run(output_dir: str) -> List[str]:
    """The entries of an earlier run in ``output_dir`` (empty when there are none)."""
    if not os.path.isdir(output_dir):
        return []
    return [name for name in RUN_FILES + RUN_DIRS if os.path.lexists(os.path.join(output_dir, name))]


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """Before the model loads: ``output_dir`` can be written, and holds no earlier run unless the
    run continues it (``resume``) or replaces it (``overwrite``). Leaves the filesystem as it was."""
    found = earlier_run(output_dir)
    if found and not resume and not overwrite:
        raise ConfigError(
            f"output_dir {output_dir} already holds a run ({', '.join(found)})",
            "continue it with --resume, replace it with --overwrite (deletes those files first), or pick "
            "another --output-dir",
        )
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"output_dir {output_dir} is a file", "pick a directory for --output-dir")
    # Create it and a file in it, as the run will: only trying tells (permissions, read-only mounts,
    # a file in the path); what this creates is removed again, the run creates it when it starts.
    created = os.path.abspath(output_dir)
    while not os.path.lexists(os.path.dirname(created)):
        created = os.path.dirname(created)
    created = created if not os.path.lexists(created) else ""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(f"cannot write to output_dir {output_dir} ({why})", "pick a writable --output-dir") from None
    finally:
        if created and os.path.isdir(created):
            shutil.rmtree(created, ignore_errors=True)


def check_flags(cfg: TrainConfig, overwrite: bool) -> None:
    """``--overwrite`` and ``--resume`` exclude each other."""
    if overwrite and cfg.resume is not None:
        fix = "pass --resume to continue the run in output_dir, or --overwrite to replace it"
        raise ConfigError("--overwrite and --resume are both given", fix)


def check_before_loading(cfg: TrainConfig, overwrite: bool) -> None:
    """The checks of a run that need no model, made right after the flags are parsed, before torch and
    transformers load (a mistake answers in a fraction of a second): the flags, and the output
    directory of a new run (:func:`check_output_dir`), or that a resumed run has a checkpoint to resume
    (found, not yet verified). A resumed run's directory is checked once its checkpoint's config is read; so
    is every directory of a torchrun job, by rank 0 alone."""
    check_flags(cfg, overwrite)
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return
    if cfg.resume is None:
        check_output_dir(cfg.output_dir, False, overwrite)
    else:
        from roundpipe.cli.checkpoint import resolve_checkpoint  # no torch: a missing checkpoint answers at once

        resolve_checkpoint(cfg.resume, cfg.output_dir)


def clear_earlier_run(output_dir: str) -> List[str]:
    """Delete an earlier run's entries from ``output_dir`` (``--overwrite``); returns their names."""
    found = earlier_run(output_dir)
    for name in found:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return found


__all__ = [
    "RUN_DIRS",
    "RUN_FILES",
    "check_before_loading",
    "check_flags",
    "check_output_dir",
    "clear_earlier_run",
    "earlier_run",
]
