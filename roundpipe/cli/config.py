"""Configuration of ``roundpipe train``: one flat dataclass, filled from defaults, a YAML file and flags.

Precedence, lowest first: the defaults below, the built-in task profile (only when no ``data`` file is
given: a from-scratch run wants other hyper-parameters than a fine-tune), the YAML file (``--config``),
then command-line flags. Every key of :class:`TrainConfig` is both a YAML key and a flag
(``lora_r`` <-> ``--lora-r``), so a run's ``config.yaml`` (written next to its checkpoints) reproduces it.

User mistakes raise :class:`ConfigError`, which the CLI prints as one line and exit status 2. The flags and
the YAML file are read by :mod:`roundpipe.cli.config_flags`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from roundpipe.settings import STAGE_INPUT_MODES as STAGE_INPUTS  # the stage-input modes (settings imports no torch)
from roundpipe.utils import BASE_FORMATS

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Short names of the dtypes, accepted wherever a dtype is (``--dtype bf16`` is ``--dtype bfloat16``).
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}
PLANS = ("auto", "layerwise", "single")
OPTIM_STATES = ("float32", "bfloat16", "int8")
MASTERS = ("float32", "bfloat16")
MASTER_ROUNDINGS = ("stochastic", "kahan", "nearest")


def normalize_dtype(value: str) -> str:
    """The canonical name of a dtype value: ``bf16`` / ``torch.bfloat16`` -> ``bfloat16``; anything else as
    given (validation names the choices)."""
    name = str(value).strip().lower()
    name = name[len("torch.") :] if name.startswith("torch.") else name
    return DTYPE_ALIASES.get(name, name)


#: The keys that hold a dtype name (aliases accepted).
DTYPE_KEYS = ("dtype", "optim_state", "master")


class ConfigError(Exception):
    """A user error: printed as ``roundpipe: error: <what> — <fix>`` with no traceback."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} — {fix}")
        self.what, self.fix = what, fix


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - argparse's name
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Everything a training run needs; the field comments double as ``--help``."""

    # model
    model: str = _f(
        "tiny", "local Hugging Face model directory, or a built-in architecture name (random init)", group="model"
    )
    dtype: str = _f(
        "auto",
        "float32, bfloat16 or float16: the weights the devices compute with; optimizer masters stay fp32 "
        "(auto: the model's own; float32 for 'tiny')",
        group="model",
    )
    rope_scaling: Optional[str] = _f(
        None,
        "stretch the rotary positions past the model's limit: yarn:F, linear:F, dynamic:F, llama3:F or none "
        "(default: the model's own config; docs/long-context.md)",
        group="model",
    )
    base_format: str = _f(
        "bf16",
        "how the frozen base weights of a LoRA run are kept in host memory: bf16, fp8, int8 or nf4 (read layer by "
        "layer into that format; anything but bf16 needs --lora-r)",
        group="model",
    )
    fp8: bool = _f(
        False,
        "FP8 GEMMs in the decoder layers' projections (GPUs of compute capability 8.9+): over a base kept with "
        "--base-format fp8 (LoRA), or torchao's float8 recipe for a full fine-tune (docs/training.md)",
        group="model",
    )
    # data
    data: Optional[str] = _f(
        None, "training data: .txt, .jsonl or .parquet file (default: the built-in task)", group="data"
    )
    task: str = _f(
        "reverse",
        "built-in synthetic task used when no data file is given (reverse, addition, addition-lsb, ...)",
        group="data",
    )
    text_field: str = _f(
        "text", "jsonl/parquet field holding plain text (rows with prompt/response or messages are chat)", group="data"
    )
    seq_len: Optional[int] = _f(
        None, "tokens per sequence (default: the task's length; 512 for data files)", group="data"
    )
    pack: bool = _f(True, "pack examples into full seq_len rows (off: one example per row, padded)", group="data")
    eval_examples: int = _f(500, "held-out examples scored at the end (built-in task)", group="data")
    # LoRA
    lora_r: int = _f(0, "LoRA rank; 0 trains all weights (full fine-tune)", group="lora")
    lora_alpha: Optional[float] = _f(None, "LoRA alpha (default: 2 x lora_r)", group="lora")
    lora_dropout: float = _f(0.0, "LoRA dropout", group="lora")
    lora_targets: List[str] = _f(
        ["all-linear"], "module names LoRA adapts (e.g. q_proj v_proj), or all-linear", group="lora"
    )
    # optimization
    batch_size: int = _f(
        8, "sequences per optimizer micro-step (split into microbatches across devices)", group="optim"
    )
    microbatches: Optional[int] = _f(
        None,
        "microbatches per micro-step, at most batch_size (default: devices + 1, capped at batch_size)",
        group="optim",
    )
    grad_accum: int = _f(1, "micro-steps accumulated per optimizer step", group="optim")
    steps: Optional[int] = _f(None, "optimizer steps (default: one epoch of the data file)", group="optim")
    epochs: Optional[float] = _f(None, "epochs over the data file (instead of steps)", group="optim")
    lr: float = _f(2e-5, "peak learning rate", group="optim")
    warmup_steps: Optional[int] = _f(
        None,
        "linear warmup steps (default: 5% of the steps; capped below the run's steps, so the peak is reached)",
        group="optim",
    )
    min_lr_ratio: float = _f(0.1, "cosine decay ends at lr x min_lr_ratio", group="optim")
    weight_decay: float = _f(0.0, "decoupled (AdamW) weight decay", group="optim")
    betas: List[float] = _f([0.9, 0.999], "Adam betas", group="optim")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0: off)", group="optim")
    seed: int = _f(0, "seed of the weights, data order and dropout", group="optim")
    optim_state: str = _f(
        "float32",
        "Adam moments on the host: float32, bfloat16 or int8 (blockwise quantised); the compact ones save 4 or "
        "6 bytes/param (docs/optimizer.md)",
        group="optim",
    )
    master: str = _f(
        "float32",
        "optimizer master weights: float32 copies, or bfloat16 (the bf16 weights themselves, no fp32 copy: 4 "
        "bytes/param less; needs --dtype bfloat16)",
        group="optim",
    )
    master_rounding: str = _f(
        "stochastic",
        "how bfloat16 masters take an update: stochastic, kahan (+2 bytes/param) or nearest",
        group="optim",
    )
    async_step: bool = _f(
        True, "overlap the optimizer step with the next iteration (weights one step stale)", group="optim"
    )
    shard_optimizer: bool = _f(
        False,
        "several ranks on one host (torchrun): share the host optimizer step among them (masters once per "
        "host, each layer's update on "
        "one rank; same results; docs/multi-node.md)",
        group="optim",
    )
    on_nonfinite: str = _f(
        "stop",
        "a NaN/inf loss or gradient norm: stop (exit with an error; the step is not applied, checkpoints stay "
        "intact) or skip (drop that "
        "step's gradients and go on)",
        group="optim",
    )
    plan: str = _f(
        "auto",
        "pipeline stages: auto (RoundPipe's planner, from measured layer times and device memory), layerwise "
        "(one layer per stage: least "
        "device memory) or single (the whole model in one stage: fastest for small models)",
        group="run",
    )
    stage_inputs: Optional[str] = _f(
        None,
        "backward-stage inputs kept on the host: bf16 (as computed), fp8 or int8 (about half the host memory at long "
        "context; backward recomputes from the rounded values; docs/long-context.md; default: RPP_STAGE_INPUTS, "
        "else bf16)",
        group="run",
    )
    compile: Optional[bool] = _f(
        None,
        "torch.compile the loss kernels (default: RPP_DISABLE_TORCH_COMPILE if set, else on for GPUs and off "
        "for CPU workers, where "
        "compiling takes longer than it saves)",
        group="run",
    )
    seq_tile: Optional[int] = _f(
        None,
        "tokens per sequence tile of the decoder layers, as RPP_SEQ_TILE and roundpipe plan --seq-tile (0: off; a "
        "shorter tile needs less GPU memory at long context; default: RPP_SEQ_TILE, else 16384)",
        group="run",
    )
    # devices
    devices: Optional[str] = _f(
        None,
        "devices, as RPP_DEVICES: cuda, cuda:0,2 or cpu:N (default: RPP_DEVICES, else all GPUs, else cpu:1)",
        group="run",
    )
    gpu_memory: Optional[str] = _f(
        None,
        "memory per GPU, as in roundpipe plan: 24GiB, 24GB, 20000MiB (default: RPP_GPU_MEMORY, else the whole GPU)",
        group="run",
    )
    host_memory: Optional[str] = _f(
        None,
        "host memory the run may use, as in roundpipe plan: 100GiB (default: RPP_HOST_MEMORY, else available less 5%)",
        group="run",
    )
    # output
    output_dir: str = _f("runs/roundpipe", "where metrics, plots and checkpoints go", group="run")
    log_every: int = _f(50, "print a log line every N steps", group="run")
    save_every: int = _f(0, "checkpoint every N steps (0: only at the end)", group="run")
    keep_checkpoints: int = _f(2, "how many most recent checkpoints to keep", group="run")
    resume: Optional[str] = _f(
        None, "checkpoint to continue from: a path, or 'latest' (output_dir's newest)", group="run"
    )
    stop_at: Optional[int] = _f(
        None, "checkpoint and stop after this step (the schedule still runs to 'steps'; resume later)", group="run"
    )
    progress: bool = _f(True, "tqdm progress bar (off when not a TTY or RPP_PROGRESS=0)", group="run")
    tensorboard: bool = _f(True, "also write TensorBoard logs when tensorboard is installed", group="run")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


#: Overrides applied when training on the built-in task (no ``data``): a tiny model trained from
#: scratch wants a large learning rate and many short sequences.
TASK_PROFILE: Dict[str, Any] = {
    "batch_size": 64,
    "microbatches": 1,
    "steps": 600,
    "lr": 3e-3,
    "warmup_steps": 50,
    "betas": [0.9, 0.98],
    "weight_decay": 0.01,
    "log_every": 100,
    "plan": "single",
}

FIELDS: Dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def base_type(name: str) -> Any:
    """``int`` for ``Optional[int]``, ``list`` for ``List[str]``, etc."""
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    return typing.get_origin(hint) or hint


def _item_type(name: str) -> Any:
    hint = _HINTS[name]
    args = typing.get_args(hint)
    return args[0] if args else str


def _coerce(name: str, value: Any) -> Any:
    """Check and convert one YAML/flag value to the field's type."""
    kind = base_type(name)
    if value is None:
        if typing.get_origin(_HINTS[name]) is typing.Union:
            return None
        raise ConfigError(f"{name} cannot be empty", f"give {name} a value or drop the key")
    try:
        if kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
                return value.lower() in ("true", "yes", "1", "on")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind is list:
            items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
            return [_item_type(name)(v) for v in items]
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        expected = {bool: "true or false", list: "a list", int: "an integer", float: "a number"}.get(kind, "a string")
        raise ConfigError(f"{name}={value!r} is not {expected}", f"set {name} to {expected}") from None


def version() -> str:
    """The installed roundpipe's version (from the package, without importing torch)."""
    from roundpipe import __version__

    return __version__


def merge(file_keys: Dict[str, Any], flag_keys: Dict[str, Any]) -> TrainConfig:
    """Defaults < task profile (no data file) < YAML < flags; values are type-checked."""
    given = {**file_keys, **flag_keys}
    if given.get("data") is not None and "task" in given:
        raise ConfigError(
            f"both data ({given['data']}) and task ({given['task']}) are set, and a data file replaces the "
            "built-in task",
            "drop --task to train on the data file, or drop --data to train on the task",
        )
    values: Dict[str, Any] = {}
    if given.get("data") is None:
        values.update(TASK_PROFILE)
    values.update(given)
    cfg = TrainConfig(**{k: _coerce(k, v) for k, v in values.items()})
    for name in DTYPE_KEYS:
        setattr(cfg, name, normalize_dtype(getattr(cfg, name)))
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Checks that need no model or data; the rest happen when those are loaded."""
    from roundpipe.cli.memory_caps import size_problem
    from roundpipe.cli.model_names import did_you_mean
    from roundpipe.cli.tasks import TASKS

    def positive(name: str, allow_none: bool = False) -> None:
        v = getattr(cfg, name)
        if (v is None and not allow_none) or (v is not None and v <= 0):
            raise ConfigError(f"{name}={v} must be positive", f"set {name} to a value above 0")

    for name in ("batch_size", "grad_accum", "lr", "log_every", "keep_checkpoints"):
        positive(name)
    for name in ("seq_len", "steps", "epochs", "microbatches", "stop_at"):
        positive(name, allow_none=True)
    for name in ("save_every", "weight_decay", "max_grad_norm", "lora_r", "lora_dropout", "eval_examples"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} is negative", f"set {name} to 0 or more")
    if cfg.seq_tile is not None and cfg.seq_tile < 0:
        raise ConfigError(f"seq_tile={cfg.seq_tile} is negative", "set --seq-tile to 0 (tiles off) or more")
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        raise ConfigError(f"warmup_steps={cfg.warmup_steps} is negative", "set warmup_steps to 0 or more")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio={cfg.min_lr_ratio} is outside [0, 1]", "pick a fraction of lr, e.g. 0.1")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ConfigError(f"betas={cfg.betas} is not two numbers in [0, 1)", "use e.g. --betas 0.9 0.999")
    if cfg.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"on_nonfinite={cfg.on_nonfinite!r} is not a choice", "use stop or skip")
    choice_keys = (("optim_state", OPTIM_STATES), ("master", MASTERS), ("master_rounding", MASTER_ROUNDINGS))
    for name, choices in (*choice_keys, ("stage_inputs", STAGE_INPUTS)):
        if getattr(cfg, name) not in choices and (name, getattr(cfg, name)) != ("stage_inputs", None):
            raise ConfigError(f"{name}={getattr(cfg, name)!r} is not a choice", f"use one of {', '.join(choices)}")
    if cfg.master == "bfloat16" and cfg.dtype not in ("bfloat16", "auto"):
        raise ConfigError(
            f"master=bfloat16 steps the bf16 weights themselves, but dtype={cfg.dtype}",
            "add --dtype bfloat16 or use --master float32",
        )
    if cfg.plan not in PLANS:
        raise ConfigError(f"plan={cfg.plan!r} is not a plan", f"use one of {', '.join(PLANS)}")
    if cfg.dtype not in DTYPES:
        fix = f"use one of {', '.join(DTYPES)} (or bf16, fp32, fp16)"
        raise ConfigError(f"dtype={cfg.dtype!r} is not supported", fix)
    if cfg.microbatches is not None and cfg.batch_size < cfg.microbatches:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is smaller than microbatches={cfg.microbatches}",
            f"raise batch_size to at least {cfg.microbatches} or lower microbatches",
        )
    if cfg.steps is not None and cfg.epochs is not None:
        raise ConfigError("both steps and epochs are set", "keep one of them")
    if cfg.stop_at is not None and cfg.steps is not None and cfg.stop_at > cfg.steps:
        raise ConfigError(
            f"stop_at={cfg.stop_at} is after the last step ({cfg.steps})", f"set stop_at to at most {cfg.steps}"
        )
    if cfg.data is None:
        if cfg.task not in TASKS:
            raise ConfigError(f"unknown task {cfg.task!r}", f"use one of {', '.join(TASKS)} or pass --data FILE")
        if cfg.epochs is not None:
            raise ConfigError(
                "epochs is set but the built-in task has no epochs (it is generated on the fly)", "use --steps"
            )
    else:
        check_data_file(cfg.data)
    check_model(cfg.model)
    if cfg.rope_scaling is not None:
        check_rope_scaling(cfg.rope_scaling)
    if (problem := size_problem(cfg)) is not None:
        raise ConfigError(*problem)
    if cfg.base_format not in BASE_FORMATS:
        hint = did_you_mean(cfg.base_format, BASE_FORMATS)
        raise ConfigError(
            f"base_format={cfg.base_format!r} is not a format{hint}", f"use one of {', '.join(BASE_FORMATS)}"
        )
    if cfg.base_format != "bf16" and cfg.lora_r == 0:
        raise ConfigError(
            f"base_format={cfg.base_format} stores the frozen base weights, but lora_r=0 trains every weight",
            "add --lora-r 16 (LoRA adapters over the quantized base), or drop --base-format",
        )
    if (problem := fp8_problem(cfg.fp8, cfg.lora_r, cfg.base_format)) is not None:
        raise ConfigError(*problem)
    if cfg.lora_r == 0 and cfg.lora_alpha is not None:
        raise ConfigError(
            "lora_alpha is set but lora_r is 0 (full fine-tune)", "set --lora-r to enable LoRA, or drop lora_alpha"
        )


def fp8_problem(fp8: bool, lora_r: int, base_format: str) -> Optional[Tuple[str, str]]:
    """(what, fix) where ``--fp8`` cannot run with this LoRA rank and base format, else None: ``roundpipe train``
    and ``roundpipe plan`` refuse the same runs in the same words."""
    if fp8 and lora_r and base_format != "fp8":
        return (
            f"--fp8 with LoRA computes from a frozen base kept as fp8, and this base is kept as {base_format}",
            "add --base-format fp8, or drop --fp8",
        )
    return None


def check_rope_scaling(spec: str) -> None:
    """``spec`` is a rotary scaling (``yarn:4``); one line naming the accepted forms otherwise."""
    from roundpipe.rope_scaling import SPEC_FORMS, parse_spec

    try:
        parse_spec(spec)
    except ValueError:
        raise ConfigError(f"rope_scaling={spec!r} is not a rotary scaling", f"use {SPEC_FORMS}") from None


def check_data_file(path: str) -> None:
    """A data file exists, has a supported extension and is not empty (whitespace alone is empty): checked
    with the flags, before torch and the model load."""
    if not os.path.isfile(path):
        raise ConfigError(f"data file {path!r} not found", "pass an existing .txt, .jsonl or .parquet file to --data")
    if os.path.splitext(path)[1].lower() not in (".txt", ".jsonl", ".parquet"):
        raise ConfigError(f"data file {path!r} has an unsupported extension", "use a .txt, .jsonl or .parquet file")
    size = os.path.getsize(path)
    if size == 0 or (size <= 1 << 20 and not path.lower().endswith(".parquet") and _blank(path)):
        fix = "put the training text in it (.txt) or one JSON object per line (.jsonl)"
        raise ConfigError(f"data file {path!r} is empty", fix)


def _blank(path: str) -> bool:
    with open(path, "rb") as f:
        return not f.read().strip()


def check_model(model: str) -> None:
    """``model`` is a built-in architecture or a directory with a ``config.json``; a ConfigError saying
    what to pass otherwise (the built-in name probably meant, or how to get a hub model's directory)."""
    from roundpipe.cli.model_names import BUILTIN_MODELS, did_you_mean

    if model in BUILTIN_MODELS:
        return
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            fix = "pass a Hugging Face model directory (save_pretrained output)"
            raise ConfigError(f"{model} has no config.json", fix)
        return
    fix = f"pass a Hugging Face model directory or one of: {', '.join(BUILTIN_MODELS)}"
    if "/" in model or os.sep in model or os.path.exists(model):  # a path: no built-in name was meant
        if model.count("/") == 1 and not model.startswith((".", "/", "~")) and not os.path.exists(model):
            raise ConfigError(
                f"model {model!r} is neither a local directory nor a built-in architecture (nothing is downloaded)",
                f"download it first (hf download {model} --local-dir DIR), then pass --model DIR",
            )
        raise ConfigError(f"model {model!r} is neither a local directory nor a built-in architecture", fix)
    hint = did_you_mean(model, BUILTIN_MODELS)
    raise ConfigError(f"model {model!r} is neither a local directory nor a built-in architecture{hint}", fix)


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


def from_yaml_text(text: str) -> TrainConfig:
    """A config saved by :func:`to_yaml` (checkpoints), without re-validating paths."""
    import yaml

    raw = yaml.safe_load(text) or {}
    return TrainConfig(**{k: _coerce(k, v) for k, v in raw.items() if k in FIELDS})
