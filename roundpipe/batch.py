"""Microbatches: split argument pytrees into microbatches, track when their data is ready, merge outputs.

A stage's input is kept flattened: ``flatten_states[m]`` is the list of leaves of microbatch m and
``flatten_specs[m]`` the TreeSpec that rebuilds it. The first stage's input is ``(args, kwargs)``; a
stage's output ``out`` becomes the next stage's input ``((out,), {})``.

Attributes:
    avg_reducer: A reducer that averages scalar losses across microbatches.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

try:  # torch.distributed's pipelining spec types, when torch is built with distributed support
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
except ImportError:  # pragma: no cover - minimal torch builds

    class TensorChunkSpec:  # type: ignore[no-redef]
        def __init__(self, split_dim: int) -> None:
            self.split_dim = split_dim

    class _Replicate:  # type: ignore[no-redef]
        pass


from roundpipe.backend import Event


class RoundPipePackedData(list):
    """Per-microbatch outputs kept apart (``merge_output=False``), with the events that mark them ready.

    Passing it to another RoundPipe feeds microbatch m to microbatch m without a host merge or wait.

    Attributes:
        transfer_event: (forward_event, backward_event) per microbatch; forward: the data is on the host.
    """

    def __init__(self, data: List[Any], transfer_event: List[Tuple[Sequence[Event], Sequence[Event]]]) -> None:
        super().__init__(data)
        self.transfer_event = transfer_event

    def synchronize(self) -> None:
        """Block until all microbatches' data is on the host."""
        for fwd, _ in self.transfer_event:
            for e in fwd:
                e.synchronize()


def _is_packed(x: Any) -> bool:
    return isinstance(x, RoundPipePackedData)


def guess_split_spec(data: Any, expected_batchsize: Optional[int] = None) -> Tuple[Any, Optional[int]]:
    """Infer how to chunk ``data``: tensors whose dim 0 is the batch size are split along dim 0.

    The batch size is ``expected_batchsize`` or, failing that, dim 0 of the first tensor leaf with at
    least one dimension. Returns ``(spec, batch_size)``; spec mirrors ``data`` with ``TensorChunkSpec(0)``
    or ``_Replicate`` leaves; batch_size is None when nothing can be split.
    """
    leaves, spec = pytree.tree_flatten(data, is_leaf=_is_packed)
    bs = expected_batchsize
    if bs is None:
        bs = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    chunk = [
        TensorChunkSpec(0) if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == bs else _Replicate
        for t in leaves
    ]
    return pytree.tree_unflatten(chunk, spec), bs


def _split_tree(data: Any, n: int, chunk_spec: Any, what: str) -> List[Any]:
    """Split ``data`` into ``n`` microbatch pytrees following ``chunk_spec`` (from ``guess_split_spec``)."""
    leaves, spec = pytree.tree_flatten(data, is_leaf=_is_packed)
    specs = pytree.tree_leaves(chunk_spec, is_leaf=lambda s: isinstance(s, TensorChunkSpec) or s is _Replicate)
    if len(specs) != len(leaves):
        raise ValueError(f"{what}: the split spec has {len(specs)} leaves but the data has {len(leaves)}")
    per_leaf: List[List[Any]] = []
    for leaf, s in zip(leaves, specs):
        if _is_packed(leaf):
            if len(leaf) != n:
                raise ValueError(f"{what}: packed data has {len(leaf)} microbatches but num_microbatch={n}")
            per_leaf.append(list(leaf))
        elif isinstance(s, TensorChunkSpec) and isinstance(leaf, torch.Tensor):
            parts = torch.tensor_split(leaf, n, dim=s.split_dim)
            per_leaf.append(list(parts))
        else:
            per_leaf.append([leaf] * n)
    return [pytree.tree_unflatten([p[m] for p in per_leaf], spec) for m in range(n)]


def _num_packed(data: Any) -> Optional[int]:
    counts = {len(x) for x in pytree.tree_leaves(data, is_leaf=_is_packed) if _is_packed(x)}
    if len(counts) > 1:
        raise ValueError(f"inputs mix RoundPipePackedData with different microbatch counts {sorted(counts)}")
    return counts.pop() if counts else None


class Batch:
    """Microbatch state of one RoundPipe call.

    Attributes:
        flatten_states: Leaves of the current stage input (then output) per microbatch.
        flatten_specs: TreeSpecs rebuilding them.
        forward_events: Per microbatch, device events to wait on before reading ``flatten_states[m]``.
        backward_events: Per microbatch, events marking input gradients on the host.
        num_microbatch: Number of microbatches.
        label_list: Labels per microbatch (``forward_backward``).
        loss_list: Losses per microbatch (``forward_backward``).
    """

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], run_config: Any, label: Any = None) -> None:
        n = run_config.num_microbatch
        packed_n = _num_packed((args, kwargs))
        if packed_n is not None:
            n = packed_n  # microbatches of an upstream RoundPipe flow through one to one
        data = (tuple(args), dict(kwargs))
        if callable(run_config.split_input):
            parts = list(run_config.split_input(tuple(args), dict(kwargs), n))
            if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], dict) for p in parts):
                raise ValueError("split_input must return a list of (args_tuple, kwargs_dict) pairs")
            n = len(parts)
        else:
            chunk_spec, bs = (run_config.split_input, None) if run_config.split_input is not None else guess_split_spec(data)
            if run_config.split_input is None and packed_n is None:
                if bs is None:
                    n = 1  # nothing to split: one microbatch
                elif n > bs:
                    raise ValueError(
                        f"num_microbatch={n} is larger than the batch size {bs}; lower num_microbatch "
                        f"(RoundPipeRunConfig(num_microbatch=...)) or use a larger batch"
                    )
                self._check_batch_dims(data, bs)
            parts = _split_tree(data, n, chunk_spec, "split_input")
        self.num_microbatch: int = n
        self.flatten_states: List[List[Any]] = []
        self.flatten_specs: List[pytree.TreeSpec] = []
        self.forward_events: List[List[Event]] = []
        self.backward_events: List[List[Event]] = [[] for _ in range(n)]
        packed = [x for x in pytree.tree_leaves(data, is_leaf=_is_packed) if _is_packed(x)]
        for m, part in enumerate(parts):
            leaves, spec = pytree.tree_flatten(part)
            self.flatten_states.append(leaves)
            self.flatten_specs.append(spec)
            # Data from an upstream RoundPipe may still be downloading: its events gate our uploads.
            self.forward_events.append([e for p in packed for e in p.transfer_event[m][0]])
        self.label_list: List[Any] = self._split_label(label, run_config, n)
        self.loss_list: List[Any] = [None] * n

    @staticmethod
    def _check_batch_dims(data: Any, bs: int) -> None:
        """Catch the easy mistake of tensors with different batch sizes (only one set would be split)."""
        sizes = {t.shape[0] for t in pytree.tree_leaves(data) if isinstance(t, torch.Tensor) and t.dim() >= 2}
        if len(sizes) > 1 and bs in sizes:
            others = sorted(s for s in sizes if s != bs)
            if all(s > 1 for s in others):
                raise ValueError(
                    f"input tensors disagree on the batch dimension: dim 0 sizes {sorted(sizes)}; the batch size "
                    f"taken is {bs} (the first tensor). Give every per-sample tensor the same dim 0, or pass "
                    f"RoundPipeRunConfig(split_input=...)"
                )

    @staticmethod
    def _split_label(label: Any, run_config: Any, n: int) -> List[Any]:
        if label is None:
            return [None] * n
        if callable(run_config.split_label):
            labels = list(run_config.split_label(label, n))
            if len(labels) != n:
                raise ValueError(f"split_label returned {len(labels)} parts for {n} microbatches")
            return labels
        spec = run_config.split_label
        if spec is None:
            spec, _ = guess_split_spec(label)
        return _split_tree(label, n, spec, "split_label")

    def stage_input(self, m: int) -> Any:
        """Rebuild microbatch m's current stage input pytree."""
        return pytree.tree_unflatten(self.flatten_states[m], self.flatten_specs[m])

    def dump(self, run_config: Any, outputs: Optional[List[Any]] = None) -> Any:
        """Merge microbatch outputs per ``run_config.merge_output`` (outputs default to the current states).

        Returns a ``RoundPipePackedData`` when ``merge_output`` is False (no host wait), otherwise waits
        for the outputs' download events and merges them.
        """
        if outputs is None:
            outputs = [self.stage_input(m)[0][0] for m in range(self.num_microbatch)]
        if run_config.merge_output is False:
            return RoundPipePackedData(outputs, [(ev, self.backward_events[m]) for m, ev in enumerate(self.forward_events)])
        for evs in self.forward_events:
            for e in evs:
                e.synchronize()
        if callable(run_config.merge_output) and not isinstance(run_config.merge_output, bool):
            merged = run_config.merge_output(outputs)
        else:
            merged = merge_microbatches(outputs)
        if run_config.output_device.type != "cpu":
            merged = pytree.tree_map(
                lambda t: t.to(run_config.output_device, non_blocking=True) if isinstance(t, torch.Tensor) else t, merged
            )
        return merged


def merge_microbatches(outputs: List[Any]) -> Any:
    """Default merge: tensors with dims are concatenated on dim 0, 0-dim tensors stacked into a 1-D
    tensor (one entry per microbatch), other values taken from microbatch 0."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec0 = flat[0][1]
    for leaves, spec in flat[1:]:
        if spec != spec0:
            raise ValueError("microbatch outputs have different structures; pass merge_output=<callable> to merge them")
    merged_leaves = []
    for i, leaf in enumerate(flat[0][0]):
        column = [f[0][i] for f in flat]
        if isinstance(leaf, torch.Tensor):
            merged_leaves.append(torch.stack(column) if leaf.dim() == 0 else torch.cat(column, dim=0))
        else:
            merged_leaves.append(leaf)
    return pytree.tree_unflatten(merged_leaves, spec0)


class _CustomReducer:
    """Base of reducers that combine one value per microbatch."""

    def reduce(self, reduced_val: Optional[torch.Tensor], new_val: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class AvgReducer(_CustomReducer):
    """Averages scalar losses across microbatches: ``reduce(None, x)`` resets, then each call adds one."""

    def __init__(self) -> None:
        self.sum: Optional[torch.Tensor] = None
        self.count = 0

    def reduce(self, reduced_val: Optional[torch.Tensor], new_val: torch.Tensor) -> torch.Tensor:
        if reduced_val is None:
            self.sum, self.count = None, 0
        self.sum = new_val if self.sum is None else self.sum + new_val
        self.count += 1
        return self.sum / self.count


avg_reducer = AvgReducer()
