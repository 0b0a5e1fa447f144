"""The RoundPipe model wrappers: ``RoundPipe`` runs a layer list on the device pool; ``AutoRoundPipe``
gives any model the optimizer-side features (optimizer parameters, asynchronous steps)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from roundpipe import settings
from roundpipe.base import RoundPipeBase, check_wrapper_arguments
from roundpipe.devices.cpu_streams import host_checked
from roundpipe.devices.memory import PinMode, pin_module
from roundpipe.devices.threads import raise_if_failed
from roundpipe.host import step_cycle
from roundpipe.host.attribute import LayerAttribute, ParamAttribute
from roundpipe.host.formats import check_base_format, module_device_bytes, quantize_base
from roundpipe.planning import budget
from roundpipe.planning.plan import ModelExecutePlan, PlanCache, RunType
from roundpipe.planning.timer import ModelTimer
from roundpipe.runtime import pipeline, plan_choice
from roundpipe.runtime.batch import Batch
from roundpipe.runtime.grad_sync import GradSync
from roundpipe.runtime.partial_grads import PartialGradStore
from roundpipe.runtime.run import Run
from roundpipe.runtime.run_config import ResolvedRunConfig, RoundPipeRunConfig, check_model_run_config
from roundpipe.utils import (
    FP8_PREPARED,
    GiB,
    get_call_location,
    get_model_active_size,
    get_model_compute_size,
    get_model_size,
)


def check_run_config(run_config: Any, where: str) -> None:
    """A call's run configuration is a ``RoundPipeRunConfig`` (a dict or a field's value is a common slip)."""
    if not isinstance(run_config, RoundPipeRunConfig):
        raise TypeError(
            f"{where} takes a roundpipe.RoundPipeRunConfig, not {type(run_config).__name__} "
            f"(e.g. RoundPipeRunConfig(num_microbatch=4))"
        )


def check_call_arguments(
    input_args: Any, input_kwargs: Any, loss_fn: Any, return_outputs: Any, run_config: Any
) -> None:
    """``forward_backward``'s arguments, checked before any job runs: each mistake gets one line naming the
    argument, instead of an error inside a layer or ``loss_fn`` on a device thread."""
    if not isinstance(input_args, tuple):
        raise TypeError(
            f"forward_backward: input_args is the tuple of the first layer's positional arguments "
            f"(input_args=(x,)), not a {type(input_args).__name__}"
        )
    if not isinstance(input_kwargs, dict):
        raise TypeError(
            f"forward_backward: input_kwargs is a dict of the first layer's keyword arguments, "
            f"not a {type(input_kwargs).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"forward_backward: loss_fn must be a callable (outputs_m, label_m) -> loss of one microbatch, "
            f"not a {type(loss_fn).__name__}"
        )
    if not isinstance(return_outputs, bool):
        raise TypeError(f"forward_backward: return_outputs is True or False, not {return_outputs!r:.40}")
    check_run_config(run_config, "forward_backward(run_config=...)")


class RoundPipe(RoundPipeBase):
    """Wraps a module with RoundPipe's pipelined runtime.

    An ``nn.Sequential`` is split into its children (the layers); any other module is one layer. Layer 0
    is called as ``layer(*args, **kwargs)``; layer i > 0 as ``layer(output_of_layer_i_minus_1)``.

    ``base_format`` (``roundpipe.host.formats.BASE_FORMATS``) stores the frozen ``nn.Linear`` and expert weights
    packed in host memory (``"fp8"``, ``"int8"``, ``"nf4"``, ``"mxfp4"``; default ``"bf16"``: as they are); they are
    uploaded packed and unpacked on the device. A packed format with no frozen weight to pack is an error.

    Attributes:
        model_run_config: Default run configuration of this model.
        layers: The layers.
        num_layers: Number of layers.
        layer_size: Size of each layer's parameters and buffers in GB.
    """

    REPLAN_EVERY = 20
    grad_sync: Optional[GradSync]
    """Gradient synchronisation across processes (data parallel), or None: ``roundpipe.runtime.grad_sync``."""

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: Optional[torch.dtype] = None,
        name: Optional[str] = None,
        model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
        pin_model: PinMode = "alloc",
        base_format: str = "bf16",
    ) -> None:
        check_wrapper_arguments(type(self).__name__, model, optim_dtype)
        check_model_run_config(model_run_config)
        check_base_format(base_format)
        super().__init__(model, name if name is not None else get_call_location(1), optim_dtype)
        on_device = [
            n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type != "cpu"
        ]
        if on_device:
            raise ValueError(
                f"RoundPipe keeps the model in host memory, but {on_device[0]} is on "
                f"{dict(model.named_parameters()).get(on_device[0], next(model.buffers(), None)).device}; "
                "call model.cpu() (or load it on the CPU) before wrapping"
            )
        self.model_run_config = model_run_config
        for s in (settings.DEBUG_DEVICE_SAVED_GB, settings.STAGE_INPUTS, settings.DEBUG_TILE_ATTENTION):
            s.get()  # read later on worker threads: a bad value fails here, naming the variable
        layers = list(model.children()) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ValueError("RoundPipe needs at least one layer; the nn.Sequential is empty")
        self.__dict__["layers"] = layers  # not registered again: they live under self.model
        self.num_layers = len(layers)
        self.layer_attrs = [LayerAttribute(i, f"{self.name}.layer{i}") for i in range(self.num_layers)]
        # Host buffers of the fused group's gradient parts on other devices (``partial_grads``).
        self.partial_grad_store: PartialGradStore = {}
        # Frozen Linear weights packed before pinning (the packed bytes are what is pinned) and before the
        # layer sizes are read (they count the packed bytes).
        quantize_base(model, base_format)
        if model_run_config.fp8 and not any(getattr(m, FP8_PREPARED, False) for m in model.modules()):
            # The wrappers convert the whole model before they split it; a RoundPipe built directly would run its
            # layers in bf16 without a word.
            raise ValueError(
                "RoundPipeRunConfig(fp8=True): this model's layers are not converted for FP8 GEMMs, and a RoundPipe "
                "built directly does not convert them: wrap it with roundpipe.wrap_model_to_roundpipe(model, fp8=True) "
                "or roundpipe.models.wrap_model(model, fp8=True), or call roundpipe.models.fp8.prepare(model, True) "
                "first; or remove fp8=True"
            )
        pin_module(model, pin_model)
        shared: Dict[int, nn.Parameter] = {}
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                attr = ParamAttribute.set(p, i)
                if attr.shared:
                    shared[id(p)] = p
        self.__dict__["_shared_list"] = list(shared.values())
        self.layer_size = [get_model_size(layer) / GiB for layer in layers]
        self.model_timer = ModelTimer(self.num_layers, [get_model_compute_size(layer) / GiB for layer in layers])
        # Owned here, read and updated by the runtime's plan choice: the automatic plans (``plan_choice``).
        self.plan_cache = PlanCache()
        # The plan of the latest call, its kept stages marked (what ran; for inspection and the benchmarks).
        self.last_plan: Optional[ModelExecutePlan] = None
        self._finish_init()

    @property
    def _shared_params(self) -> List[nn.Parameter]:
        return self.__dict__["_shared_list"]

    def optim_units(self) -> List[Tuple[LayerAttribute, List[nn.Parameter]]]:
        # Each layer's parameters are listed once (the layer list is fixed at wrapping); which of them
        # train is asked per call (``requires_grad`` may change, e.g. to freeze a layer).
        cached = self.__dict__.get("_layer_params")
        if cached is None:
            cached = self.__dict__["_layer_params"] = [list(layer.parameters()) for layer in self.layers]
        seen: set = set()
        units = []
        for attr, layer_params in zip(self.layer_attrs, cached):
            params = [p for p in layer_params if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            units.append((attr, params))
        return units

    # ---- plans ---------------------------------------------------------------------------------------
    def layer_device_bytes(self, run_type: RunType) -> List[float]:
        """Bytes each layer occupies on a device while it runs: parameters and buffers (a packed frozen weight
        at its device copy's size, its logical one once unpacked, plus the transient of unpacking it; one computing
        from its fp8 bytes at those bytes: ``formats.module_device_bytes``), plus
        gradients of trainable parameters when training. Computed once per run type (the layer list is fixed)."""
        key = "infer" if run_type == "infer" else "train"
        cache = self.__dict__.setdefault("_device_bytes", {})
        if key not in cache:
            cache[key] = [
                float(module_device_bytes(l) + (get_model_active_size(l) if key == "train" else 0)) for l in self.layers
            ]
        return cache[key]

    def resolve_plan(
        self, cfg: ResolvedRunConfig, run_type: RunType, batch: Optional[Batch] = None
    ) -> ModelExecutePlan:
        """The plan for this call: the user's (validated) or the model's default for ``run_type`` (for a
        training call over ``batch``, within the activation budgets: ``roundpipe.planning.budget``), or the one
        the model's ``grad_sync`` agrees on across processes (data parallel reducing on the devices:
        every rank must run the same jobs)."""
        plan = self._local_plan(cfg, run_type, batch)
        plan = plan if self.grad_sync is None else self.grad_sync.agree_plan(self, run_type, plan)
        self.last_plan = plan
        return plan

    def _local_plan(self, cfg: ResolvedRunConfig, run_type: RunType, batch: Optional[Batch] = None) -> ModelExecutePlan:
        """This process's plan: the user's (validated) or the model's default (``plan_choice``)."""
        return plan_choice.local_plan(self, cfg, run_type, batch)

    #: A re-plan replaces the plan in use only when the planner's model of an iteration, from the
    #: same timings, is this much faster: plans of equal cost flip on timer noise otherwise (measured on
    #: qwen3-1.7b: 929 vs 930 ms plans alternating between runs), and a new plan's stage boundaries
    #: and device memory peak cost more than the noise they chase.
    REPLAN_GAIN = 0.02

    def activation_profile(self, batch: Batch, recompute_grain: str) -> Optional["budget.ActivationProfile"]:
        """What a training call over ``batch`` keeps per layer (``roundpipe.planning.budget``), or None when the
        model cannot tell: a plain RoundPipe is planned by its weights alone. Presets override it."""
        return None

    # ---- running -------------------------------------------------------------------------------------
    def _needs_graph(self, batch: Batch) -> bool:
        if any(p.requires_grad for p in self.model.parameters()):
            return True
        return any(isinstance(t, torch.Tensor) and t.requires_grad for leaves in batch.flatten_states for t in leaves)

    @host_checked
    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig = RoundPipeRunConfig(), **kwargs: Any
    ) -> Any:
        """Run the model over all microbatches; with gradients enabled the result is connected to
        autograd, and ``backward()`` on it runs the pipelined backward."""

        check_run_config(roundpipe_run_config, "forward(roundpipe_run_config=...)")
        cfg = ResolvedRunConfig(roundpipe_run_config, self.model_run_config)
        if cfg.requires_grad and not torch.is_grad_enabled():
            raise RuntimeError(
                "RoundPipeRunConfig(requires_grad=True) but gradients are disabled (torch.no_grad); enable "
                "grad or drop requires_grad"
            )
        self._check_optimizer_idle()
        batch = Batch(args, kwargs, cfg)
        train = cfg.requires_grad and self._needs_graph(batch)
        into_weights = step_cycle.begin_call(self, train)
        run_type: RunType = "train" if train else "infer"
        run = Run(self, cfg, batch, run_type, self.resolve_plan(cfg, run_type, batch))
        run.grad_into_weights = into_weights
        if not train:
            with torch.no_grad():
                pipeline.guarded(run, f"model {self.name!r} forward", lambda: pipeline.dispatch_forward(run))
            run.timer.finish()
            return batch.dump(cfg)
        inputs = [
            t
            for leaves in run.input_leaves
            for t, want in zip(leaves, [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves])
            if want
        ]
        tag = torch.empty(0, requires_grad=True)
        outs = iter(pipeline.RoundPipeBatchedBackward.apply(run, tag, *inputs))
        for m, leaves in enumerate(batch.flatten_states):
            batch.flatten_states[m] = [next(outs) if isinstance(t, torch.Tensor) else t for t in leaves]
        return batch.dump(cfg)

    @host_checked
    def forward_backward(
        self,
        input_args: Tuple[Any, ...] = (),
        input_kwargs: Dict[str, Any] = {},  # noqa: B006 - the spec's signature; never mutated
        label: Any = None,
        loss_fn: Callable[[Any, Any], Union[Sequence[torch.Tensor], torch.Tensor]] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig = RoundPipeRunConfig(),
    ) -> Any:
        """Forward, loss and backward over all microbatches in one pipelined pass.

        ``loss_fn(outputs_m, label_m)`` gives microbatch m's loss (a scalar or a sequence of scalars);
        gradients are those of the sum over microbatches, accumulated into ``.grad`` as ``backward``
        does. Returns the summed loss (detached), and the merged outputs when ``return_outputs``.
        """

        if not torch.is_grad_enabled():
            raise RuntimeError("forward_backward needs gradients enabled; it was called under torch.no_grad()")
        if isinstance(input_args, torch.Tensor):
            input_args = (input_args,)  # one tensor: the first layer's one argument
        check_call_arguments(input_args, input_kwargs, loss_fn, return_outputs, run_config)
        cfg = ResolvedRunConfig(run_config, self.model_run_config)
        self._check_optimizer_idle()
        into_weights = step_cycle.begin_call(self, True)
        batch = Batch(input_args, dict(input_kwargs), cfg, label)
        run = Run(self, cfg, batch, "fused", self.resolve_plan(cfg, "fused", batch), loss_fn, return_outputs)
        run.grad_into_weights = into_weights
        pipeline.guarded(run, f"model {self.name!r} forward_backward", lambda: pipeline.dispatch_fused(run))
        pipeline.finish_backward(run)
        for evs in batch.forward_events:
            for e in evs:
                e.synchronize()
        per_mb = [list(l) for l in batch.loss_list]
        n_losses = len(per_mb[0])
        sums = [torch.stack([mb[k] for mb in per_mb]).sum() for k in range(n_losses)]
        # Hand input gradients to the caller's graph (a user module or an upstream RoundPipe).
        wanted = [
            (t, g)
            for ctx, leaves in zip(run.contexts, run.input_leaves)
            for t, g, want in zip(leaves, ctx.grad_states, ctx.input_requires_grad)
            if want and g is not None
        ]
        run.release()
        if wanted:
            torch.autograd.backward([t for t, _ in wanted], [g.to(t.device) for t, g in wanted])
        loss: Any = sums if run.loss_is_sequence else sums[0]
        if return_outputs:
            return loss, batch.dump(cfg, outputs=run.outputs)
        return loss

    def _check_optimizer_idle(self) -> None:
        """Raise a worker failure from an earlier asynchronous step before starting a new run."""
        raise_if_failed(f"model {self.name!r} optimizer step")


class AutoRoundPipe(RoundPipeBase):
    """Gives an arbitrary model (typically one whose heavy submodules are RoundPipe instances, see
    ``wrapper``) the optimizer-side features: ``optim_parameters()``, ``step``, ``synchronize``.

    The model runs as is. Parameters outside RoundPipe submodules are used on the host by the main
    thread; they form one extra unit of the step protocol, fenced at the start of ``forward``.
    """

    def __init__(
        self, model: nn.Module, name: Optional[str] = None, optim_dtype: Optional[torch.dtype] = None, **kwargs: Any
    ) -> None:
        super().__init__(model, name if name is not None else get_call_location(1), optim_dtype)
        self.__dict__["_host_attr"] = LayerAttribute(-1, f"{self.name}.host")
        self._finish_init()

    def _submodels(self) -> List[RoundPipe]:
        return [m for m in self.model.modules() if isinstance(m, RoundPipe)]

    def optim_units(self) -> List[Tuple[LayerAttribute, List[nn.Parameter]]]:
        units: List[Tuple[LayerAttribute, List[nn.Parameter]]] = []
        inside: set = set()
        for sub in self._submodels():
            sub_units = sub.optim_units()
            units.extend(sub_units)
            inside.update(id(p) for p in sub.model.parameters())
        host = [p for p in self.model.parameters() if p.requires_grad and id(p) not in inside]
        for p in host:
            ParamAttribute.set(p, None)  # the step protocol reads every unit parameter's attribute
        units.append((self._host_attr, host))
        return units

    @property
    def layer_attrs(self) -> List[LayerAttribute]:  # type: ignore[override]
        return [a for sub in self._submodels() for a in sub.layer_attrs] + [self._host_attr]

    @layer_attrs.setter
    def layer_attrs(self, value: List[LayerAttribute]) -> None:
        pass

    @property
    def _shared_params(self) -> List[nn.Parameter]:
        return [p for sub in self._submodels() for p in sub._shared_params]

    def _finish_host_buffers(self) -> None:
        for sub in self._submodels():
            sub._finish_host_buffers()

    def _cycles(self) -> List[step_cycle.StepCycle]:
        return [c for sub in self._submodels() for c in sub._cycles()]

    @host_checked
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model; host-side parameters are fenced against an asynchronous step first."""
        attr = self._host_attr
        # The main thread reads the host parameters in forward and writes their .grad in backward.
        attr.param_copied.wait()
        attr.grad_copied.wait()
        return self.model(*args, **kwargs)
