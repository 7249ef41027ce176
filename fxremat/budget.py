"""Parse the ``budget`` argument of :func:`fxremat.compile`, :func:`fxremat.plan` and the CLI.

One rule, the same in Python and on the command line (``--budget`` goes through
:func:`parse_budget` as a string):

- ``int``: bytes (``8 * 2**30``). ``1`` is refused: it reads like "100%" and is one byte;
  pass ``1.0`` or ``"100%"`` for the whole baseline peak.
- ``float`` in (0, 1]: that fraction of the predicted peak with no recomputation (the baseline).
- ``str``:
  - ``"min"``: the smallest budget for which a plan exists;
  - a number with a byte unit: ``"800MiB"``, ``"1.5GB"``, ``"2 GiB"``, ``"512 kB"``, ``"1000 B"``
    (``KiB``/``MiB``/``GiB``/``TiB`` are powers of 2**10, ``kB``/``MB``/``GB``/``TB`` powers of
    10**3, case-insensitive). A bare ``"800M"``, ``"2G"``, ``"64k"`` is refused as ambiguous,
    with both spellings offered;
  - a percentage ``"50%"`` in (0, 100], or a bare number in (0, 1] (``"0.5"``, ``"1"``): a
    fraction of the baseline, as a float. A bare number above 1 (``"2000"``, ``"2e9"``) is
    refused: bytes in a string need a unit (``"2e9B"``, ``"2GB"``).

:func:`parse_budget` returns a :class:`Budget` that is resolved to bytes once the baseline peak
is known.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Budget", "parse_budget"]

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_AMBIGUOUS = {"k": ("KiB", "kB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB")}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_PATTERN = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z%]*)\s*$")
_HELP = ("use int bytes, a string with a unit ('800MiB', '1.5GB'), a fraction (0.5, '0.5', '50%') "
         "or 'min'")


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes``, ``fraction`` or ``minimum`` is set."""

    bytes: int | None = None
    fraction: float | None = None
    minimum: bool = False

    def resolve(self, baseline_peak_bytes: int) -> int | None:
        """Bytes for this budget given the baseline peak; ``None`` means "the minimum"."""
        if self.minimum:
            return None
        if self.bytes is not None:
            return self.bytes
        return int(self.fraction * baseline_peak_bytes)

    def __str__(self) -> str:
        if self.minimum:
            return "min"
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction:g} of baseline"


def parse_budget(budget) -> Budget:
    """Validate ``budget`` (see the module docstring for the rule) and return a :class:`Budget`.

    >>> parse_budget("800MiB").bytes == 800 * 2**20
    True
    >>> parse_budget(0.5).fraction == parse_budget("50%").fraction == parse_budget("0.5").fraction
    True
    """
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or budget is None:
        raise TypeError(f"fxremat: budget must be int bytes, str, float or 'min', got {budget!r}; {_HELP}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"fxremat: budget must be positive, got {budget!r} bytes; {_HELP}")
        if budget == 1:
            raise ValueError("fxremat: budget 1 (an int) would be one byte; for the whole baseline peak pass "
                             "1.0 or '100%', for bytes a string with a unit such as '800MiB'")
        return Budget(bytes=budget)
    if isinstance(budget, float):
        return _fraction(budget, repr(budget))
    if isinstance(budget, str):
        return _parse_str(budget)
    raise TypeError(f"fxremat: budget must be int, str or float, got {type(budget).__name__} {budget!r}; {_HELP}")


def _fraction(value: float, shown: str) -> Budget:
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(
            f"fxremat: a fraction budget must be in (0, 1] (of the baseline peak), got {shown}; "
            f"for bytes pass an int or a string with a unit such as '800MiB'; {_HELP}"
        )
    return Budget(fraction=value)


def _parse_str(text: str) -> Budget:
    if text.strip().lower() == "min":
        return Budget(minimum=True)
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"fxremat: cannot parse budget {text!r}; {_HELP}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0.0 < number <= 100.0:
            raise ValueError(f"fxremat: a percentage budget must be in (0%, 100%], got {text!r}; {_HELP}")
        return Budget(fraction=number / 100)
    if unit == "":
        if number > 1.0:
            raise ValueError(
                f"fxremat: budget {text!r} has no unit: a bare number is a fraction in (0, 1]; for bytes "
                f"write '{match.group(1)}B', or use MiB/GiB ('800MiB') or MB/GB ('800MB'); {_HELP}"
            )
        return _fraction(number, repr(text))
    if unit in _AMBIGUOUS:
        binary, decimal = _AMBIGUOUS[unit]
        raise ValueError(
            f"fxremat: budget {text!r} is ambiguous: write '{match.group(1)}{binary}' ({match.group(1)} x "
            f"2**{10 * (list(_AMBIGUOUS).index(unit) + 1)} bytes) or '{match.group(1)}{decimal}' "
            f"({match.group(1)} x 10**{3 * (list(_AMBIGUOUS).index(unit) + 1)} bytes)"
        )
    if unit not in _UNITS:
        raise ValueError(f"fxremat: cannot parse budget {text!r} (unknown unit {match.group(2)!r}); {_HELP}")
    value = number * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"fxremat: budget {text!r} is not a positive number of bytes; {_HELP}")
    return Budget(bytes=int(value))
