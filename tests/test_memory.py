"""Host memory layout: packing tensors into arenas keeps values, identities and alignment."""

from __future__ import annotations

import torch
from torch import nn

from roundpipe.memory import pack_into_arenas


def test_pack_into_arenas_keeps_values_and_objects() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 53), nn.LayerNorm(53), nn.Linear(53, 7, bias=False)).to(torch.bfloat16)
    tensors = list(model.parameters())
    before = [t.detach().clone() for t in tensors]
    ids = [id(t) for t in tensors]
    arenas = pack_into_arenas(tensors, pin=False, arena_bytes=4096)
    assert [id(t) for t in model.parameters()] == ids  # the same Parameter objects
    for t, b in zip(model.parameters(), before):
        assert torch.equal(t, b)
        assert t.data_ptr() % 64 == 0
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert sum(a.numel() for a in arenas) < 2 * max(total, 4096)
    assert all(a.numel() & (a.numel() - 1) == 0 for a in arenas)  # powers of two: no allocator rounding
    # Every tensor lives inside one of the arenas, and no two overlap.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    owners = [any(a.data_ptr() <= s and e <= a.data_ptr() + a.numel() for a in arenas) for s, e in spans]
    assert all(owners)
    # Training still works on the packed parameters.
    out = model(torch.randn(4, 37, dtype=torch.bfloat16)).float().sum()
    out.backward()
    assert model[0].weight.grad is not None


def test_large_tensor_gets_its_own_power_of_two_arena() -> None:
    big = torch.randn(3000)  # 12000 bytes > arena_bytes
    small = [torch.randn(10) for _ in range(3)]
    arenas = pack_into_arenas([big, *small], pin=False, arena_bytes=1024)
    assert arenas[0].numel() == 16384  # next power of two; the small ones fill its tail
    assert len(arenas) == 1
