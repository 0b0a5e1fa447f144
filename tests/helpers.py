"""Reference computations for comparing RoundPipe against plain PyTorch."""

from __future__ import annotations

import copy
from typing import Dict, List

import torch
from torch import nn

from roundpipe.context import doing_recompute


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


class DropoutRecorder:
    """Records the masks each nn.Dropout of a model applies in forward (not in recompute), per call,
    so a plain PyTorch reference can apply exactly the same masks."""

    def __init__(self, model: nn.Module) -> None:
        self.masks: Dict[str, List[torch.Tensor]] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Dropout):
                self.masks[name] = []
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(mod: nn.Module, inp, out) -> None:
            if mod.training and not doing_recompute():
                self.masks[name].append((out != 0).detach().cpu())

        return hook


class _MaskedDropout(nn.Module):
    def __init__(self, p: float, masks: List[torch.Tensor]) -> None:
        super().__init__()
        self.p, self.masks, self.calls = p, masks, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.masks[self.calls].to(x.device)
        self.calls += 1
        return x * mask.to(x.dtype) * (1.0 / (1.0 - self.p))


def with_recorded_dropout(model: nn.Module, recorder: DropoutRecorder) -> nn.Module:
    """A copy of ``model`` whose dropouts replay the recorded masks in call order."""
    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, nn.Dropout):
            parent_name, _, child = name.rpartition(".")
            parent = ref.get_submodule(parent_name) if parent_name else ref
            setattr(parent, child, _MaskedDropout(mod.p, recorder.masks[name]))
    return ref
