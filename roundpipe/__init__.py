"""roundpipe: train models larger than GPU memory by streaming layers to a round-robin pool of devices.

    model = RoundPipe(nn.Sequential(...), optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-4)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
"""

from typing import Any

from roundpipe.context import OptimizerCtx, doing_recompute, get_recompute_data, save_for_recompute
from roundpipe.device import get_num_devices
from roundpipe.roundpipe import AutoRoundPipe, RoundPipe
from roundpipe.run_config import RoundPipeRunConfig
from roundpipe.plan import ModelExecutePlan
from roundpipe.settings import configure

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
    "get_num_devices",
    "get_recompute_data",
    "optim",
    "save_for_recompute",
    "wrap_model_to_roundpipe",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: these pull in transformers / build extensions.
    if name == "wrap_model_to_roundpipe":
        from roundpipe.wrapper import wrap_model_to_roundpipe

        return wrap_model_to_roundpipe
    if name == "GradScaler":
        from roundpipe.optim.grad_scaler import GradScaler

        return GradScaler
    if name == "optim":
        import roundpipe.optim as optim

        return optim
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
