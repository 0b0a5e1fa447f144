"""A ``roundpipe train`` config as a run writes it: ``config.yaml`` next to its metrics and in every checkpoint,
with absolute paths (so ``--resume`` from another directory finds the data and the model), and the YAML that
``--print-config`` prints. Reading it back is ``roundpipe.cli.config.from_yaml_text``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from roundpipe.cli.config import TrainConfig


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its relative paths (data, output_dir, resume, a model directory) made absolute, as a run
    saves it: resuming from another working directory then finds the run's data and model."""
    from roundpipe.cli.model_names import BUILTIN_MODELS

    def absolute(path: Any) -> Any:
        return path if path is None or path == "latest" else os.path.abspath(path)

    model = cfg.model if cfg.model in BUILTIN_MODELS else absolute(cfg.model)
    paths = dict(data=absolute(cfg.data), output_dir=absolute(cfg.output_dir), resume=absolute(cfg.resume), model=model)
    return dataclasses.replace(cfg, **paths)


def to_yaml(cfg: TrainConfig, saved: bool = False) -> str:
    """The config as YAML (``config.yaml`` of runs and checkpoints, ``--print-config``). ``task`` is
    left out when a data file replaces it, so the file can be passed to ``--config`` again. ``saved``: a
    run's own copy, whose paths are absolute (:func:`with_absolute_paths`)."""
    import yaml

    values = (with_absolute_paths(cfg) if saved else cfg).to_dict()
    if cfg.data is not None:
        values.pop("task")
    return yaml.safe_dump(values, sort_keys=False)
