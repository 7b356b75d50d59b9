"""How plan numbers are rounded, so a plan is byte-identical wherever it is compiled."""

from __future__ import annotations


def r3(value: float) -> float:
    """Round for byte-stable plans."""
    return round(float(value), 3)


def significant(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits: 0.0001357 stays non-zero where 3 decimals would print 0.0."""
    return float(f"{float(value):.{digits}g}")


def r4(value: float) -> float:
    """Ray resource shares are kept to four decimals (Ray's own granularity)."""
    return float(int(value * 10_000) / 10_000)
