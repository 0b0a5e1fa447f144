"""What every command shows a new user: ``--help`` as plain text (no reStructuredText markup from the
docstrings it is built from), and one list of built-in model names that ``plan`` and ``train`` both take."""

from __future__ import annotations

import argparse
import re

import pytest

from roundpipe.cli import COMMANDS, USAGE, main, plan
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.model_names import BUILTIN_MODELS
from roundpipe.planning import estimate

#: reStructuredText / Sphinx markup that a terminal shows as noise.
MARKUP = re.compile(r"``|:(func|class|mod|meth|data|attr):`")


def help_text(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_is_plain_text(capsys, command: str) -> None:
    text = help_text(capsys, [command, "--help"])
    assert f"roundpipe {command}" in text and "--" in text
    assert not MARKUP.search(text), MARKUP.search(text).group(0) + " in: " + text[:3000]
    assert not MARKUP.search(USAGE)


def test_plan_and_train_take_the_same_built_in_models(capsys) -> None:
    """Every built-in name that ``plan`` estimates, ``train`` builds, with the shape ``plan`` estimates."""
    from roundpipe.cli.model_loading import builtin_config

    names = plan.builtin_names()
    assert names == list(BUILTIN_MODELS) and "qwen3-32b" in names
    assert set(estimate.ModelShape.BUILTIN) <= set(names)
    for name in names:
        assert parse_train_args(["--model", name]).cfg.model == name
        planned, limit = plan.model_shape(name)
        built = estimate.ModelShape.from_config(argparse.Namespace(**builtin_config(name).to_dict()))
        assert (planned.params(), planned.layers, planned.hidden) == (built.params(), built.layers, built.hidden), name
        assert limit is None  # train extends a built-in model's rotary tables as far as asked
    budget = ["--gpu-memory", "80GiB", "--host-memory", "512GiB"]
    assert plan.main(["--model", "qwen3-32b", "--seq-len", "4096", "--lora-r", "16", *budget]) == 0
