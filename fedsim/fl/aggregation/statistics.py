"""Coordinate-wise order statistics: the median and the trimmed mean (Yin et al. 2018)."""

from __future__ import annotations

import math
from fractions import Fraction

from ...core.checks import is_number
from . import AGGREGATORS, OPTIONS, Rule, fail, mean_of, middle, sorted_rows, tolerating, too_few


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
        return middle(updates)

    return tolerating(rule, lambda k: (k - 1) // 2)


@AGGREGATORS.register(
    "trimmed_mean",
    "coordinate-wise mean after dropping the floor(beta k) smallest and largest values, or the f "
    "smallest and largest (beta default 0.1; Yin et al. 2018)",
)
def trimmed_mean(beta: float | None = None, f: int | None = None) -> Rule:
    """Coordinate-wise trimmed mean (Yin et al. 2018).

    Per coordinate, the ``b = floor(beta * k)`` smallest and ``b`` largest of the ``k`` values
    are dropped and the rest averaged; rounding down never drops more than the fraction asked,
    and ``beta < 0.5`` always leaves at least one value. ``beta = 0`` is the plain mean. ``f``
    instead drops exactly ``f`` values at each end, for a known number ``f`` of Byzantine clients
    (ByzFL's ``TrMean``), and needs ``2f < k``. Sample counts are ignored.

    ``beta * k`` is the exact product of ``beta`` as written in decimal (its shortest repr) and
    ``k``: 0.29 of 100 clients drops 29 at each end. Flower 1.42's ``aggregate_trimmed_avg``
    truncates the float product instead, ``int(beta * k)``, which is one less where that product
    falls just below an integer: (k, beta) = (100, 0.29) (28.999999999999996), (180, 0.35),
    (200, 0.145), (200, 0.285) and (200, 0.29) among k <= 200 and beta a multiple of 0.001.
    """
    if beta is not None and f is not None:
        fail(f"set beta or f, not both (got beta = {beta!r} and f = {f!r})")
    OPTIONS.count("f", f, 0, optional=True)
    beta = 0.1 if beta is None and f is None else beta
    if beta is not None and (not is_number(beta) or not 0 <= beta < 0.5):
        fail(f"beta must be a number in [0, 0.5), got {beta!r}")
    exact_beta = None if beta is None else Fraction(str(beta))

    def rule(updates, weights):
        k = updates.shape[0]
        if f is not None and 2 * f >= k:
            too_few(
                f"f = {f} is too large for k = {k} clients per round: the trimmed mean drops 2f "
                f"values, so aggregator_options.f must be in [0, {(k - 1) // 2}]"
            )
        drop = f if exact_beta is None else math.floor(exact_beta * k)
        if drop == 0:
            return mean_of(updates)
        return mean_of(sorted_rows(updates)[drop : k - drop])

    return tolerating(rule, lambda k: f if exact_beta is None else math.floor(exact_beta * k))
