"""Compact optimizer state of the host Adam: bf16 or blockwise-int8 moments, bf16 master weights.

``roundpipe.optim.Adam(..., state_dtype=..., master=..., master_rounding=..., block_size=..., seed=...)``
selects this mode (see docs/optimizer.md, "Compact optimizer state"): it exists so that full
fine-tuning of an 8B model fits a 128 GiB host, where fp32 master + fp32 moments (12 bytes per
parameter) do not.

State of a parameter ``p`` (``step`` as torch.optim.Adam):

* ``state_dtype="float32"`` / ``"bfloat16"``: ``exp_avg`` and ``exp_avg_sq`` of p's shape in that dtype
  (bf16 values are rounded to nearest once per step from the fp32 result; v stays >= 0).
* ``state_dtype="int8"``: ``exp_avg`` (int8, flat) with ``exp_avg_scale`` (fp32 block absmaxes) and
  ``exp_avg_sq`` (uint8 codes of ``sqrt(v)``, flat) with ``exp_avg_sq_scale``: ``roundpipe.optim.quant``.
* ``master="bfloat16"``: the bf16 parameter itself is the master; ``master_rounding="kahan"`` adds
  ``kahan_comp`` (bf16, p's shape), the rounding error carried to the next step.

Every step decodes the state to fp32, computes Adam in fp32 with the new (unrounded) moments, and
encodes once. Two implementations: the C++ kernel ``csrc/compact_adam.cpp`` (``RPP_DEBUG_ADAM_IMPL`` auto /
cpp) and ``torch_step`` here (torch, or when the kernel cannot be built), which it mirrors.
"""

from __future__ import annotations

import array
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from roundpipe.optim import quant
from roundpipe.optim.fp32_step import kernel_hyperparams

__all__ = [
    "CompactConfig",
    "CompactKernelBatch",
    "check_param",
    "convert_state",
    "init_state",
    "state_layout",
    "make_config",
    "state_bytes",
    "state_to_fp32",
    "step_scalars",
    "torch_step",
]

STATE_DTYPES = ("float32", "bfloat16", "int8")
MASTERS = ("float32", "bfloat16")
ROUNDINGS = ("stochastic", "kahan", "nearest")
# Codes shared with csrc/compact_adam.cpp.
_STATE_KIND = {"float32": 0, "bfloat16": 1, "int8": 2}
_MASTER_KIND = {
    ("float32", None): 0,
    ("bfloat16", "nearest"): 1,
    ("bfloat16", "stochastic"): 2,
    ("bfloat16", "kahan"): 3,
}


@dataclass(frozen=True)
class CompactConfig:
    """The compact-state options of one ``Adam`` (validated by ``make_config``)."""

    state_dtype: str = "float32"
    master: str = "float32"
    master_rounding: str = "stochastic"
    block_size: int = 256
    seed: int = 0

    @property
    def enabled(self) -> bool:
        """False for the default (fp32 state, parameters as masters): the original Adam path."""
        return self.state_dtype != "float32" or self.master != "float32"

    @property
    def state_kind(self) -> int:
        """Moment format code of the C++ kernel."""
        return _STATE_KIND[self.state_dtype]

    @property
    def master_kind(self) -> int:
        """Master-update code of the C++ kernel."""
        return _MASTER_KIND[(self.master, self.master_rounding if self.master == "bfloat16" else None)]

    def as_dict(self) -> Dict[str, Any]:
        """The options, as saved in ``Adam.state_dict()['compact']``."""
        return asdict(self)


def make_config(state_dtype: Any, master: Any, master_rounding: Any, block_size: Any, seed: Any) -> CompactConfig:
    """Validate the options. Raises ValueError naming the argument and what it accepts."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if master not in MASTERS:
        raise ValueError(f"master must be one of {MASTERS}, got {master!r}")
    if master_rounding not in ROUNDINGS:
        raise ValueError(f"master_rounding must be one of {ROUNDINGS}, got {master_rounding!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return CompactConfig(state_dtype, master, master_rounding, block_size, seed)


def check_param(cfg: CompactConfig, p: Tensor, group: Dict[str, Any]) -> None:
    """Raise ValueError when a compact optimizer cannot own ``p`` (or ``group``'s options)."""
    want = torch.bfloat16 if cfg.master == "bfloat16" else torch.float32
    if p.dtype != want:
        hint = (
            "master='bfloat16' takes bfloat16 parameters (a bf16 model's optim_parameters() without optim_dtype)"
            if cfg.master == "bfloat16"
            else "master='float32' with a compact state_dtype takes float32 parameters (optim_dtype=torch.float32), "
            "or use master='bfloat16' for bf16 ones"
        )
        raise ValueError(f"master={cfg.master!r}: parameter of dtype {p.dtype} not accepted; {hint}")
    if group.get("amsgrad"):
        raise ValueError(
            "amsgrad=True is not supported with a compact state (state_dtype/master): it accepts amsgrad=False only"
        )


def step_scalars(step: float, lr: float, beta1: float, beta2: float) -> Tuple[float, float]:
    """(-lr / bias_correction1, sqrt(bias_correction2)), computed in double as the kernel does."""
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return -(lr / bc1), bc2**0.5


def state_layout(cfg: CompactConfig, p: Tensor) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]:
    """dtype and shape of each state tensor of ``p`` in ``cfg``'s format (``step`` excluded): what
    ``init_state`` builds and what the kernel batch checks before each step, without allocating."""
    n = p.numel()
    layout: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
    if cfg.state_dtype == "int8":
        nb = quant.n_blocks(n, cfg.block_size)
        layout["exp_avg"] = (torch.int8, (n,))
        layout["exp_avg_scale"] = (torch.float32, (nb,))
        layout["exp_avg_sq"] = (torch.uint8, (n,))
        layout["exp_avg_sq_scale"] = (torch.float32, (nb,))
    else:
        dt = torch.bfloat16 if cfg.state_dtype == "bfloat16" else torch.float32
        layout["exp_avg"] = (dt, tuple(p.shape))
        layout["exp_avg_sq"] = (dt, tuple(p.shape))
    if cfg.master == "bfloat16" and cfg.master_rounding == "kahan":
        layout["kahan_comp"] = (torch.bfloat16, tuple(p.shape))
    return layout


def state_bytes_of(cfg: CompactConfig, p: Tensor) -> int:
    """Host bytes of ``p``'s state in ``cfg``'s format (``step`` excluded), from ``state_layout``."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in state_layout(cfg, p).values())


def init_state(cfg: CompactConfig, p: Tensor) -> Dict[str, Tensor]:
    """Zero state of ``p`` in ``cfg``'s format (``step`` as torch.optim.Adam keeps it)."""
    state: Dict[str, Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
    for key, (dtype, shape) in state_layout(cfg, p).items():
        state[key] = torch.zeros(shape, dtype=dtype)
    return state


def state_to_fp32(state: Dict[str, Tensor], shape: torch.Size, block_size: Optional[int]) -> Tuple[Tensor, Tensor]:
    """(m, v) of any saved format (fp32, bf16, int8 with scales) as fp32 tensors of ``shape``."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if "exp_avg_scale" in state:
        if block_size is None:
            raise ValueError("an int8 optimizer state needs its block_size (the 'compact' entry of the state dict)")
        m = quant.dequantize_m(m, state["exp_avg_scale"], block_size)
        r = quant.dequantize_r(v, state["exp_avg_sq_scale"], block_size)
        v = r * r
    return m.float().reshape(shape).clone(), v.float().reshape(shape).clone()


def _matches(cfg: CompactConfig, saved_cfg: Optional[Dict[str, Any]], state: Dict[str, Tensor], p: Tensor) -> bool:
    """Whether ``state`` is already in ``cfg``'s format for ``p`` (so it loads bit for bit)."""
    layout = state_layout(cfg, p)
    if (set(layout) | {"step"}) - {"kahan_comp"} != set(state) - {"kahan_comp"}:
        return False
    if cfg.state_dtype == "int8" and (saved_cfg is None or saved_cfg.get("block_size") != cfg.block_size):
        return False
    return all(
        state[k].dtype == dtype and tuple(state[k].shape) == shape for k, (dtype, shape) in layout.items() if k in state
    )


def convert_state(
    cfg: CompactConfig, p: Tensor, saved: Dict[str, Tensor], saved_cfg: Optional[Dict[str, Any]]
) -> Dict[str, Tensor]:
    """``saved`` (any format: torch/fp32 Adam, or another compact config) as ``p``'s state in ``cfg``.

    Same format: cloned bit for bit (exact resume). Otherwise the moments go through fp32 and are
    rounded/quantised once into ``cfg``'s format; a missing Kahan compensation starts at zero and one
    that ``cfg`` does not use is dropped (at most half a bf16 ulp of each weight)."""
    step = saved["step"].detach().to(torch.float32).clone().reshape(())
    if _matches(cfg, saved_cfg, saved, p):
        out = {k: t.detach().clone() for k, t in saved.items() if k != "step"}
    else:
        block = saved_cfg.get("block_size") if saved_cfg else None
        m, v = state_to_fp32(saved, p.shape, block)
        out = init_state(cfg, p)
        out.pop("step")
        _store_moments(cfg, out, m.reshape(-1), v.reshape(-1), quant.sqrt32(v.reshape(-1)))
    if cfg.master == "bfloat16" and cfg.master_rounding == "kahan":
        comp = saved.get("kahan_comp")
        ok = comp is not None and comp.dtype == torch.bfloat16 and comp.shape == p.shape
        out["kahan_comp"] = comp.detach().clone() if ok else torch.zeros(p.shape, dtype=torch.bfloat16)
    else:
        out.pop("kahan_comp", None)
    out["step"] = step
    return out


def state_bytes(state: Dict[str, Tensor]) -> int:
    """Host bytes of one parameter's optimizer state tensors (``step`` included)."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))


def _load_moments(cfg: CompactConfig, state: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
    """fp32 (m, v) of a state in ``cfg``'s format, flat."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if cfg.state_dtype == "int8":
        r = quant.dequantize_r(v, state["exp_avg_sq_scale"], cfg.block_size)
        return quant.dequantize_m(m, state["exp_avg_scale"], cfg.block_size), r * r
    return m.reshape(-1).float(), v.reshape(-1).float()


def _store_moments(cfg: CompactConfig, state: Dict[str, Tensor], m: Tensor, v: Tensor, r: Tensor) -> None:
    """Write fp32 m, v and r = sqrt(v) (flat) into ``state`` in ``cfg``'s format, in place (int8
    stores r, the other formats v)."""
    if cfg.state_dtype == "int8":
        qm, sm = quant.quantize_m(m, cfg.block_size)
        qr, sr = quant.quantize_r(r, cfg.block_size)
        state["exp_avg"].copy_(qm)
        state["exp_avg_scale"].copy_(sm)
        state["exp_avg_sq"].copy_(qr)
        state["exp_avg_sq_scale"].copy_(sr)
    else:
        state["exp_avg"].view(-1).copy_(m)
        state["exp_avg_sq"].view(-1).copy_(v)


def _f32(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float32)


def torch_step(
    cfg: CompactConfig, group: Dict[str, Any], items: List[Tuple[int, Tensor, Tensor, Dict[str, Tensor]]]
) -> None:
    """One compact Adam step in torch for ``items`` = (parameter id, p, grad, state); mirrors the kernel.

    The moments are updated in fp32 (``m + (g - m) * (1 - beta1)``, ``v * beta2 + ((1 - beta2) * g) * g``),
    the parameter moves by ``(-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`` computed from the new fp32
    moments, then m and sqrt(v) are stored in the state format and the parameter in the master's.
    """
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    lw, b2, omb2, eps = _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2), _f32(float(group["eps"]))
    coupled_wd = _f32(0.0 if decoupled else wd)
    decay = _f32(1.0 - lr * wd if decoupled else 1.0)
    for pid, p, grad, state in items:
        step_t = state["step"]
        step_t += 1.0
        neg_step, bc2s = step_scalars(float(step_t.item()), lr, beta1, beta2)
        pf = p.detach().reshape(-1).float()
        g = grad.detach().reshape(-1).float()
        if group["maximize"]:
            g = -g
        g = g + coupled_wd * pf
        x = pf * decay
        m0, v0 = _load_moments(cfg, state)
        m = m0 + (g - m0) * lw
        v = v0 * b2 + (omb2 * g) * g
        r = quant.sqrt32(v)
        denom = r * _f32(1.0 / bc2s) + eps
        upd = (_f32(neg_step) * m) / denom
        if cfg.master == "float32":
            p.detach().view(-1).copy_(x + upd)
        elif cfg.master_rounding == "nearest":
            p.detach().view(-1).copy_(quant.rne_bf16(x + upd))
        elif cfg.master_rounding == "stochastic":
            base = quant.sr_base(cfg.seed, int(step_t.item()), pid)
            p.detach().view(-1).copy_(quant.sr_bf16(x + upd, base))
        else:  # kahan
            comp = state["kahan_comp"].view(-1)
            y = ((x - pf) + upd) + comp.float()
            t = quant.rne_bf16(pf + y)
            comp.copy_(quant.rne_bf16(y - (t.float() - pf)))
            p.detach().view(-1).copy_(t)
        _store_moments(cfg, state, m, v, r)


class CompactKernelBatch:
    """The parameters of one group for one call of the compact C++ kernel (pointers kept with tensors)."""

    def __init__(self, cfg: CompactConfig) -> None:
        self.cfg = cfg
        self.keep: List[Tensor] = []  # tensors whose pointers are passed (alive until run returns)
        self.touched: List[Tensor] = []  # tensors the kernel writes (autograd version bump)
        # p, g, m, v, m_scale, v_scale, comp, step
        self.ptrs = [array.array("Q") for _ in range(8)]
        self.grad_kinds = array.array("i")
        self.numels = array.array("q")
        self.pids = array.array("q")

    def add(self, pid: int, p: Tensor, g: Tensor, state: Dict[str, Tensor]) -> bool:
        """Take a parameter the kernel can step (contiguous host tensors of the expected formats)."""
        if not (p.is_cpu and p.is_contiguous() and g.is_cpu and g.shape == p.shape):
            return False
        if g.dtype not in (torch.float32, torch.bfloat16) or not (g.dtype == p.dtype or g.dtype == torch.bfloat16):
            return False
        # The layout, not a zero state: allocating (and faulting in) the moments at every step cost more
        # than the step itself.
        for k, (dtype, shape) in state_layout(self.cfg, p).items():
            s = state.get(k)
            if s is None or not (s.dtype == dtype and tuple(s.shape) == shape and s.is_cpu and s.is_contiguous()):
                return False
        if not g.is_contiguous() or g.is_conj() or g.is_neg():
            g = g.resolve_conj().resolve_neg().contiguous()
        names = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "kahan_comp")
        tensors = [p, g] + [state.get(k) for k in names] + [state["step"]]
        for arr, t in zip(self.ptrs, tensors):
            arr.append(t.data_ptr() if t is not None else 0)
        self.keep.extend(t for t in tensors if t is not None)
        self.touched.extend(t for t in tensors if t is not None and t is not g)
        self.grad_kinds.append(1 if g.dtype == torch.bfloat16 else 0)
        self.numels.append(p.numel())
        self.pids.append(pid)
        return True

    def __len__(self) -> int:
        return len(self.numels)

    def run(self, kernel: Callable[..., int], group: Dict[str, Any], flush_denormals: bool = True) -> None:
        """One kernel call for the batch; ``flush_denormals``: subnormals count as zero (``csrc/flush_denormals.h``;
        ``torch_step`` keeps them, so the two agree bit for bit only where no value is subnormal)."""
        kernel(
            len(self),
            *(a.buffer_info()[0] for a in self.ptrs),
            self.grad_kinds.buffer_info()[0],
            self.numels.buffer_info()[0],
            self.pids.buffer_info()[0],
            *kernel_hyperparams(group),
            self.cfg.state_kind,
            self.cfg.master_kind,
            self.cfg.block_size,
            torch.get_num_threads(),
            self.cfg.seed,
            int(bool(flush_denormals)),
        )
        torch.autograd.graph.increment_version(self.touched)
