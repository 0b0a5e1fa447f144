"""The ``roundpipe train`` recipe: model + data + RoundPipe + host optimizer, with metrics and checkpoints.

One optimizer step:

1. draw ``grad_accum`` batches; count the tokens their losses average over;
2. for each, ``forward_backward`` over the batch's microbatches (each microbatch's loss is its token
   loss sum over the token count of the *whole step*, so accumulation gives the exact mean);
3. ``model.step(step_fn)``: on the optimizer thread, the host gradients of the fp32 masters are
   clipped to ``max_grad_norm`` (global norm), then optimizer, LR scheduler and ``zero_grad``.

With ``async_step`` (the default) step 3 returns at once and the optimizer overlaps the next step's
compute; that step then computes at weights one step old (see ``RoundPipeBase.step``).

A non-finite loss is caught before its step, a non-finite gradient norm on the optimizer thread (its
step is not applied); ``on_nonfinite`` then stops the run with one error line or skips the step.

Checkpoints do not perturb training: they wait for the optimizer thread and save the fp32 masters,
the optimizer state *and* the weights the devices currently compute with (in async mode the previous
step's), so a resumed run repeats the uninterrupted run's computation bit for bit on CPU workers,
whether or not the uninterrupted run checkpointed at that step. ``model.safetensors`` holds the
up-to-date weights (masters in the training dtype), which is what ``roundpipe export`` writes out.

Data parallel (launched by ``torchrun`` with several ranks, see :mod:`roundpipe.cli.parallel`): every rank draws the
same global batches (same seed) and trains on its contiguous share of their rows; a rank's loss is its tokens' loss sum
over the token count of the *global* step, and the ranks' gradients are summed
(:func:`roundpipe.distributed.enable_data_parallel` with ``op="sum"``), so every rank takes the one-process step on the
whole batch. Rank 0 alone prints, writes metrics and checkpoints; all ranks resume from the same checkpoint.

Before the model loads, the output directory is checked (:mod:`roundpipe.cli.run_dir`): writable, and
not holding an earlier run unless ``--resume`` continues it or ``--overwrite`` replaces it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Union

import torch

from roundpipe import distributed as rdist
from roundpipe import rope_scaling, settings
from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli import parallel
from roundpipe.cli.config import ConfigError, TrainConfig
from roundpipe.cli.memory_caps import CAPS, cap_problem, memory_caps
from roundpipe.cli.model_loading import (
    build_model,
    load_model_config,
    load_tokenizer,
    lora_config,
    model_source,
    resolve_dtype,
)
from roundpipe.cli.optimizer import HostOptimizer
from roundpipe.cli.pipeline import PipelineModel
from roundpipe.cli.run_dir import check_flags, check_output_dir, clear_earlier_run
from roundpipe.cli.tasks import TaskStream, task_for
from roundpipe.cli.train_loop import TrainLoop
from roundpipe.cli.train_state import Progress, TrainResult, read_payload, resume_config, rng_state, write_payload

if TYPE_CHECKING:
    from roundpipe.cli.data import FileStream

logger = logging.getLogger("roundpipe")


class Recipe(TrainLoop):
    """Set up from a :class:`TrainConfig`, then :meth:`train` (the loop: :mod:`roundpipe.cli.train_loop`)."""

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
            self.dp = rdist.enable_data_parallel(self.model.rp, op="sum", shard_optimizer=self.cfg.shard_optimizer)
            w = self.env.world_size
            if self.cfg.batch_size < w and getattr(self.dp, "reduce_on", "host") == "device":
                raise ConfigError(
                    f"batch_size={self.cfg.batch_size} leaves some of the {w} ranks without rows, and "
                    "gradients reduced on the devices need every rank "
                    "in every call",
                    f"raise batch_size to at least {w}",
                )
            # The same microbatch count on every rank (the reduction on the devices needs the same jobs
            # everywhere): at most the smallest share of a batch.
            self.microbatches = max(1, min(self.microbatches, self.cfg.batch_size // w))
        if self.resume_from is not None:
            path = self.resume_from
            parallel.everywhere(lambda: self._load_checkpoint(path), f"the loading of checkpoint {path}")
            rdist.assert_same_across_ranks(
                (os.path.basename(os.path.normpath(path)), self.step, self._master_sha),
                "the resumed checkpoint (name, step, sha256 of its master weights)",
            )

    def _plan(self) -> None:
        """Devices, model source and config, tokenizer, data, and the numbers a run derives from them
        (microbatches, sequence length, steps, warmup): everything but the model and the optimizer.
        ``--print-config`` stops here (:func:`resolved_config`)."""
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
        self.model_config = load_model_config(self.source)
        if cfg.rope_scaling is not None:  # before the weights load with it, so checkpoints and exports carry it
            rope_scaling.with_rope_scaling(self.model_config, cfg.rope_scaling)
        self.dtype = resolve_dtype(cfg, self.model_config)
        self.tokenizer = load_tokenizer(self.source, cfg)
        self.stream = self._data(self.model_config)
        vocab = getattr(self.model_config, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ConfigError(
                f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {vocab}",
                "use the model's own tokenizer",
            )
        self.total_steps = self._total_steps()
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * self.total_steps)
        self.notes: List[str] = []  # logged when training starts
        if self.warmup_steps >= self.total_steps:
            # Warmup reaches the peak learning rate at step warmup + 1: never, in a shorter run.
            capped = self.total_steps - 1
            self.notes.append(
                f"warmup_steps={self.warmup_steps} is not shorter than the run ({self.total_steps} steps): "
                f"capped at {capped}, so the learning rate "
                "reaches its peak at the last step"
            )
            self.warmup_steps = capped

    def resolved(self) -> TrainConfig:
        """The config with the values :meth:`_plan` derived in place of the unset ones (steps stays
        unset when ``epochs`` gives the length: both together are an error)."""
        cfg = self.cfg
        return dataclasses.replace(
            cfg,
            microbatches=self.microbatches,
            seq_len=self.stream.seq_len,
            steps=self.total_steps if cfg.epochs is None else cfg.steps,
            warmup_steps=self.warmup_steps,
        )

    def _build(self) -> None:
        """Model, data, optimizer and schedule: this process's work alone (no collectives)."""
        cfg = self.cfg
        self._plan()
        if cfg.fp8:
            from roundpipe.models import fp8

            try:
                fp8.check_hardware()
            except ValueError as exc:
                raise ConfigError(str(exc).split(";")[0], "drop --fp8 to train in bf16") from None
        hf_model = build_model(self.source, self.model_config, self.dtype, lora_config(cfg) if cfg.lora_r else None)
        if cfg.master == "bfloat16" and self.dtype != torch.bfloat16:
            raise ConfigError(
                f"master=bfloat16 steps the bf16 weights themselves, but this model trains in {self.dtype}",
                "add --dtype bfloat16",
            )
        self.model = PipelineModel(
            hf_model,
            self.microbatches,
            cfg.plan,
            master_dtype=None if cfg.master == "bfloat16" else torch.float32,
            stage_inputs=cfg.stage_inputs,
            base_format=cfg.base_format,
            fp8=cfg.fp8,
        )
        if not self.model.trainable_named():
            raise ConfigError("the model has no trainable parameters", "check --lora-targets")
        clip_params = list(self.model.rp.optim_parameters())  # creates the fp32 masters
        masters = [m for _, m in self.model.master_named()]  # by Hugging Face name
        self.optim = HostOptimizer(
            masters, clip_params, cfg, self.total_steps, self.warmup_steps, float16=self.dtype == torch.float16
        )
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.elapsed_before = 0.0
        self._master_sha: Optional[str] = None

    def _set_devices(self) -> None:
        """Choose this process's devices and torch.compile switch (``roundpipe.configure``)."""
        import roundpipe

        spec = self.cfg.devices
        if spec is not None and spec.strip().startswith("cuda") and self.env.local_world_size > 1:
            raise ConfigError(
                f"devices={spec} would make the {self.env.local_world_size} ranks on this host share those GPUs",
                "drop --devices (each rank then gets its share of the host's GPUs) or launch one rank per host",
            )
        compile_ = self.cfg.compile
        if compile_ is None and not settings.DISABLE_TORCH_COMPILE.is_set():  # auto: compile for GPUs only
            compile_ = _uses_gpus(spec)
        try:
            # The caps first: the workers read them as they start (--gpu-memory wins over RPP_GPU_MEMORY).
            roundpipe.configure(devices=spec, compile=compile_, **memory_caps(self.cfg))
            if self.cfg.seq_tile is not None:  # --seq-tile wins over RPP_SEQ_TILE, as the caps do
                roundpipe.configure(seq_tile=self.cfg.seq_tile)
            roundpipe.get_num_devices()  # starts the workers; reads RPP_DEVICES when --devices is not given
        except (ValueError, RuntimeError) as exc:
            if str(exc).startswith(CAPS["gpu_memory"] + "="):
                raise ConfigError(*cap_problem(self.cfg, exc)) from None
            where = f"--devices {spec}" if spec is not None else f"RPP_DEVICES={settings.DEVICES.get()}"
            if _uses_gpus(spec) and not torch.cuda.is_available():
                raise ConfigError(
                    f"{where} asks for GPUs, but torch.cuda.is_available() is False (a CPU build of torch, or "
                    "no GPU visible)",
                    "train on CPU workers with --devices cpu:N"
                    + ("" if spec is not None else " (or RPP_DEVICES=cpu:N)")
                    + ", or install a CUDA build of torch",
                ) from None
            # the core's message names RPP_DEVICES
            detail = str(exc).split(";")[0].split(": ", 1)[-1].split(", e.g.")[0]
            raise ConfigError(
                f"{where} is not a device list ({detail})", "use --devices cuda, cuda:0,1 or cpu:N"
            ) from None

    def _data(self, model_config: Any) -> Union[TaskStream, "FileStream"]:
        """The batch stream; the sequence length is checked against the model before any tokenizing."""
        cfg = self.cfg
        limit = rope_scaling.position_limit(model_config)
        if cfg.data is None:
            try:
                task = task_for(cfg.task, cfg.seq_len)
            except ValueError as exc:
                raise ConfigError(
                    str(exc), "drop --seq-len, use --task recall (any length), or train on a --data file"
                ) from None
            seq_len = task.seq_len
            if self.source.get("kind") == "builtin" and limit is not None and seq_len > limit:
                # A built-in model is trained from scratch: its rotary tables reach as far as asked.
                model_config.max_position_embeddings = seq_len
        else:
            seq_len = cfg.seq_len or min(512, limit or 512)
        try:
            rope_scaling.check_length(model_config, seq_len)
        except rope_scaling.SequenceTooLong as exc:
            raise ConfigError(exc.what, exc.fix) from None
        if cfg.data is None:
            return TaskStream(task, cfg.batch_size, cfg.seed)
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
    def save_checkpoint(self, loss: float) -> str:
        """Wait for the optimizer thread, then write a checkpoint (see the module docstring).

        With several ranks: call it on every rank. The replicas are identical, so rank 0 writes the
        one copy (with every rank's RNG state); the others wait until it is complete, and a failed
        write stops every rank.
        """
        self.model.wait_for_step()
        self._check_gradients(self.step)
        self._flush_rows()
        cfg = self.cfg
        rngs = parallel.gather_to_main(rng_state(), f"checkpoint of step {self.step}") if self.env.distributed else None
        progress = Progress(
            self.step, self.total_steps, self.tokens_seen, self.elapsed_before + (time.time() - self.t_start)
        )
        # With a sharded step each rank holds its layers' moments: gathered onto rank 0 (every rank takes part).
        state = self.dp.full_optimizer_state_dict(self.optim.optimizer) if self.dp is not None else None

        def write(d: str) -> None:
            write_payload(
                d,
                cfg,
                self.source,
                self.dtype,
                self.model,
                self.tokenizer,
                self.optim,
                self.stream,
                progress,
                rngs,
                state,
            )

        step = self.step
        path = parallel.on_main(
            lambda: ckpt.save_checkpoint(cfg.output_dir, step, write, cfg.keep_checkpoints, {"loss": loss}),
            f"the checkpoint of step {step}",
        )
        self.last_checkpoint = path
        return path

    def _load_checkpoint(self, path: str) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, schedule, data position, RNGs."""
        files = ckpt.verify_checkpoint(path)["files"]
        self._master_sha = str(files["optim/master.safetensors"]["sha256"])  # type: ignore[index]
        progress = read_payload(
            path, self.model, self.optim, self.stream, self.env.rank, self.env.world_size, self.total_steps
        )
        self.step, self.tokens_seen, self.elapsed_before = progress.step, progress.tokens_seen, progress.elapsed


def _uses_gpus(spec: Optional[str]) -> bool:
    """Whether device spec ``spec`` (None: ``RPP_DEVICES``, whose default is all GPUs when there are
    any) selects GPUs rather than CPU workers."""
    chosen = (spec if spec is not None else settings.DEVICES.get()).strip().lower()
    if not chosen:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    return chosen.startswith("cuda")


def run(
    cfg: TrainConfig,
    given: Optional[Dict[str, Any]] = None,
    out: Callable[[str], None] = print,
    overwrite: bool = False,
) -> TrainResult:
    """Train with ``cfg``; ``given`` are the keys set explicitly (by YAML or flags), used on resume.
    ``overwrite``: delete an earlier run's files in ``output_dir`` first (without it, and without
    ``resume``, such a directory is refused, see :mod:`roundpipe.cli.run_dir`).

    Launched by torchrun with several ranks, this joins the job first (data parallel, see
    :mod:`roundpipe.cli.parallel`) and leaves it at the end, also when training fails.
    """
    check_flags(cfg, overwrite)
    env = parallel.start()
    quiet = env.distributed and not env.is_main
    old_level = logger.level
    if quiet:
        logger.setLevel(logging.WARNING)  # the ranks' INFO lines would repeat rank 0's
    failed = True
    recipe: Optional[Recipe] = None
    try:
        if cfg.resume is not None:
            ref, out_dir = cfg.resume, cfg.output_dir
            # Rank 0 picks the checkpoint ('latest' could change under the others' feet); every rank
            # then reads it: it must exist at that path on every node (shared filesystem or a copy).
            path = parallel.on_main(
                lambda: ckpt.resolve_intact(ref, out_dir, logger.warning), "the choice of the checkpoint to resume from"
            )
            cfg = parallel.everywhere(
                lambda: resume_config(cfg, given or {}, path), f"the reading of checkpoint {path}"
            )
        checked = cfg  # before the model loads: a mistake here should not cost its loading time
        parallel.on_main(
            lambda: check_output_dir(checked.output_dir, checked.resume is not None, overwrite),
            "the check of output_dir",
        )
        recipe = Recipe(cfg, out)
        recipe.setup()
        if overwrite:
            removed = parallel.on_main(lambda: clear_earlier_run(checked.output_dir), "the removal of the earlier run")
            if removed:
                recipe.log(f"--overwrite: deleted the earlier run's {', '.join(removed)} in {cfg.output_dir}")
        result = recipe.train()
        failed = False
        return result
    finally:
        if env.distributed:
            model: Optional[PipelineModel] = getattr(recipe, "model", None)  # None if setup failed before building it
            parallel.stop(failed, model.rp if model is not None else None)
        if quiet:
            logger.setLevel(old_level)


def resolved_config(cfg: TrainConfig, given: Optional[Dict[str, Any]] = None) -> TrainConfig:
    """The config a run of ``cfg`` would use, with the values it derives (sequence length, steps,
    microbatches, warmup) filled in: ``--print-config``. Reads the model config, the tokenizer and the
    data (the step count of a data file depends on it), builds no model and writes nothing."""
    if cfg.resume is not None:
        cfg = resume_config(cfg, given or {})
    recipe = Recipe(cfg, out=lambda msg: None)
    recipe._plan()
    return recipe.resolved()


__all__ = ["Recipe", "TrainResult", "resolved_config", "run"]
