"""Rates and times as tc writes them: parsing ('100mbit', '0.5ms') and printing."""
from __future__ import annotations

import re

_RATE_UNITS = {"bit": 1, "bps": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*")


def _number(value, units: dict, error: str) -> float:
    """A number, or a string of a number and one of ``units`` (none: the base unit)."""
    if isinstance(value, (int, float)):
        return float(value)
    m = _NUMBER.fullmatch(str(value))
    if not m or m.group(2).lower() not in units | {"": 1}:
        raise ValueError(error)
    return float(m.group(1)) * units.get(m.group(2).lower(), 1)


def parse_rate(value) -> float:
    """'100mbit', '1gbit', '2.5gbit', 1e9 -> bits per second (tc's units: powers of 1000)."""
    rate = _number(value, _RATE_UNITS, f"bandwidth {value!r}: expected a number with bit, kbit, mbit or gbit")
    if not rate > 0:
        raise ValueError(f"bandwidth {value!r} must be positive")
    return rate


def parse_time(value) -> float:
    """'0.5ms', '100us', '2ms', 0.001 -> seconds."""
    t = _number(value, _TIME_UNITS, f"time {value!r}: expected a number with s, ms or us")
    if t < 0:
        raise ValueError(f"time {value!r} must not be negative")
    return t


def fmt_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} bit/s"


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"
