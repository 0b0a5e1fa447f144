"""Context managers for RoundPipe.

Layers can stash data computed in the forward pass (for example rotary embeddings or attention masks)
so that the backward recompute reuses it instead of computing it again::

    if doing_recompute():
        cos, sin = get_recompute_data()
    else:
        cos, sin = rotary(x)
        save_for_recompute(cos, sin)

Outside a RoundPipe run ``save_for_recompute`` is a no-op and ``doing_recompute`` is False, so the same
layer code runs unchanged in plain PyTorch. (The optimizer's scope, ``OptimizerCtx``, belongs to the step
protocol: ``roundpipe.host.step``.)

Attributes:
    flags: Thread-local storage for context flags. Each device controller thread has its own.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple, TypeVar

import torch

flags = threading.local()
_S = TypeVar("_S", bound="_Scope")


def _get(name: str) -> Any:
    return getattr(flags, name, None)


class _Scope:
    """A context manager that is the current one of its kind (``FLAG`` in this thread's ``flags``) inside
    its ``with`` block; leaving the block makes the enclosing one current again."""

    FLAG = ""

    def __init__(self) -> None:
        self._prev: Optional[_Scope] = None

    def __enter__(self: _S) -> _S:
        self._prev = _get(self.FLAG)
        setattr(flags, self.FLAG, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(flags, self.FLAG, self._prev)


class ForwardCtx(_Scope):
    """Marks that this scope runs a forward pass whose data may be saved for recompute.

    Attributes:
        save_for_recompute: Callable receiving the data to save for the layer that runs now.
    """

    FLAG = "forward_ctx"

    def __init__(self, save_for_recompute: Callable[..., None]) -> None:
        super().__init__()
        self.save_for_recompute = save_for_recompute


class RecomputeCtx(_Scope):
    """Marks that this scope recomputes a forward pass for backward.

    Attributes:
        recompute_data: Data saved for recomputation (a tuple), or None if the layer saved nothing.
    """

    FLAG = "recompute_ctx"

    def __init__(self, recompute_data: Optional[Tuple[Any, ...]]) -> None:
        super().__init__()
        self.recompute_data = recompute_data


def doing_recompute() -> bool:
    """Whether the current scope is a backward recompute."""
    return _get("recompute_ctx") is not None


def get_recompute_data() -> Tuple[Any, ...]:
    """Data the current layer saved with ``save_for_recompute`` in its forward pass (always a tuple)."""
    ctx = _get("recompute_ctx")
    if ctx is None:
        raise RuntimeError(
            "get_recompute_data() called outside a RoundPipe recompute; guard it with doing_recompute()."
        )
    if ctx.recompute_data is None:
        raise RuntimeError(
            "get_recompute_data(): this layer saved nothing in forward; call save_for_recompute(...) in its forward."
        )
    return ctx.recompute_data


def save_for_recompute(*data: Any) -> None:
    """Save data for the backward recompute of the layer that runs now.

    Tensors saved must not require grad. Call at most once per layer and forward. A no-op outside a
    RoundPipe training forward (plain PyTorch, inference, or while recomputing).
    """
    # RoundPipe sets a ForwardCtx only in forwards that will be recomputed (training runs, which run
    # their forward under no_grad); elsewhere this is a no-op.
    ctx = _get("forward_ctx")
    if ctx is None or doing_recompute():
        return
    for d in torch.utils._pytree.tree_leaves(data):
        if isinstance(d, torch.Tensor) and d.requires_grad:
            raise ValueError("save_for_recompute: saved tensors must not require grad; pass tensor.detach().")
    ctx.save_for_recompute(*data)
