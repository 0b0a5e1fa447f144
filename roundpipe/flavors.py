"""The model sizes RoundPipe knows by name, two tables: ``roundpipe train --model qwen3-1.7b`` (random
init), ``roundpipe plan`` and the memory estimate (``roundpipe.planning.estimate.ModelShape.builtin``), and the
benchmarks (``bench/train_bench.py``'s ``WORKLOADS``) all read :data:`BUILTIN` (:data:`QWEN3` and :data:`LLAMA3`).

The Qwen3 sizes are those of ``shared/bench/WORKLOADS.md`` (vocab 151936, head_dim 128), plus qwen3-32b; the
Llama sizes are Llama-3.1's (vocab 128256, head_dim 128, untied); ``plan`` and ``train`` accept the same names
(``roundpipe.cli.model_names``). A flavor is the shape only: what else a
config sets (rotary base, norm epsilon, position limit) stays with the one building it.

Data only, no torch: the CLI checks a model name before torch loads, which is why this table is not in
``roundpipe/models/`` (importing that package loads torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

QWEN3_VOCAB = 151936
"""Vocabulary size of every Qwen3 flavor."""
QWEN3_HEAD_DIM = 128
"""Width of one attention head of every Qwen3 flavor."""
LLAMA3_VOCAB = 128256
"""Vocabulary size of every Llama-3.1 flavor."""


@dataclass(frozen=True)
class Flavor:
    """One size of an architecture (the config fields that differ between sizes)."""

    hidden: int
    """``hidden_size``."""
    intermediate: int
    """``intermediate_size`` (the MLP's width)."""
    layers: int
    """``num_hidden_layers``."""
    heads: int
    """``num_attention_heads``."""
    kv_heads: int
    """``num_key_value_heads``."""
    tied: bool
    """``tie_word_embeddings``: the output head shares the embedding's weights."""
    head_dim: int = QWEN3_HEAD_DIM
    """``head_dim``."""
    vocab: int = QWEN3_VOCAB
    """``vocab_size``."""
    family: str = "qwen3"
    """The config's ``model_type``: ``qwen3`` (``Qwen3Config``) or ``llama`` (``LlamaConfig``)."""

    def config_fields(self) -> Dict[str, Any]:
        """These sizes as config keyword arguments, the same in ``Qwen3Config`` and ``LlamaConfig`` (what a builder
        adds to them is its own)."""
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tied,
        )


QWEN3: Dict[str, Flavor] = {
    "qwen3-0.6b": Flavor(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-1.7b": Flavor(2048, 6144, 28, 16, 8, tied=True),
    "qwen3-4b": Flavor(2560, 9728, 36, 32, 8, tied=True),
    "qwen3-8b": Flavor(4096, 12288, 36, 32, 8, tied=False),
    "qwen3-14b": Flavor(5120, 17408, 40, 40, 8, tied=False),
    "qwen3-32b": Flavor(5120, 25600, 64, 64, 8, tied=False),
}
"""Flavor name -> its sizes, smallest first."""

LLAMA3: Dict[str, Flavor] = {
    "llama3.1-8b": Flavor(4096, 14336, 32, 32, 8, tied=False, vocab=LLAMA3_VOCAB, family="llama"),
    "llama3.1-70b": Flavor(8192, 28672, 80, 64, 8, tied=False, vocab=LLAMA3_VOCAB, family="llama"),
}
"""The Llama-3.1 sizes, smallest first."""

BUILTIN: Dict[str, Flavor] = {**QWEN3, **LLAMA3}
"""Every flavor by name: what ``plan``, ``train`` and the benchmarks accept."""

__all__ = ["BUILTIN", "LLAMA3", "LLAMA3_VOCAB", "QWEN3", "QWEN3_HEAD_DIM", "QWEN3_VOCAB", "Flavor"]
