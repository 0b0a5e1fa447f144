"""``roundpipe plan``: what a training run will need before it starts, from the model's dimensions.

    roundpipe plan --model qwen3-8b --seq-len 262144 --lora-r 16
    roundpipe plan --model ~/models/Qwen3-8B --seq-len 131072 --gpu-memory 24GiB

Prints peak GPU memory (per GPU) and peak host memory of one step, the bytes each token costs, and
the longest context that fits this machine (or the ``--gpu-memory`` / ``--host-memory`` given). The
same numbers are ``roundpipe.estimate.estimate(...)`` and ``roundpipe.estimate.longest_context(...)``
in Python. Nothing heavy is imported but torch, and torch only to read this machine's GPU size when
``--gpu-memory`` is not given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, NoReturn, Optional, Tuple

from roundpipe import estimate

GiB = float(1 << 30)


def _size(text: str) -> float:
    """``24GiB`` / ``24GB`` / ``24`` (GiB) -> bytes."""
    from roundpipe.settings import parse_size_gib  # the parser of RPP_GPU_MEMORY: one place for sizes

    try:
        return parse_size_gib(text) * GiB
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 24GiB, 24GB or 20000MiB") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roundpipe plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", required=True, help=f"a Hugging Face model directory (its config.json) or a built-in shape: {', '.join(estimate.ModelShape.BUILTIN)}"
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step (default 1)")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank on all decoder projections (default 0: full fine-tune)")
    p.add_argument("--gpu-memory", type=_size, default=None, help="memory per GPU (default: this machine's GPU, else 80GiB)")
    p.add_argument("--host-memory", type=_size, default=None, help="host memory (default: this machine's)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the process trains on (default 1)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as the other commands report bad input."""
    print(f"roundpipe plan: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_shape(model: str) -> estimate.ModelShape:
    """The shape of a built-in name or of a model directory's config.json (no transformers import)."""
    if model in estimate.ModelShape.BUILTIN:
        return estimate.ModelShape.builtin(model)
    path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        _fail(f"--model {model!r} is neither a built-in shape ({', '.join(estimate.ModelShape.BUILTIN)}) nor a directory with a config.json")
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    try:
        return estimate.ModelShape.from_config(argparse.Namespace(**config))
    except (AttributeError, TypeError, KeyError) as exc:
        _fail(f"{path} is not a decoder-only causal LM config (missing {exc})")


def machine_memory() -> Tuple[Optional[float], float]:
    """(GPU memory of the smallest visible GPU or None, host memory) of this machine, in bytes."""
    gpu: Optional[float] = None
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "":
        try:
            import torch

            if torch.cuda.is_available():
                gpu = float(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))
        except ImportError:
            pass
    import psutil

    return gpu, float(psutil.virtual_memory().total)


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    for name in ("seq_len", "batch_size", "microbatches", "gpus"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1")
    shape = model_shape(args.model)
    gpu, host = args.gpu_memory, args.host_memory
    if gpu is None or host is None:
        found_gpu, found_host = machine_memory()
        gpu = gpu if gpu is not None else (found_gpu or 80 * GiB)
        host = host if host is not None else found_host
    # As the planner does: one decoder layer per backward stage, or the fewest that let the stages'
    # input checkpoints fit the host (fewer checkpoints, more activations per stage on the GPU).
    candidates = [
        estimate.estimate(
            shape, args.seq_len, args.batch_size, lora_rank=args.lora_r, microbatches=args.microbatches, layers_per_stage=g, devices=args.gpus, gpu_bytes=gpu
        )
        for g in range(1, 5)
    ]
    e = next((c for c in candidates if c.peak_gpu_bytes <= gpu and c.peak_host_bytes <= host), candidates[0])
    seq, fit = estimate.longest_context(shape, gpu, host, batch_size=args.batch_size, lora_rank=args.lora_r, microbatches=args.microbatches, devices=args.gpus)
    if args.json:
        print(
            json.dumps(
                {
                    "peak_gpu_bytes": e.peak_gpu_bytes,
                    "peak_host_bytes": e.peak_host_bytes,
                    "gpu_bytes_per_token": e.gpu_bytes_per_token,
                    "host_bytes_per_token": e.host_bytes_per_token,
                    "gpu_parts": e.gpu_parts,
                    "host_parts": e.host_parts,
                    "longest_context": seq,
                    "longest_context_layers_per_stage": fit.layers_per_stage if fit else None,
                    "gpu_memory": gpu,
                    "host_memory": host,
                }
            )
        )
        return 0
    print(f"{args.model}: {shape.params() / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}")
    print(e.describe())
    fits = e.peak_gpu_bytes <= gpu and e.peak_host_bytes <= host
    print(f"this step {'fits' if fits else 'does NOT fit'} {gpu / GiB:.0f} GiB per GPU and {host / GiB:.0f} GiB of host memory")
    print(
        "\n".join(estimate.describe_fit(shape, gpu, host, batch_size=args.batch_size, lora_rank=args.lora_r, microbatches=args.microbatches, devices=args.gpus))
    )
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
