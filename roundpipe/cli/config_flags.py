"""The command line and YAML file of ``roundpipe train``, read into a :class:`~roundpipe.cli.config.TrainConfig`.

One flag per config key (``lora_r`` <-> ``--lora-r``), a YAML file (``--config``) under the flags, and the
flags that are not config keys (``--print-config``, ``--overwrite``, ``--version``). A misspelt key or flag
gets "did you mean", also for the names other trainers use (``learning_rate`` -> ``lr``). The record itself,
its defaults, types and checks are :mod:`roundpipe.cli.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from typing import Any, Dict, List, NamedTuple, Sequence

from roundpipe.cli.config import FIELDS, TASK_PROFILE, ConfigError, TrainConfig, base_type, merge, version

#: Names other trainers (Hugging Face Trainer, torchtune) use for our keys, for "did you mean".
ALIASES = {
    "learning_rate": "lr",
    "max_steps": "steps",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum",
    "per_device_train_batch_size": "batch_size",
    "max_seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "model_name_or_path": "model",
    "warmup": "warmup_steps",
    "lora_rank": "lora_r",
    "target_modules": "lora_targets",
    "max_grad_norm": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "dataset": "data",
    "output": "output_dir",
    "resume_from_checkpoint": "resume",
    "num_microbatch": "microbatches",
}


def _closest(name: str) -> str:
    import difflib

    candidates = {**{k: k for k in FIELDS}, **ALIASES}
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return f"did you mean '{candidates[match[0]]}'?" if match else "see 'roundpipe train --help' for the keys"


def load_yaml(path: str) -> Dict[str, Any]:
    """Keys of a YAML config file (flat mapping; ``-`` or ``_`` in keys both work)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found", "pass an existing YAML file to --config")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(
            f"config file {path!r} is not valid YAML{where}", "fix the syntax; keys are 'name: value' lines"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} is not a mapping", "write one 'key: value' per line")
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"unknown config key '{key}' in {path}", _closest(name))
        out[name] = value
    return out


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a :class:`ConfigError` (one line, no usage dump)."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments: --"):
            flag = message.split()[2]
            hint = _closest(flag[2:].split("=")[0].replace("-", "_"))
            if hint.startswith("did you mean"):
                key = hint.split("'")[1]
                raise ConfigError(f"unknown flag {flag}", f"did you mean --{key.replace('_', '-')}?")
        raise ConfigError(message, f"see '{self.prog} --help'")


def add_config_flag(group: Any, name: str, **kw: Any) -> None:
    """Add config key ``name``'s flag to ``group`` (a parser or an argument group) as ``roundpipe train`` has it:
    its spelling, action and help, one definition for train and the commands that take the same flag
    (``roundpipe plan --fp8``). ``kw`` goes to ``add_argument`` (a ``default``, where the parser does not
    suppress its defaults as train's does)."""
    f = FIELDS[name]
    flag = "--" + name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_ = f.metadata["help"]
    help_ = help_ if "default" in help_ or default is None else f"{help_} (default: {default})"
    kw["help"] = help_.replace("%", "%%")
    kind = base_type(name)
    if kind is bool:
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, **kw)
    elif kind is list:
        group.add_argument(flag, dest=name, nargs="+", metavar="X", **kw)
    elif name == "resume":
        group.add_argument(flag, dest=name, nargs="?", const="latest", metavar="CKPT", **kw)
    else:
        group.add_argument(flag, dest=name, metavar=name.upper(), **kw)


def build_parser() -> argparse.ArgumentParser:
    """Flags for every config key; defaults are SUPPRESSed so only flags given on the command line
    override the YAML file."""
    parser = _ArgumentParser(
        prog="roundpipe train",
        description=(
            "Train or fine-tune a causal LM with RoundPipe (layers streamed to a pool of GPUs or CPU workers). "
            "Without --data, the built-in task's profile changes some defaults "
            f"({', '.join(f'{k}={v}' for k, v in TASK_PROFILE.items())}); "
            "--print-config shows what a run will use."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file with config keys (flags override it)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the config a run would use (defaults resolved) as YAML and exit",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an output_dir that holds an earlier run, deleting that run's files first (without it "
        "such a directory is refused unless --resume)",
    )
    parser.add_argument("--version", action="version", version=f"roundpipe {version()}")
    groups = {
        "model": parser.add_argument_group("model"),
        "data": parser.add_argument_group("data"),
        "lora": parser.add_argument_group("LoRA"),
        "optim": parser.add_argument_group("optimization"),
        "run": parser.add_argument_group("run and output"),
    }
    for name, f in FIELDS.items():
        add_config_flag(groups[f.metadata["group"]], name)
    return parser


class TrainArgs(NamedTuple):
    """What ``roundpipe train``'s command line asks for."""

    cfg: TrainConfig
    print_config: bool
    given: Dict[str, Any]
    """The keys set explicitly (YAML or flags): they override a checkpoint's config on resume."""
    overwrite: bool


#: A negative number, scientific notation included (argparse alone reads ``-1e-3`` as an option).
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _join_negative_values(argv: Sequence[str]) -> List[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3`` for flags that take one value, so that the value reaches
    validation (``lr=-0.001 must be positive``) instead of failing as 'expected one argument'."""
    out: List[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        name = prev[2:].replace("-", "_")
        if (
            prev.startswith("--")
            and "=" not in prev
            and name in FIELDS
            and base_type(name) not in (bool, list)
            and _NEGATIVE_NUMBER.match(arg)
        ):
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


def parse_train_args(argv: Sequence[str]) -> TrainArgs:
    """The config from command-line arguments and the YAML file they name, and the flags that are
    not config keys (see :class:`TrainArgs`)."""
    ns = vars(build_parser().parse_args(_join_negative_values(argv)))
    file_keys = load_yaml(ns.pop("config")) if "config" in ns else {}
    print_config = bool(ns.pop("print_config", False))
    overwrite = bool(ns.pop("overwrite", False))
    given = {**file_keys, **ns}
    return TrainArgs(merge(file_keys, ns), print_config, given, overwrite)
