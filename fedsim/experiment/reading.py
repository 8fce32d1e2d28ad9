"""Reading an experiment's raw mapping into ``Config`` and its sections: each value against its
field's type, an unknown key refused with a suggestion, and every error named by where its value
came from (the file, ``--set``, or a keyword of ``fedsim.run``)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from ..core.errors import ConfigError, FedsimError, cut, shown
from ..core.overrides import overlap
from ..core.sections import section_type
from .config import KEYS, Config


def where(origin: str, key: str, from_overrides: dict[str, str]) -> str:
    """Where a key's value came from: ``--set key`` or ``keyword key``, as its user spelled it
    (also when that gave one of its sub-keys, such as aggregator_options.beta, or the whole of which
    it is a part, such as pre_aggregators for pre_aggregators.nnm; see apply_overrides), or
    ``FILE: key``."""
    spelled = from_overrides.get(key) or next((s for k, s in from_overrides.items() if overlap(k, key)), None)
    return f"{spelled} {key}" if spelled else f"{origin}: {key}"


def locate(cfg: Config, error: FedsimError) -> FedsimError:
    """An error found after loading (when the data is split, say) that names a key, named as
    validation names it: with the file, or the --set (or keyword), that gave the value."""
    origin, overrides = getattr(cfg, "origin", ("config", {}))
    key, sep, rest = str(error).partition(": ")
    if not sep or key not in KEYS:
        return error
    located = copy.copy(error)
    located.args = (f"{where(origin, key, overrides)}: {rest}",)
    return located


def build(cls, raw: dict, prefix: str, origin: str, from_overrides: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in _MOVED:
            raise ConfigError(f"{where(origin, dotted, from_overrides)}: is now {_MOVED[dotted]}")
        if key not in known:
            # a key of a section given on its own (lr for local.lr) is that key before one that is spelled alike
            inside = [f"{prefix}{name}.{key}" for name in known if key in _field_names(section_type(hints[name]))]
            close = inside or [prefix + c for c in difflib.get_close_matches(str(key), known, n=1)]
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"{where(origin, cut(dotted), from_overrides)}: unknown key{hint}")
        hint, section = hints[key], section_type(hints[key])
        if section is not None:
            if value is None and section is not hint:  # an optional section left out: `privacy: null`
                kwargs[key] = None
                continue
            if value is None:  # `local:` with every key commented out
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{where(origin, dotted, from_overrides)}: expected a mapping of keys, got {shown(value)}"
                )
            kwargs[key] = build(section, value, dotted + ".", origin, from_overrides)
        else:
            kwargs[key] = _coerce(value, hint, where(origin, dotted, from_overrides))
    return cls(**kwargs)


def _field_names(section) -> set[str]:
    return {f.name for f in dataclasses.fields(section)} if section is not None else set()


_TYPE_WORDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a mapping",
    list: "a list",
    Any: "a name, an import path (pkg.module:name) or, from Python, the object",
}
_MOVED = {"local.mu": "algorithm_options.mu (with algorithm: fedprox)"}
# Integers become int64 tensors and seeds, floats float32 tensor values: beyond these the
# engine cannot represent a value, so validation refuses it rather than a later traceback.
MAX_INT = 2**63 - 1
MAX_FLOAT = 3.4e38
MIN_FLOAT = 1.18e-38  # smaller magnitudes are float32 subnormals: an lr of 1e-45 would be 0


def _coerce(value, hint, where: str):
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: expected {_TYPE_WORDS[hint]}, got null")
    if hint is Any:  # a component: checked when it is resolved (components.check)
        return value
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        dict: isinstance(value, dict),
        list: isinstance(value, list),
    }[hint]
    if not ok:
        raise ConfigError(f"{where}: expected {_TYPE_WORDS[hint]}, got {shown(value)}")
    if hint is int and abs(value) > MAX_INT:
        raise ConfigError(
            f"{where}: must be within ±(2^63 - 1), the 64-bit integers the engine computes "
            f"with; got a {value.bit_length()}-bit integer"
        )
    if hint is float:
        value = float(value)
        if not math.isfinite(value) or abs(value) > MAX_FLOAT or 0 < abs(value) < MIN_FLOAT:
            raise ConfigError(
                f"{where}: must be a finite number within ±3.4e38 (float32), and 0 or at least "
                f"1.2e-38 in size, got {value}"
            )
    if hint is str and ("\0" in value or len(value) > 1000):
        raise ConfigError(f"{where}: must be text of at most 1,000 characters without NUL bytes")
    return value
