"""Build a Hugging Face causal LM straight into host storage, one part at a time: from a checkpoint
directory (``from_pretrained``) or with random weights (``from_config``), its frozen base in a base format
(bf16, fp8, int8, nf4, mxfp4) and its LoRA adapters from a ``peft.LoraConfig``.

The model is first a skeleton on the meta device (no weight allocated), LoRA applied to it; then the
embedding, each decoder layer, the final norm and the head are filled in order (:mod:`roundpipe.loading.fill`),
so only one layer is ever in the compute dtype and the host's peak stays near the model's final footprint:
a 70B model with an NF4 base builds in about 40 GB instead of 140.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from roundpipe.loading.fill import PartFiller
from roundpipe.loading.shards import CheckpointFiles, LoadError
from roundpipe.loading.skeleton import build_skeleton

logger = logging.getLogger("roundpipe")

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_request(base_format: str, lora: Optional[Any], dtype: torch.dtype) -> None:
    """The format exists, and a quantized base has LoRA to train (its frozen weights are the base's)."""
    if dtype not in DTYPES:
        raise LoadError(f"dtype={dtype} is not a compute dtype; use one of {', '.join(map(str, DTYPES))}")
    if base_format != "bf16":
        from roundpipe.host.formats import check_base_format

        check_base_format(base_format)
        if lora is None:
            raise LoadError(
                f"base_format={base_format!r} stores frozen weights, but without lora every weight trains; pass "
                "lora=peft.LoraConfig(...) or keep base_format='bf16'"
            )


def _fill(
    model_config: Any, dtype: torch.dtype, base_format: str, lora: Optional[Any], files: Optional[CheckpointFiles]
) -> nn.Module:
    skeleton = build_skeleton(model_config, dtype, lora)
    filler = PartFiller(skeleton.hf, dtype, base_format, files, lora)
    for prefix, part in skeleton.parts:
        filler.fill(prefix, part)
    filler.finish_adapters()
    filler.check_unused()
    skeleton.model.eval()  # as transformers' from_pretrained leaves it; training calls set their own mode
    return skeleton.model


#: What a hub download fetches: the config and the safetensors weights (the tokenizer is the caller's).
HUB_FILES = ["*.json", "*.safetensors"]


def local_dir(path: str) -> str:
    """``path`` itself when it is a directory; a hub id (``org/name``) not present locally is downloaded into
    the Hugging Face cache (config and safetensors only) and its snapshot directory returned."""
    if os.path.isdir(path) or path.count("/") != 1 or path.startswith((".", "/", "~")):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=HUB_FILES)
    except Exception as exc:  # offline, unknown id, gated model: one line, what to do
        raise LoadError(
            f"{path} is no local directory and its download failed ({type(exc).__name__}); download it with "
            f"'hf download {path} --local-dir DIR' and pass DIR"
        ) from None


def load_pretrained(
    path: Union[str, os.PathLike],
    base_format: str = "bf16",
    lora: Optional[Any] = None,
    dtype: torch.dtype = torch.bfloat16,
    config: Optional[Any] = None,
) -> nn.Module:
    """The Hugging Face model of checkpoint directory ``path`` (inside PEFT with ``lora``), its weights on the
    host, frozen Linear weights in ``base_format``; not wrapped. ``config``: the model config to use instead of
    the directory's ``config.json`` (a run that changed its rotary scaling)."""
    check_request(base_format, lora, dtype)
    path = local_dir(os.fspath(path))
    files = CheckpointFiles(path)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise LoadError(
                f"cannot read the config of {path} ({str(exc).splitlines()[0]}); pass a directory with a config.json"
            ) from None
    return _fill(config, dtype, base_format, lora, files)


def build_random(
    config: Any, base_format: str = "bf16", lora: Optional[Any] = None, dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """The Hugging Face model of ``config`` with random weights (the model's own init; frozen Linear weights
    N(0, initializer_range) drawn straight into ``base_format``; LoRA as PEFT initialises it); not wrapped."""
    check_request(base_format, lora, dtype)
    return _fill(config, dtype, base_format, lora, None)


def from_pretrained(
    path: Union[str, os.PathLike],
    base_format: str = "bf16",
    lora: Optional[Any] = None,
    dtype: torch.dtype = torch.bfloat16,
    **wrap_kwargs: Any,
) -> Any:
    """A checkpoint directory read layer by layer into a RoundPipe causal LM (``wrap_model_to_roundpipe``'s preset).

    Args:
        path: A Hugging Face model directory: ``config.json`` and safetensors weights, one
            ``model.safetensors`` or shards with ``model.safetensors.index.json``; a hub id (``org/name``)
            that is no local directory is downloaded first (config and safetensors).
        base_format: How the frozen Linear weights are kept in host memory: ``"bf16"``, ``"fp8"``, ``"int8"``,
            ``"nf4"`` or ``"mxfp4"`` (on GPT-OSS: the experts, kept as the checkpoint's MXFP4 bytes); anything but
            bf16 needs ``lora``.
        lora: A ``peft.LoraConfig``: adapters initialised as ``get_peft_model`` does (seed with
            ``torch.manual_seed`` for PEFT's exact numbers); None trains every weight.
        dtype: The compute dtype (the embedding, norms, head and the dequantized base).
        **wrap_kwargs: Forwarded to ``roundpipe.wrap_model_to_roundpipe`` (``optim_dtype``, ``model_run_config``).
    """
    import roundpipe

    model = load_pretrained(path, base_format, lora, dtype)
    wrap_kwargs.setdefault("name", os.path.basename(os.path.normpath(os.fspath(path))))
    return roundpipe.wrap_model_to_roundpipe(model, use_sequential_preset=True, base_format=base_format, **wrap_kwargs)


def from_config(
    config: Any,
    base_format: str = "bf16",
    lora: Optional[Any] = None,
    dtype: torch.dtype = torch.bfloat16,
    **wrap_kwargs: Any,
) -> Any:
    """A RoundPipe causal LM of ``config`` with random weights (as ``AutoModelForCausalLM.from_config``), built
    part by part like :func:`from_pretrained`: a 70B model with an NF4 base needs no 140 GB of host memory."""
    import roundpipe

    model = build_random(config, base_format, lora, dtype)
    wrap_kwargs.setdefault("name", getattr(config, "model_type", "model"))
    return roundpipe.wrap_model_to_roundpipe(model, use_sequential_preset=True, base_format=base_format, **wrap_kwargs)


__all__ = [
    "HUB_FILES",
    "build_random",
    "check_request",
    "from_config",
    "from_pretrained",
    "load_pretrained",
    "local_dir",
]
