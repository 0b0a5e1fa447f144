"""Data parallel in ``roundpipe train``: joining a torchrun job, and decisions every rank takes together.

``roundpipe train`` launched by torchrun with more than one rank trains data parallel
(:mod:`roundpipe.distributed`): every rank draws the same global batches and trains on its contiguous
share of their rows, the gradients are summed over the ranks, and rank 0 alone prints, writes metrics
and checkpoints. With one rank (plain ``roundpipe train``, or torchrun with a world size of 1) no
process group is created and nothing here does any communication.

The helpers exist for one rule: a rank must never wait in a collective for a rank that has already
failed. Work that can fail on some ranks only (reading a checkpoint on one node, the forward on this
rank's rows, rank 0 writing a checkpoint) runs inside a helper whose closing collective also carries
"did it fail here?", so every rank learns of a failure at the same point: the failing rank raises its
own error, the others :class:`PeerFailed` naming it. A rank that dies outright (killed, segfault)
makes the others' next collective fail at once (gloo sees the connection close); one that stalls,
after the collective's timeout; both become a :class:`PeerFailed` as well. The per-step collective
(:func:`sum_over_ranks`) has the short timeout of the gradient collectives (``RPP_DIST_TIMEOUT_S``,
on a group of its own: the ranks meet there every step), the rest the default group's long one
(``RPP_DIST_MAIN_TIMEOUT_S``: the others wait there while rank 0 writes a checkpoint).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, TypeVar

from roundpipe.cli.config import ConfigError

# roundpipe.distributed (and torch) is imported inside the functions that use it: the CLI's --help,
# --version and configuration errors must not wait for torch.
if TYPE_CHECKING:
    from roundpipe import distributed as rdist

T = TypeVar("T")

_step_group: Any = None  # the per-step group (short timeout), created by start()


class PeerFailed(RuntimeError):
    """Another rank failed (its own output has the error), or contact with it was lost: this rank
    stops too. The CLI prints it as one line, exit status 1."""


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (1 outside torchrun); readable before any process group exists."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    try:
        return int(raw) if raw else 1
    except ValueError:
        raise ConfigError(
            f"WORLD_SIZE={raw!r} is not an integer", "launch with torchrun, or unset WORLD_SIZE"
        ) from None


def rank_prefix() -> str:
    """``"rank R: "`` in a torchrun job of several ranks (so that interleaved output says who wrote
    it), ``""`` otherwise. From the environment: usable before the group exists and after it is gone."""
    try:
        if launched_world_size() <= 1:
            return ""
    except ConfigError:
        return ""  # reported where the job is joined (start)
    return f"rank {os.environ.get('RANK', '?')}: "


def start() -> rdist.DistEnv:
    """Join the torchrun job when it has more than one rank; a single process (no group) otherwise.

    A world size of 1 creates no process group on purpose: a one-rank torchrun run is then exactly a
    plain ``roundpipe train`` (no collectives, no gradient hook).
    """
    from roundpipe import distributed as rdist

    global _step_group
    if launched_world_size() <= 1:
        return rdist.DistEnv()
    env = rdist.init_from_env()
    if env.distributed:
        import torch.distributed as dist

        # Every rank creates it here, first, so groups are created in the same order on all ranks.
        _step_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=rdist.timeout_s()))
    return env


def stop(failed: bool, model: Any = None) -> None:
    """Leave the job that :func:`start` joined (call it only when that returned a distributed env).

    After a failure the optimizer thread may still be reducing an asynchronous step's gradients on
    the data-parallel group; tearing the group down under it can abort the process, so ``model``'s
    pending optimizer work (a RoundPipe model, if one was built) is waited for first, and the failure
    it re-raises dropped: this rank is already failing with a better error (the peers stop at the same
    step, so the reduction completes; if a peer is gone it fails within ``RPP_DIST_TIMEOUT_S``).
    """
    from roundpipe import distributed as rdist

    if failed and model is not None:
        try:
            model.synchronize()
        except Exception:  # noqa: BLE001 - this rank is already failing with a better error
            pass
    global _step_group
    _step_group = None
    rdist.destroy()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _describe(exc: BaseException) -> str:
    """One line saying what went wrong, for the other ranks' messages."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, PeerFailed):
        return _first_line(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _lost(what: str, exc: BaseException, timeout_var: str = "RPP_DIST_MAIN_TIMEOUT_S") -> PeerFailed:
    from roundpipe import distributed as rdist

    seconds = rdist.timeout_s() if timeout_var == "RPP_DIST_TIMEOUT_S" else rdist.main_timeout_s()
    return PeerFailed(
        f"lost contact with the other ranks during {what} ({type(exc).__name__}: {_first_line(exc)}); "
        f"another rank probably died, or stalled past {timeout_var}={seconds:g} s: its output says why"
    )


def _raise_for(failures: Sequence[Optional[str]], own: Optional[BaseException], what: str) -> None:
    """Raise this rank's own error if it failed, else :class:`PeerFailed` naming the failed ranks."""
    if own is not None:
        raise own
    bad = [(r, f) for r, f in enumerate(failures) if f is not None]
    if bad:
        r, first = bad[0]
        more = f" (and rank(s) {', '.join(str(b) for b, _ in bad[1:])})" if len(bad) > 1 else ""
        raise PeerFailed(f"rank {r}{more} failed during {what}: {first}")


def everywhere(fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank; if it raises on any rank, every rank raises.

    For work that can fail on some ranks only and is followed by collectives (setup, loading a
    checkpoint): the closing all-gather tells every rank whether all succeeded.
    """
    from roundpipe import distributed as rdist

    if rdist.get_world_size() == 1:
        return fn()
    result: Any = None
    own: Optional[BaseException] = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have been told
        own = exc
    import torch.distributed as dist

    failures: List[Optional[str]] = [None] * rdist.get_world_size()
    try:
        dist.all_gather_object(failures, None if own is None else _describe(own))
    except Exception as exc:  # noqa: BLE001 - a dead peer
        if own is not None:
            raise own from exc
        raise _lost(what, exc) from exc
    _raise_for(failures, own, what)
    return result


def on_main(fn: Callable[[], T], what: str) -> T:
    """``fn()`` on rank 0 only; its result (small, picklable) or its failure reaches every rank.

    The broadcast doubles as the barrier after rank 0's work (a checkpoint write): the other ranks
    wait in it, up to ``RPP_DIST_MAIN_TIMEOUT_S``.
    """
    from roundpipe import distributed as rdist

    if rdist.get_world_size() == 1:
        return fn()
    own: Optional[BaseException] = None
    box: Tuple[Optional[str], Any] = (None, None)
    if rdist.is_main_process():
        try:
            box = (None, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have been told
            own = exc
            box = (_describe(exc), None)
    try:
        box = rdist.broadcast_object(box)
    except Exception as exc:  # noqa: BLE001 - a dead peer
        if own is not None:
            raise own from exc
        raise _lost(what, exc) from exc
    _raise_for([box[0]] + [None] * (rdist.get_world_size() - 1), own, what)
    return box[1]


def sum_over_ranks(local: Callable[[], Sequence[float]], size: int, what: str) -> List[float]:
    """Sum ``local()`` (``size`` numbers) over the ranks, in float64; if ``local`` raises on any rank,
    every rank raises (one collective: the failure flags travel with the values).

    For work every rank does in step (a training step, the sharded evaluation): it runs on the
    per-step group, whose timeout is ``RPP_DIST_TIMEOUT_S``.
    """
    from roundpipe import distributed as rdist

    own: Optional[BaseException] = None
    try:
        values = [float(v) for v in local()]
        if len(values) != size:
            raise ValueError(f"{what}: expected {size} values, got {len(values)}")
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have been told
        own, values = exc, [0.0] * size
    world = rdist.get_world_size()
    if world == 1:
        if own is not None:
            raise own
        return values
    import torch
    import torch.distributed as dist

    flags = [0.0] * world
    flags[rdist.get_rank()] = 1.0 if own is not None else 0.0
    t = torch.tensor(values + flags, dtype=torch.float64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_step_group)
    except Exception as exc:  # noqa: BLE001 - a dead or stalled peer
        if own is not None:
            raise own from exc
        raise _lost(what, exc, "RPP_DIST_TIMEOUT_S" if _step_group is not None else "RPP_DIST_MAIN_TIMEOUT_S") from exc
    out = t.tolist()
    _raise_for([("see its output" if f else None) for f in out[size:]], own, what)
    return out[:size]


def gather_to_main(obj: Any, what: str) -> Optional[List[Any]]:
    """Every rank's ``obj`` (small, picklable), in rank order, on rank 0; None on the others."""
    from roundpipe import distributed as rdist

    if rdist.get_world_size() == 1:
        return [obj]
    import torch.distributed as dist

    out: Optional[List[Any]] = [None] * rdist.get_world_size() if rdist.is_main_process() else None
    try:
        dist.gather_object(obj, out, dst=0)
    except Exception as exc:  # noqa: BLE001 - a dead peer
        raise _lost(what, exc) from exc
    return out


__all__ = [
    "PeerFailed",
    "everywhere",
    "gather_to_main",
    "launched_world_size",
    "on_main",
    "rank_prefix",
    "start",
    "stop",
    "sum_over_ranks",
]
