"""Experiment configuration: the run's own keys (``Config``), ``--set`` overrides, and each value's type.

An experiment is one YAML file whose keys mirror ``Config`` and its sections, each section a
dataclass declared beside the feature it configures (see core/sections.py). Every key has a
default, so a file only says what differs. Errors name the file (or ``--set``), the dotted
key and what is allowed, in one line. What the values may be, and how they combine, is
checked by validation.py, which also loads a config whole (``load_config``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..algorithms import ALGORITHMS
from ..algorithms.local import LocalConfig
from ..core.checks import Checks
from ..core.errors import cut, shown
from ..core.files import atomic_write_text
from ..core.overrides import apply_overrides, parse_override
from ..core.sections import is_section, key_rows, option
from ..data.config import DataConfig, default_data_root
from ..data.tensors import Dataset
from ..fl.asynchronous import AsyncConfig
from ..fl.attacks import AttackConfig
from ..fl.compression import CompressionConfig
from ..fl.privacy import PrivacyConfig
from ..fl.system_config import SystemConfig
from ..models.lora import LoraConfig
from ..results.keys import defining, flatten_config

__all__ = [
    "AsyncConfig",
    "AttackConfig",
    "CompressionConfig",
    "Config",
    "DataConfig",
    "LocalConfig",
    "LoraConfig",
    "PrivacyConfig",
    "SystemConfig",
    "apply_overrides",
    "default_data_root",
    "parse_override",
]


# the experiment trackers a run can also write to (fedsim/runs/callbacks.py has one callback for each)
TRACKERS = ("tensorboard", "mlflow", "wandb")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _not_power_of_choice(key: str, cfg: Any, config: Any) -> str | None:
    return (
        None if cfg.client_sampling == "power_of_choice" else f"client_sampling {cfg.client_sampling} does not use it"
    )


def _not_vmap(key: str, cfg: Any, config: Any) -> str | None:
    return None if cfg.backend == "vmap" else f"backend is {cfg.backend}: it is vmap's"


def _no_server_optimizer(key: str, cfg: Any, config: Any) -> str | None:
    return "server_optimizer is none" if cfg.server_optimizer == "none" else None


@dataclass
class Config:
    """An experiment: the run's own keys, then one section per feature (each declared beside its
    feature, see core/sections.py)."""

    name: str = option("experiment", "run name (run directory prefix, plot titles)")
    seed: int = option(
        0,
        "every random choice derives from (seed, round, client), each purpose (split, sample, a client's "
        "shuffling, noise, ...) from a stream of its own that no other stream's keys can reproduce "
        "(`fedsim/core/streams.py`)",
    )
    device: str = option("auto", "`auto` (cuda if available, else cpu), `cpu`, `cuda`, `cuda:N`")
    rounds: int = option(10, "communication rounds")
    workers: int | None = option(
        None,
        "worker processes; `null`: min(clients_per_round, CPU cores), on a GPU also capped by free memory (see "
        "[Resources](reliability.md#resources)); `0`: none, the server trains the clients itself, one after "
        "another (for debugging, where a breakpoint in a model stops in the one process, and for tiny runs; same "
        "numbers, no round timeout)",
    )
    threads: int = option(
        1,
        "torch threads each worker trains with (the server, with `workers: 0`); the numbers depend on it but not on "
        "`workers`: a matrix product split over another number of threads may round differently. Fewer workers "
        "than cores leave cores idle at 1: a lone worker on 2 cores trains faster with `threads: 2` (see "
        "[Performance](performance.md#threads)). The server scores with every core the process may use (its CPU "
        "affinity), whatever OMP_NUM_THREADS or torchrun says",
    )
    mode: str = option(
        "sync",
        "`sync`: clients train copies of the global model, the server aggregates them; `async`: the server waits "
        "for no round, applying updates as they arrive on the simulated clock (see "
        "[Asynchronous rounds](asynchronous.md)); `hogwild`: the workers train one shared model lock-free, every "
        "client every round (see [Hogwild mode](scaling.md#hogwild-mode))",
    )
    backend: str = option(
        "process",
        "`process`: a worker trains its clients one by one; `vmap`: a worker trains a group of clients in "
        "lockstep (see [Backends](architecture.md#backends)); with LoRA, batched adapters (see "
        "[Language models](language-models.md#batched-adapters))",
    )
    vmap_group_size: int = option(
        0, "`vmap`: clients trained together in one group; `0` = all clients of the round", unread=_not_vmap
    )
    clients_per_round: int = option(
        10,
        "clients sampled (without replacement) each round, among those online (see "
        "[System heterogeneity](data.md#system-heterogeneity-and-client-sampling)); under `poisson` sampling the "
        "expected number",
    )
    client_sampling: str = option(
        "uniform",
        "how the round's clients are chosen: `uniform`, `by_size`, `poisson` (each client with probability "
        "`clients_per_round` / `data.num_clients`, which `privacy:` needs; see "
        "[Privacy](privacy.md#differential-privacy)), `power_of_choice`",
    )
    sampling_candidates: int | None = option(
        None,
        "`power_of_choice`: d candidates, `clients_per_round` <= d <= `data.num_clients`",
        unread=_not_power_of_choice,
    )
    eval_every: int = option(1, "evaluate every N rounds (and always after the last)")
    # 128: a CPU scores a batch fastest when its activations stay in the core's cache (the zoo's
    # CNNs score 1.6 to 1.8 times as fast as in batches of 2,000: benchmarks/bench_scoring.py)
    eval_batch_size: int = option(
        128,
        "test-set batch size, in samples (a text dataset's: sequences, whose scores take batch x "
        "`data.sequence_length` x vocabulary floats: set it lower for a language model)",
    )
    eval_subset: int | None = option(
        None,
        "score the rounds before the last on this many test samples, drawn by the seed and the same every round "
        "(the header says so, and `metrics.csv`'s `test_samples`); the last round is scored on the whole test set. "
        "For runs whose evaluation would take longer than their training (the shipped `llm/` files set 512). A "
        "round whose score on the subset reaches `stop_at_accuracy` is scored again on the whole test set, as the "
        "last round is: the run stops, and `rounds_to_target` counts, only on that score",
    )
    eval_per_client: bool = option(
        False,
        "also score the global model on every client's own test split (needs `data.test_partition: true`; see "
        "[Per-client evaluation](privacy.md#per-client-evaluation))",
    )
    stop_at_accuracy: float | None = option(None, "stop once test accuracy reaches this fraction")
    model: Any = option(
        "mnist_cnn",
        "see [Datasets and models](data.md#datasets-and-models); `char_transformer`, or `hf:<name or folder>` for "
        "a Hugging Face causal language model (see [Language models](language-models.md)); or an import path "
        "`pkg.module:build` (see [Extending fedsim](extending.md))",
    )
    model_options: dict = option(
        doc="keywords of the model's builder: `char_transformer`'s `layers`, `heads`, `width`, `dropout`; an `hf:` "
        "model's `from_pretrained` options (`dtype: bfloat16`, `attn_implementation`)",
        factory=dict,
    )
    initial_weights: str | None = option(
        None,
        "a run directory (or its `checkpoint.pt`) whose global model this run starts from, before LoRA adapters "
        "are placed on it: a model trained by one run, fine-tuned by another. The run scores it, on the whole "
        "test set, as round 0 of `metrics.csv`, which the best figures and the round to a target leave out: they "
        "are the rounds trained. A LoRA run's checkpoint holds a fingerprint of its base, and a resume or "
        "`load_model` on another base is refused",
    )
    algorithm: Any = option(
        "fedavg",
        f"{', '.join(f'`{name}`' for name in ALGORITHMS.names())}, or an import path (see "
        "[Client algorithms](algorithms.md#client-algorithms))",
    )
    algorithm_options: dict = option(
        doc="the algorithm's options (`fedprox`'s `mu`, `feddyn`'s `alpha`, ...)", factory=dict
    )
    aggregator: Any = option(
        "fedavg",
        "aggregation rule (see [Aggregation](algorithms.md#aggregation-rules)), or an import path; not set (or "
        "`null`): the rule the algorithm's paper fixes, `mean` for `scaffold` and `feddyn`, else `fedavg` (another "
        "rule for those two is run with a warning naming the paper's)",
        shown_default="see meaning",
    )
    aggregator_options: dict = option(doc="the rule's options", factory=dict)
    pre_aggregators: list = option(
        doc="pre-aggregators applied in order before the rule, each a name or an import path, alone or as "
        "`{name: {option: value}}` (see [Pre-aggregation](algorithms.md#pre-aggregation)): `clipping`, `nnm`, "
        "`bucketing`, `arc`",
        factory=list,
    )
    server_optimizer: str = option("none", "`none`, `fedavgm`, `fedadagrad`, `fedadam`, `fedyogi`")
    server_lr: float | None = option(
        None, "server learning rate; `null`: the optimizer's default", unread=_no_server_optimizer
    )
    server_momentum: float = option(0.9, "`fedavgm`'s momentum", unread=_no_server_optimizer)
    server_beta1: float = option(0.9, "the adaptive optimizers' first moment decay", unread=_no_server_optimizer)
    server_beta2: float = option(0.99, "the adaptive optimizers' second moment decay", unread=_no_server_optimizer)
    server_tau: float = option(1e-3, "the adaptive optimizers' degree of adaptivity", unread=_no_server_optimizer)
    checkpoint_every: int = option(1, "rounds between checkpoints (0: never)")
    worker_timeout: float | None = option(
        None,
        "seconds a round may take; `null`: 15 min for the first round, then 10x the slowest round (at least 2 min)",
    )
    on_worker_failure: str = option("stop", "`stop`, or `restart` the pool and re-run the round")
    on_nonfinite: str = option("drop", "a client update with NaN/Inf is dropped (`drop`) or stops the run (`fail`)")
    sharing_strategy: str = option(
        "file_descriptor",
        "torch.multiprocessing sharing strategy for CPU tensors (`file_system` where descriptor limits bite)",
    )
    trackers: list = option(
        doc="where else the run's numbers go, each of "
        + ", ".join(f"`{name}`" for name in TRACKERS)
        + ": the metrics of every round, the clients' figures, this config, the summary and the plot (see "
        "[Trackers](results.md#trackers)); `fedsim run --mlflow` and the like add one",
        factory=list,
    )
    client_state_limit_mb: float | None = option(
        None,
        "the most the clients' kept state may take (see [Personal models](personal-models.md)); `null`: half the "
        "host's memory",
    )
    privacy: PrivacyConfig | None = option(None, "client-level differential privacy (off without the section)")
    data: DataConfig = option(factory=DataConfig)
    local: LocalConfig = option(factory=LocalConfig)
    attack: AttackConfig = option(factory=AttackConfig)
    system: SystemConfig = option(factory=SystemConfig)
    compression: CompressionConfig = option(factory=CompressionConfig)
    asynchronous: AsyncConfig = option(factory=AsyncConfig)
    lora: LoraConfig = option(factory=LoraConfig)

    def check(self) -> None:
        """How the run is executed: name, device, rounds, workers, evaluation, failures."""
        checks = Checks()
        if not self.name.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in self.name):
            checks.fail("name", f"must be a non-empty name without control characters, got {shown(self.name)}")
        if not _DEVICE.fullmatch(self.device):
            checks.fail("device", f"must be auto, cpu, cuda or cuda:N, got {cut(repr(self.device))}")
        checks.at_least("seed", self.seed, 0)
        checks.at_least("rounds", self.rounds, 1)
        checks.at_least("data.num_clients", self.data.num_clients, 1)
        if self.data.num_clients > MAX_CLIENTS:  # the engine keeps per-client tensors (attackers, SCAFFOLD's c_i)
            checks.fail("data.num_clients", f"must be at most {MAX_CLIENTS:,}, got {self.data.num_clients:,}")
        checks.at_least("clients_per_round", self.clients_per_round, 1)
        if self.clients_per_round > self.data.num_clients:
            checks.fail(
                "clients_per_round",
                f"must be <= data.num_clients ({self.data.num_clients}), got {self.clients_per_round}",
            )
        checks.at_least("threads", self.threads, 1)
        if self.workers is not None:
            checks.at_least("workers", self.workers, 0)
            if self.workers > self.clients_per_round:
                checks.fail(
                    "workers",
                    f"must be <= clients_per_round ({self.clients_per_round}): "
                    f"a worker without a client would idle, got {self.workers}",
                )
        checks.at_least("vmap_group_size", self.vmap_group_size, 0)
        if self.backend == "vmap" and self.workers is not None and self.workers > groups_per_round(self):
            checks.fail(
                "workers",
                f"must be <= the {groups_per_round(self)} vmap group(s) of a round (clients_per_round "
                f"/ vmap_group_size, rounded up), got {self.workers}",
            )
        checks.at_least("eval_every", self.eval_every, 1)
        if self.eval_subset is not None:
            checks.at_least("eval_subset", self.eval_subset, 1)
        checks.at_least("eval_batch_size", self.eval_batch_size, 1)
        checks.at_least("checkpoint_every", self.checkpoint_every, 0)
        if self.stop_at_accuracy is not None and not 0 < self.stop_at_accuracy <= 1:
            checks.fail("stop_at_accuracy", f"must be a fraction in (0, 1], got {self.stop_at_accuracy}")
        if self.worker_timeout is not None and not 0 < self.worker_timeout <= MAX_TIMEOUT:
            checks.fail(
                "worker_timeout",
                f"must be > 0 and at most {MAX_TIMEOUT:,} seconds (waits are counted in "
                f"milliseconds of a C int), got {self.worker_timeout}",
            )
        checks.one_of("mode", self.mode, ("sync", "async", "hogwild"))
        checks.one_of("backend", self.backend, ("process", "vmap"))
        checks.one_of("on_worker_failure", self.on_worker_failure, ("stop", "restart"))
        checks.one_of("on_nonfinite", self.on_nonfinite, ("drop", "fail"))
        checks.one_of("sharing_strategy", self.sharing_strategy, ("file_descriptor", "file_system"))
        for tracker in self.trackers:
            checks.one_of("trackers", tracker, TRACKERS)
        if len(set(self.trackers)) < len(self.trackers):
            checks.fail("trackers", f"names a tracker twice: {self.trackers}")
        if self.client_state_limit_mb is not None:
            checks.positive("client_state_limit_mb", self.client_state_limit_mb)
        if self.eval_per_client and not self.data.test_partition:
            checks.fail(
                "eval_per_client", "needs data.test_partition: true, which gives every client its own test split"
            )
        self._check_server_optimizer(checks)

    def _check_server_optimizer(self, checks: Checks) -> None:
        """The server optimizer's constants (its name is checked against its registry, with the
        components)."""
        if self.server_lr is not None and self.server_lr <= 0:
            checks.fail("server_lr", f"must be > 0, got {self.server_lr}")
        for key in ("server_momentum", "server_beta1", "server_beta2"):
            checks.within(key, getattr(self, key), 0, 1, "[)")
        if not 0 < self.server_tau <= 1e18:
            checks.fail(
                "server_tau", f"must be > 0 and at most 1e18 (its square must fit in float32), got {self.server_tau}"
            )

    def to_dict(self) -> dict:
        """Plain values only: a component given as an object is named by ``describe``."""
        return plain(self)


def plain(value: Any) -> Any:
    """``value`` (a section, or what a key holds) in plain values: a component given as an object,
    also as the key of a mapping (``pre_aggregators: [{my_step: {option: value}}]``), is named by
    ``describe``."""
    if is_section(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return describe(value)


def key_table() -> str:
    """Every key of an experiment file as the Markdown table of docs/configuration.md: key,
    default, meaning, in the order the sections declare them."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {default} | {doc} |" for key, default, doc in key_rows(Config)]
    return "\n".join(lines) + "\n"


MAX_TIMEOUT = 1_000_000  # seconds
MAX_CLIENTS = 100_000_000
SECTIONS = {key.rpartition(".")[0] for key, _, _ in key_rows(Config)} - {""}
KEYS = {key for key, _, _ in key_rows(Config)} | SECTIONS  # every dotted key, and every section's name


def vmap_group_size(cfg: Config) -> int:
    """Clients trained together in one vmap group: vmap_group_size, where 0 means the whole round."""
    return cfg.vmap_group_size or cfg.clients_per_round


def groups_per_round(cfg: Config) -> int:
    """What a round is divided into among the workers: its clients, or its vmap groups."""
    if cfg.backend == "vmap":
        return -(-cfg.clients_per_round // vmap_group_size(cfg))
    return cfg.clients_per_round


def overrides_of(cfg: Config) -> dict:
    """The keys set on top of the experiment (``--set``, or ``fedsim.run``'s keywords), dotted,
    with the values the run has for them: ``{"data.dataset": "synthetic", "aggregator_options.bound": 0.5}``."""
    _, keys = getattr(cfg, "origin", ("config", {}))
    values = dict(flatten_config(cfg.to_dict()))
    return {
        key: value for key, value in sorted(values.items()) if any(key == k or key.startswith(k + ".") for k in keys)
    }


def directory_name(cfg: Config) -> str:
    """What a run directory is called before its timestamp: the run's name, then the overrides
    that change what it computes (not where or how fast it runs) as key=value, as many as fit in
    48 characters (in the order of their keys), and a hash of them all where not all fit, so that
    two runs that differ in one left out stay apart: ``mnist_seed-dataset=synthetic-lr=0.05``."""
    changes = [f"{key.rpartition('.')[2]}={_short(value)}" for key, value in defining(overrides_of(cfg)).items()]
    suffix = "-".join(changes)
    if len(suffix) > 48:
        digest = hashlib.sha1(suffix.encode()).hexdigest()[:8]
        shown = []
        for change in changes:
            if len("-".join([*shown, change, digest])) <= 48:  # a long one left out leaves room for a later one
                shown.append(change)
        suffix = "-".join([*shown, digest])
    return f"{cfg.name}-{suffix}" if suffix else cfg.name


def _short(value: object) -> str:
    """A value in a directory name: a component by its own name, without its module; a path or
    a hub name (``hf:owner/name``) by its last part."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).rpartition(":")[2].rstrip("/").rpartition("/")[2]


def save_config(cfg: Config, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- components by name


def describe(value: object) -> str:
    """How config.yaml names a component: its name, import path or where it was defined; an
    object with its arguments, ``__main__:ServerStep(step=0.5)``."""
    if isinstance(value, str):
        return value

    if isinstance(value, Dataset):
        return value.name
    target = value if inspect.isroutine(value) or inspect.isclass(value) else type(value)
    where = f"{getattr(target, '__module__', '?')}:{_name_in_module(target)}"
    return where if target is value else f"{where}({_arguments(value)})"


def _name_in_module(target: object) -> str:
    """The name ``target`` is imported by from its module: its qualified name, or, where a wrapper
    took its function's name (``fedsim.aggregation.remembering``, ``functools.wraps``), the name of
    the module's attribute that holds it."""
    name = getattr(target, "__qualname__", type(target).__name__)
    module = sys.modules.get(getattr(target, "__module__", None) or "")
    found = module
    for part in name.split("."):
        found = getattr(found, part, None)
    if module is None or found is target:
        return name
    return next((attr for attr, held in vars(module).items() if held is target), name)


def _arguments(obj) -> str:
    """An object's constructor arguments, as far as it keeps them: every parameter of its
    ``__init__`` that it stores under the same name (``self.step = step``), as scikit-learn's
    get_params reads them."""
    try:
        parameters = inspect.signature(type(obj).__init__).parameters.values()
    except (TypeError, ValueError):
        return ""
    kept = [
        p.name
        for p in parameters
        if p.name != "self"
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name in getattr(obj, "__dict__", {})
    ]
    return ", ".join(f"{name}={cut(repr(getattr(obj, name)), 40)}" for name in kept)
