"""The one way fedsim checks a value: every config section, option mapping and feature uses it.

``Checks(section)`` checks the keys of one section; each check returns the value it accepts or
raises a one-line ConfigError that starts with the key, ``section.key: must be ...``, so that
loading can prefix it with the file or ``--set`` that gave the value (see config.locate).
An option mapping (``aggregator_options``, ``algorithm_options``) is one key holding many
options: ``Checks("aggregator_options", options=True)`` names the option in the message,
``aggregator_options: beta must be ...``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from types import SimpleNamespace
from typing import NoReturn

import numpy as np

from .errors import ConfigError, cut, did_you_mean, shown
from .registry import Registry

# torch.finfo(torch.float32)'s bounds, as Python floats: this module is read before torch is
# imported (the command line reads an experiment's overrides while the fork server imports torch)
FLOAT32 = SimpleNamespace(tiny=float(np.finfo(np.float32).tiny), max=float(np.finfo(np.float32).max))


def is_number(value: object) -> bool:
    """A finite int or float (numpy's too), not a bool. An int is finite however large
    (math.isfinite would raise OverflowError above 1.8e308)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return isinstance(value, (int, np.integer)) or math.isfinite(value)


def is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class Checks:
    """The checks of one section's values (``section`` "" for the top level)."""

    def __init__(self, section: str = "", options: bool = False):
        self.section, self.options = section, options

    def fail(self, key: str, message: str) -> NoReturn:
        if self.options:
            raise ConfigError(f"{self.section}: {key} {message}")
        raise ConfigError(f"{self.section}.{key}: {message}" if self.section else f"{key}: {message}")

    def at_least(self, key: str, value: float, low: float) -> float:
        if value < low:
            self.fail(key, f"must be >= {low}, got {value}")
        return value

    def within(self, key: str, value: float, low: float, high: float, bounds: str = "[]", why: str = "") -> float:
        """``low <= value <= high``, with ``bounds`` saying which ends are open: "[)", "(]", ..."""
        above = value > low if bounds[0] == "(" else value >= low
        below = value < high if bounds[1] == ")" else value <= high
        if not (above and below):
            self.fail(key, f"must be in {bounds[0]}{low}, {high}{bounds[1]}{why}, got {value}")
        return value

    def one_of(self, key: str, value: object, allowed: Collection[str]) -> str:
        if value not in allowed:
            self.fail(key, f"must be one of {', '.join(allowed)}, got {cut(repr(value))}{did_you_mean(value, allowed)}")
        return value

    def choice(self, key: str, value: object, table: Registry) -> str:
        """A name registered in ``table`` (a Registry)."""
        if value not in table:
            self.fail(
                key,
                f"unknown {table.kind} {cut(repr(value))}{did_you_mean(value, table.names())}; choose one "
                f"of: {', '.join(table.names())}",
            )
        return value

    def number(self, key: str, value: object, what: str) -> float:
        """A finite number; ``what`` says what is expected when it is not one."""
        if not is_number(value):
            self.fail(key, f"{what}, got {shown(value)}")
        return float(value)

    def positive(self, key: str, value: object) -> float:
        """A number > 0 that float32 holds at full precision: in its normal range, so that it
        neither overflows to inf nor becomes a subnormal or 0 (``max_norm = 1e-45`` would
        otherwise clip every update to zero)."""
        if not is_number(value) or not FLOAT32.tiny <= value <= FLOAT32.max:
            self.fail(
                key,
                f"must be a number > 0 in float32's normal range "
                f"[{FLOAT32.tiny:.3g}, {FLOAT32.max:.3g}], got {value!r}",
            )
        return float(value)

    def non_negative(self, key: str, value: object) -> float:
        """0, or a positive number as above."""
        if is_number(value) and (value == 0 or FLOAT32.tiny <= value <= FLOAT32.max):
            return float(value)
        self.fail(
            key,
            f"must be 0 or a number > 0 in float32's normal range [{FLOAT32.tiny:.3g}, {FLOAT32.max:.3g}], "
            f"got {value!r}",
        )

    def count(self, key: str, value: object, low: int, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if not is_integer(value) or value < low:
            self.fail(key, f"must be an integer >= {low}{' (or null)' if optional else ''}, got {value!r}")
        return int(value)

    def mapping(self, value: object, keys: Collection[str]) -> dict:
        """A section given as a mapping (or a dataclass instance) of the ``keys`` alone."""
        if value is None:
            return {}
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
            return {key: getattr(value, key) for key in value.__dataclass_fields__}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.section}: expected a mapping of {', '.join(keys)}, got {shown(value)}")
        unknown = [str(key) for key in value if key not in keys]
        if unknown:
            self.fail(unknown[0], f"unknown key; choose among: {', '.join(keys)}")
        return dict(value)


def refuse_unknown(section: str, name: str, options: Mapping, takes: list[str]) -> None:
    """One line for the first of ``options`` that the component ``name`` does not take (``takes``)."""
    unknown = sorted(set(options) - set(takes))
    if unknown:
        listed = f"it takes: {', '.join(takes)}" if takes else "it takes no options"
        option, colon, value = str(unknown[0]).partition(":")
        if colon and option in takes:  # {s:0} is one key in YAML, "s:0"; {s: 0} is s = 0
            listed += f" (YAML reads a colon with no space after it as part of the name: write {option}: {value})"
        raise ConfigError(f"{section}: {name} takes no option {unknown[0]!r}; {listed}")
