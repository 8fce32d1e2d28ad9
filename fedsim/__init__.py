"""fedsim: a synchronous federated-learning simulator for one machine and one accelerator.

    import fedsim
    history = fedsim.run("mnist_seed", rounds=5, **{"local.lr": 0.05})
    history.test_accuracy        # one entry per evaluated round
    model = fedsim.load_model(history.run_dir)    # the trained nn.Module
    fedsim.run("mnist_seed", aggregator=my_rule, model=MyNet)   # your own parts

Imports are lazy so that worker processes, which import this package, start quickly.
"""
__version__ = "0.1.0"

_API = {
    "run": "runs", "resume": "runs", "load_config": "validation", "Config": "config",
    "History": "results", "load_run": "results", "load_runs": "results", "load_model": "trained",
    "results_table": "results", "plot_runs": "plot", "Algorithm": "algorithms", "Callback": "callbacks",
}
_MODULES = {"data", "algorithms", "callbacks", "aggregation", "attacks", "models"}
__all__ = sorted(_API)


def __dir__():
    """The public names, for tab completion (they are imported when first used)."""
    return sorted({*globals(), *_API, *_MODULES})


def __getattr__(name):
    import importlib

    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fedsim' has no attribute {name!r}")
