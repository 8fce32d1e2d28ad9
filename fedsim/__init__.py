"""fedsim: a synchronous federated-learning simulator for one machine and one accelerator.

    import fedsim
    history = fedsim.run("mnist_seed", rounds=5, **{"local.lr": 0.05})
    history.test_accuracy        # one entry per evaluated round
    model = fedsim.load_model(history.run_dir)    # the trained nn.Module
    fedsim.run("mnist_seed", aggregator=my_rule, model=MyNet)   # your own parts

The package is built in layers, each a folder that imports only those below it (see
docs/architecture.md): cli/, runs/, execution/, engine/, experiment/, fl/, algorithms/, models/,
data/, results/, core/. Imports are lazy so that worker processes, which import this package, start
quickly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# Read once, when torch loads its OpenMP runtime (GNU OpenMP in torch's Linux builds), so here, before
# any of fedsim's modules loads torch; the worker processes inherit it. A thread waiting for the next
# parallel step spins 10,000 turns, a fraction of a millisecond, then sleeps, where the runtime spins
# 300,000 by default: a run shares its cores with its workers, other runs or a notebook, and a spinning
# thread holds a core another process needs. Beside two busy processes 10 rounds of ByzFL's benchmark
# took half as long so, and alone as long (benchmarks/bench_sharing.py). A setting of the user's is kept.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_API = {
    "run": "runs.launch",
    "resume": "runs.launch",
    "sweep": "runs.sweep",
    "load_config": "experiment.validation",
    "Config": "experiment.config",
    "History": "results.history",
    "load_run": "results.history",
    "load_runs": "results.history",
    "load_model": "runs.trained",
    "results_table": "results.table",
    "plot_runs": "results.plot",
    "Algorithm": "algorithms",
    "Callback": "runs.callbacks",
    "FedsimError": "core.errors",
}
# public modules as attributes, imported when first used: fedsim.aggregation.get(...), fedsim.callbacks.TensorBoard()
_MODULES = {
    "data": "data",
    "algorithms": "algorithms",
    "results": "results",
    "callbacks": "runs.callbacks",
    "aggregation": "fl.aggregation",
    "attacks": "fl.attacks",
    "models": "models",
}
__all__ = sorted(_API)


class _ModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import fedsim.aggregation`` and ``from fedsim.callbacks import TensorBoard``: the public
    modules of ``_MODULES`` imported under their short names, as the same module objects."""

    def find_spec(self, fullname, path=None, target=None):
        name = fullname.removeprefix(f"{__name__}.")
        if fullname.startswith(f"{__name__}.") and name in _MODULES and _MODULES[name] != name:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder, replaced by the real module in exec_module

    def exec_module(self, module) -> None:
        name = module.__name__.removeprefix(f"{__name__}.")
        sys.modules[module.__name__] = importlib.import_module(f".{_MODULES[name]}", __name__)


sys.meta_path.append(_ModuleAliases())


def __dir__() -> list[str]:
    """The public names, for tab completion (they are imported when first used)."""
    return sorted({*_API, *_MODULES, "__version__"})  # not this module's own helpers, nor the layers it is built of


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    if name in _MODULES:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    raise AttributeError(f"module 'fedsim' has no attribute {name!r}")
