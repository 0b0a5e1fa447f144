"""Thread helpers that keep RoundPipe worker threads observable and safe.

Every blocking wait in RoundPipe goes through ``AnnotatedEvent.wait`` or ``AnnotatedSemaphore.acquire``.
They wait in short slices and check a process-wide failure slot in between: when any RoundPipe thread
fails, every waiter wakes within ``POLL_S`` and raises ``RoundPipeAborted``, so no thread hangs on a
peer that died. The caller's thread then re-raises the original exception (see ``raise_if_failed``).

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
from typing import Any, Callable, List, Optional

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


_last_progress = time.monotonic()
_progress = 0  # how many times a run moved forward (``wait_or_stall`` restarts its clock at each)
_main_waits = 0


def note_progress() -> None:
    """Record that a run moved forward (a microbatch, job or optimizer kernel finished)."""
    global _last_progress, _progress
    _last_progress = time.monotonic()
    _progress += 1


def _check_abort() -> None:
    if _failure is not None:
        raise RoundPipeAborted("aborted: another RoundPipe thread failed") from None


class _Waiting:
    """Counts threads blocked in RoundPipe waits (the watchdog only fires while someone waits)."""

    def __enter__(self) -> None:
        global _main_waits
        _main_waits += 1
        _ensure_watchdog()

    def __exit__(self, *exc: Any) -> None:
        global _main_waits
        _main_waits -= 1


_watchdog: Optional[threading.Thread] = None


def _ensure_watchdog() -> None:
    """Start the watchdog thread once if ``RPP_WATCHDOG_S`` is set (off by default)."""
    global _watchdog
    if _watchdog is not None:
        return
    from roundpipe import settings

    limit = settings.WATCHDOG_S.get()
    if limit <= 0:
        _watchdog = threading.current_thread()  # marks "checked, disabled"
        return
    _watchdog = threading.Thread(target=_watch, args=(limit,), name="roundpipe-watchdog", daemon=True)
    _watchdog.start()


def _watch(limit: float) -> None:
    """Dump every RoundPipe thread's stack when waits make no progress for ``limit`` seconds (again
    every ``limit`` seconds while they still make none)."""
    quiet_until = 0.0
    while True:
        time.sleep(min(1.0, limit / 4))
        now = time.monotonic()
        stalled = now - _last_progress
        if _main_waits > 0 and stalled > limit and now >= quiet_until:
            with thread_exception_print_lock:
                print(
                    f"roundpipe watchdog: no progress for {stalled:.0f} s (RPP_WATCHDOG_S={limit:g}); thread stacks:",
                    file=sys.stderr,
                )
                print("--- main thread ---", file=sys.stderr)
                print_trimmed_traceback(sys._current_frames().get(threading.main_thread().ident))
            dump_all_active_threads()
            quiet_until = now + limit  # not ``note_progress``: a stalled wait (``wait_or_stall``) must still fail


def _poll(attempt: Callable[[float], bool], timeout: Optional[float]) -> bool:
    """Call ``attempt(slice)`` (a blocking wait of at most ``slice`` seconds) until it succeeds or
    ``timeout`` passes, checking between slices whether another RoundPipe thread failed."""
    with _Waiting():
        remaining = timeout
        while True:
            _check_abort()
            step = POLL_S if remaining is None else min(POLL_S, remaining)
            if attempt(step):
                return True
            if remaining is not None:
                remaining -= step
                if remaining <= 0:
                    return False


_stress_rng = random.Random(0)
_stress_limit = 0.0
_stall_limit = 0.0  # RPP_WATCHDOG_S as ``wait_or_stall`` uses it (0: plain waits)


def refresh_waits() -> None:
    """Read ``RPP_DEBUG_STRESS_DELAY_S`` and ``RPP_WATCHDOG_S`` again (each RoundPipe call does, at its start,
    and any ``configure`` of them). Waits use the values read last: a wait is too frequent a place to parse
    the environment."""
    global _stress_limit, _stall_limit
    from roundpipe import settings

    _stress_limit = settings.DEBUG_STRESS_DELAY_S.get()
    _stall_limit = settings.WATCHDOG_S.get()


def _watch_wait_settings() -> None:
    from roundpipe import settings

    settings.on_change(settings.DEBUG_STRESS_DELAY_S, refresh_waits)
    settings.on_change(settings.WATCHDOG_S, refresh_waits)
    refresh_waits()


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
    """Event whose waits are named (for stack dumps) and abort when a RoundPipe thread fails."""

    def __init__(self, name: str = "", set: bool = False) -> None:  # noqa: A002 - mirrors Event.set
        super().__init__()
        self.name = name
        if set:
            self.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        stress_delay()
        if self.is_set():
            return True
        with annotate(f"wait {self.name}"):  # a blocking wait shows on profiler timelines (RPP_PROFILER)
            return _poll(super().wait, timeout)


class RoundPipeStalled(RuntimeError):
    """A wait saw no RoundPipe thread make progress for ``RPP_WATCHDOG_S`` seconds (``wait_or_stall``)."""


def wait_or_stall(event: AnnotatedEvent, what: Callable[[], str]) -> None:
    """``event.wait()`` for a peer thread's hand-over; with ``RPP_WATCHDOG_S`` > 0, raise
    ``RoundPipeStalled`` (``what()`` says what never came) once no RoundPipe thread has made progress
    (``note_progress``: a microbatch or optimizer kernel done) for that long, so a peer that will never
    set the event fails the run instead of hanging it. The clock restarts at every progress: a run
    that is slow but moving is not cut short. Without a watchdog it waits as ``event.wait()``."""
    limit = _stall_limit
    if limit <= 0:
        event.wait()
        return
    seen, deadline = _progress, time.monotonic() + limit
    while not event.wait(min(limit, 0.25)):
        now = time.monotonic()
        if _progress != seen:
            seen, deadline = _progress, now + limit
        elif now >= deadline:
            raise RoundPipeStalled(
                f"{what()}: no RoundPipe thread made progress for {limit:g} s (RPP_WATCHDOG_S) while waiting for it"
            )


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
            return _poll(lambda step: super(AnnotatedSemaphore, self).acquire(True, step), timeout)

    __enter__ = acquire


class RoundPipeThread(threading.Thread):
    """Daemon thread that records uncaught exceptions in the failure slot instead of dying silently.

    Attributes:
        is_active: Whether the thread currently executes user work (used by ``dump_all_active_threads``).
    """

    def __init__(self, target: Callable[[], Any], name: str, **kwargs: Any) -> None:
        super().__init__(target=self._run_target, name=name, daemon=True, **kwargs)
        self._user_target = target
        self.is_active = False
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
