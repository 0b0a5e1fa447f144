"""Integrations of RoundPipe with other training libraries.

* :mod:`roundpipe.integrations.hf_trainer`: Hugging Face ``transformers.Trainer`` and TRL's
  ``SFTTrainer`` train a RoundPipe-wrapped model (``RoundPipeTrainer``, ``RoundPipeTrainerMixin``,
  ``with_roundpipe``).

Imported on first use: transformers is an optional dependency.
"""

from typing import Any

__all__ = ["RoundPipeOptimizer", "RoundPipeTrainer", "RoundPipeTrainerMixin", "with_roundpipe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from roundpipe.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'roundpipe.integrations' has no attribute {name!r}")
