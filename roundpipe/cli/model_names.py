"""The built-in architectures of ``roundpipe train`` and the name closest to a mistyped one, without torch:
config validation (``roundpipe.cli.config.check_model``) and ``roundpipe plan`` read them before anything
heavy loads, so a mistyped name costs no model loading time and is answered with the name probably meant.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Iterable

from roundpipe.cli.tasks import BYTE_VOCAB_SIZE

_QWEN3_COMMON = dict(
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936
)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> Dict[str, Any]:
    return dict(
        _QWEN3_COMMON,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        tie_word_embeddings=tied,
    )


#: Built-in Qwen3 architectures (random init): the WORKLOADS.md sizes plus ``tiny`` for the default task.
BUILTIN_MODELS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        hidden_size=192,
        intermediate_size=576,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=32,
        vocab_size=BYTE_VOCAB_SIZE,
        max_position_embeddings=1024,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
}


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``name`` (case and ``_`` / ``-`` aside), or ''."""
    by_key = {c.lower().replace("_", "-"): c for c in choices}
    match = difflib.get_close_matches(name.lower().replace("_", "-"), list(by_key), n=1, cutoff=0.6)
    return f" (did you mean '{by_key[match[0]]}'?)" if match else ""


__all__ = ["BUILTIN_MODELS", "did_you_mean"]
