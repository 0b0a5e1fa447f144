"""Adam and AdamW for fp32 stepping on the host.

RoundPipe keeps the optimizer's parameters (fp32 master copies), their gradients and the Adam state in
host memory and steps them on the optimizer thread while the devices run the next iteration, so the
host step must run at memory speed. ``Adam`` has the signature, the state and the results of
``torch.optim.Adam``; its state dicts load into ``torch.optim.Adam`` and back.

Two implementations, chosen per step with ``RPP_DEBUG_ADAM_IMPL``:

* ``cpp`` (``auto`` picks it when it builds): ``csrc/adam.cpp``, one pass over memory per parameter and
  one parallel region per parameter group (the per-tensor overhead of many small tensors disappears), one
  division and one square root per element, subnormals flushed (``flush_denormals``). Used for contiguous
  fp32 and complex64 tensors on the CPU; other tensors go the torch way.
* ``torch``: torch's fused CPU kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``, one pass too),
  and torch's single-tensor reference where the fused kernel does not apply.

``auto`` (default) uses ``cpp`` and falls back to ``torch`` with a logged warning when the kernel cannot
be built (no compiler). ``foreach``, ``capturable``, ``differentiable`` and ``fused`` are accepted for
compatibility and stored in the param groups, but do not change the host implementation.

Opt-in compact state (``state_dtype``, ``master``, ``master_rounding``, ``block_size``, ``seed``): bf16 or
blockwise-int8 moments and bf16 master weights, stepped by ``roundpipe.optim.compact`` (its own C++
kernel ``csrc/compact_adam.cpp``, same ``RPP_DEBUG_ADAM_IMPL`` choice). The defaults keep the path above.

Opt-in ``skip_zero_grad`` (mixtures of experts): a parameter whose gradient is zero everywhere, or an expert (slice
along dim 0 of a 3-d parameter) whose gradient slice is, is left out of the step as torch leaves out a parameter
whose ``.grad`` is None; not Adam's result (see ``Adam``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from roundpipe import settings
from roundpipe.host.state_reserve import StateReserve
from roundpipe.host.step import accept_low_precision_grad, current_publisher, current_stager
from roundpipe.optim import compact
from roundpipe.optim.build import OptimBuildError, get_optim_function, prebuild
from roundpipe.optim.fp32_step import KernelBatch, TensorLists, torch_step

logger = logging.getLogger(__name__)

__all__ = ["Adam"]

IMPL_ENV = "RPP_DEBUG_ADAM_IMPL"
_IMPLS = ("auto", "cpp", "torch")

_kernel_error: Optional[str] = None  # why the C++ kernel is unavailable in this process, once known
_compact_kernel_error: Optional[str] = None  # the same for the compact kernel


def _adam_kernel(name: str = "adam", impl: Optional[str] = None) -> Optional[Callable[..., int]]:
    """The C++ step function ``name`` ("adam" or "compact_adam"), or None when ``impl`` (an optimizer's
    ``RPP_DEBUG_ADAM_IMPL``, read when it was built; None: read it now) selects torch or the build failed
    (auto)."""
    global _kernel_error, _compact_kernel_error
    if impl is None:
        impl = settings.DEBUG_ADAM_IMPL.get()
    if impl == "torch":
        return None
    failed = _kernel_error if name == "adam" else _compact_kernel_error
    if impl == "auto" and failed is not None:
        return None  # failed before: don't retry a build every step
    try:
        return get_optim_function(name)
    except OptimBuildError as exc:
        if impl == "cpp":
            raise
        if name == "adam":
            _kernel_error = str(exc)
        else:
            _compact_kernel_error = str(exc)
        logger.warning(
            "roundpipe.optim.Adam: C++ kernel unavailable, using torch's fused CPU Adam instead (set %s=torch "
            "to silence this). Reason: %s",
            IMPL_ENV,
            exc,
        )
        return None


def _to_scalar(x: Union[float, Tensor]) -> Union[float, Tensor]:
    """A 1-element hyperparameter tensor as a 0-dim tensor (as torch.optim.Adam stores betas)."""
    return x.squeeze() if isinstance(x, Tensor) and x.dim() != 0 else x


def _get_scalar_dtype(is_fused: Optional[bool] = None) -> torch.dtype:
    """dtype of the ``step`` state, as torch.optim chooses it."""
    if is_fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Adam(Optimizer):
    """Implements Adam (and AdamW with ``decoupled_weight_decay=True``) with fp32 stepping on CPU.

    Results match ``torch.optim.Adam`` to float rounding. See ``torch.optim.Adam`` for the algorithm and
    the meaning of every argument; ``foreach``, ``capturable``, ``differentiable`` and ``fused`` are
    compatibility placeholders (stored, not used). The step runs without autograd.

    Compact state (opt-in; docs/optimizer.md, "Compact optimizer state"):

    Args:
        state_dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"int8"`` (blockwise, one fp32 scale per
            ``block_size`` elements; ``roundpipe.optim.quant``) for ``exp_avg`` and ``exp_avg_sq``.
        master: ``"float32"`` (default: the parameters are fp32 masters) or ``"bfloat16"`` (the bf16
            parameters are the masters: no fp32 copy anywhere).
        master_rounding: how a bf16 master takes its fp32 update: ``"stochastic"`` (default; seeded,
            a pure function of (seed, step, parameter, element)), ``"kahan"`` (a bf16 compensation
            buffer, 2 bytes per parameter) or ``"nearest"``.
        block_size: elements per int8 quantisation block (default 256).
        seed: seed of the stochastic rounding, an int in [0, 2**63).
        preallocate_state: build the zero moments in a background thread from the RoundPipe model's
            first training call on, so the first ``step()`` does not allocate them on its critical
            path (``roundpipe.host.state_reserve``; same memory, same state dict; a parameter's state still
            appears at its first step). False, or without RoundPipe: allocate them in the first step,
            as torch does.

    Mixture-of-experts and subnormal options (docs/optimizer.md, "Experts without tokens"):

    Args:
        skip_zero_grad: step a parameter whose gradient is exactly zero everywhere (an expert that no
            token reached) as if it had no gradient: like torch for a parameter whose ``.grad`` is None,
            its moments, weight and step count stay as they are. This is not Adam's result: with a zero
            gradient Adam still decays both moments and moves the weight by ``lr * m_hat / (sqrt(v_hat) +
            eps)``, which is not zero while ``m`` is not. Default False (Adam's result). A param group
            may set its own ``"skip_zero_grad"`` (e.g. the experts' group only). Costs one read of each
            such gradient to test it. A 3-d parameter with the fp32 state (a layer's experts in one tensor
            [E, ...]) is skipped per expert: expert ``e`` (slice ``[e]``) with an all-zero gradient slice
            keeps its weight and moments, the others step with bias correction from their own counts, as
            if each expert were a separate parameter. Those counts are ``state["expert_step"]`` (shape
            [E], from the first step that leaves an expert out); ``state["step"]`` then counts the steps in
            which any expert stepped. torch.optim.Adam loads such a state but ignores ``expert_step`` (it
            would bias-correct every expert with ``step``). Such a parameter is stepped as E slices (the
            C++ kernel still, one batch per group), and its bf16 model weights are copied after the step
            instead of written in it. With a compact state, 3-d parameters keep the whole-tensor rule.
        flush_denormals: the C++ kernels (fp32 and compact) take subnormal floats (below 1.2e-38) as zero
            (x86 FTZ/DAZ, for their own threads and only while they run). Moments that decay under zero
            gradients pass through that range, where each operation is 15-45x slower; default True. The
            torch paths never flush.

    Raises:
        ValueError: bad hyperparameters, an unknown compact option, or parameters the chosen master does
            not take (``master="bfloat16"`` needs bf16 parameters; a compact ``state_dtype`` with
            ``master="float32"`` needs fp32 ones); ``amsgrad`` with a compact state.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, Tensor] = 1e-3,
        betas: Tuple[Union[float, Tensor], Union[float, Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
        state_dtype: str = "float32",
        master: str = "float32",
        master_rounding: str = "stochastic",
        block_size: int = 256,
        seed: int = 0,
        preallocate_state: bool = True,
        skip_zero_grad: bool = False,
        flush_denormals: bool = True,
    ) -> None:
        # Same validation as torch.optim.Adam, minus its foreach/fused/capturable combinations: those
        # flags select torch implementations that this optimizer does not use.
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (
            (isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
        ):
            raise ValueError("betas must be either both floats or both Tensors")
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor) and beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
        defaults = {
            "lr": lr,
            "betas": tuple(map(_to_scalar, betas)),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        # Not in the param groups: a default optimizer's state dict stays torch.optim.Adam's.
        self.skip_zero_grad = bool(skip_zero_grad)
        self.flush_denormals = bool(flush_denormals)
        self.compact_config = compact.make_config(state_dtype, master, master_rounding, block_size, seed)
        # Set before the base constructor: it calls add_param_group, which starts the builders.
        self._reserve: Optional[StateReserve] = StateReserve("adam") if preallocate_state else None
        super().__init__(params, defaults)
        # The kernel choice, read once: steps run on the optimizer thread.
        self.impl: str = settings.DEBUG_ADAM_IMPL.get()
        if self.impl != "torch":
            # The C++ step is compiled (first run on a machine: 2 s for Adam, 7 s for the compact
            # kernel on a 2-core host) and loaded meanwhile, not inside the first step.
            prebuild("compact_adam" if self.compact_config.enabled else "adam")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; also marks the parameters as taking bfloat16
        gradients for fp32 parameters, so RoundPipe hands its bf16 host gradients over uncopied."""
        cfg: Optional[compact.CompactConfig] = getattr(self, "compact_config", None)
        if cfg is not None and cfg.enabled:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            for p in params:
                compact.check_param(cfg, p, {**self.defaults, **param_group})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            accept_low_precision_grad(p)
        reserve: Optional[StateReserve] = getattr(self, "_reserve", None)
        if reserve is not None:
            if cfg is not None and cfg.enabled:
                reserve.add(
                    group["params"], lambda p: compact.init_state(cfg, p), lambda p: compact.state_bytes_of(cfg, p)
                )
            else:
                amsgrad = bool(group["amsgrad"])
                moments = 3 if amsgrad else 2
                reserve.add(
                    group["params"],
                    lambda p: _zero_moments(p, amsgrad),
                    lambda p: moments * p.numel() * p.element_size(),
                )

    def _take_reserved(self, p: Tensor) -> Optional[Dict[str, Tensor]]:
        """``p``'s zero state built in the background, if any (see ``preallocate_state``)."""
        reserve: Optional[StateReserve] = getattr(self, "_reserve", None)
        return None if reserve is None else reserve.take(p)

    def _drop_reserve(self) -> None:
        """After the first step or a state load: free what was built for parameters it did not use."""
        reserve: Optional[StateReserve] = getattr(self, "_reserve", None)
        if reserve is not None:
            reserve.clear()
            self._reserve = None

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Restore pickled or older state: fill group keys missing from it, make ``step`` a tensor."""
        super().__setstate__(state)
        self.__dict__.setdefault("skip_zero_grad", False)  # an optimizer pickled before these options
        self.__dict__.setdefault("flush_denormals", True)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            fused = group.setdefault("fused", None)
            for p in group["params"]:
                p_state = self.state.get(p, [])
                if len(p_state) != 0 and not torch.is_tensor(p_state["step"]):
                    step_val = float(p_state["step"])
                    p_state["step"] = (
                        torch.tensor(step_val, dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                        if group["capturable"] or group["fused"]
                        else torch.tensor(step_val, dtype=_get_scalar_dtype())
                    )

    def _init_state(self, p: Tensor, group: Dict[str, Any]) -> Dict[str, Tensor]:
        """Create the state of ``p`` exactly as torch.optim.Adam does (lazily, at its first step)."""
        state = self.state[p]
        # torch keeps `step` on the CPU (float32) unless capturable/fused: same keys, dtypes and devices
        # here, so state dicts move between this optimizer and torch.optim.Adam as they are.
        state["step"] = (
            torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
            if group["capturable"] or group["fused"]
            else torch.tensor(0.0, dtype=_get_scalar_dtype())
        )
        reserved = self._take_reserved(p)
        if reserved is None or ("max_exp_avg_sq" in reserved) != bool(group["amsgrad"]):
            reserved = _zero_moments(p, bool(group["amsgrad"]))
        state.update(reserved)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform a single optimization step.

        Args:
            closure: A closure that reevaluates the model and returns the loss.

        Returns:
            The loss value if a closure is provided, otherwise None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pub = current_publisher()
        stager = current_stager() if pub is None else None  # fused staging: write the staging buffers
        compact_on = self.compact_config.enabled
        kernel = _adam_kernel("compact_adam" if compact_on else "adam", self.impl)
        # The parameter's position in the optimizer: part of a compact state's rounding stream.
        pids = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])} if compact_on else {}
        # Whole groups; in a streamed RoundPipe step, layer by layer in forward order (Publisher.plan).
        if pub is None:
            plan: List[Tuple[Optional[int], List[Tuple[int, List[Tensor]]]]] = [
                (None, [(gi, g["params"]) for gi, g in enumerate(self.param_groups)])
            ]
        else:
            plan = pub.plan(self.param_groups)
        for unit, parts in plan:
            outs = None
            if pub is not None:
                pub.check_unpublished([p for _, ps in parts for p in ps])
                if unit is not None and not compact_on:
                    # The kernel writes this layer's model weights itself, once no upload reads
                    # them any more (Publisher.outputs waits for that).
                    outs = pub.outputs(unit)
            elif stager is not None and not compact_on:
                outs = stager.outputs([p for _, ps in parts for p in ps if p.grad is not None])
            written: List[Tensor] = []
            for gi, params in parts:
                if compact_on:
                    self._compact_params(self.param_groups[gi], params, kernel, pids)
                else:
                    written += self._fp32_params(self.param_groups[gi], params, kernel, outs)
            if unit is not None and pub is not None:
                pub.done(unit, written)  # this layer goes to the next forward now
            if stager is not None and outs:
                stager.done(written, outs)
        self._drop_reserve()
        return loss

    def _with_grads(
        self, group: Dict[str, Any], params: List[Tensor]
    ) -> Iterator[Tuple[Tensor, Tensor, Dict[str, Any], Optional[List[int]]]]:
        """``(param, grad, state, experts)`` of each of ``params`` that has a gradient (with ``skip_zero_grad``:
        one that is not zero everywhere), its state created at its first step (taken from the reserve when one
        was built). ``experts``: None to step the tensor whole, else the indices along dim 0 of the experts of a
        3-d fp32-state parameter to step one by one (see ``skip_zero_grad``)."""
        skip_zero = bool(group.get("skip_zero_grad", self.skip_zero_grad))
        compact_on = self.compact_config.enabled
        for p in params:
            g = p.grad
            if g is None:
                continue
            experts: Optional[List[int]] = None
            if skip_zero and not g.is_sparse:
                if g.dim() == 3 and not compact_on and g.numel() > 0:
                    # One read of the gradient: which experts (slices along dim 0) got a token.
                    experts = g.reshape(g.shape[0], -1).any(1).nonzero().flatten().tolist()
                    if not experts:
                        continue  # no expert got a token: as if p had no gradient
                elif not bool(g.any()):
                    continue  # as if p had no gradient (torch skips a None .grad the same way)
            if g.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            state = self.state[p]
            if len(state) == 0:
                if compact_on:
                    state.update(self._take_reserved(p) or compact.init_state(self.compact_config, p))
                else:
                    state = self._init_state(p, group)
            if experts is not None and len(experts) == g.shape[0] and "expert_step" not in state:
                experts = None  # every expert stepped every time so far: one step count, the whole tensor
            elif experts is None and "expert_step" in state:
                experts = list(range(g.shape[0]))  # per-expert counts from an earlier step: keep them
            yield p, g, state, experts

    def _fp32_params(
        self,
        group: Dict[str, Any],
        params: List[Tensor],
        kernel: Optional[Callable[..., int]],
        outs: Optional[Dict[int, Tensor]] = None,
    ) -> List[Tensor]:
        """Step ``params`` of ``group`` with the fp32 state: the C++ kernel where it applies, torch
        otherwise. ``outs``: ``id(param) -> bf16 tensor`` the kernel also writes the update to (a
        streamed step's model weights); returns the parameters whose update it wrote there."""
        amsgrad = group["amsgrad"]
        batch = KernelBatch() if kernel is not None else None
        rest = TensorLists()
        # One pass over the parameters: lazy state, then each to the kernel batch if it can take it,
        # else to torch. This loop is the per-tensor cost of a step; keep it lean.
        for p, g, state, experts in self._with_grads(group, params):
            m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
            vmax = state["max_exp_avg_sq"] if amsgrad else None
            if experts is not None:
                _add_experts(experts, p, g, state, vmax, batch, rest)
                continue
            if batch is None or not batch.add(p, g, m, v, vmax, step):
                rest.add(p, g, m, v, vmax, step)
            else:
                batch.add_output(outs.get(id(p)) if outs else None)
        if batch is not None and kernel is not None and batch.params:
            batch.run(kernel, group, self.flush_denormals)
        if rest.params:
            torch_step(group, *rest.lists())
        return batch.written if batch is not None else []

    def _compact_params(
        self, group: Dict[str, Any], params: List[Tensor], kernel: Optional[Callable[..., int]], pids: Dict[int, int]
    ) -> None:
        """Step ``params`` of ``group`` with the compact state: the C++ kernel where it applies, torch otherwise."""
        cfg = self.compact_config
        batch = compact.CompactKernelBatch(cfg) if kernel is not None else None
        rest: List[Tuple[int, Tensor, Tensor, Dict[str, Tensor]]] = []
        for p, g, state, _ in self._with_grads(group, params):
            pid = pids[id(p)]
            if batch is None or not batch.add(pid, p, g, state):
                rest.append((pid, p, g, state))
        if batch is not None and kernel is not None and len(batch):
            batch.run(kernel, group, self.flush_denormals)
        if rest:
            compact.torch_step(cfg, group, rest)

    def state_dict(self) -> Dict[str, Any]:
        """As ``torch.optim.Adam.state_dict``; a compact optimizer adds its options under ``"compact"``."""
        sd = super().state_dict()
        if self.compact_config.enabled:
            sd["compact"] = self.compact_config.as_dict()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As ``torch.optim.Adam.load_state_dict``, converting between state formats.

        A state saved in this optimizer's format loads bit for bit (a resumed run continues exactly).
        Other formats are converted through fp32 (``compact.convert_state``): fp32 / torch.optim.Adam
        state into a compact optimizer (moments rounded or quantised once), an int8 state saved with
        another ``block_size`` (decoded with the saved one, requantised into this one's blocks), and a
        compact state into a default optimizer (moments decoded to the parameters' dtype).
        """
        self._drop_reserve()  # the loaded states replace what was built for a fresh start
        saved_cfg = state_dict.get("compact")
        is_compact = saved_cfg is not None or any("exp_avg_scale" in s for s in state_dict["state"].values())
        if not self.compact_config.enabled and not is_compact:
            super().load_state_dict(state_dict)
            _restore_expert_steps(self, state_dict)
            return
        super().load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        # torch cast every floating state tensor to its parameter's dtype: redo each state from the saved one.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(sid)
            if not saved:
                continue
            if self.compact_config.enabled:
                self.state[p] = compact.convert_state(self.compact_config, p, saved, saved_cfg)
                continue
            block = saved_cfg.get("block_size") if saved_cfg else None
            m, v = compact.state_to_fp32(saved, p.shape, block)
            state = self.state[p]
            state["exp_avg"], state["exp_avg_sq"] = m.to(p.dtype), v.to(p.dtype)
            for key in ("exp_avg_scale", "exp_avg_sq_scale", "kahan_comp"):
                state.pop(key, None)
            if self.param_groups[0]["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()


def _zero_moments(p: Tensor, amsgrad: bool) -> Dict[str, Tensor]:
    """torch.optim.Adam's initial moments of ``p`` (zeros like it)."""
    state = {
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _add_experts(
    experts: List[int],
    p: Tensor,
    g: Tensor,
    state: Dict[str, Any],
    vmax: Optional[Tensor],
    batch: Optional[KernelBatch],
    rest: TensorLists,
) -> None:
    """Queue the slices ``[e]`` of a 3-d parameter (``p``, ``g``, the moments: [E, ...]) for ``e`` in
    ``experts``, each with its own step count ``state["expert_step"][e]`` (shape [E], created from the
    tensor's ``step`` the first time an expert is left out). ``state["step"]`` counts the steps in which
    any expert stepped. The model weights of such a parameter are copied after the step, not written in it."""
    es = state.get("expert_step")
    step = state["step"]
    if es is None:
        es = state["expert_step"] = torch.full((p.shape[0],), float(step), dtype=step.dtype, device=step.device)
    step.add_(1)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    for e in experts:
        pe, ge, me, ve, vme, se = p[e], g[e], m[e], v[e], None if vmax is None else vmax[e], es[e]
        if batch is None or not batch.add(pe, ge, me, ve, vme, se):
            rest.add(pe, ge, me, ve, vme, se)
        else:
            batch.add_output(None)


def _restore_expert_steps(opt: Adam, state_dict: Dict[str, Any]) -> None:
    """torch's load casts every state tensor but ``step`` to its parameter's dtype: give each loaded
    ``expert_step`` back the dtype of its ``step``."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for sid, p in zip(saved_ids, params):
        saved = state_dict["state"].get(sid) or {}
        if "expert_step" in saved:
            step = opt.state[p]["step"]
            opt.state[p]["expert_step"] = saved["expert_step"].to(dtype=step.dtype, device=step.device)
