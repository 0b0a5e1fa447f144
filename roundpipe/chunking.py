"""Split a stage's parameter copies into chunks of about equal bytes (greedy number partitioning).

The spec's helper for issuing a stage upload as several chunks with an event each (chunks of equal
bytes take about equal time). The runtime's unit is the layer: each layer's upload records one
event and compute waits for layer k's event just before running layer k (``transfer.wait_layer``), so
a multi-layer stage starts computing once its first layer is on the device; a single large tensor is
sliced instead (``transfer.chunked_upload``) so activation uploads can pass it. Chunks smaller than a
layer would need the layer's forward split. Re-exported by ``roundpipe.transfer``.
"""

from __future__ import annotations

import heapq
from typing import List, Tuple

import torch

TensorPair = Tuple[torch.Tensor, torch.Tensor]


def chunk_layer_params(tensor_pair: List[TensorPair], n_chunks: int) -> List[List[TensorPair]]:
    """Group (src, dst) copies into at most ``n_chunks`` chunks with balanced bytes.

    Greedy number partitioning: take the copies largest first (by ``src`` bytes) and put each into the
    chunk with the fewest bytes so far (ties: the one with fewer copies, then the lower index, so chunks
    fill before any gets a second copy). Its largest chunk is at most 4/3 of the optimum.

    Returns ``min(n_chunks, len(tensor_pair))`` non-empty chunks; within a chunk the copies keep their
    input order. Every pair appears exactly once.
    """
    if n_chunks < 1:
        raise ValueError(f"chunk_layer_params: n_chunks must be >= 1, got {n_chunks}")
    if not tensor_pair:
        return []
    n = min(n_chunks, len(tensor_pair))
    order = sorted(range(len(tensor_pair)), key=lambda i: -_nbytes(tensor_pair[i][0]))  # stable on ties
    heap = [(0, 0, c) for c in range(n)]  # (bytes, copies, chunk index)
    members: List[List[int]] = [[] for _ in range(n)]
    for i in order:
        size, count, c = heapq.heappop(heap)
        members[c].append(i)
        heapq.heappush(heap, (size + _nbytes(tensor_pair[i][0]), count + 1, c))
    return [[tensor_pair[i] for i in sorted(m)] for m in members]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
