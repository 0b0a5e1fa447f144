"""Run metrics: ``metrics.csv`` (always), TensorBoard (when installed), a PNG plot, the end summary, and
whether progress bars are shown.

The CSV is the source of truth: one row per optimizer step, appended and flushed as training goes, so
it survives a crash. On resume, rows after the checkpoint's step (written by the interrupted run after
its last checkpoint) are dropped, and the resumed run writes those steps again.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import resource
import sys
from typing import Any, Dict, List, Optional

import torch

from roundpipe import settings

logger = logging.getLogger("roundpipe")

COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s")


class MetricsWriter:
    """Appends per-step rows to ``metrics.csv`` and mirrors them to TensorBoard."""

    def __init__(self, output_dir: str, resume_step: Optional[int] = None, tensorboard: bool = True) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.csv")
        kept: List[Dict[str, str]] = []
        if resume_step is not None and os.path.isfile(self.path):
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= resume_step]
        self._file = open(self.path, "w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._csv.writeheader()
        self._csv.writerows(kept)
        self._file.flush()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(
                    os.path.join(output_dir, "tensorboard"),
                    purge_step=resume_step + 1 if resume_step is not None else None,
                )
            except ImportError:
                pass

    @property
    def tensorboard_dir(self) -> Optional[str]:
        return self._tb.log_dir if self._tb is not None else None

    def write(self, row: Dict[str, Any]) -> None:
        self._csv.writerow({k: _fmt(row.get(k)) for k in COLUMNS})
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if row.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", row[key], row["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _fmt(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v


def read_metrics(path: str) -> List[Dict[str, float]]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def plot_metrics(csv_path: str, png_path: str) -> Optional[str]:
    """Loss and learning rate over steps as a PNG; None (with a log line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = read_metrics(csv_path)
    if not rows:
        return None
    fig = metrics_figure(rows)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def metrics_figure(rows: List[Dict[str, float]]) -> Any:
    """The figure of :func:`plot_metrics` (matplotlib's Agg backend): loss above, learning rate below,
    over steps, whose axis ticks are whole steps (a short run would otherwise show steps 1.25, 1.5...)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    loss = [r.get("loss", math.nan) for r in rows]
    ax_loss.plot(steps, loss, lw=0.8, alpha=0.4, color="tab:blue", label="loss")
    window = max(1, len(loss) // 50)
    if window > 1:
        smooth = [
            sum(loss[max(0, i - window + 1) : i + 1]) / len(loss[max(0, i - window + 1) : i + 1])
            for i in range(len(loss))
        ]
        ax_loss.plot(steps, smooth, lw=1.5, color="tab:blue", label=f"loss (mean of {window})")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log" if min(loss) > 0 and max(loss) / max(min(loss), 1e-12) > 20 else "linear")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_lr.plot(steps, [r.get("lr", math.nan) for r in rows], color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared with the loss axis
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def progress_enabled() -> bool:
    """Progress bars only on a terminal, and not with ``RPP_PROGRESS=0`` (the project convention)."""
    return sys.stderr.isatty() and settings.PROGRESS.get()


def host_peak_rss_gib() -> float:
    """Peak resident memory of this process (GiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (1024**3 if sys.platform == "darwin" else 1024**2)


def device_peak_memory_gib() -> Optional[float]:
    """Largest peak allocated memory over the CUDA devices (GiB); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 1024**3


def format_rate(tokens_per_s: float) -> str:
    """Tokens per second for log lines: ``850``, ``12.3k``."""
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 10_000 else f"{tokens_per_s:.0f}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` for log lines."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def write_summary(output_dir: str, metrics: MetricsWriter, result: Dict[str, Any]) -> List[str]:
    """The end of a run (rank 0): ``loss.png``, ``summary.json`` (``result`` with the memory peaks
    added) and the closing lines to print. ``result``: step, total_steps, final_loss, tokens_per_s,
    seconds (this process's training), elapsed_s (the run's, resumed parts included: the time the
    progress lines show), accuracy, checkpoint."""
    plot = plot_metrics(metrics.path, os.path.join(output_dir, "loss.png"))
    gpu = device_peak_memory_gib()
    summary = {**result, "peak_gpu_memory_gib": gpu, "host_peak_rss_gib": host_peak_rss_gib()}
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    files = (
        [f"metrics {metrics.path}"]
        + ([f"plot {plot}"] if plot else [])
        + ([f"checkpoint {result['checkpoint']}"] if result["checkpoint"] else [])
    )
    if metrics.tensorboard_dir:
        files.append(f"tensorboard {metrics.tensorboard_dir}")
    elapsed = result.get("elapsed_s", result["seconds"])
    took = format_duration(elapsed)
    if elapsed - result["seconds"] >= 1:  # resumed: the progress lines count the earlier parts too
        took += f" ({format_duration(result['seconds'])} since the resume)"
    return [
        f"done: step {result['step']}/{result['total_steps']} in {took}, "
        f"{format_rate(result['tokens_per_s'])} tokens/s, "
        f"final loss {result['final_loss']:.4f}; peak GPU memory "
        f"{'%.2f GiB' % gpu if gpu is not None else 'n/a (CPU workers)'}, "
        f"host peak RSS {summary['host_peak_rss_gib']:.2f} GiB",
        "wrote " + ", ".join(files),
    ]


__all__ = [
    "COLUMNS",
    "MetricsWriter",
    "device_peak_memory_gib",
    "format_duration",
    "format_rate",
    "host_peak_rss_gib",
    "metrics_figure",
    "plot_metrics",
    "progress_enabled",
    "read_metrics",
    "write_summary",
]
