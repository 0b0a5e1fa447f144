"""What a ``roundpipe train`` checkpoint holds, and how it goes back into a run.

The directory mechanics (temporary directory, manifest, atomic rename, pruning) are
:mod:`roundpipe.cli.checkpoint`'s; this module fills the directory and reads it back::

    config.yaml  source.json  hf/ (config + tokenizer)  lora/ (adapter config)
    model.safetensors           up-to-date weights by Hugging Face name (masters in the training dtype)
    optim/device.safetensors    the trainable weights the devices compute with right now
    optim/master.safetensors    the fp32 masters
    optim/state.pt              optimizer state
    trainer.pt                  step, schedule, GradScaler, data position, RNG states, counters

In async mode the device weights are one step older than the masters; saving both lets a resumed run
repeat the uninterrupted run's computation exactly (see :mod:`roundpipe.cli.train`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from roundpipe import distributed as rdist
from roundpipe.checkpoint import rng_state, set_rng_state
from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli.config import ConfigError, TrainConfig, from_yaml_text, merge, to_yaml, with_absolute_paths
from roundpipe.cli.optimizer import HostOptimizer
from roundpipe.cli.pipeline import PipelineModel

logger = logging.getLogger("roundpipe")


def weights_kind(source: Dict[str, str], lora: bool) -> str:
    """'trainable' when the frozen weights can be rebuilt from the source (LoRA on a local model, or over a
    quantized base: a built-in's is drawn again from the run's seed): checkpoints then stay adapter-sized;
    'full' otherwise."""
    rebuilt = source["kind"] == "local" or source.get("base_format", "bf16") != "bf16"
    return "trainable" if lora and rebuilt else "full"


@dataclass
class Progress:
    """The run's counters that a checkpoint carries besides the model and optimizer."""

    step: int
    total_steps: int
    tokens_seen: int
    elapsed: float
    """Seconds trained so far, over every process that worked on this run."""


def write_payload(
    d: str,
    cfg: TrainConfig,
    source: Dict[str, str],
    dtype: torch.dtype,
    model: PipelineModel,
    tokenizer: Any,
    optim: HostOptimizer,
    stream: Any,
    progress: Progress,
    rngs: Optional[List[Dict[str, Any]]],
    optimizer_state: Optional[Dict[str, Any]] = None,
) -> None:
    """Fill checkpoint directory ``d`` (call with no optimizer step in flight). ``rngs``: every rank's
    RNG state in rank order (data parallel), else None. ``optimizer_state``: the optimizer's state dict
    to save instead of this process's (a sharded step's, gathered from every rank)."""
    lora = hasattr(model.hf_model, "peft_config")
    kind = weights_kind(source, lora)
    os.makedirs(os.path.join(d, "optim"))
    with open(os.path.join(d, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg, saved=True))
    with open(os.path.join(d, "source.json"), "w") as f:
        json.dump({**source, "weights": kind, "dtype": str(dtype).replace("torch.", "")}, f, indent=1)
    hf_dir = os.path.join(d, "hf")
    model.rp.preset.model.config.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    if lora:
        model.hf_model.peft_config["default"].save_pretrained(os.path.join(d, "lora"))
    ckpt.save_tensors(
        model.current_weights(kind == "trainable"), os.path.join(d, "model.safetensors"), {"format": "pt"}
    )
    ckpt.save_tensors(dict(model.trainable_named()), os.path.join(d, "optim", "device.safetensors"))
    ckpt.save_tensors(dict(model.master_named()), os.path.join(d, "optim", "master.safetensors"))
    states = optim.state_dicts()
    ckpt.save_torch(
        optimizer_state if optimizer_state is not None else states["optimizer"], os.path.join(d, "optim", "state.pt")
    )
    trainer = {
        "step": progress.step,
        "total_steps": progress.total_steps,
        "scheduler": states["scheduler"],
        "scaler": states["scaler"],
        "data": stream.state_dict(),
        "rng": rng_state(),
        **({"rng_by_rank": rngs} if rngs is not None else {}),
        "tokens_seen": progress.tokens_seen,
        "elapsed": progress.elapsed,
    }
    ckpt.save_torch(trainer, os.path.join(d, "trainer.pt"))


def resume_config(cfg: TrainConfig, given: Dict[str, Any], path: Optional[str] = None) -> TrainConfig:
    """With ``--resume``, the checkpoint's config is the base and only keys given now override it
    (``stop_at`` of the interrupted run is dropped). ``path``: the checkpoint, when already resolved
    (by rank 0, for all ranks)."""
    if path is None:
        path = ckpt.resolve_checkpoint(cfg.resume or "latest", cfg.output_dir)
    ckpt.verify_checkpoint(path)
    with open(os.path.join(path, "config.yaml")) as f:
        saved_cfg = from_yaml_text(f.read())
    saved = saved_cfg.to_dict()
    # Paths compared resolved: the saved ones are absolute (older checkpoints' as given), flags as typed.
    then, now = with_absolute_paths(saved_cfg).to_dict(), with_absolute_paths(cfg)
    saved["stop_at"] = None
    if saved.get("data") is not None:
        saved.pop("task", None)  # unused with a data file (configs saved before it was left out name it)
    if rdist.current_env().local_world_size > 1 and "devices" not in given:
        saved["devices"] = None  # several ranks per host: each takes its share of the GPUs (init_from_env)
    changed = sorted(
        k
        for k, v in given.items()
        if k
        not in (
            "resume",
            "stop_at",
            "output_dir",
            "progress",
            "log_every",
            "save_every",
            "keep_checkpoints",
            "devices",
            "gpu_memory",
            "host_memory",
            "tensorboard",
        )
        and then.get(k) != getattr(now, k)
    )
    if changed and rdist.is_main_process():
        logger.warning(
            "resuming with changed %s: the run will not repeat the uninterrupted one exactly", ", ".join(changed)
        )
    merged = merge({}, {**saved, **{k: getattr(cfg, k) for k in given}, "resume": path})
    return merged


def read_payload(
    path: str, model: PipelineModel, optim: HostOptimizer, stream: Any, rank: int, world_size: int, total_steps: int
) -> Progress:
    """Load checkpoint ``path`` (already verified) into the model, optimizer, data stream and RNGs;
    returns the counters to continue with. ``rank``/``world_size``: this process's place in a data
    parallel job (its own RNG state when the checkpoint has one per rank of the same layout)."""
    device_w = ckpt.load_tensors(os.path.join(path, "optim", "device.safetensors"))
    master_w = ckpt.load_tensors(os.path.join(path, "optim", "master.safetensors"))
    named = model.trainable_named()
    if set(device_w) != {n for n, _ in named}:
        raise ConfigError(
            f"checkpoint {path} was saved for other trainable parameters (different model or LoRA settings)",
            "resume with the config the checkpoint was trained with",
        )
    full = ckpt.load_tensors(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        params = dict(model.hf_model.named_parameters())
        for name, t in full.items():  # frozen weights (and buffers) of full checkpoints
            if name in params and not params[name].requires_grad:
                params[name].copy_(t)
        for name, p in named:
            p.copy_(device_w[name])
        for name, m in model.master_named():
            m.copy_(master_w[name])
    trainer: Any = ckpt.load_torch(os.path.join(path, "trainer.pt"))
    optim.load_state_dicts(  # type: ignore[arg-type]
        ckpt.load_torch(os.path.join(path, "optim", "state.pt")), trainer["scheduler"], trainer.get("scaler")
    )
    stream.load_state_dict(trainer["data"])  # the global data position: the same on every rank
    by_rank = trainer.get("rng_by_rank")
    same_layout = isinstance(by_rank, list) and len(by_rank) == world_size
    set_rng_state(by_rank[rank] if same_layout else trainer["rng"])
    step = int(trainer["step"])
    if step >= total_steps:
        raise ConfigError(
            f"checkpoint {path} is at step {step}, the end of a {total_steps}-step run",
            "raise --steps to train further",
        )
    return Progress(
        step=step, total_steps=total_steps, tokens_seen=int(trainer["tokens_seen"]), elapsed=float(trainer["elapsed"])
    )


__all__ = ["Progress", "read_payload", "resume_config", "rng_state", "set_rng_state", "weights_kind", "write_payload"]


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports; the test suite reads it too."""

    step: int
    total_steps: int
    loss: float
    tokens_per_s: float
    seconds: float
    output_dir: str
    checkpoint: Optional[str]
    accuracy: Optional[float] = None
    model: Optional[PipelineModel] = None
    tokenizer: Any = None
    ranks: int = 1
