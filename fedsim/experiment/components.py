"""The parts of a run a user can bring: a model, an aggregation rule and pre-aggregators, an
algorithm, a dataset.

Each config key (``model``, ``aggregator``, ``algorithm``, ``data.dataset``, and each entry of
``pre_aggregators``) takes a name fedsim registers, an import path ``pkg.module:attr``
(imported in every process that needs it), or, from Python, the object itself:

    model            a function or nn.Module class: no arguments, or (input_shape, num_classes)
    aggregator       a function (updates [k, P], weights [k], **aggregator_options) -> [P]
    pre_aggregators  functions (updates, weights, generator, **options) -> (updates [k', P], weights [k'])
    algorithm        an Algorithm instance, or a subclass built with algorithm_options
    data.dataset     a Dataset (fedsim.data.from_tensors), or a .pt / .npz file of its tensors

Objects reach the worker processes by value, serialized with cloudpickle, so a function or
class defined in a notebook cell or a script's ``__main__`` works there too. Whatever cannot
be used is refused in one line, before any worker is handed anything: not importable, the
wrong kind of object, the wrong signature, the wrong output on a probe call.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..algorithms import ALGORITHMS, Algorithm
from ..core.checks import refuse_unknown
from ..core.errors import ConfigError, FedsimError, user_code
from ..core.files import read_checkpoint
from ..core.flat import FlatModel
from ..core.registry import is_import_path, load_attr, registered
from ..data import DATASETS, PARTITIONS, check_dataset_spec, hub, text
from ..fl import aggregation
from ..fl.aggregation import AGGREGATORS, PRE_AGGREGATORS, PreAggregator, Rule, preaggregation
from ..fl.asynchronous import ASYNC_METHODS
from ..fl.attacks import ATTACKS
from ..fl.compression import COMPRESSORS
from ..fl.sampling import CLIENT_SAMPLINGS
from ..fl.server_opt import SERVER_OPTIMIZERS
from ..models import language as language_models
from ..models import lora
from ..models.lora import apply_lora
from ..models.zoo import MODELS
from .config import Config, describe, plain

KEYS = ("model", "aggregator", "algorithm", "data.dataset", "attack.type")
SHIPPED = ("model", "algorithm", "attack.type")  # what the workers use


def get(cfg: Config, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def _set(cfg, key: str, value) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, value)


def _resolve(key: str, spec, table):
    """A registered entry, an imported attribute, or the object given."""
    if not isinstance(spec, str):
        return spec
    if is_import_path(spec):
        return load_attr(key, spec)
    return registered(key, table, spec)


def _takes(fn, counts: tuple[int, ...], key: str, wanted: str) -> int:
    """How many positional arguments ``fn`` wants, if it is one of ``counts``."""
    try:
        signature = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
    except (TypeError, ValueError):
        return counts[-1]  # a builtin: trust it
    params = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if inspect.isclass(fn):
        params = params[1:]  # self
    required = [p for p in params if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    for count in counts:
        if len(required) <= count and (len(params) >= count or varargs):
            return count
    raise ConfigError(f"{key}: {describe(fn)} takes ({', '.join(p.name for p in params)}); {wanted}")


# ----------------------------------------------------------------------------- models


def model_builder(spec: Any) -> Callable[..., torch.nn.Module]:
    """A function (input_shape, num_classes, **model_options) -> nn.Module for a model spec."""
    if isinstance(spec, str) and language_models.is_hf_model(spec):
        return functools.partial(language_models.hf_model, spec)
    target = _resolve("model", spec, MODELS)
    if not callable(target):
        raise ConfigError(f"model: {describe(spec)} is a {type(target).__name__}, not a function or nn.Module class")
    if isinstance(spec, str) and not is_import_path(spec):
        return target  # registered builders take (input_shape, num_classes, **options)
    count = _takes(target, (0, 2), "model", "a model builder takes no arguments or (input_shape, num_classes)")
    return (lambda shape, classes, /, **options: target(**options)) if count == 0 else target


def check_model_options(spec: Any, options: dict) -> None:
    """Refuse a ``model_options`` key that names an argument fedsim fills itself: a builder is
    called with the dataset's input shape and number of classes as its first two arguments, so
    an option of the same name would give that argument twice."""
    builder = model_builder(spec)
    try:
        signature = inspect.signature(builder.__init__ if inspect.isclass(builder) else builder)
    except (TypeError, ValueError):
        return  # a builtin: nothing to compare
    params = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    filled = params[1:3] if inspect.isclass(builder) else params[:2]  # past self
    sources = (
        "the input shape comes from the dataset's inputs",
        "the number of classes comes from the dataset (its labels, or the num_classes its file declares)",
    )
    for param, source in zip(filled, sources):
        if param.kind is param.POSITIONAL_OR_KEYWORD and param.name in options:  # positional-only names stay free
            raise ConfigError(
                f"model_options.{param.name}: {source}, and fedsim passes it to model {describe(spec)} "
                f"itself; remove it from model_options"
            )
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # it takes any option: its own error names what it refuses
    named = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    refuse_unknown("model_options", describe(spec), options, named[len(filled) + inspect.isclass(builder) :])


def build_model(
    spec: Any, input_shape: tuple[int, ...], num_classes: int, options: dict | None = None
) -> torch.nn.Module:
    builder = model_builder(spec)
    with user_code(f"model: {describe(spec)} failed when it was built", ConfigError):
        module = builder(input_shape, num_classes, **(options or {}))
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model: {describe(spec)} returned a {type(module).__name__}, not a torch.nn.Module")
    if not any(True for _ in module.parameters()):
        raise ConfigError(f"model: {describe(spec)} has no parameters to train")
    return module


def run_model(cfg: Config, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """The model a run trains: built with ``model_options``, holding the ``initial_weights`` of
    another run where it names one, with LoRA adapters where ``lora`` asks for them (only the
    adapters then train). Every process of a run builds it so (a worker on the meta device)."""
    module = build_model(cfg.model, input_shape, num_classes, cfg.model_options)
    if cfg.initial_weights is not None and not next(module.parameters()).is_meta:  # a worker's gets the server's
        load_weights(module, cfg.initial_weights, describe(cfg.model))
    return apply_lora(module, cfg.lora, describe(cfg.model)) if cfg.lora.enabled else module


def base_source(cfg: Config) -> str:
    """What gives a run its frozen base (LoRA's), for a message: ``initial_weights`` (a relative path
    with where it leads from here), else the model."""
    if cfg.initial_weights is None:
        return f"model {describe(cfg.model)}"
    path = Path(cfg.initial_weights).expanduser()
    return f"initial_weights {cfg.initial_weights}" + ("" if path.is_absolute() else f" (here {path.resolve()})")


def load_weights(module: torch.nn.Module, source: str, model_name: str) -> None:
    """Put the global model of a run (its directory, or its checkpoint.pt) into ``module``: a
    model trained by one run, fine-tuned by another (with LoRA adapters, say)."""
    path = Path(source).expanduser()
    path = path / "checkpoint.pt" if path.is_dir() else path
    try:
        state = read_checkpoint(path)
        weights = state["global"]
    except FileNotFoundError:
        raise ConfigError(
            f"initial_weights: {path} does not exist; give a run directory or its checkpoint.pt"
        ) from None
    except FedsimError as e:
        raise ConfigError(f"initial_weights: {e}") from None
    flat = FlatModel(module, "cpu")
    if weights.shape != flat.flat.shape:
        got = f"{weights.numel():,} weights"
        if "base_digest" in state:  # what a run with a frozen base keeps: the weights it trained alone
            raise ConfigError(
                f"initial_weights: {path} holds {got}, the LoRA adapters of a run that fine-tuned a base, not a "
                f"whole model of {len(flat):,}; give the run whose model that base was (its own initial_weights)"
            )
        raise ConfigError(
            f"initial_weights: {path} holds {got} where model {model_name} has {len(flat):,}; "
            f"it is another model's checkpoint"
        )
    flat.flat.copy_(weights)


def probe_model(
    spec: Any, module: torch.nn.Module, sample: torch.Tensor, num_classes: int, tokens: bool = False
) -> None:
    """Call the model once on two samples: it must return [2, num_classes] finite class scores,
    or for a token-level task [2, T, V] finite scores with V >= num_classes (a vocabulary a
    language model pads)."""
    was_training = module.training
    module.eval()
    try:
        with (
            torch.no_grad(),
            user_code(
                f"model: {describe(spec)} fails on a batch of inputs of shape {tuple(sample.shape[1:])}", ConfigError
            ),
        ):
            out = module(sample[:2])
    finally:
        module.train(was_training)
    n = len(sample[:2])
    expected = (n, *sample.shape[1:], num_classes) if tokens else (n, num_classes)
    shape_ok = isinstance(out, torch.Tensor) and (
        tuple(out.shape[:-1]) == expected[:-1] and out.shape[-1] >= num_classes
        if tokens
        else tuple(out.shape) == expected
    )
    if not shape_ok or not out.is_floating_point():
        got = f"shape {tuple(out.shape)} ({out.dtype})" if isinstance(out, torch.Tensor) else type(out).__name__
        wanted = f"token scores of shape {expected} or wider" if tokens else f"class scores of shape {expected}"
        raise ConfigError(f"model: {describe(spec)} returns {got} for {n} inputs; expected {wanted}")
    if not torch.isfinite(out).all():  # its clients' updates would all be non-finite, round after round
        raise ConfigError(
            f"model: {describe(spec)} returns non-finite {'token' if tokens else 'class'} scores (NaN/Inf) for {n} "
            f"inputs with its initial weights"
        )


# ----------------------------------------------------------------------------- aggregation rules


def aggregator(spec: Any, options: dict, attackers: int | None = None) -> Rule:
    """The rule ``(updates, weights) -> [P]`` with its options bound; ``attackers``, the number of
    Byzantine clients the run fixes, is a registered rule's ``f`` where its options leave it unset."""

    if isinstance(spec, str) and not is_import_path(spec):
        registered("aggregator", aggregation.AGGREGATORS, spec)
        if attackers is not None:
            options = aggregation.with_assumed_attackers(spec, options, attackers)
        return aggregation.get(spec, **options)
    rule = _resolve("aggregator", spec, aggregation.AGGREGATORS)
    if not callable(rule):
        raise ConfigError(f"aggregator: {describe(spec)} is a {type(rule).__name__}, not a function")
    _takes(rule, (2,), "aggregator", "a rule takes (updates, weights, **options)")
    if not options:
        return rule
    bound = functools.partial(rule, **options)
    if aggregation.is_equivariant(rule):
        aggregation.equivariant(bound)
    return aggregation.remembering(bound, rule.start_memory) if aggregation.remembers(rule) else bound


def assumed_attackers(cfg: Config) -> int | None:
    """The number of Byzantine clients in every round where ``attack.count`` fixes it: the rules'
    and pre-aggregators' default ``f``. None where the run does not fix it."""
    return None if cfg.attack.type == "none" else cfg.attack.count


def server_rule(cfg: Config) -> tuple[Rule, list[PreAggregator]]:
    """The run's rule and its pre-aggregators, ``f`` filled from ``attack.count`` where unset."""
    attackers = assumed_attackers(cfg)
    rule = aggregator(cfg.aggregator, cfg.aggregator_options, attackers)
    return rule, [
        pre_aggregator(spec, attackers, f"pre_aggregators[{i}]") for i, spec in enumerate(cfg.pre_aggregators)
    ]


def pre_aggregator(spec: Any, attackers: int | None, key: str) -> PreAggregator:
    """One entry of ``pre_aggregators`` (``key``): a registered one, whose ``f`` is ``attackers``
    where its options leave it unset, or a function of one's own (``preaggregation.own_step``)."""
    name, options = preaggregation.entry(spec, key)
    if isinstance(name, str) and not is_import_path(name):
        return preaggregation.pre_aggregator(spec, attackers, key)
    step = _resolve(key, name, PRE_AGGREGATORS)
    if not callable(step):
        raise ConfigError(f"{key}: {describe(name)} is a {type(step).__name__}, not a function")
    _takes(step, (3,), key, "a pre-aggregator takes (updates, weights, generator, **options)")
    return preaggregation.own_step(step, options, f"{key} ({describe(name)})")


def probe_aggregator(spec: Any, rule: Rule, k: int) -> None:
    """Call the rule once on a small stack of ``k`` rows: a rule that cannot work with that many
    clients (Krum with f >= k/2, say) says so now, and a rule of one's own must return [P]."""
    updates = torch.randn(k, 3, generator=torch.Generator().manual_seed(0))
    with user_code(f"aggregator: {describe(spec)} fails on a stack of {k} updates of 3 values", ConfigError):
        out = rule(updates, torch.ones(k))
    # the run checks the rule's output every round too: these 3 values on the CPU cannot show a rule
    # that goes wrong only for more values, or on another device
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (3,) or out.dtype != updates.dtype:
        got = f"shape {tuple(out.shape)} ({out.dtype})" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"aggregator: {describe(spec)} returns {got} for {k} updates of 3 values; "
            f"expected shape (3,) ({updates.dtype}), as the updates"
        )


# ----------------------------------------------------------------------------- algorithms


def algorithm(spec: Any, options: dict) -> Algorithm:
    """An Algorithm instance: a registered or imported class built with ``options``, or the
    instance given."""

    target = _resolve("algorithm", spec, ALGORITHMS)
    if inspect.isclass(target) and issubclass(target, Algorithm):
        refuse_unknown("algorithm_options", describe(spec), options, list(inspect.signature(target).parameters))
        with user_code(f"algorithm: {describe(spec)} failed when it was built", ConfigError):
            return target(**options)
    if isinstance(target, Algorithm):
        if options:
            raise ConfigError(
                f"algorithm_options: {describe(spec)} is an algorithm object, built already; "
                f"give its options to its constructor"
            )
        return target
    raise ConfigError(f"algorithm: {describe(spec)} is not a fedsim Algorithm (subclass fedsim.Algorithm)")


def paper_aggregator(spec: Any) -> str | None:
    """The rule the paper of algorithm ``spec`` fixes (``Algorithm.paper_aggregator``), or None."""
    return getattr(_resolve("algorithm", spec, ALGORITHMS), "paper_aggregator", None)


def default_aggregator(spec: Any) -> str:
    """The rule of a run that names none: its algorithm's paper's, else fedavg."""
    return paper_aggregator(spec) or "fedavg"


def aggregator_warning(cfg: Config) -> str | None:
    """A line for a run whose rule is not the one its algorithm's paper fixes; None otherwise."""
    paper, rule = paper_aggregator(cfg.algorithm), describe(cfg.aggregator)
    if paper is None or rule == paper:
        return None
    return (
        f"aggregator is {rule}, but the {describe(cfg.algorithm)} paper aggregates with {paper} "
        f"(what the run gets when aggregator is not set)"
    )


def personal_warning(cfg: Config) -> str | None:
    """A line for a run whose algorithm trains personal models that nothing will score: without
    eval_per_client every figure it shows is the global model's, as under FedAvg."""
    if cfg.eval_per_client or cfg.mode != "sync":
        return None
    try:
        personal = algorithm(cfg.algorithm, cfg.algorithm_options).has_personal_model
    except ConfigError:
        return None  # the run says why
    if not personal:
        return None
    return (
        f"algorithm {describe(cfg.algorithm)} trains a model per client, which only eval_per_client: true "
        f"(with data.test_partition: true) scores; every accuracy shown is the global model's"
    )


# ----------------------------------------------------------------------------- checks and shipping


def check(cfg: Config) -> None:
    """Everything that can be checked before the data is loaded: each component resolves, has
    the right kind and signature, and the rule works on clients_per_round rows."""

    check_model_options(cfg.model, cfg.model_options)
    rule, steps = server_rule(cfg)
    rows = cfg.clients_per_round + (assumed_attackers(cfg) or 0)  # attack.count's updates come on top
    if rows <= _PROBE_ROWS:  # Krum's distances are k x k; beyond this the first round checks
        try:
            probe_aggregator(cfg.aggregator, preaggregation.pre_aggregated(steps, rule, torch.Generator), rows)
        except ConfigError as refused:
            raise ConfigError(f"{refused}{_where_k_and_f_come_from(cfg, steps, rows)}") from None
    algorithm(cfg.algorithm, cfg.algorithm_options)
    check_dataset_spec(cfg.data.dataset)


_PROBE_ROWS = 2000


def _where_k_and_f_come_from(cfg: Config, steps: list[PreAggregator], rows: int) -> str:
    """What a rule's refusal of its k and f cannot say: the f that attack.count set, and the k that
    attack.count's updates or a pre-aggregator that groups the rows (bucketing) made."""
    said = []
    if assumed_attackers(cfg) is not None:
        said.append(f"k is clients_per_round {cfg.clients_per_round} plus attack.count {cfg.attack.count}")
        if "f" not in cfg.aggregator_options:
            said[-1] += ", and f is attack.count where the options set none"
    updates, weights = torch.zeros(rows, 1), torch.ones(rows)
    try:
        for step in steps:
            updates, weights = step(updates, weights, torch.Generator())
    except ConfigError:
        return f" ({'; '.join(said)})" if said else ""  # a step's own refusal: it names its k
    if len(updates) != rows:
        made = f"{len(updates)} row{'s' * (len(updates) != 1)}"
        said.append(f"the pre-aggregators make {made} of the {rows} updates for the rule")
    return f" ({'; '.join(said)})" if said else ""


@dataclass
class Shipped:
    """A component serialized by value for the workers (cloudpickle)."""

    payload: bytes
    description: str


def for_workers(cfg: Config) -> Config:
    """A copy of ``cfg`` that the worker processes can unpickle: the model, algorithm and attack
    they need travel by value; the aggregator, pre-aggregators and dataset, which they do not use,
    by name only."""
    import cloudpickle

    shipped = copy.copy(cfg)
    shipped.data, shipped.attack = copy.copy(cfg.data), copy.copy(cfg.attack)
    shipped.pre_aggregators = plain(cfg.pre_aggregators)  # by name, as the aggregator: the server's alone
    for key in KEYS:
        value = get(cfg, key)
        if isinstance(value, str) and value.startswith("__main__:") and key in SHIPPED:
            value = load_attr(key, value)  # a worker's __main__ is not the server's: send the object
        if isinstance(value, str):
            continue
        if key in SHIPPED:
            _set(shipped, key, Shipped(cloudpickle.dumps(value), describe(value)))
        else:
            _set(shipped, key, describe(value))
    return shipped


def from_server(cfg: Config) -> Config:
    """The worker's side of ``for_workers``: objects back from their bytes."""
    import cloudpickle

    for key in SHIPPED:
        value = get(cfg, key)
        if isinstance(value, Shipped):
            _set(cfg, key, cloudpickle.loads(value.payload))
    return cfg


def forms() -> dict[str, list[tuple[str, str]]]:
    """What ``fedsim list`` shows beside the name tables: the forms a key may take that no table
    holds, as (form, what it loads)."""
    hf = f"{hub.PREFIX}<name or folder>"
    loaders = [
        (f"data.dataset: {hf}", "a Hugging Face dataset from the hub or a folder it saved; data.hf names its columns"),
        (f"model: {hf}", "a Hugging Face causal language model from the hub or a folder; model_options go to it"),
        (f"data.tokenizer: {hf}", text.FORMS[1][1]),
    ]
    return {"Hugging Face loaders (hf:)": loaders, "tokenizers (data.tokenizer)": text.FORMS}


def tables() -> dict:
    """Every name table, for validation and ``fedsim list``."""
    return {
        "datasets": DATASETS,
        "partitions": PARTITIONS,
        "models": MODELS,
        "algorithms": ALGORITHMS,
        "aggregators": AGGREGATORS,
        "pre-aggregators (pre_aggregators)": PRE_AGGREGATORS,
        "server optimizers": SERVER_OPTIMIZERS,
        "attacks": ATTACKS,
        "client samplings": CLIENT_SAMPLINGS,
        "compressors": COMPRESSORS,
        "async methods": ASYNC_METHODS,
        "LoRA methods (lora.method)": lora.METHODS,
    }
