"""A LoRA model over a quantized base written as a plain Hugging Face checkpoint: each part's base weights
dequantized, the adapters merged in, and the result written as sharded safetensors as it goes, so the
whole model is never in the output dtype at once (the layer-by-layer loader, run backwards).

The merge is PEFT's: ``weight + get_delta_weight(adapter)`` in the weight's dtype, as ``merge_and_unload``
does over a plain base, so a merged export equals PEFT's merge over the dequantized weights.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from roundpipe.loading.fill import checkpoint_name, is_adapter
from roundpipe.loading.shards import INDEX, SINGLE

#: Bytes of one output shard at most (a part larger than this gets a shard of its own).
MAX_SHARD_BYTES = 4 << 30


def _plain(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A frozen weight dequantized (a plain tensor as it is), in ``dtype``."""
    if hasattr(t, "packed"):  # a FrozenWeight (as a parameter too: the parameter is the wrapper itself)
        return t.dequantize(dtype=dtype)
    return t.detach().to(dtype)


def merged_parts(model: nn.Module, dtype: torch.dtype) -> Iterator[Dict[str, torch.Tensor]]:
    """The checkpoint tensors of ``model`` (a PEFT LoRA model, or a plain one) part by part, by Hugging Face
    name: bases dequantized to ``dtype``, adapters merged, each tied tensor once."""
    from peft.tuners.lora.layer import LoraLayer

    from roundpipe.loading.skeleton import parts_of

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    seen: set = set()
    for prefix, part in parts_of(hf):
        out: Dict[str, torch.Tensor] = {}
        for sub_name, sub in part.named_modules():
            at = prefix + (f"{sub_name}." if sub_name else "")
            for attr, p in sub._parameters.items():
                name = at + attr
                if p is not None and not is_adapter(name) and id(p) not in seen:
                    seen.add(id(p))
                    out[checkpoint_name(name)] = _plain(p, dtype)
        for sub_name, sub in part.named_modules():  # the bases are all in ``out`` now: merge the adapters
            if not isinstance(sub, LoraLayer):
                continue
            at = prefix + (f"{sub_name}." if sub_name else "")
            with torch.no_grad():
                for adapter in sub.active_adapters:
                    if adapter not in sub.lora_A:
                        continue
                    key = checkpoint_name(at + "base_layer.weight")
                    out[key] = out[key] + sub.get_delta_weight(adapter).to(dtype)
                    if sub.lora_bias.get(adapter, False):
                        bias = checkpoint_name(at + "base_layer.bias")
                        out[bias] = out[bias] + sub.lora_B[adapter].bias.detach().to(dtype)
        yield out


def write_sharded(parts: Iterator[Dict[str, torch.Tensor]], out: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Write ``parts`` into directory ``out`` as ``model.safetensors`` or shards with their index (Hugging
    Face's names), a shard written as soon as it is full; returns the bytes written."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    written: List[Tuple[str, List[str]]] = []
    pending: Dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            name = f"shard-{len(written):05d}.tmp"
            save_file({k: v.contiguous() for k, v in pending.items()}, os.path.join(out, name), {"format": "pt"})
            written.append((name, list(pending)))
        pending, size = {}, 0

    for part in parts:
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        if size and size + nbytes > max_shard_bytes:
            flush()
        pending.update(part)
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        os.replace(os.path.join(out, written[0][0]), os.path.join(out, SINGLE))
        return total
    weight_map = {}
    for i, (tmp, keys) in enumerate(written, 1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(os.path.join(out, tmp), os.path.join(out, final))
        weight_map.update({k: final for k in keys})
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def save_merged(model: nn.Module, out: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """``model`` (LoRA over a quantized base, or any model of the loader) as a Hugging Face directory ``out``
    in ``dtype``, adapters merged: the weights written part by part, then ``config.json``."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = write_sharded(merged_parts(model, dtype), out)
    config = hf.config
    config.dtype = dtype
    config.save_pretrained(out)
    return total


__all__ = ["MAX_SHARD_BYTES", "merged_parts", "save_merged", "write_sharded"]
