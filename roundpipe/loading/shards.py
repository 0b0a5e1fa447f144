"""The safetensors files of a Hugging Face checkpoint directory, read a few tensors at a time.

A directory holds one ``model.safetensors`` or several shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file). :class:`CheckpointFiles` reads that map once and then opens only the
files a group of tensors lives in, for the time it reads them: a file stays mapped only while one layer is
read, so the pages read from it leave the process's resident memory with the layer.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Dict, Iterable, List, Optional

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class LoadError(ValueError):
    """A checkpoint or model the loader cannot read: the message names the file or key and what to do."""


class CheckpointFiles:
    """Tensor name -> the file holding it, for one checkpoint directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where: Dict[str, str] = self._weight_map(path)

    @staticmethod
    def _weight_map(path: str) -> Dict[str, str]:
        if not os.path.isdir(path):
            raise LoadError(f"{path} is not a directory; pass a Hugging Face model directory (save_pretrained output)")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise LoadError(
                    f"{index} is not a safetensors index ({exc}); write it again with save_pretrained"
                ) from None
            missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
            if missing:
                raise LoadError(
                    f"{index} lists {missing[0]}, which is not in {path}"
                    + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
                    + "; copy every shard of the checkpoint there"
                )
            return dict(weight_map)
        single = os.path.join(path, SINGLE)
        if os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                return {key: SINGLE for key in f.keys()}
        found = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".gguf")))
        hint = f" (it holds {found[0]}: convert it to safetensors with save_pretrained)" if found else ""
        raise LoadError(f"{path} has neither {INDEX} nor {SINGLE}{hint}; the loader reads safetensors checkpoints")

    def keys(self) -> List[str]:
        return list(self.where)

    def read(self, keys: Iterable[str], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
        """The tensors ``keys`` (each converted to ``dtype`` unless None), each file open only during this call."""
        from safetensors import safe_open

        by_file: Dict[str, List[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key], []).append(key)
        out: Dict[str, torch.Tensor] = {}
        with ExitStack() as stack:
            for name, names in by_file.items():
                file = os.path.join(self.path, name)
                try:
                    f = stack.enter_context(safe_open(file, framework="pt"))
                except (OSError, RuntimeError) as exc:
                    raise LoadError(f"cannot read {file} ({exc}); the shard is damaged: copy it again") from None
                for key in names:
                    t = f.get_tensor(key)
                    out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return out

    def file_of(self, key: str) -> str:
        return os.path.join(self.path, self.where[key])


__all__ = ["INDEX", "SINGLE", "CheckpointFiles", "LoadError"]
