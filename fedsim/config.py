"""Experiment configuration: typed dataclasses, YAML loading, ``--set`` overrides, validation.

An experiment is one YAML file whose keys mirror the dataclasses below. Every key has a
default, so a file only says what differs. Errors name the file (or ``--set``), the dotted
key and what is allowed, in one line.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from .errors import ConfigError, FedsimError
from .system import SystemConfig


def default_data_root() -> str:
    return os.environ.get("FEDSIM_DATA", "datasets")


@dataclass
class DataConfig:
    dataset: Any = "mnist"  # a name, a .pt/.npz file, an import path, or a Dataset (see components.py)
    root: str = field(default_factory=default_data_root)
    partition: str = "iid"
    num_clients: int = 10
    limit: Optional[int] = None  # use only the first N training samples
    download: bool = True  # fetch a missing dataset into root (torchvision's sources)
    placement: str = "auto"  # device | host | auto: on the device when it takes <= half its free memory
    # partition options; each partition reads the ones it needs
    alpha: float = 0.5  # dirichlet concentration (label skew, or sizes for quantity)
    min_samples: int = 1  # dirichlet: re-draw until every client has this many
    shards_per_client: int = 2
    classes_per_client: int = 2
    sigma: float = 1.0  # quantity: log-normal spread of client sizes
    quantity_skew: str = "lognormal"  # quantity: lognormal | dirichlet
    test_partition: bool = False  # also split the test set per client, same distribution
    augment: Optional[bool] = None  # training-time augmentation; None = the dataset's default


@dataclass
class LocalConfig:
    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 (autocast of forward and loss; weights and SGD stay fp32)


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
    workers: Optional[int] = None  # None: min(clients_per_round, CPU cores), capped on a GPU; 0: none
    mode: str = "sync"  # sync | hogwild: the workers train one shared model lock-free (see hogwild.py)
    backend: str = "process"  # process | vmap
    vmap_group_size: int = 0  # vmap: clients trained together in one group; 0 = the whole round
    clients_per_round: int = 10
    client_sampling: str = "uniform"  # uniform | by_size | power_of_choice (see system.py)
    sampling_candidates: Optional[int] = None  # power_of_choice: d candidates, clients_per_round <= d
    eval_every: int = 1
    eval_batch_size: int = 2000
    eval_per_client: bool = False  # also score the global model on every client's test split (data.test_partition)
    stop_at_accuracy: Optional[float] = None
    model: Any = "mnist_cnn"  # model, algorithm, aggregator: a name, an import path or an object
    algorithm: Any = "fedavg"
    algorithm_options: dict = field(default_factory=dict)
    aggregator: Any = "fedavg"
    aggregator_options: dict = field(default_factory=dict)
    server_optimizer: str = "none"
    server_lr: Optional[float] = None  # None: the optimizer's own default
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    checkpoint_every: int = 1
    worker_timeout: Optional[float] = None  # seconds; None: generous and scaled to the round
    on_worker_failure: str = "stop"  # stop | restart
    on_nonfinite: str = "drop"  # drop | fail
    sharing_strategy: str = "file_descriptor"  # file_descriptor | file_system (CPU runs)
    privacy: Optional[dict] = None  # DP-FedAvg: {clip, noise_multiplier, delta} (see privacy.py); null: off
    data: DataConfig = field(default_factory=DataConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    def to_dict(self) -> dict:
        """Plain values only: a component given as an object is named by ``describe``."""
        from .components import describe

        def plain(value):
            if isinstance(value, (Config, DataConfig, LocalConfig, AttackConfig, SystemConfig)):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, list):
                return [plain(v) for v in value]
            if value is None or isinstance(value, (str, int, float, bool)):
                return value
            return describe(value)

        return plain(self)


# ----------------------------------------------------------------------------- loading


def load_config(source: "str | os.PathLike | dict | Config" = None, overrides=None) -> Config:
    """Build a validated Config from a YAML path, a dict or a Config, plus overrides.

    ``overrides`` is a list of ``"dotted.key=value"`` strings (values parsed as YAML
    scalars, as on the command line) or a dict of ``{"dotted.key": value}``; nested dicts
    such as ``{"local": {"lr": 0.1}}`` work too.
    """
    origin = "config"
    if source is None:
        raw: dict = {}
    elif isinstance(source, Config):
        raw = source.to_dict()
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        origin = str(source)
        raw = _read_yaml(Path(source))
    from_overrides = apply_overrides(raw, overrides or {}, origin)
    cfg = _build(Config, raw, "", origin, from_overrides)
    validate(cfg, origin, from_overrides)
    cfg.origin = (origin, frozenset(from_overrides))  # for errors found later (see locate)
    return cfg


MAX_FILE_BYTES = 1 << 20  # an experiment file is a few hundred bytes; anything near this is not one
MAX_NODES = 10_000  # values in a document once its aliases are expanded
MAX_DEPTH = 32  # nesting of mappings and lists


class RefusedYAML(yaml.MarkedYAMLError):
    """Well-formed YAML that fedsim will not read: too deep, too large, or a key given twice."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: a few hundred bytes of aliases can expand into millions of
    values (which every later copy, dump or error message would then pay for), and deep nesting
    exhausts Python's recursion limit. Documents beyond MAX_DEPTH or MAX_NODES are refused, and
    so is a key given twice in one mapping, which PyYAML would silently resolve to the last."""

    def compose_node(self, parent, index):
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_DEPTH:
            raise RefusedYAML(problem=f"nested more than {MAX_DEPTH} levels deep",
                              problem_mark=self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_document(self, node):
        if _expanded_size(node) > MAX_NODES:
            raise RefusedYAML(problem=f"expands into more than {MAX_NODES:,} values (aliases included)",
                              problem_mark=node.start_mark)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` merges keys that the mapping may then override
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise RefusedYAML(problem=f"key {_cut(repr(key))} given twice in one mapping",
                                      problem_mark=key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads 1e-3 as text; YAML 1.2 and every user read it as the number it means
_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                                     list("-+0123456789"))


def _expanded_size(root) -> int:
    """Nodes of the document with every alias expanded; a recursive alias counts as unbounded.
    Iterative and memoized by node, so neither a long alias chain nor a wide one is costly."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size and not children_done:
            continue
        children = _children(node)
        if children_done:
            size[id(node)] = min(1 + sum(size.get(id(c), MAX_NODES + 1) for c in children), MAX_NODES + 1)
            continue
        size[id(node)] = MAX_NODES + 1  # in progress: a cycle back to it counts as too large
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_yaml(text: str):
    """``yaml.safe_load`` within the bounds of ``_BoundedLoader``."""
    return yaml.load(text, Loader=_BoundedLoader)


def _read_yaml(path: Path) -> dict:
    try:
        if path.is_file() and path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes is too large for an experiment file "
                              f"(at most {MAX_FILE_BYTES:,})")
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a YAML experiment file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        raw = parse_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        kind = "refused" if isinstance(e, RefusedYAML) else "syntax error"
        raise ConfigError(f"{path}: YAML {kind} at {where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of more digits than Python converts
        raise ConfigError(f"{path}: YAML error: {_cut(' '.join(str(e).split()), 200)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """'local.lr=0.1' -> ('local.lr', 0.1); the value is read as YAML (text that is not YAML
    stays text)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {_cut(text)}: expected dotted.key=value, e.g. --set local.lr=0.05")
    try:
        parsed = parse_yaml(value) if value.strip() else None
    except RefusedYAML as e:
        raise ConfigError(f"--set {key}: YAML refused: {e.problem}") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ConfigError(f"--set {key}: {_cut(str(e))}") from None
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def apply_overrides(raw: dict, overrides, origin: str = "config") -> set[str]:
    """Write overrides into the raw dict in place; return the dotted keys they set.

    A dotted key reaches into a section (``local.lr``) or an option mapping
    (``aggregator_options.beta``); a section that holds something other than a mapping is
    an error, never silently replaced (an empty one, ``local:``, counts as no keys)."""
    if isinstance(overrides, dict):
        items = list(_flatten(overrides))
    else:
        items = [parse_override(o) for o in ([overrides] if isinstance(overrides, str) else overrides)]
    for key, value in items:
        node = raw
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                section = ".".join(parts[:depth + 1])
                where = "--set" if section in {k for k, _ in items} else f"{origin}:"
                raise ConfigError(f"{where} {section}: expected a mapping of keys (for --set {key}), "
                                  f"got {_shown(node[part])}")
            node = node[part]
        node[parts[-1]] = value
    return {key for key, _ in items}


def _flatten(d: dict, prefix: str = ""):
    for key, value in d.items():
        dotted = f"{prefix}{key}"
        # a dict value for a section (data, local, attack) sets its keys one by one;
        # aggregator_options is itself a dict-valued key and is set whole
        if isinstance(value, dict) and dotted in _SECTIONS:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _shown(value) -> str:
    """A value for an error message: its type and repr, cut short (it may be huge)."""
    return f"{type(value).__name__} {_cut(repr(value))}"


_SECTIONS = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}
_KEYS = {f.name for f in dataclasses.fields(Config)} | {
    f"{section}.{f.name}" for section in _SECTIONS for f in dataclasses.fields(getattr(Config(), section))}


# ----------------------------------------------------------------------------- typing


def _where(origin: str, key: str, from_overrides: set[str]) -> str:
    """Where a key's value came from: ``--set key`` (also when --set gave one of its sub-keys,
    such as aggregator_options.beta), or ``FILE: key``."""
    overridden = key in from_overrides or any(k.startswith(key + ".") for k in from_overrides)
    return f"--set {key}" if overridden else f"{origin}: {key}"


def locate(cfg: Config, error: FedsimError) -> FedsimError:
    """An error found after loading (when the data is split, say) that names a key, named as
    validation names it: with the file, or the --set, that gave the value."""
    origin, overrides = getattr(cfg, "origin", ("config", frozenset()))
    key, sep, rest = str(error).partition(": ")
    if not sep or key not in _KEYS:
        return error
    located = copy.copy(error)
    located.args = (f"{_where(origin, key, overrides)}: {rest}",)
    return located


def _build(cls, raw: dict, prefix: str, origin: str, from_overrides: set[str]):
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in _MOVED:
            raise ConfigError(f"{_where(origin, dotted, from_overrides)}: is now {_MOVED[dotted]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"{_where(origin, _cut(dotted), from_overrides)}: unknown key{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:  # `local:` with every key commented out
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{_where(origin, dotted, from_overrides)}: expected a mapping of keys, "
                                  f"got {_shown(value)}")
            kwargs[key] = _build(hint, value, dotted + ".", origin, from_overrides)
        else:
            kwargs[key] = _coerce(value, hint, _where(origin, dotted, from_overrides))
    return cls(**kwargs)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping",
               Any: "a name, an import path (pkg.module:name) or, from Python, the object"}
_MOVED = {"local.mu": "algorithm_options.mu (with algorithm: fedprox)"}
# Integers become int64 tensors and seeds, floats float32 tensor values: beyond these the
# engine cannot represent a value, so validation refuses it rather than a later traceback.
MAX_INT = 2**63 - 1
MAX_FLOAT = float(3.4e38)
MIN_FLOAT = float(1.18e-38)  # smaller magnitudes are float32 subnormals: an lr of 1e-45 would be 0
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
        raise ConfigError(f"{where}: expected {_TYPE_WORDS[hint]}, got {_shown(value)}")
    if hint is int and abs(value) > MAX_INT:
        raise ConfigError(f"{where}: must be within ±(2^63 - 1), the 64-bit integers the engine computes "
                          f"with; got a {value.bit_length()}-bit integer")
    if hint is float:
        value = float(value)
        if not math.isfinite(value) or abs(value) > MAX_FLOAT or 0 < abs(value) < MIN_FLOAT:
            raise ConfigError(f"{where}: must be a finite number within ±3.4e38 (float32), and 0 or at least "
                              f"1.2e-38 in size, got {value}")
    if hint is str and ("\0" in value or len(value) > 1000):
        raise ConfigError(f"{where}: must be text of at most 1,000 characters without NUL bytes")
    return value


# ----------------------------------------------------------------------------- validation

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def validate(cfg: Config, origin: str = "config", from_overrides: set[str] = frozenset()) -> None:
    """Range and name checks; raises ConfigError naming the first bad key."""
    from . import components  # these import torch; load them only when validating
    from .privacy import Privacy
    from .registry import tables
    from .system import System

    tables = tables()

    def fail(key, message):
        raise ConfigError(f"{_where(origin, key, from_overrides)}: {message}")

    def at_least(key, value, low):
        if value < low:
            fail(key, f"must be >= {low}, got {value}")

    def choice(key, value, table):
        if value not in table:
            fail(key, f"unknown {table.kind} {_cut(repr(value))}; choose one of: {', '.join(table.names())}")

    def one_of(key, value, allowed):
        if value not in allowed:
            fail(key, f"must be one of {', '.join(allowed)}, got {_cut(repr(value))}")

    d, loc = cfg.data, cfg.local
    if not cfg.name.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in cfg.name):
        fail("name", f"must be a non-empty name without control characters, got {_shown(cfg.name)}")
    if not _DEVICE.fullmatch(cfg.device):
        fail("device", f"must be auto, cpu, cuda or cuda:N, got {_cut(repr(cfg.device))}")
    at_least("seed", cfg.seed, 0)
    at_least("rounds", cfg.rounds, 1)
    at_least("data.num_clients", d.num_clients, 1)
    if d.num_clients > MAX_CLIENTS:  # the engine keeps per-client tensors (attackers, SCAFFOLD's c_i)
        fail("data.num_clients", f"must be at most {MAX_CLIENTS:,}, got {d.num_clients:,}")
    at_least("clients_per_round", cfg.clients_per_round, 1)
    if cfg.clients_per_round > d.num_clients:
        fail("clients_per_round", f"must be <= data.num_clients ({d.num_clients}), got {cfg.clients_per_round}")
    if cfg.workers is not None:
        at_least("workers", cfg.workers, 0)
        if cfg.workers > cfg.clients_per_round:
            fail("workers", f"must be <= clients_per_round ({cfg.clients_per_round}): "
                            f"a worker without a client would idle, got {cfg.workers}")
    at_least("vmap_group_size", cfg.vmap_group_size, 0)
    if cfg.backend == "vmap" and cfg.workers is not None and cfg.workers > work_items(cfg):
        fail("workers", f"must be <= the {work_items(cfg)} vmap group(s) of a round (clients_per_round / "
                        f"vmap_group_size, rounded up), got {cfg.workers}")
    at_least("eval_every", cfg.eval_every, 1)
    at_least("eval_batch_size", cfg.eval_batch_size, 1)
    at_least("checkpoint_every", cfg.checkpoint_every, 0)
    if cfg.stop_at_accuracy is not None and not 0 < cfg.stop_at_accuracy <= 1:
        fail("stop_at_accuracy", f"must be a fraction in (0, 1], got {cfg.stop_at_accuracy}")
    if cfg.worker_timeout is not None and not 0 < cfg.worker_timeout <= MAX_TIMEOUT:
        fail("worker_timeout", f"must be > 0 and at most {MAX_TIMEOUT:,} seconds (waits are counted in "
                               f"milliseconds of a C int), got {cfg.worker_timeout}")
    if d.limit is not None and d.limit < d.num_clients:
        fail("data.limit", f"must be >= data.num_clients ({d.num_clients}) so every client gets data, got {d.limit}")
    if d.alpha <= 0:
        fail("data.alpha", f"must be > 0, got {d.alpha}")
    at_least("data.sigma", d.sigma, 0)
    at_least("data.min_samples", d.min_samples, 0)
    at_least("data.shards_per_client", d.shards_per_client, 1)
    at_least("data.classes_per_client", d.classes_per_client, 1)
    one_of("data.quantity_skew", d.quantity_skew, ("lognormal", "dirichlet"))
    at_least("local.epochs", loc.epochs, 1)
    at_least("local.batch_size", loc.batch_size, 1)
    if loc.lr <= 0:
        fail("local.lr", f"must be > 0, got {loc.lr}")
    if not 0 <= loc.momentum < 1:
        fail("local.momentum", f"must be in [0, 1), got {loc.momentum}")
    at_least("local.weight_decay", loc.weight_decay, 0)
    if cfg.server_lr is not None and cfg.server_lr <= 0:
        fail("server_lr", f"must be > 0, got {cfg.server_lr}")
    for key in ("server_momentum", "server_beta1", "server_beta2"):
        if not 0 <= getattr(cfg, key) < 1:
            fail(key, f"must be in [0, 1), got {getattr(cfg, key)}")
    if not 0 < cfg.server_tau <= 1e18:
        fail("server_tau", f"must be > 0 and at most 1e18 (its square must fit in float32), got {cfg.server_tau}")
    if not 0 <= cfg.attack.fraction < 1:
        fail("attack.fraction", f"must be in [0, 1), got {cfg.attack.fraction}")
    one_of("mode", cfg.mode, ("sync", "hogwild"))
    one_of("backend", cfg.backend, ("process", "vmap"))
    one_of("local.precision", loc.precision, ("fp32", "bf16"))
    one_of("data.placement", d.placement, ("auto", "device", "host"))
    one_of("on_worker_failure", cfg.on_worker_failure, ("stop", "restart"))
    one_of("on_nonfinite", cfg.on_nonfinite, ("drop", "fail"))
    one_of("sharing_strategy", cfg.sharing_strategy, ("file_descriptor", "file_system"))
    choice("data.partition", d.partition, tables["partitions"])
    choice("server_optimizer", cfg.server_optimizer, tables["server optimizers"])
    choice("attack.type", cfg.attack.type, tables["attacks"])
    if cfg.attack.type != "none" and cfg.attack.fraction == 0:
        fail("attack.fraction", f"attack.type is {cfg.attack.type} but fraction is 0; set a fraction in (0, 1)")
    if cfg.eval_per_client and not d.test_partition:
        fail("eval_per_client", "needs data.test_partition: true, which gives every client its own test split")
    try:
        components.check(cfg)
        if cfg.mode == "hogwild":  # first: it refuses whole sections that the checks below detail
            from .hogwild import check_config

            check_config(cfg)
        System.check_config(cfg)
        Privacy.check(cfg)  # after the components it is combined with are known to be valid
    except ConfigError as e:  # the message starts with the key it is about
        key, _, message = str(e).partition(": ")
        fail(key, message)


_PARTITION_KEYS = ("alpha", "min_samples", "shards_per_client", "classes_per_client", "sigma", "quantity_skew")


def unused_settings(cfg: Config) -> list[str]:
    """Partition options set to other than their default although the chosen partition does not
    read them, and system settings that do nothing (see System.warnings): a run would silently
    ignore them, so the run warns."""
    from .data import options_for
    from .system import System

    used, default = options_for(cfg.data.partition, cfg.data), DataConfig()
    return [f"data.{key} is {getattr(cfg.data, key)!r} but data.partition {cfg.data.partition} does not use it"
            for key in _PARTITION_KEYS if key not in used and getattr(cfg.data, key) != getattr(default, key)] + \
        System.from_config(cfg).warnings()


def vmap_group_size(cfg: Config) -> int:
    """Clients trained together in one vmap group: vmap_group_size, where 0 means the whole round."""
    return cfg.vmap_group_size or cfg.clients_per_round


def work_items(cfg: Config) -> int:
    """What a round is divided into among the workers: its clients, or its vmap groups."""
    if cfg.backend == "vmap":
        return -(-cfg.clients_per_round // vmap_group_size(cfg))
    return cfg.clients_per_round


def save_config(cfg: Config, path: Path) -> None:
    from .results import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
