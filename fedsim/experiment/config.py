"""Experiment configuration: typed dataclasses, ``--set`` overrides, and each value's type.

An experiment is one YAML file whose keys mirror the dataclasses below. Every key has a
default, so a file only says what differs. Errors name the file (or ``--set``), the dotted
key and what is allowed, in one line. What the values may be, and how they combine, is
checked by validation.py, which also loads a config whole (``load_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import inspect
import math
import os
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.checks import shown
from ..core.errors import ConfigError, FedsimError, cut
from ..core.files import atomic_write_text
from ..core.yamlfile import RefusedYAML, parse_yaml
from ..data.tensors import Dataset
from ..fl.asynchronous import AsyncConfig
from ..fl.compression import CompressionConfig
from ..fl.lora import LoraConfig
from ..fl.system_config import SystemConfig
from .keys import defining, flatten_config


def default_data_root() -> str:
    """Where datasets are read and downloaded: ``$FEDSIM_DATA``, else one cache folder for every
    run whatever directory it starts in (``$XDG_CACHE_HOME/fedsim/datasets``, by default
    ``~/.cache/fedsim/datasets``)."""
    if os.environ.get("FEDSIM_DATA"):
        return os.environ["FEDSIM_DATA"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fedsim", "datasets")


@dataclass
class DataConfig:
    dataset: Any = "mnist"  # a name, a .pt/.npz file, an import path, or a Dataset (see components.py)
    root: str = field(default_factory=default_data_root)
    partition: str = "iid"
    num_clients: int = 10
    limit: int | None = None  # use only the first N training samples
    download: bool = True  # fetch a missing dataset into root (torchvision's sources)
    placement: str = "auto"  # device | host | auto: on the device when it takes <= half its free memory
    # partition options; each partition reads the ones it needs
    alpha: float = 0.5  # dirichlet concentration (label skew, or sizes for quantity); pachinko: of the coarse labels
    beta: float = 10.0  # pachinko: concentration of the fine labels within a coarse label
    min_samples: int = 1  # dirichlet: re-draw until every client has this many
    balanced: bool = False  # dirichlet: NIID-Bench's cap, no more classes for a client holding N / num_clients
    shards_per_client: int = 2
    classes_per_client: int = 2
    sigma: float = 1.0  # quantity: log-normal spread of client sizes
    quantity_skew: str = "lognormal"  # quantity: lognormal | dirichlet
    test_partition: bool = False  # also split the test set per client, same distribution
    augment: bool | None = None  # training-time augmentation; None = the dataset's default
    hf: dict | None = None  # hf: datasets: which columns and splits to use (see data/hub.py)
    # text datasets: token ids in sequences of sequence_length tokens (see data/text.py)
    tokenizer: str = "bytes"  # bytes (built in, 256 ids) | hf:<name or folder> (a transformers tokenizer)
    sequence_length: int = 128


@dataclass
class LocalConfig:
    epochs: int = 1
    steps: int | None = None  # the most local steps a client takes in a round (FlowerTune's max_steps); null: all
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 (autocast of forward and loss; weights and SGD stay fp32)
    optimizer: str = "sgd"  # sgd (with momentum) | adamw (fresh moments for every client's round)
    beta1: float = 0.9  # adamw's moment decays and epsilon, torch.optim.AdamW's defaults
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class AttackConfig:
    type: str = "none"
    fraction: float = 0.0  # share of all clients that are Byzantine (a seeded set)
    scale: float = 1.0  # sign_flip sends -scale x update, scale sends scale x update


@dataclass
class Config:
    name: str = "experiment"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    rounds: int = 10
    workers: int | None = None  # None: min(clients_per_round, CPU cores), capped on a GPU; 0: none
    mode: str = "sync"  # sync | async (see asynchronous.py) | hogwild: one shared model trained lock-free (hogwild.py)
    backend: str = "process"  # process | vmap
    vmap_group_size: int = 0  # vmap: clients trained together in one group; 0 = the whole round
    clients_per_round: int = 10
    client_sampling: str = "uniform"  # uniform | by_size | poisson | power_of_choice (see sampling.py)
    sampling_candidates: int | None = None  # power_of_choice: d candidates, clients_per_round <= d
    eval_every: int = 1
    eval_batch_size: int = 2000
    eval_subset: int | None = None  # score the rounds before the last on this many test samples (seeded); null: all
    eval_per_client: bool = False  # also score the global model on every client's test split (data.test_partition)
    stop_at_accuracy: float | None = None
    model: Any = "mnist_cnn"  # model, algorithm, aggregator: a name, an import path or an object
    model_options: dict = field(default_factory=dict)  # keywords of the model's builder (its sizes)
    initial_weights: str | None = None  # a run directory (or its checkpoint.pt) whose global model to start from
    algorithm: Any = "fedavg"
    algorithm_options: dict = field(default_factory=dict)
    aggregator: Any = "fedavg"  # load_config: unset or null gives the algorithm's paper's rule (mean for scaffold)
    aggregator_options: dict = field(default_factory=dict)
    server_optimizer: str = "none"
    server_lr: float | None = None  # None: the optimizer's own default
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    checkpoint_every: int = 1
    worker_timeout: float | None = None  # seconds; None: generous and scaled to the round
    on_worker_failure: str = "stop"  # stop | restart
    on_nonfinite: str = "drop"  # drop | fail
    sharing_strategy: str = "file_descriptor"  # file_descriptor | file_system (CPU runs)
    client_state_limit_mb: float | None = None  # the most the clients' state may take; None: half the host's memory
    privacy: dict | None = None  # DP-FedAvg: {clip, noise_multiplier, delta} (see privacy.py); null: off
    data: DataConfig = field(default_factory=DataConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)  # see compression.py
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)  # mode: async (see asynchronous.py)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters as the updates (see lora.py)

    def to_dict(self) -> dict:
        """Plain values only: a component given as an object is named by ``describe``."""

        def plain(value):
            if isinstance(
                value,
                (
                    Config,
                    DataConfig,
                    LocalConfig,
                    AttackConfig,
                    SystemConfig,
                    CompressionConfig,
                    AsyncConfig,
                    LoraConfig,
                ),
            ):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, list):
                return [plain(v) for v in value]
            if value is None or isinstance(value, (str, int, float, bool)):
                return value
            return describe(value)

        return plain(self)


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
    raw: dict, overrides: dict[str, Any] | str | Iterable[str], origin: str = "config"
) -> dict[str, str]:
    """Write overrides into the raw dict in place; return the dotted keys they set, each with how
    its user spelled it: ``--set`` for the command line's "key=value" strings, ``keyword`` for a
    dict (fedsim.run's keywords).

    A dotted key reaches into a section (``local.lr``) or an option mapping
    (``aggregator_options.beta``); a section that holds something other than a mapping is
    an error, never silently replaced (an empty one, ``local:``, counts as no keys)."""
    if isinstance(overrides, dict):
        items, spelled = list(_flatten(overrides)), "keyword"
    else:
        items = [parse_override(o) for o in ([overrides] if isinstance(overrides, str) else overrides)]
        spelled = "--set"
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


def _flatten(d: dict, prefix: str = ""):
    for key, value in d.items():
        dotted = f"{prefix}{key}"
        # a dict value for a section (data, local, attack) sets its keys one by one;
        # aggregator_options is itself a dict-valued key and is set whole
        if isinstance(value, dict) and dotted in _SECTIONS:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


_SECTIONS = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}
_KEYS = {f.name for f in dataclasses.fields(Config)} | {
    f"{section}.{f.name}" for section in _SECTIONS for f in dataclasses.fields(getattr(Config(), section))
}


# ----------------------------------------------------------------------------- typing


def where(origin: str, key: str, from_overrides: dict[str, str]) -> str:
    """Where a key's value came from: ``--set key`` or ``keyword key``, as its user spelled it
    (also when that gave one of its sub-keys, such as aggregator_options.beta; see
    apply_overrides), or ``FILE: key``."""
    spelled = from_overrides.get(key) or next((s for k, s in from_overrides.items() if k.startswith(key + ".")), None)
    return f"{spelled} {key}" if spelled else f"{origin}: {key}"


def locate(cfg: Config, error: FedsimError) -> FedsimError:
    """An error found after loading (when the data is split, say) that names a key, named as
    validation names it: with the file, or the --set (or keyword), that gave the value."""
    origin, overrides = getattr(cfg, "origin", ("config", {}))
    key, sep, rest = str(error).partition(": ")
    if not sep or key not in _KEYS:
        return error
    located = copy.copy(error)
    located.args = (f"{where(origin, key, overrides)}: {rest}",)
    return located


def build(cls, raw: dict, prefix: str, origin: str, from_overrides: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in _MOVED:
            raise ConfigError(f"{where(origin, dotted, from_overrides)}: is now {_MOVED[dotted]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"{where(origin, cut(dotted), from_overrides)}: unknown key{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:  # `local:` with every key commented out
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{where(origin, dotted, from_overrides)}: expected a mapping of keys, got {shown(value)}"
                )
            kwargs[key] = build(hint, value, dotted + ".", origin, from_overrides)
        else:
            kwargs[key] = _coerce(value, hint, where(origin, dotted, from_overrides))
    return cls(**kwargs)


_TYPE_WORDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a mapping",
    Any: "a name, an import path (pkg.module:name) or, from Python, the object",
}
_MOVED = {"local.mu": "algorithm_options.mu (with algorithm: fedprox)"}
# Integers become int64 tensors and seeds, floats float32 tensor values: beyond these the
# engine cannot represent a value, so validation refuses it rather than a later traceback.
MAX_INT = 2**63 - 1
MAX_FLOAT = 3.4e38
MIN_FLOAT = 1.18e-38  # smaller magnitudes are float32 subnormals: an lr of 1e-45 would be 0
MAX_TIMEOUT = 1_000_000  # seconds
MAX_CLIENTS = 100_000_000


def _coerce(value, hint, where: str):
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: expected {_TYPE_WORDS[hint]}, got null")
    if hint is Any:  # a component: checked when it is resolved (components.check)
        return value
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        dict: isinstance(value, dict),
    }[hint]
    if not ok:
        raise ConfigError(f"{where}: expected {_TYPE_WORDS[hint]}, got {shown(value)}")
    if hint is int and abs(value) > MAX_INT:
        raise ConfigError(
            f"{where}: must be within ±(2^63 - 1), the 64-bit integers the engine computes "
            f"with; got a {value.bit_length()}-bit integer"
        )
    if hint is float:
        value = float(value)
        if not math.isfinite(value) or abs(value) > MAX_FLOAT or 0 < abs(value) < MIN_FLOAT:
            raise ConfigError(
                f"{where}: must be a finite number within ±3.4e38 (float32), and 0 or at least "
                f"1.2e-38 in size, got {value}"
            )
    if hint is str and ("\0" in value or len(value) > 1000):
        raise ConfigError(f"{where}: must be text of at most 1,000 characters without NUL bytes")
    return value


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
    that change what it computes (not where or how fast it runs), or a hash of them where they
    would be long: ``mnist_seed-dataset=synthetic-lr=0.05``."""
    changes = [f"{key.rpartition('.')[2]}={_short(value)}" for key, value in defining(overrides_of(cfg)).items()]
    suffix = "-".join(changes)
    if len(suffix) > 48:
        suffix = "set-" + hashlib.sha1(suffix.encode()).hexdigest()[:8]
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
    where = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__name__)}"
    return where if target is value else f"{where}({_arguments(value)})"


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
