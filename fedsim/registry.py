"""Name -> object tables, so a YAML file or a notebook can say ``model: mnist_cnn``; and where they all are."""
from __future__ import annotations

from typing import Callable

from .errors import ConfigError


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

    def get(self, name: str):
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._entries[name][0]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> list[tuple[str, str]]:
        return [(name, self._entries[name][1]) for name in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def tables() -> dict[str, Registry]:
    """Every name table, for validation and ``fedsim list``; imported here, when first asked
    for, because the tables' modules import torch."""
    from .aggregation import AGGREGATORS
    from .algorithms import ALGORITHMS
    from .attacks import ATTACKS
    from .data import DATASETS, PARTITIONS
    from .models import MODELS
    from .server_opt import SERVER_OPTIMIZERS
    from .sampling import CLIENT_SAMPLINGS

    return {"datasets": DATASETS, "partitions": PARTITIONS, "models": MODELS, "algorithms": ALGORITHMS,
            "aggregators": AGGREGATORS, "server optimizers": SERVER_OPTIMIZERS, "attacks": ATTACKS,
            "client samplings": CLIENT_SAMPLINGS}
