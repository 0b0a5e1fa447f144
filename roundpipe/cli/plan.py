"""``roundpipe plan``: what a training run will need before it starts, from the model's dimensions.

    roundpipe plan --model qwen3-8b --seq-len 262144 --lora-r 16
    roundpipe plan --model ~/models/Qwen3-8B --seq-len 131072 --rope-scaling yarn:4 --gpu-memory 24GiB
    roundpipe plan --model qwen3-8b --seq-len 4096 --optim-state int8 --master bfloat16
    roundpipe plan --model ~/models/Llama-3.1-70B --seq-len 4096 --batch-size 8 --lora-r 16 --base-format nf4
    roundpipe plan --model qwen3-8b --seq-len 4096 --batch-size 8 --lora-r 16 --base-format fp8 --fp8

Prints peak GPU memory (per GPU) and peak host memory of one step, the bytes each token costs, and
the longest context that fits this machine (or the ``--gpu-memory`` / ``--host-memory`` given), searched over
the sequence tile (``RPP_SEQ_TILE``) and its halvings unless ``--seq-tile`` fixes it; with ``--base-format``
fp8, int8 or nf4, the frozen base's host bytes, the bytes uploaded per layer and the time to unpack it on the
GPU; with ``--fp8``, which projections run as FP8 GEMMs and which stay in bf16, a layer's weights on the GPU (a
frozen fp8 base's bytes, not unpacked) and the weights' fp8 copies (FP8's GEMM speed is not estimated); the
backward stages whose activations the GPU's room keeps for the backward (no recompute), the bytes
they take and the recompute they save. A step that does not fit is told which side is short and by how much,
with the levers that would change it, each with its estimated effect (LoRA, compact optimizer state, int8 stage
inputs, a shorter sequence tile, fewer tokens, more memory). The
same numbers are ``roundpipe.planning.estimate.estimate(...)`` and ``roundpipe.planning.estimate.longest_context(...)``
in Python. Exit status 0 when the step fits, 1 when it does not (text and ``--json`` alike), 2 with one
line for bad input. A run ``roundpipe train`` refuses is refused here too: a sequence beyond a model
directory's position limit (``max_position_embeddings``, stretched by its rotary scaling or by
``--rope-scaling``: :mod:`roundpipe.rope_scaling`), more microbatches than sequences, ``--fp8`` with LoRA over a
base not kept as fp8, or (planning for this machine's GPUs) on a GPU without FP8 GEMMs. Nothing heavy is imported
but torch, and torch only to read this machine's GPU size when ``--gpu-memory`` is not given (and with ``--fp8``
its compute capability, checked by ``roundpipe.models.fp8``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

from roundpipe import rope_scaling
from roundpipe.cli import plan_levers
from roundpipe.cli.config import (
    MASTER_ROUNDINGS,
    MASTERS,
    OPTIM_STATES,
    STAGE_INPUTS,
    ConfigError,
    check_rope_scaling,
    fp8_problem,
    normalize_dtype,
)
from roundpipe.cli.config_flags import add_config_flag
from roundpipe.cli.memory_caps import size_bytes
from roundpipe.planning import estimate, fp8_estimate, keep_estimate, memory_terms
from roundpipe.utils import BASE_FORMATS, GiB


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a :class:`ConfigError` (one line, no usage dump)."""

    def error(self, message: str) -> Any:
        raise ConfigError(message, f"see '{self.prog} --help'")


def _size(text: str) -> float:
    """``24GiB`` / ``24GB`` / ``24`` (GiB) -> bytes, as ``roundpipe train`` reads the same flags."""
    try:
        return size_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def builtin_names() -> List[str]:
    """The built-in architectures: those ``roundpipe train`` builds by name (``roundpipe.cli.model_names``)."""
    from roundpipe.cli.model_names import BUILTIN_MODELS

    return list(BUILTIN_MODELS)


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    # --help is plain text: the docstring without its reStructuredText markup (``x``, :mod:`x`)
    description = re.sub(r":\w+:`~?([^`]+)`", r"\1", (__doc__ or "").replace("``", ""))
    p = _ArgumentParser(prog="roundpipe plan", description=description, formatter_class=raw)
    shapes = ", ".join(builtin_names())
    p.add_argument("--model", required=True, help=f"a Hugging Face model directory or a built-in: {shapes}")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step, at most batch-size (default 1)")
    p.add_argument(
        "--rope-scaling",
        default=None,
        help="stretch the rotary positions past the model's limit: yarn:F, linear:F, dynamic:F, llama3:F or none "
        "(as train)",
    )
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank on all decoder projections (0: full fine-tune)")
    p.add_argument(
        "--base-format",
        choices=BASE_FORMATS,
        default="bf16",
        help="how a LoRA run's frozen projections are held in host memory and uploaded (as train; default bf16)",
    )
    add_config_flag(p, "fp8", default=False)  # train's flag, as train has it
    states, masters, roundings = (", ".join(c) for c in (OPTIM_STATES, MASTERS, MASTER_ROUNDINGS))
    p.add_argument("--optim-state", type=normalize_dtype, default="float32", help=f"Adam moments: {states} (as train)")
    p.add_argument("--master", type=normalize_dtype, default="float32", help=f"master weights: {masters} (as train)")
    p.add_argument("--master-rounding", default="stochastic", help=f"bfloat16 masters: {roundings} (as train)")
    p.add_argument(
        "--stage-inputs",
        choices=STAGE_INPUTS,
        default=None,
        help="backward-stage inputs on the host (as train; default: RPP_STAGE_INPUTS, else bf16)",
    )
    p.add_argument("--gpu-memory", type=_size, default=None, help="memory per GPU (default: this machine's or 80GiB)")
    p.add_argument("--host-memory", type=_size, default=None, help="host memory (default: this machine's)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the process trains on (default 1)")
    p.add_argument(
        "--sequence-tiles",
        type=int,
        default=1,
        help="tiles of each sequence that flow over the GPUs as microbatches (RoundPipeRunConfig(sequence_tiles=))",
    )
    p.add_argument(
        "--seq-tile",
        type=int,
        default=None,
        help="tokens per sequence tile of the decoder layers, as train --seq-tile (RPP_SEQ_TILE) sets it (0: off; "
        "default: RPP_SEQ_TILE; the longest context is then searched over it and its halvings)",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def _read_config(path: str) -> Dict[str, Any]:
    """A model directory's config.json as a dict (the text model's part of a multimodal config)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        what = f"cannot read {path} ({type(exc).__name__}: {exc})"
        raise ConfigError(what, "pass a directory written by save_pretrained") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object", "pass a directory written by save_pretrained")
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


#: The config keys the estimate reads; a config without them has another layout than the one it models.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def model_shape(model: str, rope: Optional[str] = None) -> Tuple[estimate.ModelShape, Optional[Dict[str, Any]]]:
    """The shape of a built-in name or of a model directory's config.json (no transformers import), and
    the config a sequence length is checked against (a directory's, with the ``rope`` scaling spec set; None
    for a built-in shape, whose rotary tables ``roundpipe train`` extends as far as asked)."""
    from roundpipe.cli.model_names import BUILTIN_MODELS, did_you_mean

    if model in estimate.ModelShape.BUILTIN:
        return estimate.ModelShape.builtin(model), None
    if model in BUILTIN_MODELS:
        return estimate.ModelShape.from_config(argparse.Namespace(**BUILTIN_MODELS[model])), None
    path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        names = builtin_names()
        raise ConfigError(
            f"--model {model!r} is neither a built-in shape nor a directory with a config.json"
            + did_you_mean(model, names),
            f"pass a Hugging Face model directory or one of: {', '.join(names)}",
        )
    config = _read_config(path)
    missing = [k for k in SHAPE_KEYS if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        kind = f"model_type {config.get('model_type')!r}" if config.get("model_type") else "no model_type"
        raise ConfigError(
            f"{path} ({kind}) has no integer {', '.join(missing)}",
            "roundpipe plan estimates decoder-only LMs laid out like Llama / Qwen3 (those keys in config.json)",
        )
    if rope is not None:
        rope_scaling.with_rope_scaling(config, rope)
    try:
        return estimate.ModelShape.from_config(argparse.Namespace(**config)), config
    except ValueError as exc:
        raise ConfigError(
            f"{path}: {exc}", "roundpipe plan estimates dense Llama / Qwen3 layouts, Qwen3-MoE and GPT-OSS"
        ) from None


def machine_memory() -> Tuple[Optional[float], float]:
    """(GPU memory of the smallest visible GPU or None, host memory) of this machine, in bytes."""
    gpu: Optional[float] = None
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "":
        try:
            import torch

            if torch.cuda.is_available():
                sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
                gpu = float(min(sizes))
        except ImportError:
            pass
    import psutil

    return gpu, float(psutil.virtual_memory().total)


def check_fp8_gpus() -> None:
    """``--fp8`` on this machine's GPUs, refused where ``roundpipe train`` refuses it, in the runtime's words
    (``roundpipe.models.fp8.check_capabilities``: FP8 GEMMs need compute capability 8.9). Nothing to check
    without CUDA: CPU workers run the same casts emulated."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x") == "":
        return
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    from roundpipe.models import fp8

    try:
        fp8.check_capabilities([torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())])
    except ValueError as exc:
        fix = "drop --fp8 to train in bf16, or give --gpu-memory to plan for another machine's GPUs"
        raise ConfigError(str(exc).split(";")[0], fix) from None


def check(args: argparse.Namespace, config: Optional[Dict[str, Any]]) -> None:
    """What ``roundpipe train`` refuses, refused here with the same words (``config``: the model directory's,
    whose position limit the sequence must keep)."""
    for name in ("seq_len", "batch_size", "microbatches", "gpus", "sequence_tiles"):
        flag = "--" + name.replace("_", "-")
        if getattr(args, name) < 1:
            raise ConfigError(f"{flag}={getattr(args, name)} must be positive", f"set {flag} to 1 or more")
    if args.seq_tile is not None and args.seq_tile < 0:
        raise ConfigError(f"--seq-tile={args.seq_tile} is negative", "set --seq-tile to 0 (tiles off) or more")
    if args.lora_r < 0:
        raise ConfigError(f"--lora-r={args.lora_r} is negative", "set --lora-r to 0 (full fine-tune) or more")
    if args.base_format != "bf16" and not args.lora_r:
        raise ConfigError(
            f"--base-format {args.base_format} packs the frozen base of a LoRA run, and this is a full fine-tune",
            "give --lora-r, or leave --base-format at bf16",
        )
    if (problem := fp8_problem(args.fp8, args.lora_r, args.base_format)) is not None:
        raise ConfigError(*problem)
    if args.microbatches > args.batch_size:
        raise ConfigError(
            f"batch_size={args.batch_size} is smaller than microbatches={args.microbatches}",
            f"raise --batch-size to at least {args.microbatches} or lower --microbatches",
        )
    for name, choices in (("optim_state", OPTIM_STATES), ("master", MASTERS), ("master_rounding", MASTER_ROUNDINGS)):
        if getattr(args, name) not in choices:
            raise ConfigError(f"{name}={getattr(args, name)!r} is not a choice", f"use one of {', '.join(choices)}")
    if args.sequence_tiles > args.seq_len:
        raise ConfigError(
            f"--sequence-tiles={args.sequence_tiles} is more than the sequence's {args.seq_len} tokens",
            "lower --sequence-tiles",
        )
    if config is not None:
        try:
            rope_scaling.check_length(config, args.seq_len)
        except rope_scaling.SequenceTooLong as exc:
            raise ConfigError(exc.what, exc.fix) from None


def main(argv: Optional[List[str]] = None) -> int:
    """Print the estimate; the exit status says whether the step fits (see the module docstring)."""
    try:
        return _plan(parser().parse_args(argv))
    except ConfigError as exc:
        print(f"roundpipe: error: {exc}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    if args.rope_scaling is not None:
        check_rope_scaling(args.rope_scaling)
    shape, config = model_shape(args.model, args.rope_scaling)
    check(args, config)
    if shape.experts and (args.fp8 or args.base_format != "bf16"):
        raise ConfigError(
            f"{args.model} is a mixture of experts, and the plan models a packed base and FP8 GEMMs for dense layers",
            "plan it without --fp8 and with --base-format bf16 (the expert weights then count at 2 bytes)",
        )
    if args.fp8:
        try:
            fp8_estimate.fp8_terms(shape, args.lora_r, args.base_format)
        except ValueError as exc:
            raise ConfigError(*str(exc).split("; ", 1)) from None
        if args.gpu_memory is None:  # planning for this machine's GPUs
            check_fp8_gpus()
    gpu, host = args.gpu_memory, args.host_memory
    if gpu is None or host is None:
        found_gpu, found_host = machine_memory()
        gpu = gpu if gpu is not None else (found_gpu or 80 * GiB)
        host = host if host is not None else found_host
    kw: Dict[str, Any] = dict(
        batch_size=args.batch_size,
        lora_rank=args.lora_r,
        microbatches=args.microbatches,
        devices=args.gpus,
        sequence_tiles=args.sequence_tiles,
        optimizer_bytes_per_param=memory_terms.optimizer_state_bytes(
            args.optim_state, args.master, args.master_rounding
        ),
        stage_inputs=args.stage_inputs,
        base_format=args.base_format,
        fp8=args.fp8,
    )
    if args.seq_tile is not None:
        kw["tile"] = args.seq_tile
    # The longest context: over the tile given, else over the setting's and its halvings.
    tiles = [args.seq_tile] if args.seq_tile is not None else estimate.tile_choices()
    e, fits = plan_levers.best_estimate(shape, args.seq_len, gpu, host, kw)
    levers = [] if fits else plan_levers.levers(args, shape, gpu, host, kw)
    kept = keep_estimate.keep_estimate(shape, e, args.gpus, args.sequence_tiles)
    if args.json:
        seq, fit = estimate.longest_context(shape, gpu, host, tiles=tiles, **kw)
        result = {
            "fits": fits,
            "peak_gpu_bytes": e.peak_gpu_bytes,
            "peak_host_bytes": e.peak_host_bytes,
            "gpu_bytes_per_token": e.gpu_bytes_per_token,
            "host_bytes_per_token": e.host_bytes_per_token,
            "gpu_parts": e.gpu_parts,
            "host_parts": e.host_parts,
            "layers_per_stage": e.layers_per_stage,
            "base_format": e.base_format,
            "upload_bytes_per_layer": e.upload_bytes_per_layer,
            "dequantize_ms_per_layer": e.dequantize_ms_per_layer,
            "device_bytes_per_layer": e.device_bytes_per_layer,
            "fp8": e.fp8.to_json() if e.fp8 is not None else None,
            "longest_context": seq,
            "longest_context_layers_per_stage": fit.layers_per_stage if fit else None,
            "longest_context_seq_tile": fit.tile if fit else None,
            "seq_tile": e.tile,
            "gpu_memory": gpu,
            "host_memory": host,
            "short": plan_levers.shortfall(e, gpu, host),
            "levers": [lever.to_json() for lever in levers],
            "keep": kept.to_json(),
        }
        print(json.dumps(result))
        return 0 if fits else 1
    print(f"{args.model}: {shape.params() / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}")
    if shape.experts:
        print(
            f"mixture of experts: {shape.experts} experts of width {shape.expert_intermediate}, "
            f"{shape.intermediate // shape.expert_intermediate} a token; weights, gradients and optimizer state count "
            f"every expert, activations the routed ones as one MLP of width {shape.intermediate} (an approximation "
            "not yet checked against a measured GPU peak)"
        )
    print(e.describe())
    if kept.stages:  # the choice when keeping happens (the JSON says why not otherwise)
        print(kept.describe())
    if fits:
        print(f"this step fits {estimate.budgets(gpu, host)}")
    else:
        print(f"this step does NOT fit {estimate.budgets(gpu, host)}: {plan_levers.describe_short(e, gpu, host)}")
        print("levers, each estimated alone:\n" + "\n".join(lever.describe(host) for lever in levers))
    print("\n".join(estimate.describe_fit(shape, gpu, host, tiles=tiles, **kw)))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
