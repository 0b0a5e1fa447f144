"""CUDA graphs of a job's per-microbatch compute, and the fixed device slots their weights live in.

A job runs one layer group over every microbatch of a call, the same computation each time. Issued
eagerly, each microbatch costs the device thread one Python call and one launch per kernel (hundreds
per decoder layer, with its backward), and with several GPUs those threads queue for the interpreter
lock. Captured once as a CUDA graph, a microbatch costs a few copies and one replay.

What a graph needs, and who provides it:

* Fixed addresses for the weights. A graphed job uploads its layers into this device's ``LayerSlot``
  s instead of fresh tensors: one slot per (layer structure, parity, position in the group). Jobs on a
  device alternate parity, and ``DeviceManager.throttle_prefetch`` keeps at most two jobs' weights
  resident, so a job reuses the slots of the job two before it. Its parameter stream first waits for
  that job's ``release`` event (recorded on the gradient stream after the job's gradient downloads,
  which follow its compute): the new weights never overwrite ones still being read. A weight whose
  device copy is not one plain tensor (a frozen fp8 base under FP8 GEMMs, its bytes and row scales)
  gets a slot tensor per part (``layer_signature``'s ``parts``), so the graph reads what an eager job does.
* Fixed addresses for the inputs: every tensor input is copied into the graph's static inputs before
  each replay (on the compute stream, which has waited for the uploads). Outputs are cloned out of the
  graph's static outputs, so a result may live on (a hand-over, a download in flight) while the next
  replay overwrites the static ones. An output that is one of the inputs (a tensor or object passed
  through the layers, such as the labels or the rotary tables) is the caller's input again.
* A computation that replays the same: ``GraphCache.run`` runs a key (job kind, parity, layer
  structures, input shapes and dtypes, grad flags, autocast) eagerly ``WARMUP`` times first (compiled
  kernels compile and autotune, cuBLAS picks its workspace), checking that the computation draws no
  random numbers and saves nothing for recompute; a key that does either, or whose capture fails
  (a host synchronisation, data-dependent shapes), runs eagerly from then on.

Graphs of a device share one memory pool. They run one at a time on the compute stream and every
graph's static outputs stay allocated while the graph is cached, so what two graphs share is only
their temporaries: safe in any replay order. At most ``MAX_GRAPHS`` graphs are kept per device, and a
new shape (another sequence length) is a new key: shapes that keep changing run eagerly.

CPU workers (``RPP_DEBUG_GRAPHS=1`` on CPU) get a stand-in that "captures" by recording the function and
"replays" by running it again on the static inputs and copying its results into the static outputs:
the same data flow (slots, static copies, pass-through outputs, clones, guards), so CI tests it.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, OrderedDict, Sequence, Set, Tuple

import torch
from torch import nn

from roundpipe.devices import allocator, backend, memory
from roundpipe.devices.backend import Event

logger = logging.getLogger("roundpipe")

Leaves = List[Any]
# Non-tensor leaves a graph may pass through unchanged without reading them; matched by type in keys.
_OPAQUE_TYPES: Tuple[type, ...] = ()
_SIMPLE = (type(None), bool, int, float, str)


#: Graphs only for microbatches whose inputs stay below this many bytes: at long context a job is
#: compute-bound (its launches cost nothing next to its kernels) and a graph's private memory pool
#: would sit beside the eager allocator's, in the device memory long sequences need.
MAX_INPUT_BYTES = 256 * 2**20


def register_opaque(cls: type) -> None:
    """Let objects of ``cls`` ride through graphed layers as pass-through leaves (keyed by type, never
    read inside the graph), e.g. ``transfer.HostScalar``."""
    global _OPAQUE_TYPES
    if cls not in _OPAQUE_TYPES:
        _OPAQUE_TYPES = _OPAQUE_TYPES + (cls,)


def enabled(device: torch.device, pool_size: int, mode: str) -> bool:
    """Whether jobs on ``device`` may be graphed under ``mode`` (``RPP_DEBUG_GRAPHS``, read once per call by
    the run). ``auto``: on a pool of several GPUs, where each job's host cost decides the pace (measured on
    one GPU, the graphs gave nothing: its single device thread launches its kernels ahead of the GPU
    anyway). ``1`` on CPU workers selects the stand-in."""
    if mode == "0":
        return False
    if mode == "1":
        return True
    return backend.is_cuda(device) and pool_size > 1 and allocator_allows(pool_size)


EXPANDABLE_MAX_DEVICES = allocator.EXPANDABLE_MAX_DEVICES

_allocator_checked = False


def allocator_allows(pool_size: int) -> bool:
    """Whether ``auto`` may graph a pool of ``pool_size`` GPUs under the allocator's settings. Above
    :data:`EXPANDABLE_MAX_DEVICES` with expandable segments: when ``import roundpipe`` chose them, they
    are turned off for the segments created from now on (graphs, which keep their memory in private
    pools, gain more on such pools than expandable segments: 62,119 against 45,298 tokens/s eagerly
    with them, 4 H200s); when the user chose them, jobs stay eager, with one log line."""
    global _allocator_checked
    if pool_size <= EXPANDABLE_MAX_DEVICES or not allocator.expandable_segments_requested():
        return True
    state = allocator.withdraw_own_expandable_segments()
    if state != "user":
        if state == "withdrawn":
            logger.info(
                "roundpipe: graphed jobs on %d GPUs: the allocator's expandable segments (set by import roundpipe) "
                "are off from now on; they failed graph captures on pools of more than %d GPUs",
                pool_size,
                EXPANDABLE_MAX_DEVICES,
            )
        return True
    if not _allocator_checked:
        _allocator_checked = True
        logger.warning(
            "roundpipe: jobs on %d GPUs stay eager: PYTORCH_ALLOC_CONF asks for expandable segments, with which "
            "graph captures failed on pools of more than %d GPUs; unset it (or set RPP_DEBUG_GRAPHS=1 to try)",
            pool_size,
            EXPANDABLE_MAX_DEVICES,
        )
    return False


#: The tensors a parameter's device copy holds when it is not one plain tensor of its shape and dtype (a frozen
#: weight whose GEMMs read its packed bytes): each one's (name, shape, dtype).
Parts = Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]


def layer_signature(
    layer: nn.Module, parts: Optional[Callable[[torch.Tensor], Optional[Parts]]] = None
) -> Optional[Tuple[Any, ...]]:
    """The storage a layer's slot needs: its class and, per parameter, its shape, dtype and ``parts(p)`` (the
    tensors its device copy holds instead of one plain tensor of that shape, or None: a plain one), or None
    when the layer cannot use a slot (buffers, which forward may update; a parameter shared with another
    module of the layer)."""
    if any(True for _ in layer.buffers()):
        return None
    shapes = []
    seen: Set[int] = set()
    for mod in layer.modules():
        for p in mod._parameters.values():
            if p is None:
                continue
            if id(p) in seen:
                return None
            seen.add(id(p))
            shapes.append((tuple(p.shape), p.dtype, parts(p) if parts is not None else None))
    return (type(layer).__name__, tuple(shapes))


class LayerSlot:
    """Device storage for one layer's parameters and their gradients, at fixed addresses.

    Attributes:
        params: One tensor per parameter, in ``layer.modules()`` order; None for a parameter held as parts.
        packed: Per parameter, the tensors of its parts by name (``layer_signature``), or None for a plain one.
        grads: Their gradient buffers, made on first use in training.
        release: Event after which the last job using the slot no longer reads or writes it (None: never
            used); the next upload into it waits for it on the parameter stream.
    """

    def __init__(self, signature: Tuple[Any, ...], device: torch.device) -> None:
        self.params: List[Optional[torch.Tensor]] = []
        self.packed: List[Optional[Dict[str, torch.Tensor]]] = []
        for shape, dtype, parts in signature[1]:
            plain = parts is None
            self.params.append(torch.empty(shape, dtype=dtype, device=device) if plain else None)
            self.packed.append(None if plain else {n: torch.empty(s, dtype=d, device=device) for n, s, d in parts})
        self.grads: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self.release: Optional[Event] = None

    def grad(self, k: int) -> torch.Tensor:
        g = self.grads[k]
        if g is None:
            p = self.params[k]
            if p is None:
                raise ValueError(f"graph slot: parameter {k} is held as parts (a frozen weight): it has no gradient")
            g = self.grads[k] = torch.empty_like(p)
        return g


def _fingerprint(leaf: Any) -> Optional[Hashable]:
    """What a key records of one input leaf; None for an object a graph cannot take as input (it might
    read it, and a replay would not see its next value)."""
    if isinstance(leaf, torch.Tensor):
        return ("t", tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.requires_grad)
    if isinstance(leaf, _SIMPLE):
        return ("v", type(leaf), leaf)
    if isinstance(leaf, _OPAQUE_TYPES):
        return ("o", type(leaf))
    return None


def leaves_key(leaves: Sequence[Any], spec: Any) -> Optional[Tuple[Any, ...]]:
    """Key part for a job's inputs: the tree structure and each leaf's fingerprint (None: not graphable)."""
    prints = tuple(_fingerprint(t) for t in leaves)
    return None if any(p is None for p in prints) else (spec, prints)


@dataclass
class _Captured:
    """One captured graph: its static inputs, and how to build the outputs after a replay."""

    graph: Any
    static_in: List[Optional[torch.Tensor]]
    # Per output leaf: ("in", k) the caller's input k; ("out", tensor) a static output (cloned out);
    # ("const", value) a constant.
    out_map: List[Tuple[str, Any]]
    spec: Any
    fn: Optional[Callable[[Leaves], Tuple[Leaves, Any]]] = None  # the CPU stand-in re-runs it
    uses: int = field(default=0)
    diverged: bool = False  # the stand-in found the computation depending on the data


class GraphCache:
    """A device's slots and graphs (see the module docstring); used by that device's thread only.

    Attributes:
        device: The torch device.
        compute_stream: Where graphs are captured and replayed.
        slots: (layer signature, parity, position) -> LayerSlot.
        graphs: Key -> captured graph, least recently used first.
        warm: Key -> eager runs so far.
        refused: Keys that run eagerly for good.
        jobs: Jobs begun on this device (their parity alternates).
        captures / replays / failures: Counts, for benchmarks and tests; ``last_error``: why the last
            capture failed.
    """

    WARMUP = 2
    #: Graphs kept per device (least recently used dropped first): each holds static outputs of its
    #: own, so a run whose lengths keep changing must not collect them without bound.
    MAX_GRAPHS = 16
    #: Keys remembered (warm-up counts, refusals) before they are forgotten and start over.
    MAX_KEYS = 1024

    def __init__(self, device: torch.device, compute_stream: Any) -> None:
        self.device = device
        self.compute_stream = compute_stream
        self.cuda = backend.is_cuda(device)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.slots: Dict[Tuple[Any, int, int], LayerSlot] = {}
        self.graphs: OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self.warm: Dict[Hashable, int] = collections.defaultdict(int)
        self.refused: Set[Hashable] = set()
        self.jobs = 0
        self.captures = 0
        self.replays = 0
        self.failures = 0
        self.last_error = ""

    def begin_job(self) -> int:
        """Count a job on this device; returns its parity (which slots it may use)."""
        parity = self.jobs & 1
        self.jobs += 1
        return parity

    def take_slots(self, signatures: Sequence[Tuple[Any, ...]], parity: int) -> List[LayerSlot]:
        """The slots of a job's layers (creating them on first use)."""
        out = []
        for k, sig in enumerate(signatures):
            key = (sig, parity, k)
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = LayerSlot(sig, self.device)
            out.append(slot)
        return out

    def captured(self, key: Optional[Hashable]) -> bool:
        """Whether ``key`` replays a captured graph (the run will be one replay: worth timing as a
        group; a warm-up or a capture is not, and runs the eager path's own timing)."""
        return key is not None and key in self.graphs

    def holds_memory(self) -> bool:
        """Whether graphs (their static outputs and pool) or slots hold device memory now."""
        return bool(self.graphs or self.slots)

    def clear(self) -> None:
        """Drop every graph and slot (the caller has synchronised the device)."""
        self.graphs.clear()
        self.warm.clear()
        self.refused.clear()
        self.slots.clear()

    # ---- running ---------------------------------------------------------------------------------
    def run(
        self,
        key: Optional[Hashable],
        fn: Callable[[Leaves], Tuple[Leaves, Any]],
        inputs: Leaves,
        eager: Optional[Callable[[Leaves], Tuple[Leaves, Any]]] = None,
        check: Optional[Callable[[], bool]] = None,
    ) -> Tuple[Leaves, Any]:
        """``fn(inputs) -> (output leaves, meta)``, eagerly or through the graph of ``key``.

        ``fn`` must be a pure function of its inputs and the job's slot tensors (the compute stream is
        current): it is what gets captured. ``eager`` (default ``fn``) computes the same with the eager
        path's bookkeeping (RNG states saved for the recompute, per-layer waits and timing); it runs
        the warm-ups and every call of a refused key. ``check()``, asked after each warm-up, says
        whether the run was fit for a graph (no random numbers drawn, nothing saved for recompute);
        False refuses the key."""
        eager = fn if eager is None else eager
        if key is None:  # inputs no graph can take (``leaves_key``)
            return eager(inputs)
        captured = self.graphs.get(key)
        if captured is not None:
            self.graphs.move_to_end(key)
            out = self._replay(captured, inputs)
            if captured.diverged:  # the stand-in saw the computation change with the data
                del self.graphs[key]
                self.refused.add(key)
            return out
        if key in self.refused:
            return eager(inputs)
        if len(self.warm) > self.MAX_KEYS or len(self.refused) > self.MAX_KEYS:
            self.warm.clear()
            self.refused.clear()
        if self.warm[key] < self.WARMUP:
            self.warm[key] += 1
            out = eager(inputs)
            if check is not None and not check():
                self.refused.add(key)
            return out
        try:
            captured = self._capture(fn, inputs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - capture is an optimisation: run eagerly instead
            self.refused.add(key)
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.last_error = f"{type(exc).__name__}: {first}"
            log = logger.warning if not self.failures else logger.debug  # once per device
            log("roundpipe graphs: a job on %s runs eagerly (its capture failed: %s)", self.device, self.last_error)
            self.failures += 1
            return eager(inputs)
        if captured is None:  # outputs a graph cannot reproduce
            self.refused.add(key)
            return eager(inputs)
        self.graphs[key] = captured
        self.captures += 1
        while len(self.graphs) > self.MAX_GRAPHS:
            self.graphs.popitem(last=False)
        if captured.graph is None:
            # The stand-in's capture ran the function on the static inputs for real (a CUDA capture runs
            # nothing): its static outputs are this microbatch's results.
            return self._outputs(captured, inputs)
        return self._replay(captured, inputs)

    def _capture(self, fn: Callable[[Leaves], Tuple[Leaves, Any]], inputs: Leaves) -> Optional[_Captured]:
        """Capture ``fn`` on static copies of ``inputs`` (not run: the replay that follows computes)."""
        with torch.no_grad():
            static_in = [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in inputs]
        leaves_in = [s if s is not None else t for s, t in zip(static_in, inputs)]
        if self.cuda:
            graph = torch.cuda.CUDAGraph()
            # On the compute stream, which this thread alone issues to. thread_local: the other device
            # threads (and the optimizer thread) may allocate or query events meanwhile; only this
            # thread's unsafe calls would break the capture (they raise, and the key runs eagerly).
            # A pinned buffer whose last view dies in this thread meanwhile is unpinned after the capture
            # (``memory.release_deferred``: cudaHostUnregister would invalidate it).
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                try:
                    out_leaves, spec = fn(leaves_in)
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture was invalidated; the stream is free again
                        pass
                    raise
                graph.capture_end()
            finally:
                memory.release_deferred()
        else:
            graph = None
            out_leaves, spec = fn(leaves_in)
        out_map = self._map_outputs(out_leaves, leaves_in)
        if out_map is None:
            return None
        return _Captured(graph, static_in, out_map, spec, None if self.cuda else fn)

    @staticmethod
    def _map_outputs(out_leaves: Leaves, leaves_in: Leaves) -> Optional[List[Tuple[str, Any]]]:
        by_id = {id(t): k for k, t in enumerate(leaves_in)}
        out_map: List[Tuple[str, Any]] = []
        for t in out_leaves:
            k = by_id.get(id(t))
            if k is not None:
                out_map.append(("in", k))
            elif isinstance(t, torch.Tensor):
                out_map.append(("out", t))
            elif isinstance(t, _SIMPLE):
                out_map.append(("const", t))
            else:
                return None  # an object made inside the computation: a replay could not make it
        return out_map

    def _replay(self, c: _Captured, inputs: Leaves) -> Tuple[Leaves, Any]:
        """Copy the inputs in, replay, clone the outputs out (all on the current, compute, stream)."""
        with torch.no_grad():
            for s, t in zip(c.static_in, inputs):
                if s is not None:
                    s.copy_(t)
            if c.graph is not None:
                c.graph.replay()
            else:
                # The stand-in runs the function again. A CUDA capture of a computation that branches
                # on the data fails (the branch reads a device value on the host); here the branch
                # is just taken again, so compare what it made with what the capture recorded, and
                # refuse the key (returning this run's own results) when they differ.
                assert c.fn is not None
                outs, meta = c.fn([s if s is not None else t for s, t in zip(c.static_in, inputs)])
                fresh = self._map_outputs(outs, [s if s is not None else t for s, t in zip(c.static_in, inputs)])
                same = meta == c.spec and fresh is not None and [k for k, _ in fresh] == [k for k, _ in c.out_map]
                if same:
                    same = all(
                        ref.shape == o.shape and ref.dtype == o.dtype
                        for (kind, ref), o in zip(c.out_map, outs)
                        if kind == "out"
                    )
                if not same:
                    c.diverged = True  # the key is dropped: nothing reads these static tensors again
                    return outs, meta
                for (kind, ref), o in zip(c.out_map, outs):
                    if kind == "out":
                        ref.copy_(o)
        c.uses += 1
        self.replays += 1
        return self._outputs(c, inputs)

    @staticmethod
    def _outputs(c: _Captured, inputs: Leaves) -> Tuple[Leaves, Any]:
        """The outputs of the last replay: static outputs cloned (the next replay overwrites them),
        pass-through leaves the caller's own inputs."""
        out: Leaves = []
        with torch.no_grad():
            for kind, ref in c.out_map:
                if kind == "in":
                    out.append(inputs[ref])
                elif kind == "out":
                    out.append(ref.clone())
                else:
                    out.append(ref)
        return out, c.spec
