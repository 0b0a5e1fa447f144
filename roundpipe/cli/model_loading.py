"""Model loading for ``roundpipe train``: built-in architectures, local Hugging Face directories, the
compute dtype, the tokenizer, LoRA and the base format.

A model is either a built-in Qwen3 or Llama-3.1 architecture (random init, byte-level tokenizer; no download)
or a local directory written by ``save_pretrained`` (``local_files_only``: nothing is downloaded). A quantized
base (``--base-format``) and the large built-ins are built layer by layer (``roundpipe.loading``). Every
failure a user can fix is a :class:`ConfigError` naming the directory and what to do.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Optional

import torch
from torch import nn

from roundpipe.cli.config import ConfigError, TrainConfig, check_model
from roundpipe.cli.model_names import BUILTIN_MODELS, family_of
from roundpipe.cli.tasks import EOS_ID, byte_tokenizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_config(name: str) -> Any:
    """The config of built-in architecture ``name`` (``Qwen3Config``, or ``LlamaConfig`` for the Llama-3.1
    sizes), with the byte-level vocabulary's ids for EOS/pad."""
    from roundpipe.models.configs import config_class

    return config_class(family_of(name))(
        **BUILTIN_MODELS[name], use_cache=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID + 1, bos_token_id=None
    )


def model_source(cfg: TrainConfig) -> Dict[str, str]:
    """Where the model comes from: ``{"kind": "builtin", "name", "seed"}`` (``seed``: what its random weights are
    drawn from) or ``{"kind": "local", "path"}``; both with the ``base_format`` the frozen weights are kept in."""
    check_model(cfg.model)
    if cfg.model in BUILTIN_MODELS:
        return {"kind": "builtin", "name": cfg.model, "seed": str(cfg.seed), "base_format": cfg.base_format}
    return {"kind": "local", "path": os.path.abspath(cfg.model), "base_format": cfg.base_format}


def load_model_config(source: Dict[str, str]) -> Any:
    """The model's ``PretrainedConfig`` (read before the weights, to check the run against it; the weights load
    with it, so what the run changes in it, such as ``--rope-scaling``, is the model's)."""
    if source["kind"] == "builtin":
        return builtin_config(source["name"])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source["path"], local_files_only=True)
    except (OSError, ValueError) as exc:
        raise config_error(source["path"], exc) from None


def config_error(path: str, exc: Exception) -> ConfigError:
    """One line for a config transformers cannot read: its unknown ``model_type`` named, or the first
    sentence of transformers' message (several paragraphs of advice, for an unknown type)."""
    import transformers

    text = " ".join(str(exc).split())
    model_type = None
    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        pass
    if model_type is not None and "does not recognize this architecture" in text:
        return ConfigError(
            f"the model type {model_type!r} of {path} is unknown to transformers {transformers.__version__}",
            "upgrade transformers (pip install -U transformers), or pass a model of a type it knows",
        )
    first = text.split(". ")[0].rstrip(".")
    fix = "pass a directory written by save_pretrained"
    return ConfigError(f"cannot read the model config in {path} ({first})", fix)


def resolve_dtype(cfg: TrainConfig, model_config: Any) -> torch.dtype:
    """The dtype the devices compute with: ``--dtype``, else the model config's own (float32 for
    ``tiny``, bfloat16 for the other built-ins, float32 when the config names none)."""
    if cfg.dtype != "auto":
        return TORCH_DTYPES[cfg.dtype]
    if cfg.model == "tiny":
        return torch.float32
    own = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(own, str):
        own = TORCH_DTYPES.get(own)
    if own in TORCH_DTYPES.values():
        return own
    return torch.bfloat16 if cfg.model in BUILTIN_MODELS else torch.float32


def layer_by_layer(source: Dict[str, str]) -> bool:
    """Whether the model is built part by part (``roundpipe.loading``): a quantized base, or a built-in larger
    than ``tiny`` (random weights without a whole-model copy). Otherwise transformers builds it whole."""
    return source.get("base_format", "bf16") != "bf16" or (source["kind"] == "builtin" and source["name"] != "tiny")


def build_model(source: Dict[str, str], model_config: Any, dtype: torch.dtype, lcfg: Optional[Any] = None) -> nn.Module:
    """The Hugging Face causal LM (random init for built-ins; weights on the host), inside PEFT with LoRA
    config ``lcfg``."""
    if layer_by_layer(source):
        from roundpipe.loading import LoadError, build_random, load_pretrained

        fmt = source.get("base_format", "bf16")
        try:
            if source["kind"] == "local":
                return load_pretrained(source["path"], fmt, lcfg, dtype, config=model_config)
            # Drawn from the run's seed alone, so that a resume or an export rebuilds the same frozen base.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(source["seed"]))
                return build_random(model_config, fmt, lcfg, dtype)
        except LoadError as exc:
            what, _, fix = str(exc).rpartition("; ")
            raise ConfigError(what or fix, fix if what else "check --model and --base-format") from None
    from transformers import AutoModelForCausalLM

    if source["kind"] == "builtin":
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source["path"], config=model_config, dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load the model in {source['path']} ({str(exc).splitlines()[0]})",
                "pass a directory written by save_pretrained with its weights",
            ) from None
    return apply_lora(model, lcfg) if lcfg is not None else model


#: Vocabulary files of Hugging Face tokenizers (fast, SentencePiece, BPE, WordPiece, tiktoken): a model
#: directory with none of them has no tokenizer. transformers would then build an empty one from the
#: model type, and the data would fail later with a misleading error (no chat template, too few tokens).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)


def load_tokenizer(source: Dict[str, str], cfg: TrainConfig) -> Any:
    """The byte tokenizer for the built-in task and built-in models, the model's own otherwise."""
    if cfg.data is None or source["kind"] == "builtin":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    path = source["path"]
    fix = "save the model's tokenizer there with tokenizer.save_pretrained(model_dir)"
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ConfigError(
            f"the model directory {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})", fix
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"no usable tokenizer in {path} ({str(exc).splitlines()[0]})", fix) from None
    if len(tokenizer) <= 1:
        raise ConfigError(f"the tokenizer in {path} is empty ({len(tokenizer)} tokens)", fix)
    return tokenizer


def lora_config(cfg: TrainConfig) -> Any:
    """The PEFT ``LoraConfig`` of the run's ``lora_*`` keys."""
    from peft import LoraConfig

    targets: Any = cfg.lora_targets
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def peft_model(model: nn.Module, lcfg: Any) -> nn.Module:
    """``peft.get_peft_model(model, lcfg)`` without the FutureWarning transformers 5 gives for PEFT's
    read of ``is_gradient_checkpointing`` (a deprecated alias; nothing a user can act on). Only that
    warning is filtered, and only during the call."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, lcfg)


def apply_lora(model: nn.Module, lcfg: Any) -> nn.Module:
    """``model`` inside a PEFT model with adapters ``lcfg`` (only the adapters train)."""
    try:
        return peft_model(model, lcfg)
    except ValueError as exc:
        raise ConfigError(
            f"LoRA: {str(exc).splitlines()[0]}",
            "set --lora-targets to module names of this model (e.g. q_proj v_proj) or all-linear",
        ) from None


__all__ = [
    "BUILTIN_MODELS",
    "TOKENIZER_FILES",
    "TORCH_DTYPES",
    "apply_lora",
    "build_model",
    "builtin_config",
    "config_error",
    "layer_by_layer",
    "load_model_config",
    "load_tokenizer",
    "lora_config",
    "model_source",
    "peft_model",
    "resolve_dtype",
]
