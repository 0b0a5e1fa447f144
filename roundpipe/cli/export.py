"""``roundpipe export CKPT OUT``: a checkpoint as a Hugging Face model directory.

The directory holds ``config.json``, the weights (safetensors) and the tokenizer, so
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load it. The
weights are the up-to-date ones (the fp32 masters in the training dtype), i.e. exactly what the
trained RoundPipe model computes with after ``synchronize()``. A LoRA run is merged into the base
weights by default; ``--no-merge-lora`` writes a PEFT adapter directory instead, which transformers
also loads (with peft installed) as long as the base model directory stays where it was.

A run over a quantized base (``--base-format nf4``) keeps only its adapters in a checkpoint: export rebuilds
the base as the run did, then writes each part dequantized with its adapters merged, as sharded
safetensors, so the whole model is never in bf16 at once (``roundpipe.loading.merge``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Dict, List, Optional

from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli.config import DTYPES, ConfigError, normalize_dtype


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ConfigError(message, f"see '{self.prog} --help'")


def parse_export_args(argv: List[str]) -> argparse.Namespace:
    parser = _ArgumentParser(
        prog="roundpipe export", description="Write a roundpipe checkpoint as a Hugging Face model directory."
    )
    parser.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="checkpoint directory (…/checkpoints/step-N), or a run's output_dir for its latest",
    )
    parser.add_argument("out", metavar="OUT", help="directory to write (must not exist, or be empty)")
    parser.add_argument(
        "--merge-lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="merge LoRA into the base weights (default); --no-merge-lora writes a PEFT adapter",
    )
    choices = [d for d in DTYPES if d != "auto"]
    help_ = "cast the weights (default: the training dtype; bf16, fp32, fp16 work too)"
    parser.add_argument("--dtype", type=normalize_dtype, choices=choices, default=None, help=help_)
    return parser.parse_args(argv)


def read_source(path: str) -> Dict[str, Any]:
    """What checkpoint ``path``'s model was built from (``source.json``)."""
    with open(os.path.join(path, "source.json")) as f:
        return json.load(f)


def load_checkpoint_model(path: str) -> Any:
    """The Hugging Face model (PEFT-wrapped for LoRA runs) with the checkpoint's up-to-date weights. A run over
    a quantized base gets that base again, rebuilt layer by layer (:func:`load_over_quantized_base`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from roundpipe.cli.model_loading import TORCH_DTYPES

    source = read_source(path)
    if source.get("base_format", "bf16") != "bf16":
        return load_over_quantized_base(path, source)
    dtype = TORCH_DTYPES[source["dtype"]]
    weights = ckpt.load_tensors(os.path.join(path, "model.safetensors"))
    # the run's config (its rotary scaling included), also over a LoRA run's base directory
    config = AutoConfig.from_pretrained(os.path.join(path, "hf"), local_files_only=True)
    if source["weights"] == "trainable":  # LoRA on a local model: frozen weights from the model directory
        _check_base_dir(source)
        model = AutoModelForCausalLM.from_pretrained(source["path"], config=config, dtype=dtype, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if os.path.isdir(os.path.join(path, "lora")):
        from peft import LoraConfig

        from roundpipe.cli.model_loading import peft_model

        model = peft_model(model, LoraConfig.from_pretrained(os.path.join(path, "lora")))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if source["weights"] == "full":
        tied = {
            n for n in missing if n.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)
        }
        missing = [n for n in missing if n not in tied]
    else:
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        missing = [n for n in missing if n in trained]
    _check_match(path, missing, unexpected)
    model.eval()
    return model


def _check_base_dir(source: Dict[str, Any]) -> None:
    if source["kind"] == "local" and not os.path.isdir(source["path"]):
        raise ConfigError(
            f"the base model directory {source['path']} of this LoRA checkpoint is gone",
            "restore it there, then export again",
        )


def _check_match(path: str, missing: List[str], unexpected: List[str]) -> None:
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {path} does not match its model ({len(missing)} missing, {len(unexpected)} unexpected "
            f"weights, e.g. {(missing + unexpected)[0]})",
            "export with the roundpipe version that wrote it",
        )


def load_over_quantized_base(path: str, source: Dict[str, Any]) -> Any:
    """The PEFT model of a LoRA run over a quantized base: the base rebuilt in its format from the model
    directory (or a built-in's seed), as the run built it, then the checkpoint's adapters."""
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig

    from roundpipe.cli.model_loading import TORCH_DTYPES, build_model

    _check_base_dir(source)
    config = AutoConfig.from_pretrained(os.path.join(path, "hf"), local_files_only=True)
    lcfg = LoraConfig.from_pretrained(os.path.join(path, "lora"))
    model = build_model(source, config, TORCH_DTYPES[source["dtype"]], lcfg)
    weights = ckpt.load_tensors(os.path.join(path, "model.safetensors"))
    params = dict(model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    _check_match(path, sorted(trained - set(weights)), sorted(set(weights) - trained))
    with torch.no_grad():
        for name, t in weights.items():
            params[name].copy_(t)
    model.eval()
    return model


def check_export(checkpoint: str, out: str) -> str:
    """The verified checkpoint directory ``checkpoint`` names (a run's newest, or itself), once ``out``
    is known to be free: the user errors of ``export``, found before transformers loads."""
    path = ckpt.resolve_checkpoint(
        checkpoint,
        checkpoint,
        "pass a run's output_dir (its newest checkpoint) or a checkpoint directory (…/checkpoints/step-N) to "
        "roundpipe export",
    )
    ckpt.verify_checkpoint(path)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"{out} already exists and is not empty", "pick a new output directory or delete it")
    return path


def export(checkpoint: str, out: str, merge_lora: bool = True, dtype: Optional[str] = None) -> str:
    """Write ``checkpoint`` as a Hugging Face model directory ``out``; returns ``out``."""
    from transformers import AutoTokenizer

    path = check_export(checkpoint, out)
    source = read_source(path)
    if not merge_lora and source["kind"] != "local" and os.path.isdir(os.path.join(path, "lora")):
        raise ConfigError(
            "an unmerged LoRA adapter needs a base model directory, but this run's base was a built-in architecture",
            "export with --merge-lora",
        )
    model = load_checkpoint_model(path)
    is_lora = hasattr(model, "peft_config")
    quantized = source.get("base_format", "bf16") != "bf16"
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if quantized and merge_lora:  # dequantized and merged part by part, written as it goes
        from roundpipe.cli.model_loading import TORCH_DTYPES
        from roundpipe.loading.merge import save_merged

        save_merged(model, tmp, TORCH_DTYPES[dtype or source["dtype"]])
    else:
        if is_lora and merge_lora:
            model = model.merge_and_unload()
        if dtype is not None:
            from roundpipe.cli.model_loading import TORCH_DTYPES

            if quantized:  # the adapters alone are written: cast them, the base stays packed
                for p in model.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(TORCH_DTYPES[dtype])
            else:
                model = model.to(TORCH_DTYPES[dtype])
        model.save_pretrained(tmp)
    if is_lora and not merge_lora:  # record the base directory so from_pretrained finds it
        cfg_path = os.path.join(tmp, "adapter_config.json")
        with open(cfg_path) as f:
            adapter = json.load(f)
        with open(os.path.join(path, "source.json")) as f:
            adapter["base_model_name_or_path"] = json.load(f)["path"]
        with open(cfg_path, "w") as f:
            json.dump(adapter, f, indent=2)
    AutoTokenizer.from_pretrained(os.path.join(path, "hf"), local_files_only=True).save_pretrained(tmp)
    ckpt.share_like_other_files(tmp)  # the weights are written 0600: readable by whoever may read the rest
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    return out


__all__ = [
    "check_export",
    "export",
    "load_checkpoint_model",
    "load_over_quantized_base",
    "parse_export_args",
    "read_source",
]
