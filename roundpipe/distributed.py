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

* ``"host"``: :class:`DataParallel` is the model's ``grad_sync`` (``roundpipe.grad_sync``; see ``roundpipe.optim.step``)
  and all-reduces the host gradients with gloo on the optimizer thread, after they have landed on the
  host and before they are copied into the optimizer's master copies. It works on any accelerator,
  CPU workers included, adds no device traffic, and the asynchronous step hides it behind the next
  forward. It runs on a *dedicated* gloo group that only the optimizer thread uses: collectives on one
  group must be issued in the same order on every rank, and the main thread (logging, barriers,
  checkpoints) could otherwise interleave its collectives differently on different ranks.
* ``"device"``: each layer's gradients are all-reduced on its device at the end of the layer's backward
  job, before the gradient download (``roundpipe.dp_device``, hooked into ``transfer.download_layer``):
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
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from roundpipe import settings
from roundpipe.optim import thread as optim_thread
from roundpipe import device as device_mod
from roundpipe.attribute import LayerAttribute, ParamAttribute
from roundpipe.roundpipe import RoundPipe, RoundPipeBase

if TYPE_CHECKING:
    from roundpipe.dp_device import _DeviceReduction

logger = logging.getLogger("roundpipe")

DEFAULT_TIMEOUT_S = settings.DIST_TIMEOUT_S.default
DEFAULT_MAIN_TIMEOUT_S = settings.DIST_MAIN_TIMEOUT_S.default
_NCCL_GRACE_S = 30.0  # NCCL groups time out this much later than RPP_DIST_TIMEOUT_S (see _CollectiveMonitor)

T = TypeVar("T")


class DataParallelError(RuntimeError):
    """A data-parallel collective failed (a peer died, stalled past the timeout, or disagrees)."""


# -------------------------------------------------------------------------------------------------
# Process group setup (torchrun environment)
# -------------------------------------------------------------------------------------------------


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
    if local_world_size <= 1 or settings.DEVICES.is_set() or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    per = count // local_world_size
    if per == 0:
        raise ValueError(
            f"{local_world_size} ranks on this host but only {count} GPU(s); use --nproc-per-node {count} or fewer, "
            "or set RPP_DEVICES per rank"
        )
    ids = list(range(local_rank * per, (local_rank + 1) * per))
    torch.cuda.set_device(ids[0])  # NCCL in the default group (if asked for) binds to this GPU
    settings.configure(devices="cuda:" + ",".join(str(i) for i in ids))  # re-creates existing workers


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
    backend = backend or settings.DIST_BACKEND.get()
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



class DataParallel:
    """The ``grad_sync`` of a data-parallel RoundPipe model (built by :func:`enable_data_parallel`).

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
        optim_thread.submit(self._set_count, count)

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
        if self.model.grad_sync is self:
            self.model.grad_sync = None

    # ---- optimizer thread --------------------------------------------------------------------------
    def _set_count(self, count: float) -> None:
        if self._pending_count is not None:
            raise DataParallelError(f"rank {self.global_rank}: normalize_by called twice before one model.step")
        self._pending_count = count

    def _set_weight(self, weight: float) -> None:
        """Device reduction: this rank's ``normalize_by`` weight, for the units reduced here on the host."""
        self._pending_weight = weight

    def agree_plan(self, model: Any, run_type: str, plan: Any) -> Any:
        """``GradSync.agree_plan``: with the device reduction, the plan every rank runs (rank 0's)."""
        if self.device is None:
            return plan
        return self.device.agree_plan(model, run_type, plan)

    def layer_reducer(self, model: Any, layer_id: int) -> Any:
        """``GradSync.layer_reducer``: the device reduction of ``model``'s layer, if reduced there."""
        return None if self.device is None else self.device.layer_reducer(model, layer_id)

    def reduce_host(self, params: List[nn.Parameter]) -> None:
        """``GradSync.reduce_host``: called once for each unit of a step, on the optimizer thread."""
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
                f"rank {self.global_rank}: reduce_host called with an unexpected unit (call #{self._cursor} of the step); "
                "was requires_grad changed during training without model.synchronize()?"
            )
        self._seen.add(u)
        return u

    def _begin_step(self) -> None:
        t0 = time.perf_counter()
        self._t_step = t0
        self._units = self.model.optim_units()
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
            entries = [(u, p) for u, (attr, ps) in enumerate(self._units) if not self.device.reduces(attr) for p in ps]
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
# Setup
# -------------------------------------------------------------------------------------------------


def _layout_signature(model: RoundPipeBase) -> str:
    """Hash of the reduction layout: units and their trainable parameters' shapes and dtypes."""
    h = hashlib.sha256()
    names = {id(p): n for n, p in model.model.named_parameters(remove_duplicate=False)}
    for u, (_, params) in enumerate(model.optim_units()):
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
    from roundpipe.dp_device import _DeviceReduction
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
    if isinstance(model.grad_sync, DataParallel):
        raise ValueError(f"model {model.name!r} is already data parallel")
    if model.grad_sync is not None:
        raise ValueError(f"model {model.name!r} already has a grad_sync ({model.grad_sync!r})")
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
    optim_thread.synchronize()
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
    model.grad_sync = dp
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
