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

* ``"host"``: :class:`DataParallel` is the model's ``grad_sync`` (``roundpipe.runtime.grad_sync``;
  see ``roundpipe.host.step``) and all-reduces the host gradients with gloo on the optimizer thread, after
  they have landed on the host and before they are copied into the optimizer's master copies. It works on any
  accelerator, CPU workers included, adds no device traffic, and the asynchronous step hides it behind the next
  forward. It runs on a *dedicated* gloo group that only the optimizer thread uses: collectives on one
  group must be issued in the same order on every rank, and the main thread (logging, barriers,
  checkpoints) could otherwise interleave its collectives differently on different ranks.
* ``"device"``: each layer's gradients are all-reduced on its device at the end of the layer's backward
  job, before the gradient download (``device_reduce``, hooked into ``transfer.download_layer``):
  NCCL on GPUs (NVLink or InfiniBand instead of host memory and TCP; no host thread blocks, the
  collective is ordered on the device's gradient stream), gloo on CPU workers (how CI tests it). One group per
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

The package, one module per concern (they import one another directly, never through this ``__init__``,
which only re-exports the public names):

* ``env``: the torchrun environment, ``init_from_env``, the timeouts, ``destroy``;
* ``errors``: :class:`DataParallelError` and the wording of a failed collective;
* ``collectives``: the main thread's small collectives (ranks, barriers, scalars, agreement checks);
* ``sharding``: each rank's rows of a global batch;
* ``reduction``: what both reductions share (options, :class:`DataParallelStats`);
* ``host_reduce``: the bucketed gloo reduction on the optimizer thread;
* ``device_reduce``: the reduction on the devices, its streams and its collective monitor;
* ``device_order``: why the ranks' device collectives come in the same order (the plan agreement);
* ``optim_shard``: the host optimizer step shared by the ranks of a host (``shard_optimizer=True``);
* ``data_parallel``: :class:`DataParallel`, the model's ``grad_sync`` (``roundpipe.runtime.grad_sync.GradSync``);
* ``enable``: :func:`enable_data_parallel`.

Attributes:
    DEFAULT_TIMEOUT_S: Gradient-collective timeout when ``RPP_DIST_TIMEOUT_S`` is unset.
    DEFAULT_MAIN_TIMEOUT_S: Main-thread collective timeout when ``RPP_DIST_MAIN_TIMEOUT_S`` is unset.
"""

from __future__ import annotations

from roundpipe.distributed.collectives import (
    all_reduce_scalars,
    any_across_ranks,
    assert_same_across_ranks,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_main_process,
)
from roundpipe.distributed.data_parallel import DataParallel
from roundpipe.distributed.enable import enable_data_parallel
from roundpipe.distributed.env import (
    DEFAULT_MAIN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    DistEnv,
    current_env,
    destroy,
    init_from_env,
    main_timeout_s,
    timeout_s,
)
from roundpipe.distributed.errors import DataParallelError
from roundpipe.distributed.reduction import DataParallelStats, ReduceOn
from roundpipe.distributed.sharding import shard, shard_bounds

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
