"""How far a model's rotary positions reach, and how to stretch them: the position limit a run is checked against.

A config's limit is ``max_position_embeddings`` unless its rotary scaling (``rope_parameters``, or the older
``rope_scaling``, with its ``rope_type``) stretches it, read as transformers builds the rotary tables from it
(``transformers.modeling_rope_utils``):

* ``linear`` and ``dynamic`` scale the pretrained length, which transformers takes to be
  ``max_position_embeddings`` (dynamic NTK divides by it): the limit is ``max_position_embeddings * factor``;
* ``yarn``, ``llama3`` (and ``longrope``) name the pretrained length, ``original_max_position_embeddings`` (by
  default ``max_position_embeddings``, as transformers fills it in): the limit is ``original * factor``, or
  ``max_position_embeddings`` where the config says more (Llama-3.1: 131,072 from 8,192 x 8).

:func:`with_rope_scaling` sets a scaling from a short spec (``"yarn:4"``), as ``roundpipe train --rope-scaling``
and ``roundpipe plan --rope-scaling`` do. The same functions read a config.json dict (``roundpipe plan``, no
transformers) and a ``PretrainedConfig``. Data and arithmetic only, no torch: the CLI checks a run before torch
loads, which is why this is not in ``roundpipe/models/`` (that package loads torch); ``roundpipe.models``
re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

SPEC_FORMS = "yarn:F, linear:F, dynamic:F, llama3:F or none (F: a factor of at least 1, e.g. yarn:4)"
"""The accepted forms of a scaling spec, as error messages name them."""

ROPE_TYPES = ("yarn", "linear", "dynamic", "llama3")
"""The scalings a spec can set (``none`` removes one)."""

NAMED_ORIGINAL = ("yarn", "llama3", "longrope")
"""Scalings whose parameters name the pretrained length (``original_max_position_embeddings``)."""

LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""The frequency bands of Llama-3.1's scaling (its config.json), which a ``llama3:F`` spec keeps."""


@dataclass(frozen=True)
class RopeSpec:
    """A parsed scaling spec: ``rope_type`` one of :data:`ROPE_TYPES`, or ``none`` with ``factor`` 1."""

    rope_type: str
    factor: float

    def __str__(self) -> str:
        return "none" if self.rope_type == "none" else f"{self.rope_type}:{self.factor:g}"


def parse_spec(spec: str) -> RopeSpec:
    """``"yarn:4"`` -> ``RopeSpec("yarn", 4.0)``; a ``ValueError`` of one line naming :data:`SPEC_FORMS` otherwise."""
    text = str(spec).strip().lower()
    if text == "none":
        return RopeSpec("none", 1.0)
    kind, sep, value = text.partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = math.nan
    if not sep or kind not in ROPE_TYPES or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"rope scaling {spec!r} is not one of {SPEC_FORMS}")
    return RopeSpec(kind, factor)


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _set(config: Any, name: str, value: Any) -> None:
    if isinstance(config, dict):
        config[name] = value
    else:
        setattr(config, name, value)


def rope_dicts(config: Any) -> List[Dict[str, Any]]:
    """The config's rotary parameters: one dict, or one per layer type where they are nested by it (empty when
    the config has none). ``rope_scaling`` wins over ``rope_parameters``, as transformers reads a config.json."""
    params = _get(config, "rope_scaling") or _get(config, "rope_parameters") or {}
    if not isinstance(params, dict):
        return []
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(params) else [params]


def _rope_type(params: Dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def original_length(config: Any, params: Optional[Dict[str, Any]] = None) -> Optional[int]:
    """The pretrained length a scaling stretches: ``original_max_position_embeddings`` for the scalings that name
    it (a top-level one first, as transformers reads Phi-3), else ``max_position_embeddings``."""
    limit = _get(config, "max_position_embeddings")
    params = params if params is not None else (rope_dicts(config) or [{}])[0]
    if _rope_type(params) in NAMED_ORIGINAL:
        named = _get(config, "original_max_position_embeddings") or params.get("original_max_position_embeddings")
        if isinstance(named, int) and named > 0:
            return named
    return limit if isinstance(limit, int) else None


def _one_limit(config: Any, params: Dict[str, Any]) -> Optional[int]:
    limit = _get(config, "max_position_embeddings")
    if not isinstance(limit, int):
        return None
    factor = params.get("factor")
    kind = _rope_type(params)
    if not isinstance(factor, (int, float)) or factor < 1:
        return limit
    if kind in ("linear", "dynamic"):
        return int(limit * factor)
    if kind in NAMED_ORIGINAL:
        return max(limit, int((original_length(config, params) or limit) * factor))
    return limit


def position_limit(config: Any) -> Optional[int]:
    """The longest sequence ``config`` (a ``PretrainedConfig`` or a config.json dict) takes, its rotary scaling
    counted (see the module docstring); None when it names no ``max_position_embeddings``."""
    limits = [_one_limit(config, p) for p in rope_dicts(config)] or [_one_limit(config, {})]
    known = [n for n in limits if n is not None]
    return min(known) if known else None


def describe_limit(config: Any) -> str:
    """The limit and where it comes from: ``max_position_embeddings=40960``, or
    ``131072: yarn factor 4 of original_max_position_embeddings=32768``."""
    limit = position_limit(config)
    scaled = [p for p in rope_dicts(config) if _rope_type(p) not in ("default", "none")]
    if not scaled or limit == _get(config, "max_position_embeddings"):
        return f"max_position_embeddings={_get(config, 'max_position_embeddings')}"
    p = scaled[0]
    kind = _rope_type(p)
    base = "original_max_position_embeddings" if kind in NAMED_ORIGINAL else "max_position_embeddings"
    return f"{limit}: {kind} factor {p.get('factor'):g} of {base}={original_length(config, p)}"


def with_rope_scaling(config: Any, spec: str) -> Any:
    """``config`` (a ``PretrainedConfig`` or a config.json dict) with the rotary scaling of ``spec`` (see
    :func:`parse_spec`), changed in place and returned; any scaling it had is replaced.

    The pretrained length (:func:`original_length`) is kept: ``yarn:F`` and ``llama3:F`` record it as
    ``original_max_position_embeddings`` and set ``max_position_embeddings`` to it times F (as Qwen documents
    YaRN); ``linear:F`` and ``dynamic:F`` keep ``max_position_embeddings``, which transformers reads as the
    pretrained length. ``none`` removes the scaling and restores the pretrained length. The rotary base
    (``rope_theta``) and a partial rotary factor stay. Raises ``ValueError`` for a bad spec.
    """
    parsed = parse_spec(spec)
    old = (rope_dicts(config) or [{}])[0]
    original = original_length(config, old)
    if original is None:
        raise ValueError("the config has no max_position_embeddings to scale")
    params = {k: v for k, v in old.items() if k in ("rope_theta", "partial_rotary_factor")}
    if "rope_theta" not in params and _get(config, "rope_theta") is not None:
        params["rope_theta"] = _get(config, "rope_theta")
    limit = original
    if parsed.rope_type == "none":
        params["rope_type"] = "default"
    else:
        params.update(rope_type=parsed.rope_type, factor=parsed.factor)
        if parsed.rope_type in NAMED_ORIGINAL:
            params["original_max_position_embeddings"] = original
            limit = int(original * parsed.factor)
        if parsed.rope_type == "llama3":
            params.update(LLAMA3_DEFAULTS)
    if isinstance(config, dict):
        config.pop("rope_scaling", None)
        config.pop("original_max_position_embeddings", None)
    elif getattr(config, "original_max_position_embeddings", None) is not None:
        config.original_max_position_embeddings = original
    _set(config, "rope_parameters", params)
    _set(config, "max_position_embeddings", limit)
    if not isinstance(config, dict):  # transformers' own normal form, checked as loading a config.json does
        for step in ("standardize_rope_params", "validate_rope"):
            if callable(getattr(config, step, None)):
                getattr(config, step)()
    return config


def fitting_factor(config: Any, seq_len: int) -> int:
    """The YaRN factor that lets ``seq_len`` tokens fit: ``seq_len`` over the pretrained length, rounded up to a
    power of two."""
    base = original_length(config) or seq_len
    return 1 << max(0, math.ceil(math.log2(math.ceil(seq_len / base))))


def check_length(config: Any, seq_len: int, python: bool = False) -> None:
    """Raise :class:`SequenceTooLong` when ``seq_len`` exceeds :func:`position_limit`: the message names both
    fixes, as flags (``--rope-scaling``, ``--seq-len``) or, with ``python``, as the Python calls."""
    limit = position_limit(config)
    if limit is None or seq_len <= limit:
        return
    factor = fitting_factor(config, seq_len)
    what = f"seq_len={seq_len} exceeds the model's limit ({describe_limit(config)})"
    if python:
        fix = (
            f"scale its rotary positions with roundpipe.models.with_rope_scaling(config, 'yarn:{factor}') before "
            f"from_pretrained(..., config=config), or use sequences of at most {limit} tokens"
        )
    else:
        fix = f"add --rope-scaling yarn:{factor}, or lower --seq-len to at most {limit}"
    raise SequenceTooLong(what, fix)


class SequenceTooLong(ValueError):
    """A sequence past the model's position limit: ``what`` and ``fix`` as one line (``what — fix``)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} — {fix}")
        self.what, self.fix = what, fix


__all__ = [
    "ROPE_TYPES",
    "SPEC_FORMS",
    "RopeSpec",
    "SequenceTooLong",
    "check_length",
    "describe_limit",
    "fitting_factor",
    "original_length",
    "parse_spec",
    "position_limit",
    "rope_dicts",
    "with_rope_scaling",
]
