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

Data parallel (launched by ``torchrun`` with several ranks, see :mod:`roundpipe.cli.parallel`): every
rank draws the same global batches (same seed) and trains on its contiguous share of their rows; a
rank's loss is its tokens' loss sum over the token count of the *global* step, and the ranks'
gradients are summed (:func:`roundpipe.distributed.enable_data_parallel` with ``op="sum"``), so every
rank takes the one-process step on the whole batch. Rank 0 alone prints, writes metrics and checkpoints; all ranks resume from the same checkpoint.

Before the model loads, the output directory is checked (:mod:`roundpipe.cli.run_dir`): writable, and
not holding an earlier run unless ``--resume`` continues it or ``--overwrite`` replaces it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from roundpipe import distributed as rdist
from roundpipe import settings
from roundpipe.cli import checkpoint as ckpt
from roundpipe.cli import parallel
from roundpipe.cli.config import ConfigError, TrainConfig, to_yaml
from roundpipe.cli.metrics import MetricsWriter, format_duration, format_rate, progress_enabled, write_summary
from roundpipe.cli.model_loading import apply_lora, build_model, load_model_config, load_tokenizer, lora_config, model_source, resolve_dtype
from roundpipe.cli.optimizer import HostOptimizer
from roundpipe.cli.pipeline import PipelineModel
from roundpipe.cli.run_dir import check_flags, check_output_dir, clear_earlier_run
from roundpipe.cli.tasks import TaskStream, exact_match, held_out_examples, task_for
from roundpipe.cli.train_state import Progress, TrainResult, read_payload, resume_config, rng_state, write_payload

if TYPE_CHECKING:
    from roundpipe.cli.data import FileStream

logger = logging.getLogger("roundpipe")


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
            self.dp = rdist.enable_data_parallel(self.model.rp, op="sum", shard_optimizer=self.cfg.shard_optimizer)
            w = self.env.world_size
            if self.cfg.batch_size < w and getattr(self.dp, "reduce_on", "host") == "device":
                raise ConfigError(
                    f"batch_size={self.cfg.batch_size} leaves some of the {w} ranks without rows, and gradients reduced on the devices need every rank "
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
                (os.path.basename(os.path.normpath(path)), self.step, self._master_sha), "the resumed checkpoint (name, step, sha256 of its master weights)"
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
        self.dtype = resolve_dtype(cfg, self.model_config)
        self.tokenizer = load_tokenizer(self.source, cfg)
        self.stream = self._data(self.model_config)
        vocab = getattr(self.model_config, "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ConfigError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {vocab}", "use the model's own tokenizer")
        self.total_steps = self._total_steps()
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * self.total_steps)
        self.notes: List[str] = []  # logged when training starts
        if self.warmup_steps >= self.total_steps:
            # Warmup reaches the peak learning rate at step warmup + 1: never, in a shorter run.
            capped = self.total_steps - 1
            self.notes.append(
                f"warmup_steps={self.warmup_steps} is not shorter than the run ({self.total_steps} steps): capped at {capped}, so the learning rate "
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
        hf_model = build_model(self.source, self.model_config, self.dtype)
        if cfg.lora_r:
            hf_model = apply_lora(hf_model, lora_config(cfg))
        if cfg.master == "bfloat16" and self.dtype != torch.bfloat16:
            raise ConfigError(f"master=bfloat16 steps the bf16 weights themselves, but this model trains in {self.dtype}", "add --dtype bfloat16")
        self.model = PipelineModel(hf_model, self.microbatches, cfg.plan, master_dtype=None if cfg.master == "bfloat16" else torch.float32)
        if not self.model.trainable_named():
            raise ConfigError("the model has no trainable parameters", "check --lora-targets")
        clip_params = list(self.model.rp.optim_parameters())  # creates the fp32 masters
        masters = [m for _, m in self.model.master_named()]  # by Hugging Face name
        self.optim = HostOptimizer(masters, clip_params, cfg, self.total_steps, self.warmup_steps, float16=self.dtype == torch.float16)
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
            roundpipe.configure(devices=spec, compile=compile_)
            roundpipe.get_num_devices()  # starts the workers; reads RPP_DEVICES when --devices is not given
        except (ValueError, RuntimeError) as exc:
            where = f"--devices {spec}" if spec is not None else f"RPP_DEVICES={settings.DEVICES.get()}"
            if _uses_gpus(spec) and not torch.cuda.is_available():
                raise ConfigError(
                    f"{where} asks for GPUs, but torch.cuda.is_available() is False (a CPU build of torch, or no GPU visible)",
                    "train on CPU workers with --devices cpu:N"
                    + ("" if spec is not None else " (or RPP_DEVICES=cpu:N)")
                    + ", or install a CUDA build of torch",
                ) from None
            detail = str(exc).split(";")[0].split(": ", 1)[-1].split(", e.g.")[0]  # the core's message names RPP_DEVICES
            raise ConfigError(f"{where} is not a device list ({detail})", "use --devices cuda, cuda:0,1 or cpu:N") from None

    def _data(self, model_config: Any) -> Union[TaskStream, "FileStream"]:
        """The batch stream; the sequence length is checked against the model before any tokenizing."""
        cfg = self.cfg
        limit = getattr(model_config, "max_position_embeddings", None)
        if cfg.data is None:
            try:
                task = task_for(cfg.task, cfg.seq_len)
            except ValueError as exc:
                raise ConfigError(str(exc), "drop --seq-len, use --task recall (any length), or train on a --data file") from None
            seq_len = task.seq_len
            if self.source.get("kind") == "builtin" and limit is not None and seq_len > limit:
                # A built-in model is trained from scratch: its rotary tables reach as far as asked.
                model_config.max_position_embeddings = limit = seq_len
        else:
            seq_len = cfg.seq_len or min(512, limit or 512)
        if limit is not None and seq_len > limit:
            raise ConfigError(f"seq_len={seq_len} exceeds the model's limit (max_position_embeddings={limit})", f"lower --seq-len to at most {limit}")
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
        progress = Progress(self.step, self.total_steps, self.tokens_seen, self.elapsed_before + (time.time() - self.t_start))
        # With a sharded step each rank holds its layers' moments: gathered onto rank 0 (every rank takes part).
        state = self.dp.full_optimizer_state_dict(self.optim.optimizer) if self.dp is not None else None

        def write(d: str) -> None:
            write_payload(d, cfg, self.source, self.dtype, self.model, self.tokenizer, self.optim, self.stream, progress, rngs, state)

        step = self.step
        path = parallel.on_main(
            lambda: ckpt.save_checkpoint(cfg.output_dir, step, write, cfg.keep_checkpoints, {"loss": loss}), f"the checkpoint of step {step}"
        )
        self.last_checkpoint = path
        return path

    def _load_checkpoint(self, path: str) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, schedule, data position, RNGs."""
        self._master_sha = str(ckpt.verify_checkpoint(path)["files"]["optim/master.safetensors"]["sha256"])  # type: ignore[index]
        progress = read_payload(path, self.model, self.optim, self.stream, self.env.rank, self.env.world_size, self.total_steps)
        self.step, self.tokens_seen, self.elapsed_before = progress.step, progress.tokens_seen, progress.elapsed

    # ---- training ----------------------------------------------------------------------------------
    def _train_step(self) -> Tuple[float, int]:
        """One optimizer step (see the module docstring); returns its loss and its token count (both
        of the global batch: every rank returns the same)."""
        from roundpipe.models.loss import count_loss_tokens

        batches = [self.stream.next_batch() for _ in range(self.cfg.grad_accum)]  # global: the same on every rank
        counted = sum(count_loss_tokens(labels) for _, labels in batches)
        if counted == 0:
            raise ConfigError(f"step {self.step + 1} has no trained token", "check the data's loss masks (seq_len may cut off the responses)")
        scaler = self.optim.scaler
        scale = self.optim.scale

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
            if scaler is not None:
                loss /= scaler.get_scale()
            return float(loss)

        if self.env.distributed:
            # One collective: the global loss, whether any rank saw Ctrl-C, and whether any rank failed.
            value, stops = parallel.sum_over_ranks(lambda: [local_loss(), float(self._stop_requested)], 2, f"step {self.step + 1}")
            self._stop_now = stops > 0
        else:
            value = local_loss()
            self._stop_now = self._stop_requested
        # Iteration s computes at the weights after step s-2 (async) or s-1 (sync), so those steps are
        # complete now: the same point of the run on every rank, whatever the thread timing.
        self._check_gradients(self.step - 1 if self.cfg.async_step else self.step)
        # Checked before the step, so non-finite gradients never reach the optimizer (with a
        # GradScaler the scaler skips such steps itself and backs its scale off).
        if not math.isfinite(value) and scaler is None:
            if self.cfg.on_nonfinite == "stop":
                raise ConfigError(
                    f"the loss is {value} at step {self.step + 1}",
                    "lower --lr (or --max-grad-norm), check the data, or pass --on-nonfinite skip; earlier checkpoints are intact",
                )
            # Backward has completed and no step reads these gradients yet: dropping them is safe.
            for p in self.model.rp.model.parameters():
                p.grad = None
            self.skipped_steps += 1
            self.optim.grad_norms[self.step + 1] = math.nan  # its metrics row has no gradient norm
            self.log(f"roundpipe: step {self.step + 1}: loss is {value}; its gradients were dropped (on_nonfinite=skip)")
        else:
            self.model.rp.step(self.optim.step_fn, self.cfg.async_step, self.step + 1)
        if scaler is not None:
            scaler.update()
        self.step += 1
        return value, sum(ids.numel() for ids, _ in batches)

    def _check_gradients(self, upto: int) -> None:
        """Act on the steps up to ``upto`` whose gradient norm was not finite (the optimizer thread
        dropped their gradients): stop the run at the first, or log them as skipped (on_nonfinite)."""
        for step in sorted(s for s in list(self.optim.nonfinite) if s <= upto):
            norm = self.optim.nonfinite.pop(step)
            if self.cfg.on_nonfinite == "stop":
                raise ConfigError(
                    f"the gradient norm is {norm} at step {step} (the loss was finite)",
                    "lower --lr, check the data, or pass --on-nonfinite skip; the step was not applied and earlier checkpoints are intact",
                )
            self.skipped_steps += 1
            self.log(f"roundpipe: step {step}: gradient norm is {norm}; its gradients were dropped (on_nonfinite=skip)")

    def _flush_rows(self, force: bool = False) -> None:
        """Write pending metric rows whose gradient norm the optimizer thread has produced (rank 0;
        the other ranks only drop them)."""
        while self._pending and (force or self._pending[0]["step"] in self.optim.grad_norms):
            row = self._pending.pop(0)
            row["grad_norm"] = self.optim.grad_norms.pop(row["step"], None)
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
                f.write(to_yaml(cfg, saved=True))
            self.metrics = MetricsWriter(cfg.output_dir, self.step if resumed else None, cfg.tensorboard)
        self._pending: List[Dict[str, Any]] = []
        self.last_checkpoint: Optional[str] = None
        n_params = sum(p.numel() for p in self.model.hf_model.parameters())
        n_train = sum(m.numel() for _, m in self.model.master_named())
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
        for note in self.notes:
            self.log(f"note: {note}")
        if self.env.distributed:
            w = self.env.world_size
            low, high = cfg.batch_size // w, -(-cfg.batch_size // w)
            self.log(
                f"data parallel: {w} ranks, each trains on its rows of every batch ({low if low == high else f'{low}-{high}'} of {cfg.batch_size}); "
                "losses and tokens/s are over all ranks; rank 0 writes metrics and checkpoints"
            )
            shard = self.dp.step_sync if self.dp is not None else None
            if shard is not None:
                self.log(f"host optimizer step shared by the {shard.local_size} ranks of this host (--shard-optimizer)")
        elif cfg.shard_optimizer:
            self.log("note: --shard-optimizer shares the step among the ranks of a host; one process has nothing to share")
        end = self.total_steps if cfg.stop_at is None else min(cfg.stop_at, self.total_steps)
        bar_on = cfg.progress and progress_enabled() and self.is_main
        if bar_on:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr)
        old_handler = signal.signal(signal.SIGINT, self._on_sigint) if _main_thread() else None
        self.t_start = time.time()
        t_run = time.time()
        tokens_this_run, elapsed = 0, 0.0
        loss_value = math.nan
        try:
            while self.step < end:
                lr = self.optim.lr_at(self.step)
                loss_value, step_tokens = self._train_step()
                self.tokens_seen += step_tokens
                tokens_this_run += step_tokens
                elapsed = time.time() - t_run
                tps = tokens_this_run / max(elapsed, 1e-9)
                self._pending.append(
                    {
                        "step": self.step,
                        "loss": loss_value,
                        "lr": lr,
                        "tokens": self.tokens_seen,
                        "tokens_per_s": tps,
                        "elapsed_s": self.elapsed_before + elapsed,
                    }
                )
                self._flush_rows()
                if self._bar is not None:
                    self._bar.set_postfix_str(f"loss {loss_value:.4f}, {format_rate(tps)} tok/s", refresh=False)
                    self._bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == end:
                    self.log(
                        f"step {self.step}/{self.total_steps} | loss {loss_value:.4f} | lr {lr:.2e} | {format_rate(tps)} tok/s | "
                        f"{format_duration(self.elapsed_before + elapsed)}"
                    )
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
        seconds = elapsed  # at the last step, as its progress line (the done line agrees with it): saves aside
        self.model.rp.synchronize()
        self._check_gradients(self.step)
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
            assert self.metrics is not None
            summary = {
                "step": result.step,
                "total_steps": result.total_steps,
                "final_loss": result.loss,
                "tokens_per_s": result.tokens_per_s,
                "seconds": result.seconds,
                "elapsed_s": self.elapsed_before + result.seconds,  # the progress lines' time: resumed parts included
                "accuracy": result.accuracy,
                "checkpoint": result.checkpoint,
            }
            for line in write_summary(cfg.output_dir, self.metrics, summary):
                self.log(line)
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
        task = task_for(self.cfg.task, self.cfg.seq_len)
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


def _uses_gpus(spec: Optional[str]) -> bool:
    """Whether device spec ``spec`` (None: ``RPP_DEVICES``, whose default is all GPUs when there are
    any) selects GPUs rather than CPU workers."""
    chosen = (spec if spec is not None else settings.DEVICES.get()).strip().lower()
    if not chosen:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    return chosen.startswith("cuda")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def run(cfg: TrainConfig, given: Optional[Dict[str, Any]] = None, out: Callable[[str], None] = print, overwrite: bool = False) -> TrainResult:
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
            path = parallel.on_main(lambda: ckpt.resolve_checkpoint(ref, out_dir), "the choice of the checkpoint to resume from")
            cfg = parallel.everywhere(lambda: resume_config(cfg, given or {}, path), f"the reading of checkpoint {path}")
        checked = cfg  # before the model loads: a mistake here should not cost its loading time
        parallel.on_main(lambda: check_output_dir(checked.output_dir, checked.resume is not None, overwrite), "the check of output_dir")
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
