"""The fp32 Adam step's two implementations behind ``roundpipe.optim.Adam``: batches of tensors for the
C++ kernel (``csrc/adam.cpp``: raw pointers, one call per group) and torch's fused CPU kernel (or its
single-tensor reference) for the rest. Pure functions of the tensors they are given: no state."""

from __future__ import annotations

import array
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

# dtypes torch's fused CPU Adam kernel handles (complex tensors are passed as their real views).
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_F32, _C64, _BF16 = torch.float32, torch.complex64, torch.bfloat16


def _as_float(x: Union[float, Tensor]) -> float:
    return x.item() if isinstance(x, Tensor) else float(x)


def kernel_hyperparams(group: Dict[str, Any], amsgrad: bool = False) -> Tuple[Union[float, int], ...]:
    """A param group's Adam hyperparameters in the order the C++ kernels take them: lr, beta1, beta2, eps,
    weight decay, then the flags (``amsgrad`` where the kernel has it), maximize, decoupled weight decay."""
    beta1, beta2 = group["betas"]
    flags = ([group["amsgrad"]] if amsgrad else []) + [group["maximize"], group["decoupled_weight_decay"]]
    rates = (_as_float(group["lr"]), _as_float(beta1), _as_float(beta2), float(group["eps"]))
    return (*rates, float(group["weight_decay"]), *(int(bool(f)) for f in flags))


class TensorLists:
    """params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (amsgrad only), steps."""

    def __init__(self) -> None:
        self.params: List[Tensor] = []
        self.grads: List[Tensor] = []
        self.exp_avgs: List[Tensor] = []
        self.exp_avg_sqs: List[Tensor] = []
        self.max_exp_avg_sqs: List[Tensor] = []
        self.steps: List[Tensor] = []

    def add(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Optional[Tensor], step: Tensor) -> None:
        self.params.append(p)
        self.grads.append(g)
        self.exp_avgs.append(m)
        self.exp_avg_sqs.append(v)
        if vmax is not None:
            self.max_exp_avg_sqs.append(vmax)
        self.steps.append(step)

    def lists(self) -> Tuple[List[Tensor], ...]:
        return self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps


class KernelBatch(TensorLists):
    """The tensors of one group that the C++ kernel steps, with their data pointers, for one call."""

    def __init__(self) -> None:
        super().__init__()
        self.ptrs = [array.array("Q") for _ in range(6)]  # p, g, m, v, vmax, step
        self.grad_kinds = array.array("i")  # 0: fp32 gradient, 1: bfloat16 gradient (csrc/adam.cpp)
        self.numels = array.array("q")
        self.outs = array.array("Q")  # per tensor: a bf16 buffer the kernel also writes the update to, or 0
        self.written: List[Tensor] = []  # the parameters whose update went to such a buffer

    def add_output(self, out: Optional[Tensor]) -> None:
        """The parameter just added (``add`` returned True) also writes its updated values, rounded to
        bfloat16, into ``out`` (a contiguous host bf16 tensor of its size), if given and suitable."""
        p = self.params[-1]
        ok = (
            out is not None
            and p.dtype is _F32
            and out.dtype is _BF16
            and out.is_cpu
            and out.is_contiguous()
            and out.numel() == p.numel()
        )
        self.outs.append(out.data_ptr() if ok else 0)  # type: ignore[union-attr]
        if ok:
            self.written.append(p)

    def add(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Optional[Tensor], step: Tensor) -> bool:
        """Take the parameter if the kernel can step it: host fp32 (or complex64) parameter and state it
        may walk linearly. Returns False (taking nothing) otherwise."""
        dt = p.dtype
        if not ((dt is _F32 or dt is _C64) and p.is_cpu and p.is_contiguous()):
            return False
        shape = p.shape
        for t in (m, v) if vmax is None else (m, v, vmax):
            # Shapes too: load_state_dict does not check them, and the kernel must never run off the end.
            if not (t.dtype is dt and t.is_cpu and t.is_contiguous() and t.shape == shape):
                return False
        # A bfloat16 gradient of an fp32 parameter is read as is (widened exactly in the kernel).
        bf16_grad = g.dtype is _BF16 and dt is _F32
        if not ((g.dtype is dt or bf16_grad) and g.is_cpu and g.shape == shape):
            return False
        if not (step.dtype is _F32 and step.is_cpu and step.dim() == 0):
            return False
        if not g.is_contiguous() or g.is_conj() or g.is_neg():
            # The kernel reads raw gradient memory linearly: read a strided gradient, or a lazily
            # negated or conjugated view, through a materialised copy (kept alive in self.grads).
            g = g.resolve_conj().resolve_neg().contiguous()
        super().add(p, g, m, v, vmax, step)
        ptrs = self.ptrs
        ptrs[0].append(p.data_ptr())
        ptrs[1].append(g.data_ptr())
        ptrs[2].append(m.data_ptr())
        ptrs[3].append(v.data_ptr())
        if vmax is not None:
            ptrs[4].append(vmax.data_ptr())
        ptrs[5].append(step.data_ptr())
        self.grad_kinds.append(1 if bf16_grad else 0)
        self.numels.append(p.numel() * 2 if dt is _C64 else p.numel())
        return True

    def run(self, kernel: Callable[..., int], group: Dict[str, Any], flush_denormals: bool = True) -> None:
        """One kernel call for the whole batch. The arrays and tensors stay referenced by ``self``.
        ``flush_denormals``: subnormal values count as zero in the step (``csrc/adam.cpp``'s header)."""
        p, g, m, v, vmax, step = (a.buffer_info()[0] if len(a) else None for a in self.ptrs)
        kernel(
            len(self.params),
            p,
            g,
            self.grad_kinds.buffer_info()[0],
            m,
            v,
            vmax,
            step,
            self.numels.buffer_info()[0],
            *kernel_hyperparams(group, amsgrad=True),
            torch.get_num_threads(),
            self.outs.buffer_info()[0] if any(self.outs) else None,
            int(bool(flush_denormals)),
        )
        # Writes through raw pointers bypass autograd's version counters; bump them as in-place ops
        # would, so a graph that saved one of these tensors still fails loudly instead of going stale.
        torch.autograd.graph.increment_version(
            self.params + self.exp_avgs + self.exp_avg_sqs + self.max_exp_avg_sqs + self.steps
        )


def _is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlaps (in some dimension order)."""
    expected = 1
    if t.numel() == 0:
        return True
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _fused_inputs(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
) -> Optional[Tuple[List[Tensor], ...]]:
    """The lists for torch's fused CPU kernel (real views), or None if it cannot take these tensors.

    The fused kernel walks all tensors of a parameter in one memory order and checks neither strides
    nor sizes: a gradient whose strides differ from its parameter's (e.g. a channels_last parameter with
    a contiguous gradient; torch.optim.AdamW(fused=True) has this problem too) silently gives garbage,
    and state of the wrong shape (load_state_dict does not check) is read past its end. Such gradients
    are copied into the parameter's layout; a parameter that is not dense, or whose state has another
    shape or layout, sends the group to the reference path (which raises on wrong shapes).
    """
    out: Tuple[List[Tensor], ...] = ([], [], [], [], [])
    states = zip(exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [None] * len(params))
    for p, g, (m, v, vmax) in zip(params, grads, states):
        dt = p.dtype
        cplx = p.is_complex()
        if not (p.is_cpu and (cplx or dt in _FUSED_DTYPES) and g.dtype is dt and g.shape == p.shape):
            return None
        state = (m, v) if vmax is None else (m, v, vmax)
        if p.is_contiguous():
            if not all(t.is_contiguous() and t.shape == p.shape for t in state):
                return None
            if not g.is_contiguous():
                g = g.contiguous()
        else:
            if not _is_dense(p) or not all(t.shape == p.shape and t.stride() == p.stride() for t in state):
                return None
            if g.stride() != p.stride():
                g = torch.empty_like(p).copy_(g)  # preserve_format: p's strides, as p is dense
        if g.is_conj() or g.is_neg():
            g = g.resolve_conj().resolve_neg()
        for lst, t in zip(out, (p, g, m, v, vmax)):
            if t is not None:
                # Adam on a complex tensor is Adam on its real view (torch's reference does the same).
                lst.append(torch.view_as_real(t) if cplx else t)
    return out


def torch_step(
    group: Dict[str, Any],
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    steps: List[Tensor],
) -> None:
    """Step the tensors the C++ kernel does not take, with torch's own implementations."""
    # torch's kernels want a gradient of the parameter's dtype: widen a low-precision gradient of a
    # higher-precision parameter (exact), as the C++ kernel does on the fly.
    grads = [g.to(p.dtype) if g.dtype != p.dtype and not p.is_complex() else g for p, g in zip(params, grads)]
    beta1, beta2 = group["betas"]
    common = dict(
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )
    fused_lists = _fused_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    if fused_lists is not None:
        _torch_adam(*fused_lists, steps, fused=True, **common)
        # The fused op leaves autograd's version counters alone; bump them as in-place ops would.
        torch.autograd.graph.increment_version(params + exp_avgs + exp_avg_sqs + max_exp_avg_sqs + steps)
    else:
        # Anything else (another device, mixed dtypes): torch's reference implementation.
        _torch_adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            foreach=False,
            fused=False,
            has_complex=any(torch.is_complex(p) for p in params),
            **common,
        )
