"""The tracker that orders one call's layer groups across devices (jobs of one call run concurrently on
several device threads; each waits here for the group before it)."""

from __future__ import annotations

from typing import List

from roundpipe.devices.threads import AnnotatedEvent, note_progress
from roundpipe.planning.plan import ModelExecutePlan


class ModelTracker:
    """Orders layer groups across devices within one run.

    Group g of microbatch m may start only after group g-1 has issued microbatch m's output (forward),
    or group g+1 has issued microbatch m's input gradient (backward). One event per (group, microbatch),
    set by the job that produced it and waited on by the job that consumes it: most jobs take their
    microbatches in order, but the fused group may be split by microbatch over several devices
    (``jobs.run_forward_backward``), whose parts finish their microbatches in any order.

    Attributes:
        fwd_plan / bwd_plan: The plan of this run.
        fwd_done / bwd_done: Per group, per microbatch: set once the group issued the microbatch's
            output (forward) or input gradient (backward).
    """

    def __init__(self, execute_plan: ModelExecutePlan, num_microbatch: int) -> None:
        self.fwd_plan = execute_plan.fwd_plan
        self.bwd_plan = execute_plan.bwd_plan
        self.fwd_done = [self._events(f"fwd_group{g}", num_microbatch) for g in range(len(self.fwd_plan))]
        self.bwd_done = [self._events(f"bwd_group{g}", num_microbatch) for g in range(len(self.bwd_plan))]
        self._bwd_starts = {r.start for r in self.bwd_plan}

    @staticmethod
    def _events(name: str, n: int) -> List[AnnotatedEvent]:
        return [AnnotatedEvent(f"{name}.microbatch{m}") for m in range(n)]

    def backward_need_input(self, layer_id: int) -> bool:
        """Whether ``layer_id`` starts a backward group (its input is saved for recompute)."""
        return layer_id in self._bwd_starts

    def forward_wait_for(self, layer_group_id: int, m: int) -> None:
        """Block until forward group ``layer_group_id - 1`` issued microbatch ``m``'s output (group
        ``len(fwd_plan)`` is the fused group, which follows the last forward group)."""
        if layer_group_id > 0:
            self.fwd_done[layer_group_id - 1][m].wait()

    def forward_notify(self, layer_group_id: int, m: int) -> None:
        _notify(self.fwd_done[layer_group_id][m])

    def forward_wait_complete(self, num_microbatch: int) -> None:
        """Block until the last forward group finished ``num_microbatch`` microbatches."""
        if self.fwd_plan:
            _wait_all(self.fwd_done[-1], num_microbatch)

    def backward_wait_for(self, layer_group_id: int, m: int) -> None:
        """Block until backward group ``layer_group_id + 1`` issued microbatch ``m``'s input gradient."""
        if layer_group_id + 1 < len(self.bwd_plan):
            self.bwd_done[layer_group_id + 1][m].wait()

    def backward_notify(self, layer_group_id: int, m: int) -> None:
        _notify(self.bwd_done[layer_group_id][m])

    def backward_wait_complete(self, num_microbatch: int) -> None:
        """Block until backward group 0 finished ``num_microbatch`` microbatches."""
        if self.bwd_plan:
            _wait_all(self.bwd_done[0], num_microbatch)


def _notify(done: AnnotatedEvent) -> None:
    """A group issued a microbatch: the run made progress (the watchdog's clock), and the waiter may go."""
    note_progress()
    done.set()


def _wait_all(done: List[AnnotatedEvent], num_microbatch: int) -> None:
    """Block until a group issued each of the first ``num_microbatch`` microbatches."""
    for m in range(num_microbatch):
        done[m].wait()
