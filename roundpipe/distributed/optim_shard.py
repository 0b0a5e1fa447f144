"""The host optimizer step sharded across the data-parallel ranks of one host
(``enable_data_parallel(shard_optimizer=True)``; ZeRO stage 1, on the host).

Why: without it every rank of a host runs the whole host optimizer step on the same reduced gradients,
so W ranks on one host stream W times the same optimizer traffic (Adam reads and writes about 26 bytes
per parameter) through one memory bus, and hold W copies of the fp32 masters and moments. Sharded:

* the optimizer copies (fp32 masters) of the whole model live *once per host*, in one shared memory
  segment (a ``memfd``) that every local rank maps;
* every optimizer unit (a layer's trainable parameters) is owned by one local rank (balanced by size);
  only the owner's optimizer steps it: right before each ``optimizer.step()`` (a torch optimizer step
  pre-hook, so gradient clipping in ``step_fn`` still sees every reduced gradient) the other ranks'
  optimizers find ``.grad = None`` there and skip the unit, creating no moments for it;
* every rank then copies every unit from the shared masters into its own model weights (the usual
  staging or copy of :mod:`roundpipe.host.step`), so replicas stay bit-identical.

Order: two barriers on a gloo group of the host's ranks, issued only by the optimizer threads, in the
same sequence on every rank (the optimizer thread runs the steps in order):

    step t:  gradients handed over (and reduced)
             -> barrier "read": every local rank has finished reading the masters of step t-1
                (its staging or copy into the model), so no owner overwrites what a peer still reads
             -> step_fn: each owner writes its units' masters
             -> barrier "written": every owner's writes are done (a collective is a full fence)
             -> every rank stages / copies all units from the masters

A master written by another process does not bump this process's version counter, which the step
protocol uses to tell whether the weights are current (``ParamBuffers.weights_current``): after the
"written" barrier the peers' masters are bumped by hand.

Checkpoints: the masters are complete on every rank; the moments of a unit only on its owner.
:meth:`OptimizerShard.full_state_dict` gathers them onto the host's first rank. Loading a full state
on every rank is fine: the first step drops the moments a rank does not own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe.distributed.env import timeout_s
from roundpipe.distributed.errors import DataParallelError, run_collective
from roundpipe.host import optim_thread
from roundpipe.host import state_reserve as reserve
from roundpipe.host.attribute import ParamAttribute
from roundpipe.roundpipe import RoundPipeBase

logger = logging.getLogger("roundpipe")

_ALIGN = 64  # bytes: every master starts at a cache-line boundary of the segment
Units = List[Tuple[Any, List[nn.Parameter]]]


def _host_key() -> str:
    """What identifies this host (hostname plus boot id: containers on different machines may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def assign_owners(sizes: List[int], ranks: int) -> List[int]:
    """Owner (0..ranks-1) of each unit: largest first to the least loaded rank (ties: the lowest), so the
    ranks step about the same number of parameters. Depends only on ``sizes``: every rank agrees."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[u] = r
        load[r] += sizes[u]
    return owner


# The shard whose step_fn runs on this thread (set by before_step_fn, cleared by after_step_fn); read by
# the optimizer step pre-hook, which torch calls for every optimizer of the process.
_active = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    shard: Optional[OptimizerShard] = getattr(_active, "shard", None)
    if shard is not None:
        shard.hide_unowned(optimizer)


def _install_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            register_optimizer_step_pre_hook(_step_pre_hook)
            _hook_installed = True


class OptimizerShard:
    """This rank's share of the host optimizer step (module docstring); the ``step_sync`` of a
    :class:`~roundpipe.distributed.data_parallel.DataParallel` (``roundpipe.host.protocol.StepSync``).

    Attributes:
        local_rank: This rank's index among the ranks of its host (0..local_size-1).
        local_size: Ranks of this host that share the masters.
        owned_params: Parameters (masters) this rank's optimizer steps.
        total_params: Parameters in the shared masters.
        hidden_steps: Optimizer steps whose unowned gradients the pre-hook hid (a check that it ran).
    """

    def __init__(self, model: RoundPipeBase, setup_group: Any) -> None:
        self.model = model
        self.hidden_steps = 0
        self.where = f"rank {dist.get_rank()}/{dist.get_world_size()}"
        # Every master exists before it is moved into the segment (they are created on first use).
        list(model.optim_parameters())
        units = [[ParamAttribute.get(p).optim for p in params] for _, params in model.optim_units()]
        masters: List[nn.Parameter] = [m for ms in units for m in ms if m is not None]
        # The ranks of this host (main thread, default group: every rank takes part in every new_group).
        keys: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, _host_key(), group=setup_group)
        hosts: Dict[str, List[int]] = {}
        for r, key in enumerate(keys):
            hosts.setdefault(key, []).append(r)
        self.group: Any = None
        for key in sorted(hosts, key=lambda k: hosts[k][0]):
            g = dist.new_group(hosts[key], backend="gloo", timeout=timedelta(seconds=timeout_s()))
            if dist.get_rank() in hosts[key]:
                self.group = g
        local = hosts[_host_key()]
        self.ranks = local
        self.local_rank, self.local_size = local.index(dist.get_rank()), len(local)
        # Who steps what, and where each master lies in the segment.
        sizes = [sum(m.numel() for m in ms if m is not None) for ms in units]
        owner_of_unit = assign_owners(sizes, self.local_size)
        self.owner: Dict[int, int] = {
            id(m): owner_of_unit[u] for u, ms in enumerate(units) for m in ms if m is not None
        }
        self.unowned = {mid for mid, r in self.owner.items() if r != self.local_rank}
        offsets, total = [], 0
        for m in masters:
            offsets.append(total)
            total += (m.numel() * m.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        self.segment = self._map_segment(max(total, _ALIGN), local, setup_group)
        # Each owner writes its own masters into the segment (identical on every rank after the initial
        # broadcast, but the owner's copy is the one its optimizer keeps writing), then all switch over.
        views = []
        for m, off in zip(masters, offsets):
            view = self.segment[off : off + m.numel() * m.element_size()].view(m.dtype).view(m.shape)
            if self.owner[id(m)] == self.local_rank:
                view.copy_(m.detach())
            views.append(view)
        dist.barrier(group=self.group)
        with torch.no_grad():
            for m, view in zip(masters, views):
                m.data = view
        self.masters = masters
        reserve.stepped_elsewhere(m for m in masters if id(m) in self.unowned)  # no moments built for them here
        # (master, where it lies in the segment, stepped by another rank): checked and bumped per step.
        self._masters_ptrs = [(m, m.data_ptr(), id(m) in self.unowned) for m in masters]
        self.total_params = sum(m.numel() for m in masters)
        self.owned_params = sum(m.numel() for m in masters if id(m) not in self.unowned)
        dist.barrier(group=self.group)
        _install_hook()
        logger.info(
            "data parallel: host optimizer sharded over %d local ranks; rank %d steps %.1f%% of %d parameters",
            self.local_size,
            self.local_rank,
            100.0 * self.owned_params / max(1, self.total_params),
            self.total_params,
        )

    def _map_segment(self, nbytes: int, local: List[int], setup_group: Any) -> torch.Tensor:
        """One shared memory segment of ``nbytes`` for the host's ranks: the host's first rank creates a
        memfd (no /dev/shm size limit; freed with the last mapping), the others map it through /proc."""
        me = dist.get_rank()
        path = ""
        fd = -1
        if me == local[0]:
            fd = os.memfd_create("roundpipe-masters")
            os.ftruncate(fd, nbytes)
            path = f"/proc/{os.getpid()}/fd/{fd}"
        paths: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(paths, path, group=setup_group)
        try:
            segment = torch.from_file(paths[local[0]], shared=True, size=nbytes, dtype=torch.uint8)
        except Exception as exc:  # noqa: BLE001 - reported with what to change
            raise DataParallelError(
                f"{self.where}: shard_optimizer could not map the host's shared optimizer memory "
                f"({paths[local[0]]}: {exc}); "
                "the ranks of one host must run as the same user with /proc mounted, or pass shard_optimizer=False"
            ) from exc
        dist.barrier(group=self.group)  # every local rank has mapped it: the creator's descriptor may go
        if fd >= 0:
            os.close(fd)
        return segment

    # ---- roundpipe.host.protocol.StepSync (optimizer thread) ------------------------------------------------
    def before_step_fn(self, units: Units, streamed: bool) -> None:
        """Before ``step_fn``: no peer still reads the masters of the previous step."""
        if streamed:
            raise DataParallelError(
                f"{self.where}: RPP_STEP_MODE=streamed publishes each layer from its own optimizer; with "
                "shard_optimizer=True "
                "a rank steps only its units. Use the staged asynchronous step (unset RPP_STEP_MODE) or "
                "shard_optimizer=False"
            )
        self._barrier("read")
        _active.shard = self

    def after_step_fn(self, units: Units) -> None:
        """After ``step_fn``: every owner has written its masters; the peers' ones count as written here
        (their version counters, which this process's writes alone would move). A master moved out of
        the segment would silently stop being shared: refused before anything reads it."""
        _active.shard = None
        self._barrier("written")
        with torch.no_grad():
            for m, ptr, unowned in self._masters_ptrs:
                if m.data_ptr() != ptr:
                    raise DataParallelError(
                        f"{self.where}: an optimizer copy of model {self.model.name!r} no longer lies in the "
                        "host's shared memory "
                        "(its .data was replaced after enable_data_parallel(shard_optimizer=True)): write into "
                        "it in place (copy_) instead"
                    )
                if unowned:
                    torch.autograd.graph.increment_version(m)

    def abort(self) -> None:
        """A step failed on this thread: stop hiding gradients (the failure reaches the main thread)."""
        _active.shard = None

    def hide_unowned(self, optimizer: torch.optim.Optimizer) -> None:
        """Right before ``optimizer.step()``: the units other ranks own get ``.grad = None`` (the optimizer
        skips them) and lose any moments (a full checkpoint loaded on every rank)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self.unowned:
                    p.grad = None
                    optimizer.state.pop(p, None)
        self.hidden_steps += 1

    def _barrier(self, what: str) -> None:
        run_collective(
            lambda: dist.barrier(group=self.group), self.where, f"the sharded optimizer step's barrier ({what})"
        )

    def unshare(self) -> None:
        """Main thread, nothing in flight: give every master a private copy (the model trains alone again)."""
        _active.shard = None
        reserve.stepped_elsewhere(self.masters, elsewhere=False)
        with torch.no_grad():
            for m in self.masters:
                m.data = m.data.clone()
        self.masters, self._masters_ptrs = [], []
        del self.segment

    # ---- checkpoints (main thread) --------------------------------------------------------------------
    def full_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
        """``optimizer.state_dict()`` with every unit's moments, on the host's first rank (global rank 0
        among them); None on the others. A collective of the host's ranks: call it on each of them, after
        ``model.synchronize()``."""
        optim_thread.synchronize()
        sd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        # Per owned parameter with state: its tensors as (shape, dtype), its other entries as they are.
        mine = {
            i: (
                {k: (tuple(v.shape), v.dtype) for k, v in sd["state"][i].items() if torch.is_tensor(v)},
                {k: v for k, v in sd["state"][i].items() if not torch.is_tensor(v)},
            )
            for i, p in enumerate(order)
            if self.owner.get(id(p)) == self.local_rank and sd["state"].get(i)
        }
        metas: List[Any] = [None] * self.local_size
        dist.all_gather_object(metas, mine, group=self.group)
        first = self.local_rank == 0
        for r, meta in enumerate(metas[1:], start=1):  # the leader's own entries are in sd already
            for i in sorted(meta):
                tensors, others = meta[i]
                if first:
                    state = sd["state"][i] = dict(others)
                for k, (shape, dtype) in tensors.items():
                    if r == self.local_rank:
                        dist.send(sd["state"][i][k].contiguous(), dst=self.ranks[0], group=self.group)
                    elif first:
                        state[k] = torch.empty(shape, dtype=dtype)
                        dist.recv(state[k], src=self.ranks[r], group=self.group)
        dist.barrier(group=self.group)
        return sd if first else None
