"""``roundpipe train --seq-tile N``: the sequence tile of ``RPP_SEQ_TILE`` (and of ``roundpipe plan --seq-tile``)
as a train flag. During the run the setting is the flag's value, winning over the variable, and the decoder
layers run tiled at it; without the flag the variable stays in charge; a negative tile is one line."""

from __future__ import annotations

from typing import Any, List

import pytest

from roundpipe import settings
from roundpipe.cli import main
from roundpipe.cli.config import merge
from roundpipe.cli.config_flags import parse_train_args
from roundpipe.cli.train import run
from roundpipe.models import tiling


@pytest.fixture(autouse=True)
def _restore_process_state(restore_process_state: None) -> None:
    """The runs here configure this process's devices and tile (see conftest.restore_process_state)."""


def test_help_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seq-tile SEQ_TILE tokens per sequence tile of the decoder layers, as RPP_SEQ_TILE" in text
    assert parse_train_args(["--seq-tile", "4096"]).cfg.seq_tile == 4096
    assert parse_train_args([]).cfg.seq_tile is None


def _tiles_seen(monkeypatch, tmp_path, **keys: Any) -> List[Any]:
    """Train the built-in task for one step; returns (RPP_SEQ_TILE, rows per tile) for each tiled layer call."""
    seen: List[Any] = []
    real = tiling.tiled_forward

    def counting(layer, hidden, mask, position_ids, position_embeddings, rows):  # hidden: [batch, seq, hidden]
        seen.append((settings.SEQ_TILE.get(), rows))
        return real(layer, hidden, mask, position_ids, position_embeddings, rows)

    monkeypatch.setattr(tiling, "tiled_forward", counting)
    cfg = dict(devices="cpu:1", steps=1, batch_size=4, eval_examples=0, output_dir=str(tmp_path / "run"), **keys)
    assert run(merge({}, cfg), out=lambda m: None).step == 1
    return seen


def test_the_flag_reaches_the_setting_during_the_run(tmp_path, monkeypatch) -> None:
    """4 rows x 14 tokens: under the default tile (16384) no layer tiles; ``--seq-tile 8`` (over the
    variable's 16384) tiles every layer at 8 // 4 = 2 positions, forward and recompute."""
    monkeypatch.setenv("RPP_SEQ_TILE", "16384")
    assert _tiles_seen(monkeypatch, tmp_path / "a") == []
    seen = _tiles_seen(monkeypatch, tmp_path / "b", seq_tile=8)
    assert seen and set(seen) == {(8, 2)}
    monkeypatch.setenv("RPP_SEQ_TILE", "12")
    settings.unconfigure(settings.SEQ_TILE.name)  # the last run's choice, undone: the variable's 12 again
    assert set(_tiles_seen(monkeypatch, tmp_path / "c")) == {(12, 3)}


def test_a_negative_tile_is_one_line(capsys) -> None:
    assert main(["train", "--seq-tile", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "roundpipe: error: seq_tile=-1 is negative — set --seq-tile to 0 (tiles off) or more"
