"""What ``roundpipe plan`` says when a step does not fit: which side is short and by how much, and the
levers that would change it, each with the effect the estimate itself computes for it (never a fixed text).

A lever is one change to the command line: LoRA, compact optimizer state, int8 stage inputs, a shorter sequence
tile (``--seq-tile`` in plan and train, or ``RPP_SEQ_TILE``) where the GPU is short, fewer tokens
(the longest ``--seq-len`` that fits, from ``estimate.longest_context``), more GPU memory where the GPU is
short, an NF4 frozen base (``--base-format nf4``, with LoRA) where the host is short.
Each is estimated alone, as ``plan`` would with its flags added (the same choice of layers per backward
stage); when none of the run's own levers fits alone, they are tried together.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from roundpipe.planning import estimate, memory_terms
from roundpipe.planning.estimate import Estimate, ModelShape
from roundpipe.utils import GiB

MAX_LAYERS_PER_STAGE = 4
"""The backward stages ``plan`` tries, as the planner does: 1 to this many decoder layers each."""

RUN_FLAGS = ("--lora-r", "--optim-state", "--stage-inputs", "--base-format", "--seq-tile")
"""The levers that change the run itself (not its tokens, nor the machine): tried together, on this machine,
when none fits alone."""

LORA_RANK = 16
"""The LoRA rank a lever proposes (the rank of the measured long-context rows)."""


def best_estimate(
    shape: ModelShape, seq_len: int, gpu: float, host: float, kw: Dict[str, Any]
) -> Tuple[Estimate, bool]:
    """The step's estimate as the planner would lay it out, and whether it fits: one decoder layer per
    backward stage, or the fewest that let the stages' input checkpoints fit the host (fewer checkpoints,
    more activations per stage on the GPU)."""
    candidates = [
        estimate.estimate(shape, seq_len, layers_per_stage=g, gpu_bytes=gpu, **kw)
        for g in range(1, MAX_LAYERS_PER_STAGE + 1)
    ]
    fit = next((c for c in candidates if fits(c, gpu, host)), None)
    return (fit, True) if fit is not None else (candidates[0], False)


def fits(e: Estimate, gpu: float, host: float) -> bool:
    return e.peak_gpu_bytes <= gpu and e.peak_host_bytes <= host


def shortfall(e: Estimate, gpu: float, host: float) -> Dict[str, float]:
    """Bytes each side lacks (0 where it fits)."""
    return {"gpu": max(0.0, e.peak_gpu_bytes - gpu), "host": max(0.0, e.peak_host_bytes - host)}


def describe_short(e: Estimate, gpu: float, host: float) -> str:
    """``"host short by 31.4 GiB (needs 54.9 of 23.5 GiB)"``, for each side that is short."""
    short = shortfall(e, gpu, host)
    sides = []
    for side, need, have in (("GPU", e.peak_gpu_bytes, gpu), ("host", e.peak_host_bytes, host)):
        if short[side.lower()] > 0:
            sides.append(
                f"{side} short by {short[side.lower()] / GiB:.1f} GiB (needs {need / GiB:.1f} of {have / GiB:.1f} GiB)"
            )
    return " and ".join(sides)


@dataclass
class Lever:
    """One change to the command line and its estimated step (None: not available)."""

    change: str
    """The change as the user types it, e.g. ``--lora-r 16``."""
    argv: List[str] = field(default_factory=list)
    """The flags to add to ``roundpipe plan`` (and ``train``) for it."""
    estimate: Optional[Estimate] = None
    fits: bool = False
    gpu: float = 0.0
    """The GPU budget it is estimated under (changed by the ``--gpu-memory`` lever)."""
    note: str = ""
    """Why it is not available, or what else it implies."""
    changed: Dict[str, Any] = field(default_factory=dict)
    """The estimate's keywords it changes (``lora_rank=16``), for trying several at once."""

    def describe(self, host: float) -> str:
        if self.estimate is None:
            return f"  {self.change}: {self.note}"
        e = self.estimate
        short = shortfall(e, self.gpu, host)
        status = (
            "fits" if self.fits else " and ".join(f"{k} still {v / GiB:.1f} GiB short" for k, v in short.items() if v)
        )
        status = status.replace("gpu still", "GPU still")
        text = (
            f"  {self.change}: GPU {e.peak_gpu_bytes / GiB:.1f} GiB, host {e.peak_host_bytes / GiB:.1f} GiB ({status})"
        )
        return text + (f"; {self.note}" if self.note else "")

    def to_json(self) -> Dict[str, Any]:
        e = self.estimate
        return {
            "change": self.change,
            "argv": self.argv,
            "available": e is not None,
            "fits": self.fits,
            "peak_gpu_bytes": e.peak_gpu_bytes if e is not None else None,
            "peak_host_bytes": e.peak_host_bytes if e is not None else None,
            "gpu_memory": self.gpu if e is not None else None,
            "note": self.note,
        }


def levers(args: argparse.Namespace, shape: ModelShape, gpu: float, host: float, kw: Dict[str, Any]) -> List[Lever]:
    """The levers for a step that does not fit (``args``: ``plan``'s; ``kw``: its estimate's keywords)."""
    from roundpipe import settings

    def lever(change: str, argv: List[str], budget: float = gpu, note: str = "", **changed: Any) -> Lever:
        e, ok = best_estimate(shape, args.seq_len, budget, host, {**kw, **changed})
        return Lever(change, argv, e, ok, budget, note, changed)

    out: List[Lever] = []
    fp8 = bool(kw.get("fp8"))
    if not args.lora_r:  # with --fp8, LoRA computes from a base kept as fp8
        argv = ["--lora-r", str(LORA_RANK)] + (["--base-format", "fp8"] if fp8 else [])
        more = {"base_format": "fp8"} if fp8 else {}
        out.append(lever(" ".join(argv), argv, lora_rank=LORA_RANK, **more))
    if (args.optim_state, args.master) != ("int8", "bfloat16"):
        compact = memory_terms.optimizer_state_bytes("int8", "bfloat16", args.master_rounding)
        argv = ["--optim-state", "int8", "--master", "bfloat16"]
        out.append(lever(" ".join(argv), argv, note="train needs --dtype bfloat16", optimizer_bytes_per_param=compact))
    # A LoRA base in 4 bits, about a quarter of its host bytes (modelled for dense layers only).
    if kw.get("base_format", "bf16") != "nf4" and not shape.experts:
        rank = args.lora_r or LORA_RANK
        argv = ([] if args.lora_r else ["--lora-r", str(rank)]) + ["--base-format", "nf4"]
        argv += ["--no-fp8"] if fp8 else []  # FP8 GEMMs read a base kept as fp8
        out.append(lever(" ".join(argv), argv, base_format="nf4", lora_rank=rank, fp8=False))
    if (args.stage_inputs or settings.STAGE_INPUTS.get()) != "int8":
        out.append(
            lever("--stage-inputs int8 (RPP_STAGE_INPUTS=int8)", ["--stage-inputs", "int8"], stage_inputs="int8")
        )
    now, _ = best_estimate(shape, args.seq_len, gpu, host, kw)
    if now.peak_gpu_bytes > gpu and now.tile:  # the largest shorter tile that fits, else the shortest
        tiled: Optional[Lever] = None
        for t in estimate.tile_choices(now.tile)[1:]:
            tiled = lever(f"--seq-tile {t} (RPP_SEQ_TILE={t})", ["--seq-tile", str(t)], tile=t)
            if tiled.fits:
                break
        if tiled is not None and tiled.estimate is not None and tiled.estimate.peak_gpu_bytes < now.peak_gpu_bytes:
            out.append(tiled)
    seq, fit = estimate.longest_context(shape, gpu, host, max_layers_per_stage=MAX_LAYERS_PER_STAGE, **kw)
    if fit is not None and seq < args.seq_len:
        out.append(Lever(f"--seq-len {seq}", ["--seq-len", str(seq)], fit, True, gpu, "the longest that fits"))
    elif fit is None:
        out.append(Lever("fewer tokens", note=f"no --seq-len of 1,024 or more fits {estimate.budgets(gpu, host)}"))
    e, _ = best_estimate(shape, args.seq_len, gpu, host, kw)
    if e.peak_gpu_bytes > gpu:
        out.append(more_gpu(shape, args.seq_len, gpu, host, kw))
    if e.peak_host_bytes > host:  # the estimate's host side does not depend on the host budget
        n = math.ceil(e.peak_host_bytes / GiB)
        e, ok = best_estimate(shape, args.seq_len, gpu, n * GiB, kw)
        out.append(Lever(f"--host-memory {n}GiB", ["--host-memory", f"{n}GiB"], e, ok, gpu, "a machine with that much"))
    run_levers = [lv for lv in out if lv.argv and lv.argv[0] in RUN_FLAGS]
    if len(run_levers) > 1 and not any(lv.fits for lv in run_levers):
        out.append(together(args, shape, gpu, host, kw, run_levers))
    return out


def more_gpu(shape: ModelShape, seq_len: int, gpu: float, host: float, kw: Dict[str, Any]) -> Lever:
    """The least whole GiB per GPU under which the GPU side fits (the host may still be short)."""
    e, _ = best_estimate(shape, seq_len, gpu, host, kw)
    n = max(math.ceil(e.peak_gpu_bytes / GiB), math.floor(gpu / GiB) + 1)
    for _ in range(1024):
        e, ok = best_estimate(shape, seq_len, n * GiB, host, kw)
        if e.peak_gpu_bytes <= n * GiB:
            return Lever(f"--gpu-memory {n}GiB", ["--gpu-memory", f"{n}GiB"], e, ok, n * GiB, "a larger GPU")
        n += 1
    return Lever("more GPU memory", note="no GPU up to 1 TiB fits this step")


def together(
    args: argparse.Namespace, shape: ModelShape, gpu: float, host: float, kw: Dict[str, Any], chosen: List[Lever]
) -> Lever:
    """The run's levers at once, on this machine (``gpu`` and ``host``)."""
    argv = [x for lv in chosen for x in lv.argv]
    changed = {k: v for lv in chosen for k, v in lv.changed.items()}
    e, ok = best_estimate(shape, args.seq_len, gpu, host, {**kw, **changed})
    return Lever("together: " + " ".join(argv), argv, e, ok, gpu, "", changed)


__all__ = ["Lever", "best_estimate", "describe_short", "fits", "levers", "shortfall"]
