"""The ``roundpipe train`` recipe: model + data + RoundPipe + host optimizer, with metrics and checkpoints.

One optimizer step:

1. draw ``grad_accum`` batches; count the tokens their losses average over;
2. for each, ``forward_backward`` over the batch's microbatches (each microbatch's loss is its token
   loss sum over the token count of the *whole step*, so accumulation gives the exact mean);
3. ``model.step(step_fn)``: on the optimizer thread, the host gradients of the fp32 masters are
   clipped to ``max_grad_norm`` (global norm), then optimizer, LR scheduler and ``zero_grad``.

With ``async_step`` (the default) step 3 returns at once and the optimizer overlaps the next step's
compute; that step then computes at weights one step old (see ``RoundPipeBase.step``).

Checkpoints do not perturb training: they wait for the optimizer thread and save the fp32 masters,
the optimizer state *and* the weights the devices currently compute with (in async mode the previous
step's), so a resumed run repeats the uninterrupted run's computation bit for bit on CPU workers,
whether or not the uninterrupted run checkpointed at that step. ``model.safetensors`` holds the
up-to-date weights (masters in the training dtype), which is what ``roundpipe export`` writes out.

Data parallel (launched by ``torchrun`` with several ranks, see :mod:`roundpipe.cli.parallel`): every
rank draws the same global batches (same seed) and trains on its contiguous share of their rows; a
rank's loss is its tokens' loss sum over the token count of the *global* step, and the ranks'
gradients are summed (:func:`roundpipe.distributed.enable_data_parallel` with ``op="sum"``), so every
rank takes the one-process step on the whole batch. Rank 0 alone prints, writes metrics and checkpoints; all ranks resume from the same checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from roundpipe import distributed as rdist
from roundpipe import settings
from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli import parallel
from roundpipe.cli.config import ConfigError, TrainConfig, merge, to_yaml
from roundpipe.cli.metrics import MetricsWriter, device_peak_memory_gib, format_rate, host_peak_rss_gib, plot_metrics
from roundpipe.cli.tasks import BYTE_VOCAB_SIZE, EOS_ID, TASKS, TaskStream, byte_tokenizer, exact_match, held_out_examples

if TYPE_CHECKING:
    from roundpipe.cli.data import FileStream

logger = logging.getLogger("roundpipe")

# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

_QWEN3_COMMON = dict(head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936)

#: Built-in Qwen3 architectures (random init): the WORKLOADS.md sizes plus ``tiny`` for the default task.
BUILTIN_MODELS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        hidden_size=192, intermediate_size=576, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
        head_dim=32, vocab_size=BYTE_VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10_000.0, tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3_COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_config(name: str) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**BUILTIN_MODELS[name], use_cache=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID + 1, bos_token_id=None)


def model_source(cfg: TrainConfig) -> Dict[str, str]:
    """Where the model comes from: ``{"kind": "builtin", "name"}`` or ``{"kind": "local", "path"}``."""
    if cfg.model in BUILTIN_MODELS:
        return {"kind": "builtin", "name": cfg.model}
    if os.path.isdir(cfg.model):
        if not os.path.isfile(os.path.join(cfg.model, "config.json")):
            raise ConfigError(f"{cfg.model} has no config.json", "pass a Hugging Face model directory (save_pretrained output)")
        return {"kind": "local", "path": os.path.abspath(cfg.model)}
    raise ConfigError(
        f"model {cfg.model!r} is neither a local directory nor a built-in architecture",
        f"pass a Hugging Face model directory or one of: {', '.join(BUILTIN_MODELS)}",
    )


def load_model_config(source: Dict[str, str]) -> Any:
    if source["kind"] == "builtin":
        return builtin_config(source["name"])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source["path"], local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config in {source['path']} ({exc})", "pass a directory written by save_pretrained") from None


def resolve_dtype(cfg: TrainConfig, model_config: Any) -> torch.dtype:
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if cfg.model == "tiny":
        return torch.float32
    own = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(own, str):
        own = _DTYPES.get(own)
    if own in _DTYPES.values():
        return own
    return torch.bfloat16 if cfg.model in BUILTIN_MODELS else torch.float32


def build_model(source: Dict[str, str], model_config: Any, dtype: torch.dtype) -> nn.Module:
    """The Hugging Face causal LM (random init for built-ins; weights on the host)."""
    from transformers import AutoModelForCausalLM

    if source["kind"] == "builtin":
        return AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(source["path"], dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model in {source['path']} ({str(exc).splitlines()[0]})", "pass a directory written by save_pretrained with its weights") from None


def load_tokenizer(source: Dict[str, str], cfg: TrainConfig) -> Any:
    """The byte tokenizer for the built-in task and built-in models, the model's own otherwise."""
    if cfg.data is None or source["kind"] == "builtin":
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source["path"], local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"no usable tokenizer in {source['path']} ({str(exc).splitlines()[0]})", "save one there with tokenizer.save_pretrained(model_dir)") from None


def lora_config(cfg: TrainConfig) -> Any:
    from peft import LoraConfig

    targets: Any = cfg.lora_targets
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, lcfg: Any) -> nn.Module:
    from peft import get_peft_model

    try:
        return get_peft_model(model, lcfg)
    except ValueError as exc:
        raise ConfigError(f"LoRA: {str(exc).splitlines()[0]}", "set --lora-targets to module names of this model (e.g. q_proj v_proj) or all-linear") from None


# ---------------------------------------------------------------------------------------------------------
# RoundPipe glue
# ---------------------------------------------------------------------------------------------------------


class PipelineModel:
    """A causal LM on RoundPipe (``RoundPipeForCausalLM``), with the calls training needs.

    Attributes:
        hf_model: The Hugging Face model (inside PEFT when LoRA is on); its parameters are the ones
            RoundPipe streams, so it reflects training after ``synchronize()``.
        rp: The RoundPipe model (``optim_parameters``, ``step``, ``synchronize``).
    """

    def __init__(self, hf_model: nn.Module, num_microbatch: Optional[int], plan: str = "auto") -> None:
        import roundpipe
        from roundpipe import ModelExecutePlan, RoundPipeRunConfig

        self.hf_model = hf_model
        try:
            self.rp = roundpipe.wrap_model_to_roundpipe(
                hf_model,
                use_sequential_preset=True,
                optim_dtype=torch.float32,
                name="train",
                model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
            )
        except NotImplementedError as exc:
            raise ConfigError(f"this model is not supported by RoundPipe ({str(exc).splitlines()[0]})", "use a decoder-only causal LM (Qwen3, Llama, Mistral, ...)") from None
        n = self.rp.num_layers
        if plan == "single":  # one stage: forward, loss and backward of the whole model in one job
            self.rp.model_run_config.execute_plan = ModelExecutePlan([range(0, n)], [range(0, n)])
        elif plan == "layerwise":
            self.rp.model_run_config.execute_plan = ModelExecutePlan.layerwise(n, "train")

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, weight: float, scale: Callable[[torch.Tensor], torch.Tensor], num_microbatch: Optional[int] = None
    ) -> torch.Tensor:
        """Accumulate the gradients of ``scale(weight x batch-mean token loss)``; returns that
        (scaled, weighted) loss. ``weight`` = this batch's share of the step's loss tokens.

        ``weight`` 0 (rows without a trained token, e.g. a data-parallel rank's share) still runs the
        call, with a zero loss: a batch mean over no token would be 0/0, and with gradients reduced on
        the devices every rank must run every training call. ``num_microbatch`` overrides the model's
        microbatch count for this call.
        """
        from roundpipe import RoundPipeRunConfig

        preset = self.rp.preset
        kwargs = preset.forward_kwargs(input_ids=input_ids, labels=labels, return_logits=False)
        if weight == 0:
            loss_fn: Callable[[Any, Any], torch.Tensor] = lambda out, label: scale(out["loss_sum"] * 0.0)
        else:
            base = preset.microbatch_loss_fn(kwargs)
            loss_fn = lambda out, label: scale(base(out, label) * weight)
        return self.rp.forward_backward(input_kwargs=kwargs, loss_fn=loss_fn, run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))

    def _infer_config(self, batch_size: int) -> Any:
        """Inference run config: no more microbatches than rows."""
        from roundpipe import RoundPipeRunConfig, get_num_devices

        n = self.rp.model_run_config.num_microbatch or settings.default_num_microbatch(get_num_devices())
        return RoundPipeRunConfig(num_microbatch=max(1, min(n, batch_size)))

    @torch.no_grad()
    def last_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last position, ``[B, V]``."""
        return self.rp(input_ids=input_ids, logits_to_keep=1, roundpipe_run_config=self._infer_config(input_ids.shape[0])).logits[:, -1]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of all positions, ``[B, T, V]``."""
        return self.rp(input_ids=input_ids, roundpipe_run_config=self._infer_config(input_ids.shape[0])).logits

    def masters(self) -> Dict[int, torch.Tensor]:
        """``id(model parameter) -> fp32 optimizer master`` for the trainable parameters."""
        from roundpipe.attribute import ParamAttribute

        out = {}
        for p in self.hf_model.parameters():
            if p.requires_grad and ParamAttribute.has(p) and ParamAttribute.get(p).optim is not None:
                out[id(p)] = ParamAttribute.get(p).optim
        return out


def make_optimizer(masters: List[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (RoundPipe's host Adam, decoupled weight decay) on the fp32 masters; no weight decay on
    vectors (norm weights, biases)."""
    from roundpipe.optim import Adam

    decay = [p for p in masters if p.ndim >= 2]
    no_decay = [p for p in masters if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), decoupled_weight_decay=True)


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps.

    A class (not a lambda) so that ``LambdaLR.state_dict()`` saves it.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports; the test suite reads it too."""

    step: int
    total_steps: int
    loss: float
    tokens_per_s: float
    seconds: float
    output_dir: str
    checkpoint: Optional[str]
    accuracy: Optional[float] = None
    model: Optional[PipelineModel] = None
    tokenizer: Any = None
    ranks: int = 1


def rng_state() -> Dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))  # torch.load(weights_only)-safe
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Recipe:
    """Set up from a :class:`TrainConfig`, then :meth:`train`."""

    def __init__(self, cfg: TrainConfig, out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self._print = out
        self._bar: Any = None
        self._stop_requested = False  # Ctrl-C seen by this process
        self._stop_now = False  # this step ends the run: Ctrl-C seen by any rank (the same on all ranks)
        self.env = rdist.current_env()
        self.dp: Optional[rdist.DataParallel] = None

    @property
    def is_main(self) -> bool:
        """Whether this process prints, writes metrics and checkpoints (rank 0, or a single process)."""
        return self.env.is_main

    # ---- output ------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        """Print ``msg`` (rank 0 only: the ranks train in lock step, their lines would be duplicates)."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            self._print(msg)

    # ---- setup -------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build everything; with several ranks, make the model a data-parallel replica and load the
        checkpoint on every rank. Each phase that can fail on some ranks only ends in an agreement,
        so a failure on one rank stops all of them (see :mod:`roundpipe.cli.parallel`)."""
        self.env = rdist.current_env()
        parallel.everywhere(self._build, "setup")
        if self.env.distributed:
            # After the masters exist (it broadcasts rank 0's) and before a checkpoint is loaded (the
            # broadcast would overwrite the loaded device weights with the masters). The loss of every
            # rank is already normalised by the global token count (see _train_step): sum, not mean.
            self.dp = rdist.enable_data_parallel(self.model.rp, op="sum")
            w = self.env.world_size
            if self.cfg.batch_size < w and getattr(self.dp, "reduce_on", "host") == "device":
                raise ConfigError(
                    f"batch_size={self.cfg.batch_size} leaves some of the {w} ranks without rows, and gradients reduced on the devices need every rank in every call",
                    f"raise batch_size to at least {w}",
                )
            # The same microbatch count on every rank (the reduction on the devices needs the same jobs
            # everywhere): at most the smallest share of a batch.
            self.microbatches = max(1, min(self.microbatches, self.cfg.batch_size // w))
        if self.resume_from is not None:
            path = self.resume_from
            parallel.everywhere(lambda: self._load_checkpoint(path), f"the loading of checkpoint {path}")
            rdist.assert_same_across_ranks((os.path.basename(os.path.normpath(path)), self.step, self._master_sha), "the resumed checkpoint (name, step, sha256 of its master weights)")

    def _build(self) -> None:
        """Model, data, optimizer and schedule: this process's work alone (no collectives)."""
        cfg = self.cfg
        self._set_devices()
        from roundpipe import get_num_devices

        # validate() rejects an explicit microbatches above batch_size; the default adapts to the batch.
        self.microbatches = cfg.microbatches or min(settings.default_num_microbatch(get_num_devices()), cfg.batch_size)
        self.resume_from: Optional[str] = None
        if cfg.resume is not None:
            self.resume_from = ckpt.resolve_checkpoint(cfg.resume, cfg.output_dir)
            ckpt.verify_checkpoint(self.resume_from)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.source = model_source(cfg)
        model_config = load_model_config(self.source)
        self.dtype = resolve_dtype(cfg, model_config)
        if self.dtype == torch.float16:
            from roundpipe import GradScaler

            self.scaler: Any = GradScaler()
        else:
            self.scaler = None
        self.tokenizer = load_tokenizer(self.source, cfg)
        self.stream = self._data(model_config)
        vocab = getattr(model_config, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ConfigError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {vocab}", "use the model's own tokenizer")
        hf_model = build_model(self.source, model_config, self.dtype)
        self.lora = lora_config(cfg) if cfg.lora_r else None
        if self.lora is not None:
            hf_model = apply_lora(hf_model, self.lora)
        self.model = PipelineModel(hf_model, self.microbatches, cfg.plan)
        named = [(n, p) for n, p in hf_model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters", "check --lora-targets")
        self.optim_params = list(self.model.rp.optim_parameters())  # creates the fp32 masters
        masters_by_id = self.model.masters()
        self.master_named = [(n, masters_by_id[id(p)]) for n, p in named]  # by Hugging Face name
        self.optimizer = make_optimizer([m for _, m in self.master_named], cfg)
        self.total_steps = self._total_steps()
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(self.warmup_steps, self.total_steps, cfg.min_lr_ratio))
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0
        self.grad_norms: Dict[int, float] = {}
        self._master_sha: Optional[str] = None

    def _set_devices(self) -> None:
        import roundpipe
        from roundpipe import backend, settings

        spec = self.cfg.devices
        if spec is not None and spec.strip().startswith("cuda") and self.env.local_world_size > 1:
            raise ConfigError(
                f"devices={spec} would make the {self.env.local_world_size} ranks on this host share those GPUs",
                "drop --devices (each rank then gets its share of the host's GPUs) or launch one rank per host",
            )
        try:
            devices = backend.parse_devices(spec if spec is not None else settings.DEVICES.get())
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(str(exc).split(";")[0], "use --devices cuda, cuda:0,1 or cpu:N") from None
        compile_ = self.cfg.compile
        if compile_ is None and not settings.DISABLE_TORCH_COMPILE.is_set():  # auto: compile for GPUs only
            compile_ = any(d.type == "cuda" for d in devices)
        roundpipe.configure(devices=spec, compile=compile_)

    def _data(self, model_config: Any) -> Union[TaskStream, "FileStream"]:
        """The batch stream; the sequence length is checked against the model before any tokenizing."""
        cfg = self.cfg
        limit = getattr(model_config, "max_position_embeddings", None)
        if cfg.data is None:
            task = TASKS[cfg.task]
            if cfg.seq_len is not None and cfg.seq_len != task.seq_len:
                raise ConfigError(f"seq_len={cfg.seq_len} is set, but task {cfg.task!r} has fixed {task.seq_len}-token examples", "drop --seq-len or train on a --data file")
            seq_len = task.seq_len
        else:
            seq_len = cfg.seq_len or min(512, limit or 512)
        if limit is not None and seq_len > limit:
            raise ConfigError(f"seq_len={seq_len} exceeds the model's limit (max_position_embeddings={limit})", f"lower --seq-len to at most {limit}")
        if cfg.data is None:
            return TaskStream(TASKS[cfg.task], cfg.batch_size, cfg.seed)
        from roundpipe.cli.data import file_stream

        return file_stream(cfg.data, self.tokenizer, seq_len, cfg.pack, cfg.batch_size, cfg.seed, cfg.text_field)

    def _total_steps(self) -> int:
        cfg = self.cfg
        if cfg.steps is not None:
            return cfg.steps
        rows_per_step = cfg.batch_size * cfg.grad_accum
        epochs = cfg.epochs if cfg.epochs is not None else 1.0
        return max(1, math.ceil(epochs * self.stream.num_rows / rows_per_step))

    # ---- checkpoints -------------------------------------------------------------------------------
    def _current_weights(self, trainable_only: bool) -> Dict[str, torch.Tensor]:
        """Up-to-date weights by Hugging Face name: masters in the training dtype for trainable
        parameters (what ``synchronize`` would copy), the parameters themselves otherwise."""
        masters = self.model.masters()
        out = {}
        for name, p in self.model.hf_model.named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            m = masters.get(id(p))
            out[name] = m.detach().to(p.dtype) if m is not None else p.detach()
        if not trainable_only:
            params = dict(self.model.hf_model.named_parameters(remove_duplicate=False))
            for name, t in self.model.hf_model.state_dict().items():
                if name not in params:
                    out[name] = t  # persistent buffers
        return out

    @property
    def _weights_kind(self) -> str:
        """'trainable' when the frozen weights can be reloaded from the model directory (LoRA on a
        local model): checkpoints then stay adapter-sized."""
        return "trainable" if self.lora is not None and self.source["kind"] == "local" else "full"

    def save_checkpoint(self, loss: float) -> str:
        """Wait for the optimizer thread, then write a checkpoint (see the module docstring).

        With several ranks: call it on every rank. The replicas are identical, so rank 0 writes the
        one copy (with every rank's RNG state); the others wait until it is complete, and a failed
        write stops every rank.
        """
        from roundpipe.optim import thread as optim_thread

        optim_thread.synchronize()
        self._flush_rows()
        cfg = self.cfg
        rngs = parallel.gather_to_main(rng_state(), f"checkpoint of step {self.step}") if self.env.distributed else None

        def write(d: str) -> None:
            os.makedirs(os.path.join(d, "optim"))
            with open(os.path.join(d, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            with open(os.path.join(d, "source.json"), "w") as f:
                json.dump({**self.source, "weights": self._weights_kind, "dtype": str(self.dtype).replace("torch.", "")}, f, indent=1)
            hf_dir = os.path.join(d, "hf")
            self.model.rp.preset.model.config.save_pretrained(hf_dir)
            self.tokenizer.save_pretrained(hf_dir)
            if self.lora is not None:
                self.model.hf_model.peft_config["default"].save_pretrained(os.path.join(d, "lora"))
            ckpt.save_tensors(self._current_weights(self._weights_kind == "trainable"), os.path.join(d, "model.safetensors"), {"format": "pt"})
            named = [(n, p) for n, p in self.model.hf_model.named_parameters() if p.requires_grad]
            ckpt.save_tensors({n: p for n, p in named}, os.path.join(d, "optim", "device.safetensors"))
            ckpt.save_tensors(dict(self.master_named), os.path.join(d, "optim", "master.safetensors"))
            ckpt.save_torch(self.optimizer.state_dict(), os.path.join(d, "optim", "state.pt"))
            trainer = {
                "step": self.step,
                "total_steps": self.total_steps,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "data": self.stream.state_dict(),
                "rng": rng_state(),
                **({"rng_by_rank": rngs} if rngs is not None else {}),
                "tokens_seen": self.tokens_seen,
                "elapsed": self.elapsed_before + (time.time() - self.t_start),
            }
            ckpt.save_torch(trainer, os.path.join(d, "trainer.pt"))

        step = self.step
        path = parallel.on_main(lambda: ckpt.save_checkpoint(cfg.output_dir, step, write, cfg.keep_checkpoints, {"loss": loss}), f"the checkpoint of step {step}")
        self.last_checkpoint = path
        return path

    def _load_checkpoint(self, path: str) -> None:
        from roundpipe.cli.checkpoint import load_tensors, load_torch

        self._master_sha = str(ckpt.verify_checkpoint(path)["files"]["optim/master.safetensors"]["sha256"])  # type: ignore[index]
        device_w = load_tensors(os.path.join(path, "optim", "device.safetensors"))
        master_w = load_tensors(os.path.join(path, "optim", "master.safetensors"))
        named = [(n, p) for n, p in self.model.hf_model.named_parameters() if p.requires_grad]
        if set(device_w) != {n for n, _ in named}:
            raise ConfigError(f"checkpoint {path} was saved for other trainable parameters (different model or LoRA settings)", "resume with the config the checkpoint was trained with")
        full = load_tensors(os.path.join(path, "model.safetensors"))
        with torch.no_grad():
            params = dict(self.model.hf_model.named_parameters())
            for name, t in full.items():  # frozen weights (and buffers) of full checkpoints
                if name in params and not params[name].requires_grad:
                    params[name].copy_(t)
            for name, p in named:
                p.copy_(device_w[name])
            for name, m in self.master_named:
                m.copy_(master_w[name])
        self.optimizer.load_state_dict(load_torch(os.path.join(path, "optim", "state.pt")))
        trainer = load_torch(os.path.join(path, "trainer.pt"))
        self.scheduler.load_state_dict(trainer["scheduler"])
        # The schedule is a function of the config and the step: keep this run's (steps, lr and warmup
        # may have been changed on resume), and only the step count from the checkpoint.
        self.scheduler.lr_lambdas = [WarmupCosine(self.warmup_steps, self.total_steps, self.cfg.min_lr_ratio) for _ in self.optimizer.param_groups]
        self.scheduler.base_lrs = [self.cfg.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.cfg.lr
            group["lr"] = self.cfg.lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.scaler is not None and trainer.get("scaler") is not None:
            self.scaler.load_state_dict(trainer["scaler"])
        self.stream.load_state_dict(trainer["data"])  # the global data position: the same on every rank
        by_rank = trainer.get("rng_by_rank")
        same_layout = isinstance(by_rank, list) and len(by_rank) == self.env.world_size
        set_rng_state(by_rank[self.env.rank] if same_layout else trainer["rng"])  # type: ignore[index]
        self.step = int(trainer["step"])
        self.tokens_seen = int(trainer["tokens_seen"])
        self.elapsed_before = float(trainer["elapsed"])
        if self.step >= self.total_steps:
            raise ConfigError(f"checkpoint {path} is at step {self.step}, the end of a {self.total_steps}-step run", "raise --steps to train further")

    # ---- training ----------------------------------------------------------------------------------
    def _step_fn(self, step: int) -> None:
        """Optimizer-thread body of one step: clip the host gradients' global norm, step, schedule."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.optim_params, max_norm)
        self.grad_norms[step] = float(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self) -> Tuple[float, int]:
        """One optimizer step (see the module docstring); returns its loss and its token count (both
        of the global batch: every rank returns the same)."""
        from roundpipe.models.loss import count_loss_tokens

        batches = [self.stream.next_batch() for _ in range(self.cfg.grad_accum)]  # global: the same on every rank
        counted = sum(count_loss_tokens(labels) for _, labels in batches)
        if counted == 0:
            raise ConfigError(f"step {self.step + 1} has no trained token", "check the data's loss masks (seq_len may cut off the responses)")
        scale = self.scaler.scale if self.scaler is not None else (lambda t: t)

        def local_loss() -> float:
            """Forward and backward of this rank's rows, each batch weighted by its share of the
            global token count: the ranks' losses (and gradients) add up to the one-process ones."""
            loss = torch.zeros(())
            for ids, labels in batches:
                if self.env.distributed:
                    ids, labels = rdist.shard((ids, labels))
                    if ids.shape[0] == 0:
                        continue  # no rows here (batch_size < ranks): no call; the step still reduces
                n = count_loss_tokens(labels)
                loss += self.model.forward_backward(ids, labels, n / counted, scale, self.microbatches).detach().float()
            if self.scaler is not None:
                loss /= self.scaler.get_scale()
            return float(loss)

        if self.env.distributed:
            # One collective: the global loss, whether any rank saw Ctrl-C, and whether any rank failed.
            value, stops = parallel.sum_over_ranks(lambda: [local_loss(), float(self._stop_requested)], 2, f"step {self.step + 1}")
            self._stop_now = stops > 0
        else:
            value = local_loss()
            self._stop_now = self._stop_requested
        # Checked before the step, so non-finite gradients never reach the optimizer (with a
        # GradScaler the scaler skips such steps itself and backs its scale off).
        if not math.isfinite(value) and self.scaler is None:
            if self.cfg.on_nonfinite == "stop":
                raise ConfigError(f"the loss is {value} at step {self.step + 1}", "lower --lr (or --max-grad-norm), check the data, or pass --on-nonfinite skip; earlier checkpoints are intact")
            # Backward has completed and no step reads these gradients yet: dropping them is safe.
            for p in self.model.rp.model.parameters():
                p.grad = None
            self.skipped_steps += 1
            self.grad_norms[self.step + 1] = math.nan  # its metrics row has no gradient norm
            self.log(f"roundpipe: step {self.step + 1}: loss is {value}; its gradients were dropped (on_nonfinite=skip)")
        else:
            self.model.rp.step(self._step_fn, self.cfg.async_step, self.step + 1)
        if self.scaler is not None:
            self.scaler.update()
        self.step += 1
        return value, sum(ids.numel() for ids, _ in batches)

    def _flush_rows(self, force: bool = False) -> None:
        """Write pending metric rows whose gradient norm the optimizer thread has produced (rank 0;
        the other ranks only drop them)."""
        while self._pending and (force or self._pending[0]["step"] in self.grad_norms):
            row = self._pending.pop(0)
            row["grad_norm"] = self.grad_norms.pop(row["step"], None)
            if self.metrics is not None:
                self.metrics.write(row)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        self.log("roundpipe: interrupt: checkpointing after this step (Ctrl-C again to abort)")

    def train(self) -> TrainResult:
        """Train to ``stop_at`` or the last step; call it on every rank (rank 0 writes the files)."""
        cfg = self.cfg
        resumed = self.resume_from is not None
        self.metrics: Optional[MetricsWriter] = None
        if self.is_main:
            os.makedirs(cfg.output_dir, exist_ok=True)
            with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            self.metrics = MetricsWriter(cfg.output_dir, self.step if resumed else None, cfg.tensorboard)
        self._pending: List[Dict[str, Any]] = []
        self.last_checkpoint: Optional[str] = None
        n_params = sum(p.numel() for p in self.model.hf_model.parameters())
        n_train = sum(m.numel() for _, m in self.master_named)
        from roundpipe import get_num_devices

        self.log(
            f"roundpipe train: {cfg.model} ({n_params / 1e6:.2f}M params, {n_train / 1e6:.2f}M trained, {str(self.dtype).replace('torch.', '')}"
            f"{', LoRA r=%d' % cfg.lora_r if cfg.lora_r else ''}) on {get_num_devices()} device(s) [{settings.DEVICES.get() or 'default'}]"
        )
        self.log(f"data: {self.stream.describe()}")
        self.log(
            f"steps: {self.total_steps} x {cfg.grad_accum} x {cfg.batch_size} sequences x {self.stream.seq_len} tokens, "
            f"{self.microbatches} microbatches, {'async' if cfg.async_step else 'sync'} optimizer step"
            + (f"; resuming at step {self.step} from {self.resume_from}" if resumed else "")
        )
        if self.env.distributed:
            w = self.env.world_size
            low, high = cfg.batch_size // w, -(-cfg.batch_size // w)
            self.log(
                f"data parallel: {w} ranks, each trains on its rows of every batch ({low if low == high else f'{low}-{high}'} of {cfg.batch_size}); "
                "losses and tokens/s are over all ranks; rank 0 writes metrics and checkpoints"
            )
        end = self.total_steps if cfg.stop_at is None else min(cfg.stop_at, self.total_steps)
        from roundpipe.cli import progress_enabled

        bar_on = cfg.progress and progress_enabled() and self.is_main
        if bar_on:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr)
        old_handler = signal.signal(signal.SIGINT, self._on_sigint) if _main_thread() else None
        self.t_start = time.time()
        t_run = time.time()
        tokens_this_run = 0
        loss_value = math.nan
        try:
            while self.step < end:
                lr = self.scheduler.lr_lambdas[0](self.step) * cfg.lr
                loss_value, step_tokens = self._train_step()
                self.tokens_seen += step_tokens
                tokens_this_run += step_tokens
                elapsed = time.time() - t_run
                tps = tokens_this_run / max(elapsed, 1e-9)
                self._pending.append({"step": self.step, "loss": loss_value, "lr": lr, "tokens": self.tokens_seen, "tokens_per_s": tps, "elapsed_s": self.elapsed_before + elapsed})
                self._flush_rows()
                if self._bar is not None:
                    self._bar.set_postfix_str(f"loss {loss_value:.4f}, {format_rate(tps)} tok/s", refresh=False)
                    self._bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == end:
                    self.log(f"step {self.step}/{self.total_steps} | loss {loss_value:.4f} | lr {lr:.2e} | {format_rate(tps)} tok/s | {_fmt_time(self.elapsed_before + elapsed)}")
                at_save = cfg.save_every and self.step % cfg.save_every == 0
                if at_save or self.step == end or self._stop_now:
                    path = self.save_checkpoint(loss_value)
                    if self.step != end or at_save:
                        self.log(f"checkpoint: {path}")
                if self._stop_now:
                    break
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        seconds = time.time() - t_run
        self.model.rp.synchronize()
        self._flush_rows(force=True)
        if self.metrics is not None:
            self.metrics.close()
        result = TrainResult(
            step=self.step,
            total_steps=self.total_steps,
            loss=loss_value,
            tokens_per_s=tokens_this_run / max(seconds, 1e-9),
            seconds=seconds,
            output_dir=cfg.output_dir,
            checkpoint=self.last_checkpoint,
            model=self.model,
            tokenizer=self.tokenizer,
            ranks=self.env.world_size,
        )
        if cfg.data is None and cfg.eval_examples and self.step == self.total_steps:
            result.accuracy = self.evaluate()
        if self.dp is not None:
            self.dp.close()  # the returned model trains locally again (the process group ends with run)
        if self.is_main:
            self._summary(result)
        if self.step < self.total_steps and self.last_checkpoint is not None:
            why = "interrupted" if self._stop_now else "stop_at reached"
            resume_cmd = "torchrun ... -m roundpipe train" if self.env.distributed else "roundpipe train"
            self.log(f"{why} at step {self.step}/{self.total_steps}; continue with: {resume_cmd} --resume --output-dir {cfg.output_dir}")
        if self._stop_now:
            raise KeyboardInterrupt
        return result

    def evaluate(self) -> float:
        """Exact match of greedy answers on held-out problems of the built-in task.

        With several ranks each scores its contiguous share of the problems and the counts are
        summed, so every rank returns the accuracy over all of them.
        """
        task = TASKS[self.cfg.task]
        examples = held_out_examples(task, self.cfg.eval_examples)
        if not self.env.distributed:
            acc, results = exact_match(self.model.last_logits, task, examples)
            correct, total = round(acc * len(results)), len(results)
        else:
            results = []

            def local() -> List[float]:
                nonlocal results
                _, results = exact_match(self.model.last_logits, task, rdist.shard(examples))
                return [sum(want == got for _, want, got in results), len(results)]

            correct_f, total_f = parallel.sum_over_ranks(local, 2, "the held-out evaluation")
            correct, total = int(correct_f), int(total_f)
            acc = correct / max(total, 1)
        for prompt, want, got in results[:3]:
            self.log(f"  {prompt}{got:<{task.answer_len}}  {'ok' if got == want else 'expected ' + want}")
        self.log(f"held-out exact match: {acc:.1%} ({correct}/{total})")
        return acc

    def _summary(self, r: TrainResult) -> None:
        """Plot, ``summary.json`` and the closing lines (rank 0)."""
        cfg = self.cfg
        assert self.metrics is not None
        plot = plot_metrics(self.metrics.path, os.path.join(cfg.output_dir, "loss.png"))
        gpu = device_peak_memory_gib()
        summary = {
            "step": r.step,
            "total_steps": r.total_steps,
            "final_loss": r.loss,
            "tokens_per_s": r.tokens_per_s,
            "seconds": r.seconds,
            "peak_gpu_memory_gib": gpu,
            "host_peak_rss_gib": host_peak_rss_gib(),
            "accuracy": r.accuracy,
            "checkpoint": r.checkpoint,
        }
        with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        self.log(
            f"done: step {r.step}/{r.total_steps} in {_fmt_time(r.seconds)}, {format_rate(r.tokens_per_s)} tokens/s, final loss {r.loss:.4f}; "
            f"peak GPU memory {'%.2f GiB' % gpu if gpu is not None else 'n/a (CPU workers)'}, host peak RSS {summary['host_peak_rss_gib']:.2f} GiB"
        )
        files = [f"metrics {self.metrics.path}"] + ([f"plot {plot}"] if plot else []) + ([f"checkpoint {r.checkpoint}"] if r.checkpoint else [])
        if self.metrics.tensorboard_dir:
            files.append(f"tensorboard {self.metrics.tensorboard_dir}")
        self.log("wrote " + ", ".join(files))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def resume_config(cfg: TrainConfig, given: Dict[str, Any], path: Optional[str] = None) -> TrainConfig:
    """With ``--resume``, the checkpoint's config is the base and only keys given now override it
    (``stop_at`` of the interrupted run is dropped). ``path``: the checkpoint, when already resolved
    (by rank 0, for all ranks)."""
    from roundpipe.cli.config import from_yaml_text

    if path is None:
        path = ckpt.resolve_checkpoint(cfg.resume or "latest", cfg.output_dir)
    ckpt.verify_checkpoint(path)
    with open(os.path.join(path, "config.yaml")) as f:
        saved = from_yaml_text(f.read()).to_dict()
    saved["stop_at"] = None
    if rdist.current_env().local_world_size > 1 and "devices" not in given:
        saved["devices"] = None  # several ranks per host: each takes its share of the GPUs (init_from_env)
    changed = sorted(k for k, v in given.items() if k not in ("resume", "stop_at", "output_dir", "progress", "log_every", "save_every", "keep_checkpoints", "devices", "tensorboard") and saved.get(k) != getattr(cfg, k))
    if changed and rdist.is_main_process():
        logger.warning("resuming with changed %s: the run will not repeat the uninterrupted one exactly", ", ".join(changed))
    merged = merge({}, {**saved, **{k: getattr(cfg, k) for k in given}, "resume": path})
    return merged


def run(cfg: TrainConfig, given: Optional[Dict[str, Any]] = None, out: Callable[[str], None] = print) -> TrainResult:
    """Train with ``cfg``; ``given`` are the keys set explicitly (by YAML or flags), used on resume.

    Launched by torchrun with several ranks, this joins the job first (data parallel, see
    :mod:`roundpipe.cli.parallel`) and leaves it at the end, also when training fails.
    """
    env = parallel.start()
    quiet = env.distributed and not env.is_main
    old_level = logger.level
    if quiet:
        logger.setLevel(logging.WARNING)  # the ranks' INFO lines would repeat rank 0's
    failed = True
    try:
        if cfg.resume is not None:
            ref, out_dir = cfg.resume, cfg.output_dir
            # Rank 0 picks the checkpoint ('latest' could change under the others' feet); every rank
            # then reads it: it must exist at that path on every node (shared filesystem or a copy).
            path = parallel.on_main(lambda: ckpt.resolve_checkpoint(ref, out_dir), "the choice of the checkpoint to resume from")
            cfg = parallel.everywhere(lambda: resume_config(cfg, given or {}, path), f"the reading of checkpoint {path}")
        recipe = Recipe(cfg, out)
        recipe.setup()
        result = recipe.train()
        failed = False
        return result
    finally:
        if env.distributed:
            parallel.stop(failed)
        if quiet:
            logger.setLevel(old_level)


__all__ = ["BUILTIN_MODELS", "PipelineModel", "Recipe", "TrainResult", "WarmupCosine", "run"]
