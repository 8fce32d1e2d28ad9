"""A run's trained model, back from its run directory: ``fedsim.load_model(run_dir)``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.errors import FedsimError
from ..core.flat import FlatModel, check_same_base
from ..core.streams import model_seed
from ..experiment import components
from ..experiment.config import Config
from ..models.lora import LoraConfig
from ..results.history import load_run
from ..results.rundir import RunDirectory

logger = logging.getLogger("fedsim")


def load_model(
    run_dir: str | os.PathLike, model: str | Callable[..., torch.nn.Module] | None = None
) -> torch.nn.Module:
    """The global model of a run as its checkpoint holds it (the last round's, unless
    ``checkpoint_every`` says otherwise), an ``nn.Module`` on the CPU in eval mode.

    The model is built again as the run built it: config.yaml's ``model``, ``model_options`` and
    ``lora`` for the shape of its data (summary.json), its frozen base (if any) from the run's
    seed. A model given to the run as an object is given again, ``model=TwoLayer``, as
    fedsim.resume takes it.
    """
    path = Path(run_dir)
    history = load_run(path)
    shape, classes = history.summary.get("input_shape"), history.summary.get("num_classes")
    if not (path / "summary.json").is_file() and (path / "checkpoint.pt").is_file():
        raise FedsimError(
            f"{path}: no summary.json, which says the shape of the run's data: the run stopped before "
            f"writing it; `fedsim run --resume {path}` finishes the run and writes it"
        )
    if not shape or not classes:
        raise FedsimError(
            f"{path}: summary.json does not say the shape of the run's data (a run of an older "
            f"fedsim, or one that did not start); its model cannot be built again"
        )
    spec = model if model is not None else history.config.get("model")
    if isinstance(spec, str) and spec.startswith("__main__:"):
        raise FedsimError(
            f"{path}: its model, {spec}, was an object given from Python; give it again: "
            f"fedsim.load_model(run_dir, model=...)"
        )
    state = RunDirectory(path).load_checkpoint()
    config = history.config
    built = Config(
        model=spec,
        model_options=config.get("model_options") or {},
        initial_weights=config.get("initial_weights"),  # a LoRA run's base: the weights it started from
        lora=LoraConfig(**config.get("lora", {})),
    )
    torch.manual_seed(model_seed(config.get("seed", 0)))  # a frozen base is the run's initial one: built again
    flat = FlatModel(components.run_model(built, tuple(shape), classes), "cpu")
    if len(flat) != state["global"].numel():
        raise FedsimError(
            f"{path}: checkpoint.pt holds {state['global'].numel():,} weights where the model "
            f"{components.describe(spec)} has {len(flat):,}; it is not this model's checkpoint"
        )
    check_same_base(state, flat.base_digest(), path, components.base_source(built))
    flat.flat.copy_(state["global"])
    server = state.get("algorithm", {}).get("server") or {}
    algorithm = config.get("algorithm") or "fedavg"
    if server and isinstance(algorithm, str) and not algorithm.startswith("__main__:"):
        # what the algorithm's state stands for outside the weights: FLoRA's merges into the base
        rebuilt = components.algorithm(algorithm, config.get("algorithm_options") or {})
        rebuilt.bind(flat.module)
        rebuilt.resume(server)
    _say_whose_model(path, history.summary, algorithm, config.get("algorithm_options") or {})
    return flat.module.eval()


def _say_whose_model(path: Path, summary: dict, algorithm: object, options: dict) -> None:
    """A run whose clients keep models of their own: the global model returned is not what its
    personal accuracy measured, and under an algorithm that exchanges no weights it never trained."""
    name = components.describe(algorithm)
    personal = summary.get("client_eval_model") == "personal" or (
        isinstance(algorithm, str)
        and not algorithm.startswith("__main__:")
        and components.algorithm(algorithm, options).has_personal_model
    )
    if summary.get("global_model_trained") is False:
        logger.warning(
            f"{path}: algorithm {name} exchanges no weights, so its global model never trained: this is "
            f"the model it started from; its clients' own models are in checkpoint.pt"
        )
    elif personal:
        logger.warning(
            f"{path}: this is the global model; the clients of algorithm {name} use models of their own, "
            f"which eval_per_client scores as its personal accuracy (in checkpoint.pt)"
        )
