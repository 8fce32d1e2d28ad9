"""Keys set on top of an experiment file: ``--set dotted.key=value``, ``--grid key=v1,v2``, and
``fedsim.run``'s keywords, written into the file's raw mapping. Neither torch nor the sections are
imported here, so that the command line can read what its runs will be while the fork server
imports torch."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import yaml

from .errors import ConfigError, cut, shown
from .yamlfile import RefusedYAML, parse_yaml


def overlap(key: str, other: str) -> bool:
    """Whether setting one dotted key changes the other: the same key, or a key and one inside its
    mapping or list (aggregator_options and aggregator_options.beta, pre_aggregators and
    pre_aggregators[1])."""
    return key == other or _inside(key, other) or _inside(other, key)


def _inside(key: str, whole: str) -> bool:
    return key.startswith((whole + ".", whole + "["))


def with_keys_added_since(recorded: dict, defaults: dict) -> dict:
    """A config recorded as dotted keys by an earlier fedsim, with the keys added since at their
    ``defaults`` (the run ran as they do): a key counts as recorded when the record holds it, a part
    of its mapping, or the mapping it is part of."""
    added = {key: value for key, value in defaults.items() if not any(overlap(key, r) for r in recorded)}
    return {**added, **recorded}


def parse_override(text: str) -> tuple[str, Any]:
    """'local.lr=0.1' -> ('local.lr', 0.1); the value is read as YAML (text that is not YAML
    stays text)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {cut(text)}: expected dotted.key=value, e.g. --set local.lr=0.05")
    try:
        parsed = parse_yaml(value) if value.strip() else None
    except RefusedYAML as e:
        raise ConfigError(f"--set {key}: YAML refused: {e.problem}") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ConfigError(f"--set {key}: {cut(str(e))}") from None
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def apply_overrides(
    raw: dict, overrides: dict[str, Any] | str | Iterable[str], origin: str = "config", sections: Collection[str] = ()
) -> dict[str, str]:
    """Write overrides into the raw dict in place; return the dotted keys they set, each with how
    its user spelled it: ``--set`` for the command line's "key=value" strings, ``keyword`` for a
    dict (fedsim.run's keywords).

    A dotted key reaches into a section (``local.lr``) or an option mapping
    (``aggregator_options.beta``); a section that holds something other than a mapping is
    an error, never silently replaced (an empty one, ``local:``, counts as no keys). A mapping
    given for one of the ``sections`` (``{"local": {"lr": 0.1}}``, ``--set 'local={lr: 0.1}'``)
    sets its keys one by one, keeping the section's others."""
    if isinstance(overrides, dict):
        items, spelled = list(_flatten(overrides, sections)), "keyword"
    else:
        parsed = [parse_override(o) for o in ([overrides] if isinstance(overrides, str) else overrides)]
        items, spelled = [item for key, value in parsed for item in _flatten({key: value}, sections)], "--set"
    for key, value in items:
        node = raw
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                section = ".".join(parts[: depth + 1])
                where = spelled if section in {k for k, _ in items} else f"{origin}:"
                raise ConfigError(
                    f"{where} {section}: expected a mapping of keys (for {spelled} {key}), got {shown(node[part])}"
                )
            node = node[part]
        node[parts[-1]] = value
    return {key: spelled for key, _ in items}


def _flatten(d: dict, sections: Collection[str], prefix: str = ""):
    for key, value in d.items():
        dotted = f"{prefix}{key}"
        # a dict value for a section (data, local, attack) sets its keys one by one;
        # aggregator_options is itself a dict-valued key and is set whole
        if isinstance(value, dict) and dotted in sections:
            yield from _flatten(value, sections, dotted + ".")
        else:
            yield dotted, value


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["aggregator=fedavg,median", "seed=0,1"]`` -> ``[("aggregator", ["fedavg", "median"]), ...]``."""
    grid, seen = [], set()
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        texts = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(texts):
            raise ConfigError(f"--grid {spec}: expected key=value1,value2,... e.g. --grid aggregator=fedavg,median")
        if key in seen:
            raise ConfigError(f"--grid {key}: given twice; list all its values in one --grid")
        seen.add(key)
        grid.append((key, texts))
    return grid
