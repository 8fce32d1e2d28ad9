"""Checks of the options a component takes (``aggregator_options``, ``algorithm_options``):
a value the float32 engine cannot use is refused in one line that names the option."""
from __future__ import annotations

import math

import torch

from .errors import ConfigError

FLOAT32 = torch.finfo(torch.float32)


def is_number(value) -> bool:
    # an int is finite however large (math.isfinite would raise OverflowError above 1.8e308)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        isinstance(value, int) or math.isfinite(value))


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Options:
    """The checks for one section's options; each returns the value or raises ConfigError."""

    def __init__(self, section: str):
        self.section = section

    def fail(self, message: str):
        raise ConfigError(f"{self.section}: {message}")

    def positive(self, name: str, value) -> float:
        """A number > 0 that float32 holds at full precision: in its normal range, so that it
        neither overflows to inf nor becomes a subnormal or 0 (``max_norm = 1e-45`` would
        otherwise clip every update to zero)."""
        if not is_number(value) or not FLOAT32.tiny <= value <= FLOAT32.max:
            self.fail(f"{name} must be a number > 0 in float32's normal range "
                      f"[{FLOAT32.tiny:.3g}, {FLOAT32.max:.3g}], got {value!r}")
        return float(value)

    def non_negative(self, name: str, value) -> float:
        """0, or a positive number as above."""
        return 0.0 if is_number(value) and value == 0 else self.positive(name, value)

    def count(self, name: str, value, low: int, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if not is_integer(value) or value < low:
            self.fail(f"{name} must be an integer >= {low}{' (or null)' if optional else ''}, got {value!r}")
        return value
