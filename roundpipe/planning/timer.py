"""Per-layer forward / recompute / backward timing, the input of automatic stage planning.

Each iteration gets an ``IterTimer``. Device threads wrap layer work in its contexts
(``time_fwd`` per layer, ``time_bwd`` per backward group), which record a pair of events on the layer's
stream: CUDA events with timing on CUDA streams, wall-clock stamps on CPU workers (whose work runs
synchronously on the recording thread). When the iteration is done, ``IterTimer.finish`` hands the events
to the ``ModelTimer``, which folds them into per-layer estimates once the device has passed them
(``update_times`` never blocks).

Estimates per kind ('fwd', 're' for recompute, 'bwd' for backward proper):

* Before any measurement they are proportional to layer sizes (``get_estimate`` then reports source
  'memory'): bigger layers do more math.
* The first measured iteration of each kind is dropped: it pays for warm-up (allocator growth, kernel
  autotuning, lazy initialisation).
* Then an exponential moving average starting from 0, corrected for that start like Adam's bias
  correction: after t updates the average holds a weight ``SMOOTH_RATE ** t`` (``scale``) of the initial
  0, so the estimate is ``estimate / (1 - scale)``. The first update thus gives exactly the first kept
  measurement, and later ones smooth noise.

're' and 'bwd' always advance together (one training iteration measures both), so their ``stage`` and
``scale`` agree. A layer that an iteration did not measure keeps its estimate; a layer never measured
gets a stand-in when its kind first switches to time (see ``ModelTimer._fallback``), e.g. the layers of
the fused group are never recomputed, and their recompute stand-in is their forward time, which makes
their backward estimate (recompute + backward) the fused cost forward + backward.

A graphed job (``roundpipe.devices.graphs``) is timed per group and microbatch (``time_group``): its forward
time is spread over the layers like a backward group's, and a recompute + backward time is split into
're' and 'bwd' in the proportions of the current estimates.

Timing costs the device threads two events per layer and microbatch. Once estimates exist it samples:
``ModelTimer.new_iter`` times the first ``TIMED_FIRST`` calls, then every ``TIMED_EVERY``-th.

The timer also keeps the host's cost of a job (``note_job``): the device thread's CPU time for it, less
what it spends in the job's compute on CPU workers and in waits that spin, fitted as a cost per
microbatch and one per layer. The planner weighs group sizes with it (``host_costs``,
``roundpipe.planning.simulate``).

Times are in milliseconds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Literal, Optional, Sequence, Tuple

import torch

from roundpipe import settings
from roundpipe.planning.simulate import HostCosts, RunType

TimeKind = Literal["fwd", "re", "bwd"]
EventPair = Tuple[Any, Any]  # (start, end): torch.cuda.Event or WallClockEvent
TimerFwdEventsType = Dict[Tuple[str, int], List[EventPair]]  # ('fwd' | 're', layer) -> one pair per run
TimerBwdEventsType = Dict[range, List[EventPair]]  # layer group -> one pair per run
TimerGroupEventsType = Dict[Tuple[str, range], List[EventPair]]  # ('fwd' | 'rebwd', group) -> pairs
TimerQueueType = Deque[Tuple[TimerFwdEventsType, TimerBwdEventsType, TimerGroupEventsType]]

_KINDS: Tuple[TimeKind, ...] = ("fwd", "re", "bwd")


class WallClockEvent:
    """Event stand-in for CPU workers, with the part of the ``torch.cuda.Event`` API the timer uses.

    Work on a CPU worker runs synchronously on its thread, so the wall-clock time at ``record`` is when the
    work before it finished. A recorded event is complete at once.
    """

    def __init__(self) -> None:
        self.time: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def query(self) -> bool:
        return self.time is not None

    def elapsed_time(self, end_event: "WallClockEvent") -> float:
        """Milliseconds from this event to ``end_event``, like ``torch.cuda.Event.elapsed_time``."""
        assert self.time is not None and end_event.time is not None, "event not recorded"
        return (end_event.time - self.time) * 1000.0


def _new_event(stream: Any) -> Any:
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.Event(enable_timing=True)
    return WallClockEvent()


class LayerTimingContext:
    """Records ``start_event`` on entry and ``end_event`` on exit, both on ``stream``.

    ``on_exit`` (optional) runs after a block that finished without an exception; ``IterTimer`` uses it to
    keep only complete measurements.
    """

    def __init__(
        self, start_event: Any, end_event: Any, stream: Any, on_exit: Optional[Callable[[], None]] = None
    ) -> None:
        self.start_event = start_event
        self.end_event = end_event
        self.stream = stream
        self.on_exit = on_exit

    def __enter__(self) -> "LayerTimingContext":
        self.start_event.record(self.stream)
        return self

    def __exit__(self, exc_type: Any, *args: Any) -> None:
        self.end_event.record(self.stream)
        if exc_type is None and self.on_exit is not None:
            self.on_exit()


class _NoTiming:
    """The context of an iteration that is not timed (``IterTimer.active`` False): does nothing."""

    def __enter__(self) -> "_NoTiming":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_NO_TIMING = _NoTiming()


class IterTimer:
    """Collects the timing events of one iteration; safe to use from several device threads at once.

    Call ``finish()`` when the iteration has been dispatched (events may still be pending on the device);
    it hands the events to the parent. ``__del__`` calls it if nobody did. Records made after ``finish``
    are dropped. An inactive timer (a call the parent does not sample) hands out contexts that record
    nothing.
    """

    def __init__(self, parent: "ModelTimer", active: bool = True) -> None:
        self.parent = parent
        self.active = active
        self.fwd_events: TimerFwdEventsType = {}
        self.bwd_events: TimerBwdEventsType = {}
        self.group_events: TimerGroupEventsType = {}
        self.lock = threading.Lock()
        self.finished = False

    def time_fwd(self, action: Literal["fwd", "re"], layer_idx: int, stream: Any) -> Any:
        """Time the forward ('fwd') or the backward recompute ('re') of one layer on ``stream``."""
        if action not in ("fwd", "re"):
            raise ValueError(f"time_fwd: action must be 'fwd' or 're', got {action!r}")
        if not self.active:
            return _NO_TIMING
        self.parent._check_layers(range(layer_idx, layer_idx + 1))
        return self._context(self.fwd_events, (action, layer_idx), stream)

    def time_bwd(self, layer_ids: range, stream: Any) -> Any:
        """Time the backward (without recompute) of a group of layers on ``stream``; the group's time is
        later spread over its layers in proportion to their current backward estimates."""
        if not self.active:
            return _NO_TIMING
        self.parent._check_layers(layer_ids)
        return self._context(self.bwd_events, layer_ids, stream)

    def time_group(self, kind: Literal["fwd", "rebwd"], layer_ids: range, stream: Any) -> Any:
        """Time a whole group at once: its forward ('fwd') or its recompute + backward ('rebwd'), as a
        graphed job runs them (one replay per microbatch)."""
        if kind not in ("fwd", "rebwd"):
            raise ValueError(f"time_group: kind must be 'fwd' or 'rebwd', got {kind!r}")
        if not self.active:
            return _NO_TIMING
        self.parent._check_layers(layer_ids)
        return self._context(self.group_events, (kind, layer_ids), stream)

    def finish(self) -> None:
        """Hand this iteration's events to the parent timer (once)."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
        if self.fwd_events or self.bwd_events or self.group_events:
            self.parent.add_iteration(self.fwd_events, self.bwd_events, self.group_events)

    def __del__(self) -> None:
        if getattr(self, "finished", True):
            return
        try:
            self.finish()
        except Exception:  # interpreter shutdown; timing is best effort
            pass

    def _context(self, table: Dict[Any, List[EventPair]], key: Any, stream: Any) -> LayerTimingContext:
        start, end = _new_event(stream), _new_event(stream)

        def add() -> None:
            with self.lock:
                if not self.finished:
                    table.setdefault(key, []).append((start, end))

        return LayerTimingContext(start, end, stream, on_exit=add)


class ModelTimer:
    """Per-layer time estimates of one model, from size-based guesses to smoothed measurements.

    Attributes:
        SMOOTH_RATE: Weight of the old average in each update (Adam's beta).
        BACKWARD_MULTIPLIER: Backward time (without recompute) as a multiple of forward time, used until
            backward has been measured.
        VERBOSE: Print every update (environment ``RPP_DEBUG_TIMER=1``).
        n_layers: Number of layers timed.
        layer_sizes: Per-layer sizes, the estimates before any measurement (any unit, e.g. bytes).
        stage: Per kind: 0 nothing measured yet, 1 first (warm-up) iteration dropped, 2 time-based.
        scale: Per kind: weight of the initial 0 still in the moving average (``SMOOTH_RATE ** updates``).
        estimate: Per kind: the moving averages, not yet bias-corrected (see ``current``).
        iter_results: Finished iterations whose events may still be pending on the device, oldest first.
        version: Increases each time measurements change the estimates; re-plan when it moved.
    """

    SMOOTH_RATE: float = 0.9
    BACKWARD_MULTIPLIER: float = 2.0
    VERBOSE: bool = settings.DEBUG_TIMER.get()
    #: Calls timed from the start (warm-up and the first estimates), then one call in ``TIMED_EVERY``.
    TIMED_FIRST: int = 8
    TIMED_EVERY: int = 4

    def __init__(self, n_layers: int, layer_sizes: Sequence[float]) -> None:
        if len(layer_sizes) != n_layers:
            raise ValueError(f"ModelTimer: {len(layer_sizes)} layer sizes for {n_layers} layers")
        self.n_layers = n_layers
        self.layer_sizes = [float(s) for s in layer_sizes]
        self.stage: Dict[TimeKind, int] = {k: 0 for k in _KINDS}
        self.scale: Dict[TimeKind, float] = {k: 1.0 for k in _KINDS}
        self.estimate: Dict[TimeKind, List[float]] = {k: [0.0] * n_layers for k in _KINDS}
        self.iter_results: TimerQueueType = deque()
        self.version = 0
        self.calls = 0
        self.lock = threading.RLock()
        self.job_ms = 0.0  # host time per job and microbatch (see ``note_job``)
        self.layer_ms = 0.0  # host time per job and layer
        self.jobs_noted = 0
        self._host_sums = [0.0] * 5

    def new_iter(self) -> IterTimer:
        """A fresh ``IterTimer`` for the next call: active for the first ``TIMED_FIRST`` calls, then for
        one in ``TIMED_EVERY``."""
        with self.lock:
            n = self.calls
            self.calls += 1
        return IterTimer(self, active=n < self.TIMED_FIRST or n % self.TIMED_EVERY == 0)

    def add_iteration(
        self,
        fwd_events: TimerFwdEventsType,
        bwd_events: TimerBwdEventsType,
        group_events: Optional[TimerGroupEventsType] = None,
    ) -> None:
        """Queue a finished iteration's events (called by ``IterTimer.finish``)."""
        with self.lock:
            self.iter_results.append((fwd_events, bwd_events, group_events or {}))

    def update_times(self) -> bool:
        """Fold in every queued iteration whose events the device has completed, oldest first, without
        blocking: stop at the first iteration that is still running. Returns whether estimates changed."""
        changed = False
        with self.lock:
            while self.iter_results:
                fwd_events, bwd_events, group_events = self.iter_results[0]
                tables = (*fwd_events.values(), *bwd_events.values(), *group_events.values())
                if not all(end.query() for pairs in tables for _, end in pairs):
                    break
                self.iter_results.popleft()
                if self._absorb(fwd_events, bwd_events, group_events):
                    self.version += 1
                    changed = True
        return changed

    #: Jobs whose host time is not noted: the first ones compile kernels and build buffers.
    JOBS_SKIPPED = 8

    def note_job(self, host_ms: float, microbatches: int, layers: int) -> None:
        """Fold one job's host time (ms) into the host cost model ``host_ms = job_ms x microbatches +
        layer_ms x layers``: a least-squares fit over the jobs seen, older jobs weighing less (called
        by the device threads; jobs of several group sizes and microbatch counts tell the two apart)."""
        with self.lock:
            self.jobs_noted += 1
            if self.jobs_noted <= self.JOBS_SKIPPED:
                return
            keep = 0.98
            m, n = float(microbatches), float(layers)
            s = self._host_sums
            for k, v in enumerate((m * m, m * n, n * n, host_ms * m, host_ms * n)):
                s[k] = keep * s[k] + v
            mm, mn, nn, hm, hn = s
            det = mm * nn - mn * mn
            if det > 1e-9 * max(mm * nn, 1e-30):
                a, b = (hm * nn - hn * mn) / det, (hn * mm - hm * mn) / det
                if a >= 0 and b >= 0:
                    self.job_ms, self.layer_ms = a, b
                    return
            # Too few kinds of jobs to tell the terms apart (or a negative one): all per microbatch.
            self.job_ms, self.layer_ms = hm / mm if mm > 0 else 0.0, 0.0

    def host_costs(self, serial_compute: bool) -> HostCosts:
        """The measured host costs of a job (zero until measured), for ``roundpipe.planning.simulate``."""
        with self.lock:
            return HostCosts(job_ms=self.job_ms, layer_ms=self.layer_ms, serial_compute=serial_compute)

    def has_measurements(self, run_type: RunType) -> bool:
        """Whether ``get_estimate(run_type)`` is fully based on measured time (after folding in completed
        iterations)."""
        self.update_times()
        with self.lock:
            if run_type == "infer":
                return self.stage["fwd"] == 2
            return self.stage["fwd"] == 2 and self.stage["bwd"] == 2

    def get_estimate(self, run_type: RunType) -> Tuple[Literal["time", "memory"], List[float], List[float]]:
        """Current per-layer estimates, after folding in completed iterations.

        Returns ``(source, fwd, bwd)``: source 'time' (milliseconds) once forward has been measured, else
        'memory' (the layer sizes stand in for time). ``bwd[i]`` is recompute + backward of layer i; until
        backward has been measured it is ``(1 + BACKWARD_MULTIPLIER) x fwd[i]``. The same lists serve all
        run types; for 'infer' the backward list is not needed.
        """
        self.update_times()
        with self.lock:
            if self.stage["fwd"] != 2:
                source: Literal["time", "memory"] = "memory"
                fwd = list(self.layer_sizes)
            else:
                source = "time"
                fwd = self.current("fwd")
            if source == "time" and self.stage["bwd"] == 2:
                bwd = [r + b for r, b in zip(self.current("re"), self.current("bwd"))]
            else:
                bwd = [(1 + self.BACKWARD_MULTIPLIER) * f for f in fwd]
            return source, fwd, bwd

    def slowest_job_ms(self, groups: Sequence[range], num_microbatch: int) -> Optional[float]:
        """The longest job of these layer groups that the estimates expect (ms: every microbatch's forward,
        recompute and backward of each layer, an upper bound for any kind of job), or None before forward has
        been measured (the estimates are then layer sizes, not times). The watchdog scales from it."""
        source, fwd, bwd = self.get_estimate("train")
        if source != "time":
            return None
        return max((sum(fwd[i] + bwd[i] for i in g) for g in groups), default=0.0) * num_microbatch

    def current(self, kind: TimeKind) -> List[float]:
        """Bias-corrected estimates of one kind; only meaningful at stage 2."""
        assert self.stage[kind] == 2, f"no measured {kind} times yet"
        correction = 1.0 - self.scale[kind]
        return [e / correction for e in self.estimate[kind]]

    # -----------------------------------------------------------------------------------------------------

    def _absorb(
        self,
        fwd_events: TimerFwdEventsType,
        bwd_events: TimerBwdEventsType,
        group_events: Optional[TimerGroupEventsType] = None,
    ) -> bool:
        fwd_ms = _mean_ms({layer: ps for (action, layer), ps in fwd_events.items() if action == "fwd"})
        re_ms = _mean_ms({layer: ps for (action, layer), ps in fwd_events.items() if action == "re"})
        group_ms = _mean_ms(bwd_events)
        if group_events:
            fwd_groups = _mean_ms({g: ps for (kind, g), ps in group_events.items() if kind == "fwd"})
            fwd_ms.update(self._spread(fwd_groups, "fwd"))
            for i, (r, b) in self._split_rebwd(
                _mean_ms({g: ps for (kind, g), ps in group_events.items() if kind == "rebwd"})
            ).items():
                re_ms[i] = r
                group_ms[range(i, i + 1)] = b
        changed = False
        if fwd_ms:
            changed |= self._advance(("fwd",), {"fwd": fwd_ms})
        if re_ms or group_ms:
            changed |= self._advance(("re", "bwd"), {"re": re_ms, "bwd": self._spread(group_ms)})
        return changed

    def _advance(self, kinds: Tuple[TimeKind, ...], measured: Dict[TimeKind, Dict[int, float]]) -> bool:
        """Apply one iteration's measurements to ``kinds`` (which share a stage), dropping the first."""
        if self.stage[kinds[0]] == 0:
            for k in kinds:
                self.stage[k] = 1
            self._log(f"{'/'.join(kinds)}: dropped the first measured iteration (warm-up)")
            return False
        full = {k: self._with_fallback(k, measured[k]) for k in kinds}
        beta = self.SMOOTH_RATE
        for k in kinds:
            self.estimate[k] = [beta * e + (1 - beta) * m for e, m in zip(self.estimate[k], full[k])]
            self.scale[k] *= beta
            self.stage[k] = 2
        for k in kinds:
            est = self.current(k)
            self._log(f"{k}: total {sum(est):.3f} ms, per layer [{', '.join(f'{t:.3f}' for t in est)}]")
        return True

    def _with_fallback(self, kind: TimeKind, measured: Dict[int, float]) -> List[float]:
        """One value per layer: the measurement where there is one, else what the estimate stands at."""
        base = self.current(kind) if self.stage[kind] == 2 else self._fallback(kind, measured)
        return [measured.get(i, base[i]) for i in range(self.n_layers)]

    def _fallback(self, kind: TimeKind, measured: Dict[int, float]) -> List[float]:
        """Stand-in times for layers never measured when ``kind`` first turns time-based."""
        if kind == "re" and self.stage["fwd"] == 2:
            return self.current("fwd")  # a recompute replays the forward
        if kind == "bwd" and self.stage["fwd"] == 2:
            return [self.BACKWARD_MULTIPLIER * t for t in self.current("fwd")]
        # Size-proportional, scaled to the measured layers.
        size = sum(self.layer_sizes[i] for i in measured)
        ms_per_size = sum(measured.values()) / size if size > 0 else 0.0
        return [s * ms_per_size for s in self.layer_sizes]

    def _split_rebwd(self, group_ms: Dict[range, float]) -> Dict[int, Tuple[float, float]]:
        """Split each group's recompute + backward time into per-layer (recompute, backward) times in the
        proportions of the current estimates (recompute ~ forward and backward ~ ``BACKWARD_MULTIPLIER``
        x forward before they exist)."""
        fwd = self.current("fwd") if self.stage["fwd"] == 2 else self.layer_sizes
        re = self.current("re") if self.stage["re"] == 2 else fwd
        bwd = self.current("bwd") if self.stage["bwd"] == 2 else [self.BACKWARD_MULTIPLIER * t for t in fwd]
        out: Dict[int, Tuple[float, float]] = {}
        for group, ms in group_ms.items():
            total = sum(re[i] + bwd[i] for i in group)
            for i in group:
                share = (re[i] + bwd[i]) / total if total > 0 else 1.0 / len(group)
                part = re[i] / (re[i] + bwd[i]) if re[i] + bwd[i] > 0 else 1.0 / (1.0 + self.BACKWARD_MULTIPLIER)
                out[i] = (ms * share * part, ms * share * (1.0 - part))
        return out

    def _spread(self, group_ms: Dict[range, float], kind: TimeKind = "bwd") -> Dict[int, float]:
        """Split each group's time over its layers in proportion to their current estimates of ``kind``
        (backward groups; the forward groups of graphed jobs)."""
        if self.stage[kind] == 2:
            weights = self.current(kind)
        elif self.stage["fwd"] == 2:
            weights = self.current("fwd")
        else:
            weights = self.layer_sizes
        per_layer: Dict[int, float] = {}
        for group, ms in group_ms.items():
            total = sum(weights[i] for i in group)
            for i in group:
                share = weights[i] / total if total > 0 else 1.0 / len(group)
                per_layer[i] = per_layer.get(i, 0.0) + ms * share
        return per_layer

    def _check_layers(self, layers: range) -> None:
        if len(layers) == 0 or layers.start < 0 or layers.stop > self.n_layers or layers.step != 1:
            raise ValueError(f"timer: layers {layers} are not a non-empty range within 0..{self.n_layers - 1}")

    def _log(self, message: str) -> None:
        if self.VERBOSE:
            print(f"[roundpipe timer] {message}", file=sys.stderr, flush=True)


def _mean_ms(events: Dict[Any, List[EventPair]]) -> Dict[Any, float]:
    """Mean elapsed milliseconds per key (one pair per microbatch), so the microbatch count cancels out."""
    return {key: sum(s.elapsed_time(e) for s, e in ps) / len(ps) for key, ps in events.items() if ps}
