"""What a run is made of, each part checked before any worker is handed anything: its device
and workers, where its data lives, the data split among the clients, the initial model,
privacy, the algorithm and the clients' state; and the engine assembled from them."""

from __future__ import annotations

import torch

from ..algorithms import Algorithm
from ..core.errors import ConfigError, FedsimError, user_code
from ..core.flat import FlatModel
from ..core.threads import available_cores
from ..data.tensors import Dataset
from ..engine.async_loop import AsyncEngine
from ..engine.buffers import RoundBuffers
from ..engine.loop import Engine, Executor
from ..engine.state import GlobalState
from ..engine.update import AggregateUpdates
from ..execution.distributed import Ranks, rank_device
from ..execution.hogwild import AdoptSharedWeights
from ..experiment import components
from ..experiment.config import Config, groups_per_round
from ..experiment.federation import Federation, initial_model, load_federation
from ..experiment.reading import locate
from ..fl.attacks import make_attack
from ..fl.client_eval import ClientEvaluation
from ..fl.client_state import ClientStates
from ..fl.compression import Compression, client_shapes
from ..fl.privacy import Privacy
from ..fl.system import System

# Each worker process on a GPU holds a CUDA context (hundreds of MiB) plus its model, gradients
# and activations; this budget per worker keeps the default from over-subscribing the card.
_GPU_BYTES_PER_WORKER = 1 << 30


def resolve_device(name: str) -> torch.device:
    """The run's device; a CUDA device always with its index (workers pass it to set_device)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device: '{name}' asked for, but CUDA is not available here "
                f"(torch {torch.__version__}); use device: cpu or auto"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: '{name}' asked for, but there are {torch.cuda.device_count()} CUDA devices")
    return device


def run_device(cfg: Config, ranks: Ranks) -> torch.device:
    """The run's device; under torchrun each rank's own. A mode that runs in one process refuses ranks."""
    one_process = {
        "async": "plays one simulated clock in one process",
        "hogwild": "shares one model in one machine's memory",
    }.get(cfg.mode)
    if one_process and ranks.several:
        raise ConfigError(f"mode: {cfg.mode} {one_process}; run it as a single process, without torchrun")
    return resolve_device(rank_device(cfg.device) if ranks.several else cfg.device)


def resolve_workers(cfg: Config, device: torch.device) -> int:
    if cfg.workers is not None:
        return cfg.workers
    workers = min(groups_per_round(cfg), available_cores())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        workers = min(workers, max(1, int(0.8 * free // _GPU_BYTES_PER_WORKER)))
    return workers


def data_placement(placement: str, data: Dataset, device: torch.device) -> torch.device:
    """Where the dataset lives: on the device, or in host memory when it would take more than
    half of the GPU's free memory (``auto``), or when asked (``host``)."""
    if device.type != "cuda" or placement == "device":
        return device
    if placement == "host":
        return torch.device("cpu")
    size = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    free, _ = torch.cuda.mem_get_info(device)
    return device if size <= free / 2 else torch.device("cpu")


def build_parts(
    cfg: Config, device: torch.device, datasets: dict | None = None
) -> tuple[Federation, FlatModel, Privacy | None, Algorithm, ClientStates]:
    """What a run is made of, each part checked as far as it can be before any worker is handed
    anything: the data split among the clients, the initial model (probed), privacy (or None), the
    algorithm (set up and bound to the model) and the clients' state (its bound checked).
    ``datasets``: loaded datasets to reuse (see load_federation)."""
    federation = load_federation(cfg, datasets)
    empty = (federation.parts.sizes() == 0).nonzero()
    if len(empty):
        raise ConfigError(f"data.partition: client {int(empty[0])} gets no samples; use fewer clients or more data")
    model = FlatModel(initial_model(cfg, federation.data), device)
    if cfg.backend == "vmap" and len(model) != model.num_params:
        raise ConfigError(
            f"backend: vmap cannot train {components.describe(cfg.model)}, whose batch-norm "
            f"statistics are not parameters; use backend: process"
        )
    privacy = Privacy.from_config(cfg)  # DP-FedAvg in place of the rule (privacy.py), or None
    if privacy:
        privacy.check_model(components.describe(cfg.model), model.num_params, len(model))
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    with user_code(f"algorithm: {components.describe(cfg.algorithm)} failed in setup", ConfigError):
        algorithm.setup(cfg)
        algorithm.bind(model.module)
    n = model.num_params
    clients = ClientStates.of(
        {
            f"algorithm {components.describe(cfg.algorithm)}": algorithm.client_state(n),
            "compression.error_feedback": client_shapes(cfg.compression, n),
        },
        cfg.data.num_clients,
        cfg.client_state_limit_mb,
    )
    return federation, model, privacy, algorithm, clients


def check_run(cfg: Config, datasets: dict | None = None) -> None:
    """Everything a run checks before its workers start, without starting them (a sweep checks
    every run so before the first trains); the model is built on the CPU."""
    try:
        resolve_device(cfg.device)
        build_parts(cfg, torch.device("cpu"), datasets)
    except FedsimError as e:
        raise locate(cfg, e) from None


def make_engine(
    cfg: Config,
    state: GlobalState,
    buffers: RoundBuffers,
    executor: Executor,
    test: tuple[torch.Tensor, torch.Tensor],
    client_eval: ClientEvaluation | None,
    privacy: Privacy | None,
    compression: Compression | None,
) -> Engine:
    """The engine of ``cfg.mode``: the async clock's, or rounds whose update strategy aggregates
    the clients' copies (hogwild's adopts the weights they trained in place)."""
    system = System.from_config(cfg)
    if cfg.mode == "async":  # the clock decides when the global model changes (validation refuses the rest)
        return AsyncEngine(cfg, state, buffers, executor, None, system, test, client_eval)
    if cfg.mode == "hogwild":
        strategy = AdoptSharedWeights(cfg, state, buffers)
        state.bytes_sent = None  # nothing travels: the workers train one shared model
    else:
        rule, pre_aggregators = components.server_rule(cfg)
        names = component_names(cfg)
        attack = make_attack(cfg.attack)
        strategy = AggregateUpdates(
            cfg, state, buffers, state.algorithm, rule, privacy, attack, names, compression, pre_aggregators
        )
    return Engine(cfg, state, buffers, executor, strategy, system, test, client_eval, privacy)


def component_names(cfg: Config) -> dict[str, str]:
    """How the run's messages name its algorithm, rule and server optimizer."""
    return {
        "algorithm": components.describe(cfg.algorithm),
        "aggregator": components.describe(cfg.aggregator),
        "attack": components.describe(cfg.attack.type),
        "server_optimizer": cfg.server_optimizer,
    }
