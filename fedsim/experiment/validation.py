"""Loading an experiment and checking it whole: every section's values, then what the sections
say together (a component against its options, privacy against the rule, hogwild against the
rest). Every check raises a one-line ConfigError that names the key, and ``load_config`` adds
where its value came from (the file, or ``--set``). Only the top of the package (runs, sweep,
cli) imports this module: the features it combines never import it back."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..algorithms import Algorithm
from ..core.checks import Checks, shown
from ..core.errors import ConfigError, cut
from ..core.registry import is_import_path
from ..core.yamlfile import experiment_file, read_yaml
from ..data import options_for
from ..data.hub import check_hub_options
from ..data.text import check_tokenizer_spec, template_fields
from ..fl import asynchronous, compression, lora
from ..fl.aggregation import AGGREGATORS
from ..fl.compression import feeds_back
from ..fl.privacy import RULES, Privacy
from ..fl.system import System
from ..fl.system_config import SystemConfig
from . import components
from .config import MAX_CLIENTS, MAX_TIMEOUT, Config, DataConfig, apply_overrides, build, groups_per_round, where

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_PARTITION_KEYS = (
    "alpha",
    "min_samples",
    "balanced",
    "shards_per_client",
    "classes_per_client",
    "sigma",
    "quantity_skew",
)


def load_config(
    source: str | os.PathLike | dict | Config = None, overrides: dict[str, Any] | str | Iterable[str] | None = None
) -> Config:
    """Build a validated Config from a YAML path (or the name of a shipped experiment,
    ``"mnist_seed"``), a dict or a Config, plus overrides.

    ``overrides`` is a list of ``"dotted.key=value"`` strings (values parsed as YAML
    scalars, as on the command line) or a dict of ``{"dotted.key": value}``; nested dicts
    such as ``{"local": {"lr": 0.1}}`` work too.
    """
    origin, earlier = "config", {}
    if source is None:
        raw: dict = {}
    elif isinstance(source, Config):
        raw = source.to_dict()
        origin, earlier = getattr(source, "origin", (origin, earlier))  # its overrides stay overrides
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        origin = str(source)
        raw = read_yaml(experiment_file(source))
    from_overrides = {**earlier, **apply_overrides(raw, overrides or {}, origin)}
    rule_named = raw.get("aggregator") is not None
    if not rule_named:  # no aggregator, or null: the one the algorithm's paper fixes
        raw.pop("aggregator", None)
    cfg = build(Config, raw, "", origin, from_overrides)
    try:
        if not rule_named:
            cfg.aggregator = components.default_aggregator(cfg.algorithm)
        validate(cfg)
    except ConfigError as e:  # the message starts with the key it is about
        key, _, message = str(e).partition(": ")
        raise ConfigError(f"{where(origin, key, from_overrides)}: {message}") from None
    cfg.origin = (origin, from_overrides)  # for errors found later (see config.locate), and overrides_of
    return cfg


def validate(cfg: Config) -> None:
    """Every check, section by section; raises ConfigError naming the first bad key."""
    checks = Checks()
    _check_run(cfg, checks)
    _check_data(cfg.data, Checks("data"))
    _check_training(cfg, checks)
    tables = components.tables()
    checks.choice("data.partition", cfg.data.partition, tables["partitions"])
    checks.choice("server_optimizer", cfg.server_optimizer, tables["server optimizers"])
    checks.choice("attack.type", cfg.attack.type, tables["attacks"])
    if cfg.attack.type != "none" and cfg.attack.fraction == 0:
        checks.fail("attack.fraction", f"attack.type is {cfg.attack.type} but fraction is 0; set a fraction in (0, 1)")
    if cfg.eval_per_client and not cfg.data.test_partition:
        checks.fail("eval_per_client", "needs data.test_partition: true, which gives every client its own test split")
    components.check(cfg)
    if cfg.backend == "vmap" and components.algorithm(cfg.algorithm, cfg.algorithm_options).trains_own_way:
        checks.fail(
            "backend",
            f"vmap trains a group's clients in lockstep by one local SGD; algorithm "
            f"{components.describe(cfg.algorithm)} trains each client its own way: use backend: "
            f"process",
        )
    compression.check(cfg.compression)
    asynchronous.check(cfg.asynchronous)
    lora.check(cfg.lora)
    if cfg.mode == "hogwild":  # first: it refuses whole sections that the checks below detail
        check_hogwild(cfg, checks)
    if cfg.mode == "async":
        check_async(cfg, checks)
    System.check_config(cfg)
    check_privacy(cfg)  # after the components it is combined with are known to be valid


def _check_run(cfg: Config, checks: Checks) -> None:
    """How the run is executed: name, device, rounds, workers, evaluation, failures."""
    if not cfg.name.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in cfg.name):
        checks.fail("name", f"must be a non-empty name without control characters, got {shown(cfg.name)}")
    if not _DEVICE.fullmatch(cfg.device):
        checks.fail("device", f"must be auto, cpu, cuda or cuda:N, got {cut(repr(cfg.device))}")
    checks.at_least("seed", cfg.seed, 0)
    checks.at_least("rounds", cfg.rounds, 1)
    checks.at_least("data.num_clients", cfg.data.num_clients, 1)
    if cfg.data.num_clients > MAX_CLIENTS:  # the engine keeps per-client tensors (attackers, SCAFFOLD's c_i)
        checks.fail("data.num_clients", f"must be at most {MAX_CLIENTS:,}, got {cfg.data.num_clients:,}")
    checks.at_least("clients_per_round", cfg.clients_per_round, 1)
    if cfg.clients_per_round > cfg.data.num_clients:
        checks.fail(
            "clients_per_round", f"must be <= data.num_clients ({cfg.data.num_clients}), got {cfg.clients_per_round}"
        )
    if cfg.workers is not None:
        checks.at_least("workers", cfg.workers, 0)
        if cfg.workers > cfg.clients_per_round:
            checks.fail(
                "workers",
                f"must be <= clients_per_round ({cfg.clients_per_round}): "
                f"a worker without a client would idle, got {cfg.workers}",
            )
    checks.at_least("vmap_group_size", cfg.vmap_group_size, 0)
    if cfg.backend == "vmap" and cfg.workers is not None and cfg.workers > groups_per_round(cfg):
        checks.fail(
            "workers",
            f"must be <= the {groups_per_round(cfg)} vmap group(s) of a round (clients_per_round "
            f"/ vmap_group_size, rounded up), got {cfg.workers}",
        )
    checks.at_least("eval_every", cfg.eval_every, 1)
    if cfg.eval_subset is not None:
        checks.at_least("eval_subset", cfg.eval_subset, 1)
    checks.at_least("eval_batch_size", cfg.eval_batch_size, 1)
    checks.at_least("checkpoint_every", cfg.checkpoint_every, 0)
    if cfg.stop_at_accuracy is not None and not 0 < cfg.stop_at_accuracy <= 1:
        checks.fail("stop_at_accuracy", f"must be a fraction in (0, 1], got {cfg.stop_at_accuracy}")
    if cfg.worker_timeout is not None and not 0 < cfg.worker_timeout <= MAX_TIMEOUT:
        checks.fail(
            "worker_timeout",
            f"must be > 0 and at most {MAX_TIMEOUT:,} seconds (waits are counted in "
            f"milliseconds of a C int), got {cfg.worker_timeout}",
        )
    checks.one_of("mode", cfg.mode, ("sync", "async", "hogwild"))
    checks.one_of("backend", cfg.backend, ("process", "vmap"))
    checks.one_of("on_worker_failure", cfg.on_worker_failure, ("stop", "restart"))
    checks.one_of("on_nonfinite", cfg.on_nonfinite, ("drop", "fail"))
    checks.one_of("sharing_strategy", cfg.sharing_strategy, ("file_descriptor", "file_system"))
    if cfg.client_state_limit_mb is not None:
        checks.positive("client_state_limit_mb", cfg.client_state_limit_mb)


def _check_data(d: DataConfig, checks: Checks) -> None:
    check_hub_options(d.dataset, d.hf)
    if isinstance(d.hf, dict) and isinstance(d.hf.get("text"), str):
        template_fields(d.hf["text"])  # a template's braces, before any data is read
    check_tokenizer_spec(d.tokenizer)
    checks.within("sequence_length", d.sequence_length, 2, 1_000_000)
    if d.limit is not None and d.limit < d.num_clients:
        checks.fail("limit", f"must be >= data.num_clients ({d.num_clients}) so every client gets data, got {d.limit}")
    if d.alpha <= 0:
        checks.fail("alpha", f"must be > 0, got {d.alpha}")
    checks.at_least("sigma", d.sigma, 0)
    checks.at_least("min_samples", d.min_samples, 0)
    checks.at_least("shards_per_client", d.shards_per_client, 1)
    checks.at_least("classes_per_client", d.classes_per_client, 1)
    checks.one_of("quantity_skew", d.quantity_skew, ("lognormal", "dirichlet"))
    checks.one_of("placement", d.placement, ("auto", "device", "host"))


def _check_training(cfg: Config, checks: Checks) -> None:
    """Local training, the server optimizer and the attack."""
    local = Checks("local")
    local.at_least("epochs", cfg.local.epochs, 1)
    if cfg.local.steps is not None:
        local.at_least("steps", cfg.local.steps, 1)
    local.at_least("batch_size", cfg.local.batch_size, 1)
    if cfg.local.lr <= 0:
        local.fail("lr", f"must be > 0, got {cfg.local.lr}")
    local.within("momentum", cfg.local.momentum, 0, 1, "[)")
    local.at_least("weight_decay", cfg.local.weight_decay, 0)
    local.one_of("precision", cfg.local.precision, ("fp32", "bf16"))
    local.one_of("optimizer", cfg.local.optimizer, ("sgd", "adamw"))
    if cfg.local.optimizer == "adamw":
        local.within("beta1", cfg.local.beta1, 0, 1, "[)")
        local.within("beta2", cfg.local.beta2, 0, 1, "[)")
        local.positive("eps", cfg.local.eps)
        if cfg.local.momentum:
            local.fail("momentum", "is SGD's; adamw's first moment decays by local.beta1: leave momentum at 0")
        if cfg.backend == "vmap":
            checks.fail("backend", "vmap steps its clients by SGD; local.optimizer: adamw trains with backend: process")
    if cfg.server_lr is not None and cfg.server_lr <= 0:
        checks.fail("server_lr", f"must be > 0, got {cfg.server_lr}")
    for key in ("server_momentum", "server_beta1", "server_beta2"):
        checks.within(key, getattr(cfg, key), 0, 1, "[)")
    if not 0 < cfg.server_tau <= 1e18:
        checks.fail(
            "server_tau", f"must be > 0 and at most 1e18 (its square must fit in float32), got {cfg.server_tau}"
        )
    Checks("attack").within("fraction", cfg.attack.fraction, 0, 1, "[)")


def check_hogwild(cfg: Config, checks: Checks) -> None:
    """``mode: hogwild`` (execution/hogwild.py): refuse, naming the key, every setting it would
    silently ignore."""
    n = cfg.data.num_clients
    system = [
        f"system.{f.name}"
        for f in dataclasses.fields(cfg.system)
        if getattr(cfg.system, f.name) != getattr(SystemConfig(), f.name)
    ]
    # a table, kept as written: each entry's key, test and reason
    # fmt: off
    refused = [
        ("algorithm", components.describe(cfg.algorithm) != "fedavg",
         "hogwild trains by plain local SGD, with no client term and no server update; use algorithm: fedavg"),
        ("aggregator", components.describe(cfg.aggregator) != "fedavg",
         "hogwild aggregates nothing (every step lands in the one shared model); use aggregator: fedavg"),
        ("server_optimizer", cfg.server_optimizer != "none",
         "hogwild has no aggregated update for a server optimizer to apply; use server_optimizer: none"),
        ("attack.type", cfg.attack.type != "none",
         "hogwild has no client updates for an attack to rewrite; use attack.type: none"),
        ("backend", cfg.backend != "process",
         "vmap trains copies of the weights; hogwild trains the shared weights themselves: use backend: process"),
        ("clients_per_round", cfg.clients_per_round != n,
         f"a hogwild round is one pass over every client; set it to data.num_clients ({n}), "
         f"got {cfg.clients_per_round}"),
        ("compression.type", cfg.compression.type != "none",
         "hogwild has no client updates to compress (every step lands in the one shared model); "
         "use compression.type: none"),
        ("privacy", cfg.privacy is not None,
         "DP-FedAvg clips and noises client updates, which hogwild does not have; remove the privacy section"),
        ("client_sampling", cfg.client_sampling != "uniform",
         "a hogwild round trains every client, so there is no sample to choose; use client_sampling: uniform"),
        ("sampling_candidates", cfg.sampling_candidates is not None,
         "a hogwild round trains every client, so there is no sample to choose; leave it unset"),
        (system[0] if system else "system", bool(system),
         "system heterogeneity is simulated for synchronous rounds only; leave the system section out"),
    ]
    # fmt: on
    _refuse(checks, refused, "hogwild")


def check_async(cfg: Config, checks: Checks) -> None:
    """``mode: async`` (asynchronous.py): refuse, naming the key, every setting it would
    silently ignore or apply wrongly."""
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    method = cfg.asynchronous.method
    # a table, kept as written: each entry's key, test and reason
    # fmt: off
    refused = [
        ("algorithm", not algorithm.needs_only_weights,
         f"FedBuff and FedAsync apply each client's trained weights as they arrive; algorithm "
         f"{components.describe(cfg.algorithm)} keeps state or reports they do not update; use fedavg or fedprox"),
        ("aggregator", components.describe(cfg.aggregator) != "fedavg",
         "updates are weighted by their staleness (asynchronous.staleness), not by a rule; use aggregator: fedavg"),
        ("server_optimizer", method == "fedasync" and cfg.server_optimizer != "none",
         "FedAsync mixes each update into the global model itself (asynchronous.mixing); use server_optimizer: "
         "none, or asynchronous.method: fedbuff"),
        ("attack.type", cfg.attack.type != "none",
         "attacks rewrite a synchronous round's updates; use attack.type: none"),
        ("compression.type", cfg.compression.type != "none",
         "compression is simulated for synchronous rounds only; use compression.type: none"),
        ("privacy", cfg.privacy is not None,
         "DP-FedAvg's accounting is for sampled synchronous rounds; remove the privacy section"),
        ("client_sampling", cfg.client_sampling != "uniform",
         "a client that starts is drawn uniformly among those not training; use client_sampling: uniform"),
        ("sampling_candidates", cfg.sampling_candidates is not None,
         "a client that starts is drawn uniformly among those not training; leave it unset"),
        ("system.availability", cfg.system.availability != 1,
         "an async run has no rounds in which a client is online or not; leave it at 1"),
        ("system.deadline", cfg.system.deadline is not None,
         "the server waits for no round: every client reports when it finishes; leave it null"),
        ("system.stragglers", cfg.system.stragglers != "drop",
         "without a deadline nobody straggles; leave it out"),
    ]
    # fmt: on
    _refuse(checks, refused, "async")


def _refuse(checks: Checks, refused: list, mode: str) -> None:
    """The first setting of ``refused`` (key, whether it is set, why it cannot be) that is set."""
    for key, bad, why in refused:
        if bad:
            checks.fail(key, f"{why} (mode: {mode})")


def unused_settings(cfg: Config) -> list[str]:
    """Partition options set to other than their default although the chosen partition does not
    read them, and system settings that do nothing (see System.warnings): a run would silently
    ignore them, so the run warns. So it does for a rule other than the one the algorithm's
    paper fixes, and for personal models that nothing scores."""
    used, default = options_for(cfg.data.partition, cfg.data), DataConfig()
    privacy = cfg.privacy if isinstance(cfg.privacy, dict) else {}
    return (
        [
            f"data.{key} is {getattr(cfg.data, key)!r} but data.partition {cfg.data.partition} does not use it"
            for key in _PARTITION_KEYS
            if key not in used and getattr(cfg.data, key) != getattr(default, key)
        ]
        + [
            f"privacy.{key} is {privacy[key]!r} but privacy.target_quantile is null: the clip is fixed"
            for key in ("clip_learning_rate", "count_noise")
            if privacy.get(key) is not None and privacy.get("target_quantile") is None
        ]
        + compression.unused_options(cfg.compression)
        + System.from_config(cfg).warnings()
        + (
            asynchronous.unused_options(cfg.asynchronous)
            if cfg.mode == "async"
            else [
                f"asynchronous.{key} is set but mode is {cfg.mode}: set mode: async to use it"
                for key, value in vars(cfg.asynchronous).items()
                if value != getattr(asynchronous.AsyncConfig(), key)
            ]
        )
        + [w for w in [components.aggregator_warning(cfg), components.personal_warning(cfg)] if w]
    )


# ----------------------------------------------------------------------------- privacy and the rest


def check_privacy(cfg: Config) -> None:
    """The ``privacy`` section, then what it is combined with. DP-FedAvg's guarantee (see
    fl/privacy.py) holds only for a rule whose output is a sum of per-client contributions each
    bounded by the clip, an algorithm that keeps nothing computed from un-noised client data, no
    error-feedback residuals, and Poisson sampling of clients that are always online."""
    if Privacy.from_config(cfg) is None:
        return
    _privacy_and_aggregator(cfg.aggregator)
    _privacy_and_algorithm(cfg)
    _privacy_and_compression(cfg)
    _privacy_and_sampling(cfg)


def _privacy_and_aggregator(spec) -> None:
    registered = isinstance(spec, str) and not is_import_path(spec)
    if registered and spec in RULES:
        return
    if registered and spec in AGGREGATORS:
        why = (
            "its output is not a sum of per-client contributions each bounded by privacy.clip, so the Gaussian "
            "mechanism's sensitivity bound does not hold"
        )
    else:
        why = (
            "fedsim cannot tell that its output is a sum of per-client contributions each bounded by "
            "privacy.clip, which the Gaussian mechanism's sensitivity bound needs"
        )
    raise ConfigError(
        f"privacy: aggregator {components.describe(spec)} cannot be used with differential privacy: "
        f"{why}; use aggregator fedavg or mean (under privacy both are the unweighted mean of the "
        f"clipped updates)"
    )


def _privacy_and_algorithm(cfg) -> None:
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    name = components.describe(cfg.algorithm)
    try:
        algorithm.setup(cfg)
        kept = [
            ("server state", algorithm.server_state(1)),
            ("client state", algorithm.client_state(1)),
            ("client reports", algorithm.report_shapes(1)),
        ]
    except ConfigError:
        raise
    except Exception as e:  # the user's code: say whose, in one line
        raise ConfigError(
            f"algorithm: {name} failed when asked for its state ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    reasons = [f"{what} {', '.join(map(repr, shapes))}" for what, shapes in kept if shapes]
    if type(algorithm).server_update is not Algorithm.server_update:
        reasons.append("its own server_update")
    if reasons:
        listed = reasons[0] if len(reasons) == 1 else f"{', '.join(reasons[:-1])} and {reasons[-1]}"
        raise ConfigError(
            f"privacy: algorithm {name} cannot be used with differential privacy: it has {listed}, "
            f"which see the clients' un-noised data and so would leak it; use an algorithm that only "
            f"changes local training (fedavg, fedprox)"
        )


def _privacy_and_compression(cfg) -> None:
    section = getattr(cfg, "compression", None)
    if section is not None and feeds_back(section):
        raise ConfigError(
            "compression.error_feedback: cannot be used with differential privacy: each client's "
            "residual is state kept from the rounds it took part in, which the accounting (each "
            "round's contribution a function of the client's data and the current model) does not "
            "cover, as with an algorithm's client state; set compression.error_feedback: false"
        )


def _privacy_and_sampling(cfg) -> None:
    """The accountant's rate q = K / N is each client's chance to be in a round only under Poisson
    sampling of clients that are always online."""
    sampling = getattr(cfg, "client_sampling", "uniform")
    if sampling != "poisson":
        why = {
            "uniform": "it samples exactly clients_per_round clients, for which the Poisson accounting is not "
            "a proven bound",
            "power_of_choice": "it makes some clients likelier to be sampled, by their loss on their own "
            "data, which is not noised",
        }.get(sampling, "it makes some clients likelier to be sampled than others")
        raise ConfigError(
            f"client_sampling: {sampling} cannot be used with privacy: {why}; use client_sampling: "
            f"poisson (each client joins a round with probability clients_per_round / "
            f"data.num_clients, as DP-FedAvg assumes)"
        )
    system = getattr(cfg, "system", None)
    availability = (
        system.get("availability", 1.0) if isinstance(system, Mapping) else getattr(system, "availability", 1.0)
    )
    if availability != 1:
        raise ConfigError(
            f"privacy: system.availability {availability!r} cannot be used with differential privacy: "
            f"clients that are online more often are sampled more often than clients_per_round / "
            f"data.num_clients, the sampling rate the accountant assumes; leave availability at 1"
        )
