"""The data-parallel error and the wording of a failed collective, shared by every part of
:mod:`roundpipe.distributed` (setup, main-thread helpers, host and device reductions)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from roundpipe.distributed.env import timeout_s

T = TypeVar("T")


class DataParallelError(RuntimeError):
    """A data-parallel collective failed (a peer died, stalled past the timeout, or disagrees)."""


# Raised through the package's public name (tracebacks, logs and pickles say roundpipe.distributed).
DataParallelError.__module__ = "roundpipe.distributed"


def exception_summary(exc: BaseException) -> str:
    """``Type: first line of the message``: a collective's error can span many lines (gloo, NCCL)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else repr(exc)}"


def collective_failure(where: str, what: str, waited: float, exc: BaseException) -> DataParallelError:
    """The error of a failed gradient collective: ``where`` (rank), ``what`` (collective, layers, size),
    how long it waited and the timeout, and the usual cause (a peer that died or stalled)."""
    return DataParallelError(
        f"{where}: {what} failed after {waited:.1f} s (collective timeout {timeout_s():g} s, RPP_DIST_TIMEOUT_S): "
        f"{exception_summary(exc)}. Another rank probably died or stalled; its own log says why."
    )


def run_collective(fn: Callable[[], T], where: str, what: str) -> T:
    """``fn()`` (a blocking collective); a failure becomes :func:`collective_failure`'s error."""
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported with its context
        raise collective_failure(where, what, time.perf_counter() - t0, exc) from exc
