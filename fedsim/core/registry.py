"""Name -> object tables, so a YAML file or a notebook can say ``model: mnist_cnn``; and import
paths, ``pkg.module:attr``, for what is not registered."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from .errors import ConfigError, did_you_mean, user_code


class Registry:
    """A table of named entries, each with a one-line description for ``fedsim list``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[object, str]] = {}

    def register(self, name: str, description: str | None = None) -> Callable:
        def add(obj):
            doc = description or (obj.__doc__ or "").strip().splitlines()[0]
            self._entries[name] = (obj, doc)
            return obj

        return add

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise ConfigError(
                f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; choose one of: "
                f"{', '.join(self.names())}"
            )
        return self._entries[name][0]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> list[tuple[str, str]]:
        return [(name, self._entries[name][1]) for name in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def is_import_path(text: str) -> bool:
    return ":" in text


def load_attr(key: str, path: str) -> Any:
    """The object an import path ``pkg.module:attr`` names; one line if it cannot be had."""
    module_name, _, attr = path.partition(":")
    keyword = f"**{{{key!r}: ...}}" if "." in key else f"{key}=..."
    if attr.endswith(")"):  # how config.yaml names an object given from Python (see describe)
        raise ConfigError(
            f"{key}: {path} was an object given from Python; give it again, e.g. fedsim.resume(run_dir, {keyword})"
        )
    if module_name == "__main__" and not hasattr(sys.modules.get("__main__"), attr.partition(".")[0]):
        raise ConfigError(
            f"{key}: {path} was defined in the script that started the run; give it again from Python, "
            f"e.g. fedsim.resume(run_dir, {keyword})"
        )
    with user_code(f"{key}: cannot import {module_name!r}", ConfigError):  # ImportError, or what the module raised
        target = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def registered(key: str, table: Registry, name: str) -> Any:
    """``table``'s entry ``name``; an unknown name is refused naming the config key."""
    if name not in table:
        raise ConfigError(
            f"{key}: unknown {table.kind} {name!r}{did_you_mean(name, table.names())}; choose one "
            f"of: {', '.join(table.names())}, or give an import path (pkg.module:name)"
        )
    return table.get(name)
