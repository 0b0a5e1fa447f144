"""The built-in architectures of ``roundpipe train`` and the name closest to a mistyped one, without torch:
config validation (``roundpipe.cli.config.check_model``) and ``roundpipe plan`` read them before anything
heavy loads, so a mistyped name costs no model loading time and is answered with the name probably meant.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, Iterable

from roundpipe import flavors
from roundpipe.cli.tasks import BYTE_VOCAB_SIZE


def _qwen3(flavor: flavors.Flavor) -> Dict[str, Any]:
    """The ``Qwen3Config`` fields of a built-in flavor: its sizes (``roundpipe.flavors``) and the rotary
    base, norm epsilon and position limit of the released Qwen3 models."""
    return dict(flavor.config_fields(), rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960)


#: The rotary scaling of the released Llama-3.1 models (positions past 8,192 stretched, up to 131,072).
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(flavor: flavors.Flavor) -> Dict[str, Any]:
    """The ``LlamaConfig`` fields of a built-in Llama-3.1 flavor: its sizes and the released models' rotary
    base and scaling, norm epsilon and position limit."""
    return dict(
        flavor.config_fields(),
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=dict(LLAMA3_ROPE),
        max_position_embeddings=131072,
    )


def family_of(name: str) -> str:
    """The ``model_type`` of built-in architecture ``name`` (``qwen3`` or ``llama``)."""
    return flavors.BUILTIN[name].family if name in flavors.BUILTIN else "qwen3"


#: Built-in architectures (random init): every size of ``roundpipe.flavors`` (Qwen3 and Llama-3.1) plus
#: ``tiny`` (Qwen3) for the default task. ``roundpipe train`` builds them and ``roundpipe plan`` estimates
#: them: one list for both.
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
    **{name: _qwen3(flavor) for name, flavor in flavors.QWEN3.items()},
    **{name: _llama3(flavor) for name, flavor in flavors.LLAMA3.items()},
}


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``name`` (case and ``_`` / ``-`` aside), or ''."""
    by_key = {c.lower().replace("_", "-"): c for c in choices}
    match = difflib.get_close_matches(name.lower().replace("_", "-"), list(by_key), n=1, cutoff=0.6)
    return f" (did you mean '{by_key[match[0]]}'?)" if match else ""


__all__ = ["BUILTIN_MODELS", "LLAMA3_ROPE", "did_you_mean", "family_of"]
