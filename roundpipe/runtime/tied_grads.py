"""Gradient shares of tied parameters (a weight used by several layers, e.g. a tied embedding and LM
head), summed on the owner layer's device before its download (``transfer.download_layer`` calls
``fetch``, ``merge`` and ``keep``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from roundpipe.host.attribute import LayerAttribute, ParamAttribute
from roundpipe.host.buffers import ParamBuffers
from roundpipe.runtime.transfer import to_device


class TiedGrads:
    """One call's gradient shares of tied parameters (a parameter used by several layers), summed on
    the owner's device into the share of the owner (the parameter's lowest layer, whose backward job
    runs last) before the owner's download. The host then holds one share, and
    ``RoundPipeBase.reduce_shared_grads`` has nothing left to add on the main thread between
    iterations (qwen3-1.7b's tied embedding: 311M elements).

    One device: a sharer's share (a layer above the owner, in an earlier job) is not downloaded at all;
    it stays on the device (``keep``) and the owner's gradient stream adds it in (``merge``). Both are
    issued on that device's gradient stream after its compute stream, which ran both backwards in job
    order, so no event is needed. This also saves the share's copy over PCIe and its host buffers.

    Several devices: the sharer's share is downloaded as usual; the owner's device thread waits until
    that download is issued (``grad_download_started``, host side), its gradient stream waits for the
    download's event (device side, across devices) and uploads the host copy (``fetch``, queued before
    the stream waits for the owner's compute, so the upload overlaps it), then adds it in (``merge``).
    The sharer's host buffer is not written again before this call's ``finish_backward`` has waited for
    every gradient download, the owner's included.

    Only the device threads touch it; a share is merged by the owner's job, which runs after the
    sharer's (backward runs from the last layer to the first), never in the same job (``job_layers``).
    """

    def __init__(self, layer_attrs: Sequence[LayerAttribute], one_device: bool) -> None:
        self.layer_attrs = layer_attrs
        self.one_device = one_device
        self.kept: Dict[int, torch.Tensor] = {}  # id(param) -> its sharers' shares summed on the device
        self.fetched: Dict[int, List[torch.Tensor]] = {}  # id(param) -> sharers' shares uploaded (several devices)

    def keep(self, p: torch.Tensor, attr: ParamAttribute, layer_id: int, grad: torch.Tensor, job_layers: range) -> bool:
        """One device: keep this sharer's share on the device for the owner's download (True), or let
        it be downloaded (False)."""
        owner = min(attr.layer_ids)
        if not self.one_device or layer_id == owner or owner in job_layers:
            return False
        kept = self.kept.get(id(p))
        if kept is None:
            self.kept[id(p)] = grad
        else:  # a third layer sharing it: one kept sum per parameter
            kept.add_(grad)
        return True

    def fetch(self, cpu_layer: nn.Module, layer_id: int, job_layers: range, device: Any) -> None:
        """Several devices, at the owner's download, before its gradient stream (current) waits for its
        compute: upload the sharers' host shares of the tied parameters this layer owns."""
        if self.one_device:
            return
        stream = device.grad_stream
        seen = set()
        for host_mod in cpu_layer.modules():
            for p in host_mod._parameters.values():
                if p is None or id(p) in seen or not ParamAttribute.has(p):
                    continue
                seen.add(id(p))
                attr = ParamAttribute.get(p)
                if not attr.shared or layer_id != min(attr.layer_ids):
                    continue
                shares: List[torch.Tensor] = []
                for lid in sorted(attr.layer_ids):
                    if lid == layer_id or lid in job_layers:
                        continue
                    sharer = self.layer_attrs[lid]
                    sharer.grad_download_started.wait()  # its download is issued (an earlier job)
                    # Summed here: the share leaves the host gradient, so the fold does not add it again.
                    host = ParamBuffers.of(p).take_share(lid)
                    if host is None:
                        continue
                    stream.wait_event(sharer.grad_downloaded)  # ... and lands before we read it
                    shares.append(to_device(host, device.device))
                self.fetched[id(p)] = shares

    def merge(
        self,
        p: torch.Tensor,
        attr: ParamAttribute,
        layer_id: int,
        grad: Optional[torch.Tensor],
        hold: List[torch.Tensor],
    ) -> Optional[torch.Tensor]:
        """At the owner's download (the current stream is its gradient stream, past its compute): add the
        sharers' shares (kept on this device, or uploaded by ``fetch``) into ``grad`` and return the
        gradient to download. Device tensors read here go to ``hold``: the caller keeps them until the
        download has completed."""
        if layer_id != min(attr.layer_ids):
            return grad
        shares: List[torch.Tensor] = []
        kept = self.kept.pop(id(p), None)
        if kept is not None:
            shares.append(kept)
        shares.extend(self.fetched.pop(id(p), []))
        for share in shares:
            hold.append(share)
            grad = share if grad is None else grad.add_(share)
        return grad
