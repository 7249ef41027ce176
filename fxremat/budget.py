"""Parse the ``budget`` argument of :func:`fxremat.compile` / :func:`fxremat.plan`.

A budget is one of
- ``int``: bytes;
- ``str`` with a unit: ``"800MiB"``, ``"1.5GB"``, ``"2 GiB"``, ``"512 kB"``, ``"1000 B"``;
- ``float`` in (0, 1]: that fraction of the predicted peak with no recomputation;
- ``"min"``: the smallest budget for which a plan exists.

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
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*$")
_HELP = "use bytes (int), a string such as '800MiB' or '1.5GB', a fraction in (0, 1], or 'min'"


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
    """Validate ``budget`` and return a :class:`Budget`.

    >>> parse_budget("800MiB").bytes == 800 * 2**20
    True
    >>> parse_budget(0.5).fraction
    0.5
    """
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or budget is None:
        raise TypeError(f"fxremat: budget must be int bytes, str, float or 'min', got {budget!r}; {_HELP}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"fxremat: budget must be positive, got {budget!r} bytes; {_HELP}")
        return Budget(bytes=budget)
    if isinstance(budget, float):
        if math.isnan(budget) or not 0.0 < budget <= 1.0:
            raise ValueError(
                f"fxremat: a float budget is a fraction of the baseline peak in (0, 1], got {budget!r}; "
                f"for bytes pass an int or a string with a unit; {_HELP}"
            )
        return Budget(fraction=budget)
    if isinstance(budget, str):
        return _parse_str(budget)
    raise TypeError(f"fxremat: budget must be int, str or float, got {type(budget).__name__} {budget!r}; {_HELP}")


def _parse_str(text: str) -> Budget:
    if text.strip().lower() == "min":
        return Budget(minimum=True)
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"fxremat: cannot parse budget {text!r}; {_HELP}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"fxremat: budget {text!r} is not a positive number of bytes; {_HELP}")
    return Budget(bytes=int(value))
