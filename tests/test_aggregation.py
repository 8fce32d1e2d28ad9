"""Aggregation rules against references written independently with numpy and plain loops."""

from __future__ import annotations

import collections
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from support import installed

import fedsim
from fedsim.core.blocks import span_basis
from fedsim.core.errors import ConfigError
from fedsim.fl import aggregation
from fedsim.fl.aggregation.preaggregation import pre_aggregated, pre_aggregator

needs_byzfl = pytest.mark.skipif(not installed("byzfl"), reason="byzfl is not installed")

RULES = [
    "fedavg",
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "bulyan",
    "geometric_median",
    "norm_clip",
    "dnc",
    "centered_clipping",
    "clipped_clustering",
]
U32 = 2.0**-24  # float32 unit roundoff


# ----------------------------------------------------------------------------- references


def ref_weighted_mean(u, w):
    return sum(w[i] * u[i] for i in range(len(u))) / sum(w)


def ref_median(u):
    k, p = u.shape
    out = []
    for j in range(p):
        col = sorted(u[:, j].tolist())
        out.append(col[k // 2] if k % 2 else (col[k // 2 - 1] + col[k // 2]) / 2)
    return np.array(out)


def ref_trimmed_mean(u, beta):
    k, p = u.shape
    drop = math.floor(Fraction(str(beta)) * k)
    return np.array([sum(sorted(u[:, j].tolist())[drop : k - drop]) / (k - 2 * drop) for j in range(p)])


def ref_krum_scores(u, f):
    k = len(u)
    scores = []
    for i in range(k):
        others = sorted(float(np.sum((u[i] - u[j]) ** 2)) for j in range(k) if j != i)
        scores.append(sum(others[: k - f - 2]))
    return np.array(scores)


def ref_krum(u, f):
    scores = ref_krum_scores(u, f)
    return u[int(np.argmin(scores))]  # argmin: the first of equal scores


def ref_multi_krum(u, f, m):
    order = np.argsort(ref_krum_scores(u, f), kind="stable")
    return u[order[:m]].mean(axis=0)


def ref_bulyan_selection(u, f):
    """El Mhamdi et al. 2018: Krum on the updates not picked yet, k - 2f times; Krum scores a row by
    its |R| - f - 2 nearest others in R, at least one (see aggregation.bulyan)."""
    remaining, picked = list(range(len(u))), []
    while len(picked) < len(u) - 2 * f:
        count = min(max(1, len(remaining) - f - 2), len(remaining) - 1)
        scores = [
            sum(sorted(float(np.sum((u[i] - u[j]) ** 2)) for j in remaining if j != i)[:count]) for i in remaining
        ]
        picked.append(remaining.pop(int(np.argmin(scores))))  # argmin: the first of equal scores
    return picked


def ref_bulyan(u, f):
    """Per coordinate, the mean of the k - 4f picked values nearest their median; also the values kept."""
    chosen = u[ref_bulyan_selection(u, f)]
    beta = len(u) - 4 * f
    out, kept = [], []
    for column in chosen.T:
        middle = ref_median(column[:, None])[0]
        nearest = sorted(range(len(column)), key=lambda i: (abs(column[i] - middle), i))[:beta]
        kept.append(column[nearest])
        out.append(sum(column[i] for i in nearest) / beta)
    return np.array(out), np.array(kept).T


def ref_geometric_median(u, w, eps=1e-6, iterations=2000):
    a = w / w.sum()
    z = a @ u
    for _ in range(iterations):
        b = a / np.maximum(eps, np.sqrt(((u - z) ** 2).sum(axis=1)))
        z = b @ u / b.sum()
    return z


def ref_norm_clip(u, w, max_norm):
    rows = [u[i] * min(1.0, max_norm / np.sqrt(np.sum(u[i] ** 2))) for i in range(len(u))]
    return ref_weighted_mean(rows, w)


def random_stack(k, p, seed):
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(k, p)).astype(np.float32)
    w = rng.integers(1, 500, size=k)
    return u, w


def run(name, u, w, **options):
    out = aggregation.get(name, **options)(torch.from_numpy(u), torch.from_numpy(np.asarray(w)))
    assert out.shape == (u.shape[1],) and out.dtype == torch.float32
    return out.numpy()


def rounding_bound(roundings, magnitude):
    """Twice the worst-case error of a float32 result reached through ``roundings`` roundings,
    in any order, each of a partial result no larger than ``magnitude`` (for a mean with
    weights >= 0, the same mean of the absolute values): the factor 2 covers second-order
    terms and the float64 reference. It holds for any summation order, BLAS or SIMD width."""
    return 2 * roundings * U32 * magnitude


def assert_within(got, expected, bound):
    error = np.abs(np.asarray(got, dtype=np.float64) - expected)
    assert np.all(error <= bound), f"error / bound up to {np.max(error / bound):.3g}, error {np.max(error):.3g}"


# ----------------------------------------------------------------------------- against the references


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_fedavg_mean_and_median_match_references(k):
    u, w = random_stack(k, 41, seed=k)
    u64 = u.astype(np.float64)
    # k - 1 additions, one rounding per product and one per normalized weight (or for 1 / k)
    assert_within(run("fedavg", u, w), ref_weighted_mean(u64, w), rounding_bound(k + 1, ref_weighted_mean(abs(u64), w)))
    assert_within(run("mean", u, w), u64.mean(axis=0), rounding_bound(k + 1, abs(u64).mean(axis=0)))
    # halving is exact, so a / 2 + b / 2 is (a + b) / 2 rounded once: the float64 value rounded
    np.testing.assert_array_equal(run("median", u, w), ref_median(u64).astype(np.float32))


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values():
    u = np.array([[1.0, 5.0], [4.0, -1.0], [2.0, 0.0], [10.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(run("median", u, [1, 1, 1, 1]), [3.0, 0.0])


@pytest.mark.parametrize("k,beta", [(1, 0.4), (5, 0.0), (5, 0.2), (10, 0.1), (10, 0.3), (10, 0.49), (100, 0.29)])
def test_trimmed_mean_matches_reference(k, beta):
    u, w = random_stack(k, 13, seed=k)
    drop = math.floor(Fraction(str(beta)) * k)
    kept = np.sort(u.astype(np.float64), axis=0)[drop : k - drop]  # sorting is exact: only the mean rounds
    assert_within(
        run("trimmed_mean", u, w, beta=beta),
        ref_trimmed_mean(u.astype(np.float64), beta),
        rounding_bound(len(kept) + 1, abs(kept).mean(axis=0)),
    )


def test_trimmed_mean_rounds_the_count_down():
    # k = 9, beta = 0.2: floor(1.8) = 1 value dropped at each end
    u = np.arange(9, dtype=np.float32).reshape(9, 1) ** 2
    assert run("trimmed_mean", u, [1] * 9, beta=0.2)[0] == pytest.approx(np.mean(np.arange(1, 8) ** 2))


@pytest.mark.parametrize("k,beta", [(100, 0.29), (180, 0.35), (200, 0.145), (200, 0.285)])
def test_trimmed_mean_counts_beta_k_exactly_where_truncating_the_float_product_drops_one_less(k, beta):
    """floor of the exact decimal product, against Flower 1.42's int(beta * k) written out here."""
    exact, truncated = math.floor(Fraction(str(beta)) * k), int(beta * k)
    assert truncated == exact - 1  # the float product falls just below the integer
    # integer cubes, exact in float32; the mean of the m = k - 2b kept rounds m + 1 times (as in the
    # tests above), and the means after b and b - 1 drops differ by far more than that
    u = (np.arange(k, dtype=np.float64) ** 3)[:, None]
    rng = np.random.default_rng(k)
    shuffled = u[rng.permutation(k)].astype(np.float32)

    def trimmed(drop):
        return float(sum(Fraction(int(v)) for v in u[drop : k - drop, 0]) / (k - 2 * drop))

    bound = rounding_bound(k - 2 * exact + 1, trimmed(exact))
    assert abs(run("trimmed_mean", shuffled, [1] * k, beta=beta)[0] - trimmed(exact)) <= bound
    assert abs(trimmed(truncated) - trimmed(exact)) > 100 * bound


@pytest.mark.parametrize("k,f", [(3, 0), (5, 1), (9, 3), (10, 2)])
def test_krum_and_multi_krum_match_references(k, f):
    u, w = random_stack(k, 29, seed=10 + k)
    u64 = u.astype(np.float64)
    np.testing.assert_array_equal(run("krum", u, w, f=f), ref_krum(u64, f).astype(np.float32))
    # the mean of m of the rows (the others weigh 0 and add exactly 0): m + 1 roundings of values <= max |u|
    for m in range(1, k - f + 1):
        assert_within(
            run("multi_krum", u, w, f=f, m=m), ref_multi_krum(u64, f, m), rounding_bound(m + 1, abs(u64).max(axis=0))
        )


@pytest.mark.parametrize("k,f", [(3, 0), (7, 1), (8, 1), (11, 2), (12, 2), (16, 3)])
def test_bulyan_matches_reference(k, f):
    u, w = random_stack(k, 31, seed=30 + k)
    u64 = u.astype(np.float64)
    expected, kept = ref_bulyan(u64, f)
    # the mean of the k - 4f values kept: k - 4f + 1 roundings of values <= their mean magnitude
    assert_within(run("bulyan", u, w, f=f), expected, rounding_bound(k - 4 * f + 1, abs(kept).mean(axis=0)))
    if f == 0:  # every update picked and kept: the mean
        assert_within(run("bulyan", u, w, f=0), u64.mean(axis=0), rounding_bound(k + 1, abs(u64).mean(axis=0)))


def test_bulyan_picks_as_krum_does_on_the_remaining_updates():
    # two far rows and one farther: the honest nine are picked first, in Krum's order, the outliers never
    rng = np.random.default_rng(3)
    honest = rng.normal(size=(9, 5))
    u = np.concatenate([honest[:4], [np.full(5, 50.0)], honest[4:], [np.full(5, -40.0)]]).astype(np.float32)
    picked = ref_bulyan_selection(u.astype(np.float64), 1)
    assert len(picked) == 9 and {4, 10}.isdisjoint(picked)
    expected, kept = ref_bulyan(u.astype(np.float64), 1)
    assert_within(run("bulyan", u, [1] * 11, f=1), expected, rounding_bound(7 + 1, abs(kept).mean(axis=0)))
    # f: null is the largest f with k >= 4f + 3, here 2
    expected, kept = ref_bulyan(u.astype(np.float64), 2)
    assert_within(run("bulyan", u, [1] * 11), expected, rounding_bound(3 + 1, abs(kept).mean(axis=0)))


def test_krum_defaults_to_the_largest_f_and_multi_krum_to_k_minus_f():
    u, w = random_stack(10, 7, seed=4)
    u64 = u.astype(np.float64)
    np.testing.assert_array_equal(run("krum", u, w), ref_krum(u64, 3).astype(np.float32))
    assert_within(run("multi_krum", u, w), ref_multi_krum(u64, 3, 7), rounding_bound(7 + 1, abs(u64).max(axis=0)))


def test_krum_ties_go_to_the_lower_row():
    # integer entries make every distance exact, so rows 1 and 3 score exactly the same
    center = np.array([1, 2, 3, 4], dtype=np.float32)
    u = np.stack([center + 9, center, center + 1, center, center - 1, center - 8]).astype(np.float32)
    scores = ref_krum_scores(u.astype(np.float64), 1)
    assert scores[1] == scores[3] == scores.min()
    np.testing.assert_array_equal(run("krum", u, [1] * 6, f=1), u[1])
    np.testing.assert_allclose(run("multi_krum", u, [1] * 6, f=1, m=2), u[[1, 3]].mean(axis=0))


@pytest.mark.parametrize("k", [1, 2, 6, 11])
def test_geometric_median_matches_a_float64_weiszfeld(k):
    u, w = random_stack(k, 17, seed=20 + k)
    got = run("geometric_median", u, w, tol=1e-9, max_iter=500)
    # a Weiszfeld step computes distances and weights in float64 (relative error < 1e-15) and rounds
    # each weight once to float32, after the float32 rounding of the sample weight: 2 roundings, then
    # one per product and k - 1 additions: k + 2 <= 13 roundings of values <= max |u| = 3.1: 2.4e-6.
    # Near the fixed point the float64 iteration contracts by <= 0.45 a step for these k, so the fixed
    # points are <= 2.4e-6 / 0.55 = 4.4e-6 apart; atol twice that.
    np.testing.assert_allclose(got, ref_geometric_median(u.astype(np.float64), w.astype(np.float64)), rtol=0, atol=9e-6)


def test_geometric_median_in_one_dimension_is_the_weighted_median():
    u = np.array([[0.0], [1.0], [10.0], [-3.0], [2.0]], dtype=np.float32)
    weights = [1, 3, 1, 1, 1]  # the weighted median is 1.0: weight 3 of 7 at it, 2 below, 2 above
    # with eps = 1e-6 the smoothed objective is flat on [1 - eps, 1 + eps] (the term of 1.0 is
    # constant there, the others balance 2 against 2): any point there, plus a float32 ulp, is right
    got = run("geometric_median", u, weights, eps=1e-6, tol=1e-12, max_iter=10_000)[0]
    assert got == pytest.approx(1.0, abs=1e-6 + 2.0**-23)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_norm_clip_matches_reference(max_norm):
    u, w = random_stack(7, 9, seed=3)
    u64 = u.astype(np.float64)
    # the norms and scales are float64 (relative error < 1e-15); the float32 weight rounds once, its
    # product with the scale once more (to float32), each product with u once, then k - 1 additions:
    # k + 2 roundings of terms <= the clipped |u|
    assert_within(
        run("norm_clip", u, w, max_norm=max_norm),
        ref_norm_clip(u64, w, max_norm),
        rounding_bound(7 + 2, ref_norm_clip(abs(u64), w, max_norm)),
    )


def test_norm_clip_defaults_to_the_median_norm_and_keeps_zero_updates():
    u = np.zeros((4, 3), dtype=np.float32)
    u[1], u[2], u[3] = [3, 4, 0], [0, 0, 1], [0, 30, 40]  # norms 0, 5, 1, 50: median (1 + 5) / 2 = 3
    expected = ref_norm_clip(u[1:].astype(np.float64), [1, 1, 1], 3.0) * 3 / 4  # the zero row adds nothing
    # exact norms and median, weight 1/4 exact, terms >= 0: the scale times the weight (float64, rounded
    # to float32), the product and 3 additions round 5 times
    np.testing.assert_allclose(run("norm_clip", u, [1, 1, 1, 1]), expected, rtol=2 * 5 * U32)


def test_norm_clip_with_mostly_zero_updates_clips_to_zero():
    # median norm 0: the nonzero update is clipped to norm 0, and the zero ones stay zero (not 0 / 0)
    u = np.zeros((3, 4), dtype=np.float32)
    u[0] = 1.0
    np.testing.assert_array_equal(run("norm_clip", u, [1, 1, 1]), np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("name", ["fedavg", "mean", "median", "trimmed_mean", "geometric_median", "norm_clip"])
def test_one_client_gives_its_own_update(name):
    u = np.array([[0.5, -2.0, 7.0]], dtype=np.float32)
    # exact: the weight normalizes to 1, the median of one value is x / 2 + x / 2, the norm ratio is 1
    np.testing.assert_array_equal(run(name, u, [3]), u[0])


@pytest.mark.parametrize("name", RULES)
def test_integer_and_float_weights_agree(name):
    u, w = random_stack(9, 11, seed=5)
    # counts < 2^24 convert exactly, so both runs do the same float32 arithmetic
    np.testing.assert_array_equal(run(name, u, w), run(name, u, w.astype(np.float32)))


# ----------------------------------------------------------------------------- robustness


def test_robust_rules_stay_near_the_honest_mean_and_the_mean_does_not():
    rng = np.random.default_rng(7)
    k, f, p = 10, 4, 50  # f < k/2 attackers
    honest = (1.0 + 0.1 * rng.normal(size=(k - f, p))).astype(np.float32)
    attackers = np.full((f, p), 1e6, dtype=np.float32)
    u = np.concatenate([attackers[:2], honest, attackers[2:]])  # attackers not in a block at one end
    honest_mean = honest.astype(np.float64).mean(axis=0)
    radius = max(np.linalg.norm(h - honest_mean) for h in honest)

    def error(name, **options):
        return np.linalg.norm(run(name, u, [100] * k, **options) - honest_mean)

    for name, options in [
        ("median", {}),
        ("trimmed_mean", {"beta": 0.4}),
        ("krum", {"f": 3}),
        ("multi_krum", {"f": 3, "m": 5}),
        ("geometric_median", {}),
    ]:
        assert error(name, **options) <= 2 * radius, name
    assert error("norm_clip", max_norm=1.0) <= 1.0 + np.linalg.norm(honest_mean)
    assert error("mean") > 1e5 * radius


# ----------------------------------------------------------------------------- huge updates


FLOAT32_MAX = float(np.finfo(np.float32).max)


def huge_stacks():
    """Finite float32 stacks near the float32 limit, where sums and squares overflow."""
    rng = np.random.default_rng(11)
    signs = rng.choice([-1.0, 1.0], size=(8, 6))
    spread = (signs * rng.uniform(0.1, 3.4, size=(8, 6)) * 1e38).astype(np.float32)
    one_huge = rng.normal(size=(7, 6)).astype(np.float32)
    one_huge[3] = signs[0] * 3e38  # among rows of size ~1
    # every value at the limit: a mean of 10 of them rounds past it (1/10 rounds up in float32)
    limit = np.tile(np.array([1, -1, 1, 1, -1, -1], dtype=np.float32) * np.float32(FLOAT32_MAX), (10, 1))
    return {"spread": spread, "one huge": one_huge, "limit": limit}


def ref_geometric_median_magnitude(u, w, z, eps=1e-6):
    """The Weiszfeld step's weighted mean of |u| at z: its terms' size, for a rounding bound."""
    b = w / np.maximum(eps, np.sqrt(((u - z) ** 2).sum(axis=1)))
    return b @ abs(u) / b.sum()


@pytest.mark.parametrize("stack", ["spread", "one huge", "limit"])
@pytest.mark.parametrize("name", RULES)
def test_huge_updates_give_a_finite_aggregate(name, stack):
    u = huge_stacks()[stack]
    k = len(u)
    w = np.random.default_rng(k).integers(1, 500, size=k)
    u64, w64 = u.astype(np.float64), w.astype(np.float64)
    options = {"tol": 1e-9, "max_iter": 500} if name == "geometric_median" else {}
    got = run(name, u, w, **options)
    assert np.all(np.isfinite(got)), got
    # the references are in float64, where nothing here overflows; the bounds are the ones of the
    # tests above, relative to the size of the values, so they hold at any scale
    if name == "fedavg":
        assert_within(got, ref_weighted_mean(u64, w64), rounding_bound(k + 1, ref_weighted_mean(abs(u64), w64)))
    elif name == "mean":
        assert_within(got, u64.mean(axis=0), rounding_bound(k + 1, abs(u64).mean(axis=0)))
    elif name == "median":
        np.testing.assert_array_equal(got, ref_median(u64).astype(np.float32))
    elif name == "trimmed_mean":  # beta = 0.1 drops 0 of 7 or 8 values, 1 of 10 at each end
        kept = np.sort(u64, axis=0)[k // 10 : k - k // 10]
        assert_within(got, ref_trimmed_mean(u64, 0.1), rounding_bound(len(kept) + 1, abs(kept).mean(axis=0)))
    elif name in ("krum", "multi_krum") and stack == "one huge":
        # squared_distances centres each column on its mean, which the huge row dominates: the honest
        # rows' distances to each other (~1) drown in rounding errors of ~1e-16 P^2 (3e38 / k)^2 ~ 1e61,
        # so Krum's choice among them is not the reference's. Only the exclusion of the huge row is
        # checked here, and test_one_huge_update_does_not_move_the_robust_rules bounds the result.
        honest = np.delete(u, 3, axis=0)
        if name == "krum":
            assert any(np.array_equal(got, row) for row in honest), got
        else:
            assert np.all(abs(got) <= abs(honest).max(axis=0)), got
    elif name == "krum":
        np.testing.assert_array_equal(got, ref_krum(u64, (k - 3) // 2).astype(np.float32))
    elif name == "multi_krum":
        f = (k - 3) // 2
        assert_within(got, ref_multi_krum(u64, f, k - f), rounding_bound(k - f + 1, abs(u64).max(axis=0)))
    elif name == "bulyan" and stack == "one huge":  # as Krum: its distances among the honest rows are lost
        assert np.all(abs(got) <= abs(np.delete(u, 3, axis=0)).max(axis=0)), got
    elif name == "bulyan":
        expected, kept = ref_bulyan(u64, (k - 3) // 4)
        assert_within(got, expected, rounding_bound(len(kept) + 1, abs(kept).mean(axis=0)))
    elif name == "norm_clip":  # clipped to the median norm
        bound = np.median(np.sqrt((u64**2).sum(axis=1)))
        assert_within(got, ref_norm_clip(u64, w64, bound), rounding_bound(k + 2, ref_norm_clip(abs(u64), w64, bound)))
    elif name == "geometric_median":
        # as in test_geometric_median_matches_a_float64_weiszfeld: a step rounds k + 2 times, relative
        # to its terms (the huge row's weighs ~1e-38); near these fixed points the float64 iteration
        # contracts by <= 0.49 a step (for the identical rows of "limit", it stays put)
        expected = ref_geometric_median(u64, w64)
        magnitude = ref_geometric_median_magnitude(u64, w64, expected)
        assert_within(got, expected, rounding_bound(k + 2, magnitude) / (1 - 0.5))


def test_one_huge_update_does_not_move_the_robust_rules():
    u = huge_stacks()["one huge"]
    honest = np.delete(u, 3, axis=0).astype(np.float64)
    honest_mean = honest.mean(axis=0)
    radius = max(np.linalg.norm(h - honest_mean) for h in honest)
    for name in ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median", "norm_clip"]:
        options = {"beta": 0.2} if name == "trimmed_mean" else {}  # drops 1 of 7 at each end; bulyan: f = 1
        assert np.linalg.norm(run(name, u, [100] * len(u), **options) - honest_mean) <= 2 * radius, name


# ----------------------------------------------------------------------------- numerics and devices


def test_squared_distances_are_accurate_for_close_updates_of_large_norm():
    # ||a||^2 ~ 3e9 while ||a - b||^2 ~ 0.6: without centring, a float64 Gram matrix is off by
    # ~1e-6 relative even with correctly rounded sums (~1e-3 with MKL). p spans two of the
    # function's column blocks. Bound, with n = p summed terms and u = 2^-53: the centred rows
    # x_i are exact to u, and in any summation order |error of <x_i, x_j>| <= n u |x_i| |x_j|,
    # so D_ij is off by <= n u (|x_i| + |x_j|)^2 ~ 1.5 n u D_ij (4 rows of isotropic noise of
    # variance s^2: |x_i|^2 ~ 3/4 s^2 n, D_ij ~ 2 s^2 n). The reference sums n positive squares,
    # each correct to 2u: <= (n + 2) u D_ij. Total ~2.5 n u = 8e-11; rtol 4 n u.
    rng = np.random.default_rng(0)
    p = 300_000
    base = rng.normal(scale=100.0, size=p)
    u = (base + 1e-3 * rng.normal(size=(4, p))).astype(np.float32)
    u64 = u.astype(np.float64)
    expected = np.array([[np.sum((a - b) ** 2) for b in u64] for a in u64])
    got = aggregation.squared_distances(torch.from_numpy(u)).numpy()
    np.testing.assert_allclose(got, expected, rtol=4 * p * 2.0**-53, atol=0)  # the diagonal is exactly 0
    as_float64 = torch.from_numpy(u64.copy())
    np.testing.assert_allclose(
        aggregation.squared_distances(as_float64).numpy(), expected, rtol=4 * p * 2.0**-53, atol=0
    )
    np.testing.assert_array_equal(as_float64.numpy(), u64)  # the input is not centred in place


def test_one_huge_update_does_not_blur_the_distances_between_the_others():
    # the rows are moved by a centre among them before the Gram product; a plain mean would sit
    # ~1e29 away from the honest rows here, and their distances (~0.6) would vanish in the
    # cancellation. With the outlier left out of the centre, the honest block keeps the bound
    # of the test above; the outlier's own distances (~1e65) are exact to float64's n u.
    rng = np.random.default_rng(1)
    p = 300_000
    base = rng.normal(scale=100.0, size=p)
    honest = base + 1e-3 * rng.normal(size=(5, p))
    u = np.concatenate([honest, 1e30 * rng.normal(size=(1, p))]).astype(np.float32)
    u64 = u.astype(np.float64)
    expected = np.array([[np.sum((a - b) ** 2) for b in u64] for a in u64])
    got = aggregation.squared_distances(torch.from_numpy(u)).numpy()
    np.testing.assert_allclose(got, expected, rtol=4 * p * 2.0**-53, atol=0)
    # so Krum (f = 1) picks the honest row that is really closest to its k - f - 2 neighbours
    scores = np.sort(expected + np.diag([np.inf] * 6), axis=1)[:, :3].sum(axis=1)
    np.testing.assert_array_equal(run("krum", u, [1] * 6, f=1), u[np.argmin(scores)])


@pytest.mark.cuda
@pytest.mark.parametrize("name", RULES)
def test_cuda_matches_cpu(name):
    u, w = random_stack(12, 1000, seed=9)
    rule = aggregation.get(name)
    cpu = rule(torch.from_numpy(u), torch.from_numpy(w))
    gpu = rule(torch.from_numpy(u).cuda(), torch.from_numpy(w).cuda())
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- options and errors


@pytest.mark.parametrize(
    "name,options,k,words",
    [
        ("krum", {"f": 2}, 6, ["aggregator_options.f", "[0, 1]", "k = 6"]),
        ("krum", {"f": 3}, 6, ["aggregator_options.f", "[0, 1]"]),
        ("krum", {}, 2, ["at least 3", "k = 2"]),
        ("krum", {"f": 0}, 1, ["at least 3", "k = 1"]),
        ("multi_krum", {"f": 5}, 10, ["aggregator_options.f", "[0, 3]"]),
        ("multi_krum", {"f": 1, "m": 9}, 9, ["aggregator_options.m", "[1, 8]"]),
        ("multi_krum", {"m": 0}, 9, ["m must be an integer >= 1"]),
        ("krum", {"f": -1}, 9, ["f must be an integer >= 0"]),
        ("bulyan", {"f": 2}, 10, ["aggregator_options.f", "[0, 1]", "k = 10", "4f + 3"]),
        ("bulyan", {}, 2, ["at least 3", "k = 2"]),
        ("bulyan", {"f": 0.5}, 9, ["f must be an integer >= 0"]),
        ("krum", {"f": 1.5}, 9, ["f must be an integer >= 0"]),
        ("trimmed_mean", {"beta": 0.5}, 9, ["beta", "[0, 0.5)", "0.5"]),
        ("trimmed_mean", {"beta": -0.1}, 9, ["beta", "[0, 0.5)"]),
        ("trimmed_mean", {"beta": "a lot"}, 9, ["beta", "[0, 0.5)"]),
        ("norm_clip", {"max_norm": 0}, 9, ["max_norm", "> 0"]),
        ("norm_clip", {"max_norm": -2.0}, 9, ["max_norm", "> 0"]),
        ("geometric_median", {"max_iter": 0}, 9, ["max_iter", ">= 1"]),
        ("geometric_median", {"eps": 0.0}, 9, ["eps", "> 0"]),
        # the float32 engine's range: overflowing, subnormal, infinite, NaN or huge-int values
        ("geometric_median", {"eps": 1e39}, 9, ["eps", "float32", "3.4e+38", "got 1e+39"]),
        ("geometric_median", {"tol": 1e-39}, 9, ["tol", "float32", "1.18e-38", "got 1e-39"]),
        ("geometric_median", {"tol": math.nan}, 9, ["tol", "> 0", "got nan"]),
        ("geometric_median", {"eps": "small"}, 9, ["eps", "> 0", "got 'small'"]),
        ("norm_clip", {"max_norm": 1e-45}, 9, ["max_norm", "1.18e-38", "got 1e-45"]),
        ("norm_clip", {"max_norm": math.inf}, 9, ["max_norm", "3.4e+38", "got inf"]),
        ("norm_clip", {"max_norm": 10**39}, 9, ["max_norm", "3.4e+38", "got 1" + "0" * 39]),
        ("trimmed_mean", {"bet": 0.1}, 9, ["'bet'", "it takes: beta"]),
        ("mean", {"beta": 0.1}, 9, ["'beta'", "no options"]),
    ],
)
def test_invalid_options_give_one_line_errors(name, options, k, words):
    with pytest.raises(ConfigError) as info:
        rule = aggregation.get(name, **options)
        rule(torch.randn(k, 3), torch.ones(k))
    message = str(info.value)
    assert message.startswith("aggregator_options: ") and "\n" not in message, message
    for word in words:
        assert word in message, message


def test_options_at_the_float32_bounds_are_accepted():
    tiny, huge = float(np.finfo(np.float32).tiny), FLOAT32_MAX
    u, w = random_stack(5, 4, seed=1)
    u64 = u.astype(np.float64)
    # a bound above every norm clips nothing: the weighted mean, with the k + 2 roundings of
    # test_norm_clip_matches_reference
    assert_within(
        run("norm_clip", u, w, max_norm=huge),
        ref_weighted_mean(u64, w),
        rounding_bound(5 + 2, ref_weighted_mean(abs(u64), w)),
    )
    for eps, tol in [(tiny, tiny), (huge, huge)]:
        assert np.all(np.isfinite(run("geometric_median", u, w, eps=eps, tol=tol))), (eps, tol)
    # eps above every distance weighs the updates as the sample counts: the weighted mean again, after
    # one step that stops the iteration (k + 2 roundings, as in the float64 Weiszfeld test)
    assert_within(
        run("geometric_median", u, w, eps=huge),
        ref_weighted_mean(u64, w),
        rounding_bound(5 + 2, ref_weighted_mean(abs(u64), w)),
    )


def test_config_validation_reports_k_dependent_options():
    cfg = {"aggregator": "krum", "aggregator_options": {"f": 2}, "clients_per_round": 6, "data": {"num_clients": 20}}
    with pytest.raises(ConfigError) as info:
        fedsim.load_config(cfg)
    message = str(info.value)
    assert "\n" not in message and "aggregator_options" in message and "[0, 1]" in message, message
    fedsim.load_config(dict(cfg, clients_per_round=7))  # k = 7 > 2 * 2 + 2
    with pytest.raises(ConfigError) as info:
        fedsim.load_config(dict(cfg, aggregator="bulyan", clients_per_round=10))
    message = str(info.value)
    assert "\n" not in message and "aggregator_options" in message and "k >= 4f + 3" in message, message
    fedsim.load_config(dict(cfg, aggregator="bulyan", clients_per_round=11))  # k = 11 >= 4 * 2 + 3


def test_every_rule_is_registered_with_a_description():
    described = dict(aggregation.AGGREGATORS.describe())
    assert set(RULES) <= set(described)
    assert all(text and "\n" not in text for text in described.values())


# ----------------------------------------------------------------------------- exact ties


def ref_distances(u):
    """Squared distances from the row differences, in float64: d[i, j] and d[j, i] sum the same
    squares (u - v is -(v - u) exactly) in the same order, so they are the same number."""
    d = ((u[:, None, :] - u[None, :, :]) ** 2).sum(axis=2)
    assert np.array_equal(d, d.T)
    return d


def ref_krum_order(d, f):
    """The rows by Krum score (Blanchard et al. 2017: the sum of the k - f - 2 smallest distances to
    the others), equal scores by row. Equal sets of distances sum alike: sorted, then summed in order."""
    k = len(d)
    scores = [sum(sorted(d[i, j] for j in range(k) if j != i)[: k - f - 2]) for i in range(k)]
    return sorted(range(k), key=lambda i: (scores[i], i))


def ref_bulyan_fast(u, f):
    """Bulyan (El Mhamdi et al. 2018) with plain loops for the picks (at least one neighbour counted,
    as in aggregation.bulyan; equal scores by row) and numpy for the coordinate step; also the kept values."""
    d, remaining, picked = ref_distances(u), list(range(len(u))), []
    while len(picked) < len(u) - 2 * f:
        count = min(max(1, len(remaining) - f - 2), len(remaining) - 1)
        scores = {i: sum(sorted(d[i, j] for j in remaining if j != i)[:count]) for i in remaining}
        best = min(remaining, key=lambda i: (scores[i], i))
        remaining.remove(best)
        picked.append(best)
    chosen = u[picked]
    # np.median: the mean of the two middle values for an even count; equal distances to the earlier pick
    nearest = np.argsort(abs(chosen - np.median(chosen, axis=0)), axis=0, kind="stable")[: len(u) - 4 * f]
    kept = np.take_along_axis(chosen, nearest, axis=0)
    return kept.mean(axis=0), kept, picked


@pytest.mark.parametrize("k,p", [(3, 33), (4, 33), (7, 64), (10, 1000), (16, 100)])
def test_squared_distances_are_exactly_symmetric_with_a_zero_diagonal(k, p):
    # a BLAS may round <a, b> and <b, a> apart (MKL does for these shapes); the matrix must not
    for seed in range(20):
        d = aggregation.squared_distances(torch.from_numpy(random_stack(k, p, seed)[0]))
        assert torch.equal(d, d.T), seed
        assert torch.equal(d.diagonal(), torch.zeros(k, dtype=d.dtype)), seed


@pytest.mark.parametrize("k,f,p", [(3, 0, 33), (3, 0, 65), (10, 1, 100), (10, 2, 100)])
def test_krum_and_multi_krum_pick_as_the_reference_on_random_inputs(k, f, p):
    # for k = 3, f = 0 a score counts one neighbour, so the closest pair ties in every input, in exact
    # and in float arithmetic alike (one distance, d(i, j) = d(j, i)), and the lower row must win
    for seed in range(100):
        u, w = random_stack(k, p, seed=seed)
        u64 = u.astype(np.float64)
        order = ref_krum_order(ref_distances(u64), f)
        np.testing.assert_array_equal(run("krum", u, w, f=f), u[order[0]], err_msg=f"seed {seed}")
        np.testing.assert_array_equal(run("multi_krum", u, w, f=f, m=1), u[order[0]], err_msg=f"seed {seed}")
        chosen = u64[order[: k - f]]
        # the mean of k - f rows: k - f + 1 roundings of values <= their largest |value|
        assert_within(run("multi_krum", u, w, f=f), chosen.mean(axis=0), rounding_bound(k - f + 1, abs(chosen).max()))


@pytest.mark.parametrize("k,f", [(7, 1), (10, 1), (11, 2)])
def test_bulyan_matches_the_reference_on_random_inputs(k, f):
    # the last pick counts one neighbour (for f = 1 the last two), so in every input it is a tie between
    # the two closest of the rows left; the wrong one of them moves the result by up to ~2.5 here
    for seed in range(100):
        u, w = random_stack(k, 1000, seed=seed)
        expected, kept, _ = ref_bulyan_fast(u.astype(np.float64), f)
        # the mean of the k - 4f values kept, as in test_bulyan_matches_reference
        bound = rounding_bound(k - 4 * f + 1, abs(kept).mean(axis=0))
        assert_within(run("bulyan", u, w, f=f), expected, bound)


def test_bulyan_gives_the_tie_of_its_last_pick_to_the_lower_row_wherever_the_pair_sits():
    # k = 11, f = 2: only the last pick counts one neighbour, and it ties the two closest of the 5 rows
    # left. Placed at any two positions (the other rows in their order), the lower one is picked,
    # whichever of the pair it holds.
    k, f = 11, 2
    u = random_stack(k, 64, seed=2)[0].astype(np.float64)
    picks = ref_bulyan_fast(u, f)[2]
    left = [r for r in range(k) if r not in picks[:-1]]
    a, b = min((float(np.sum((u[i] - u[j]) ** 2)), i, j) for i in left for j in left if i < j)[1:]
    assert picks[-1] == a
    others = [r for r in range(k) if r not in (a, b)]
    results = {}
    for low, high in itertools.combinations(range(k), 2):
        for first, second in [(a, b), (b, a)]:
            order = others.copy()
            order.insert(low, first)
            order.insert(high, second)
            stack = u[order]
            expected, kept, picked = ref_bulyan_fast(stack, f)
            assert picked[-1] == low
            got = run("bulyan", stack.astype(np.float32), [1] * k, f=f)
            assert_within(got, expected, rounding_bound(k - 4 * f + 1, abs(kept).mean(axis=0)))
            results[first] = expected
    # which of the two is picked matters, by far more than the bound
    assert np.max(np.abs(results[a] - results[b])) > 0.1


@pytest.mark.parametrize("k,f,p", [(3, 0, 33), (10, 1, 1000), (11, 2, 1000)])
def test_krum_and_bulyan_agree_with_flower(k, f, p):
    """Flower 1.42's aggregate_krum and aggregate_bulyan (flwr/server/strategy/aggregate.py), where
    installed: float32 distances from the row differences, numpy's argmin (the first of equal scores)."""
    flower = pytest.importorskip("flwr.server.strategy.aggregate")
    for seed in range(100):
        u, w = random_stack(k, p, seed=seed)
        results = [([row], 1) for row in u]
        np.testing.assert_array_equal(run("krum", u, w, f=f), flower.aggregate_krum(results, f, to_keep=0)[0])
        if k >= 4 * f + 3:  # Flower pops the picks from the list it is given
            expected = flower.aggregate_bulyan(list(results), f, flower.aggregate_krum, to_keep=0)[0]
            kept = ref_bulyan_fast(u.astype(np.float64), f)[1]
            # each a float32 mean of the same k - 4f values: twice the bound of one
            assert_within(run("bulyan", u, w, f=f), expected, 2 * rounding_bound(k - 4 * f + 1, abs(kept).mean(axis=0)))


# ----------------------------------------------------------------------------- pre-aggregators


def spread_stack(k=11, p=60, seed=0):
    """Rows of distinct norms and distances (no ties), a few far out."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, p, generator=g) * torch.linspace(0.5, 3.0, k)[:, None]
    rows[-2:] += 8.0
    return rows


def ref_nnm(u, f):
    k = len(u)
    out = []
    for i in range(k):
        nearest = sorted(range(k), key=lambda j: (float(np.linalg.norm(u[i] - u[j])), j))[: k - f]
        out.append(u[nearest].mean(axis=0))
    return np.array(out)


def ref_arc(u, f):
    k = len(u)
    clipped = math.floor(Fraction(2 * f * (k - f), k))
    norms = [float(np.linalg.norm(row)) for row in u]
    order = sorted(range(k), key=lambda i: (norms[i], i))
    out = u.copy()
    if clipped:
        bound = norms[order[k - clipped - 1]]
        for i in order[k - clipped :]:
            out[i] = u[i] * min(1.0, bound / norms[i])
    return out


@pytest.mark.parametrize("f", [0, 1, 3, 5])
def test_nnm_mixes_each_update_with_its_k_minus_f_nearest(f):
    u = spread_stack()
    out, weights = pre_aggregator({"nnm": {"f": f}})(u, torch.arange(11.0), torch.Generator())
    np.testing.assert_allclose(out.double().numpy(), ref_nnm(u.double().numpy(), f), rtol=1e-5, atol=1e-6)
    assert torch.equal(weights, torch.arange(11.0))


@pytest.mark.parametrize("f", [0, 1, 2, 4, 5])
def test_arc_clips_the_largest_updates_to_the_next_norm(f):
    u = spread_stack()
    out, _ = pre_aggregator({"arc": {"f": f}})(u, torch.ones(11), torch.Generator())
    np.testing.assert_allclose(out.double().numpy(), ref_arc(u.double().numpy(), f), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bound", [0.5, 5.0, 1e6])
def test_clipping_bounds_every_norm(bound):
    u = spread_stack()
    out, _ = pre_aggregator({"clipping": {"max_norm": bound}})(u, torch.ones(11), torch.Generator())
    expected = [row * min(1.0, bound / float(row.double().norm())) for row in u]
    torch.testing.assert_close(out, torch.stack(expected))
    assert (out.double().norm(dim=1) <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("s", [1, 2, 3, 11, 20])
def test_bucketing_averages_random_buckets_of_s(s):
    u, w = spread_stack(), torch.arange(1.0, 12.0)
    out, weights = pre_aggregator({"bucketing": {"s": s}})(u, w, torch.Generator().manual_seed(7))
    order = torch.randperm(11, generator=torch.Generator().manual_seed(7)).tolist()
    buckets = [order[i : i + s] for i in range(0, 11, s)]
    torch.testing.assert_close(out, torch.stack([u[b].mean(0) for b in buckets]))
    torch.testing.assert_close(weights, torch.tensor([float(w[b].sum()) for b in buckets]))


def test_pre_aggregators_compose_in_order_and_draw_the_same_buckets_each_call():
    u, w = spread_stack(), torch.ones(11)
    steps = [pre_aggregator({"clipping": {"max_norm": 3.0}}), pre_aggregator("bucketing"), pre_aggregator("nnm")]
    rule = pre_aggregated(steps, aggregation.get("median"), lambda: torch.Generator().manual_seed(1))
    by_hand, by_hand_weights, draws = u, w, torch.Generator().manual_seed(1)
    for step in steps:
        by_hand, by_hand_weights = step(by_hand, by_hand_weights, draws)
    torch.testing.assert_close(rule(u, w), aggregation.get("median")(by_hand, by_hand_weights))
    assert torch.equal(rule(u, w), rule(u, w))
    assert torch.equal(u, spread_stack())  # nothing written into the round's stack


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nmm", "pre_aggregators: unknown pre-aggregator 'nmm' (did you mean 'nnm'?)"),
        ({"nnm": {"g": 1}}, "pre_aggregators: nnm takes no option 'g'; it takes: f"),
        ({"clipping": 2.0}, "pre_aggregators: each entry is a name, an import path (pkg.module:name) or a function"),
        ({"clipping": {"max_norm": -1}}, "pre_aggregators: clipping's max_norm must be"),
        ({"bucketing": {"s": 0}}, "pre_aggregators: bucketing's s must be an integer >= 1"),
    ],
)
def test_a_bad_pre_aggregator_is_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError) as refused:
        pre_aggregator(spec)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_pre_aggregator_of_ones_own_gets_its_options_and_is_checked_in_one_line():
    from fedsim.core.errors import UserCodeError
    from fedsim.experiment.components import pre_aggregator as entry_of_a_run

    def pairs(updates, weights, generator, scale=1.0):
        """Each two neighbouring rows replaced by their mean, times ``scale``."""
        rows = scale * (updates[0::2] + updates[1::2]) / 2
        return rows, weights[0::2] + weights[1::2]

    u, w = spread_stack()[:10], torch.arange(10.0)
    rows, counts = entry_of_a_run({pairs: {"scale": 2.0}}, None, "pre_aggregators[0]")(u, w, torch.Generator())
    assert torch.equal(rows, u[0::2] + u[1::2]) and torch.equal(counts, w[0::2] + w[1::2])
    aggregation.equivariant(pairs)  # the mark carries over to the entry the run builds
    assert aggregation.is_equivariant(entry_of_a_run(pairs, None, "pre_aggregators[0]"))

    def broken(updates, weights, generator):
        return updates[:, :2], weights

    def raising(updates, weights, generator):
        raise ValueError("no")

    def nan(updates, weights, generator):  # would be blamed on the rule and the server's step
        return updates * float("nan"), weights

    label = f"pre_aggregators[1] ({__name__}:test_a_pre_aggregator_of_ones_own_gets_its_options_and_is_checked"
    for step, says in (
        (broken, "_in_one_line.<locals>.broken) returned (shape (10, 2) torch.float32 on cpu, shape (10,) "),
        (raising, "_in_one_line.<locals>.raising) failed on 10 updates of 60 values (ValueError: no)"),
        (nan, "_in_one_line.<locals>.nan) returned non-finite (NaN/Inf) rows from 10 finite updates of 60 values"),
    ):
        with pytest.raises(UserCodeError) as refused:
            entry_of_a_run(step, None, "pre_aggregators[1]")(u, w, torch.Generator())
        assert str(refused.value).startswith(label + says) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^pre_aggregators\[2\]: .*takes \(updates, weights\); a pre-agg"):
        entry_of_a_run(lambda updates, weights: (updates, weights), None, "pre_aggregators[2]")


def test_trimmed_mean_with_f_drops_exactly_f_at_each_end():
    u = spread_stack().double().numpy()
    got = aggregation.get("trimmed_mean", f=3)(torch.from_numpy(u), torch.ones(11)).numpy()
    expected = np.sort(u, axis=0)[3:8].mean(axis=0)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    with pytest.raises(ConfigError, match="set beta or f, not both"):
        aggregation.get("trimmed_mean", f=1, beta=0.1)
    with pytest.raises(ConfigError, match=r"f = 6 is too large for k = 11"):
        aggregation.get("trimmed_mean", f=6)(torch.from_numpy(u), torch.ones(11))


@needs_byzfl
@pytest.mark.parametrize("f", [1, 3])
def test_pre_aggregators_and_rules_match_byzfl(f):
    from byzfl.aggregators import GeometricMedian, TrMean
    from byzfl.aggregators.preaggregators import ARC, NNM, Clipping

    u = spread_stack()
    pairs = [
        ({"nnm": {"f": f}}, NNM(f=f)),
        ({"arc": {"f": f}}, ARC(f=f)),
        ({"clipping": {"max_norm": 2.0}}, Clipping(c=2.0)),
    ]
    for spec, theirs in pairs:
        ours, _ = pre_aggregator(spec)(u, torch.ones(11), torch.Generator())
        torch.testing.assert_close(ours, theirs(u.clone()), rtol=1e-5, atol=1e-6, msg=str(spec))
    torch.testing.assert_close(aggregation.get("trimmed_mean", f=f)(u, torch.ones(11)), TrMean(f=f)(u.clone()))
    # ByzFL's geometric median: smoothed Weiszfeld from 0, nu = 0.1, T = 3 iterations
    gm = aggregation.get("geometric_median", eps=0.1, max_iter=3, tol=0, init="zero")
    torch.testing.assert_close(gm(u, torch.ones(11)), GeometricMedian(nu=0.1, T=3)(u.clone()), rtol=1e-5, atol=1e-6)


def test_attack_count_sets_f_of_the_rules_and_pre_aggregators():
    from fedsim.experiment import components

    cfg = fedsim.load_config(
        {
            "data": {"dataset": "synthetic", "num_clients": 11},
            "clients_per_round": 11,
            "aggregator": "krum",
            "pre_aggregators": ["nnm", {"arc": {"f": 1}}],
            "attack": {"type": "ipm", "count": 2},
        }
    )
    rule, (nnm, arc) = components.server_rule(cfg)
    u, w, g = spread_stack(), torch.ones(11), torch.Generator()
    torch.testing.assert_close(rule(u, w), aggregation.get("krum", f=2)(u, w))
    torch.testing.assert_close(nnm(u, w, g)[0], pre_aggregator({"nnm": {"f": 2}})(u, w, g)[0])
    torch.testing.assert_close(arc(u, w, g)[0], pre_aggregator({"arc": {"f": 1}})(u, w, g)[0])  # set: kept


@pytest.mark.parametrize("k", [1, 2, 3, 11, 14, 17, 24, 25, 100, 128, 129])
def test_rows_are_sorted_as_torch_sorts_them(k):
    g = torch.Generator().manual_seed(k)
    values = torch.randint(-3, 4, (k, 500), generator=g).float()  # many ties
    values[0, :10] = -0.0
    assert torch.equal(aggregation.sorted_rows(values), values.sort(dim=0).values)


def test_the_sorting_network_sorts_every_column_of_zeros_and_ones():
    """The 0-1 principle (Knuth, TAOCP 5.3.4): a comparison network that sorts every sequence of 0s
    and 1s sorts every sequence. Every one of the 2^k columns, for each k up to 16."""
    for k in range(1, 17):
        columns = torch.arange(1 << k)
        bits = ((columns[None, :] >> torch.arange(k)[:, None]) & 1).float()
        assert torch.equal(aggregation.sorted_rows(bits), bits.sort(dim=0).values), k
    assert len(aggregation.sorting_network(14)) == 53  # where odd-even transposition takes 91


@pytest.fixture
def fresh_networks(monkeypatch):
    """No network compiled yet and no eager sorting counted in this process."""
    monkeypatch.setattr(aggregation, "_compiled", {})
    monkeypatch.setattr(aggregation, "_eager_seconds", collections.defaultdict(float))


@pytest.mark.slow
def test_a_compiled_network_gives_the_eager_networks_bits(fresh_networks, monkeypatch):
    """Past its budget of eager sorting, a process sorts by the compiled network: the same bits as
    the eager one, ties, signed zeros, infinities and NaN (which both spread) included."""
    g = torch.Generator().manual_seed(5)
    values = torch.randint(-3, 4, (5, 3 * aggregation._NETWORK_COLUMNS + 7), generator=g).float()
    values[:, :40] = 0.0
    values[::2, :40] = -0.0
    values[1, 50:60], values[2, 55:70], values[3, 65:80] = float("nan"), float("inf"), float("-inf")
    eager = aggregation.sorted_rows(values)
    assert aggregation._compiled == {}  # one short sort compiles nothing
    monkeypatch.setattr(aggregation, "_COMPILE_AFTER_S", 0.0)
    compiled = aggregation.sorted_rows(values)
    assert aggregation._compiled[5] is not None
    assert torch.equal(compiled.view(torch.int32), eager.view(torch.int32))
    narrower = aggregation.sorted_rows(values[:, 1:])  # another width, the same compiled network
    assert torch.equal(narrower.view(torch.int32), eager[:, 1:].contiguous().view(torch.int32))


@pytest.mark.parametrize("when", ["compile", "first call"])
def test_a_network_that_cannot_be_compiled_is_said_once_and_sorts_uncompiled(fresh_networks, monkeypatch, caplog, when):
    def no_compiler(function, **options):
        def fails(*args):
            raise RuntimeError("no C++ compiler\nthe rest of a long message")

        return fails() if when == "compile" else fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(aggregation, "_COMPILE_AFTER_S", 0.0)
    values = torch.randn(4, aggregation._NETWORK_COLUMNS)
    for _ in range(3):
        assert torch.equal(aggregation.sorted_rows(values), values.sort(dim=0).values)
    [record] = caplog.records
    assert record.getMessage() == (
        "the sorting network of 4 rows could not be compiled (RuntimeError: no C++ compiler); it runs uncompiled"
    )


def ref_dnc(u, f, iterations, b, c, seed):
    """Shejwalkar & Houmansadr's Algorithm 2 with an SVD of each subsample, the same draws."""
    g = torch.Generator().manual_seed(seed)
    k, p = u.shape
    good = set(range(k))
    for _ in range(iterations):
        sub = u[:, torch.randperm(p, generator=g)[:b]].double()
        centred = sub - sub.mean(0)
        top = torch.linalg.svd(centred, full_matrices=False).Vh[0]
        scores = (centred @ top) ** 2
        kept = set(sorted(range(k), key=lambda i: (float(scores[i]), i))[: k - round(c * f)])
        good = good & kept if good & kept else kept
    return sorted(good), u[sorted(good)].double().mean(0)


@pytest.mark.parametrize("iterations, b", [(1, 50), (5, 50), (3, 10_000)])
def test_dnc_keeps_the_updates_no_iteration_finds_far_along_the_top_singular_vector(iterations, b):
    g = torch.Generator().manual_seed(4)
    u = torch.randn(12, 300, generator=g)
    u[[3, 7, 10]] += 6.0 * torch.randn(300, generator=g)  # three updates pulled one way
    kept, expected = ref_dnc(u, 3, iterations, b, 1.0, seed=11)
    assert not {3, 7, 10} & set(kept)
    rule = aggregation.get("dnc", f=3, iterations=iterations, coordinates=b)
    got = rule(u, torch.ones(12), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- rules with a memory


def run_rounds(rule, stacks):
    """The rule over successive rounds, each reading the memory the last one left (as a run keeps it)."""
    memory, out = aggregation.Memory(rule.start_memory(stacks[0][0])), []
    for u in stacks:
        out.append(rule(u, torch.ones(len(u)), memory=memory))
        memory = aggregation.Memory(memory.new)
    return out, memory


def ref_centered_clipping(stacks, tau, iterations):
    """Karimireddy et al. 2021 in float64: v_{l+1} = v_l + mean_i (x_i - v_l) min(1, tau / ||x_i - v_l||),
    each round from the last round's result."""
    v, out = np.zeros(stacks[0].shape[1]), []
    for u in stacks:
        x = u.double().numpy()
        for _ in range(iterations):
            d = x - v
            norms = np.linalg.norm(d, axis=1)
            v = v + np.mean(d * np.minimum(1, tau / np.maximum(norms, 1e-300))[:, None], axis=0)
        out.append(v.copy())
    return out


@pytest.mark.parametrize("tau, iterations", [(100.0, 1), (0.5, 1), (0.5, 3)])
def test_centered_clipping_starts_each_round_from_the_last_aggregate(tau, iterations):
    g = torch.Generator().manual_seed(2)
    stacks = [torch.randn(9, 40, generator=g) + 0.3 * r for r in range(4)]
    stacks[2][:3] *= 50  # three far updates: clipped to tau around the centre
    got, _ = run_rounds(aggregation.get("centered_clipping", tau=tau, iterations=iterations), stacks)
    for ours, theirs in zip(got, ref_centered_clipping(stacks, tau, iterations)):
        # each coordinate: a convex combination of float32 values rounded k + 1 times per iteration
        np.testing.assert_allclose(ours.double().numpy(), theirs, rtol=0, atol=20 * iterations * U32 * 50 * 4)


@needs_byzfl
def test_centered_clipping_matches_byzfl_over_rounds():
    from byzfl.aggregators import CenteredClipping

    g = torch.Generator().manual_seed(5)
    stacks = [torch.randn(11, 30, generator=g) * (1 + r) for r in range(3)]
    theirs = CenteredClipping(tau=2.0, L=2)  # the instance starts each call from its last output
    got, _ = run_rounds(aggregation.get("centered_clipping", tau=2.0, iterations=2), stacks)
    for u, ours in zip(stacks, got):
        torch.testing.assert_close(ours, theirs(u.clone()), rtol=1e-5, atol=1e-5)


def ref_clipped_clustering(stacks, max_tau=1e5, linkage="average"):
    """Blades' Clippedclustering in float64, its clustering by SciPy's hierarchical linkage."""
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    from scipy.spatial.distance import squareform

    history, out = [], []
    for u in stacks:
        x = u.double().numpy()
        norms = np.linalg.norm(x, axis=1)
        history.extend(norms)
        bound = min(np.median(history), max_tau)
        x = x * np.where(norms > bound, bound / norms, 1.0)[:, None]
        unit = x / np.maximum(np.linalg.norm(x, axis=1), 1e-8)[:, None]
        distances = np.clip(1 - unit @ unit.T, 0, None)
        np.fill_diagonal(distances, 0)
        labels = hierarchy.fcluster(hierarchy.linkage(squareform(distances), linkage), 2, "maxclust")
        larger = 1 if (labels == 1).sum() > (labels == 2).sum() else 2
        out.append(x[labels == larger].mean(axis=0))
    return out


@pytest.mark.parametrize("linkage", ["average", "single"])
def test_clipped_clustering_matches_a_reference_over_rounds(linkage):
    g = torch.Generator().manual_seed(8)
    honest = torch.randn(40, generator=g)
    stacks = []
    for r in range(3):
        u = honest + 0.4 * torch.randn(11, 40, generator=g)
        u[[1, 4, 6, 9][: r + 2]] = -(3.0 + r) * honest + 0.1 * torch.randn(r + 2, 40, generator=g)  # flipped, longer
        stacks.append(u)
    got, memory = run_rounds(aggregation.get("clipped_clustering", linkage=linkage), stacks)
    for ours, theirs in zip(got, ref_clipped_clustering(stacks, linkage=linkage)):
        np.testing.assert_allclose(ours.double().numpy(), theirs, rtol=1e-5, atol=1e-5)
    assert memory.new["norms"].shape == (33,)  # every norm seen
    assert torch.nn.functional.cosine_similarity(got[-1], honest, dim=0) > 0.9


def test_clipped_clustering_clips_at_the_median_of_every_norm_seen_and_max_tau():
    u = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, -9.0]])
    rule = aggregation.get("clipped_clustering")
    # 4 norms {1, 2, 3, 9}: bound 2.5; the three along +x cluster together
    torch.testing.assert_close(rule(u, torch.ones(4)), torch.tensor([(1 + 2 + 2.5) / 3, 0.0]))
    memory = aggregation.Memory({"norms": torch.tensor([0.1] * 5, dtype=torch.float64)})
    # 9 norms, median 0.1: every update clipped to 0.1
    torch.testing.assert_close(rule(u, torch.ones(4), memory=memory), torch.tensor([0.1, 0.0]))
    capped = aggregation.get("clipped_clustering", max_tau=1.5)
    torch.testing.assert_close(capped(u, torch.ones(4)), torch.tensor([(1 + 1.5 + 1.5) / 3, 0.0]))


def test_two_equal_clusters_keep_the_one_holding_the_first_update():
    u = torch.tensor([[0.0, 1.0], [0.0, 1.1], [1.0, 0.0], [1.1, 0.0]])
    out = aggregation.get("clipped_clustering", max_tau=1.0)(u, torch.ones(4))
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0]))


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["centered_clipping", "clipped_clustering"])
def test_a_run_with_a_rule_that_remembers_resumes_exactly(tmp_path, rule):
    from support import BASE

    cfg = dict(
        BASE,
        workers=0,
        aggregator=rule,
        aggregator_options={"tau": 0.05} if rule == "centered_clipping" else {},
        attack={"type": "optimal_alie", "count": 1},  # its line search tries the rule: it must leave no memory
    )
    full = fedsim.run(cfg, out=tmp_path / "full", quiet=True, rounds=4)
    fedsim.run(cfg, out=tmp_path / "part", quiet=True, rounds=2)
    saved = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["aggregator"]
    assert set(saved) == ({"centre"} if rule == "centered_clipping" else {"norms"})
    if rule == "clipped_clustering":
        assert saved["norms"].shape == (2 * 5,)  # 4 clients and 1 Byzantine per round
    resumed = fedsim.resume(tmp_path / "part", quiet=True, rounds=4)
    assert (resumed.test_loss, resumed.test_accuracy) == (full.test_loss, full.test_accuracy)


@pytest.mark.slow
def test_a_rule_of_ones_own_with_a_memory_keeps_it_with_its_options_and_resumes_exactly(tmp_path):
    from support import BASE

    import fedsim.aggregation

    def momentum(updates, weights, beta=0.5, memory=None):
        """The mean, averaged with the last round's by an exponential moving average."""
        average = beta * memory.kept["average"] + (1 - beta) * updates.mean(dim=0)
        memory.new["average"] = average
        return average.clone()

    rule = fedsim.aggregation.remembering(momentum, lambda weights: {"average": torch.zeros_like(weights)})
    # called alone, outside a run, it starts from what it remembers before the first round
    torch.testing.assert_close(rule(torch.ones(2, 3), torch.ones(2), beta=0.75), torch.full((3,), 0.25))
    cfg = dict(BASE, workers=0, aggregator=rule, aggregator_options={"beta": 0.9})
    full = fedsim.run(cfg, out=tmp_path / "full", quiet=True, rounds=3)
    fedsim.run(cfg, out=tmp_path / "run", quiet=True, rounds=2)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["aggregator"]["average"]
    resumed = fedsim.resume(tmp_path / "run", quiet=True, rounds=3, aggregator=rule)
    assert (resumed.test_loss, resumed.test_accuracy) == (full.test_loss, full.test_accuracy)
    plain = fedsim.run(dict(cfg, aggregator="mean", aggregator_options={}), out=tmp_path / "mean", quiet=True, rounds=3)
    assert saved.abs().sum() > 0 and full.test_loss != plain.test_loss


# ----------------------------------------------------------------------------- rotations


EQUIVARIANT = {
    "fedavg",
    "mean",
    "norm_clip",
    "krum",
    "multi_krum",
    "geometric_median",
    "clipped_clustering",
    "clipping",
    "nnm",
    "bucketing",
    "arc",
}


def rotated(name):
    """What the rule or pre-aggregator ``name`` (default options) makes of a float64 stack turned
    by a random rotation Q, and of the stack itself: ``(f(X Q), f(X))``."""
    g = torch.Generator().manual_seed(5)
    updates = torch.randn(9, 12, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, 9)[:, None]
    weights = torch.randint(1, 50, (9,), generator=g).double()
    q, r = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    q = q * r.diagonal().sign()
    if name in aggregation.AGGREGATORS.names():
        step = aggregation.get(name)
        return step(updates @ q, weights) @ q.T, step(updates, weights), aggregation.is_equivariant(step)
    step = pre_aggregator(name)
    turned, _ = step(updates @ q, weights, torch.Generator().manual_seed(1))
    plain, _ = step(updates, weights, torch.Generator().manual_seed(1))
    return turned @ q.T, plain, aggregation.is_equivariant(step)


@pytest.mark.parametrize("name", sorted(EQUIVARIANT))
def test_the_rules_marked_equivariant_commute_with_a_rotation(name):
    """Turned back, what a marked rule makes of the turned stack is what it makes of the stack, up
    to float64 rounding of a few dozen operations on values of order 1 (the optimal attacks' line
    search relies on it: core.blocks.span_coordinates)."""
    turned, plain, marked = rotated(name)
    assert marked
    torch.testing.assert_close(turned, plain, rtol=0, atol=1e-12)


def test_exactly_the_rules_that_commute_with_rotations_are_marked():
    names = [*aggregation.AGGREGATORS.names(), *aggregation.PRE_AGGREGATORS.names()]
    assert {name for name in names if rotated(name)[2]} == EQUIVARIANT
    turned, plain, _ = rotated("median")  # coordinate-wise: another result, turned
    assert (turned - plain).abs().max() > 1e-3
    assert not aggregation.is_equivariant(aggregation.get("clipped_clustering", agg="median"))


def test_a_pipeline_is_equivariant_where_every_step_and_its_rule_are():
    steps = [pre_aggregator({"clipping": {"max_norm": 2.0}}), pre_aggregator("nnm")]
    assert aggregation.is_equivariant(pre_aggregated(steps, aggregation.get("geometric_median"), torch.Generator))
    assert not aggregation.is_equivariant(pre_aggregated(steps, aggregation.get("trimmed_mean"), torch.Generator))
    assert not aggregation.is_equivariant(pre_aggregated(steps, lambda u, w: u.mean(0), torch.Generator))


def test_a_pipeline_whose_first_steps_are_equivariant_expands_their_coordinates():
    """Clipping and bucketing run on the coordinates of the updates in their span, and the median,
    which is not equivariant, on the rows ``expand`` gives back: the median of the rows, to float32
    rounding of values below 1 (k = 9 terms: a few float32 epsilons). A first step that is not
    marked leaves the pipeline to run on the rows, as does one with no step."""

    def shifted(updates, weights, generator):  # not marked: adds a fixed vector
        return updates + 1.0, weights

    median = aggregation.get("median")
    steps = [pre_aggregator({"clipping": {"max_norm": 3.0}}), pre_aggregator({"bucketing": {"s": 2}})]
    pipeline = pre_aggregated(steps, median, lambda: torch.Generator().manual_seed(2))
    assert aggregation.is_expanding(pipeline) and not aggregation.is_equivariant(pipeline)
    assert not aggregation.is_expanding(pre_aggregated([shifted, *steps], median, torch.Generator))
    assert not aggregation.is_expanding(pre_aggregated([], median, torch.Generator))
    equivariant = pre_aggregated(steps, aggregation.get("geometric_median"), torch.Generator)
    assert not aggregation.is_expanding(equivariant)

    g = torch.Generator().manual_seed(6)
    updates = torch.randn(9, 500, generator=g) * torch.linspace(0.5, 2, 9)[:, None]
    weights = torch.ones(9)
    coordinates, basis = span_basis(updates)
    seen = []

    def expand(stack):
        seen.append(stack.shape)
        return stack.to(basis.dtype) @ basis

    expanded = pipeline(coordinates, weights, expand=expand)
    assert seen == [(5, 9)]  # after bucketing: 5 buckets, in coordinates
    torch.testing.assert_close(expanded, pipeline(updates, weights), rtol=0, atol=8 * 9 * torch.finfo().eps)


def test_a_rule_of_ones_own_marked_equivariant_stays_so_with_its_options():
    from fedsim.experiment.components import aggregator

    def clipped_mean(updates, weights, bound=1.0):
        return (updates * (bound / updates.norm(dim=1)).clamp(max=1.0)[:, None]).mean(dim=0)

    assert not aggregation.is_equivariant(aggregator(clipped_mean, {"bound": 0.5}))
    marked = aggregation.equivariant(clipped_mean)
    assert aggregation.is_equivariant(aggregator(marked, {"bound": 0.5}))
    assert aggregation.is_equivariant(aggregator(marked, {}))
