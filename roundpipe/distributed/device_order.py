"""The order of the device gradient collectives (``reduce_on="device"``): why every rank issues the
same ones in the same order, and the agreement before each training call that makes it so.

Collectives on one group must be issued in the same order on every rank. There is one group per local
device index k (device k of every rank), used only by device k's controller thread, which reduces each
layer at the end of its job (``DeviceReduction.reduce_layer``): the sequence is the device's job order.
Jobs go to the devices round robin in dispatch order (``roundpipe.devices.dispatch``), fixed before launch, so
device k runs the same jobs on every rank when every rank (1) runs the same training calls in the same
order, (2) with the same plan and (3) from the same round-robin position, and (4) has the same number
of devices. Before every training call, the ranks all-gather their step and call index, model, device
count, round-robin position and plan (one small gloo collective on the main thread,
:meth:`PlanAgreement.agree`): a mismatch in (1) or (4) raises on every rank; for (2) and (3) every rank
adopts rank 0's plan and position (auto plans are re-tuned from each rank's own timings, and rank-local
inference calls, e.g. an evaluation on rank 0, move the position). At each step a hash of the sequence
of layers each device reduced is compared between ranks before the optimizer runs
(``DeviceReduction.finish_step``), so a disagreement that slipped through can never be summed into the
weights.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch
import torch.distributed as dist

from roundpipe.devices import device as device_mod
from roundpipe.devices.dispatch import dispatcher
from roundpipe.distributed.errors import DataParallelError, run_collective
from roundpipe.planning.plan import ModelExecutePlan

logger = logging.getLogger("roundpipe")

RUN_CODES = {"train": 1, "fused": 2}  # the training run types (the others compute no gradients)
# step, call within the step, model, layers, devices, round-robin position, run type, forward groups, backward groups
HEADER = 9


def encode_plan(header: List[int], plan: ModelExecutePlan, max_layers: int) -> torch.Tensor:
    """One int64 row: the ``HEADER`` numbers, then the plan's forward and backward groups as
    (start, stop) pairs, each padded with -1 to ``max_layers`` groups (equal sizes on every rank)."""
    t = torch.full((HEADER + 4 * max_layers,), -1, dtype=torch.int64)
    t[:HEADER] = torch.tensor(header, dtype=torch.int64)
    for base, groups in ((HEADER, plan.fwd_plan), (HEADER + 2 * max_layers, plan.bwd_plan)):
        for i, r in enumerate(groups):
            t[base + 2 * i], t[base + 2 * i + 1] = r.start, r.stop
    return t


def decode_plan(row: List[int], max_layers: int) -> ModelExecutePlan:
    """The plan of a row written by :func:`encode_plan`."""

    def groups(base: int, n: int) -> List[range]:
        return [range(row[base + 2 * i], row[base + 2 * i + 1]) for i in range(n)]

    return ModelExecutePlan(groups(HEADER, row[7]), groups(HEADER + 2 * max_layers, row[8]))


class PlanAgreement:
    """The main thread's side of the order (module docstring): the step and call counters, and the
    agreement on rank 0's plan and round-robin position before each training call.

    Attributes:
        steps: ``model.step`` calls so far.
        calls: Training calls in the current step.
        adopted_plans: Training calls that ran rank 0's plan instead of this rank's own.
    """

    def __init__(self, control: Any, max_layers: int) -> None:
        self.control = control  # gloo group of all ranks, used only by the main thread
        self.max_layers = max(1, max_layers)
        self.world_size = dist.get_world_size(control)
        self.global_rank = dist.get_rank()
        self.steps = 0
        self.calls = 0
        self.adopted_plans = 0

    def on_step_launch(self) -> None:
        """A new step starts (main thread, ``model.step``)."""
        self.steps += 1
        self.calls = 0

    def agree(self, model: Any, index: int, run_type: str, plan: ModelExecutePlan) -> ModelExecutePlan:
        """The plan of a training call of ``model`` (``index``: its position among the reduced models),
        the same on every rank (rank 0's); the dispatcher then starts where rank 0's does."""
        n_dev = device_mod.get_num_devices()
        header = [
            self.steps,
            self.calls,
            index,
            model.num_layers,
            n_dev,
            dispatcher.position(),
            RUN_CODES[run_type],
            len(plan.fwd_plan),
            len(plan.bwd_plan),
        ]
        mine = encode_plan(header, plan, self.max_layers)
        rows_t = [torch.empty_like(mine) for _ in range(self.world_size)]
        run_collective(
            lambda: dist.all_gather(rows_t, mine, group=self.control),
            f"rank {self.global_rank}/{self.world_size}",
            f"plan agreement before training call {self.calls + 1} of step {self.steps + 1} (model {model.name!r})",
        )
        self.calls += 1
        rows = [r.tolist() for r in rows_t]
        self._check_same(rows, model)
        agreed = decode_plan(rows[0], self.max_layers)
        # Jobs take devices round robin from the dispatcher's position: start where rank 0 starts, so
        # device k gets the same jobs, and issues the same collectives in the same order, everywhere.
        dispatcher.seek(int(rows[0][5]))
        if agreed != plan:
            self.adopted_plans += 1
            if self.adopted_plans == 1:
                logger.info(
                    "data parallel: rank %d runs rank 0's plan %s instead of its own %s (ranks must run the same plan "
                    "with reduce_on='device'; auto plans follow each rank's timings)",
                    self.global_rank,
                    agreed,
                    plan,
                )
        return agreed

    def _check_same(self, rows: List[List[int]], model: Any) -> None:
        """Raise on every rank (all see the same rows) when ranks are not at the same call."""

        def differ(k: int) -> bool:
            return any(r[k] != rows[0][k] for r in rows)

        def per_rank(k: int) -> str:
            return ", ".join(f"rank {i}: {r[k]}" for i, r in enumerate(rows))

        where = (
            f"rank {self.global_rank}/{self.world_size}: training call {self.calls} of step {self.steps + 1} "
            f"(model {model.name!r})"
        )
        if differ(0) or differ(1):
            at = ", ".join(f"rank {i}: call {r[1] + 1} of step {r[0] + 1}" for i, r in enumerate(rows))
            raise DataParallelError(
                f"{where}: the ranks are at different training calls ({at}). With reduce_on='device' "
                "every rank must run every forward/backward, since the gradients are reduced inside it: a rank "
                "may not skip "
                "a call (e.g. for a share of the batch without rows or without trained tokens). Give every "
                "rank at least "
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
