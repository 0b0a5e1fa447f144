"""Execution plans (how layers are grouped into stages) and the tracker that orders stages across devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Literal, Optional

from roundpipe.threads import AnnotatedSemaphore, note_progress

if TYPE_CHECKING:
    from roundpipe.roundpipe import RoundPipe

RunType = Literal["infer", "train", "fused"]


class ModelExecutePlan:
    """Execution plans of a RoundPipe model: contiguous layer groups for forward and for backward.

    For 'fused' runs (``forward_backward``) the last backward group runs forward, loss and backward in
    one job, so ``fwd_plan`` stops where ``bwd_plan[-1]`` starts. A plan written for 'train' is adapted
    to 'fused' (and back) by ``for_run_type``.

    Attributes:
        fwd_plan: Layer ranges executed during forward.
        bwd_plan: Layer ranges executed during backward (empty for inference).
    """

    def __init__(self, fwd_plan: Optional[List[range]] = None, bwd_plan: Optional[List[range]] = None) -> None:
        self.fwd_plan: List[range] = list(fwd_plan or [])
        self.bwd_plan: List[range] = list(bwd_plan or [])

    def __repr__(self) -> str:
        def fmt(plan: List[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in plan) + "]"

        return f"ModelExecutePlan(fwd={fmt(self.fwd_plan)} ({len(self.fwd_plan)} groups), bwd={fmt(self.bwd_plan)} ({len(self.bwd_plan)} groups))"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelExecutePlan) and (self.fwd_plan, self.bwd_plan) == (other.fwd_plan, other.bwd_plan)

    @classmethod
    def layerwise(cls, num_layers: int, run_type: RunType) -> "ModelExecutePlan":
        """One layer per group: the finest plan, valid for any model."""
        groups = [range(i, i + 1) for i in range(num_layers)]
        if run_type == "infer":
            return cls(groups, [])
        return cls(groups, groups).for_run_type(run_type, num_layers)

    def for_run_type(self, run_type: RunType, num_layers: int) -> "ModelExecutePlan":
        """This plan adapted to ``run_type`` (forward coverage differs between 'train' and 'fused')."""
        if run_type == "infer" or not self.bwd_plan:
            return ModelExecutePlan(self.fwd_plan, [] if run_type == "infer" else self.bwd_plan)
        fused_start = self.bwd_plan[-1].start
        fwd: List[range] = []
        for r in self.fwd_plan:
            if run_type == "fused":
                if r.start < fused_start:
                    fwd.append(range(r.start, min(r.stop, fused_start)))
            else:
                fwd.append(r)
        if run_type == "train" and (not fwd or fwd[-1].stop < num_layers):
            start = fwd[-1].stop if fwd else 0
            fwd.append(range(start, num_layers))
        return ModelExecutePlan(fwd, self.bwd_plan)

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ``ValueError`` naming the offending layers unless the plans cover every layer once, in order."""
        from roundpipe.planner import validate_plan

        validate_plan(self.fwd_plan, self.bwd_plan, num_layers, run_type)

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: "RoundPipe",
        min_stages: Optional[int] = None,
        upper_threshold: float = 1.1,
        model_memory_limit: Optional[float] = None,
    ) -> "ModelExecutePlan":
        """Plan from the models' timers (see ``roundpipe.planner``); one plan per model is returned by
        ``auto_many``. With one model this returns its plan."""
        plans = cls.auto_many(run_type, *models, min_stages=min_stages, upper_threshold=upper_threshold, model_memory_limit=model_memory_limit)
        return plans[0]

    @classmethod
    def auto_many(
        cls,
        run_type: RunType,
        *models: "RoundPipe",
        min_stages: Optional[int] = None,
        upper_threshold: float = 1.1,
        model_memory_limit: Optional[float] = None,
    ) -> List["ModelExecutePlan"]:
        """Plans for several models sharing one device memory budget."""
        from roundpipe.device import get_min_gpu_memory, get_num_devices
        from roundpipe.planner import plan_stages

        if not models:
            raise ValueError("ModelExecutePlan.auto needs at least one RoundPipe model")
        if min_stages is None:
            min_stages = get_num_devices()
        if model_memory_limit is None:
            model_memory_limit = get_min_gpu_memory() * 0.6
        total = sum(sum(m.layer_size) for m in models) or 1.0
        plans = []
        for m in models:
            # Several models share the budget in proportion to their size.
            share = model_memory_limit * (sum(m.layer_size) / total) if len(models) > 1 else model_memory_limit
            _, fwd_t, bwd_t = m.model_timer.get_estimate(run_type)
            layer_bytes = [int(b) for b in m.layer_device_bytes(run_type)]
            fwd, bwd = plan_stages(
                run_type,
                fwd_t,
                bwd_t,
                layer_bytes,
                min_stages=min_stages,
                upper_threshold=upper_threshold,
                memory_limit_bytes=share * 1024**3,
            )
            plans.append(cls(fwd, bwd))
        return plans


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
