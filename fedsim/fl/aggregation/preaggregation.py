"""Pre-aggregators: maps from the round's stack of updates to another stack, composed in order
before any rule (``pre_aggregators: [clipping, nnm]`` then ``aggregator: trimmed_mean``).

Each is registered as a factory of its options returning ``(updates [k, P], weights [k],
generator) -> (updates [k', P], weights [k'])``; one of one's own is such a function taking its
options as keywords (``own_step``); only bucketing draws from the generator (the
round's own stream, so that the buckets are the same whatever the number of workers). None
writes into the stack it is given: the algorithm's server update may read the updates again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ...core.blocks import finite_rows
from ...core.checks import Checks, refuse_unknown
from ...core.errors import ConfigError, UserCodeError, cut, user_code
from ...core.registry import registered
from . import (
    PRE_AGGREGATORS,
    Memory,
    PreAggregator,
    Rule,
    TooFewUpdates,
    combine,
    equivariant,
    expanding,
    is_equivariant,
    remembers,
    row_norms,
    squared_distances,
    takes_generator,
    with_assumed_attackers,
)

OPTIONS = Checks("pre_aggregators", options=True)


def _assumed(name: str, f: int | None, k: int) -> int:
    """``f``, or the largest number of Byzantine clients the theory allows among ``k`` (2f < k)."""
    largest = (k - 1) // 2
    if f is None:
        return largest
    if f >= k:
        raise TooFewUpdates(f"pre_aggregators: {name}'s f = {f} must be smaller than the k = {k} updates of a round")
    return f


def _scaled(updates: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row times its factor, as a new stack."""
    return updates * scale.to(updates.dtype)[:, None]


@PRE_AGGREGATORS.register(
    "clipping", "scale each update to an L2 norm of at most max_norm (default 2.0; static clipping)"
)
def clipping(max_norm: float = 2.0) -> PreAggregator:
    """Static clipping: ``u_i * min(1, max_norm / ||u_i||)``. The default 2.0 is ByzFL's ``c``,
    which bounds a client's momentum; the update a fedsim client sends is its weights' change,
    the momentum times the learning rate after one step (see docs/algorithms.md)."""
    bound = OPTIONS.positive("max_norm", max_norm)

    def step(updates, weights, generator):
        norms = row_norms(updates)
        return _scaled(updates, torch.where(norms > bound, bound / norms, 1.0)), weights

    return equivariant(step)


@PRE_AGGREGATORS.register(
    "nnm", "each update replaced by the mean of its k-f nearest updates, itself included (Allouah et al. 2023)"
)
def nnm(f: int | None = None) -> PreAggregator:
    """Nearest-neighbour mixing (Allouah et al. 2023, "Fixing by mixing"): each update becomes
    the unweighted mean of the ``k - f`` updates nearest to it in L2 distance, itself included
    (distance 0). Equal distances go to the lower row. ``f`` null: the run's number of Byzantine
    clients where ``attack.count`` says it, else the largest f with 2f < k. Sample counts are
    kept as they are."""
    OPTIONS.count("f", f, 0, optional=True)

    def step(updates, weights, generator):
        k = updates.shape[0]
        keep = k - _assumed("nnm", f, k)
        nearest = squared_distances(updates).argsort(dim=1, stable=True)[:, :keep]
        mixing = torch.zeros(k, k, dtype=updates.dtype, device=updates.device)
        mixing.scatter_(1, nearest, 1.0 / keep)
        return combine(mixing, updates), weights

    return equivariant(step)


@PRE_AGGREGATORS.register(
    "bucketing", "random buckets of s updates, each replaced by its mean (s default 2; Karimireddy et al. 2022)"
)
def bucketing(s: int = 2) -> PreAggregator:
    """Bucketing (Karimireddy, He & Jaggi 2022, "Byzantine-robust learning on heterogeneous
    datasets via bucketing"): the updates in a random order (the round's stream), cut into
    buckets of ``s``, the last one shorter where ``s`` does not divide ``k``; each bucket becomes
    the unweighted mean of its updates, with the sum of their sample counts as its count."""
    OPTIONS.count("s", s, 1)

    def step(updates, weights, generator):
        k = updates.shape[0]
        order = torch.randperm(k, generator=generator).to(updates.device)
        buckets = -(-k // s)
        member = torch.zeros(buckets, k, dtype=updates.dtype, device=updates.device)
        member[torch.arange(k, device=updates.device) // s, order] = 1.0
        rows = combine(member / member.sum(dim=1, keepdim=True), updates)
        return rows, member.to(weights.dtype) @ weights.to(member.device)

    return equivariant(step)


@PRE_AGGREGATORS.register(
    "arc",
    "adaptive robust clipping: the floor(2f(k-f)/k) largest updates clipped to the next norm (Allouah et al. 2024)",
)
def arc(f: int | None = None) -> PreAggregator:
    """Adaptive robust clipping (Allouah et al. 2024, "Boosting robustness by clipping gradients
    in distributed learning"): the ``m = floor(2 f (k - f) / k)`` updates of largest norm are
    scaled to the norm of the largest of the others (ties of norm go to the lower row, which
    counts as the smaller). ``f`` as for ``nnm``."""
    OPTIONS.count("f", f, 0, optional=True)

    def step(updates, weights, generator):
        k = updates.shape[0]
        assumed = _assumed("arc", f, k)
        # exact: ByzFL truncates the float product, one less at k = 121, f = 66
        clipped = 2 * assumed * (k - assumed) // k
        if clipped == 0:
            return updates, weights
        norms = row_norms(updates)
        order = norms.argsort(stable=True)
        bound = norms[order[k - clipped - 1]]
        scale = torch.ones_like(norms)
        largest = order[k - clipped :]
        scale[largest] = torch.where(norms[largest] > bound, bound / norms[largest], 1.0)
        return _scaled(updates, scale), weights

    return equivariant(step)


def entry(spec: object, key: str) -> tuple[object, dict]:
    """An entry of ``pre_aggregators`` as (what it names, its options): a name, an import path or,
    from Python, a function, alone or as ``{that: {option: value}}``."""
    if isinstance(spec, dict) and len(spec) == 1:
        ((name, options),) = spec.items()
        options = {} if options is None else options  # `- nnm:` in YAML
    else:
        name, options = spec, {}
    if not (isinstance(name, str) or callable(name)) or not isinstance(options, dict):
        raise ConfigError(
            f"{key}: each entry is a name, an import path (pkg.module:name) or a function, alone or as "
            f"{{name: {{option: value}}}}, got {cut(repr(spec))}; the names: {', '.join(PRE_AGGREGATORS.names())}"
        )
    return name, options


def pre_aggregator(spec: object, f: int | None = None, key: str = "pre_aggregators") -> PreAggregator:
    """A registered pre-aggregator, ``name`` or ``{name: {option: value}}``; ``f``, the run's number
    of Byzantine clients, fills an ``f`` the options leave unset. ``key`` names the entry in errors."""
    name, options = entry(spec, key)
    registered(key, PRE_AGGREGATORS, name)
    if f is not None:
        options = with_assumed_attackers(name, options, f, PRE_AGGREGATORS)
    factory = PRE_AGGREGATORS.get(name)
    refuse_unknown(key, name, options, list(inspect.signature(factory).parameters))
    try:
        return factory(**options)
    except ConfigError as refused:  # OPTIONS' "pre_aggregators: f must be ...", said of this entry
        raise ConfigError(f"{key}: {name}'s {str(refused).removeprefix(f'{OPTIONS.section}: ')}") from None


def own_step(step: Callable, options: dict, label: str) -> PreAggregator:
    """A pre-aggregator of one's own, ``step(updates, weights, generator, **options)``, with its
    options bound; what it raises, or returns other than a stack of the updates' length, dtype and
    device with one weight a row, or non-finite rows from finite updates, is said in one line naming
    it (``label``): the round's check would otherwise blame the rule."""

    def checked(updates, weights, generator):
        with user_code(f"{label} failed on {len(updates)} updates of {updates.shape[1]} values"):
            out = step(updates, weights, generator, **options)
        rows, counts = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if (
            isinstance(rows, torch.Tensor)
            and isinstance(counts, torch.Tensor)
            and rows.ndim == 2
            and len(rows) >= 1
            and (rows.shape[1], rows.dtype, rows.device) == (updates.shape[1], updates.dtype, updates.device)
            and tuple(counts.shape) == (len(rows),)
        ):
            if not bool(finite_rows(rows).all()) and bool(finite_rows(updates).all()):
                raise UserCodeError(
                    f"{label} returned non-finite (NaN/Inf) rows from {len(updates)} finite updates of "
                    f"{updates.shape[1]} values"
                )
            return rows, counts
        got = ", ".join(
            f"shape {tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            for t in (out if isinstance(out, tuple) else (out,))
        )
        raise UserCodeError(
            f"{label} returned ({got}) for {len(updates)} updates of {updates.shape[1]} values; expected "
            f"(updates [k', {updates.shape[1]}] {updates.dtype} on {updates.device}, weights [k']), k' >= 1"
        )

    return equivariant(checked) if is_equivariant(step) else checked


def pre_aggregated(
    steps: list[PreAggregator],
    rule: Rule,
    generator: Callable[[], torch.Generator],
    memory: Callable[[], Memory] | None = None,
) -> Rule:
    """The rule applied to what ``steps`` make of the stack, in order; each call draws from a fresh
    ``generator()`` (as do rules that take a ``generator`` keyword, such as ``dnc``), so that an
    algorithm that aggregates twice in a round, and an attack that tries the server's aggregate,
    see the draws the round's update sees. A rule with a memory gets ``memory()`` on each call. The
    composition is ``equivariant`` where every step and the rule are, and ``expanding`` where it
    starts with equivariant steps and then is not."""
    draws_too, remembered = takes_generator(rule), memory is not None and remembers(rule)
    if not steps and not draws_too and not remembered:
        return rule
    lead = next((i for i, step in enumerate(steps) if not is_equivariant(step)), len(steps))

    def aggregate(updates, weights, expand=None):
        draws = generator()
        for step in steps[:lead]:
            updates, weights = step(updates, weights, draws)
        if expand is not None:
            updates = expand(updates)
        for step in steps[lead:]:
            updates, weights = step(updates, weights, draws)
        keywords = {"generator": draws} if draws_too else {}
        if remembered:
            keywords["memory"] = memory()
        return rule(updates, weights, **keywords)

    if lead == len(steps) and is_equivariant(rule):
        return equivariant(aggregate)
    return expanding(aggregate) if lead else aggregate
