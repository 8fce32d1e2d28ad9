"""Aggregation rules: pure functions of stacked client updates.

A rule takes ``updates``, a ``[k, P]`` float tensor (one row per client: its weights minus
the global weights), and ``weights``, the ``k`` client sample counts (integer or float), and
returns the aggregated ``[P]`` update on the same device. Rules are whole-tensor operations:
no Python loop over parameters (the geometric median loops over its iterations).
``get(name, **options)`` builds a rule from the registry; options are checked when the rule is
built, and the ones that depend on the number of clients ``k`` when it is called, so that
config validation (which calls the rule once on ``clients_per_round`` rows) reports them.

The robust rules (``median``, ``trimmed_mean``, ``krum``, ``multi_krum``, ``bulyan``) ignore the
sample counts, as in their papers: an attacker could otherwise claim a large count.

Every rule maps finite updates to a finite aggregate, however large (float32 updates up to
3.4e38, as an attacker may send): means are convex combinations (``_combine``), whose partial
sums never exceed the largest value, rather than sums divided afterwards; norms and distances
are accumulated in float64 (``_norms``, ``squared_distances``), where float32 squares overflow.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import torch

from ..core.checks import Checks, is_number, refuse_unknown
from ..core.errors import ConfigError
from ..core.registry import Registry

Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AGGREGATORS = Registry("aggregator")


def get(name: str, **options: Any) -> Rule:
    """The rule ``name`` with its options, e.g. ``get("trimmed_mean", beta=0.1)``."""
    factory = AGGREGATORS.get(name)
    refuse_unknown("aggregator_options", name, options, list(inspect.signature(factory).parameters))
    return factory(**options)


# ----------------------------------------------------------------------------- option checks


_OPTIONS = Checks("aggregator_options", options=True)


def _fail(message: str):
    raise ConfigError(f"aggregator_options: {message}")


def _normalized(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    w = weights.to(device=like.device, dtype=like.dtype)
    return w / w.sum()


def _combine(coefficients: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``coefficients @ rows`` in the rows' dtype, for coefficients >= 0 summing to at most 1:
    a weighted mean, possibly of scaled-down rows.

    Every partial sum, in any summation order, is then a combination of values with
    coefficients summing to at most 1, so no larger than the largest ``|value|`` up to
    rounding; a sum divided afterwards overflows float32 once the values pass 3.4e38 / k.
    Rounding alone can lift a result within ~k * 6e-8 of the float32 limit past it; the exact
    result is within the limit, so the clamp only undoes that rounding. (A partial sum can only
    overflow if its coefficients sum to nearly 1, so the other terms are too small to matter and
    no partial sum can overflow the other way: the clamp sees inf, never NaN.)
    """
    limit = torch.finfo(rows.dtype).max
    return (coefficients.to(rows.dtype) @ rows).clamp_(-limit, limit)


def _mean(rows: torch.Tensor) -> torch.Tensor:
    """The unweighted mean of the rows, as a convex combination (see ``_combine``)."""
    return _combine(_normalized(rows.new_ones(rows.shape[0]), rows), rows)


_BLOCK = 1 << 20  # elements of the float64 block in ``float64_blocks``: 8 MiB


def float64_blocks(rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, block)`` over the columns of ``rows``: each block of columns copied in turn into
    one float64 buffer of ~``_BLOCK`` elements, so that a float64 view of a large stack never
    exists whole (the buffer is reused: use a block before taking the next)."""
    k, p = rows.shape
    columns = max(1, min(p, _BLOCK // max(1, k)))
    buffer = rows.new_empty((k, columns), dtype=torch.float64)
    for start in range(0, p, columns):
        block = buffer[:, : min(columns, p - start)]
        block.copy_(rows[:, start : start + columns])
        yield start, block


def _norms(rows: torch.Tensor, point: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[k]`` Euclidean norms of ``rows[i] - point`` (``point`` default 0), in float64.

    In float32 a sum of squares overflows once an entry passes 1.8e19, and an infinite norm
    then gives 0 / 0 or inf / inf = NaN downstream. Float64 holds the difference of two float32
    values to ~1e-16 and a sum of P squares of them up to (6.8e38)^2 P ~ 5e77 P. The work is in
    column blocks (``float64_blocks``), so that the float64 copy stays small; the norm of a row
    is the norm of its blocks' norms.
    """
    point = None if point is None else point.to(torch.float64)
    parts = []
    for start, block in float64_blocks(rows):
        if point is not None:
            block -= point[start : start + block.shape[1]]
        parts.append(torch.linalg.vector_norm(block, dim=1))
    return torch.linalg.vector_norm(torch.stack(parts), dim=0)


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """The ``[k]`` Euclidean norms of the rows, in float64: finite for any finite rows."""
    return _norms(rows)


def _middle(values: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 from one sort; for even k, the mean of the two middle values."""
    k = values.shape[0]
    ordered = values.sort(dim=0).values
    return ordered[(k - 1) // 2] / 2 + ordered[k // 2] / 2  # halves first: no overflow near the float limit


# ----------------------------------------------------------------------------- means


@AGGREGATORS.register("fedavg", "mean weighted by client sample counts (McMahan et al. 2017)")
def fedavg() -> Rule:
    def rule(updates, weights):
        return _combine(_normalized(weights, updates), updates)

    return rule


@AGGREGATORS.register("mean", "unweighted mean of the client updates")
def mean() -> Rule:
    def rule(updates, weights):
        return _mean(updates)

    return rule


@AGGREGATORS.register(
    "norm_clip",
    "clip each update's L2 norm to max_norm (default: the round's median norm), then the sample-weighted mean",
)
def norm_clip(max_norm: float | None = None) -> Rule:
    """Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?").

    Each update ``u_i`` becomes ``u_i * min(1, max_norm / ||u_i||)``; the result is their mean
    weighted by sample counts. ``max_norm: null`` clips to the median norm of the round's
    updates, a bound that adapts as updates shrink during training.
    """
    if max_norm is not None:
        max_norm = _OPTIONS.positive("max_norm", max_norm)

    def rule(updates, weights):
        norms = _norms(updates)  # float64: finite for any float32 update
        bound = _middle(norms) if max_norm is None else max_norm
        # updates within the bound keep their scale of 1, a zero update too (even for a bound of 0)
        scale = torch.where(norms > bound, bound / norms, 1.0)
        # scaling the weights instead of the rows avoids a second [k, P] tensor
        return _combine(_normalized(weights, updates) * scale, updates)

    return rule


# ----------------------------------------------------------------------------- order statistics


@AGGREGATORS.register(
    "median", "coordinate-wise median; for an even count, the mean of the two middle values (Yin et al. 2018)"
)
def median() -> Rule:
    """Coordinate-wise median (Yin et al. 2018, "Byzantine-robust distributed learning").

    For an even number of clients each coordinate takes the mean of its two middle values (the
    usual statistical median, symmetric in the sign of the updates; ``torch.median`` would take
    the lower one). Sample counts are ignored.
    """

    def rule(updates, weights):
        return _middle(updates)

    return rule


@AGGREGATORS.register(
    "trimmed_mean",
    "coordinate-wise mean after dropping the floor(beta k) smallest and largest "
    "values (beta default 0.1; Yin et al. 2018)",
)
def trimmed_mean(beta: float = 0.1) -> Rule:
    """Coordinate-wise trimmed mean (Yin et al. 2018).

    Per coordinate, the ``b = floor(beta * k)`` smallest and ``b`` largest of the ``k`` values
    are dropped and the rest averaged; rounding down never drops more than the fraction asked,
    and ``beta < 0.5`` always leaves at least one value. ``beta = 0`` is the plain mean.
    Sample counts are ignored.

    ``beta * k`` is the exact product of ``beta`` as written in decimal (its shortest repr) and
    ``k``: 0.29 of 100 clients drops 29 at each end. Flower 1.42's ``aggregate_trimmed_avg``
    truncates the float product instead, ``int(beta * k)``, which is one less where that product
    falls just below an integer: (k, beta) = (100, 0.29) (28.999999999999996), (180, 0.35),
    (200, 0.145), (200, 0.285) and (200, 0.29) among k <= 200 and beta a multiple of 0.001.
    """
    if not is_number(beta) or not 0 <= beta < 0.5:
        _fail(f"beta must be a number in [0, 0.5), got {beta!r}")
    exact_beta = Fraction(str(beta))

    def rule(updates, weights):
        k = updates.shape[0]
        drop = math.floor(exact_beta * k)
        if drop == 0:
            return _mean(updates)
        return _mean(updates.sort(dim=0).values[drop : k - drop])

    return rule


# ----------------------------------------------------------------------------- Krum


def squared_distances(updates: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` squared Euclidean distances between the rows, via the Gram matrix.

    ``||a - b||^2 = ||a||^2 + ||b||^2 - 2 <a, b>`` costs one ``[k, P] x [P, k]`` product
    instead of k^2 row differences (far fewer passes over the stack). Its
    weakness is cancellation: the rounding error of ``<a, b>`` scales with ``||a|| ||b||``,
    so it swamps the distance between updates that are close compared to their length, and
    its size depends on the BLAS's summation order, so on the machine. Distances do not
    change under translation, so the rows are first moved by a centre among them: the
    inner products are then the size of the rows' spread around it rather than of their
    length, and the error is at most about P * 1e-16 times that spread squared, in any
    summation order. The centre is the mean of the rows no longer than twice the median
    norm: a plain mean would be dragged far off by one huge update, and the honest rows'
    distances, which Krum exists to compare, would be lost in the cancellation again. The
    work is in float64 (which holds float32 inputs exactly), in column blocks so that the
    float64 copy stays small. Each pair's distance is computed once and mirrored: the BLAS may
    round ``<a, b>`` and ``<b, a>`` apart, and d(i, j) != d(j, i) would then decide exact ties
    (Bulyan's last picks always hold one). The diagonal is exactly 0.
    """
    norms = _norms(updates)
    typical = (norms <= 2 * norms.median()).to(updates.dtype)
    centre = _combine(typical / typical.sum(), updates).to(torch.float64)
    block = 1 << 18
    gram = torch.zeros(updates.shape[0], updates.shape[0], dtype=torch.float64, device=updates.device)
    for start in range(0, updates.shape[1], block):
        chunk = updates[:, start : start + block].to(torch.float64, copy=True)  # the input stays as it is
        chunk -= centre[start : start + block]
        gram.addmm_(chunk, chunk.T)
    squared = gram.diagonal()
    upper = (squared[:, None] + squared[None, :] - 2 * gram).clamp_(min=0).triu_(1)
    return upper + upper.T  # x + 0 is exact: both triangles hold the same values


def _check_krum(k: int, f: int | None) -> int:
    """The number of attackers to assume for ``k`` clients; Krum needs k > 2f + 2."""
    return _assumed_attackers("Krum", "k > 2f + 2", k, f, (k - 3) // 2)


def _assumed_attackers(rule: str, needs: str, k: int, f: int | None, largest: int) -> int:
    """``f``, or the ``largest`` number of attackers that ``rule`` allows among ``k`` clients."""
    if largest < 0:
        _fail(f"{rule} needs {needs} clients per round, so at least 3; got k = {k}")
    if f is None:
        return largest
    if f > largest:
        _fail(
            f"f = {f} is too large for k = {k} clients per round: {rule} needs {needs}, "
            f"so aggregator_options.f must be in [0, {largest}]"
        )
    return f


def krum_scores(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Blanchard et al. 2017: the score of update i is the sum of its squared distances to
    its k - f - 2 nearest other updates."""
    k = updates.shape[0]
    distances = squared_distances(updates)
    distances.fill_diagonal_(math.inf)  # an update is not its own neighbour
    return distances.sort(dim=1).values[:, : k - f - 2].sum(dim=1)


def _first_lowest(scores: torch.Tensor) -> torch.Tensor:
    """The index of the lowest score, the lowest index among equal ones: a stable sort states that
    rule on any device, where ``argmin`` leaves it to the reduction's order."""
    return scores.sort(stable=True).indices[0]


@AGGREGATORS.register(
    "krum",
    "the update closest to its k-f-2 nearest others (f default: the largest with k > 2f+2; Blanchard et al. 2017)",
)
def krum(f: int | None = None) -> Rule:
    """Krum (Blanchard et al. 2017, "Machine learning with adversaries").

    Returns the single update with the lowest score (see ``krum_scores``), ties going to the
    lower row. ``f`` is the number of attackers assumed among the ``k`` clients of a round and
    must satisfy ``k > 2f + 2``; ``f: null`` takes the largest such f. Sample counts are ignored.
    """
    _OPTIONS.count("f", f, 0, optional=True)

    def rule(updates, weights):
        assumed = _check_krum(updates.shape[0], f)
        best = int(_first_lowest(krum_scores(updates, assumed)))
        return updates[best].clone()

    return rule


@AGGREGATORS.register(
    "multi_krum", "unweighted mean of the m best Krum-scored updates (m default k-f; Blanchard et al. 2017)"
)
def multi_krum(f: int | None = None, m: int | None = None) -> Rule:
    """Multi-Krum (Blanchard et al. 2017): the unweighted mean of the ``m`` updates with the
    lowest Krum scores, ties going to the lower rows. ``f`` as for ``krum``; ``m`` must be in
    [1, k - f] (more would have to include updates scored as the f outliers), and ``m: null``
    takes ``k - f``. ``m = 1`` is Krum.
    """
    _OPTIONS.count("f", f, 0, optional=True)
    _OPTIONS.count("m", m, 1, optional=True)

    def rule(updates, weights):
        k = updates.shape[0]
        assumed = _check_krum(k, f)
        chosen = k - assumed if m is None else m
        if chosen > k - assumed:
            _fail(
                f"m = {m} is too large for k = {k} clients per round and f = {assumed}: "
                f"aggregator_options.m must be in [1, {k - assumed}]"
            )
        order = krum_scores(updates, assumed).sort(stable=True).indices
        # weight 1 / m on the chosen rows and 0 on the others: no copy of the chosen rows
        selected = updates.new_zeros(k)
        selected[order[:chosen]] = 1.0
        return _combine(_normalized(selected, updates), updates)

    return rule


def _check_bulyan(k: int, f: int | None) -> int:
    """The number of attackers to assume for ``k`` clients; Bulyan needs k >= 4f + 3."""
    return _assumed_attackers("Bulyan", "k >= 4f + 3", k, f, (k - 3) // 4)


def _krum_picks(updates: torch.Tensor, f: int, count: int) -> torch.Tensor:
    """The rows Krum picks one at a time, ``count`` of them, each from those not picked yet (see
    ``bulyan``). Every row's distances are sorted once; a pick then sums, in each row's order,
    the first ``nearest`` distances to rows still there: k^2 work per pick, no sort of them."""
    k = updates.shape[0]
    distances = squared_distances(updates)
    distances.fill_diagonal_(math.inf)  # sorts last: an update is not its own neighbour
    order = distances.argsort(dim=1, stable=True)
    ordered = distances.gather(1, order)
    there = torch.ones(k, dtype=torch.bool, device=updates.device)
    picks = []
    for size in range(k, k - count, -1):
        nearest = min(max(1, size - f - 2), size - 1)
        alive = there.expand(k, k).gather(1, order)  # (a gather: indexing by [k, k] is far slower on a CPU)
        counted = alive & (alive.cumsum(dim=1) <= nearest)
        scores = torch.where(counted, ordered, 0.0).sum(dim=1).masked_fill_(~there, math.inf)
        # distinct rows tie exactly where one neighbour counts: a shared d(i, j), plus zeros
        best = _first_lowest(scores)
        there[best] = False
        picks.append(best)
    return torch.stack(picks)


@AGGREGATORS.register(
    "bulyan",
    "Krum picks k-2f updates one by one; per coordinate, the mean of the k-4f picked "
    "values nearest their median (f default: the largest with k >= 4f+3; "
    "El Mhamdi et al. 2018)",
)
def bulyan(f: int | None = None) -> Rule:
    """Bulyan (El Mhamdi, Guerraoui, Rouault 2018, "The hidden vulnerability of distributed
    learning in Byzantium").

    Selection: Krum picks one update at a time from those not picked yet, R (all k at first),
    until theta = k - 2f are picked. Each pick scores every update of R by the sum of its squared
    distances to its |R| - f - 2 nearest others in R, and at least its nearest one: that count
    reaches 0 in the last pick for f = 1 (and in the last two for f = 0), where it would score every
    update 0 (Flower counts one neighbour there too). Ties go to the lower row. Aggregation: per
    coordinate, the mean of the beta = theta - 2f picked values nearest the median of the theta (for
    even theta the mean of the two middle values), ties going to the earlier pick. ``f`` is the
    number of attackers assumed among the ``k`` clients of a round and must satisfy
    ``k >= 4f + 3``; ``f: null`` takes the largest such f, and ``f = 0`` is the plain mean. Sample
    counts are ignored. The picks cost theta passes over a [k, k] matrix (docs/algorithms.md gives
    the times); the aggregation takes about 6x the stack's memory.
    """
    _OPTIONS.count("f", f, 0, optional=True)

    def rule(updates, weights):
        k = updates.shape[0]
        assumed = _check_bulyan(k, f)
        selected = updates[_krum_picks(updates, assumed, k - 2 * assumed)]
        # halves: the distances of values near the float limit do not overflow
        distance = (selected / 2 - _middle(selected) / 2).abs_()
        nearest = distance.argsort(dim=0, stable=True)[: k - 4 * assumed]
        return _mean(selected.gather(0, nearest))

    return rule


# ----------------------------------------------------------------------------- geometric median


@AGGREGATORS.register(
    "geometric_median", "sample-weighted geometric median by smoothed Weiszfeld iterations (RFA, Pillutla et al. 2022)"
)
def geometric_median(eps: float = 1e-6, tol: float = 1e-5, max_iter: int = 100) -> Rule:
    """Robust federated aggregation (Pillutla et al. 2022, "Robust aggregation for federated
    learning"): ``z = argmin sum_i a_i max(eps, ||z - u_i||)`` with ``a_i`` the normalized sample
    counts, by the smoothed Weiszfeld iteration

        z <- sum_i b_i u_i / sum_i b_i,    b_i = a_i / max(eps, ||z - u_i||),

    started at the weighted mean. It stops when an iteration moves ``z`` by at most ``tol``
    times its norm, or after ``max_iter`` iterations. (A test on the relative change of the
    objective, as in the paper's code, stops far too early when attackers send huge updates:
    their distances dominate the objective and hardly change while ``z`` is still travelling
    towards the honest updates.) Each iteration is two passes over the ``[k, P]`` stack (the
    distances, in float64 column blocks, and the combination) and one host synchronization for
    the stopping test.
    """
    eps = _OPTIONS.positive("eps", eps)
    tol = _OPTIONS.positive("tol", tol)
    _OPTIONS.count("max_iter", max_iter, 1)

    def rule(updates, weights):
        alpha = _normalized(weights, updates)
        z = _combine(alpha, updates)
        for _ in range(max_iter):
            beta = alpha / _norms(updates, z).clamp_(min=eps)  # float64: no overflow
            previous, z = z, _combine(beta / beta.sum(), updates)
            if _norms(z[None], previous) <= tol * _norms(z[None]):
                break
        return z

    return rule
