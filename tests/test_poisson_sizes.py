"""Poisson sampling's sample sizes (fedsim.fl.sampling): Binomial(N, q) each round, drawn ahead of
the rounds so that the buffers can hold the largest, and a function of (seed, round) alone."""

from __future__ import annotations

import math

import numpy as np

from fedsim.fl.sampling import POISSON_BLOCK, _poisson_sizes, draw, poisson_capacity, poisson_size

N, K = 50, 5
EVERYONE = np.arange(N)


def sampled(seed: int, rnd: int) -> np.ndarray:
    return draw("poisson", seed, rnd, EVERYONE, K, np.ones(N))


def test_sample_sizes_follow_the_binomial_law():
    """R rounds across a block boundary: the count of rounds of size j is Binomial(R, P(j)) with
    P(j) = C(N, j) q^j (1 - q)^(N - j), so six of its standard deviations bound it for every j; the
    mean size is k within six standard errors, and neighbouring rounds are uncorrelated within six
    standard errors of a correlation (1 / sqrt(R))."""
    q, rounds = K / N, 100_000
    sizes = np.array([poisson_size(11, rnd, N, K) for rnd in range(1, rounds + 1)])
    counts = np.bincount(sizes, minlength=N + 1)
    for j in range(N + 1):
        p = math.comb(N, j) * q**j * (1 - q) ** (N - j)
        assert abs(counts[j] - rounds * p) <= 6 * math.sqrt(rounds * p * (1 - p)) + 1e-9, j
    sd = math.sqrt(N * q * (1 - q))
    assert abs(sizes.mean() - K) <= 6 * sd / math.sqrt(rounds)
    assert abs(np.corrcoef(sizes[:-1], sizes[1:])[0, 1]) <= 6 / math.sqrt(rounds)


def test_the_round_samples_as_many_clients_as_its_size():
    """What draw() samples with everyone online is the round's size; rounds around the first
    block boundary included."""
    rounds = [*range(1, 200), *range(POISSON_BLOCK - 5, POISSON_BLOCK + 5)]
    for rnd in rounds:
        assert len(sampled(3, rnd)) == poisson_size(3, rnd, N, K)


def test_the_capacity_is_the_largest_sample_draw_makes():
    rounds = 3000
    largest = max(len(sampled(5, rnd)) for rnd in range(1, rounds + 1))
    assert poisson_capacity(5, rounds, N, K) == largest > K
    # at least k, even when no round samples that many
    assert poisson_capacity(5, 1, N, K) == max(K, len(sampled(5, 1)))
    assert poisson_capacity(5, 0, N, K) == K
    # a million rounds: returns, and is the largest of its rounds' sizes, so at least the above
    million = poisson_capacity(5, 10**6, N, K)
    assert largest <= million <= N


def test_a_rounds_size_does_not_depend_on_the_runs_length_or_what_was_read_before():
    """The prefix property: a run of R rounds and the same run resumed with more rounds sample
    their first R rounds alike. The capacity grows with the rounds as the running maximum of
    one sequence of sizes, in blocks read in any order."""
    rounds = [1, 2, 17, POISSON_BLOCK, POISSON_BLOCK + 1, 3 * POISSON_BLOCK + 9]
    first = {rnd: sampled(9, rnd) for rnd in rounds}
    _poisson_sizes.cache_clear()
    poisson_capacity(9, 10**6, N, K)  # a longer run's start reads every block of it
    for rnd in reversed(rounds):
        assert np.array_equal(sampled(9, rnd), first[rnd]), rnd
    ends = [1, 10, 1000, POISSON_BLOCK - 1, POISSON_BLOCK, POISSON_BLOCK + 1, 2 * POISSON_BLOCK + 3]
    _poisson_sizes.cache_clear()
    capacities = [poisson_capacity(9, end, N, K) for end in ends]
    assert capacities == sorted(capacities)
    sizes = np.array([poisson_size(9, rnd, N, K) for rnd in range(1, ends[-1] + 1)])
    assert capacities == [max(K, int(sizes[:end].max())) for end in ends]
    # another seed, another sequence
    assert [poisson_size(10, rnd, N, K) for rnd in range(1, 200)] != sizes[:199].tolist()


def test_a_round_reads_its_own_block_only():
    """A round's size costs one block's draw at most, however late the round: the start-up of a
    resumed run at round 10^6 does not draw the rounds before it."""
    _poisson_sizes.cache_clear()
    sampled(4, 10**6)
    assert _poisson_sizes.cache_info().misses == 1
    for rnd in range(10**6, 10**6 + 50):
        sampled(4, rnd)
    assert _poisson_sizes.cache_info().misses == 1
