"""A sweep's grid: the axes of ``--grid`` and of the experiment file's own ``sweep`` section, so
that a file can hold a whole benchmark and ``fedsim sweep FILE`` runs it:

```yaml
sweep:
  grid:
    attack.type: [sign_flip, optimal_ipm]     # a key and its values
    rule:                                     # a named axis: each value a name and the keys it sets
      trimmed_mean: {aggregator: trimmed_mean}
      geometric_median: {aggregator: geometric_median, aggregator_options: {eps: 0.01}}
  seeds: [0, 1, 2]
```

A named axis sets several keys at once (a rule with its own options); its runs are named by the
value's name (``rule=geometric_median``). ``--grid`` adds axes, replaces the file's axis of the same
key, or picks values of a named axis by name; ``--seeds`` replaces the file's seeds. Two axes that
set the same key are refused: the later one would override the other's value, and the run would
still be named by both. ``fedsim run`` runs the file's configuration without its grid.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import yaml

from ..core.errors import ConfigError, shown
from ..core.overrides import apply_overrides, overlap, parse_grid
from ..core.yamlfile import experiment_file, read_yaml
from ..experiment.config import SECTIONS

# (key or axis name, [(value as named in the run's name, the "key=value" overrides it sets)])
Axis = tuple[str, list[tuple[str, list[str]]]]


def file_sweep(source: Any) -> tuple[str, dict]:
    """The experiment's ``sweep`` section ({} without one) and where it came from."""
    if isinstance(source, dict):
        where, raw = "config", source
    elif isinstance(source, (str, os.PathLike)):
        where = str(source)
        raw = read_yaml(experiment_file(source))
    else:  # a Config holds no grid
        return "config", {}
    section = raw.get("sweep") or {}
    if not isinstance(section, dict) or set(section) - {"grid", "seeds"}:
        raise ConfigError(f"{where}: sweep: expected a mapping of grid and seeds, got {shown(section)}")
    return where, section


def grid_axes(source: Any, grid: list[str]) -> tuple[list[Axis], Any, str]:
    """The sweep's axes, in order: the file's (a ``--grid`` of the same key in its place), then the
    other ``--grid`` keys; the file's seeds (None where it gives none), and the file's name."""
    where, section = file_sweep(source)
    in_file = section.get("grid") or {}
    if not isinstance(in_file, dict):
        raise ConfigError(f"{where}: sweep.grid: expected a mapping from keys to their values, got {shown(in_file)}")
    axes = [_file_axis(where, key, values) for key, values in in_file.items()]
    for key, texts in parse_grid(grid):
        if isinstance(in_file.get(key), dict):  # a named axis: --grid picks its values by name
            chosen = _choose(key, texts, dict(axes)[key])
        else:
            chosen = [(text, [f"{key}={text}"]) for text in texts]
        position = next((i for i, (k, _) in enumerate(axes) if k == key), len(axes))
        axes[position : position + 1] = [(key, chosen)]
    refuse_overlaps(axes)
    return axes, section.get("seeds"), where


def set_keys(values: list[tuple[str, list[str]]]) -> set[str]:
    """The dotted keys that values of an axis set, a section's mapping (``data: {gamma: 0}``) as
    the keys it sets, as the run's configuration is built (apply_overrides)."""
    keys = set()
    for _, settings in values:
        try:
            keys |= set(apply_overrides({}, settings, sections=SECTIONS))
        except ConfigError:
            pass  # a value that cannot be read is refused, named, when its grid point is loaded
    return keys


def refuse_overlaps(axes: list[Axis]) -> None:
    """Two axes that set the same key: every run would keep only the later axis's value while
    its name says both, so a table or pivot row would hold runs of another value."""
    seen: list[tuple[str, str]] = []  # (axis, key it sets)
    for axis in axes:
        keys = sorted(set_keys(axis[1]))
        for key in keys:
            for other, known in seen:
                if overlap(key, known):
                    raise ConfigError(
                        f"--grid: axes {other} and {axis[0]} both set {max(key, known, key=len)}, so a run would "
                        f"keep only one of their values; set each key on one axis"
                    )
        seen += [(axis[0], key) for key in keys]


def _file_axis(where: str, key: object, values: object) -> Axis:
    """One entry of ``sweep.grid``: a key and a list of its values, or an axis name and a mapping
    from each value's name to the keys it sets."""
    place = f"{where}: sweep.grid.{key}"
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: sweep.grid: each axis is named by a key, got {shown(key)}")
    if isinstance(values, list) and values:  # any values, lists included, as --grid gives them
        return key, [(_text(v), [f"{key}={json.dumps(v)}"]) for v in values]
    if isinstance(values, dict) and values and all(isinstance(v, dict) and v for v in values.values()):
        return key, [
            (str(name), [f"{k}={json.dumps(v)}" for k, v in settings.items()]) for name, settings in values.items()
        ]
    raise ConfigError(
        f"{place}: expected a list of values (attack.type: [ipm, alie]) or a mapping from each value's name to "
        f"the keys it sets (rule: {{gm: {{aggregator: geometric_median}}}}), got {shown(values)}"
    )


def _choose(key: str, names: Iterable[str], values: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The values of the file's named axis ``key`` that ``--grid key=...`` names."""
    by_name = dict(values)
    for name in names:
        if name not in by_name:
            raise ConfigError(
                f"--grid {key}={name}: the file's axis {key} has no value {name}; it has {', '.join(by_name)}"
            )
    return [(name, by_name[name]) for name in names]


def _text(value: object) -> str:
    """A value as the run's name shows it, as ``--grid`` would have spelled it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):  # [{arc: {f: 1}}], not Python's [{'arc': {'f': 1}}]
        return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return str(value)
