"""Where this process sits in a torchrun job, and the process group's setup and teardown.

``init_from_env`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` ...), gives each rank of a host its own GPUs, and creates the default group with the
main-thread timeout; the gradient groups, created later by ``enable_data_parallel``, use the short
gradient timeout, which every module reads through :func:`timeout_s`.

Attributes:
    DEFAULT_TIMEOUT_S: Gradient-collective timeout when ``RPP_DIST_TIMEOUT_S`` is unset.
    DEFAULT_MAIN_TIMEOUT_S: Main-thread collective timeout when ``RPP_DIST_MAIN_TIMEOUT_S`` is unset.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.distributed as dist

from roundpipe import settings

logger = logging.getLogger("roundpipe")

DEFAULT_TIMEOUT_S = settings.DIST_TIMEOUT_S.default
DEFAULT_MAIN_TIMEOUT_S = settings.DIST_MAIN_TIMEOUT_S.default

_timeouts_in_use: Dict[str, float] = {}  # what init_from_env used, by environment variable


def _timeout_from_env(setting: "settings.Setting[float]") -> float:
    """The timeout ``init_from_env`` used (so later readers agree with the group), else the setting."""
    if setting.name in _timeouts_in_use:
        return _timeouts_in_use[setting.name]
    return setting.get()


def timeout_s() -> float:
    """Timeout of the gradient collectives (optimizer thread): ``RPP_DIST_TIMEOUT_S``, default 60 s.

    Short on purpose: ranks meet there every step, so waiting longer than a step or two means a peer
    is stuck. Raise it if a rank can legitimately lag that long (first-step compilation skew).
    """
    return _timeout_from_env(settings.DIST_TIMEOUT_S)


def main_timeout_s() -> float:
    """Timeout of the main thread's collectives (setup, barriers): ``RPP_DIST_MAIN_TIMEOUT_S``, default
    1800 s, long enough for rank 0 to write a checkpoint while the others wait at a barrier."""
    return _timeout_from_env(settings.DIST_MAIN_TIMEOUT_S)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: Global rank (0 in a single process).
        world_size: Number of ranks (1 in a single process).
        local_rank: Rank on this host.
        local_world_size: Ranks on this host.
        backend: Backend of the default process group (None when not distributed).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: Optional[str] = None

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (logs, metrics, checkpoints)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    """An integer from torchrun's environment, with an error that says who should have set it."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer (is this process launched by torchrun?)") from None


def current_env() -> DistEnv:
    """The job layout as initialized (or a single process when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistEnv()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        backend=str(dist.get_backend()),
    )


def _assign_local_devices(local_rank: int, local_world_size: int) -> None:
    """With several ranks on one host and GPUs present, give each rank its own GPUs (``RPP_DEVICES``).

    Only when ``RPP_DEVICES`` is unset: an explicit choice wins. Ranks of one host must not share a GPU,
    or each would plan with the whole GPU's memory. CPU workers need no split (each rank has its own).
    """
    if local_world_size <= 1 or settings.DEVICES.is_set() or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    per = count // local_world_size
    if per == 0:
        raise ValueError(
            f"{local_world_size} ranks on this host but only {count} GPU(s); use --nproc-per-node {count} or "
            "fewer, or set RPP_DEVICES per rank"
        )
    ids = list(range(local_rank * per, (local_rank + 1) * per))
    torch.cuda.set_device(ids[0])  # NCCL in the default group (if asked for) binds to this GPU
    settings.configure(devices="cuda:" + ",".join(str(i) for i in ids))  # re-creates existing workers


def init_from_env(
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
    main_timeout: Optional[float] = None,
    assign_devices: bool = True,
) -> DistEnv:
    """Initialize torch.distributed from torchrun's environment; a no-op outside torchrun.

    Args:
        backend: Default group's backend. Default ``RPP_DIST_BACKEND`` or ``"gloo"``. ``"nccl"`` becomes
            ``"cpu:gloo,cuda:nccl"``: roundpipe's own collectives are on host tensors and need gloo.
        timeout: Gradient-collective timeout in seconds (default ``RPP_DIST_TIMEOUT_S``, 60 s): how long
            a rank waits for a stalled peer in a training step before failing instead of hanging.
        main_timeout: Timeout of the default group (setup, barriers, logging; default
            ``RPP_DIST_MAIN_TIMEOUT_S``, 1800 s).
        assign_devices: With several ranks per host, split the host's GPUs between them (unless
            ``RPP_DEVICES`` is set).

    Returns:
        The job layout; ``world_size == 1`` when not launched by torchrun (nothing is initialized).
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if dist.is_initialized():
        return current_env()
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        return DistEnv()  # not launched by torchrun: a plain single process
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    backend = backend or settings.DIST_BACKEND.get()
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    if assign_devices:
        _assign_local_devices(local_rank, local_world)
    secs = timeout if timeout is not None else timeout_s()
    main_secs = main_timeout if main_timeout is not None else main_timeout_s()
    if secs <= 0 or main_secs <= 0:
        raise ValueError(
            f"timeout={secs}, main_timeout={main_secs}: must be positive (a dead rank must not hang the others)"
        )
    _timeouts_in_use.update(RPP_DIST_TIMEOUT_S=secs, RPP_DIST_MAIN_TIMEOUT_S=main_secs)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=main_secs), init_method="env://")
    logger.info(
        "distributed: rank %d/%d (local %d/%d), backend %s, timeouts: gradients %gs, main thread %gs",
        rank,
        world,
        local_rank,
        local_world,
        backend,
        secs,
        main_secs,
    )
    return current_env()


def destroy() -> None:
    """Tear the default group down (end of training); a no-op when not initialized."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
