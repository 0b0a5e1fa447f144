"""Exact-size pinned host buffers (roundpipe.devices.memory.mapped_empty / pinned_empty): shape, dtype, and the
register/unregister life cycle, checked with recording stand-ins for cudaHostRegister/Unregister."""

from __future__ import annotations

import gc
import os
from typing import List, Tuple

import pytest
import torch
from torch import nn

from roundpipe.devices import memory


class _Recorder:
    def __init__(self) -> None:
        self.calls: List[Tuple[str, int, int]] = []
        self.live: dict = {}

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr not in self.live, "address registered twice"
        self.live[ptr] = nbytes
        self.calls.append(("reg", ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregistering an address that is not registered"
        del self.live[ptr]
        self.calls.append(("unreg", ptr, 0))


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.bfloat16), ((1000, 700), torch.float32), ((7,), torch.float16)])
def test_mapped_empty_has_the_shape_and_holds_values(shape, dtype) -> None:
    rec = _Recorder()
    t = memory.mapped_empty(shape, dtype, rec.register, rec.unregister)
    assert t.shape == torch.Size(shape) and t.dtype == dtype and t.is_contiguous()
    ref = torch.randn(shape).to(dtype)
    t.copy_(ref)
    assert torch.equal(t, ref)
    ptr, nbytes = rec.calls[0][1], rec.calls[0][2]
    assert ptr == t.data_ptr() and ptr % 4096 == 0  # its own pages: no page shared with another registration
    assert nbytes == t.numel() * t.element_size()  # exact size, no power-of-two rounding


def test_unregistered_once_after_the_last_view_dies() -> None:
    rec = _Recorder()
    t = memory.mapped_empty((64, 64), torch.float32, rec.register, rec.unregister)
    t.fill_(3.0)
    views = [t[1:], t.view(-1)[100:200], t.t()]
    del t
    gc.collect()
    assert [c[0] for c in rec.calls] == ["reg"], "unregistered while views were alive"
    assert float(views[1].sum()) == 300.0
    del views[:2]
    gc.collect()
    assert len(rec.live) == 1
    views.clear()
    gc.collect()
    assert [c[0] for c in rec.calls] == ["reg", "unreg"] and not rec.live


def test_many_buffers_come_and_go_without_leaking_registrations() -> None:
    rec = _Recorder()
    for i in range(50):
        bufs = [memory.mapped_empty((1 << 16,), torch.bfloat16, rec.register, rec.unregister) for _ in range(4)]
        for b in bufs:
            b.fill_(float(i))
        del bufs, b
    gc.collect()
    assert not rec.live and len(rec.calls) == 400


def test_a_buffer_released_during_a_graph_capture_is_unpinned_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """cudaHostUnregister during a CUDA graph capture would invalidate the capture (and the range would
    be unmapped still registered): a buffer whose last view dies then waits for ``release_deferred``,
    which does nothing while the thread still captures; the next buffer made drains it too."""
    rec = _Recorder()
    capturing = [True]
    monkeypatch.setattr(memory, "_capturing", lambda: capturing[0])
    t = memory.mapped_empty((64, 64), torch.float32, rec.register, rec.unregister)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert ptr in rec.live, "unregistered during the capture"
    memory.release_deferred()
    assert ptr in rec.live, "released while the thread still captures"
    capturing[0] = False
    memory.release_deferred()
    assert not rec.live and rec.calls[-1] == ("unreg", ptr, 0)
    capturing[0] = True
    u = memory.mapped_empty((8,), torch.float32, rec.register, rec.unregister)
    del u
    capturing[0] = False
    v = memory.mapped_empty((8,), torch.float32, rec.register, rec.unregister)  # drains the one before
    assert list(rec.live) == [v.data_ptr()]


def test_pinned_empty_without_cuda_is_plain_host_memory() -> None:
    t = memory.pinned_empty((4, 4), torch.float32, pin=False)
    assert t.device.type == "cpu" and not t.is_pinned() and t.shape == (4, 4)


def test_pin_module_alloc_keeps_values_and_tensor_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """'alloc' copies each tensor into a fresh exact-size buffer (all of them, with the threshold at 0)."""
    rec = _Recorder()
    monkeypatch.setattr(memory, "_cuda_register", rec.register)
    monkeypatch.setattr(memory, "_cuda_unregister", rec.unregister)
    monkeypatch.setattr(memory, "EXACT_MIN_BYTES", 0)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)  # no CUDA here
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    memory.pin_module_alloc(model)
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1])
    assert sorted(rec.live.values()) == [256, 256, 256, 64 * 64 * 4]  # each tensor at exactly its size
    assert {p.data_ptr() for p in model.parameters()} == set(rec.live)


def test_a_failed_registration_raises_and_unregisters_nothing() -> None:
    rec = _Recorder()

    def refuse(ptr: int, nbytes: int) -> None:
        raise RuntimeError("cudaHostRegister failed")

    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        memory.mapped_empty((1 << 20,), torch.uint8, refuse, rec.unregister)
    gc.collect()
    assert not rec.calls


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_unmaps_without_unregistering() -> None:
    """A forked child (a DataLoader worker) that frees an inherited buffer must not unregister it: the
    registration belongs to the parent, and CUDA cannot be used in the child."""
    rec = _Recorder()
    t = memory.mapped_empty((1 << 16,), torch.float32, rec.register, rec.unregister)
    t.fill_(1.0)
    pid = os.fork()
    if pid == 0:  # child
        del t
        gc.collect()
        os._exit(0 if all(c[0] == "reg" for c in rec.calls) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert float(t.sum()) == float(1 << 16) and [c[0] for c in rec.calls] == ["reg"]
    del t
    gc.collect()
    assert [c[0] for c in rec.calls] == ["reg", "unreg"]
