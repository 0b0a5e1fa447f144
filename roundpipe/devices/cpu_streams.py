"""CPU workers' streams and events, and a recording stand-in that checks the order between streams.

On CPU workers a stream op runs at once in the issuing thread and an event is complete once recorded,
so a missing ``wait_event`` can never show as a wrong result. With ``RPP_DEBUG_CHECK_STREAMS`` on (``auto``:
in the stress mode, ``RPP_DEBUG_STRESS_DELAY_S``) the streams keep CUDA's ordering rules as bookkeeping, and
an op that CUDA could run before the work it depends on raises ``StreamOrderError`` instead:

* Positions: each stream counts the ops issued while it is current (``backend.use_stream`` enters a
  torch dispatch mode that sees every op of the block, the compute's and autograd's included).
* Clocks: each stream holds, per other stream, the position up to which its work is ordered after that
  stream's. ``record_event`` snapshots the recording stream's clock (its own position included);
  ``wait_event`` merges a snapshot into the waiting stream's clock; ``wait_stream`` does both at once.
* Completion: ``synchronize()`` or ``query()`` of an event or stream marks the snapshot's positions done
  (the host saw that work end, so work issued anywhere afterwards follows it).
* Accesses: an op records on each storage it writes the writer (stream, position, op), and on each
  storage it reads the reader's position. Reading or writing a storage last written on another
  stream, or writing one read on another stream, needs that access ordered before (clock or
  completion); otherwise the op raises, naming both streams, the tensor, both ops and the first event
  recorded after the access that the stream did not wait for.

* Host threads: code that runs on the host (the optimizer thread's kernels, the main thread inside a
  RoundPipe call) does so inside ``host_checks``, a per-thread dispatch mode. A host op that reads a storage
  whose last stream write this thread has not synchronized itself (``synchronize`` / ``query`` of an event
  or stream recorded after it, by this thread), or writes one that a stream wrote or read before the host
  saw that work complete (by any thread), raises, naming the host thread, its op, the stream, the
  stream's op and the event it should have synchronized. A read counts only the reader's own
  synchronisations: the protocol (``roundpipe.host.attribute``) has each consumer of a download
  synchronize its event (the optimizer thread a layer's ``grad_downloaded``, the main thread its outputs'),
  so a fence that another thread happens to pass earlier never stands in for a missing one
  (synchronizing a completed event costs nothing on a GPU). A write is safe once the streams' earlier
  accesses have ended, whoever saw them end: host buffers change hands between threads (their roles,
  ``roundpipe.host.buffers``), and the thread that fenced the uploads reading a buffer is not always the
  one that refills it.
  Host ops are not recorded for the streams: a stream op issued after a host write follows it in time
  (the issuing thread saw the host's work through a thread event), as on CUDA.

Ops issued elsewhere (outside both) are neither recorded nor checked. Records live on the storages
(``UntypedStorage`` keeps Python attributes for its lifetime), so they go with the memory; an epoch number,
advanced whenever checking turns on, ignores those of an earlier checked period. One lock guards clocks
and records.

Copies are real while checking (``roundpipe.runtime.transfer``: a CPU download, peer copy or host scalar
copies into a new tensor on its stream, as an upload always does), so host copies and device tensors are
distinct storages exactly as on a GPU and every hand-over between streams has a copy to order.

A tensor subclass that holds no data (``torch.nn.attention.bias.CausalBias``: its shape only) cannot be
made under a dispatch mode (torch binds the empty tensor it allocates to a plain ``Tensor`` first), so it
is made through ``unrecorded``: it reads and writes no data, so there is nothing to check; the ops that
later use it are recorded as usual.

Layers compiled with ``torch.compile`` run eagerly while checking (dynamo does not trace under a
dispatch mode): the same results, other kernels.

Event life cycle: an event belongs to the stream that records it (``record``); any stream may wait for
it (``wait_event``) and any thread may synchronize it; a new ``record`` replaces its snapshot. An event
never recorded is complete, as on CUDA. Checking off: every method returns at once (one flag read).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import traceback
import weakref
from typing import Any, Callable, ContextManager, Deque, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from roundpipe import settings

_enabled = False
_epoch = 0
_lock = threading.Lock()
_tls = threading.local()  # .stack: the CpuStreams made current by use_stream in this thread
_ops_checked = 0  # ops seen while checking (tests assert the checks ran)
_host_ops = 0  # of those, host ops (``host_checks``)
_recorded = 0  # events recorded while checking: their order, for error messages
_streams: "weakref.WeakSet[CpuStream]" = weakref.WeakSet()
T = TypeVar("T")

# Ops that only read their inputs' metadata (shape, dtype), never their data.
_META_OPS = {
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::new_zeros",
    "aten::new_ones",
    "aten::new_full",
    "aten::zeros_like",
    "aten::ones_like",
    "aten::full_like",
    "aten::rand_like",
    "aten::randn_like",
    "aten::_has_compatible_shallow_copy_type",
    "aten::is_pinned",
    "aten::is_same_size",
}


class StreamOrderError(RuntimeError):
    """An op on a CPU worker's stream, or a checked host op, touches data that CUDA could still be writing
    or reading on another stream: a ``wait_event`` / ``wait_stream`` (or host synchronisation) is missing."""


class CpuStream:
    """Stand-in for a CUDA stream on a CPU worker: work issued "on" it has finished when the call returns.
    With checking on it keeps a position and a clock (module docstring)."""

    def __init__(self, device: torch.device, name: str = "") -> None:
        self.device = device
        self.name = name or f"cpu-stream@{id(self):x}"
        self.pos = 0  # ops issued on this stream while checking
        self.done = 0  # the position up to which the host has seen this stream's work complete
        self.clock: Dict["CpuStream", int] = {}
        # The last events recorded here, for error messages: (sequence number, position, site, snapshot).
        self.events: Deque[Tuple[int, int, str, Dict["CpuStream", int]]] = collections.deque(maxlen=64)
        _streams.add(self)

    def __repr__(self) -> str:
        return f"CpuStream({self.name})"

    def snapshot(self) -> Dict["CpuStream", int]:
        """The work issued so far on this stream and all it is ordered after (caller holds ``_lock``)."""
        snap = dict(self.clock)
        snap[self] = self.pos
        return snap

    def _merge(self, snap: Dict["CpuStream", int]) -> None:
        for s, p in snap.items():
            if s is not self and p > self.clock.get(s, 0):
                self.clock[s] = p

    def wait_stream(self, stream: Any) -> None:
        if _enabled and isinstance(stream, CpuStream) and stream is not self:
            with _lock:
                self._merge(stream.snapshot())

    def wait_event(self, event: Any) -> None:
        if _enabled and getattr(event, "snap", None):
            with _lock:
                self._merge(event.snap)

    def record_event(self, event: Optional["CpuEvent"] = None) -> "CpuEvent":
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        if _enabled:
            with _lock:
                _complete(self.snapshot())

    def query(self) -> bool:
        self.synchronize()
        return True


class CpuEvent:
    """Stand-in for a CUDA event on a CPU worker: always complete. With checking on, ``record`` keeps a
    snapshot of the stream's clock for ``wait_event`` and the host's waits (module docstring)."""

    def __init__(self) -> None:
        self.snap: Optional[Dict[CpuStream, int]] = None

    def record(self, stream: Any = None) -> None:
        global _recorded
        if _enabled and isinstance(stream, CpuStream):
            site = _site()
            with _lock:
                self.snap = stream.snapshot()
                _recorded += 1
                stream.events.append((_recorded, stream.pos, site, self.snap))

    def wait(self, stream: Any = None) -> None:
        # Only a CPU stream has anything to merge. A CUDA stream handed a CpuEvent (a host buffer's
        # "downloaded" event before its first download: complete by definition) has nothing to wait for;
        # delegating to it would loop, since torch's Stream.wait_event calls event.wait(stream).
        if isinstance(stream, CpuStream):
            stream.wait_event(self)

    def synchronize(self) -> None:
        if _enabled and self.snap:
            with _lock:
                _complete(self.snap)

    def query(self) -> bool:
        self.synchronize()
        return True


def _complete(snap: Dict[CpuStream, int]) -> None:
    """The calling thread saw the work of ``snap`` end: for the streams (``done``) and for its own host
    checks (``_seen``)."""
    seen = _seen()
    for s, p in snap.items():
        if p > s.done:
            s.done = p
        if p > seen.get(s, 0):
            seen[s] = p


def _seen() -> "weakref.WeakKeyDictionary[CpuStream, int]":
    """Per stream, the position up to which this thread has synchronized its work itself."""
    seen = getattr(_tls, "seen", None)
    if seen is None:
        seen = _tls.seen = weakref.WeakKeyDictionary()
    return seen


def enabled() -> bool:
    """Whether CPU streams check their order now."""
    return _enabled


def ops_checked() -> int:
    """How many ops the checks have seen in this process (tests use it to show the checks ran)."""
    return _ops_checked


def host_ops_checked() -> int:
    """How many of those were host ops (``host_checks``)."""
    return _host_ops


def refresh() -> bool:
    """Read ``RPP_DEBUG_CHECK_STREAMS`` again (each RoundPipe call does, at its start, and any ``configure`` of
    it or of the stress mode): ``auto`` checks in the stress mode. Turning on starts a new epoch."""
    global _enabled, _epoch
    mode = settings.DEBUG_CHECK_STREAMS.get()
    on = mode == "1" or (mode == "auto" and settings.DEBUG_STRESS_DELAY_S.get() > 0)
    with _lock:
        if on and not _enabled:
            _epoch += 1
        _enabled = on
    return on


def _site() -> str:
    """``module.function`` of the innermost caller outside this module and ``backend`` (cheap: no source)."""
    f: Any = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__") in (__name__, "roundpipe.devices.backend"):
        f = f.f_back
    return "?" if f is None else f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}"


def _caller() -> str:
    """The two innermost roundpipe frames of the current stack outside this module, for error messages."""
    frames = []
    for fr in reversed(traceback.extract_stack()):
        path = fr.filename.replace("\\", "/")
        if "/roundpipe/" in path and not path.endswith(("cpu_streams.py", "backend.py")):
            frames.append(f"{path.rsplit('/roundpipe/', 1)[1]}:{fr.lineno} ({fr.name})")
            if len(frames) == 2:
                break
    return " from ".join(frames) or "?"


class _Access:
    """What the streams did last to one storage: its writer and, since that write, its readers."""

    __slots__ = ("epoch", "writer", "wpos", "wop", "readers")

    def __init__(self) -> None:
        self.epoch = _epoch
        self.writer: Optional[CpuStream] = None
        self.wpos = 0
        self.wop = ""
        self.readers: Dict[CpuStream, Tuple[int, str]] = {}


def _ordered(stream: CpuStream, other: CpuStream, pos: int) -> bool:
    """Whether work on ``stream`` now follows ``other``'s op at ``pos``."""
    return stream is other or stream.clock.get(other, 0) >= pos or other.done >= pos


def _describe(t: torch.Tensor) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    return f"a {dtype}{list(t.shape)} tensor (storage of {t.untyped_storage().nbytes()} bytes)"


def _missing_event(other: CpuStream, pos: int, host: bool = False) -> str:
    """The first event recorded after ``other``'s op ``pos`` (on any stream ordered after it): the one a
    wait (``host``: a host synchronisation) was missing for."""
    found = [(seq, s, p, site) for s in list(_streams) for seq, p, site, snap in s.events if snap.get(other, 0) >= pos]
    if not found:
        return f"no event was recorded after it (on {other.name} or a stream waiting for it)"
    _, s, p, site = min(found, key=lambda f: f[0])
    where = f"the event recorded after it on {s.name} (at its op #{p}, in {site})"
    if host:
        return f"the host never synchronized {where}"
    return f"the stream never waited for {where}, nor did the host synchronize that event"


def _fail(
    stream: CpuStream, t: torch.Tensor, op: str, verb: str, other: CpuStream, opos: int, overb: str, oop: str
) -> None:
    raise StreamOrderError(
        f"{stream.name} {verb} {_describe(t)} with {op} (its op #{stream.pos}, at {_caller()}) that {other.name} "
        f"{overb} with {oop} (its op #{opos}), without being ordered after that: {_missing_event(other, opos)}"
    )


def _host_fail(t: torch.Tensor, op: str, verb: str, other: CpuStream, opos: int, overb: str, oop: str) -> None:
    raise StreamOrderError(
        f"host thread {threading.current_thread().name!r} {verb} {_describe(t)} with {op} (at {_caller()}) that "
        f"{other.name} {overb} with {oop} (its op #{opos}), before the host saw that work complete: "
        f"{_missing_event(other, opos, host=True)}; {_host_view(other)}"
    )


def _host_view(other: CpuStream) -> str:
    """How far this thread and the host have seen ``other``'s work end, and whether another live stream has
    its name: what tells a stale or missing synchronize from one of a stream of another device pool."""
    twins = sum(1 for s in list(_streams) if s.name == other.name and s is not other)
    same = f"; {twins} other live stream(s) have that name (another device pool)" if twins else ""
    return (
        f"this thread synchronized {other.name} up to its op #{_seen().get(other, 0)}, the host up to "
        f"#{other.done} (of {other.pos}){same}"
    )


def _peek(t: torch.Tensor) -> Optional[_Access]:
    """The streams' record of ``t``'s storage in this epoch, if any (host ops make none)."""
    try:
        rec = getattr(t.untyped_storage(), "_rpp_access", None)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return rec if rec is not None and rec.epoch == _epoch else None


def _host_op(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Check a host op against the streams' last accesses of what it reads and writes (module docstring).
    A checked host write leaves the storage to the host: no stream access is pending on it any more."""
    global _ops_checked, _host_ops
    name, writes, _, meta = _op_info(func)
    if meta:
        return
    written: List[torch.Tensor] = []
    for i, arg_name in writes:
        written.extend(_tensors(args[i] if i < len(args) else kwargs.get(arg_name)))
    skip = {id(t) for t in written}
    seen = _seen()
    with _lock:
        _ops_checked += 1
        _host_ops += 1
        for x in (*args, *kwargs.values()):
            for t in _tensors(x):
                rec = None if id(t) in skip else _peek(t)
                if rec is not None and rec.writer is not None and seen.get(rec.writer, 0) < rec.wpos:
                    _host_fail(t, name, "reads", rec.writer, rec.wpos, "wrote", rec.wop)
        for t in written:
            rec = _peek(t)
            if rec is None:
                continue
            if rec.writer is not None and rec.writer.done < rec.wpos:
                _host_fail(t, name, "writes", rec.writer, rec.wpos, "wrote", rec.wop)
            for reader, (rpos, rop) in rec.readers.items():
                if reader.done < rpos:
                    _host_fail(t, name, "writes", reader, rpos, "read", rop)
            rec.writer, rec.readers = None, {}


def _access(t: torch.Tensor) -> Optional[_Access]:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without storage (meta, a subclass)
        return None
    rec = getattr(st, "_rpp_access", None)
    if rec is None or rec.epoch != _epoch:
        rec = _Access()
        st._rpp_access = rec  # type: ignore[attr-defined]
    return rec


def _read(stream: CpuStream, t: torch.Tensor, op: str) -> None:
    rec = _access(t)
    if rec is None:
        return
    if rec.writer is not None and not _ordered(stream, rec.writer, rec.wpos):
        _fail(stream, t, op, "reads", rec.writer, rec.wpos, "wrote", rec.wop)
    rec.readers[stream] = (stream.pos, op)


def _write(stream: CpuStream, t: torch.Tensor, op: str, check: bool = True) -> None:
    rec = _access(t)
    if rec is None:
        return
    if check:
        if rec.writer is not None and not _ordered(stream, rec.writer, rec.wpos):
            _fail(stream, t, op, "writes", rec.writer, rec.wpos, "wrote", rec.wop)
        for reader, (rpos, rop) in rec.readers.items():
            if not _ordered(stream, reader, rpos):
                _fail(stream, t, op, "writes", reader, rpos, "read", rop)
    rec.writer, rec.wpos, rec.wop = stream, stream.pos, op
    rec.readers = {}


_OpInfo = Tuple[str, Tuple[Tuple[int, str], ...], Tuple[bool, ...], bool]
_op_infos: Dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    """(name, written arguments (index, name), which returns are new tensors, whether the op reads no data)."""
    info = _op_infos.get(func)
    if info is None:
        schema = func._schema
        writes = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        rets = schema.returns
        fresh = tuple(r.alias_info is None for r in rets)
        view = bool(rets) and not writes and all(r.alias_info is not None for r in rets)
        info = (schema.name, writes, fresh, view or schema.name in _META_OPS)
        _op_infos[func] = info
    return info


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y


class _Recorder(TorchDispatchMode):
    """Sees every op issued while a CPU stream is current and checks / records its accesses."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        global _ops_checked
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stack: List[CpuStream] = getattr(_tls, "stack", [])
        if not _enabled or not stack:
            return out
        stream = stack[-1]
        name, writes, fresh, meta = _op_info(func)
        written: List[torch.Tensor] = []
        for i, arg_name in writes:
            written.extend(_tensors(args[i] if i < len(args) else kwargs.get(arg_name)))
        with _lock:
            _ops_checked += 1
            stream.pos += 1
            if not meta:
                skip = {id(t) for t in written}
                for x in (*args, *kwargs.values()):
                    for t in _tensors(x):
                        if id(t) not in skip:
                            _read(stream, t, name)
            inputs = None
            for t in written:
                _write(stream, t, name)
            for is_new, o in zip(fresh, out if isinstance(out, (tuple, list)) and len(fresh) > 1 else (out,)):
                if not is_new:
                    continue
                for t in _tensors(o):
                    if inputs is None:  # a kernel may hand back an input although the schema says new
                        inputs = {id(a.untyped_storage()) for x in (*args, *kwargs.values()) for a in _tensors(x)}
                    if id(t.untyped_storage()) not in inputs:
                        _write(stream, t, name, check=False)
        return out


class _StreamContext:
    """``use_stream`` of a CPU stream while checking: the stream is current in this thread; the first
    such block of the thread enters the dispatch mode that records the ops."""

    def __init__(self, stream: CpuStream) -> None:
        self.stream = stream
        self.mode: Optional[_Recorder] = None

    def __enter__(self) -> None:
        stack = getattr(_tls, "stack", None)
        if stack is None:
            stack = _tls.stack = []
        if not stack:
            self.mode = _Recorder()
            self.mode.__enter__()
        stack.append(self.stream)

    def __exit__(self, *exc: Any) -> None:
        _tls.stack.pop()
        if self.mode is not None:
            self.mode.__exit__(*exc)


def use(stream: CpuStream) -> Optional[_StreamContext]:
    """The block context that makes ``stream`` current, or None while checking is off."""
    return _StreamContext(stream) if _enabled else None


class _HostRecorder(TorchDispatchMode):
    """Sees every op of a host thread inside ``host_checks`` and checks it (``_host_op``); ops issued
    while a stream is current in the thread are the stream's (``_Recorder``, above this mode)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _enabled and not getattr(_tls, "stack", None):
            _host_op(func, args, kwargs)
        return func(*args, **kwargs)


class _HostContext:
    """``host_checks`` while checking: this thread's ops are checked as host ops until the block ends."""

    def __init__(self) -> None:
        self.mode = _HostRecorder()

    def __enter__(self) -> None:
        _tls.host = True
        self.mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        _tls.host = False


_NULL = contextlib.nullcontext()  # reusable: nullcontext keeps no state between uses


def host_checks() -> ContextManager[Any]:
    """The block in which this thread's ops are checked as host ops (module docstring): a host thread's
    work that may read what the streams wrote (an optimizer kernel, the main thread's part of a RoundPipe
    call). A no-op (one flag read) while checking is off, or inside such a block already."""
    if not _enabled or getattr(_tls, "host", False):
        return _NULL
    return _HostContext()


def host_checked(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with its body inside ``host_checks``: the main thread's part of a RoundPipe call (its
    forward, backward, step), which reads the downloads the devices made."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> T:
        with host_checks():
            return fn(*args, **kwargs)

    return checked


def unrecorded(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` outside this thread's checking modes: for the constructor of a tensor subclass that
    holds no data (module docstring), which torch cannot run under a dispatch mode. Checking off, or
    no mode of ours current: ``fn(*args)`` as it is."""
    if not isinstance(_get_current_dispatch_mode(), (_Recorder, _HostRecorder)):
        return fn(*args)
    with _pop_mode_temporarily():
        return unrecorded(fn, *args)


def current_event() -> Optional[CpuEvent]:
    """An event recorded now on this thread's current CPU stream (after the ops issued on it so far),
    or None while checking is off or outside ``use_stream``: what a host reader of those ops'
    results synchronizes (``transfer.HostScalar``)."""
    stack = getattr(_tls, "stack", None)
    return stack[-1].record_event() if _enabled and stack else None


def _watch_settings() -> None:
    settings.on_change(settings.DEBUG_CHECK_STREAMS, refresh)
    settings.on_change(settings.DEBUG_STRESS_DELAY_S, refresh)
    refresh()


_watch_settings()

__all__ = [
    "CpuEvent",
    "CpuStream",
    "StreamOrderError",
    "current_event",
    "enabled",
    "host_checked",
    "host_checks",
    "host_ops_checked",
    "ops_checked",
    "refresh",
    "unrecorded",
    "use",
]
