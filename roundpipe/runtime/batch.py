"""Microbatches: split argument pytrees into microbatches, track when their data is ready, merge outputs.

A stage's input is kept flattened: ``flatten_states[m]`` is the list of leaves of microbatch m and
``flatten_specs[m]`` the TreeSpec that rebuilds it. The first stage's input is ``(args, kwargs)``; a
stage's output ``out`` becomes the next stage's input ``((out,), {})``.

Attributes:
    avg_reducer: A reducer that averages scalar losses across microbatches.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

try:  # torch.distributed's pipelining spec types, when torch is built with distributed support
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
except ImportError:  # pragma: no cover - minimal torch builds

    class TensorChunkSpec:  # type: ignore[no-redef]
        def __init__(self, split_dim: int) -> None:
            self.split_dim = split_dim

    class _Replicate:  # type: ignore[no-redef]
        pass

    class _CustomReducer:  # type: ignore[no-redef]
        def __init__(self, init_value: Any, reduce_fn: Any) -> None:
            self.init_value = init_value
            self.reduce_fn = reduce_fn


from roundpipe.devices.backend import Event


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


def _is_reducer(s: Any) -> bool:
    """A reducer spec: torch's ``_CustomReducer`` (``init_value``, ``reduce_fn``), e.g. ``avg_reducer``."""
    return hasattr(s, "reduce_fn") and hasattr(s, "init_value")


def _is_replicate(s: Any) -> bool:
    return s is _Replicate or isinstance(s, _Replicate)


def is_leaf_spec(s: Any) -> bool:
    """Whether ``s`` is one spec entry (not a tuple / list / dict of them): ``TensorChunkSpec``,
    ``_Replicate`` (the class or an instance), a reducer, a bool, or a callable."""
    if isinstance(s, (tuple, list, dict)):
        return False
    return isinstance(s, (TensorChunkSpec, bool)) or _is_replicate(s) or _is_reducer(s) or callable(s)


def check_spec_tree(spec: Any, what: str) -> None:
    """Raise a ``ValueError`` naming the entry unless ``spec`` is None, a spec entry, or a tuple / list /
    dict of those (any depth)."""
    if spec is None or is_leaf_spec(spec):
        return
    if isinstance(spec, dict):
        for k, v in spec.items():
            check_spec_tree(v, f"{what}[{k!r}]")
        return
    if isinstance(spec, (tuple, list)):
        for i, v in enumerate(spec):
            check_spec_tree(v, f"{what}[{i}]")
        return
    raise ValueError(
        f"{what}: {spec!r} is not a spec; expected None (automatic), TensorChunkSpec(dim), _Replicate, a "
        "_CustomReducer, True / False, a callable, or a tuple / list / dict of those"
    )


def per_leaf_spec(spec: Any, data: Any, what: str, path: str = "") -> List[Any]:
    """The spec entry of every leaf of ``data`` (``pytree`` order, packed data counted as leaves).

    ``spec`` mirrors ``data`` down to any depth: an entry (or None, meaning automatic) there covers the
    whole subtree below; a dict spec may leave keys out (automatic).
    """
    if spec is None or is_leaf_spec(spec):
        return [spec] * len(pytree.tree_leaves(data, is_leaf=_is_packed))
    if isinstance(spec, (tuple, list)) and isinstance(data, (tuple, list)) and not _is_packed(data):
        if len(spec) != len(data):
            raise ValueError(f"{what}: the spec{path} has {len(spec)} entries but the data there has {len(data)}")
        return [x for i, (sp, d) in enumerate(zip(spec, data)) for x in per_leaf_spec(sp, d, what, f"{path}[{i}]")]
    if isinstance(spec, dict) and isinstance(data, dict):
        extra = sorted(map(str, set(spec) - set(data)))
        if extra:
            raise ValueError(
                f"{what}: the spec{path} names {extra}, which the data there does not have (it has "
                f"{sorted(map(str, data))})"
            )
        return [x for k, d in data.items() for x in per_leaf_spec(spec.get(k), d, what, f"{path}[{k!r}]")]
    raise ValueError(f"{what}: the spec{path} is a {type(spec).__name__} but the data there is a {type(data).__name__}")


def _auto_chunk(leaf: Any, bs: Optional[int]) -> Any:
    """The automatic split of one leaf: dim 0 when it is the batch size, else replicated."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and bs is not None and leaf.shape[0] == bs:
        return TensorChunkSpec(0)
    return _Replicate


def _packed_sizes(data: Any) -> Optional[List[int]]:
    """Microbatch sizes (dim 0) of the first packed data in ``data`` whose microbatches hold tensors."""
    for x in pytree.tree_leaves(data, is_leaf=_is_packed):
        if _is_packed(x):
            sizes = [
                next((t.shape[0] for t in pytree.tree_leaves(mb) if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
                for mb in x
            ]
            if all(size is not None for size in sizes):
                return [int(size) for size in sizes if size is not None]
    return None


def _split_tree(data: Any, n: int, chunk_spec: Any, what: str, bs: Optional[int] = None) -> List[Any]:
    """Split ``data`` into ``n`` microbatch pytrees following ``chunk_spec`` (a spec tree, None parts
    automatic for batch size ``bs``). Packed data is taken microbatch by microbatch, and tensors of the
    same batch are split to the packed microbatch sizes."""
    leaves, spec = pytree.tree_flatten(data, is_leaf=_is_packed)
    specs = per_leaf_spec(chunk_spec, data, what)
    sizes = _packed_sizes(data)
    per_leaf: List[List[Any]] = []
    for leaf, s in zip(leaves, specs):
        if s is None:
            s = _auto_chunk(leaf, bs)
        if _is_packed(leaf):
            if len(leaf) != n:
                raise ValueError(f"{what}: packed data has {len(leaf)} microbatches but num_microbatch={n}")
            per_leaf.append(list(leaf))
        elif isinstance(s, TensorChunkSpec) and isinstance(leaf, torch.Tensor):
            if sizes is not None and s.split_dim == 0 and leaf.dim() >= 1 and leaf.shape[0] == sum(sizes):
                parts = torch.split(leaf, sizes, dim=0)
            else:
                parts = torch.tensor_split(leaf, n, dim=s.split_dim)
            per_leaf.append(list(parts))
        elif _is_replicate(s) or not isinstance(leaf, torch.Tensor):
            per_leaf.append([leaf] * n)
        else:
            raise ValueError(f"{what}: {s!r} is not a split spec; use TensorChunkSpec(dim), _Replicate or None")
    return [pytree.tree_unflatten([p[m] for p in per_leaf], spec) for m in range(n)]


def _num_packed(data: Any) -> Optional[int]:
    counts = {len(x) for x in pytree.tree_leaves(data, is_leaf=_is_packed) if _is_packed(x)}
    if len(counts) > 1:
        raise ValueError(f"inputs mix RoundPipePackedData with different microbatch counts {sorted(counts)}")
    return counts.pop() if counts else None


def _custom_split_parts(result: Any) -> List[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """Microbatch ``(args, kwargs)`` pairs from a ``split_input`` callable's result: either
    ``(args_list, kwargs_list)`` (the public form) or a list of ``(args, kwargs)`` pairs."""
    if (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], (tuple, list))
        and isinstance(result[1], (tuple, list))
        and all(isinstance(kw, dict) for kw in result[1])
        and all(isinstance(a, (tuple, list)) for a in result[0])
    ):
        args_list, kwargs_list = result
        if len(args_list) != len(kwargs_list):
            raise ValueError(f"split_input returned {len(args_list)} args but {len(kwargs_list)} kwargs microbatches")
        return [(tuple(a), dict(kw)) for a, kw in zip(args_list, kwargs_list)]
    parts = list(result)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], dict) for p in parts):
        raise ValueError(
            "split_input must return (args_list, kwargs_list), or a list of (args_tuple, kwargs_dict) pairs"
        )
    return [(tuple(a), kw) for a, kw in parts]


class SplitConfig(Protocol):
    """What a ``Batch`` reads of the call's resolved config (``roundpipe.runtime.run_config.ResolvedRunConfig``
    has every field): how many microbatches the call asks for and whether the user chose that count, how
    to split inputs and labels and merge outputs, how stage inputs are kept, and the sequence tiles."""

    num_microbatch: int
    num_microbatch_chosen: bool
    split_input: Any
    split_label: Any
    merge_output: Any
    output_device: torch.device
    stage_inputs: str
    sequence_tiles: int


class Batch:
    """Microbatch state of one RoundPipe call.

    Attributes:
        flatten_states: Leaves of the current stage input (then output) per microbatch.
        flatten_specs: TreeSpecs rebuilding them.
        forward_events: Per microbatch, device events to wait on before reading ``flatten_states[m]``.
        backward_events: Per microbatch, events marking input gradients on the host.
        num_microbatch: The call's number of microbatches, computed here once: the count the config asks
            for, fitted to a smaller batch when the user did not choose it, or the count of packed inputs
            or of a custom split's parts. The plan and the run read it here; nothing writes it back.
        label_list: Labels per microbatch (``forward_backward``).
        loss_list: Losses per microbatch (``forward_backward``).
        profiles: The model's activation profile of this call per recompute grain (``run.call_profile``).
        stage_inputs: How the call keeps its backward-stage inputs ('bf16', 'fp8' or 'int8',
            ``roundpipe.runtime.stage_codec``).
    """

    def __init__(
        self, args: Tuple[Any, ...], kwargs: Dict[str, Any], run_config: SplitConfig, label: Any = None
    ) -> None:
        n = run_config.num_microbatch
        packed_n = _num_packed((args, kwargs))
        if packed_n is not None:
            n = packed_n  # microbatches of an upstream RoundPipe flow through one to one
        data = (tuple(args), dict(kwargs))
        split = run_config.split_input
        bs: Optional[int] = None  # the input batch size, where the automatic split takes it
        if callable(split) and not _is_replicate(split):
            parts = _custom_split_parts(split(tuple(args), dict(kwargs), n))
            n = len(parts)
        else:
            sizes = _packed_sizes(data)
            bs = sum(sizes) if sizes is not None else guess_split_spec(data)[1]
            if split is None and packed_n is None:
                if bs is None:
                    n = 1  # nothing to split: one microbatch
                else:
                    if n > bs and not run_config.num_microbatch_chosen:
                        n = bs  # the default count, fitted to a small batch
                    if n > bs:
                        raise ValueError(
                            f"num_microbatch={n} is larger than the batch size {bs}; lower num_microbatch "
                            f"(RoundPipeRunConfig(num_microbatch=...)) or use a larger batch"
                        )
                    self._check_batch_dims(data, bs)
            parts = _split_tree(data, n, split, "split_input", bs)
        self.num_microbatch: int = n
        self.stage_inputs: str = run_config.stage_inputs
        # Tiles of one sequence (``roundpipe.runtime.sequence``): the microbatches are its tiles, in order.
        self.sequence_tiles: int = run_config.sequence_tiles
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
        if label is not None and split is None and run_config.split_label is None:
            self._check_label_rows(label, bs)
        self.label_list: List[Any] = self._split_label(label, run_config, n)
        self.loss_list: List[Any] = [None] * n
        self.profiles: Dict[str, Any] = {}

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
    def _check_label_rows(label: Any, bs: Optional[int]) -> None:
        """With both splits automatic, the label's batch (dim 0 of its first tensor) must be the inputs':
        split to its own size, microbatch m's labels would belong to other rows, or fail in ``loss_fn``
        as a broadcast error."""
        rows = guess_split_spec(label)[1]
        if bs is not None and rows is not None and rows != bs:
            raise ValueError(
                f"forward_backward: the label batch has {rows} rows but the input batch has {bs} (dim 0 of the "
                f"first tensor of input_args/input_kwargs); give label one row per input row, or split it "
                f"yourself with RoundPipeRunConfig(split_label=...)"
            )

    @staticmethod
    def _split_label(label: Any, run_config: SplitConfig, n: int) -> List[Any]:
        if label is None:
            return [None] * n
        split = run_config.split_label
        if callable(split) and not _is_replicate(split):
            labels = list(split(label, n))
            if len(labels) != n:
                raise ValueError(f"split_label returned {len(labels)} parts for {n} microbatches")
            return labels
        return _split_tree(label, n, split, "split_label", guess_split_spec(label)[1])

    def stage_input(self, m: int) -> Any:
        """Rebuild microbatch m's current stage input pytree."""
        return pytree.tree_unflatten(self.flatten_states[m], self.flatten_specs[m])

    def dump(self, run_config: SplitConfig, outputs: Optional[List[Any]] = None) -> Any:
        """Merge microbatch outputs per ``run_config.merge_output`` (outputs default to the current states).

        Returns a ``RoundPipePackedData`` when ``merge_output`` is False (no host wait), otherwise waits
        for the outputs' download events and merges them: a callable merges the list of outputs, a
        spec tree (see :func:`merge_microbatches`) chooses per leaf, True / None is the default merge.
        """
        if outputs is None:
            outputs = [self.stage_input(m)[0][0] for m in range(self.num_microbatch)]
        events: List[Tuple[Sequence[Event], Sequence[Event]]] = [
            (ev, self.backward_events[m]) for m, ev in enumerate(self.forward_events)
        ]
        merge = run_config.merge_output
        if merge is False:
            return RoundPipePackedData(outputs, events)
        for evs in self.forward_events:
            for e in evs:
                e.synchronize()
        if callable(merge) and not isinstance(merge, bool) and not is_leaf_spec_only(merge):
            merged = merge(outputs)
        else:
            merged = merge_microbatches(outputs, None if merge is True else merge, events)
        if run_config.output_device.type != "cpu":
            merged = pytree.tree_map(
                lambda t: t.to(run_config.output_device, non_blocking=True) if isinstance(t, torch.Tensor) else t,
                merged,
            )
        return merged


def is_leaf_spec_only(s: Any) -> bool:
    """Whether ``s`` is a merge spec entry that is not a custom merge function (``_Replicate`` is a class,
    hence callable, but means "same in every microbatch")."""
    return _is_replicate(s) or _is_reducer(s) or isinstance(s, TensorChunkSpec)


def _merge_leaf(column: List[Any], spec: Any, events: Optional[List[Any]], where: str) -> Any:
    """Merge one leaf's per-microbatch values as ``spec`` says (None / True: the default rule)."""
    first = column[0]
    if spec is False:
        return RoundPipePackedData(list(column), list(events) if events is not None else [([], [])] * len(column))
    if isinstance(spec, TensorChunkSpec):
        return torch.cat(column, dim=spec.split_dim)
    if _is_reducer(spec):
        value = spec.init_value
        for x in column:
            value = spec.reduce_fn(value, x)
        return value
    if _is_replicate(spec):
        return _same_in_all(column, where)
    if callable(spec) and spec is not True:
        return spec(column)
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            # Scalars (a per-microbatch mean, say) are averaged over the microbatches.
            return torch.stack(column).sum() / len(column)
        return torch.cat(column, dim=0)
    return _same_in_all(column, where)


def _same_in_all(column: List[Any], where: str) -> Any:
    """The value every microbatch agrees on (a replicated output); an error naming it otherwise."""
    first = column[0]
    for m, x in enumerate(column[1:], 1):
        same = (
            torch.equal(first, x)
            if isinstance(first, torch.Tensor) and isinstance(x, torch.Tensor)
            else _plain_equal(first, x)
        )
        if not same:
            raise ValueError(
                f"merge_output: output {where} differs between microbatch 0 and {m} ({first!r} vs {x!r}); "
                "pass RoundPipeRunConfig(merge_output=...) with a merge for it"
            )
    return first


def _plain_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a truth value for ==: cannot be checked, keep the first
        return True


def merge_microbatches(outputs: List[Any], spec: Any = None, events: Optional[List[Any]] = None) -> Any:
    """Merge per-microbatch outputs leaf by leaf.

    Default rule (``spec`` None, or None / True at a leaf): tensors with dims are concatenated on dim 0,
    0-dim tensors averaged over the microbatches, other values must be equal in every microbatch. A
    ``spec`` tree mirroring the output chooses per leaf (or per subtree): ``TensorChunkSpec(d)``
    concatenates on dim d, ``_Replicate`` takes the (equal) value, a ``_CustomReducer`` folds the values
    with its ``reduce_fn`` from ``init_value``, a callable merges the list of values, False keeps them
    apart as ``RoundPipePackedData``.
    """
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec0 = flat[0][1]
    for _, treespec in flat[1:]:
        if treespec != spec0:
            raise ValueError("microbatch outputs have different structures; pass merge_output=<callable> to merge them")
    specs = per_leaf_spec(spec, outputs[0], "merge_output")
    merged_leaves = [_merge_leaf([f[0][i] for f in flat], s, events, f"leaf {i}") for i, s in enumerate(specs)]
    return pytree.tree_unflatten(merged_leaves, spec0)


class AvgReducer(_CustomReducer):
    """Averages scalar losses across microbatches, as a merge spec entry (``merge_output=avg_reducer``):
    the fold starts from ``init_value`` None, ``reduce(None, x)`` resets, then each call adds one."""

    def __init__(self) -> None:
        super().__init__(None, self.reduce)
        self.sum: Optional[torch.Tensor] = None
        self.count = 0

    def reduce(self, reduced_val: Optional[torch.Tensor], new_val: torch.Tensor) -> torch.Tensor:
        """The running average after adding ``new_val`` (``reduced_val`` None starts a new average)."""
        if reduced_val is None:
            self.sum, self.count = None, 0
        self.sum = new_val if self.sum is None else self.sum + new_val
        self.count += 1
        return self.sum / self.count


avg_reducer = AvgReducer()
