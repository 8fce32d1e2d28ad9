"""fedsim: a synchronous federated-learning simulator for one machine and one accelerator.

    import fedsim
    history = fedsim.run("mnist_seed", rounds=5, **{"local.lr": 0.05})
    history.test_accuracy        # one entry per evaluated round
    model = fedsim.load_model(history.run_dir)    # the trained nn.Module
    fedsim.run("mnist_seed", aggregator=my_rule, model=MyNet)   # your own parts

The package is built in layers, each a folder that imports only those below it (see
docs/architecture.md): cli.py, runs/, execution/, engine/, experiment/, fl/, algorithms/, data/,
results/, core/. Imports are lazy so that worker processes, which import this package, start
quickly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__version__ = "0.1.0"

_API = {
    "run": "runs.launch",
    "resume": "runs.launch",
    "load_config": "experiment.validation",
    "Config": "experiment.config",
    "History": "results.history",
    "load_run": "results.history",
    "load_runs": "results.history",
    "load_model": "runs.trained",
    "results_table": "results.history",
    "plot_runs": "results.plot",
    "Algorithm": "algorithms",
    "Callback": "runs.callbacks",
}
# public modules by their short names: fedsim.aggregation.get(...), from fedsim.models import MODELS
_MODULES = {
    "data": "data",
    "algorithms": "algorithms",
    "results": "results",
    "callbacks": "runs.callbacks",
    "aggregation": "fl.aggregation",
    "attacks": "fl.attacks",
    "models": "fl.models",
}
__all__ = sorted(_API)


def __dir__() -> list[str]:
    """The public names, for tab completion (they are imported when first used)."""
    return sorted({*globals(), *_API, *_MODULES})


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    if name in _MODULES:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    raise AttributeError(f"module 'fedsim' has no attribute {name!r}")


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import fedsim.models`` (and the other short names above) give the module where it
    lives, fedsim.fl.models: one module object under both names, not a copy."""

    def __init__(self) -> None:
        self._own_specs: dict = {}  # short name -> the module's own spec, which the import machinery overwrites

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, short = fullname.rpartition(".")
        if package == __name__ and _MODULES.get(short, short) != short:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{_MODULES[spec.name.rpartition('.')[2]]}")
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


sys.meta_path.append(_ShortNames())
