"""Rules that compare whole updates by their distances: Krum, Multi-Krum, Bulyan, the geometric
median and Divide-and-Conquer."""

from __future__ import annotations

import math

import torch

from . import (
    AGGREGATORS,
    OPTIONS,
    Rule,
    assumed_attackers,
    centred_gram,
    combine,
    equivariant,
    fail,
    first_lowest,
    mean_of,
    middle,
    normalized,
    row_norms,
    squared_distances,
    tolerating,
    too_few,
)


def _check_krum(k: int, f: int | None) -> int:
    """The number of attackers to assume for ``k`` clients; Krum needs k > 2f + 2."""
    return assumed_attackers("Krum", "k > 2f + 2", k, f, (k - 3) // 2)


def krum_scores(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Blanchard et al. 2017: the score of update i is the sum of its squared distances to
    its k - f - 2 nearest other updates."""
    k = updates.shape[0]
    distances = squared_distances(updates)
    distances.fill_diagonal_(math.inf)  # an update is not its own neighbour
    return distances.sort(dim=1).values[:, : k - f - 2].sum(dim=1)


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
    OPTIONS.count("f", f, 0, optional=True)

    def rule(updates, weights):
        assumed = _check_krum(updates.shape[0], f)
        best = int(first_lowest(krum_scores(updates, assumed)))
        return updates[best].clone()

    return tolerating(equivariant(rule), lambda k: (k - 3) // 2 if f is None else f)


@AGGREGATORS.register(
    "multi_krum", "unweighted mean of the m best Krum-scored updates (m default k-f; Blanchard et al. 2017)"
)
def multi_krum(f: int | None = None, m: int | None = None) -> Rule:
    """Multi-Krum (Blanchard et al. 2017): the unweighted mean of the ``m`` updates with the
    lowest Krum scores, ties going to the lower rows. ``f`` as for ``krum``; ``m`` must be in
    [1, k - f] (more would have to include updates scored as the f outliers), and ``m: null``
    takes ``k - f``. ``m = 1`` is Krum.
    """
    OPTIONS.count("f", f, 0, optional=True)
    OPTIONS.count("m", m, 1, optional=True)

    def rule(updates, weights):
        k = updates.shape[0]
        assumed = _check_krum(k, f)
        chosen = k - assumed if m is None else m
        if chosen > k - assumed:
            too_few(
                f"m = {m} is too large for k = {k} clients per round and f = {assumed}: "
                f"aggregator_options.m must be in [1, {k - assumed}]"
            )
        order = krum_scores(updates, assumed).sort(stable=True).indices
        # weight 1 / m on the chosen rows and 0 on the others: no copy of the chosen rows
        selected = updates.new_zeros(k)
        selected[order[:chosen]] = 1.0
        return combine(normalized(selected, updates), updates)

    return tolerating(equivariant(rule), lambda k: (k - 3) // 2 if f is None else f)


def _check_bulyan(k: int, f: int | None) -> int:
    """The number of attackers to assume for ``k`` clients; Bulyan needs k >= 4f + 3."""
    return assumed_attackers("Bulyan", "k >= 4f + 3", k, f, (k - 3) // 4)


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
        best = first_lowest(scores)
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
    OPTIONS.count("f", f, 0, optional=True)

    def rule(updates, weights):
        k = updates.shape[0]
        assumed = _check_bulyan(k, f)
        selected = updates[_krum_picks(updates, assumed, k - 2 * assumed)]
        # halves: the distances of values near the float limit do not overflow
        distance = (selected / 2 - middle(selected) / 2).abs_()
        nearest = distance.argsort(dim=0, stable=True)[: k - 4 * assumed]
        return mean_of(selected.gather(0, nearest))

    return tolerating(rule, lambda k: (k - 3) // 4 if f is None else f)


# ----------------------------------------------------------------------------- geometric median


@AGGREGATORS.register(
    "geometric_median", "sample-weighted geometric median by smoothed Weiszfeld iterations (RFA, Pillutla et al. 2022)"
)
def geometric_median(eps: float = 1e-6, tol: float = 1e-5, max_iter: int = 100, init: str = "mean") -> Rule:
    """Robust federated aggregation (Pillutla et al. 2022, "Robust aggregation for federated
    learning"): ``z = argmin sum_i a_i max(eps, ||z - u_i||)`` with ``a_i`` the normalized sample
    counts, by the smoothed Weiszfeld iteration

        z <- sum_i b_i u_i / sum_i b_i,    b_i = a_i / max(eps, ||z - u_i||),

    started at the weighted mean (``init: zero``: at 0, as ByzFL's ``GeometricMedian``, which
    runs ``T`` = ``max_iter`` iterations with ``nu`` = ``eps``, and ``tol: 0``). It stops when an
    iteration moves ``z`` by at most ``tol`` times its norm, or after ``max_iter`` iterations.
    (A test on the relative change of the objective, as in the paper's code, stops far too
    early when attackers send huge updates: their distances dominate the objective and hardly
    change while ``z`` is still travelling towards the honest updates.) Each iteration is two
    passes over the ``[k, P]`` stack (the distances, in float64 column blocks, and the
    combination) and one host synchronization for the stopping test.
    """
    eps = OPTIONS.positive("eps", eps)
    tol = OPTIONS.non_negative("tol", tol)
    OPTIONS.count("max_iter", max_iter, 1)
    if init not in ("mean", "zero"):
        fail(f"init must be mean or zero, got {init!r}")

    def rule(updates, weights):
        alpha = normalized(weights, updates)
        z = combine(alpha, updates) if init == "mean" else torch.zeros_like(updates[0])
        for _ in range(max_iter):
            beta = alpha / row_norms(updates, z).clamp_(min=eps)  # float64: no overflow
            previous, z = z, combine(beta / beta.sum(), updates)
            if tol and row_norms(z[None], previous) <= tol * row_norms(z[None]):
                break
        return z

    return tolerating(equivariant(rule), lambda k: (k - 1) // 2)


@AGGREGATORS.register(
    "dnc",
    "divide and conquer: the mean of the updates that are never among the c f farthest along the top singular "
    "vector of b random coordinates, over iterations (Shejwalkar & Houmansadr 2021)",
)
def dnc(f: int | None = None, iterations: int = 5, coordinates: int = 10000, c: float = 1.0) -> Rule:
    """Divide-and-Conquer (Shejwalkar & Houmansadr 2021, "Manipulating the Byzantine", Algorithm
    2). Each of ``iterations`` draws ``coordinates`` (b) coordinates at random (all of them where P
    is smaller), centres the updates' values there by their mean, and scores each update by the
    square of its projection on their top right singular vector; the ``round(c f)`` updates of
    highest score are left out. The result is the unweighted mean of the updates that no iteration
    left out. Defaults as Blades and FLPoison ship it (5 iterations, b = 10,000, c = 1); ``f`` null:
    the largest f with 2f < k. The projections come from the top eigenvector u of the centred
    rows' k x k Gram matrix (in float64): the projection of row i is sigma u_i, so the scores rank
    as u_i^2 and no [k, b] decomposition is needed. Equal scores go to the lower row, which is
    kept; an iteration that would leave no update kept by all so far starts the set afresh.
    Sample counts are ignored. The draws are the round's own stream (a ``generator``)."""
    OPTIONS.count("f", f, 0, optional=True)
    OPTIONS.count("iterations", iterations, 1)
    OPTIONS.count("coordinates", coordinates, 1)
    c = OPTIONS.non_negative("c", c)

    def rule(updates, weights, generator=None):
        k, p = updates.shape
        assumed = (k - 1) // 2 if f is None else f
        if assumed >= k:
            too_few(f"f = {assumed} is too large for k = {k} clients per round: dnc keeps k - c f, so f must be < {k}")
        dropped = min(round(c * assumed), k - 1)
        draws = generator or torch.Generator()
        good = torch.ones(k, dtype=torch.bool, device=updates.device)
        for _ in range(iterations):
            chosen = torch.randperm(p, generator=draws)[:coordinates].to(updates.device)
            top = torch.linalg.eigh(centred_gram(updates[:, chosen])).eigenvectors[:, -1]
            order = (top**2).argsort(stable=True)  # ascending scores; equal ones keep the lower row first
            this = torch.ones_like(good)
            this[order[k - dropped :]] = False
            good = good & this if (good & this).any() else this  # none left by all: this iteration's
        kept = good.to(updates.dtype)
        return combine(kept / kept.sum(), updates)

    return tolerating(rule, lambda k: (k - 1) // 2 if f is None else f)
