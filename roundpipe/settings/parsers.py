"""The parsers that turn an ``RPP_*`` variable's text into its value (see :mod:`roundpipe.settings`).

Apart from the settings table because they are a small vocabulary of their own (boolean words, device
specs, bounded numbers, sizes) that the table and the CLI share. Each raises ``ValueError("")`` on
text it does not accept; the setting adds its name and what it accepts to the message.
"""

from __future__ import annotations

from typing import Callable, Optional

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def boolean(raw: str) -> bool:
    """A boolean word (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, any case)."""
    word = raw.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("")


def device_spec(raw: str) -> str:
    """``cuda``, ``cuda:0,2`` or ``cpu:N`` (syntax only; the device layer checks what exists)."""
    spec = raw.strip().lower()
    kind, sep, rest = spec.partition(":")
    if kind == "cpu" and (not sep or (rest.isdigit() and int(rest) >= 1)):
        return spec
    if kind == "cuda" and (not sep or (rest and all(x.strip().isdigit() for x in rest.split(",")))):
        return spec
    raise ValueError("")


def tristate(raw: str) -> str:
    """``auto``, or a boolean word as ``"1"`` / ``"0"``."""
    return "auto" if raw.lower() == "auto" else ("1" if boolean(raw) else "0")


def choice(*options: str) -> Callable[[str], str]:
    """A parser accepting one of ``options`` (any case), returned lower-case."""

    def parse(raw: str) -> str:
        word = raw.lower()
        if word not in options:
            raise ValueError("")
        return word

    return parse


def number(low: float, low_inclusive: bool = True) -> Callable[[str], float]:
    """A parser of a finite number at least ``low`` (above it when not ``low_inclusive``)."""

    def parse(raw: str) -> float:
        value = float(raw)
        if value != value or value == float("inf") or value < low or (value == low and not low_inclusive):
            raise ValueError("")
        return value

    return parse


def integer(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """A parser of an integer in ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(raw: str) -> int:
        value = int(raw)
        if value < low or (high is not None and value > high):
            raise ValueError("")
        return value

    return parse


def profiler_kind(raw: str) -> Optional[str]:
    """``torch`` or ``nvtx``; None for ``0`` / ``off`` / ``none``."""
    word = raw.lower()
    if word in ("0", "off", "none"):
        return None
    if word not in ("torch", "nvtx"):
        raise ValueError("")
    return word


def parse_size_gib(raw: str) -> float:
    """``24GiB``, ``24GB``, ``24G``, ``24576MiB`` or a plain number of GiB -> GiB."""
    text = raw.strip().lower().replace(" ", "")
    units = {
        "gib": 1.0,
        "gb": 1e9 / 2**30,
        "g": 1.0,
        "mib": 1 / 1024,
        "mb": 1e6 / 2**30,
        "m": 1 / 1024,
        "tib": 1024.0,
        "tb": 1e12 / 2**30,
    }
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            value = float(text[: -len(suffix)]) * units[suffix]
            break
    else:
        value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError("")
    return value
