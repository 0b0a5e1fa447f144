"""Optimizer state allocated ahead of the first step, in a background thread.

torch's Adam creates its moments lazily, inside the first ``step()``: for a full fine-tune that is 8
bytes per parameter (66 GB for an 8B model) allocated and zeroed (the pages faulted in) on the step's
critical path, so the first iterations after warm-up wait for it. :class:`StateReserve` builds the same
zero states in a background thread as soon as the optimizer is constructed, while the model loads and
the first forward runs; the step then takes them instead of allocating. The optimizer's visible state
is unchanged: a parameter's state still appears at its first step, with the same keys, dtypes and
values as before.

Life cycle (one owner each): the builder thread only writes ``_ready`` under ``_lock``; the optimizer
(whatever thread steps it) calls :meth:`take`, which waits for the builders first, so a state is never
read half-built. :meth:`clear` drops what the first step did not take (parameters without a gradient
then allocate lazily, as in torch), so no memory stays reserved for parameters that never train.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

StateFactory = Callable[[Tensor], Dict[str, Tensor]]  # parameter -> its zero state (tensors only)


class StateReserve:
    """Zero optimizer states built in the background for parameters given to :meth:`add`."""

    def __init__(self, name: str = "optimizer") -> None:
        self.name = name
        self._lock = threading.Lock()
        # id(param) -> (param, its shape and dtype when built, state); the param is kept to rule out a
        # reused id, shape and dtype to rule out a parameter whose data was replaced since.
        self._ready: Dict[int, Tuple[Tensor, Tuple[torch.Size, torch.dtype], Dict[str, Tensor]]] = {}
        self._threads: List[threading.Thread] = []
        self._closed = False
        self.error: Optional[BaseException] = None  # why a builder stopped early (the rest allocate lazily)

    def add(self, params: Iterable[Tensor], make: StateFactory) -> None:
        """Start building ``make(p)`` for each trainable ``p`` in a background thread (one per call)."""
        todo = [p for p in params if p.requires_grad and p.device.type == "cpu"]
        if not todo or self._closed:
            return
        thread = threading.Thread(target=self._build, args=(todo, make), name=f"roundpipe-{self.name}-state", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _build(self, params: List[Tensor], make: StateFactory) -> None:
        for p in params:
            if self._closed:
                return
            try:
                key = (p.shape, p.dtype)
                state = make(p)
            except (RuntimeError, MemoryError) as exc:  # out of memory: the step allocates lazily and reports it
                self.error = exc
                logger.debug("roundpipe optimizer: state preallocation stopped (%s); the first step allocates the rest", exc)
                return
            with self._lock:
                if self._closed:
                    return
                self._ready[id(p)] = (p, key, state)

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
        self.wait()
        with self._lock:
            self._ready.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)
