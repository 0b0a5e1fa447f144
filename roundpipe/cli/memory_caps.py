"""``--gpu-memory`` and ``--host-memory``: the memory caps of ``RPP_GPU_MEMORY`` and ``RPP_HOST_MEMORY`` as
flags, read one way by ``roundpipe plan`` (the budgets it estimates against) and ``roundpipe train`` (the caps
it runs under). In train a flag wins over the variable, and it is a config key, so the run's ``config.yaml``
keeps it for ``--resume``. Problems come back as ``(what, fix)``, which the caller raises as its
``ConfigError`` (this module stands below ``roundpipe.cli.config``, which checks the keys with it).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from roundpipe.settings import parse_size_gib
from roundpipe.utils import GiB

SIZES = "a size such as 24GiB, 24GB or 20000MiB"
"""What a cap accepts, in every message that refuses one."""

#: Config key -> the setting it stands for (``roundpipe.configure``'s name).
CAPS = {"gpu_memory": "RPP_GPU_MEMORY", "host_memory": "RPP_HOST_MEMORY"}


def size_bytes(text: str) -> float:
    """``24GiB`` / ``24GB`` / ``20000MiB`` / ``24`` (GiB) -> bytes, as ``RPP_GPU_MEMORY`` reads it; a
    ``ValueError`` naming the accepted forms otherwise."""
    try:
        return parse_size_gib(str(text)) * GiB
    except ValueError:
        raise ValueError(f"{text!r}: expected {SIZES}") from None


def size_problem(cfg: Any) -> Optional[Tuple[str, str]]:
    """``(what, fix)`` for the first cap a ``TrainConfig`` gives that is not a size (one line naming the flag),
    else None."""
    for key in CAPS:
        value = getattr(cfg, key)
        if value is not None:
            try:
                size_bytes(value)
            except ValueError:
                return f"{key}={value!r} is not a size", f"set --{key.replace('_', '-')} to {SIZES}"
    return None


def memory_caps(cfg: Any) -> Dict[str, Any]:
    """The caps given, as ``roundpipe.configure`` keywords (``gpu_memory="24GiB"``): configured, they win over
    the environment's ``RPP_GPU_MEMORY`` / ``RPP_HOST_MEMORY`` for this process."""
    return {key: getattr(cfg, key) for key in CAPS if getattr(cfg, key) is not None}


def cap_problem(cfg: Any, exc: Exception) -> Tuple[str, str]:
    """``(what, fix)`` for the device layer's refusal of a GPU cap larger than the GPU, naming the flag when
    the flag set the cap."""
    detail = str(exc).split(";")[0]
    if cfg.gpu_memory is None:
        return detail, "lower RPP_GPU_MEMORY or unset it"
    return detail.replace(f"{CAPS['gpu_memory']}=", "--gpu-memory ", 1), "lower --gpu-memory or drop it (the whole GPU)"


__all__ = ["CAPS", "SIZES", "cap_problem", "memory_caps", "size_bytes", "size_problem"]
