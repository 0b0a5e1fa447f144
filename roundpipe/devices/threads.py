"""Thread helpers that keep RoundPipe worker threads observable and safe.

Every blocking wait in RoundPipe goes through ``AnnotatedEvent.wait`` or ``AnnotatedSemaphore.acquire``.
They wait in short slices and check a process-wide failure slot in between: when any RoundPipe thread
fails, every waiter wakes within ``POLL_S`` and raises ``RoundPipeAborted``, so no thread hangs on a
peer that died. The caller's thread then re-raises the original exception (see ``raise_if_failed``).

The same waits are the watchdog: a wait fails (``RoundPipeStalled``) once no RoundPipe thread has made
progress (``note_progress``: a microbatch or an optimizer kernel done) for the limit each call resolves
(``set_stall_limit``; ``RPP_WATCHDOG_S``, by default scaled from the planner's job times), naming what it
waits for and every thread's job and layer, and printing their stacks; the failure then ends every other
wait, so a hand-over that never comes fails the run instead of hanging it.

Attributes:
    roundpipe_threads: All RoundPipe threads created so far.
    thread_exception_print_lock: Lock to prevent interleaved exception prints.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Callable, Dict, List, Optional

import torch

from roundpipe.devices.profile import annotate

POLL_S = 0.05

roundpipe_threads: List["RoundPipeThread"] = []
thread_exception_print_lock = threading.Lock()

_failure_lock = threading.Lock()
_failure: Optional[BaseException] = None


class KeyboardInterruptRoundPipeThreads(KeyboardInterrupt):
    """Raised when Ctrl-C arrives while RoundPipe waits for its worker threads."""


class RoundPipeAborted(RuntimeError):
    """Raised in waiting threads after another RoundPipe thread failed; the original error is re-raised
    in the caller's thread."""


class RoundPipeWorkerError(RuntimeError):
    """An exception in a RoundPipe worker thread, re-raised in the caller's thread with its location."""


class RoundPipeOutOfMemoryError(RoundPipeWorkerError, torch.OutOfMemoryError):
    """A device ran out of memory in a stage; the message names the stage, its size and the fixes."""


class OptimizerStepError(RuntimeError):
    """An exception raised by optimizer work on the optimizer thread."""


def report_failure(exc: BaseException) -> None:
    """Record the first failure of a run; later ones (usually consequences) are dropped."""
    global _failure
    with _failure_lock:
        if _failure is None:
            _failure = exc


def current_failure() -> Optional[BaseException]:
    return _failure


def clear_failure() -> Optional[BaseException]:
    """Take the recorded failure (if any) and reset the slot so the next run starts clean."""
    global _failure
    with _failure_lock:
        exc, _failure = _failure, None
    return exc


_progress = 0  # how many times a run moved forward (each wait restarts its stall clock at a change)

#: The default watchdog (``RPP_WATCHDOG_S=auto``, ``runtime.run.watchdog_limit``): a wait fails after this many
#: seconds without progress, or ``WATCHDOG_JOBS`` times the slowest job the planner expects, whichever is longer.
WATCHDOG_FLOOR_S = 600.0
WATCHDOG_JOBS = 10.0
#: The caller's waits (any thread but a worker's) fail this much later than a worker's: a worker that waits in
#: the stalled job names the job, the layer and the event; the caller only knows the microbatch.
CALLER_GRACE_S = 1.0


def note_progress() -> None:
    """Record that a run moved forward (a microbatch or an optimizer kernel finished)."""
    global _progress
    _progress += 1


def _check_abort() -> None:
    if _failure is not None:
        raise RoundPipeAborted("aborted: another RoundPipe thread failed") from None


# Per waiting thread's ident: what it waits for, for the stall message (dict updates are atomic).
_waiting: Dict[int, Callable[[], str]] = {}
_stall_limit = WATCHDOG_FLOOR_S  # seconds without progress before a wait fails (0: never), ``set_stall_limit``
_stall_source = ""
_dump_lock = threading.Lock()
_dumped_at = -1  # the progress count of the last stall whose stacks were printed (one dump per stall)


def set_stall_limit(seconds: float, source: str) -> None:
    """The watchdog in force for the waits from now on (each RoundPipe call resolves it once, at its start: a
    wait is too frequent a place to read settings). ``source`` says where it came from, for the message."""
    global _stall_limit, _stall_source
    _stall_limit, _stall_source = seconds, source


def stall_limit() -> float:
    """The watchdog in force (seconds without progress before a wait fails; 0: off)."""
    return _stall_limit


class RoundPipeStalled(RuntimeError):
    """A wait saw no RoundPipe thread make progress for the watchdog's time (``RPP_WATCHDOG_S``)."""


def _describe(t: "RoundPipeThread") -> str:
    """What ``t``'s job is doing ("" when it cannot say: the stall's message must not fail in its stead)."""
    try:
        return t.describe() if t.describe is not None else ""
    except Exception:  # noqa: BLE001 - a job's state half torn down
        return ""


def _stalled(what: Callable[[], str], limit: float) -> RoundPipeStalled:
    """The error of a wait that made no progress for ``limit`` seconds: what this wait waits for, then every
    RoundPipe thread's job and wait; the first stall of a run also prints every thread's stack."""
    global _dumped_at
    lines = []
    for t in roundpipe_threads:
        if t.is_alive() and (t.is_active or t.ident in _waiting):
            doing = _describe(t)
            waits = _waiting.get(t.ident or -1)
            lines.append(
                f"{t.name}" + (f" in {doing}" if doing else "") + (f", waits for {waits()}" if waits else ", computes")
            )
    main = _waiting.get(threading.main_thread().ident or -1)
    if main is not None:
        lines.append(f"the caller's thread waits for {main()}")
    msg = (
        f"waited for {what()}: no RoundPipe thread made progress for {limit:g} s ({_stall_source}; "
        f"RPP_WATCHDOG_S sets it, 0 turns it off). Threads: " + "; ".join(lines)
    )
    with _dump_lock:
        first = _dumped_at != _progress and _failure is None
        _dumped_at = _progress
    if first:
        with thread_exception_print_lock:
            print(f"roundpipe watchdog: no progress for {limit:g} s; {msg}\nthread stacks:", file=sys.stderr)
            print("--- the caller's thread ---", file=sys.stderr)
            print_trimmed_traceback(sys._current_frames().get(threading.main_thread().ident or -1))
        dump_all_active_threads()
    return RoundPipeStalled(msg)


def _poll(attempt: Callable[[float], bool], timeout: Optional[float], what: Callable[[], str]) -> bool:
    """Call ``attempt(slice)`` (a blocking wait of at most ``slice`` seconds) until it succeeds or
    ``timeout`` passes, checking between slices whether another RoundPipe thread failed. A wait without a
    timeout fails (``RoundPipeStalled``) once no RoundPipe thread has made progress for the watchdog's time:
    the clock restarts at every progress, so a run that is slow but moving is not cut short."""
    me = threading.current_thread()
    limit = _stall_limit if timeout is None else 0.0
    if limit > 0 and not isinstance(me, RoundPipeThread):
        limit += CALLER_GRACE_S
    _waiting[me.ident or -1] = what
    try:
        remaining = timeout
        seen, deadline = _progress, time.monotonic() + limit
        while True:
            _check_abort()
            step = POLL_S if remaining is None else min(POLL_S, remaining)
            if attempt(step):
                return True
            if remaining is not None:
                remaining -= step
                if remaining <= 0:
                    return False
            elif limit > 0:
                now = time.monotonic()
                if _progress != seen:
                    seen, deadline = _progress, now + limit
                elif now >= deadline:
                    raise _stalled(what, limit)
    finally:
        _waiting.pop(me.ident or -1, None)


_stress_rng = random.Random(0)
_stress_limit = 0.0


def refresh_waits() -> None:
    """Read ``RPP_DEBUG_STRESS_DELAY_S`` again (each RoundPipe call does, at its start, and any ``configure`` of
    it). Waits use the value read last: a wait is too frequent a place to parse the environment."""
    global _stress_limit
    from roundpipe import settings

    _stress_limit = settings.DEBUG_STRESS_DELAY_S.get()


def _reset_stall_limit() -> None:
    """Until the next call resolves it: ``RPP_WATCHDOG_S`` when set, else the floor (a changed setting must
    not leave the waits between calls with a limit the last call chose under the old one)."""
    from roundpipe import settings

    explicit = settings.WATCHDOG_S.get()
    if explicit is None:
        set_stall_limit(WATCHDOG_FLOOR_S, f"RPP_WATCHDOG_S=auto, at least {WATCHDOG_FLOOR_S:g} s")
    else:
        set_stall_limit(explicit, f"RPP_WATCHDOG_S={explicit:g}")


def _watch_wait_settings() -> None:
    from roundpipe import settings

    settings.on_change(settings.DEBUG_STRESS_DELAY_S, refresh_waits)
    settings.on_change(settings.WATCHDOG_S, _reset_stall_limit)
    refresh_waits()
    _reset_stall_limit()


def stress_limit() -> float:
    """The stress delay in force (seconds; 0: off), as last read by ``refresh_waits``."""
    return _stress_limit


def stress_delay() -> None:
    """In stress mode (``RPP_DEBUG_STRESS_DELAY_S``), sleep a random time before a wait: the threads reach
    each synchronisation point in ever different orders, so a missing fence shows in the tests as a
    wrong result or a hang instead of hiding behind one lucky interleaving."""
    limit = _stress_limit
    if limit > 0:
        time.sleep(_stress_rng.uniform(0.0, limit))


class AnnotatedEvent(threading.Event):
    """Event whose waits are named (for stack dumps and the watchdog) and abort when a RoundPipe thread fails."""

    def __init__(self, name: str = "", set: bool = False) -> None:  # noqa: A002 - mirrors Event.set
        super().__init__()
        self.name = name
        if set:
            self.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.wait_for(timeout, self._describe)

    def wait_for(self, timeout: Optional[float], what: Callable[[], str]) -> bool:
        """``wait``, with ``what()`` naming what the event stands for in a stall's message."""
        stress_delay()
        if self.is_set():
            return True
        with annotate(f"wait {self.name}"):  # a blocking wait shows on profiler timelines (RPP_PROFILER)
            return _poll(super().wait, timeout, what)

    def _describe(self) -> str:
        return f"event {self.name}"


def wait_or_stall(event: AnnotatedEvent, what: Callable[[], str]) -> None:
    """``event.wait()`` for a peer thread's hand-over, ``what()`` saying what never came when the watchdog
    fails the wait (every wait fails so; this one names the hand-over, not only the event)."""
    event.wait_for(None, lambda: f"{what()} (event {event.name})")


class AnnotatedSemaphore(threading.Semaphore):
    """Semaphore whose waits are named and abort when a RoundPipe thread fails."""

    def __init__(self, value: int = 0, name: str = "") -> None:
        super().__init__(value)
        self.name = name

    def acquire(self, blocking: bool = True, timeout: Optional[float] = None) -> bool:
        if not blocking:
            return super().acquire(False)
        stress_delay()
        if super().acquire(False):
            return True
        with annotate(f"wait {self.name}"):
            return _poll(
                lambda step: super(AnnotatedSemaphore, self).acquire(True, step), timeout, lambda: f"slot {self.name}"
            )

    __enter__ = acquire


class RoundPipeThread(threading.Thread):
    """Daemon thread that records uncaught exceptions in the failure slot instead of dying silently.

    Attributes:
        is_active: Whether the thread currently executes user work (used by ``dump_all_active_threads``).
        describe: What the thread's job is doing now (a device's job and layer), for the watchdog's message.
    """

    def __init__(self, target: Callable[[], Any], name: str, **kwargs: Any) -> None:
        super().__init__(target=self._run_target, name=name, daemon=True, **kwargs)
        self._user_target = target
        self.is_active = False
        self.describe: Optional[Callable[[], str]] = None
        roundpipe_threads.append(self)

    def _run_target(self) -> None:
        try:
            self._user_target()
        except BaseException as exc:  # noqa: BLE001 - everything must reach the main thread
            report_failure(exc)
            with thread_exception_print_lock:
                print(f"roundpipe: thread {self.name} crashed:", file=sys.stderr)
                traceback.print_exc()


def is_threading_internal(frame: FrameType) -> bool:
    """Whether ``frame`` belongs to Python's or RoundPipe's threading machinery."""
    filename = frame.f_code.co_filename
    return filename == threading.__file__ or filename == __file__


def print_trimmed_traceback(frame: Optional[FrameType]) -> None:
    """Print the stack of ``frame`` without threading-internal frames."""
    stack = [f for f in traceback.extract_stack(frame) if not f.filename.endswith(("threading.py", "threads.py"))]
    sys.stderr.write("".join(traceback.format_list(stack)))


def dump_all_active_threads() -> None:
    """Print trimmed stack traces of all live RoundPipe threads (used by the watchdog and for debugging)."""
    frames = sys._current_frames()
    with thread_exception_print_lock:
        for t in roundpipe_threads:
            if not t.is_alive():
                continue
            state = "active" if t.is_active else "idle"
            print(f"--- roundpipe thread {t.name} ({state}) ---", file=sys.stderr)
            print_trimmed_traceback(frames.get(t.ident))  # type: ignore[arg-type]


def raise_if_failed(where: str = "") -> None:
    """Re-raise a recorded worker failure in the calling thread and reset the slot.

    ``RoundPipeAborted`` is never what the user needs to see: the first failure of the run is. Errors
    that already carry their location (``RoundPipeWorkerError``) are raised as they are.
    """
    exc = clear_failure()
    if exc is None:
        return
    if isinstance(exc, KeyboardInterrupt):
        raise KeyboardInterruptRoundPipeThreads(str(exc)) from exc
    if isinstance(exc, (RoundPipeWorkerError, OptimizerStepError)):
        raise exc
    err = RoundPipeWorkerError(f"{where}: {type(exc).__name__}: {exc}" if where else f"{type(exc).__name__}: {exc}")
    raise err from exc


_watch_wait_settings()
