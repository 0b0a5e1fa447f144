"""Optimizer state allocated ahead of the first step, in a background thread.

torch's Adam creates its moments lazily, inside the first ``step()``: for a full fine-tune that is 8
bytes per parameter (66 GB for an 8B model) allocated and zeroed (the pages faulted in) on the step's
critical path, so the first iterations after warm-up wait for it. :class:`StateReserve` builds the same
zero states in a background thread, started by the model's first training call (RoundPipe calls
:func:`start_for` with its optimizer copies) while the devices run the first forward; the step then
takes them instead of allocating. Not at construction: a run that resumes loads its optimizer state
after constructing the optimizer, and a reserve built meanwhile would double the state's memory at its
peak. The optimizer's visible state is unchanged: a parameter's state still appears at its first step,
with the same keys, dtypes and values as before; an optimizer used without RoundPipe allocates lazily.

Life cycle (one owner each): the builder thread only writes ``_ready`` under ``_lock``; the optimizer
(whatever thread steps it) calls :meth:`take`, which waits for the builders first, so a state is never
read half-built. :meth:`clear` drops what the first step did not take (parameters without a gradient
then allocate lazily, as in torch), so no memory stays reserved for parameters that never train.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# id(parameter) -> its reserve (weakly), so the runtime can start a reserve knowing only the parameters
# (start_for). Not an attribute on the tensor: that would travel with the parameter into pickles and
# copies. An entry outlives its parameter only until its reserve is cleared or collected; a reused id
# can at worst start a reserve early (take() checks the parameter itself).
_registry: Dict[int, "weakref.ReferenceType[StateReserve]"] = {}
_registry_lock = threading.Lock()

StateFactory = Callable[[Tensor], Dict[str, Tensor]]  # parameter -> its zero state (tensors only)
StateBytes = Callable[[Tensor], int]  # parameter -> the bytes of that state, without building it

# Parameters whose optimizer state another process keeps (a host optimizer step sharded across data-
# parallel ranks, ``roundpipe.distributed.optim_shard``): this process never steps them, so no reserve
# builds their state. id -> weak reference: the entry does not keep a parameter alive, and a reused id is
# told apart by the reference.
_stepped_elsewhere: Dict[int, "weakref.ReferenceType[Tensor]"] = {}


def stepped_elsewhere(params: Iterable[Tensor], elsewhere: bool = True) -> None:
    """Declare that this process's optimizers never step ``params`` (or, with ``elsewhere=False``, that
    they do again): reserves then build no state for them."""
    with _registry_lock:
        for p in params:
            if elsewhere:
                _stepped_elsewhere[id(p)] = weakref.ref(p)
            else:
                _stepped_elsewhere.pop(id(p), None)


def _is_stepped_elsewhere(p: Tensor) -> bool:
    with _registry_lock:
        ref = _stepped_elsewhere.get(id(p))
    return ref is not None and ref() is p


class StateReserve:
    """Zero optimizer states built in the background for parameters given to :meth:`add`."""

    def __init__(self, name: str = "optimizer") -> None:
        self.name = name
        self._lock = threading.Lock()
        # id(param) -> (param, its shape and dtype when built, state); the param is kept to rule out a
        # reused id, shape and dtype to rule out a parameter whose data was replaced since.
        self._ready: Dict[int, Tuple[Tensor, Tuple[torch.Size, torch.dtype], Dict[str, Tensor]]] = {}
        self._threads: List[threading.Thread] = []
        self._pending: List[Tuple[List[Tensor], StateFactory, Optional[StateBytes]]] = []
        self._closed = False
        self.error: Optional[BaseException] = None  # why a builder stopped early (the rest allocate lazily)

    def add(self, params: Iterable[Tensor], make: StateFactory, nbytes: Optional[StateBytes] = None) -> None:
        """Build ``make(p)`` for each trainable host ``p`` once :meth:`start` is called; ``nbytes(p)``, where
        given, says what that costs beforehand (:meth:`planned_bytes`)."""
        todo = [p for p in params if p.requires_grad and p.device.type == "cpu"]
        if not todo or self._closed:
            return
        me = weakref.ref(self)
        with _registry_lock:
            for p in todo:
                _registry[id(p)] = me
        self._pending.append((todo, make, nbytes))

    def planned_bytes(self) -> int:
        """Host bytes the builders that :meth:`start` would launch allocate (states of a factory added
        without ``nbytes`` count 0)."""
        return sum(
            nbytes(p)
            for todo, _, nbytes in self._pending
            if nbytes is not None
            for p in todo
            if not _is_stepped_elsewhere(p)
        )

    def start(self) -> None:
        """Start building what :meth:`add` recorded, in one background thread per ``add`` (main thread)."""
        _live.add(self)
        pending, self._pending = self._pending, []
        for todo, make, _ in pending:
            if self._closed:
                return
            thread = threading.Thread(
                target=self._build, args=(todo, make), name=f"roundpipe-{self.name}-state", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    @property
    def started(self) -> bool:
        """Whether a builder has been started (and the reserve not cleared)."""
        return bool(self._threads or self._ready)

    def _build(self, params: List[Tensor], make: StateFactory) -> None:
        for p in params:
            if self._closed:
                return
            if _is_stepped_elsewhere(p):
                continue
            try:
                key = (p.shape, p.dtype)
                state = make(p)
            except (RuntimeError, MemoryError) as exc:  # out of memory: the step allocates lazily and reports it
                self.error = exc
                logger.debug(
                    "roundpipe optimizer: state preallocation stopped (%s); the first step allocates the rest", exc
                )
                return
            with self._lock:
                if self._closed:
                    return
                self._ready[id(p)] = (p, key, state)

    def stop_at_exit(self, deadline: float) -> None:
        """Interpreter exit: build no more and join the builders (each stops after its current state), until
        ``deadline`` (``time.monotonic``). A daemon thread still inside a torch op when the interpreter
        finalises aborts the process ("terminate called without an active exception")."""
        self._closed = True
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def wait(self) -> None:
        """Block until every builder has finished."""
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def take(self, p: Tensor) -> Optional[Dict[str, Tensor]]:
        """``p``'s prebuilt zero state (removed from the reserve), or None: allocate it yourself."""
        if self._threads:
            self.wait()
        with self._lock:
            entry = self._ready.pop(id(p), None)
        if entry is None or entry[0] is not p or entry[1] != (p.shape, p.dtype):
            return None
        return entry[2]

    def clear(self) -> None:
        """Drop every state not taken, and build no more (after the first step, or a state load)."""
        self._closed = True
        self._unregister()
        self._pending = []
        self.wait()
        with self._lock:
            self._ready.clear()

    def _unregister(self) -> None:
        with _registry_lock:
            for key in [k for k, ref in _registry.items() if ref() is self or ref() is None]:
                del _registry[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)


def _reserves_of(params: Iterable[Tensor]) -> List[StateReserve]:
    """The distinct live reserves registered for ``params``."""
    found: Dict[int, StateReserve] = {}
    for p in params:
        with _registry_lock:
            ref = _registry.get(id(p))
        reserve = ref() if ref is not None else None
        if reserve is not None:
            found.setdefault(id(reserve), reserve)
    return list(found.values())


def start_for(params: Iterable[Tensor]) -> None:
    """Start the reserves the optimizers of ``params`` registered (RoundPipe's first training call)."""
    for reserve in _reserves_of(params):
        reserve.start()


def planned_bytes_for(params: Iterable[Tensor]) -> int:
    """Host bytes that :func:`start_for` on ``params`` would allocate for their optimizers' states."""
    return sum(reserve.planned_bytes() for reserve in _reserves_of(params) if not reserve.started)


def wait_for(params: Iterable[Tensor]) -> None:
    """Wait for the builders of the reserves of ``params`` (RoundPipe's first ``step``): the first step
    then finds every state built instead of waiting for the rest during the next iteration."""
    for reserve in _reserves_of(params):
        reserve.wait()


_live: "weakref.WeakSet[StateReserve]" = weakref.WeakSet()  # reserves whose builders were started


@atexit.register
def _stop_builders() -> None:
    # atexit runs after threading joined the non-daemon threads and before daemon threads are frozen.
    deadline = time.monotonic() + 30.0
    for reserve in list(_live):
        reserve.stop_at_exit(deadline)
