"""Data parallel across processes (one RoundPipe per node), on ``torch.distributed``, launched by torchrun.

Each rank runs an ordinary RoundPipe over its local devices and holds a full replica of the host
weights, gradients and optimizer state. The only thing ranks exchange during training is the gradients:
every rank then runs the same optimizer step on the same reduced gradients from the same initial
weights, so the replicas stay identical without ever exchanging weights.

    env = roundpipe.distributed.init_from_env()          # torchrun's RANK / WORLD_SIZE / MASTER_ADDR ...
    model = RoundPipe(net, optim_dtype=torch.float32)
    dp = roundpipe.distributed.enable_data_parallel(model)   # reduce_on="auto": NCCL on GPUs, else host
    for batch in batches:
        x, y = roundpipe.distributed.shard(batch)         # this rank's rows of the global batch
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))  # identical step on every rank

Two places to reduce (``enable_data_parallel(reduce_on=...)``):

* ``"host"``: :class:`DataParallel` is the model's ``grad_reducer`` (see ``RoundPipeBase._step_kernel``)
  and all-reduces the host gradients with gloo on the optimizer thread, after they have landed on the
  host and before they are copied into the optimizer's master copies. It works on any accelerator,
  CPU workers included, adds no device traffic, and the asynchronous step hides it behind the next
  forward. It runs on a *dedicated* gloo group that only the optimizer thread uses: collectives on one
  group must be issued in the same order on every rank, and the main thread (logging, barriers,
  checkpoints) could otherwise interleave its collectives differently on different ranks.
* ``"device"``: each layer's gradients are all-reduced on its device at the end of the layer's backward
  job, before the gradient download (:class:`_DeviceReduction`, hooked into ``transfer.download_layer``):
  NCCL on GPUs (NVLink or InfiniBand instead of host memory and TCP; no host thread blocks, the
  collective is ordered on the download stream), gloo on CPU workers (how CI tests it). One group per
  local device index joins device k of every rank; the ranks agree on the execute plan and round-robin
  position before every training call, so each device issues the same collectives in the same order
  on every rank, and a per-step check refuses the optimizer step if they did not. Weights (1/W,
  ``normalize_by``) are applied on the device before the SUM, and gradient accumulation over several
  calls is exact (rank 0 alone contributes the host's running sum). ``"auto"`` picks ``"device"`` when
  every local device is a GPU and NCCL is available.

Failure handling: gradient groups have a short timeout (``RPP_DIST_TIMEOUT_S``, default 60 s). A
collective that fails (peer died: at once on gloo; peer stalled: after the timeout) raises
:class:`DataParallelError`, naming this rank, the collective and the layers, on the thread that issued
it (optimizer thread, device thread, or the main thread for the plan agreement); RoundPipe records it in
its failure slot, and the main thread raises it at its next RoundPipe call or ``synchronize()``. NCCL
collectives never block a host thread: a monitor thread prints the error for a collective stalled past
the timeout, and NCCL's watchdog then ends the process. The default group, used by the main thread for
setup, barriers and logging, has a long timeout (``RPP_DIST_MAIN_TIMEOUT_S``, default 1800 s): rank 0
may legitimately keep the others waiting at a barrier while it writes a checkpoint.

Attributes:
    DEFAULT_TIMEOUT_S: Gradient-collective timeout when ``RPP_DIST_TIMEOUT_S`` is unset.
    DEFAULT_MAIN_TIMEOUT_S: Main-thread collective timeout when ``RPP_DIST_MAIN_TIMEOUT_S`` is unset.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Deque, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from roundpipe import backend, optim_stream
from roundpipe import device as device_mod
from roundpipe.attribute import LayerAttribute, ParamAttribute
from roundpipe.roundpipe import RoundPipe, RoundPipeBase
from roundpipe.scheduler import ModelExecutePlan
from roundpipe.threads import report_failure, thread_exception_print_lock
from roundpipe.transfer import host_grad

logger = logging.getLogger("roundpipe")

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAIN_TIMEOUT_S = 1800.0
_NCCL_GRACE_S = 30.0  # NCCL groups time out this much later than RPP_DIST_TIMEOUT_S (see _CollectiveMonitor)

T = TypeVar("T")


class DataParallelError(RuntimeError):
    """A data-parallel collective failed (a peer died, stalled past the timeout, or disagrees)."""


# -------------------------------------------------------------------------------------------------
# Process group setup (torchrun environment)
# -------------------------------------------------------------------------------------------------


_timeouts_in_use: Dict[str, float] = {}  # what init_from_env used, by environment variable


def _timeout_from_env(name: str, default: float) -> float:
    if name in _timeouts_in_use:
        return _timeouts_in_use[name]
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds, e.g. {name}=120") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: must be positive (a dead or stalled rank must not hang the others)")
    return value


def timeout_s() -> float:
    """Timeout of the gradient collectives (optimizer thread): ``RPP_DIST_TIMEOUT_S``, default 60 s.

    Short on purpose: ranks meet there every step, so waiting longer than a step or two means a peer
    is stuck. Raise it if a rank can legitimately lag that long (first-step compilation skew).
    """
    return _timeout_from_env("RPP_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def main_timeout_s() -> float:
    """Timeout of the main thread's collectives (setup, barriers): ``RPP_DIST_MAIN_TIMEOUT_S``, default
    1800 s, long enough for rank 0 to write a checkpoint while the others wait at a barrier."""
    return _timeout_from_env("RPP_DIST_MAIN_TIMEOUT_S", DEFAULT_MAIN_TIMEOUT_S)


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
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
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
    if local_world_size <= 1 or os.environ.get("RPP_DEVICES", "").strip() or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    per = count // local_world_size
    if per == 0:
        raise ValueError(
            f"{local_world_size} ranks on this host but only {count} GPU(s); use --nproc-per-node {count} or fewer, "
            "or set RPP_DEVICES per rank"
        )
    ids = list(range(local_rank * per, (local_rank + 1) * per))
    os.environ["RPP_DEVICES"] = "cuda:" + ",".join(str(i) for i in ids)
    torch.cuda.set_device(ids[0])  # NCCL in the default group (if asked for) binds to this GPU
    from roundpipe import device

    if device.device_list:  # created before the split: re-create from the new RPP_DEVICES
        device.reset_devices()


def init_from_env(
    backend: Optional[str] = None, timeout: Optional[float] = None, main_timeout: Optional[float] = None, assign_devices: bool = True
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
    backend = backend or os.environ.get("RPP_DIST_BACKEND", "").strip() or "gloo"
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    if assign_devices:
        _assign_local_devices(local_rank, local_world)
    secs = timeout if timeout is not None else timeout_s()
    main_secs = main_timeout if main_timeout is not None else main_timeout_s()
    if secs <= 0 or main_secs <= 0:
        raise ValueError(f"timeout={secs}, main_timeout={main_secs}: must be positive (a dead rank must not hang the others)")
    _timeouts_in_use.update(RPP_DIST_TIMEOUT_S=secs, RPP_DIST_MAIN_TIMEOUT_S=main_secs)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=main_secs), init_method="env://")
    logger.info(
        "distributed: rank %d/%d (local %d/%d), backend %s, timeouts: gradients %gs, main thread %gs",
        rank, world, local_rank, local_world, backend, secs, main_secs,
    )
    return current_env()


def destroy() -> None:
    """Tear the default group down (end of training); a no-op when not initialized."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Whether this rank logs, writes metrics and saves checkpoints (rank 0, or a single process)."""
    return get_rank() == 0


# Main-thread helpers. They use the default group, which the optimizer thread never touches (it has its
# own group), so they may run while an asynchronous step is reducing gradients.


def barrier() -> None:
    """Wait for every rank (e.g. rank 0 finished writing a checkpoint); a no-op in a single process.

    On gloo a monitored barrier: after the main timeout it names the ranks that never arrived.
    """
    if get_world_size() == 1:
        return
    if "gloo" in str(dist.get_backend()):
        dist.monitored_barrier(timeout=timedelta(seconds=main_timeout_s()), wait_all_ranks=True)
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` of rank ``src`` on every rank (picklable, small: configs, paths, step numbers)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_scalars(values: Sequence[float], op: Literal["sum", "mean", "max", "min"] = "sum") -> List[float]:
    """Reduce a few numbers over the ranks in float64 (losses, token counts for logging)."""
    vals = [float(v) for v in values]
    if get_world_size() == 1:
        return vals
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    if op == "mean":
        t /= get_world_size()
    return t.tolist()


def any_across_ranks(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: for decisions every rank must take together (skip a step
    with a non-finite loss, stop after this step), since a rank that skips ``model.step`` alone would
    leave the others waiting in the gradient all-reduce."""
    return bool(all_reduce_scalars([1.0 if flag else 0.0], "max")[0])


def assert_same_across_ranks(value: Any, what: str) -> None:
    """Raise on every rank if ``value`` (picklable) differs between ranks, naming the ranks."""
    if get_world_size() == 1:
        return
    gathered: List[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, value)
    if any(v != gathered[0] for v in gathered):
        detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(gathered))
        raise DataParallelError(f"{what} differs between ranks ({detail})")


def shard_bounds(n: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """``[start, stop)`` of rank's contiguous block of ``n`` items: ``[r*n//W, (r+1)*n//W)``.

    Contiguous blocks (not strides): concatenating the ranks' blocks in rank order gives back the
    global batch, which is what makes a W-rank step equal a one-process step on that batch.
    """
    r = get_rank() if rank is None else rank
    w = get_world_size() if world_size is None else world_size
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in 0..{w - 1}")
    return r * n // w, (r + 1) * n // w


_device_reductions: Dict[int, str] = {}  # live reduce_on="device" models in this process: id -> name


def _check_rows(n: int, world_size: Optional[int]) -> None:
    """Device reduction: every rank needs at least one row (see :func:`shard`)."""
    w = get_world_size() if world_size is None else world_size
    if _device_reductions and n < w:
        names = ", ".join(repr(v) for v in _device_reductions.values())
        empty = [r for r in range(w) if shard_bounds(n, r, w)[0] == shard_bounds(n, r, w)[1]]
        raise DataParallelError(
            f"shard: a batch of {n} rows for {w} ranks leaves rank(s) {empty} without rows; with "
            f"reduce_on='device' (model {names}) every rank must run every training call, so every rank needs at least one "
            "row: use a global batch of at least one row per rank, or reduce_on='host' (then skip the call on an empty share)"
        )


def shard(data: Any, rank: Optional[int] = None, world_size: Optional[int] = None) -> Any:
    """This rank's contiguous share (see :func:`shard_bounds`) of ``data`` along its first dimension.

    ``int n`` -> ``range`` of indices; tensor, list, range or array -> slice; ``Mapping`` -> the same keys
    with each value sharded; ``tuple`` -> each element sharded (a batch such as ``(input_ids, labels)``);
    ``None`` -> ``None``.
    Shares differ by at most one item when ``len`` is not divisible by the world size; then normalise
    the loss by the global count (:meth:`DataParallel.normalize_by`) for an exact global mean.

    With a model reducing on the devices (``reduce_on="device"``) every rank must run every training
    call, so a batch with fewer rows than ranks raises :class:`DataParallelError` here, on every rank
    (all compute the same bounds), instead of failing later on one rank only.
    """
    if data is None:
        return None  # an absent field of a batch (e.g. attention_mask=None) stays absent
    if isinstance(data, bool):
        raise TypeError("shard: expected a count, sequence, tensor, mapping or tuple, got a bool")
    if isinstance(data, int):
        return range(*shard_bounds(data, rank, world_size))
    if isinstance(data, Mapping):
        return type(data)({k: shard(v, rank, world_size) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and not isinstance(data, str):
        return tuple(shard(v, rank, world_size) for v in data)
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ValueError("shard: a 0-dim tensor has no rows to split")
        _check_rows(data.shape[0], world_size)
        a, b = shard_bounds(data.shape[0], rank, world_size)
        return data[a:b]
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (str, bytes)):
        _check_rows(len(data), world_size)
        a, b = shard_bounds(len(data), rank, world_size)
        return data[a:b]
    raise TypeError(f"shard: cannot split a {type(data).__name__}")


# -------------------------------------------------------------------------------------------------
# The gradient reducer
# -------------------------------------------------------------------------------------------------


ReduceOn = Literal["auto", "host", "device"]


@dataclass
class _Bucket:
    """Gradients reduced by one collective: several small ones packed into a flat buffer, or one large
    gradient reduced where it lies (``packed`` False)."""

    index: int
    units: Tuple[int, int]  # lowest and highest unit (layer) whose gradients it holds
    params: List[nn.Parameter]
    dtype: torch.dtype
    numel: int
    packed: bool
    buffer: Optional[torch.Tensor] = None
    work: Any = None


@dataclass
class DataParallelStats:
    """Counters of the gradient reduction (read them after ``synchronize()``).

    Attributes:
        steps: Optimizer steps reduced.
        collectives: Collectives issued (metadata, order checks and device reductions included).
        bytes: Gradient bytes all-reduced (this rank's input size).
        comm_s: Host time blocked in collectives: the optimizer thread's (host reduction, setup and
            packing included) plus, on CPU workers, the device threads' (device reduction).
        last_step_s: Host reduction: wall time of the last step's reduction, first to last unit
            (waiting for the slowest rank included). Device reduction: the sum over the last step's
            layer reductions of their time on the device, from this rank's gradients being ready to
            the reduced result (waiting for the other ranks included; layers on different devices
            overlap, so this can exceed the wall time).
        history: ``last_step_s`` of the recent steps (the last 4096).
    """

    steps: int = 0
    collectives: int = 0
    bytes: int = 0
    comm_s: float = 0.0
    last_step_s: float = 0.0
    history: Deque[float] = field(default_factory=lambda: deque(maxlen=4096))


def _device_reduced(attr: LayerAttribute) -> bool:
    """Whether this unit's gradients are reduced on the devices (it has a ``device_grad_reducer``)."""
    return getattr(attr, "device_grad_reducer", None) is not None


class DataParallel:
    """The ``grad_reducer`` of a data-parallel RoundPipe model (built by :func:`enable_data_parallel`).

    ``reduce_on == "host"``: per optimizer step, on the optimizer thread, with units (layers) handed over
    one by one by the step kernel:

    1. At the first unit: wait until every unit's gradient download has landed (the backward is over
       when ``step()`` is called, so this costs nothing), then one small all-reduce of metadata: which
       parameters have a gradient on any rank, and the counts of :meth:`normalize_by`. A parameter
       without ``.grad`` on this rank but with one elsewhere contributes zeros, so every rank issues the
       same collectives with the same sizes; a parameter no rank computed a gradient for keeps
       ``.grad = None`` (the optimizer skips it, exactly as in one process).
    2. The gradients, in the order the kernel visits the units, are cut into buckets of about
       ``bucket_mb``: small gradients are packed into a reusable flat buffer (one collective instead of
       many: a gloo call costs ~0.1-2 ms whatever its size), a gradient larger than a bucket is reduced
       in place. Each rank's share is pre-multiplied by its weight (1/W for a mean) before the SUM.
    3. Up to ``max_in_flight`` buckets are in flight (gloo runs them on its own threads); when the
       kernel reaches unit i, the buckets holding unit i's gradients are waited for and unpacked, so the
       copy of unit i's gradients into the fp32 masters overlaps the reduction of later buckets.

    Units are recognised by their parameters, not by position: the kernel may visit them first to last
    or last to first (the order is inferred from the first unit with parameters; every rank runs the
    same kernel, so every rank infers the same order). The bucket layout depends only on the parameter
    list, that order and the metadata, which are identical on all ranks (checked at setup), never on
    timing, so ranks always agree on the sequence of collectives.

    ``reduce_on == "device"``: the gradients of the layers run by RoundPipe were already reduced on the
    devices during the backward (:class:`_DeviceReduction`); at the step this reducer only settles
    which parameters have a gradient anywhere, checks that every rank reduced the same layers in the
    same order, and reduces the remaining units (an ``AutoRoundPipe``'s host parameters) as above.

    Overlap (host): with ``model.step(..., is_async=True)`` the whole reduction runs while the devices
    compute the next iteration's forward (its backward waits for the last layer's gradients to be
    copied). The reduction does not start during the backward itself: the backward returns before
    ``step()`` can be called, shared-parameter gradients are only complete at its end, and with gradient
    accumulation only the last backward before a step should be reduced; see docs/multi-node.md.
    """

    def __init__(
        self,
        model: RoundPipeBase,
        group: Any,
        bucket_mb: float = 25.0,
        op: Literal["mean", "sum"] = "mean",
        reduce_dtype: Optional[torch.dtype] = None,
        max_in_flight: int = 2,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be positive")
        if op not in ("mean", "sum"):
            raise ValueError(f"op={op!r}: expected 'mean' or 'sum'")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: must be at least 1")
        self.model = model
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.op = op
        self.reduce_dtype = reduce_dtype
        self.max_in_flight = max_in_flight
        self.stats = DataParallelStats()
        self.stats_lock = threading.Lock()  # device threads count their collectives too
        # Where the layers' gradients are reduced; the device part is attached by enable_data_parallel.
        self.reduce_on: Literal["host", "device"] = "host"
        self.device: Optional[_DeviceReduction] = None
        # Per-step state, owned by the optimizer thread.
        self._cursor = 0
        self._units: List[Tuple[LayerAttribute, List[nn.Parameter]]] = []
        self._unit_index: Dict[Tuple[int, ...], int] = {}
        self._seen: set = set()
        self._reduced: List[Tuple[int, nn.Parameter]] = []
        self._planned = False
        self._buckets: List[_Bucket] = []
        self._need: Dict[int, int] = {}  # per unit: buckets [0, need) must be done before its grads are copied
        self._issued = 0
        self._done = 0
        self._in_flight: Deque[_Bucket] = deque()
        self._free: Dict[torch.dtype, List[torch.Tensor]] = {}
        self._weight = 1.0
        self._pending_count: Optional[float] = None
        self._pending_weight: Optional[float] = None
        self._broken: Optional[BaseException] = None
        self._t_step = 0.0

    # ---- public ------------------------------------------------------------------------------------
    def normalize_by(self, count: float) -> None:
        """Weight this rank's gradients by ``count / (sum of all ranks' counts)`` in the next step
        instead of ``1/W``.

        For losses that are a *local* mean (``train_step`` divides by this rank's token count; the CLI
        by its step's token count): ``sum_r (n_r/N) * (S_r/n_r) = (sum_r S_r) / N``, the mean over all
        ranks' tokens, which is exactly the one-process loss of the concatenated batch even when the
        ranks count different numbers of tokens (padding, loss masks, uneven shards). With equal counts
        it changes nothing (``n/N = 1/W``).

        Call it on every rank, once per step, before the step's first forward/backward: that order
        works with both ``reduce_on`` modes. With ``reduce_on="host"`` it may also come later, up to
        ``model.step``: the counts are all-reduced on the optimizer thread inside the step's metadata
        collective (queued on the optimizer stream now, it applies to the next step kernel whatever the
        asynchronous step is still doing). With ``reduce_on="device"`` the weight multiplies this
        rank's gradients on the device before they are reduced in the backward, so the counts are
        exchanged now (main thread); called after the step's backward it raises
        :class:`DataParallelError` on every rank, unless all counts are equal (then the default weight
        already applied is the right one).
        """
        count = float(count)
        if not count >= 0:
            raise ValueError(f"normalize_by({count}): the count must be >= 0")
        if self.device is not None:
            self.device.normalize_by(count)
            return
        optim_stream.launch_optim_kernel(self._set_count, count)

    def on_step_launch(self) -> None:
        """Main-thread hook of ``model.step`` (``RoundPipeBase.step``): the step boundary. The device
        reduction starts a new step here (default weight again, ``normalize_by`` allowed again)."""
        if self.device is not None:
            self.device.on_step_launch()

    def close(self) -> None:
        """Stop reducing (the model trains locally again). Call on every rank after ``model.synchronize()``."""
        if self.device is not None:
            self.device.uninstall()
            self.device = None
        if self.model.grad_reducer is self:
            self.model.grad_reducer = None

    # ---- optimizer thread --------------------------------------------------------------------------
    def _set_count(self, count: float) -> None:
        if self._pending_count is not None:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by called twice before one model.step")
        self._pending_count = count

    def _set_weight(self, weight: float) -> None:
        """Device reduction: this rank's ``normalize_by`` weight, for the units reduced here on the host."""
        self._pending_weight = weight

    def __call__(self, params: List[nn.Parameter]) -> None:
        """``grad_reducer`` hook: called once for each unit of a step, on the optimizer thread."""
        if self._broken is not None:
            raise DataParallelError(f"rank {self.global_rank}: data parallel stopped after an earlier failure: {self._broken}") from self._broken
        try:
            if self._cursor == 0:
                self._begin_step()
            t0 = time.perf_counter()
            u = self._identify(params)
            if u is not None:
                if not self._planned:
                    self._plan(first=u)
                self._finish_through(self._need.get(u, 0))
                self._issue_ahead()  # keep the network busy while the kernel copies this unit's gradients
            self._cursor += 1
            if self._cursor == len(self._units):
                self._finish_through(len(self._buckets))
                self._end_step()
            self.stats.comm_s += time.perf_counter() - t0
        except BaseException as exc:
            self._broken = exc
            self._reset_step()
            raise

    def _identify(self, params: List[nn.Parameter]) -> Optional[int]:
        """The unit the kernel hands over, recognised by its parameters (None: a unit without any)."""
        if not params:
            return None  # nothing to reduce or copy
        u = self._unit_index.get(tuple(id(p) for p in params))
        if u is None or u in self._seen or self._cursor >= len(self._units):
            raise DataParallelError(
                f"rank {self.global_rank}: grad_reducer called with an unexpected unit (call #{self._cursor} of the step); "
                "was requires_grad changed during training without model.synchronize()?"
            )
        self._seen.add(u)
        return u

    def _begin_step(self) -> None:
        t0 = time.perf_counter()
        self._t_step = t0
        self._units = self.model._optim_units()
        self._unit_index = {tuple(id(p) for p in ps): u for u, (_, ps) in enumerate(self._units) if ps}
        self._seen = set()
        # Every unit's gradients must be on the host before the metadata says who has which gradient.
        # step() is called after the backward has returned, so these waits return at once.
        for attr, _ in self._units:
            attr.grad_download_started.wait()
            attr.grad_downloaded.synchronize()
        count, self._pending_count = self._pending_count, None
        weight_given, self._pending_weight = self._pending_weight, None
        if self.device is not None:
            # The device layers were reduced during the backward: settle presence, check the order.
            self.device.finish_step(self._units)
            entries = [(u, p) for u, (attr, ps) in enumerate(self._units) if not _device_reduced(attr) for p in ps]
        else:
            entries = [(u, p) for u, (_, ps) in enumerate(self._units) for p in ps]
        self._reduced, self._buckets, self._need = [], [], {}
        self._issued = self._done = 0
        self._planned = True
        self._weight = 1.0
        # Nothing to exchange with one rank; in device mode, nothing left on the host (identical on all
        # ranks: the units come from the same model everywhere).
        if self.world_size == 1 or (self.device is not None and not entries):
            self.stats.comm_s += time.perf_counter() - t0
            return
        weight, present = self._exchange_metadata(entries, count)
        if self.device is not None:  # normalize_by was handled on the main thread (same weight as the devices)
            weight = weight_given if weight_given is not None else self.device.default_weight
        # Identical on all ranks from here on: the list of reduced parameters and the bucket layout.
        reduced = [(u, p) for (u, p), keep in zip(entries, present) if keep]
        for _, p in reduced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a gradient elsewhere, none here: contribute zeros
        self._weight = weight
        self._reduced = reduced
        self._planned = not reduced
        self.stats.comm_s += time.perf_counter() - t0

    def _exchange_metadata(self, entries: List[Tuple[int, nn.Parameter]], count: Optional[float]) -> Tuple[float, List[bool]]:
        """One float64 all-reduce: [normalize_by set?, count, has-grad flag per parameter]."""
        meta = torch.zeros(2 + len(entries), dtype=torch.float64)
        if count is not None:
            meta[0], meta[1] = 1.0, count
        meta[2:] = torch.tensor([p.grad is not None for _, p in entries], dtype=torch.float64)
        units = (min(u for u, _ in entries), max(u for u, _ in entries))
        self._collective(meta, "metadata all_reduce", units).wait()
        users = int(meta[0].item())
        if users not in (0, self.world_size):
            raise DataParallelError(f"rank {self.global_rank}: normalize_by was called on {users} of {self.world_size} ranks for this step; call it on every rank or none")
        if users:
            total = float(meta[1].item())
            if total <= 0:
                raise DataParallelError(f"rank {self.global_rank}: normalize_by counts sum to {total} over all ranks; nothing to average")
            weight = count / total  # type: ignore[operator]
        else:
            weight = 1.0 / self.world_size if self.op == "mean" else 1.0
        return weight, [bool(f > 0) for f in meta[2:].tolist()]

    def _plan(self, first: int) -> None:
        """Cut the reduced gradients into buckets in the order the kernel visits the units (inferred
        from ``first``, the first unit with parameters it handed over); record per unit how many
        buckets must be done before its gradients may be copied."""
        with_params = [u for u, (_, ps) in enumerate(self._units) if ps]
        backwards = len(with_params) > 1 and first == with_params[-1]
        # A stable sort keeps each unit's parameters in their order.
        reduced = sorted(self._reduced, key=lambda e: -e[0] if backwards else e[0])
        buckets: List[_Bucket] = []
        cur: List[Tuple[int, nn.Parameter]] = []
        cur_bytes = 0

        def close() -> None:
            nonlocal cur, cur_bytes
            if cur:
                dtype = self.reduce_dtype or cur[0][1].grad.dtype
                us = [u for u, _ in cur]
                buckets.append(_Bucket(len(buckets), (min(us), max(us)), [p for _, p in cur], dtype, sum(p.numel() for _, p in cur), packed=True))
            cur, cur_bytes = [], 0

        for u, p in reduced:
            g = p.grad
            dtype = self.reduce_dtype or g.dtype
            nbytes = g.numel() * dtype.itemsize
            if nbytes >= self.bucket_bytes and g.is_contiguous() and dtype == g.dtype:
                close()  # a large gradient is its own bucket, reduced in place (no copy)
                buckets.append(_Bucket(len(buckets), (u, u), [p], dtype, g.numel(), packed=False))
                continue
            if cur and (cur_bytes + nbytes > self.bucket_bytes or dtype != (self.reduce_dtype or cur[0][1].grad.dtype)):
                close()
            cur.append((u, p))
            cur_bytes += nbytes
        close()
        owner = {id(p): u for u, p in reduced}
        need: Dict[int, int] = {}
        for b in buckets:
            for p in b.params:
                need[owner[id(p)]] = b.index + 1  # buckets are issued and finished in order
        self._buckets, self._need, self._planned = buckets, need, True
        self._issued = self._done = 0

    def _collective(self, t: torch.Tensor, what: str, units: Tuple[int, int]) -> Any:
        """Issue an async SUM all-reduce on the data-parallel group; errors name rank and layers."""
        self._count_collective(0)
        try:
            return _Work(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True), self, what, units, t.numel() * t.element_size())
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self._error(what, units, t.numel() * t.element_size(), 0.0, exc) from exc

    def _count_collective(self, nbytes: int) -> None:
        with self.stats_lock:
            self.stats.collectives += 1
            self.stats.bytes += nbytes

    def _error(self, what: str, units: Tuple[int, int], nbytes: int, waited: float, exc: BaseException) -> DataParallelError:
        return DataParallelError(
            f"rank {self.global_rank}/{dist.get_world_size()}: {what} of the gradients of layers {units[0]}-{units[1]} "
            f"({nbytes / 2**20:.2f} MiB) failed after {waited:.1f} s (collective timeout {timeout_s():g} s, RPP_DIST_TIMEOUT_S): "
            f"{_first_line(exc)}. Another rank probably died or stalled; its own log says why."
        )

    def _issue(self, bucket: _Bucket) -> None:
        if bucket.packed:
            pool = self._free.setdefault(bucket.dtype, [])
            buf = pool.pop() if pool else torch.empty(max(self.bucket_bytes // bucket.dtype.itemsize, bucket.numel), dtype=bucket.dtype)
            if buf.numel() < bucket.numel:  # only with reduce_dtype and a gradient above the bucket size
                buf = torch.empty(bucket.numel, dtype=bucket.dtype)
            bucket.buffer = buf
            flat, off = buf[: bucket.numel], 0
            for p in bucket.params:
                n = p.grad.numel()
                flat[off : off + n].copy_(p.grad.reshape(-1))
                off += n
            target = flat
        else:
            target = bucket.params[0].grad
        if self._weight != 1.0:
            target.mul_(self._weight)
        bucket.work = self._collective(target, f"all_reduce of gradient bucket {bucket.index + 1}/{len(self._buckets)}", bucket.units)
        self._in_flight.append(bucket)

    def _finish_oldest(self) -> None:
        bucket = self._in_flight.popleft()
        bucket.work.wait()
        with self.stats_lock:
            self.stats.bytes += bucket.numel * bucket.dtype.itemsize
        if bucket.packed:
            assert bucket.buffer is not None
            off = 0
            with torch.no_grad():
                for p in bucket.params:
                    n = p.grad.numel()
                    p.grad.copy_(bucket.buffer[off : off + n].view_as(p.grad))
                    off += n
            self._free[bucket.dtype].append(bucket.buffer)
            bucket.buffer = None
        bucket.work = None
        self._done += 1

    def _issue_ahead(self) -> None:
        while self._issued < len(self._buckets) and self._issued - self._done < self.max_in_flight:
            self._issue(self._buckets[self._issued])
            self._issued += 1

    def _finish_through(self, n: int) -> None:
        """Complete buckets ``[0, n)`` in order, issuing ahead as the window allows."""
        while self._done < n:
            self._issue_ahead()
            self._finish_oldest()

    def _end_step(self) -> None:
        assert self._done == len(self._buckets)
        self.stats.steps += 1
        wall = time.perf_counter() - self._t_step
        self.stats.last_step_s = self.device.last_step_s if self.device is not None else wall
        self.stats.history.append(self.stats.last_step_s)
        self._cursor = 0
        self._units, self._buckets, self._reduced = [], [], []

    def _reset_step(self) -> None:
        self._cursor = 0
        self._units, self._buckets, self._reduced, self._need = [], [], [], {}
        self._unit_index, self._seen = {}, set()
        self._in_flight.clear()
        self._issued = self._done = 0


class _Work:
    """An issued collective; ``wait()`` turns a failure or timeout into a :class:`DataParallelError`."""

    def __init__(self, work: Any, owner: DataParallel, what: str, units: Tuple[int, int], nbytes: int) -> None:
        self.work, self.owner, self.what, self.units, self.nbytes = work, owner, what, units, nbytes
        self.t0 = time.perf_counter()

    def wait(self) -> None:
        try:
            self.work.wait()
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self.owner._error(self.what, self.units, self.nbytes, time.perf_counter() - self.t0, exc) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else repr(exc)}"


# -------------------------------------------------------------------------------------------------
# Reduction on the devices (reduce_on="device")
# -------------------------------------------------------------------------------------------------
#
# Streams (CUDA). ``transfer.download_layer`` calls ``_LayerSlot`` at the end of a backward job with
# the download stream current, right after ``downstream.wait_stream(compute_stream)``: everything
# below is queued on ``downstream`` behind the layer's backward of all microbatches, so the packing
# reads final gradients. ``dist.all_reduce`` on an NCCL group makes NCCL's internal stream wait for the
# current stream (``downstream``) before the collective, and ``work.wait()`` makes the current stream
# wait for the collective's end, without blocking the host. So the unpacking and the gradient download
# queued next on ``downstream`` see the reduced values, the device thread never blocks (it goes on
# issuing its next job while NCCL runs), and the compute stream never waits for communication
# (later downloads on this device, e.g. of its next job's activations, queue behind it: that is where
# a rank waits for a slower peer). No deadlock: host threads never wait for NCCL (only the main thread,
# after the backward, and the optimizer thread wait for downloads), and every stream dependency,
# collectives included, points to work of an earlier-dispatched job, in the same dispatch order on
# every rank, so the dependency graph across ranks has no cycle. Tensors stay alive as long as streams use
# them: the flat buffers are allocated on ``downstream`` (the caching allocator reuses them only for
# later work on that stream) and NCCL records its own use of its inputs; device gradients are released
# through the memory manager, which waits for ``downstream``. Host buffers read by an upload on
# ``downstream`` (the seeds) are written again only by the gradient download queued after it on the
# same stream. On CPU workers the same code runs with gloo; ``work.wait()`` blocks the device thread.
#
# Order. Collectives on one group must be issued in the same order on every rank. There is one group per
# local device index k (device k of every rank), used only by device k's controller thread, which
# reduces each layer at the end of its job: the sequence is the device's job order. Jobs go to the
# devices round robin in dispatch order (``run._assign``), fixed before launch, so device k runs the same
# jobs on every rank when every rank (1) runs the same training calls in the same order, (2) with the
# same plan and (3) from the same round-robin position, and (4) has the same number of devices. Before
# every training call, the ranks all-gather their step and call index, model, device count, round-robin
# position and plan (one small gloo collective on the main thread): a mismatch in (1) or (4) raises on every
# rank; for (2) and (3) every rank adopts rank 0's plan and position (auto plans are re-tuned from each
# rank's own timings, and rank-local inference calls, e.g. an evaluation on rank 0, move the position).
# At each step a hash of the sequence of layers each device reduced is compared between ranks before
# the optimizer runs, so a disagreement that slipped through can never be summed into the weights.


class _LayerSlot:
    """One layer's device reduction: the ``device_grad_reducer`` hook that ``transfer.download_layer``
    calls, and the layer's presence counts between the download and the step.

    Attributes:
        index: Position of the layer among all reduced layers (the same on every rank).
        flags_host: Host copy of the layer's last reduced presence counts (one per trainable parameter).
        flags_params: The host parameters the counts refer to, in order.
        flags_valid: Whether the counts belong to the current step (cleared when the step reads them).
    """

    def __init__(self, red: "_DeviceReduction", index: int, model_name: str, layer_id: int) -> None:
        self.red = red
        self.index = index
        self.model_name = model_name
        self.layer_id = layer_id
        self.flags_host: Optional[torch.Tensor] = None
        self.flags_params: List[nn.Parameter] = []
        self.flags_valid = False

    def __call__(self, cpu_layer: nn.Module, gpu_layer: nn.Module, layer_id: int, device: Any) -> None:
        self.red.reduce_layer(self, cpu_layer, gpu_layer, layer_id, device)


class _PlanAgreement:
    """``RoundPipe._rpp_plan_hook``: the plan every rank runs (see :meth:`_DeviceReduction.agree_plan`)."""

    def __init__(self, red: "_DeviceReduction", index: int) -> None:
        self.red = red
        self.index = index

    def __call__(self, model: RoundPipe, run_type: str, plan: ModelExecutePlan) -> ModelExecutePlan:
        return self.red.agree_plan(self.index, model, run_type, plan)


@dataclass
class _LayerBucket:
    """One collective of a layer's reduction: packed (flat buffer, presence counts first in bucket 0)
    or one large gradient reduced in place. Depends only on the layer's parameters: the same on all ranks."""

    indices: List[int]
    dtype: torch.dtype
    numel: int
    packed: bool
    nflags: int = 0


_RUN_CODES = {"train": 1, "fused": 2}
# step, call within the step, model, layers, devices, round-robin position, run type, forward groups, backward groups
_HEADER = 9


def _trainable_pairs(cpu_layer: nn.Module, gpu_layer: nn.Module) -> List[Tuple[nn.Parameter, nn.Parameter]]:
    """(host parameter, device copy) of each trainable parameter of a layer, once each, in the order
    ``download_layer`` visits them (same model on every rank: same order)."""
    out: List[Tuple[nn.Parameter, nn.Parameter]] = []
    seen: set = set()
    for host_mod, dev_mod in zip(cpu_layer.modules(), gpu_layer.modules()):
        for name, p in host_mod._parameters.items():
            if p is None or not p.requires_grad or id(p) in seen:
                continue
            dp = dev_mod._parameters.get(name)
            if dp is None:
                continue
            seen.add(id(p))
            out.append((p, dp))
    return out


def _staging_host(values: List[float], dtype: torch.dtype) -> torch.Tensor:
    """A small host tensor to upload (pinned where CUDA is used, so the copy is asynchronous; the
    caching host allocator keeps it until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if backend.pin_enabled() else t


def _add_from_host(dst: torch.Tensor, host: torch.Tensor, chunk_elems: int) -> None:
    """``dst += host`` (``dst`` flat on the device, ``host`` on the host), through a staging buffer of
    at most ``chunk_elems`` so a large gradient needs no full-size temporary. Runs on the current stream:
    each chunk's upload is queued before its add, and the staging buffer is reused only by later work
    on the same stream."""
    src = host.detach().reshape(-1)
    if dst.device.type == "cpu":
        dst.add_(src)
        return
    n = src.numel()
    step = max(1, min(n, chunk_elems))
    stage = torch.empty(step, dtype=src.dtype, device=dst.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        stage[: b - a].copy_(src[a:b], non_blocking=True)
        dst[a:b].add_(stage[: b - a])


def _encode_plan(header: List[int], plan: ModelExecutePlan, max_layers: int) -> torch.Tensor:
    t = torch.full((_HEADER + 4 * max_layers,), -1, dtype=torch.int64)
    t[:_HEADER] = torch.tensor(header, dtype=torch.int64)
    for base, groups in ((_HEADER, plan.fwd_plan), (_HEADER + 2 * max_layers, plan.bwd_plan)):
        for i, r in enumerate(groups):
            t[base + 2 * i], t[base + 2 * i + 1] = r.start, r.stop
    return t


def _decode_plan(row: List[int], max_layers: int) -> ModelExecutePlan:
    def groups(base: int, n: int) -> List[range]:
        return [range(row[base + 2 * i], row[base + 2 * i + 1]) for i in range(n)]

    return ModelExecutePlan(groups(_HEADER, row[7]), groups(_HEADER + 2 * max_layers, row[8]))


class _CollectiveMonitor:
    """Names a stalled NCCL collective (CUDA only).

    NCCL collectives never block the host, so a peer that stalls shows as a hang in some later event
    synchronisation, and NCCL's own watchdog only aborts the process after the group timeout without
    saying which layer was being reduced. This thread watches the reductions in issue order: once one
    has been waiting on the device for ``RPP_DIST_TIMEOUT_S`` since this rank's gradients were ready,
    it prints a :class:`DataParallelError` naming rank, collective, layer and device, and records it in
    RoundPipe's failure slot. The NCCL groups' own timeout is longer (``_NCCL_GRACE_S`` more), so the
    message comes first; NCCL's watchdog then aborts the communicators and ends the process (no hang).
    """

    def __init__(self, red: "_DeviceReduction") -> None:
        self.red = red
        self.pending: Deque[List[Any]] = deque()  # [ready event, done event, what, bytes, first seen ready]
        self.lock = threading.Lock()
        self.fired = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="roundpipe-dp-monitor", daemon=True)
        self.thread.start()

    def add(self, ready: Any, done: Any, what: str, nbytes: int) -> None:
        with self.lock:
            self.pending.append([ready, done, what, nbytes, None])

    def stop(self) -> None:
        self.stopped = True

    def _run(self) -> None:
        while not self.stopped:
            time.sleep(min(1.0, timeout_s() / 10))
            with self.lock:
                while self.pending and self.pending[0][1].query():
                    self.pending.popleft()
                head = self.pending[0] if self.pending else None
            if head is None or self.fired:
                continue
            if head[4] is None:
                if head[0].query():
                    head[4] = time.monotonic()
                continue
            waited = time.monotonic() - head[4]
            if waited > timeout_s():
                self.fired = True
                err = self.red.error(head[2], head[3], waited, TimeoutError("the collective is still running on the device"))
                with thread_exception_print_lock:
                    print(f"roundpipe: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                report_failure(err)


class _DeviceReduction:
    """``reduce_on="device"``: each layer's gradients are all-reduced on its device at the end of its
    backward job, before the gradient download (streams and ordering: the comment above).

    Per layer, the collectives are a few flat buckets (``bucket_mb``; presence counts first) plus, in
    place, each gradient larger than a bucket: every rank issues them with the same sizes, in the same
    order, whatever its data.

    Weights and accumulation. Between calls of a step the host gradients hold the reduced, weighted sum
    of what the step computed so far, ``H = sum over calls and ranks of w_r * g``, on every rank.
    Uploads do not seed device gradients in this mode (``transfer.upload_layers``), so after the
    backward a device gradient holds this call's local gradient ``g_r`` alone; the reduction sends
    ``w_r * g_r`` from every rank plus ``H`` from rank 0 only, and the SUM is ``H + sum_r w_r g_r``:
    exact for any number of ranks and calls, with no division. ``w_r`` is 1/W (``op="mean"``), 1
    (``op="sum"``), or ``n_r / N`` after ``normalize_by`` (which therefore must come before the backward).
    Tied parameters: each layer reduces its own share; ``reduce_shared_grads`` adds the reduced shares.

    Presence. A parameter without a gradient on this rank contributes zeros (the layout is fixed); the
    first bucket carries one count per parameter (ranks and calls that had a gradient; rank 0 adds the
    counts of the step's earlier calls). At the step a parameter whose count is 0 gets ``.grad = None``,
    as in one process (the optimizer skips it).
    """

    def __init__(self, owner: DataParallel, groups: List[Any], control: Any, backend_name: str, num_devices: int, max_layers: int) -> None:
        self.owner = owner
        self.groups = groups
        self.control = control
        self.backend = backend_name
        self.num_devices = num_devices
        self.max_layers = max(1, max_layers)
        self.rank = dist.get_rank(control)
        self.world_size = dist.get_world_size(control)
        self.global_rank = dist.get_rank()
        self.default_weight = 1.0 / self.world_size if owner.op == "mean" else 1.0
        # Main-thread state of the current step. Device threads read ``weight`` during a call; the main
        # thread changes it only between calls (normalize_by, step), when no device job is running.
        self.weight = self.default_weight
        self.count_given = False
        self.reduced_this_step = False  # set by device threads, read by the main thread after the call
        self.steps = 0  # model.step calls so far (main thread)
        self.calls = 0  # training calls in the current step (main thread)
        self.slots: List[_LayerSlot] = []
        self.models: List[RoundPipe] = []
        self.lock = threading.Lock()
        self.sequence: Dict[int, List[int]] = {}  # device index -> slots reduced there since the last step
        self.timings: List[Any] = []  # per layer reduction since the last step: seconds, or (ready, done) events
        self.last_step_s = 0.0
        self.adopted_plans = 0  # training calls that ran rank 0's plan instead of this rank's own
        self.monitor: Optional[_CollectiveMonitor] = _CollectiveMonitor(self) if backend_name == "nccl" else None

    # ---- setup ---------------------------------------------------------------------------------------
    def install(self, models: List[RoundPipe]) -> None:
        """Hook every layer of ``models`` (download and upload) and their plan resolution."""
        for i, rp in enumerate(models):
            rp.__dict__["_rpp_plan_hook"] = _PlanAgreement(self, i)
            for lid, attr in enumerate(rp.layer_attrs):
                slot = _LayerSlot(self, len(self.slots), rp.name, lid)
                attr.device_grad_reducer = slot  # type: ignore[attr-defined]  # read by roundpipe.transfer
                self.slots.append(slot)
        self.models = list(models)
        _device_reductions[id(self)] = self.owner.model.name

    def uninstall(self) -> None:
        _device_reductions.pop(id(self), None)
        for rp in self.models:
            rp.__dict__.pop("_rpp_plan_hook", None)
            for attr in rp.layer_attrs:
                attr.device_grad_reducer = None  # type: ignore[attr-defined]
        self.models, self.slots = [], []
        if self.monitor is not None:
            self.monitor.stop()

    def error(self, what: str, nbytes: int, waited: float, exc: BaseException) -> DataParallelError:
        return DataParallelError(
            f"rank {self.global_rank}/{self.world_size}: {what} ({nbytes / 2**20:.2f} MiB) failed after {waited:.1f} s "
            f"(collective timeout {timeout_s():g} s, RPP_DIST_TIMEOUT_S): {_first_line(exc)}. "
            "Another rank probably died or stalled; its own log says why."
        )

    def _main_collective(self, fn: Any, what: str) -> None:
        """A collective of the main thread on the control group; failures name the rank and the call."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise DataParallelError(
                f"rank {self.global_rank}/{self.world_size}: {what} failed after {time.perf_counter() - t0:.1f} s "
                f"(collective timeout {timeout_s():g} s, RPP_DIST_TIMEOUT_S): {_first_line(exc)}. "
                "Another rank probably died or stalled; its own log says why."
            ) from exc

    # ---- main thread ---------------------------------------------------------------------------------
    def on_step_launch(self) -> None:
        self.weight = self.default_weight
        self.count_given = False
        self.reduced_this_step = False
        self.steps += 1
        self.calls = 0

    def normalize_by(self, count: float) -> None:
        """All-gather the counts now (the weight is applied on the devices during the backward)."""
        if self.count_given:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by called twice before one model.step")
        mine = torch.tensor([count, 1.0 if self.reduced_this_step else 0.0], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._main_collective(lambda: dist.all_gather(rows, mine, group=self.control), "normalize_by's all_gather of the counts")
        counts = [float(r[0]) for r in rows]
        total = sum(counts)
        if total <= 0:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by counts sum to {total} over all ranks; nothing to average")
        # Every rank sees every count, so every rank takes the same decision below.
        if any(float(r[1]) > 0 for r in rows) and any(c / total != self.weight for c in counts):
            raise DataParallelError(
                f"rank {self.global_rank}/{self.world_size}: normalize_by came after this step's backward had already reduced the "
                f"gradients on the devices (reduce_on='device') with the weight {self.weight:g} per rank, but the counts "
                f"({', '.join(f'{c:g}' for c in counts)}) need count/{total:g} per rank. Call normalize_by before the step's "
                "first forward/backward (that order works with both reduce_on modes), or use reduce_on='host'"
            )
        self.weight = count / total
        self.count_given = True
        # Units reduced on the host (an AutoRoundPipe's host parameters) use the same weight at the step.
        optim_stream.launch_optim_kernel(self.owner._set_weight, self.weight)

    def agree_plan(self, index: int, model: RoundPipe, run_type: str, plan: ModelExecutePlan) -> ModelExecutePlan:
        """The plan of a training call, the same on every rank (rank 0's); see the comment above."""
        if run_type not in _RUN_CODES:
            return plan  # inference: no gradients, no collectives (rank-local evaluation is fine)
        n_dev = device_mod.get_num_devices()
        header = [self.steps, self.calls, index, model.num_layers, n_dev, device_mod.cur_device, _RUN_CODES[run_type], len(plan.fwd_plan), len(plan.bwd_plan)]
        mine = _encode_plan(header, plan, self.max_layers)
        rows_t = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._main_collective(
            lambda: dist.all_gather(rows_t, mine, group=self.control),
            f"plan agreement before training call {self.calls + 1} of step {self.steps + 1} (model {model.name!r})",
        )
        self.calls += 1
        rows = [r.tolist() for r in rows_t]
        self._check_same(rows, model)
        agreed = _decode_plan(rows[0], self.max_layers)
        # Jobs take devices round robin from device.cur_device (run._assign): start where rank 0 starts,
        # so device k gets the same jobs, and issues the same collectives in the same order, everywhere.
        device_mod.cur_device = int(rows[0][5]) % n_dev
        if agreed != plan:
            self.adopted_plans += 1
            if self.adopted_plans == 1:
                logger.info("data parallel: rank %d runs rank 0's plan %s instead of its own %s (ranks must run the same plan "
                            "with reduce_on='device'; auto plans follow each rank's timings)", self.global_rank, agreed, plan)
        return agreed

    def _check_same(self, rows: List[List[int]], model: RoundPipe) -> None:
        """Raise on every rank (all see the same rows) when ranks are not at the same call."""

        def differ(k: int) -> bool:
            return any(r[k] != rows[0][k] for r in rows)

        def per_rank(k: int) -> str:
            return ", ".join(f"rank {i}: {r[k]}" for i, r in enumerate(rows))

        where = f"rank {self.global_rank}/{self.world_size}: training call {self.calls} of step {self.steps + 1} (model {model.name!r})"
        if differ(0) or differ(1):
            at = ", ".join(f"rank {i}: call {r[1] + 1} of step {r[0] + 1}" for i, r in enumerate(rows))
            raise DataParallelError(
                f"{where}: the ranks are at different training calls ({at}). With reduce_on='device' "
                "every rank must run every forward/backward, since the gradients are reduced inside it: a rank may not skip "
                "a call (e.g. for a share of the batch without rows or without trained tokens). Give every rank at least "
                "one row (weight its loss 0 if it has nothing to train on), or use reduce_on='host'"
            )
        if differ(4):
            raise DataParallelError(
                f"{where}: the ranks have different numbers of local devices ({per_rank(4)}); device k of each rank "
                "reduces with device k of the others, so every rank needs the same number (RPP_DEVICES)"
            )
        if differ(2) or differ(3) or differ(6):
            raise DataParallelError(
                f"{where}: the ranks run different calls (model index {per_rank(2)}; run type {per_rank(6)}); "
                "every rank must call the same models in the same order"
            )

    # ---- device threads --------------------------------------------------------------------------------
    def _layout(self, pairs: List[Tuple[nn.Parameter, nn.Parameter]]) -> List[_LayerBucket]:
        """Buckets of one layer: bucket 0 packed, starting with the presence counts; small gradients
        packed up to ``bucket_mb``; a gradient of at least ``bucket_mb`` (reduced in its own dtype)
        alone, in place."""
        rd = self.owner.reduce_dtype
        first = _LayerBucket([], rd or pairs[0][0].dtype, 0, packed=True, nflags=len(pairs))
        buckets = [first]
        cur = first
        limit = self.owner.bucket_bytes
        for i, (p, _) in enumerate(pairs):
            dtype = rd or p.dtype
            nbytes = p.numel() * dtype.itemsize
            if nbytes >= limit and dtype == p.dtype:
                buckets.append(_LayerBucket([i], dtype, p.numel(), packed=False))
                continue
            if cur.dtype != dtype or (cur.indices and (cur.numel + p.numel()) * dtype.itemsize > limit):
                cur = _LayerBucket([], dtype, 0, packed=True)
                buckets.append(cur)
            cur.indices.append(i)
            cur.numel += p.numel()
        return buckets

    def reduce_layer(self, slot: _LayerSlot, cpu_layer: nn.Module, gpu_layer: nn.Module, layer_id: int, device: Any) -> None:
        """All-reduce one layer's device gradients (SUM of weighted shares, plus rank 0's seed) in place,
        on the current (download) stream; see the class and the comment above for the reasoning."""
        pairs = _trainable_pairs(cpu_layer, gpu_layer)
        if not pairs:
            return
        k = getattr(device, "id", 0)
        if k >= len(self.groups):
            raise DataParallelError(
                f"rank {self.global_rank}: local device #{k} ({device}) has no data-parallel group: devices were re-created "
                f"after enable_data_parallel ({len(self.groups)} then); call it again after changing RPP_DEVICES"
            )
        group = self.groups[k]
        name = getattr(device, "name", str(k))
        what = f"all_reduce of the gradients of layer {layer_id} of model {slot.model_name!r} on device {name}"
        if hasattr(device, "location"):  # where a failure here is reported (DeviceManager._locate)
            device.location = f"model {slot.model_name!r}: data-parallel gradient all-reduce of layer {layer_id}"
        weight = self.weight
        seeding = self.rank == 0
        host_params = [p for p, _ in pairs]
        prev = slot.flags_host.tolist() if seeding and slot.flags_valid and slot.flags_params == host_params and slot.flags_host is not None else None
        flags = [(1.0 if dp.grad is not None else 0.0) + (prev[i] if prev is not None else 0.0) for i, (_, dp) in enumerate(pairs)]
        for _, dp in pairs:
            if dp.grad is None:
                dp.grad = torch.zeros_like(dp)  # a gradient elsewhere, none here: contribute zeros
        # Rank 0 adds what the step accumulated on the host so far (the reduced sum of earlier calls).
        seeds = [host_grad(p, layer_id) if seeding else None for p in host_params]
        cuda = device.device.type == "cuda" if hasattr(device, "device") else False
        t0 = time.perf_counter()
        ready = done = None
        targets: List[torch.Tensor] = []
        works: List[Any] = []
        nbytes = 0
        buckets = self._layout(pairs)
        for b in buckets:
            target = self._prepare(b, pairs, flags, seeds, weight)
            targets.append(target)
            nbytes += target.numel() * target.element_size()
            if ready is None and cuda:
                ready = torch.cuda.Event(enable_timing=True)
                ready.record()  # on the current stream: this rank's first bucket is ready
            try:
                works.append(dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group, async_op=True))
            except Exception as exc:  # noqa: BLE001 - reported with its context
                raise self.error(what, nbytes, time.perf_counter() - t0, exc) from exc
        for work in works:
            try:
                work.wait()  # NCCL: the current stream waits (no host block); gloo: blocks this thread
            except Exception as exc:  # noqa: BLE001 - reported with its context
                raise self.error(what, nbytes, time.perf_counter() - t0, exc) from exc
        if cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        for b, target in zip(buckets, targets):
            self._unpack(b, target, pairs, slot)
        slot.flags_params, slot.flags_valid = host_params, True
        with self.lock:
            self.reduced_this_step = True
            self.sequence.setdefault(k, []).append(slot.index)
            self.timings.append((ready, done) if cuda else time.perf_counter() - t0)
        with self.owner.stats_lock:
            self.owner.stats.collectives += len(works)
            self.owner.stats.bytes += nbytes
            if not cuda:
                self.owner.stats.comm_s += time.perf_counter() - t0
        if self.monitor is not None and ready is not None:
            self.monitor.add(ready, done, what, nbytes)

    def _prepare(self, b: _LayerBucket, pairs: List[Tuple[nn.Parameter, nn.Parameter]], flags: List[float], seeds: List[Optional[torch.Tensor]], weight: float) -> torch.Tensor:
        """This rank's input of one bucket: ``weight * gradient`` (+ rank 0's seed), counts first."""
        chunk = max(1, self.owner.bucket_bytes // b.dtype.itemsize)
        if not b.packed:
            dp = pairs[b.indices[0]][1]
            target = dp.grad if dp.grad.is_contiguous() else dp.grad.contiguous()
            if weight != 1.0:
                target.mul_(weight)
            seed = seeds[b.indices[0]]
            if seed is not None:
                _add_from_host(target.view(-1), seed, chunk)
            return target
        dev = pairs[0][1].device
        flat = torch.empty(b.nflags + b.numel, dtype=b.dtype, device=dev)
        if b.nflags:
            flat[: b.nflags].copy_(_staging_host(flags, b.dtype), non_blocking=True)
        off = b.nflags
        for i in b.indices:
            g = pairs[i][1].grad
            flat[off : off + g.numel()].copy_(g.reshape(-1))
            off += g.numel()
        if weight != 1.0 and b.numel:
            flat[b.nflags :].mul_(weight)
        off = b.nflags
        for i in b.indices:
            n = pairs[i][1].grad.numel()
            if seeds[i] is not None:
                _add_from_host(flat[off : off + n], seeds[i], chunk)  # type: ignore[arg-type]
            off += n
        return flat

    def _unpack(self, b: _LayerBucket, target: torch.Tensor, pairs: List[Tuple[nn.Parameter, nn.Parameter]], slot: _LayerSlot) -> None:
        """Reduced values back into the device gradients (downloaded next); counts to the host."""
        if not b.packed:
            dp = pairs[b.indices[0]][1]
            if target is not dp.grad:
                dp.grad.copy_(target.view_as(dp.grad))
            return
        if b.nflags:
            host = slot.flags_host
            if host is None or host.numel() != b.nflags or host.dtype != b.dtype:
                host = slot.flags_host = backend.empty_host_like(target[: b.nflags])
            # Lands before the layer's grad_downloaded event (recorded after this on the same stream),
            # which the step waits for before reading the counts.
            host.copy_(target[: b.nflags], non_blocking=target.device.type != "cpu")
        off = b.nflags
        for i in b.indices:
            g = pairs[i][1].grad
            g.copy_(target[off : off + g.numel()].view_as(g))
            off += g.numel()

    # ---- optimizer thread ----------------------------------------------------------------------------
    def finish_step(self, units: List[Tuple[LayerAttribute, List[nn.Parameter]]]) -> None:
        """At the step (all downloads landed): drop gradients no rank had, check that every rank reduced
        the same layers in the same order, and account the step's device time."""
        present: Dict[int, bool] = {}
        for slot in self.slots:
            if slot.flags_valid and slot.flags_host is not None:
                for p, f in zip(slot.flags_params, slot.flags_host.tolist()):
                    present[id(p)] = present.get(id(p), False) or f > 0
                slot.flags_valid = False  # the next call starts the next step's counts
        for attr, params in units:
            if _device_reduced(attr):
                for p in params:
                    if present.get(id(p)) is False:
                        p.grad = None  # no rank computed one: the optimizer skips it, as in one process
        with self.lock:
            sequence, self.sequence = self.sequence, {}
            timings, self.timings = self.timings, []
        self.last_step_s = sum(t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3 for t in timings)
        h = hashlib.sha256(repr(sorted(sequence.items())).encode()).digest()
        mine = torch.tensor([int.from_bytes(h[:8], "little", signed=True)], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.owner._count_collective(0)
        t0 = time.perf_counter()
        try:
            dist.all_gather(rows, mine, group=self.owner.group)
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise self.error("the step's check of the device reduction order (all_gather)", 0, time.perf_counter() - t0, exc) from exc
        bad = [r for r, t in enumerate(rows) if int(t) != int(rows[0])]
        if bad:
            raise DataParallelError(
                f"rank {self.global_rank}/{self.world_size}: the device gradient reductions of this step ran in a different order "
                f"on ranks {bad} than on rank 0, so gradients of different layers may have been summed; the step is refused. "
                "Every rank must run the same RoundPipe calls in the same order (no rank-local training calls between a "
                "forward and its backward)"
            )


# -------------------------------------------------------------------------------------------------
# Setup
# -------------------------------------------------------------------------------------------------


def _layout_signature(model: RoundPipeBase) -> str:
    """Hash of the reduction layout: units and their trainable parameters' shapes and dtypes."""
    h = hashlib.sha256()
    names = {id(p): n for n, p in model.model.named_parameters(remove_duplicate=False)}
    for u, (_, params) in enumerate(model._optim_units()):
        for p in params:
            h.update(f"{u}:{names.get(id(p), '?')}:{tuple(p.shape)}:{p.dtype}|".encode())
    return h.hexdigest()[:16]


def _broadcast_tensors(tensors: List[torch.Tensor], group: Any, bucket_bytes: int) -> None:
    """Broadcast host tensors from the group's rank 0, packed into flat buffers per dtype (few calls)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        i = 0
        while i < len(ts):
            chunk, size = [], 0
            while i < len(ts) and (not chunk or size + ts[i].numel() * ts[i].element_size() <= bucket_bytes):
                chunk.append(ts[i])
                size += ts[i].numel() * ts[i].element_size()
                i += 1
            flat = torch.cat([t.detach().reshape(-1) for t in chunk]) if len(chunk) > 1 else chunk[0].detach().reshape(-1).clone()
            dist.broadcast(flat, group=group, group_src=0)
            off = 0
            with torch.no_grad():
                for t in chunk:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def _choose_reduce_on(reduce_on: str, custom_group: bool) -> Tuple[Literal["host", "device"], Optional[str]]:
    """This rank's reduction mode and device backend (checked to agree across ranks by the caller).

    ``"auto"``: on the devices with NCCL when every local device is a GPU and NCCL is available (it is
    faster wherever GPUs talk over NVLink, InfiniBand or RoCE, and leaves the host cores to the
    optimizer), otherwise on the host with gloo. CPU workers reduce on the host under ``"auto"``:
    nothing is gained by moving their reduction; ``"device"`` still runs the device path there (gloo),
    which is how CI tests it.
    """
    if reduce_on not in ("auto", "host", "device"):
        raise ValueError(f"reduce_on={reduce_on!r}: expected 'auto', 'host' or 'device'")
    if reduce_on == "host" or (reduce_on == "auto" and custom_group):
        return "host", None
    device_mod.get_num_devices()  # creates the local devices (RPP_DEVICES) if needed
    kinds = {d.device.type for d in device_mod.device_list}
    if kinds == {"cuda"}:
        if dist.is_nccl_available():
            return "device", "nccl"
        if reduce_on == "device":
            raise RuntimeError("reduce_on='device' on GPUs needs NCCL, which this PyTorch build lacks; use reduce_on='host'")
        return "host", None
    if reduce_on == "auto":
        return "host", None
    if kinds == {"cpu"}:
        return "device", "gloo"
    raise ValueError(f"reduce_on='device' needs local devices of one kind, got {sorted(kinds)}")


def _setup_device_reduction(dp: DataParallel, model: RoundPipeBase, backend_name: str) -> _DeviceReduction:
    """Create the control group and one group per local device (every rank, same order: ``new_group``
    is a collective of the default group), connect them, and hook the model's layers."""
    secs = timeout_s()
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=secs))
    # NCCL's watchdog ends the process after the group timeout; ours names the layer first (monitor).
    grad_secs = secs + (_NCCL_GRACE_S if backend_name == "nccl" else 0.0)
    devices = list(device_mod.device_list)
    if backend_name == "nccl" and torch.cuda.current_device() not in [d.device.index for d in devices]:
        # This rank's GPUs came from RPP_DEVICES: make the first one current, so nothing NCCL or CUDA
        # does on the main thread lands on another rank's GPU (init_from_env does the same).
        torch.cuda.set_device(devices[0].device)
    groups = [dist.new_group(backend=backend_name, timeout=timedelta(seconds=grad_secs)) for _ in devices]
    world = dist.get_world_size()
    for k, (d, group) in enumerate(zip(devices, groups)):
        # Connect now, group by group in the same order on every rank (NCCL would otherwise create its
        # communicators lazily inside the first backward): a broken setup fails here, clearly.
        try:
            t = torch.ones(1, device=d.device)
            dist.all_reduce(t, group=group)
            got = float(t.item())  # synchronises with the collective
        except Exception as exc:  # noqa: BLE001 - reported with its context
            raise DataParallelError(f"rank {dist.get_rank()}/{world}: connecting the {backend_name} group of local device #{k} ({d.device}) failed: {_first_line(exc)}") from exc
        if got != world:
            raise DataParallelError(f"rank {dist.get_rank()}/{world}: the {backend_name} group of local device #{k} ({d.device}) summed {got:g} instead of {world}")
    models = [model] if isinstance(model, RoundPipe) else [m for m in model.model.modules() if isinstance(m, RoundPipe)]
    red = _DeviceReduction(dp, groups, control, backend_name, len(devices), max((m.num_layers for m in models), default=1))
    red.install(models)
    return red


def enable_data_parallel(
    model: RoundPipeBase,
    process_group: Any = None,
    bucket_mb: float = 25.0,
    backend: Literal["gloo", "auto"] = "auto",
    op: Literal["mean", "sum"] = "mean",
    reduce_dtype: Optional[torch.dtype] = None,
    broadcast_init: Literal["trainable", "all", "none"] = "trainable",
    max_in_flight: int = 2,
    reduce_on: ReduceOn = "auto",
) -> DataParallel:
    """Make ``model`` a data-parallel replica: its gradients are all-reduced over the ranks at every
    step (asynchronous or not), so all ranks take identical optimizer steps.

    Call it on every rank, after ``init_from_env()`` and before training, on the model whose ``step``
    you call (a ``RoundPipe``, a ``RoundPipeForCausalLM`` or an ``AutoRoundPipe`` root). Creating the
    optimizer before or after does not matter.

    Args:
        model: The RoundPipe model.
        process_group: Group to reduce host gradients over; default: a new gloo group of all ranks,
            used only by the optimizer thread (do not use a group that the main thread also issues
            collectives on). Only with ``reduce_on="host"`` (``"auto"`` then means host).
        bucket_mb: Target bucket size in MiB: small gradients are packed up to this size per collective.
        backend: Backend of the host gradient group: ``"gloo"``/``"auto"`` (host tensors need gloo).
            For NCCL on the GPUs use ``reduce_on="device"``.
        op: ``"mean"`` (like DDP: for losses that are a per-rank mean over equal counts) or ``"sum"``
            (the loss is already normalised by the global count). :meth:`DataParallel.normalize_by`
            overrides both for a step.
        reduce_dtype: Reduce in this dtype (e.g. float32 for bf16 gradients and many ranks); default:
            the gradients' own dtype (half the traffic of fp32 for bf16).
        broadcast_init: Copy rank 0's ``"trainable"`` parameters (optimizer masters when they exist)
            and all buffers to the other ranks, so replicas start equal even if seeds differ (LoRA
            adapters are random); ``"all"`` adds frozen parameters; ``"none"`` skips it.
        max_in_flight: Host reduction: buckets in flight at once (2: pack/unpack overlaps communication).
        reduce_on: Where the gradients of the layers RoundPipe runs are reduced.
            ``"host"``: after the download, on the optimizer thread, with gloo (any devices; the
            asynchronous step hides it behind the next forward). ``"device"``: on each device at the end
            of the layer's backward, before the download, overlapped with the rest of the backward: NCCL
            on GPUs, gloo on CPU workers; every rank then needs the same number of local devices and
            must run every training call (the plan is agreed across ranks automatically), and
            :meth:`DataParallel.normalize_by` must come before the step's backward. ``"auto"``:
            ``"device"`` when every local device is a GPU and NCCL is available, else ``"host"``.
            Parameters used outside RoundPipe (an ``AutoRoundPipe``'s host parameters) are always
            reduced on the host. All ranks must resolve to the same mode (checked).

    Returns:
        The :class:`DataParallel` reducer (``normalize_by``, ``stats``, ``reduce_on``, ``close``).
    """
    if not isinstance(model, RoundPipeBase):
        raise TypeError(f"enable_data_parallel needs a RoundPipe model (RoundPipe, AutoRoundPipe, wrap_model_to_roundpipe), got {type(model).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("enable_data_parallel: torch.distributed is not initialized; launch with torchrun and call roundpipe.distributed.init_from_env() first")
    if backend not in ("gloo", "auto"):
        raise NotImplementedError(
            f"backend={backend!r}: this is the backend of the host gradient group, which needs gloo; to reduce with NCCL on "
            "the GPUs before the download, pass reduce_on='device' (docs/multi-node.md)"
        )
    if bucket_mb <= 0 or max_in_flight < 1 or op not in ("mean", "sum"):
        raise ValueError(f"bucket_mb={bucket_mb} (> 0), max_in_flight={max_in_flight} (>= 1), op={op!r} ('mean' or 'sum')")
    if isinstance(model.grad_reducer, DataParallel):
        raise ValueError(f"model {model.name!r} is already data parallel")
    if model.grad_reducer is not None:
        raise ValueError(f"model {model.name!r} already has a grad_reducer ({model.grad_reducer!r})")
    if reduce_on == "device" and process_group is not None:
        raise ValueError("reduce_on='device' reduces over all ranks (one group per local device); process_group works with reduce_on='host' only")
    n_devices = device_mod.get_num_devices()  # creates the local devices (RPP_DEVICES) if needed
    mode, device_backend = _choose_reduce_on(reduce_on, process_group is not None)
    if process_group is None:
        # A collective on the default group: every rank creates it, in the same order. The setup below
        # runs on the default group too (long timeout: ranks may finish loading the model at very
        # different times); the new group, with the short timeout, is the optimizer thread's alone.
        setup_group = None
        process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s()))
    else:
        setup_group = process_group
        # A group object exists only on its members; check it can reduce host tensors.
        pg_backend = str(dist.get_backend(process_group))
        if "gloo" not in pg_backend:
            raise ValueError(f"process_group has backend {pg_backend!r}; host gradients need a gloo group (dist.new_group(backend='gloo'))")
    # Nothing may be in flight on the optimizer thread while the main thread uses the group below.
    optim_stream.synchronize_optim()
    ranks = dist.get_world_size(process_group)
    signature = _layout_signature(model)
    gathered: List[Any] = [None] * ranks
    dist.all_gather_object(gathered, (signature, mode, device_backend, n_devices), group=setup_group)
    if any(s[0] != gathered[0][0] for s in gathered):
        bad = [r for r, s in enumerate(gathered) if s[0] != gathered[0][0]]
        raise DataParallelError(
            f"model {model.name!r}: the trainable parameters differ between ranks (group ranks {bad} differ from rank 0): "
            "every rank must build the same model, LoRA config and requires_grad settings"
        )
    if any(s[1:3] != gathered[0][1:3] for s in gathered):
        detail = ", ".join(f"rank {r}: {s[1]}" + (f" ({s[2]})" if s[2] else "") for r, s in enumerate(gathered))
        raise DataParallelError(f"reduce_on={reduce_on!r} resolves differently on the ranks ({detail}); pass reduce_on='host' or 'device' explicitly")
    if mode == "device" and any(s[3] != gathered[0][3] for s in gathered):
        detail = ", ".join(f"rank {r}: {s[3]}" for r, s in enumerate(gathered))
        raise DataParallelError(
            f"reduce_on='device' needs the same number of local devices on every rank ({detail}): device k of each rank "
            "reduces with device k of the others. Set RPP_DEVICES alike, or use reduce_on='host'"
        )
    if broadcast_init != "none" and ranks > 1:
        _broadcast_initial_state(model, setup_group, broadcast_init, int(bucket_mb * 2**20))
    dp = DataParallel(model, process_group, bucket_mb=bucket_mb, op=op, reduce_dtype=reduce_dtype, max_in_flight=max_in_flight)
    dp.reduce_on = mode
    if mode == "device" and ranks > 1:
        assert device_backend is not None
        dp.device = _setup_device_reduction(dp, model, device_backend)
    model.grad_reducer = dp
    if mode == "device":
        logger.info("data parallel: model %r over %d ranks, reduced on the devices (%s, %d per rank, buckets of %g MiB, %s)",
                    model.name, ranks, device_backend, n_devices, bucket_mb, op)
    else:
        logger.info("data parallel: model %r over %d ranks, reduced on the host (gloo, buckets of %g MiB, %s)", model.name, ranks, bucket_mb, op)
    return dp


def _broadcast_initial_state(model: RoundPipeBase, group: Any, what: str, bucket_bytes: int) -> None:
    """Rank 0's parameters (masters where they exist, which are then copied into the model) and buffers."""
    tensors: List[torch.Tensor] = []
    masters = False
    seen = set()
    for p in model.model.parameters():
        if id(p) in seen or (not p.requires_grad and what != "all"):
            continue
        seen.add(id(p))
        optim = ParamAttribute.get(p).optim if ParamAttribute.has(p) else None
        tensors.append(optim.data if optim is not None else p.data)
        masters = masters or optim is not None
    # Buffers (running stats, rotary tables): gloo has no bool reduction; those are left as built.
    tensors.extend(b for b in model.model.buffers() if b.dtype != torch.bool)
    _broadcast_tensors(tensors, group, bucket_bytes)
    if masters:
        model.sync_optim_param()  # the model parameters (uploaded to devices) follow the masters


__all__ = [
    "DEFAULT_MAIN_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "DataParallel",
    "DataParallelError",
    "DataParallelStats",
    "DistEnv",
    "ReduceOn",
    "all_reduce_scalars",
    "any_across_ranks",
    "assert_same_across_ranks",
    "barrier",
    "broadcast_object",
    "current_env",
    "destroy",
    "enable_data_parallel",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "is_main_process",
    "main_timeout_s",
    "shard",
    "shard_bounds",
    "timeout_s",
]
