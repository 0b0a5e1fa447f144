"""``enable_data_parallel``: checks that every rank builds the same model and resolves the same mode,
creates the gradient groups, copies rank 0's initial state to the other ranks, and installs the
:class:`~roundpipe.distributed.data_parallel.DataParallel` as the model's ``grad_sync``."""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
import torch.distributed as dist

from roundpipe.devices import device as device_mod
from roundpipe.distributed.data_parallel import DataParallel
from roundpipe.distributed.device_reduce import setup_device_reduction
from roundpipe.distributed.env import timeout_s
from roundpipe.distributed.errors import DataParallelError
from roundpipe.distributed.optim_shard import OptimizerShard
from roundpipe.distributed.reduction import ReduceOn
from roundpipe.host import optim_thread
from roundpipe.host.attribute import ParamAttribute
from roundpipe.roundpipe import RoundPipeBase

logger = logging.getLogger("roundpipe")


def layout_signature(model: RoundPipeBase) -> str:
    """Hash of the reduction layout: units and their trainable parameters' shapes and dtypes."""
    h = hashlib.sha256()
    names = {id(p): n for n, p in model.model.named_parameters(remove_duplicate=False)}
    for u, (_, params) in enumerate(model.optim_units()):
        for p in params:
            h.update(f"{u}:{names.get(id(p), '?')}:{tuple(p.shape)}:{p.dtype}|".encode())
    return h.hexdigest()[:16]


def broadcast_tensors(tensors: List[torch.Tensor], group: Any, bucket_bytes: int) -> None:
    """Broadcast host tensors from the group's rank 0, packed into flat buffers per dtype (few calls)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        i = 0
        while i < len(ts):
            chunk: List[torch.Tensor] = []
            size = 0
            while i < len(ts) and (not chunk or size + ts[i].numel() * ts[i].element_size() <= bucket_bytes):
                chunk.append(ts[i])
                size += ts[i].numel() * ts[i].element_size()
                i += 1
            flat = (
                torch.cat([t.detach().reshape(-1) for t in chunk])
                if len(chunk) > 1
                else chunk[0].detach().reshape(-1).clone()
            )
            dist.broadcast(flat, group=group, group_src=0)
            off = 0
            with torch.no_grad():
                for t in chunk:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def choose_reduce_on(reduce_on: str, custom_group: bool) -> Tuple[Literal["host", "device"], Optional[str]]:
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
            raise RuntimeError(
                "reduce_on='device' on GPUs needs NCCL, which this PyTorch build lacks; use reduce_on='host'"
            )
        return "host", None
    if reduce_on == "auto":
        return "host", None
    if kinds == {"cpu"}:
        return "device", "gloo"
    raise ValueError(f"reduce_on='device' needs local devices of one kind, got {sorted(kinds)}")


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
    shard_optimizer: bool = False,
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
        shard_optimizer: Share the host optimizer step among the ranks of each host (ZeRO stage 1 on
            the host; ``roundpipe.distributed.optim_shard``): one copy of the fp32 masters per host in
            shared memory, each layer's moments and update on one rank only, every rank copying the
            updated masters into its weights. Ranks of one host then stream 1/W of the optimizer's memory
            traffic each instead of all of it, and hold 1/W of the moments. Results are bit-identical to
            the unsharded step. Checkpoints: ``optimizer.state_dict()`` holds this rank's moments only;
            :meth:`DataParallel.full_optimizer_state_dict` gathers them. Not with ``RPP_STEP_MODE=streamed``
            or a custom ``process_group``.

    Returns:
        The :class:`DataParallel` reducer (``normalize_by``, ``stats``, ``reduce_on``, ``close``).
    """
    if not isinstance(model, RoundPipeBase):
        raise TypeError(
            "enable_data_parallel needs a RoundPipe model (RoundPipe, AutoRoundPipe, "
            f"wrap_model_to_roundpipe), got {type(model).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "enable_data_parallel: torch.distributed is not initialized; launch with torchrun and call "
            "roundpipe.distributed.init_from_env() first"
        )
    if backend not in ("gloo", "auto"):
        raise NotImplementedError(
            f"backend={backend!r}: this is the backend of the host gradient group, which needs gloo; to reduce "
            "with NCCL on "
            "the GPUs before the download, pass reduce_on='device' (docs/multi-node.md)"
        )
    if bucket_mb <= 0 or max_in_flight < 1 or op not in ("mean", "sum"):
        raise ValueError(
            f"bucket_mb={bucket_mb} (> 0), max_in_flight={max_in_flight} (>= 1), op={op!r} ('mean' or 'sum')"
        )
    if isinstance(model.grad_sync, DataParallel):
        raise ValueError(f"model {model.name!r} is already data parallel")
    if model.grad_sync is not None:
        raise ValueError(f"model {model.name!r} already has a grad_sync ({model.grad_sync!r})")
    if shard_optimizer and process_group is not None:
        raise ValueError(
            "shard_optimizer=True shares the step among all ranks of each host (the default group); drop "
            "process_group or the sharding"
        )
    if reduce_on == "device" and process_group is not None:
        raise ValueError(
            "reduce_on='device' reduces over all ranks (one group per local device); process_group works with "
            "reduce_on='host' only"
        )
    n_devices = device_mod.get_num_devices()  # creates the local devices (RPP_DEVICES) if needed
    mode, device_backend = choose_reduce_on(reduce_on, process_group is not None)
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
            raise ValueError(
                f"process_group has backend {pg_backend!r}; host gradients need a gloo group "
                "(dist.new_group(backend='gloo'))"
            )
    # Nothing may be in flight on the optimizer thread while the main thread uses the group below.
    optim_thread.synchronize()
    ranks = dist.get_world_size(process_group)
    signature = layout_signature(model)
    gathered: List[Any] = [None] * ranks
    dist.all_gather_object(gathered, (signature, mode, device_backend, n_devices), group=setup_group)
    if any(s[0] != gathered[0][0] for s in gathered):
        bad = [r for r, s in enumerate(gathered) if s[0] != gathered[0][0]]
        raise DataParallelError(
            f"model {model.name!r}: the trainable parameters differ between ranks (group ranks {bad} differ "
            "from rank 0): "
            "every rank must build the same model, LoRA config and requires_grad settings"
        )
    if any(s[1:3] != gathered[0][1:3] for s in gathered):
        detail = ", ".join(f"rank {r}: {s[1]}" + (f" ({s[2]})" if s[2] else "") for r, s in enumerate(gathered))
        raise DataParallelError(
            f"reduce_on={reduce_on!r} resolves differently on the ranks ({detail}); pass reduce_on='host' or "
            "'device' explicitly"
        )
    if mode == "device" and any(s[3] != gathered[0][3] for s in gathered):
        detail = ", ".join(f"rank {r}: {s[3]}" for r, s in enumerate(gathered))
        raise DataParallelError(
            f"reduce_on='device' needs the same number of local devices on every rank ({detail}): device k of "
            "each rank "
            "reduces with device k of the others. Set RPP_DEVICES alike, or use reduce_on='host'"
        )
    if broadcast_init != "none" and ranks > 1:
        broadcast_initial_state(model, setup_group, broadcast_init, int(bucket_mb * 2**20))
    dp = DataParallel(
        model, process_group, bucket_mb=bucket_mb, op=op, reduce_dtype=reduce_dtype, max_in_flight=max_in_flight
    )
    dp.reduce_on = mode
    if mode == "device" and ranks > 1:
        assert device_backend is not None
        dp.attach_device(
            setup_device_reduction(model, dp.options, dp.counter, process_group, dp.host.set_weight, device_backend)
        )
    if shard_optimizer:
        dp.step_sync = OptimizerShard(model, setup_group)
    model.grad_sync = dp
    if mode == "device":
        logger.info(
            "data parallel: model %r over %d ranks, reduced on the devices (%s, %d per rank, buckets of %g MiB, %s)",
            model.name,
            ranks,
            device_backend,
            n_devices,
            bucket_mb,
            op,
        )
    else:
        logger.info(
            "data parallel: model %r over %d ranks, reduced on the host (gloo, buckets of %g MiB, %s)",
            model.name,
            ranks,
            bucket_mb,
            op,
        )
    return dp


def broadcast_initial_state(model: RoundPipeBase, group: Any, what: str, bucket_bytes: int) -> None:
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
    broadcast_tensors(tensors, group, bucket_bytes)
    if masters:
        model.sync_optim_param()  # the model parameters (uploaded to devices) follow the masters
