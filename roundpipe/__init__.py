"""roundpipe: train models larger than GPU memory by streaming layers to a round-robin pool of devices.

model = RoundPipe(nn.Sequential(...), optim_dtype=torch.float32)
optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-4)
loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
model.step(lambda: (optimizer.step(), optimizer.zero_grad()))

model = roundpipe.from_pretrained(model_dir, base_format="nf4", lora=peft.LoraConfig(r=16))  # layer by layer
"""

import importlib
from typing import Any

from roundpipe.devices.allocator import prefer_expandable_segments
from roundpipe.settings import configure

prefer_expandable_segments()  # before CUDA starts, unless the user chose the allocator's settings

__version__ = "0.1.0"

__all__ = [
    "AutoRoundPipe",
    "GradScaler",
    "ModelExecutePlan",
    "OptimizerCtx",
    "RoundPipe",
    "RoundPipeRunConfig",
    "configure",
    "doing_recompute",
    "from_config",
    "from_pretrained",
    "get_num_devices",
    "get_recompute_data",
    "load",
    "optim",
    "save",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]

# Imported on first use, so that ``import roundpipe`` (and the ``roundpipe`` command's --help, --version
# and configuration errors) does not pay for torch, transformers or extension builds.
_LAZY = {
    "AutoRoundPipe": "roundpipe.roundpipe",
    "GradScaler": "roundpipe.optim.grad_scaler",
    "ModelExecutePlan": "roundpipe.planning.plan",
    "OptimizerCtx": "roundpipe.host.step",
    "RoundPipe": "roundpipe.roundpipe",
    "RoundPipeRunConfig": "roundpipe.runtime.run_config",
    "doing_recompute": "roundpipe.runtime.context",
    "from_config": "roundpipe.loading.load",
    "from_pretrained": "roundpipe.loading.load",
    "get_num_devices": "roundpipe.devices.device",
    "get_recompute_data": "roundpipe.runtime.context",
    "load": "roundpipe.checkpoint",
    "save": "roundpipe.checkpoint",
    "save_for_recompute": "roundpipe.runtime.context",
    "wrap_model_to_roundpipe": "roundpipe.wrapper",
}


def __getattr__(name: str) -> Any:
    if name == "optim":
        return importlib.import_module("roundpipe.optim")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
