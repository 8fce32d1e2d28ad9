"""Client algorithms, one per file; every module of this package registers its own. Beside them,
the local training they hook into (``local.py``: the ``local:`` section and the client loop;
``group.py``: a group of clients in lockstep) and the interface they implement (``base.py``).

``ALGORITHMS`` maps names to Algorithm classes. A new algorithm is a new file here (or a
class of your own, given from Python or named by import path): nothing else changes.

It may import models, data, results and core; fl and everything above import it.
"""

import importlib
import pkgutil

from ..core.registry import Registry
from .base import Algorithm, Clients, LocalResult, Round

ALGORITHMS = Registry("algorithm")

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ALGORITHMS", "Algorithm", "Clients", "LocalResult", "Round"]
