"""``roundpipe`` command line: ``roundpipe train`` and ``roundpipe export``.

User errors (bad config, missing files, corrupt checkpoints) are printed as one line,
``roundpipe: error: <what> — <fix>``, with exit status 2 and no traceback; anything else is a bug or a
runtime failure and keeps its traceback. In a torchrun job of several ranks every line says which rank
wrote it (``roundpipe: error: rank 1: ...``), and a rank stopped by another rank's failure prints one
line naming that rank (exit status 1): the traceback is in the failing rank's output.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator, List, Optional

from roundpipe.cli.config import ConfigError
from roundpipe.cli.parallel import PeerFailed, rank_prefix

USAGE = """usage: roundpipe <command> [options]

commands:
  train    train or fine-tune a causal LM (no options: a small model learns to reverse strings)
  export   write a checkpoint as a Hugging Face model directory
  plan     estimate peak GPU and host memory of a run and the longest context a machine fits

'roundpipe <command> --help' describes each command's options; 'roundpipe --version' prints the version."""


_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers whose warnings at import time are not the command's business (``_cli_logging``)."""


@contextlib.contextmanager
def _cli_logging() -> Iterator[None]:
    """Print the ``roundpipe`` logger's INFO and above as ``roundpipe: LEVEL: ...`` on stderr while
    the command runs; the logger is restored afterwards (``main`` may run inside tests or notebooks)."""
    logger = logging.getLogger("roundpipe")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"roundpipe: {rank_prefix()}%(levelname)s: %(message)s"))
    old = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # transformers imports torchao when it is installed, and that import logs warnings: one per optional C++
    # kernel library built for another torch version (mxfp8 and others), and torch's pytree deprecation notes
    # for the enums torchao registers. roundpipe uses none of them; the lines would bury the command's own
    # one-line errors. Errors still show.
    quiet = [logging.getLogger(name) for name in _IMPORT_NOISE]
    quiet_levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old[0])
        logger.propagate = old[1]
        for q, level in zip(quiet, quiet_levels):
            q.setLevel(level)


def train_main(argv: List[str]) -> int:
    """``roundpipe train``: parse, then train (or print the resolved config)."""
    from roundpipe.cli.config import to_yaml
    from roundpipe.cli.config_flags import parse_train_args

    args = parse_train_args(argv)  # before anything heavy is imported: --help and config errors answer at once
    if not args.print_config:
        from roundpipe.cli.run_dir import check_before_loading

        check_before_loading(args.cfg, args.overwrite)  # an earlier run or an unwritable output_dir: at once too
    with _hf_quiet():
        if args.print_config:
            from roundpipe.cli.train import resolved_config

            print(to_yaml(resolved_config(args.cfg, args.given)), end="")
            return 0
        from roundpipe.cli.train import run

        try:
            run(args.cfg, args.given, overwrite=args.overwrite)
        except KeyboardInterrupt:
            print(f"roundpipe: {rank_prefix()}interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            import torch  # loaded by the run

            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            print(f"roundpipe: error: {rank_prefix()}{out_of_memory_line(exc)}", file=sys.stderr)
            return 1
    return 0


def out_of_memory_line(exc: BaseException) -> str:
    """A run's out-of-memory error in one line: where it happened and the flags that make the step fit."""
    where = str(exc).split(" Fixes: ")[0].splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"{where} — lower --batch-size or raise --microbatches (smaller activations), or lower --gpu-memory "
        "(RPP_GPU_MEMORY: smaller stages); --resume continues from the newest checkpoint (docs/resolve-oom.md)"
    )


def export_main(argv: List[str]) -> int:
    """``roundpipe export``: a checkpoint as a Hugging Face model directory."""
    from roundpipe.cli.export import check_export, export, parse_export_args

    args = parse_export_args(argv)
    source = check_export(args.checkpoint, args.out)  # a mistake answers before transformers is imported
    with _hf_quiet():
        path = export(args.checkpoint, args.out, merge_lora=args.merge_lora, dtype=args.dtype)
    from roundpipe.cli.checkpoint import verify_checkpoint

    step = verify_checkpoint(source)["step"]  # verified by check_export: not hashed again
    print(f"exported step {step} ({source}) -> {path}")
    return 0


@contextlib.contextmanager
def _hf_quiet() -> Iterator[None]:
    """No Hugging Face loading/saving bars where ours are off (they would clutter logs and error
    reports). Entered once the arguments are parsed: it imports transformers."""
    from roundpipe.cli.metrics import progress_enabled

    if progress_enabled():
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def plan_main(argv: List[str]) -> int:
    """``roundpipe plan``: the memory estimate of a run (``roundpipe.cli.plan``)."""
    from roundpipe.cli.plan import main as plan

    return plan(argv)


COMMANDS = {"train": train_main, "export": export_main, "plan": plan_main}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``roundpipe`` console script and ``python -m roundpipe``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from roundpipe.cli.config import version

        print(f"roundpipe {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"roundpipe: error: unknown command {command!r} — use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    with _cli_logging():
        try:
            return COMMANDS[command](rest)
        except ConfigError as exc:
            print(f"roundpipe: error: {rank_prefix()}{exc}", file=sys.stderr)
            return 2
        except PeerFailed as exc:
            print(f"roundpipe: error: {rank_prefix()}{exc}", file=sys.stderr)
            return 1


__all__ = ["ConfigError", "main"]
