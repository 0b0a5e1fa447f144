"""Gradients of the fused group computed in parts on several devices, summed before the download.

On several devices the fused forward-backward job (the last layers and the loss head) is split by
microbatch (``jobs.run_forward_backward``): part j runs every K-th microbatch on its own device
(``roundpipe.planning.fused_split``), so no device carries the whole head while the others wait for its
output (with one job, the head of every microbatch ran on one device: about a fifth of a qwen3-1.7b
iteration, which capped two GPUs at about 1.6x one). Each part accumulates its layers' parameter
gradients on its device; the sum goes to the host once, through the primary part (part 0), which owns
the layers' gradient events (``attribute.LayerAttribute``) exactly as an unsplit job does. Part 0 runs
the call's last microbatch, so it usually reaches its download after the other parts have handed theirs
over, and its device thread seldom blocks waiting for them while its GPU could run the next job (with
part 0 on the first microbatch, its thread waited 60-130 ms per iteration on 4 H200s, docs/benchmarks.md;
not yet measured since).

Life cycle, per call and layer of the fused group:

1. A secondary part, after its last microbatch, downloads its device gradients into host buffers of
   its own (``publish``), queued on its gradient stream after its compute stream; it records the
   download's event and then sets the layer's ``ready`` flag (host side: the download is issued).
2. The primary part, at its own download of the layer (on its gradient stream), waits for each
   secondary's flag (host side, a short wait: a part issues its download as soon as it has queued its
   microbatches; with ``RPP_WATCHDOG_S`` it fails, naming the part and layer, when the run stalls that
   long: ``threads.wait_or_stall``), makes its gradient stream wait for that part's event (device side,
   across devices) and uploads the host copy (``fetch``), all before that stream waits for its own compute, so the
   upload overlaps the compute; after the compute it adds the copies into its own gradients
   (``add``) and downloads the sum.
3. The host buffers are written again only by the next call's secondary download, after this call's
   ``finish_backward`` has waited for every gradient download, the primary's (which follows its
   upload of these buffers on the same stream) included.

With peer hand-overs (``RPP_DEBUG_PEER_HANDOFF``, ``Run.peer_handoff``) a secondary copies its gradients
straight to the primary's device instead (a peer copy on its gradient stream, the event recorded after
it), and the primary adds those copies without an upload: on 4 H200s each secondary's share of
qwen3-1.7b's head (622 MB) otherwise went down to the host and up again, the three uploads one after
another on the primary's gradient stream (33 ms). The copies wait on the primary's device until its
download has completed (``add``'s ``hold``), so they are made only while they take at most
``PEER_SHARE_FRACTION`` of what the primary's device can still hold; otherwise through the host as above.

Host memory: one buffer per trainable parameter of the fused group and secondary part, kept by the
model across calls (``store``); the fused group is one decoder layer and the head.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from roundpipe.devices import backend, threads
from roundpipe.devices.memory import pinned_empty
from roundpipe.devices.threads import AnnotatedEvent
from roundpipe.runtime.transfer import to_device

# Host buffers kept across calls: (id of the host parameter, layer, part) -> pinned buffer (a tied
# parameter has a device copy, and a gradient share, per layer).
PartialGradStore = Dict[Tuple[int, int, int], torch.Tensor]


def _grad_pairs(cpu_layer: nn.Module, gpu_layer: nn.Module) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(host parameter, device parameter) of a layer, each parameter once, in module order."""
    out: List[Tuple[torch.Tensor, torch.Tensor]] = []
    seen = set()
    for host_mod, dev_mod in zip(cpu_layer.modules(), gpu_layer.modules()):
        for name, p in host_mod._parameters.items():
            dp = dev_mod._parameters.get(name)
            if p is None or dp is None or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((p, dp))
    return out


PEER_SHARE_FRACTION = 0.1
"""The largest share of the primary device's free capacity that the secondaries' peer-copied gradients
of one layer may take together (module docstring)."""


class PartialGrads:
    """One call's gradient parts of the fused group (module docstring). ``parts`` counts the primary.
    ``primary``: the primary part's device once dispatch has placed it, and ``peer``: whether secondaries
    may hand their gradients to it as peer copies (both set by the ``Run``)."""

    def __init__(
        self,
        parts: int,
        layers: range,
        store: PartialGradStore,
        name: Callable[[int], str] = str,
        primary: Callable[[], Any] = lambda: None,
        peer: bool = False,
    ) -> None:
        self.parts = parts
        self.store = store
        self.name = name  # layer id -> how errors name the layer (the model's name and the layer's)
        self.primary = primary
        self.peer = peer
        self.ready = {
            (j, i): AnnotatedEvent(f"fused_part{j}.layer{i}.grads_issued") for j in range(1, parts) for i in layers
        }
        # (part, layer) -> (id of host parameter -> host buffer or peer copy, the copies' event, whether peer)
        self.published: Dict[Tuple[int, int], Tuple[Dict[int, torch.Tensor], Any, bool]] = {}

    def _buffer(self, p: torch.Tensor, layer_id: int, part: int, grad: torch.Tensor) -> torch.Tensor:
        key = (id(p), layer_id, part)
        buf = self.store.get(key)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            buf = pinned_empty(grad.shape, grad.dtype)
            self.store[key] = buf
        return buf

    def publish(self, part: int, layer_id: int, cpu_layer: nn.Module, gpu_layer: nn.Module, device: Any) -> None:
        """Secondary part ``part``: download this layer's device gradients into the part's host
        buffers (gradient stream, after the compute that produced them) and tell the primary."""
        stream = device.grad_stream
        stream.wait_stream(device.compute_stream)
        pairs = [(p, dp) for p, dp in _grad_pairs(cpu_layer, gpu_layer) if dp.grad is not None]
        target = self._peer_target(device, sum(dp.grad.numel() * dp.grad.element_size() for _, dp in pairs))
        bufs: Dict[int, torch.Tensor] = {}
        with torch.no_grad(), backend.use_stream(stream):
            for p, dp in pairs:
                if target is not None:
                    # torch issues a copy between two GPUs on the source's current stream (this gradient
                    # stream, past the compute) fenced with the target's current stream of this thread
                    # (its default stream, which only such copies use); the event below follows it.
                    bufs[id(p)] = dp.grad.to(target.device, non_blocking=True, copy=True)
                    continue
                buf = self._buffer(p, layer_id, part, dp.grad)
                buf.copy_(dp.grad, non_blocking=dp.grad.device.type != "cpu")
                bufs[id(p)] = buf
            event = backend.record_event(stream)
        self.published[(part, layer_id)] = (bufs, event, target is not None)
        self.ready[(part, layer_id)].set()

    def _peer_target(self, device: Any, nbytes: int) -> Any:
        """The primary's device when this secondary's gradients (``nbytes``) go there as peer copies (module
        docstring), else None (through the host)."""
        if not self.peer or nbytes == 0:
            return None
        target = self.primary()
        if target is None or target is device or target.device.type != device.device.type:
            return None
        room = backend.capacity_bytes(target.device)
        return target if nbytes * (self.parts - 1) <= PEER_SHARE_FRACTION * room else None

    def fetch(
        self, layer_id: int, cpu_layer: nn.Module, gpu_layer: nn.Module, device: Any
    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Primary part, on its gradient stream (current) before it waits for its own compute: upload every
        secondary part's gradients of this layer. Returns (device parameter, uploaded share) pairs for
        ``add``."""
        stream = device.grad_stream
        pairs = _grad_pairs(cpu_layer, gpu_layer)
        out: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for part in range(1, self.parts):
            # A part that never hands over would hang this device thread: with RPP_WATCHDOG_S the wait
            # fails once the whole run has stalled that long (a failed part aborts it at once anyway).
            threads.wait_or_stall(
                self.ready[(part, layer_id)],
                lambda part=part: f"{self.name(layer_id)}: fused part {part} never handed over its gradients to part 0",
            )
            bufs, event, peer = self.published.pop((part, layer_id))
            if not bufs:
                continue
            stream.wait_event(event)  # the part's download (another device's stream) has landed
            for p, dp in pairs:
                buf = bufs.get(id(p))
                if buf is not None:
                    out.append((dp, buf if peer else to_device(buf, device.device)))  # a peer copy is here already
        return out

    @staticmethod
    def add(shares: List[Tuple[torch.Tensor, torch.Tensor]], hold: List[torch.Tensor]) -> None:
        """Add the fetched shares (``fetch``) into the device gradients, on the current stream (the
        gradient stream, past the compute that wrote them). The shares go to ``hold``: the caller keeps
        them until the download has completed."""
        for dp, share in shares:
            hold.append(share)
            dp.grad = share if dp.grad is None else dp.grad.add_(share)


__all__ = ["PartialGradStore", "PartialGrads"]
