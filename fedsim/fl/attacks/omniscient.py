"""Attacks of colluding, omniscient attackers: every attacker sends one vector computed from the
round's honest updates (see ``RoundView``), as the robustness papers define them.

The papers (and ByzFL) define their attacks on gradients, where a fedsim update is a change of
the weights: minus the learning rate times the gradients. The attacks that do not change sign
with their input are therefore applied to the gradients' direction: ALIE's mu + z sigma of the
gradients is mu - z sigma of the updates, and the ``std`` perturbation of MinMax and MinSum is
the negative of the updates' sigma. (The other side is another attack: on ByzFL's benchmark
cell of gamma 0.33 and f = 4, 100 steps, optimal ALIE left fedsim's trimmed mean at 0.40 that
way and at 0.84 this way, where ByzFL's own run reached 0.86; real MNIST, one seed.)

Each is checked against its paper's equations and, where ByzFL ships it, against ByzFL's own
implementation (tests/test_attacks.py); where the libraries' conventions differ, the docstring
and docs/algorithms.md say how.
"""

from __future__ import annotations

import functools
import logging
import math
from statistics import NormalDist

import torch

from ...core.blocks import row_norms, span_basis, span_coordinates
from ...core.checks import Checks
from ..aggregation import centred_gram, is_equivariant, is_expanding, squared_distances
from . import ATTACKS, Attack, RoundView

logger = logging.getLogger("fedsim")
OPTIONS = Checks("attack.options", options=True)


def _mean(rows: torch.Tensor) -> torch.Tensor:
    return rows.mean(dim=0)


def _std(rows: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise standard deviation with Bessel's correction (ByzFL's ``ddof=1``); 0 for a
    single row, whose spread is unknown. Two passes, the mean and then the squares about it:
    ``rows.std(dim=0)`` along the short first dimension takes 8 times as long on a CPU (87 ms for
    10 rows of ByzFL's CNN on a 2-core one, most of an optimal ALIE's round outside its search)."""
    if len(rows) < 2:
        return torch.zeros_like(rows[0])
    return (rows - rows.mean(dim=0)).square_().sum(dim=0).div_(len(rows) - 1).sqrt_()


def alie_z_max(n: int, f: int) -> float:
    """Baruch et al. 2019's z_max = Phi^-1((n - f - s) / (n - f)), s = floor(n/2 + 1) - f: the
    largest z for which the attackers' vector is still closer to the mean than s honest updates
    are. +-inf where the ratio leaves (0, 1); +inf where every client is an attacker."""
    if f >= n:
        return math.inf
    s = n // 2 + 1 - f
    ratio = (n - f - s) / (n - f)
    if ratio <= 0 or ratio >= 1:
        return math.copysign(math.inf, ratio - 0.5)
    return NormalDist().inv_cdf(ratio)


@ATTACKS.register(
    "alie", "a little is enough: mean + z x std of the honest gradients (z default z_max; Baruch et al. 2019)"
)
class ALittleIsEnough(Attack):
    """A little is enough (Baruch, Baruch & Goldberg 2019): every attacker sends ``mu + z sigma``
    of the honest gradients, ``mu - z sigma`` of the honest updates (the coordinate-wise mean and
    standard deviation, Bessel-corrected as ByzFL's). ``z`` null: the paper's ``z_max`` for the
    round's ``n`` clients of which ``f`` are attackers (``alie_z_max``), which is 0 or negative
    for few attackers (-0.14 at n = 10, f = 1): a warning says so once. ByzFL fixes ``z`` (its ``tau``) to 1.5."""

    def __init__(self, z: float | None = None):
        self.z = None if z is None else OPTIONS.number("z", z, "must be a number (or null: z_max)")
        self._warned = False

    def factor(self, view: RoundView) -> float:
        if self.z is not None:
            return self.z
        n, f = len(view.updates), int(view.attackers.sum())
        z = alie_z_max(n, f)
        if not self._warned and not 0 < z < math.inf:
            self._warned = True
            what = "it moves towards the mean" if z <= 0 else "the attackers are a majority; they send the mean"
            logger.warning(
                f"attack alie: z_max is {z:.3g} for n = {n} clients of which f = {f} are attackers "
                f"(Phi^-1((n-f-s)/(n-f)), s = floor(n/2+1)-f); {what}; set attack.options.z to choose it"
            )
        return z if math.isfinite(z) else 0.0

    def rewrite(self, view: RoundView) -> torch.Tensor:
        honest = view.honest
        return _mean(honest) - self.factor(view) * _std(honest)


@ATTACKS.register("ipm", "inner product manipulation: -epsilon x the honest updates' mean (Xie et al. 2020)")
class InnerProductManipulation(Attack):
    """Inner product manipulation (Xie, Koyejo & Gupta 2020, "Fall of empires"): every attacker
    sends ``-epsilon`` times the mean of the honest updates. ByzFL's ``tau`` is ``epsilon`` (its
    default 2.0); ByzFL's ``SignFlipping`` is ``epsilon: 1``."""

    def __init__(self, epsilon: float = 0.1):
        self.epsilon = OPTIONS.number("epsilon", epsilon, "must be a number")

    def rewrite(self, view: RoundView) -> torch.Tensor:
        return -self.epsilon * _mean(view.honest)


def _deviation(honest: torch.Tensor, mean: torch.Tensor, perturbation: str) -> torch.Tensor:
    if perturbation == "unit_vec":  # a zero mean has no direction: 0, and the attackers send the mean
        return mean / row_norms(mean[None]).to(mean.dtype).clamp_min(torch.finfo(mean.dtype).tiny)
    if perturbation == "sign":
        return torch.sign(mean)
    return -_std(honest)  # the gradients' sigma, in the updates' direction (see above)


def _largest_gamma(fits) -> float:
    """The authors' search for gamma: start at 10, step by halves, down to steps of 1e-5; the last
    gamma that ``fits`` (0 if none)."""
    gamma, step, success = 10.0, 10.0, 0.0
    while abs(success - gamma) > 1e-5:
        if fits(gamma):
            success = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return success


class _MinMaxFamily(Attack):
    """Shejwalkar & Houmansadr 2021 (NDSS, "Manipulating the Byzantine"): every attacker sends
    ``mu - gamma p``, ``mu`` the honest updates' mean and ``p`` the perturbation (``unit_vec``:
    ``mu / ||mu||``, ``sign``: ``sign(mu)``, ``std``: the coordinate-wise standard deviation of
    the gradients, minus that of the updates),
    ``gamma`` the largest the authors' search finds for which the vector stays within the
    threshold of ``_fits``."""

    def __init__(self, perturbation: str = "unit_vec"):
        self.perturbation = OPTIONS.one_of("perturbation", perturbation, ("unit_vec", "sign", "std"))

    def rewrite(self, view: RoundView) -> torch.Tensor:
        honest = view.honest
        mean = _mean(honest)
        deviation = _deviation(honest, mean, self.perturbation)
        between = squared_distances(honest)
        gamma = _largest_gamma(lambda g: self._fits(between, row_norms(honest, mean - g * deviation) ** 2))
        return mean - gamma * deviation


@ATTACKS.register("minmax", "mu - gamma p, no farther from any honest update than the honest ones are from each other")
class MinMax(_MinMaxFamily):
    __doc__ = (
        _MinMaxFamily.__doc__
        + """
    MinMax: the vector's largest squared distance to an honest update is at most the largest
    between two honest updates."""
    )

    @staticmethod
    def _fits(between: torch.Tensor, to_vector: torch.Tensor) -> bool:
        return bool(to_vector.max() <= between.max())


@ATTACKS.register("minsum", "mu - gamma p, its summed squared distances to the honest updates within theirs")
class MinSum(_MinMaxFamily):
    __doc__ = (
        _MinMaxFamily.__doc__
        + """
    MinSum: the vector's sum of squared distances to the honest updates is at most the smallest
    such sum of an honest update, as in the authors' code; FLPoison compares with the largest,
    a weaker bound that allows a larger gamma."""
    )

    @staticmethod
    def _fits(between: torch.Tensor, to_vector: torch.Tensor) -> bool:
        return bool(to_vector.sum() <= between.sum(dim=1).min())


@ATTACKS.register("mimic", "copy the honest update farthest along their main direction (Karimireddy et al. 2022)")
class Mimic(Attack):
    """Mimic (Karimireddy, He & Jaggi 2022): every attacker copies one honest client's update, so
    that the rule over-weights that client's data. ``target`` null: the honest update that lies
    farthest from their mean along their principal direction (the top eigenvector of their
    covariance, which the paper estimates over its first rounds; here from the round itself);
    ``target: i``: the i-th honest update of the round, as ByzFL's ``epsilon`` (the last in a round
    with fewer, where some sampled clients are attackers; a target past clients_per_round is refused)."""

    def __init__(self, target: int | None = None):
        self.target = OPTIONS.count("target", target, 0, optional=True)

    def rewrite(self, view: RoundView) -> torch.Tensor:
        honest = view.honest
        if self.target is not None:
            return honest[min(self.target, len(honest) - 1)]
        if len(honest) < 2:
            return honest[0]
        # the projections of the centred rows on the top principal direction are lambda v_i, with
        # v the top eigenvector of their Gram matrix
        top = torch.linalg.eigh(centred_gram(honest)).eigenvectors[:, -1]
        return honest[int(top.abs().argmax())]


@ATTACKS.register(
    "fang",
    "values beyond the honest extremes, against the direction the model would move (Fang et al. 2020, "
    "on median and trimmed mean)",
)
class Fang(Attack):
    """Fang et al. 2020 ("Local model poisoning attacks to Byzantine-robust federated learning"),
    the full-knowledge attack on the median and the trimmed mean. ``s = sign(mu)``, the direction
    in which each weight would move without the attack (the honest updates' mean). Where it would
    rise, each attacker sends a value drawn uniformly below the honest minimum ``m``: from
    ``[b m, m]`` where ``m < 0``, ``[m / b, m]`` otherwise; where it would fall, above the honest
    maximum ``M``: ``[M, b M]`` where ``M > 0``, ``[M, M / b]`` otherwise; where it would not move,
    0. Each attacker and coordinate draws its own value (the round's attack stream, ``[a, P]``
    uniform draws). The paper and Blades take ``b = 2``; as in Blades, the bounds are those of
    the updates, which are the changes of the weights the paper bounds."""

    def __init__(self, b: float = 2.0):
        self.b = OPTIONS.within("b", OPTIONS.number("b", b, "must be a number"), 1, math.inf, "[)")

    def rewrite(self, view: RoundView) -> torch.Tensor:
        honest = view.honest
        rising = _mean(honest).sign()
        low, high = honest.min(dim=0).values, honest.max(dim=0).values
        below = torch.stack([torch.where(low < 0, self.b * low, low / self.b), low])  # [lower, upper] bounds
        above = torch.stack([high, torch.where(high > 0, self.b * high, high / self.b)])
        bounds = torch.where(rising > 0, below, torch.where(rising < 0, above, 0.0))
        draws = torch.rand(int(view.attackers.sum()), honest.shape[1], generator=view.generator)
        draws = draws.to(device=honest.device, dtype=honest.dtype)
        return bounds[0] + draws * (bounds[1] - bounds[0])


class _LineSearch(Attack):
    """ByzFL's optimal attacks: the factor of the base attack that moves the server's aggregate
    (its pre-aggregators and rule, on the round's stack with every attacker sending the vector)
    farthest from the honest updates' mean, by ByzFL's search: from ``start``, steps of ``delta``
    doubled while the distance grows, then shrunk by ``ratio`` each of the ``evals`` evaluations."""

    def __init__(self, evals: int = 20, start: float = 0.0, delta: float = 10.0, ratio: float = 0.8):
        self.evals = OPTIONS.count("evals", evals, 1)
        self.start = OPTIONS.number("start", start, "must be a number")
        self.delta = OPTIONS.number("delta", delta, "must be a number")
        if self.delta == 0:  # the search would never move from start
            OPTIONS.fail(
                "delta", "must not be 0: it is the search's first step from start (negative: it searches below)"
            )
        self.ratio = OPTIONS.within("ratio", OPTIONS.number("ratio", ratio, "must be a number"), 0.5, 1, "()")

    def line(self, honest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The base attack's vector for factor t is ``offset + t direction``: (offset, direction)."""
        raise NotImplementedError

    def rewrite(self, view: RoundView) -> torch.Tensor:
        offset, direction = self.line(view.honest)
        seen, origin, heading, mean = _searched(view, offset, direction)

        def distance(factor: float) -> float:
            aggregate = seen.aggregate(seen.sending(origin + factor * heading), seen.weights)
            return float(row_norms(aggregate[None], mean)[0])

        best, best_distance, delta, left = self.start, distance(self.start), self.delta, self.evals - 1
        growing = True
        while left > 0:
            candidate = best + delta
            found = distance(candidate)
            left -= 1
            if found > best_distance:
                best, best_distance = candidate, found
                delta *= 2 if growing else self.ratio
            else:
                delta *= self.ratio
                growing = False
        return offset + best * direction


def _searched(
    view: RoundView, offset: torch.Tensor, direction: torch.Tensor
) -> tuple[RoundView, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The round and the line ``offset + t direction`` as the search tries them, and the honest
    mean in the space of the aggregate they give. Where the server's aggregate is ``equivariant``
    (clipping, NNM, bucketing, ARC, the geometric median, Krum, ...), in coordinates of an
    orthonormal basis of the span of the honest updates and the line: each try is then on a
    ``[k, h + 2]`` stack instead of ``[k, P]``, and gives the same distance up to rounding. Where
    only its first steps are (``expanding``: clipping and NNM before the trimmed mean), they run on
    the coordinates and the rest on the rows these stand for (one ``[k, h + 2] x [h + 2, P]``
    product). Otherwise, and where a non-attacker's update is not finite, as they are."""
    senders = ~view.attackers
    honest = view.honest
    whole, first = is_equivariant(view.aggregate), is_expanding(view.aggregate)
    if not ((whole or first) and len(honest) == int(senders.sum()) > 0):
        return view, offset, direction, _mean(honest)
    rows = torch.cat([honest, offset[None], direction[None]])
    if whole:
        coordinates, aggregate = span_coordinates(rows), view.aggregate
    else:
        coordinates, basis = span_basis(rows)
        aggregate = functools.partial(view.aggregate, expand=lambda stack: stack.to(basis.dtype) @ basis)
    updates = coordinates.new_zeros(len(view.updates), coordinates.shape[1])
    updates[senders] = coordinates[:-2]
    seen = RoundView(updates, view.weights, view.attackers, view.generator, aggregate)
    return seen, coordinates[-2], coordinates[-1], _mean(seen.honest if whole else honest)


@ATTACKS.register("optimal_alie", "ALIE with the z that moves the server's aggregate farthest (ByzFL's line search)")
class OptimalALIE(_LineSearch):
    __doc__ = _LineSearch.__doc__ + "\n    The base attack is ``alie``: the factor is its ``z``."

    def line(self, honest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _mean(honest), -_std(honest)


@ATTACKS.register(
    "optimal_ipm", "IPM with the epsilon that moves the server's aggregate farthest (ByzFL's line search)"
)
class OptimalIPM(_LineSearch):
    __doc__ = _LineSearch.__doc__ + "\n    The base attack is ``ipm``: the factor is its ``epsilon``."

    def line(self, honest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(honest[0]), -_mean(honest)
