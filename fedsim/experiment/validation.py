"""Loading an experiment and checking it whole: every section's values, then what the sections
say together (a component against its options, privacy against the rule, hogwild against the
rest). Every check raises a one-line ConfigError that names the key, and ``load_config`` adds
where its value came from (the file, or ``--set``). Only the top of the package (runs, sweep,
cli) imports this module: the features it combines never import it back."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..algorithms import ALGORITHMS, Algorithm
from ..core.checks import Checks
from ..core.errors import ConfigError, user_code
from ..core.registry import is_import_path
from ..core.sections import sections, unused
from ..core.yamlfile import experiment_file, read_yaml
from ..fl.aggregation import AGGREGATORS
from ..fl.attacks import Attack, make_attack
from ..fl.attacks.omniscient import Mimic
from ..fl.compression import feeds_back
from ..fl.privacy import RULES, Privacy
from ..fl.system import System
from ..fl.system_config import SystemConfig
from . import components
from .config import SECTIONS, Config, apply_overrides
from .reading import build, where


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
        raw = _nested_copy(source)
    else:
        origin = str(source)
        raw = read_yaml(experiment_file(source))
    raw.pop("sweep", None)  # the grid fedsim sweep runs (runs/sweepgrid.py); a run is the configuration
    sections_given = {key for key, value in raw.items() if value is not None}  # by the source, before overrides
    from_overrides = {**earlier, **apply_overrides(raw, overrides or {}, origin, SECTIONS)}
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
        place = where(origin, key, from_overrides)
        section = key.partition(".")[0]
        # a key left unset in a section that only the overrides gave (privacy.delta beside --set privacy.clip)
        given = next((how for k, how in from_overrides.items() if k.partition(".")[0] == section), None)
        if place.startswith(f"{origin}:") and "." in key and section not in sections_given and given:
            place = f"{given} {key}"
        # options nobody gave, refused for the component an override chose: said of that override
        owner = _OPTIONS_OF.get(key)
        if place.startswith(f"{origin}:") and section not in sections_given and owner in from_overrides:
            place = f"{where(origin, owner, from_overrides)}: {key}"
        raise ConfigError(f"{place}: {message}") from None
    cfg.origin = (origin, from_overrides)  # for errors found later (see config.locate), and overrides_of
    return cfg


_OPTIONS_OF = {"aggregator_options": "aggregator", "algorithm_options": "algorithm", "model_options": "model"}


def _nested_copy(value: Any) -> Any:
    """A config's dicts and lists copied, for the overrides to write into without touching the
    caller's; what they hold (a dataset of a million clients, a model's function) is shared,
    not copied."""
    if isinstance(value, dict):
        return {key: _nested_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_nested_copy(item) for item in value]
    return value


def validate(cfg: Config) -> None:
    """Every section's own checks (its ``check`` method), then what the sections say together;
    raises ConfigError naming the first bad key."""
    for _, section in sections(cfg):
        if hasattr(section, "check"):
            section.check()
    checks = Checks()
    tables = components.tables()
    checks.choice("server_optimizer", cfg.server_optimizer, tables["server optimizers"])
    components.check(cfg)
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    with user_code(f"algorithm: {components.describe(cfg.algorithm)} failed in setup", ConfigError):
        algorithm.setup(cfg)  # where an algorithm refuses the settings it cannot train with
    if cfg.backend == "vmap" and algorithm.trains_own_way:
        checks.fail(
            "backend",
            f"vmap trains a group's clients in lockstep by one local loop; algorithm "
            f"{components.describe(cfg.algorithm)} trains each client its own way: use backend: "
            f"process",
        )
    if cfg.mode == "hogwild":  # first: it refuses whole sections that the checks below detail
        check_hogwild(cfg, checks)
    if cfg.mode == "async":
        check_async(cfg, checks)
    System.check_config(cfg)
    check_attack(cfg)
    check_weightless(cfg, algorithm, checks)
    check_privacy(cfg)  # after the components it is combined with are known to be valid


def check_weightless(cfg: Config, algorithm: Algorithm, checks: Checks) -> None:
    """An algorithm whose clients send no weights (``exchanges_weights``: FedProto's prototypes)
    leaves nothing for what rewrites, compresses or aggregates the weight updates: such a run would
    report an attack, a compression or a rule that changed nothing."""
    if algorithm.exchanges_weights:
        return
    name = components.describe(cfg.algorithm)
    unused = [
        ("aggregator", components.describe(cfg.aggregator) != "fedavg", "aggregator: fedavg"),
        ("pre_aggregators", bool(cfg.pre_aggregators), "no pre_aggregators"),
        ("server_optimizer", cfg.server_optimizer != "none", "server_optimizer: none"),
    ]
    for key, given, allowed in unused:
        if given:
            checks.fail(
                key, f"algorithm {name} exchanges no weights, so there is no weight update to aggregate; use {allowed}"
            )
    attack = make_attack(cfg.attack)
    if type(attack).rewrite is not Attack.rewrite:
        checks.fail(
            "attack.type",
            f"algorithm {name} exchanges no weights, so attack {components.describe(cfg.attack.type)}, which "
            f"rewrites weight updates, would change nothing; use an attack that relabels (label_flip)",
        )
    if cfg.compression.type != "none":
        checks.fail(
            "compression.type",
            f"algorithm {name} exchanges no weights, so there is no update to compress; use compression.type: none",
        )


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
        ("pre_aggregators", bool(cfg.pre_aggregators),
         "hogwild aggregates nothing (every step lands in the one shared model); leave pre_aggregators empty"),
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
    """``mode: async`` (fl/asynchronous.py): refuse, naming the key, every setting it would
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
        ("pre_aggregators", bool(cfg.pre_aggregators),
         "updates are applied as they arrive, one buffer at a time, not as a round's stack; leave pre_aggregators "
         "empty"),
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
    """Keys set to other than their default that this run does not read (each section's options
    say when theirs are not: core/sections.unused), for the run to warn of; and a rule other than
    the one the algorithm's paper fixes, and personal models that nothing scores."""
    warnings = [
        components.aggregator_warning(cfg),
        components.personal_warning(cfg),
        _attack_warning(cfg),
        _choice_warning(cfg),
    ]
    lines = unused(cfg)
    return lines + _unread_by_the_algorithm(cfg, lines) + [w for w in warnings if w]


def _unread_by_the_algorithm(cfg: Config, said: list[str]) -> list[str]:
    """A line for each key that only some algorithms read (Algorithm.reads), set by a run whose
    algorithm does not read it (and not said unread already, in ``said``)."""
    mine = set(components.algorithm(cfg.algorithm, cfg.algorithm_options).reads)
    readers: dict[str, list[str]] = {}
    for name in ALGORITHMS.names():
        for key in ALGORITHMS.get(name).reads:
            readers.setdefault(key, []).append(name)
    default, lines = Config(), []
    for key, names in readers.items():
        value = _value(cfg, key)
        if key in mine or value == _value(default, key) or any(line.startswith(f"{key} is ") for line in said):
            continue
        name = components.describe(cfg.algorithm)
        lines.append(f"{key} is {value!r} but algorithm {name} does not read it (use {' or '.join(names)})")
    return lines


def _value(cfg: Config, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _choice_warning(cfg: Config) -> str | None:
    """A line for power_of_choice under an algorithm whose clients do not use the global model it
    ranks them by (their own models; FedProto's global model never trains)."""
    if cfg.client_sampling != "power_of_choice":
        return None
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    if algorithm.exchanges_weights and not algorithm.has_personal_model:
        return None
    why = (
        "it never trains: no weights are exchanged"
        if not algorithm.exchanges_weights
        else "they use models of their own"
    )
    return (
        f"client_sampling power_of_choice ranks the candidates by their loss under the global model, which the "
        f"clients of algorithm {components.describe(cfg.algorithm)} do not train with ({why})"
    )


def _attack_warning(cfg: Config) -> str | None:
    """A line for a run in which half the clients or more are Byzantine (no rule withstands that), or
    none (a fraction too small for the federation)."""
    if cfg.attack.type == "none":
        return None
    if cfg.attack.count is not None:
        f, n = cfg.attack.count, cfg.clients_per_round + cfg.attack.count
        setting, where = f"attack.count is {f}", f"of the {n} clients of every round"
    else:
        n = cfg.data.num_clients
        f = cfg.attack.members(n)
        setting, where = f"attack.fraction is {cfg.attack.fraction:g}", f"of the {n} clients"
        if f == 0:
            return f"{setting}: round({cfg.attack.fraction:g} x {n}) = 0 {where} are Byzantine; no client attacks"
    if 2 * f < n:
        return None
    return f"{setting}: {f} {where} are Byzantine, half or more, which no aggregation rule withstands"


def check_attack(cfg: Config) -> None:
    """The Byzantine clients of ``attack.count``, outside the federation, hold no data and have no
    client id: refuse what needs either (an attack that rewrites their own update gets the honest
    mean instead, as ByzFL's Byzantine clients do)."""
    if cfg.attack.type == "none":
        return
    attack, checks = make_attack(cfg.attack), Checks()
    if isinstance(attack, Mimic) and attack.target is not None and attack.target >= cfg.clients_per_round:
        checks.fail(
            "attack.options",
            f"target {attack.target} is past the honest updates of a round, {cfg.clients_per_round} at most "
            f"(clients_per_round); choose 0 to {cfg.clients_per_round - 1}, or null",
        )
    if cfg.attack.count is None:
        return
    name = components.describe(cfg.attack.type)
    if attack.relabels:
        checks.fail(
            "attack.count",
            f"attack {name} changes the labels an attacker trains on, and the Byzantine clients of attack.count "
            f"hold no data; use attack.fraction (attackers among the clients)",
        )
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    # fmt: off
    refused = [
        ("algorithm", type(algorithm).server_update is not Algorithm.server_update,
         f"algorithm {components.describe(cfg.algorithm)} updates the model from its clients' reports, which the "
         f"Byzantine clients of attack.count, outside the federation, do not send; use attack.fraction"),
        ("privacy", cfg.privacy is not None,
         "DP-FedAvg accounts for the clients it samples, and those of attack.count are not sampled; use "
         "attack.fraction"),
        ("compression.type", cfg.compression.type != "none",
         "a compressed message carries its client's residual, and the Byzantine clients of attack.count are no "
         "clients of the federation; use attack.fraction"),
    ]
    # fmt: on
    for key, bad, why in refused:
        if bad:
            checks.fail(key, why)


# ----------------------------------------------------------------------------- privacy and the rest


def check_privacy(cfg: Config) -> None:
    """The ``privacy`` section, then what it is combined with. DP-FedAvg's guarantee (see
    fl/privacy.py) holds only for a rule whose output is a sum of per-client contributions each
    bounded by the clip, an algorithm that keeps nothing computed from un-noised client data, no
    error-feedback residuals, and Poisson sampling of clients that are always online."""
    if Privacy.from_config(cfg) is None:
        return
    _privacy_and_aggregator(cfg.aggregator)
    if cfg.pre_aggregators:
        raise ConfigError(
            "privacy: pre_aggregators cannot be used with differential privacy: DP-FedAvg clips each update to "
            "privacy.clip and adds noise to their mean itself; leave pre_aggregators empty"
        )
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
