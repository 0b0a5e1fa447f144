"""The run of ``roundpipe train``, once its :class:`~roundpipe.cli.train.Recipe` is set up: the
training loop (:meth:`TrainLoop.train`: start, loop, finish), one optimizer step, the non-finite checks,
the metrics rows, Ctrl-C and the held-out evaluation. The module docstring of :mod:`roundpipe.cli.train`
describes one step and the checkpoints.

A mixin of ``Recipe`` apart from its setup (devices, model, data, optimizer, checkpoints) because the
two change for different reasons: what a step computes and reports here, what a run is built from there.
The attributes below are the ones the setup provides.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from roundpipe import distributed as rdist
from roundpipe import settings
from roundpipe.cli import parallel
from roundpipe.cli.config import ConfigError, TrainConfig, to_yaml
from roundpipe.cli.metrics import MetricsWriter, format_duration, format_rate, progress_enabled, write_summary
from roundpipe.cli.optimizer import HostOptimizer
from roundpipe.cli.pipeline import PipelineModel
from roundpipe.cli.tasks import TaskStream, exact_match, held_out_examples, task_for
from roundpipe.cli.train_state import TrainResult

if TYPE_CHECKING:
    from roundpipe.cli.data import FileStream


class TrainLoop:
    """The training loop of a ``Recipe`` (see the module docstring)."""

    # Set up by Recipe (roundpipe.cli.train) before train() runs.
    cfg: TrainConfig
    env: rdist.DistEnv
    dp: Optional[rdist.DataParallel]
    model: PipelineModel
    optim: HostOptimizer
    stream: Union[TaskStream, "FileStream"]
    tokenizer: Any
    dtype: torch.dtype
    microbatches: int
    notes: List[str]
    resume_from: Optional[str]
    step: int
    total_steps: int
    skipped_steps: int
    tokens_seen: int
    elapsed_before: float
    t_start: float
    last_checkpoint: Optional[str]
    _bar: Any
    _stop_requested: bool
    _stop_now: bool
    is_main: bool
    log: Callable[[str], None]
    save_checkpoint: Callable[[float], str]

    def train(self) -> TrainResult:
        """Train to ``stop_at`` or the last step; call it on every rank (rank 0 writes the files)."""
        end = self._start()
        old_handler = signal.signal(signal.SIGINT, self._on_sigint) if _main_thread() else None
        self.t_start = time.time()
        try:
            loss_value, tokens_this_run, elapsed = self._loop(end)
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return self._finish(loss_value, tokens_this_run, elapsed)

    def _start(self) -> int:
        """Before the first step: ``config.yaml`` and the metrics writer (rank 0), the run's opening lines,
        the progress bar; returns the step the run ends at."""
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
            f"roundpipe train: {cfg.model} ({n_params / 1e6:.2f}M params, {n_train / 1e6:.2f}M trained, "
            f"{str(self.dtype).replace('torch.', '')}"
            f"{', LoRA r=%d' % cfg.lora_r if cfg.lora_r else ''}) on {get_num_devices()} device(s) "
            f"[{settings.DEVICES.get() or 'default'}]"
        )
        self.log(f"data: {self.stream.describe()}")
        self.log(
            f"steps: {self.total_steps} x {cfg.grad_accum} x {cfg.batch_size} sequences x "
            f"{self.stream.seq_len} tokens, "
            f"{self.microbatches} microbatches, {'async' if cfg.async_step else 'sync'} optimizer step"
            + (f"; resuming at step {self.step} from {self.resume_from}" if resumed else "")
        )
        for note in self.notes:
            self.log(f"note: {note}")
        if self.env.distributed:
            w = self.env.world_size
            low, high = cfg.batch_size // w, -(-cfg.batch_size // w)
            self.log(
                f"data parallel: {w} ranks, each trains on its rows of every batch "
                f"({low if low == high else f'{low}-{high}'} of {cfg.batch_size}); "
                "losses and tokens/s are over all ranks; rank 0 writes metrics and checkpoints"
            )
            shard = self.dp.step_sync if self.dp is not None else None
            if shard is not None:
                self.log(f"host optimizer step shared by the {shard.local_size} ranks of this host (--shard-optimizer)")
        elif cfg.shard_optimizer:
            self.log(
                "note: --shard-optimizer shares the step among the ranks of a host; one process has nothing to share"
            )
        end = self.total_steps if cfg.stop_at is None else min(cfg.stop_at, self.total_steps)
        bar_on = cfg.progress and progress_enabled() and self.is_main
        if bar_on:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True, file=sys.stderr
            )
        return end

    def _loop(self, end: int) -> Tuple[float, int, float]:
        """The steps up to ``end`` (fewer after Ctrl-C), with their metrics rows, progress lines and
        checkpoints; returns the last loss, the tokens of this run and its seconds at the last step."""
        cfg = self.cfg
        t_run = time.time()
        tokens_this_run, elapsed = 0, 0.0
        loss_value = math.nan
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
                    f"step {self.step}/{self.total_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                    f"{format_rate(tps)} tok/s | "
                    f"{format_duration(self.elapsed_before + elapsed)}"
                )
            at_save = cfg.save_every and self.step % cfg.save_every == 0
            if at_save or self.step == end or self._stop_now:
                path = self.save_checkpoint(loss_value)
                if self.step != end or at_save:
                    self.log(f"checkpoint: {path}")
            if self._stop_now:
                break
        return loss_value, tokens_this_run, elapsed

    def _finish(self, loss_value: float, tokens_this_run: int, elapsed: float) -> TrainResult:
        """After the last step: wait for the optimizer, the last metrics rows, the held-out evaluation,
        the summary (rank 0) and how to continue an interrupted run."""
        cfg = self.cfg
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
            self.log(
                f"{why} at step {self.step}/{self.total_steps}; continue with: {resume_cmd} --resume "
                f"--output-dir {cfg.output_dir}"
            )
        if self._stop_now:
            raise KeyboardInterrupt
        return result

    def _train_step(self) -> Tuple[float, int]:
        """One optimizer step (see the module docstring); returns its loss and its token count (both
        of the global batch: every rank returns the same)."""
        from roundpipe.models.loss import count_loss_tokens

        batches = [self.stream.next_batch() for _ in range(self.cfg.grad_accum)]  # global: the same on every rank
        counted = sum(count_loss_tokens(labels) for _, labels in batches)
        if counted == 0:
            raise ConfigError(
                f"step {self.step + 1} has no trained token",
                "check the data's loss masks (seq_len may cut off the responses)",
            )
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
            value, stops = parallel.sum_over_ranks(
                lambda: [local_loss(), float(self._stop_requested)], 2, f"step {self.step + 1}"
            )
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
                    "lower --lr (or --max-grad-norm), check the data, or pass --on-nonfinite skip; earlier "
                    "checkpoints are intact",
                )
            # Backward has completed and no step reads these gradients yet: dropping them is safe.
            for p in self.model.rp.model.parameters():
                p.grad = None
            self.skipped_steps += 1
            self.optim.grad_norms[self.step + 1] = math.nan  # its metrics row has no gradient norm
            self.log(
                f"roundpipe: step {self.step + 1}: loss is {value}; its gradients were dropped (on_nonfinite=skip)"
            )
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
                    "lower --lr, check the data, or pass --on-nonfinite skip; the step was not applied and "
                    "earlier checkpoints are intact",
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


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
