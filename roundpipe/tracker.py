"""The tracker that orders one call's layer groups across devices (jobs of one call run concurrently on
several device threads; each waits here for the group before it)."""

from __future__ import annotations

from roundpipe.plan import ModelExecutePlan
from roundpipe.threads import AnnotatedSemaphore, note_progress


class ModelTracker:
    """Orders layer groups across devices within one run.

    Group g of microbatch m may start only after group g-1 has issued microbatch m's output (forward),
    or group g+1 has issued microbatch m's input gradient (backward). Each group has a counting semaphore
    released once per finished microbatch; the next group acquires it once per microbatch, in order.

    Attributes:
        fwd_plan / bwd_plan: The plan of this run.
        fwd_sem / bwd_sem: Per-group semaphores counting finished microbatches.
        fused_fwd_sem: Released when the forward part of a fused job finished a microbatch.
    """

    def __init__(self, execute_plan: ModelExecutePlan) -> None:
        self.fwd_plan = execute_plan.fwd_plan
        self.bwd_plan = execute_plan.bwd_plan
        self.fwd_sem = [AnnotatedSemaphore(0, name=f"fwd_group{g}") for g in range(len(self.fwd_plan))]
        self.bwd_sem = [AnnotatedSemaphore(0, name=f"bwd_group{g}") for g in range(len(self.bwd_plan))]
        self.fused_fwd_sem = AnnotatedSemaphore(0, name="fused_fwd")
        self._bwd_starts = {r.start for r in self.bwd_plan}

    def backward_need_input(self, layer_id: int) -> bool:
        """Whether ``layer_id`` starts a backward group (its input is saved for recompute)."""
        return layer_id in self._bwd_starts

    def forward_wait_for(self, layer_group_id: int) -> None:
        """Block until forward group ``layer_group_id - 1`` finished the next microbatch."""
        if layer_group_id > 0:
            self.fwd_sem[layer_group_id - 1].acquire()

    def forward_notify(self, layer_group_id: int) -> None:
        note_progress()
        self.fwd_sem[layer_group_id].release()

    def forward_wait_complete(self, num_microbatch: int) -> None:
        """Block until the last forward group finished ``num_microbatch`` microbatches."""
        if self.fwd_plan:
            for _ in range(num_microbatch):
                self.fwd_sem[-1].acquire()

    def backward_wait_for(self, layer_group_id: int) -> None:
        """Block until backward group ``layer_group_id + 1`` finished the next microbatch."""
        if layer_group_id + 1 < len(self.bwd_plan):
            self.bwd_sem[layer_group_id + 1].acquire()

    def backward_notify(self, layer_group_id: int) -> None:
        note_progress()
        self.bwd_sem[layer_group_id].release()

    def backward_wait_complete(self, num_microbatch: int) -> None:
        """Block until backward group 0 finished ``num_microbatch`` microbatches."""
        if self.bwd_plan:
            for _ in range(num_microbatch):
                self.bwd_sem[0].acquire()

    def fused_forward_notify(self) -> None:
        self.fused_fwd_sem.release()

    def fused_forward_wait_complete(self, num_microbatch: int) -> None:
        for _ in range(num_microbatch):
            self.fused_fwd_sem.acquire()
