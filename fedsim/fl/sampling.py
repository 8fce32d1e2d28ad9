"""Client sampling: who of a round's online clients is sampled (``client_sampling``). system.py
decides who is online and calls these; see its docstring for the round as a whole.

* ``uniform``          k clients without replacement, equally likely
* ``by_size``          k clients without replacement, drawn one after another with probability
                       proportional to their number of samples
* ``poisson``          every client independently with probability q = k / N (N = data.num_clients),
                       so k is the expected number; an offline client that is drawn does not train.
                       The sampling that DP-FedAvg's accounting assumes (McMahan et al. 2018), and
                       the one a run with ``privacy:`` must use. A round may sample more than k
                       clients: the round's buffers hold ``poisson_capacity`` clients, the largest
                       sample of the run's rounds, known before the first round because every
                       round's sample size is drawn in advance, from a stream of its own
* ``power_of_choice``  Cho, Wang & Joshi (2020), "Client selection in federated learning:
                       convergence analysis and power-of-choice selection strategies": d candidates
                       (``sampling_candidates``, d >= k) drawn without replacement proportional to
                       their number of samples, then the k of them with the highest local loss of
                       the current global model

Experiment file (top-level keys, shown with their defaults)::

    client_sampling: uniform      # uniform | by_size | poisson | power_of_choice
    sampling_candidates: null     # d, required by power_of_choice: clients_per_round <= d <= num_clients

Every draw of clients comes from the stream ``streams.SAMPLING`` of (seed, round), so the sample is the same in
every worker and rank and after a resume. A poisson round's sample size comes from the stream
``streams.POISSON_SIZES`` of (seed, block), which draws the sizes of ``POISSON_BLOCK`` rounds at once:
a round's size still depends on (seed, round) alone, not on the run's number of rounds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np

from ..core.checks import Checks
from ..core.errors import shown
from ..core.registry import Registry
from ..core.streams import POISSON_SIZES, SAMPLING, generator

SAMPLINGS = {
    "uniform": "k online clients, equally likely, without replacement (the default)",
    "by_size": "k online clients without replacement, each draw proportional to the number of samples",
    "poisson": "each client independently with probability clients_per_round / num_clients (DP-FedAvg's "
    "sampling; needed by privacy)",
    "power_of_choice": "of d candidates drawn by size, the k whose loss on the global model is highest "
    "(Cho et al. 2020; d is sampling_candidates)",
}
CLIENT_SAMPLINGS = Registry("client sampling")  # for `fedsim list`
for _name, _line in SAMPLINGS.items():
    CLIENT_SAMPLINGS.register(_name, _line)(_name)

_CHECKS = Checks()  # client_sampling and sampling_candidates are top-level keys


def check_sampling(
    client_sampling: str,
    sampling_candidates: int | None,
    clients_per_round: int | None = None,
    num_clients: int | None = None,
) -> int | None:
    """d (``sampling_candidates``) as an int, or None; a one-line ConfigError naming the key for a
    bad value. The bounds k <= d <= N are checked only when ``clients_per_round`` (k) and
    ``num_clients`` (N) are given."""
    if client_sampling not in tuple(SAMPLINGS):
        _CHECKS.fail("client_sampling", f"must be one of {', '.join(SAMPLINGS)}, got {shown(client_sampling)}")
    d = _CHECKS.count("sampling_candidates", sampling_candidates, 1, optional=True)
    if d is None:
        if client_sampling == "power_of_choice":
            _CHECKS.fail(
                "sampling_candidates",
                "client_sampling power_of_choice needs d, the number of candidates "
                "(clients_per_round <= d <= data.num_clients)",
            )
        return None
    if clients_per_round is not None and d < clients_per_round:
        _CHECKS.fail(
            "sampling_candidates",
            f"must be >= clients_per_round ({clients_per_round}): the round keeps k of its d candidates, got {d}",
        )
    if num_clients is not None and d > num_clients:
        _CHECKS.fail("sampling_candidates", f"must be <= data.num_clients ({num_clients}), got {d}")
    return d


def draw(sampling: str, seed: int, rnd: int, online: np.ndarray, want: int, sizes: np.ndarray) -> np.ndarray:
    """``want`` of the ``online`` clients (sorted ids), or all of them without a draw when at most
    ``want`` are online: equally likely for ``uniform``, else each draw proportional to ``sizes``
    (every client's number of samples, float64). ``poisson``: each online client independently
    with probability ``want / len(sizes)``."""
    if sampling == "poisson":
        count = poisson_size(seed, rnd, len(sizes), want)
        drawn = generator(SAMPLING, seed, rnd).choice(len(sizes), size=count, replace=False)
        return np.intersect1d(drawn, online)  # sorted; the same law as a coin per online client
    if len(online) <= want:
        return online.copy()  # the caller's may be kept from round to round (System.online_ids)
    rng = generator(SAMPLING, seed, rnd)
    if sampling == "uniform":
        return np.sort(online[rng.choice(len(online), size=want, replace=False)])
    weights = sizes[online]
    if not weights.min() > 0:
        raise ValueError(f"{sampling}: every client needs a positive size, got {weights.min():g}")
    return np.sort(rng.choice(online, size=want, replace=False, p=weights / weights.sum()))


def poisson_capacity(seed: int, rounds: int, num_clients: int, k: int) -> int:
    """The most clients that any of rounds 1..``rounds`` samples under ``poisson`` (at least ``k``):
    the round's buffers are sized to it, so that no round's sample is ever cut short, which would
    change the sampling the privacy accounting assumes. One vectorised draw per ``POISSON_BLOCK``
    rounds, so a million rounds take about a tenth of a second."""
    largest = k
    for block in range((rounds + POISSON_BLOCK - 1) // POISSON_BLOCK):
        sizes = _poisson_sizes(seed, block, num_clients, k)[: rounds - block * POISSON_BLOCK]
        largest = max(largest, int(sizes.max()))
    return largest


def poisson_size(seed: int, rnd: int, num_clients: int, k: int) -> int:
    """How many clients round ``rnd`` samples under ``poisson``: Binomial(N, k / N)."""
    block, at = divmod(rnd - 1, POISSON_BLOCK)
    return int(_poisson_sizes(seed, block, num_clients, k)[at])


POISSON_BLOCK = 2**16  # rounds whose sample sizes are drawn together (512 KiB of sizes)


@functools.lru_cache(maxsize=4)
def _poisson_sizes(seed: int, block: int, num_clients: int, k: int) -> np.ndarray:
    """The sample sizes of rounds ``block`` x B + 1 .. (``block`` + 1) x B (B = ``POISSON_BLOCK``),
    each Binomial(N, k / N), from the stream ``POISSON_SIZES`` of (seed, block). A coin for every
    client is the same law as this size followed by that many clients drawn without replacement,
    which the round's own stream then chooses. Drawn apart from the clients, a block at a time, the
    sizes of a whole run are cheap to know before its first round, and each round's is a function
    of (seed, round) alone, whatever the run's number of rounds: a resumed run with more rounds
    samples its earlier ones as before. Cached, as every round reads its own size."""
    sizes = generator(POISSON_SIZES, seed, block).binomial(num_clients, k / num_clients, size=POISSON_BLOCK)
    sizes.setflags(write=False)
    return sizes


def choose(
    candidates: np.ndarray, k: int, losses: Mapping[int, float] | Sequence[float] | np.ndarray | None
) -> np.ndarray:
    """Power of choice: the k candidates of highest loss, sorted. ``losses``: ``{client: loss}`` or a
    sequence aligned with ``candidates``; a NaN loss counts as the highest, ties go to the lower id."""
    if len(candidates) <= k:
        return candidates
    if losses is None:
        raise ValueError(
            f"power_of_choice: round() needs the losses of the {len(candidates)} candidates "
            f"(System.candidates) to keep {k}"
        )
    if isinstance(losses, Mapping):
        missing = [int(c) for c in candidates if int(c) not in losses]
        if missing:
            raise ValueError(f"power_of_choice: no loss for candidate client {missing[0]}")
        values = np.array([float(losses[int(c)]) for c in candidates])
    else:
        values = np.array([float(v) for v in losses], dtype=np.float64)
        if len(values) != len(candidates):
            raise ValueError(f"power_of_choice: {len(values)} losses for {len(candidates)} candidates")
    values = np.where(np.isnan(values), np.inf, values)
    order = np.lexsort((candidates, -values))  # highest loss first, then the lower id
    return np.sort(candidates[order[:k]])
