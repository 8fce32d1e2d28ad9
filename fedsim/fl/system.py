"""Simulated system heterogeneity: which clients are online, which are sampled, which fail and which
are late, in FLGo's vocabulary (Wang et al., FLGo's ``flgo.simulator``):

* availability    a client is online in a round with its probability; only online clients can be
                  sampled (if fewer than ``clients_per_round`` are online, the round takes them all)
* connectivity    a sampled client drops out before reporting with probability ``dropout``: its
                  work is lost
* responsiveness  a client's local work takes ``steps x step_seconds / speed`` simulated seconds,
                  ``steps`` summed over the algorithm's phases (``Algorithm.phase_epochs``: Ditto's
                  two models, FedRep's head then body), each at most its cap (``phase_steps``:
                  local.steps, or a phase's own); past the round's ``deadline`` it is a straggler
* completeness    stragglers are dropped (``stragglers: drop``), or report the steps they finished
                  in time (``stragglers: partial``): floor(deadline x speed / step_seconds) of them,
                  one budget spent on the phases in the order they run; one whose budget ends
                  before its last phase (whose weights it sends) is dropped, as one with no step

Who is sampled among the online clients (``client_sampling``: uniform, by_size, power_of_choice)
is sampling.py's.

Its ``system:`` section and its checks are system_config.py's.

Randomness. Every draw comes from a stream keyed by what it is for (see ``streams.py``), never by a
process's history, so a plan is the same in every worker and rank and after a resume:

* the sample:        ``SAMPLING`` of (seed, round);
* online:            ``ONLINE`` of (seed, round): client c is online iff the c-th uniform
                     number of that stream is below its availability probability;
* dropout:           ``DROPOUT`` of (seed, round): client c drops out iff the c-th uniform
                     number is below ``dropout``;
* per-client constants, drawn once: availability probabilities ``AVAILABILITY`` of (seed)
  and speeds ``SPEED`` of (seed), client c taking the c-th value.

"The c-th number of a stream" depends only on the stream's keys and c (a stream's first c numbers do
not depend on how many more are drawn), so client c's draws are a function of (seed, round, c) alone:
not of the number of clients, the sample size, the workers, the other settings, or which rounds ran
before. Numbers are compared with a probability (``u < p``), so raising a probability only adds
clients: two experiments that differ in ``dropout`` lose the same clients and then some.

Use on the server, once per round::

    system = System.from_config(cfg)                     # once; System.check_config(cfg) validates
    if system.needs_losses:                              # power_of_choice: two steps
        candidates = system.candidates(seed, rnd, N, k, sizes)
        losses = {c: loss of the global model on client c's data for c in candidates}
    plan = system.round(seed, rnd, N, k, sizes, losses)  # before training
    train plan.clients, client plan.clients[i] for at most plan.step_limits[i] steps in all its phases (None: all)
    row.update(plan.metrics(left_out=non-finite updates left out))   # after training

The module is pure: it keeps no state between calls except a cache of the per-client constants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms import ALGORITHMS, Algorithm
from ..core.registry import is_import_path, load_attr
from ..core.streams import AVAILABILITY, DROPOUT, ONLINE, SPEED, generator
from .sampling import choose, draw
from .system_config import SPEED_RANGE, SystemConfig, parse_system

# A step that ends within a billionth (relative) of the deadline counts as in time: 3 s / 0.1 s is
# 30 steps, although 3 / 0.1 is 29.999999999999996 in floating point.
_IN_TIME = 1e-9


# ----------------------------------------------------------------------------- helpers


def local_steps(sizes: Sequence[int] | np.ndarray, epochs: int, batch_size: int) -> np.ndarray:
    """Each client's local SGD steps in one round when it does all its work: ``epochs x
    ceil(n_i / batch_size)`` (the last batch of an epoch may be short), as int64."""
    n = np.asarray(sizes, dtype=np.int64)
    return int(epochs) * ((n + int(batch_size) - 1) // int(batch_size))


def _ids(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _phases(cfg: Any) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """The epochs and the most steps of each local phase of ``cfg``'s algorithm
    (``Algorithm.phase_epochs``, ``Algorithm.phase_steps``): the instance given, or the class
    registered or named by import path, built with its options."""
    spec, options = getattr(cfg, "algorithm", "fedavg"), dict(getattr(cfg, "algorithm_options", None) or {})
    if isinstance(spec, str):
        spec = load_attr("algorithm", spec) if is_import_path(spec) else ALGORITHMS.get(spec)
    algorithm = spec(**options) if isinstance(spec, type) else spec
    steps = getattr(cfg.local, "steps", None)
    if not isinstance(algorithm, Algorithm):
        return (int(cfg.local.epochs),), (steps,)
    return algorithm.phase_epochs(cfg.local.epochs), algorithm.phase_steps(steps)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class RoundPlan:
    """What the system does to one round. Id arrays are sorted int64 numpy arrays."""

    round: int
    unavailable: int  # clients of the whole federation offline this round
    candidates: np.ndarray  # power_of_choice: the candidates the sample was chosen from; else the sample
    sampled: np.ndarray  # the sample: k online clients, or every online one when fewer are online
    clients: np.ndarray  # the sampled clients whose work reaches the server: train these
    step_limits: tuple  # aligned with clients: None = all its local steps, an int = a partial straggler's
    dropouts: np.ndarray  # sampled clients that failed before reporting (their work is lost)
    stragglers: np.ndarray  # sampled clients, other than dropouts, whose full work ends past the deadline
    dropped: np.ndarray  # sampled clients whose work is lost: dropouts, stragglers under drop, and
    #                      partial stragglers that finished no step
    steps: np.ndarray  # aligned with sampled: the local steps of the client's full work
    seconds: np.ndarray  # aligned with sampled: the simulated seconds of its full work
    simulated_seconds: float  # the round's simulated duration (see System.round)

    def step_limit(self, client: int) -> int | None:
        """The steps ``client`` may take (None: all); KeyError if it does not report."""
        where = np.searchsorted(self.clients, client)
        if where == len(self.clients) or self.clients[where] != client:
            raise KeyError(f"client {client} does not report in round {self.round}")
        return self.step_limits[where]

    def outcome(self, client: int) -> str:
        """``full``, ``partial``, ``dropout`` or ``straggler`` (dropped: too late, or no step in time)
        for a sampled client; KeyError for one that was not sampled."""
        if client not in set(self.sampled.tolist()):
            raise KeyError(f"client {client} was not sampled in round {self.round}")
        if client in set(self.dropouts.tolist()):
            return "dropout"
        if client in set(self.dropped.tolist()):
            return "straggler"
        return "full" if self.step_limit(client) is None else "partial"

    def metrics(self, left_out: int = 0) -> dict:
        """The round's columns for metrics.csv. ``left_out``: reporting clients the engine left out
        afterwards (non-finite updates), added to ``dropped_clients``."""
        return {
            "unavailable": self.unavailable,
            "dropped_clients": len(self.dropped) + int(left_out),
            "stragglers": len(self.stragglers),
            "simulated_seconds": self.simulated_seconds,
        }


# ----------------------------------------------------------------------------- the system


class System:
    """The federation's system behaviour, built from the config (see the module's docstring).

    ``section``: the ``system:`` section (a mapping, a SystemConfig or None); bad values raise a
    one-line ConfigError that starts with the key (``system.availability: ...``)."""

    def __init__(
        self,
        section: Mapping[str, Any] | SystemConfig | None = None,
        *,
        client_sampling: str = "uniform",
        sampling_candidates: int | None = None,
        epochs: int = 1,
        batch_size: int = 64,
        phases: Sequence[int] | None = None,
        max_steps: int | None = None,
        phase_steps: Sequence[int | None] | None = None,
    ):
        self.spec = parse_system(section, client_sampling, sampling_candidates)
        self.max_steps = max_steps  # local.steps: the most steps a client takes in a round; None: its epochs
        if int(epochs) < 1 or int(batch_size) < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
        self.epochs, self.batch_size = int(epochs), int(batch_size)
        # the epochs of each local training phase, in order (Algorithm.phase_epochs)
        self.phases = (self.epochs,) if phases is None else tuple(int(e) for e in phases)
        if not self.phases or min(self.phases) < 1:
            raise ValueError(f"phases must be epochs >= 1, one per phase, got {phases}")
        # the most steps of each phase (Algorithm.phase_steps); by default local.steps caps each
        self.caps = (max_steps,) * len(self.phases) if phase_steps is None else tuple(phase_steps)
        if len(self.caps) != len(self.phases):
            raise ValueError(f"phase_steps must hold one cap per phase, got {phase_steps} for {len(self.phases)}")
        self._cache: tuple = (None, None, None)
        self._everyone = np.arange(0)  # every client's id, kept for rounds where all are online

    @classmethod
    def from_config(cls, cfg: Any) -> System:
        """From a Config: ``cfg.system``, ``cfg.client_sampling``, ``cfg.sampling_candidates`` (each
        optional) and ``cfg.local.epochs``, ``cfg.local.batch_size``, ``cfg.local.steps``."""
        phases, caps = _phases(cfg)
        return cls(
            getattr(cfg, "system", None),
            client_sampling=getattr(cfg, "client_sampling", "uniform"),
            sampling_candidates=getattr(cfg, "sampling_candidates", None),
            epochs=cfg.local.epochs,
            batch_size=cfg.local.batch_size,
            phases=phases,
            max_steps=getattr(cfg.local, "steps", None),
            phase_steps=caps,
        )

    @staticmethod
    def check(
        section: Mapping[str, Any] | SystemConfig | None = None,
        *,
        client_sampling: str = "uniform",
        sampling_candidates: int | None = None,
        clients_per_round: int | None = None,
        num_clients: int | None = None,
    ) -> None:
        """Refuse bad values: a ConfigError of one line, ``key: what is allowed, got what``. With
        ``clients_per_round`` and ``num_clients`` it also checks the bounds of sampling_candidates."""
        parse_system(section, client_sampling, sampling_candidates, clients_per_round, num_clients)

    @staticmethod
    def check_config(cfg: Any) -> None:
        """``check`` on a Config (for ``config.validate``)."""
        System.check(
            getattr(cfg, "system", None),
            client_sampling=getattr(cfg, "client_sampling", "uniform"),
            sampling_candidates=getattr(cfg, "sampling_candidates", None),
            clients_per_round=cfg.clients_per_round,
            num_clients=cfg.data.num_clients,
        )

    @property
    def needs_losses(self) -> bool:
        """Whether ``round`` needs the candidates' losses (power_of_choice)."""
        return self.spec.sampling == "power_of_choice"

    # ----------------------------------------------------------------- per-client constants

    def local_steps(self, sizes: Sequence[int] | np.ndarray, phases: int | None = None) -> np.ndarray:
        """Each client's full work: the steps of its first ``phases`` phases (None: all), each
        ``local_steps(sizes, epochs, batch_size)`` of its epochs, at most its cap (one phase of
        local.epochs at most local.steps for most algorithms)."""
        steps = np.zeros(len(sizes), dtype=np.int64)
        for epochs, cap in list(zip(self.phases, self.caps))[:phases]:
            phase = local_steps(sizes, epochs, self.batch_size)
            steps += phase if cap is None else np.minimum(phase, cap)
        return steps

    def _constants(self, seed: int, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache[0] != (seed, num_clients):
            self._cache = (
                (seed, num_clients),
                self._availabilities(seed, num_clients),
                self._speeds(seed, num_clients),
            )
        return self._cache[1], self._cache[2]

    def _availabilities(self, seed: int, n: int) -> np.ndarray:
        kind, *params = self.spec.availability
        if kind == "constant":
            return np.full(n, params[0])
        rng = generator(AVAILABILITY, seed)
        if kind == "uniform":
            return rng.uniform(params[0], params[1], size=n)
        return rng.beta(params[0], params[1], size=n)

    def _speeds(self, seed: int, n: int) -> np.ndarray:
        kind, *params = self.spec.speed
        if kind == "constant":
            return np.ones(n)
        rng = generator(SPEED, seed)
        if kind == "lognormal":  # median exp(0) = 1; the far tails held where the clock stays finite
            return np.clip(np.exp(params[0] * rng.standard_normal(n)), *SPEED_RANGE)
        return rng.uniform(params[0], params[1], size=n)

    def availabilities(self, seed: int, num_clients: int) -> np.ndarray:
        """Each client's probability of being online in a round (drawn once per client)."""
        return self._constants(seed, num_clients)[0].copy()

    def speeds(self, seed: int, num_clients: int) -> np.ndarray:
        """Each client's relative compute speed (drawn once per client)."""
        return self._constants(seed, num_clients)[1].copy()

    # ----------------------------------------------------------------- per round

    def online(self, seed: int, rnd: int, num_clients: int) -> np.ndarray:
        """Boolean mask of the clients online in round ``rnd``."""
        kind, *params = self.spec.availability
        if kind == "constant" and params[0] == 1:
            return np.ones(num_clients, dtype=bool)  # no draw: every client, as without a system
        p = self._constants(seed, num_clients)[0]
        return generator(ONLINE, seed, rnd).random(num_clients) < p

    def online_ids(self, seed: int, rnd: int, num_clients: int) -> np.ndarray:
        """The ids of the clients online in round ``rnd``, ascending: every client's, made once
        and kept, where all are always online (a round then costs nothing per client)."""
        kind, *params = self.spec.availability
        if kind != "constant" or params[0] != 1:
            return np.flatnonzero(self.online(seed, rnd, num_clients))
        if len(self._everyone) != num_clients:
            self._everyone = np.arange(num_clients)
        return self._everyone

    def candidates(
        self, seed: int, rnd: int, num_clients: int, k: int, sizes: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """The clients the round chooses among (sorted): for power_of_choice the d candidates
        (every online client when at most d are online), whose losses ``round`` then needs; for
        the other samplings the sample itself."""
        self._arguments(num_clients, k, sizes)
        return self._draw(seed, rnd, self.online_ids(seed, rnd, num_clients), k, sizes)

    def _draw(self, seed: int, rnd: int, online: np.ndarray, k: int, sizes: Sequence[int] | np.ndarray) -> np.ndarray:
        s = self.spec
        if s.sampling not in ("uniform", "poisson"):  # weighted by size: the only ones that read the sizes
            sizes = np.asarray(sizes, dtype=np.float64)
        return draw(s.sampling, seed, rnd, online, s.candidates if s.sampling == "power_of_choice" else k, sizes)

    def round(
        self,
        seed: int,
        rnd: int,
        num_clients: int,
        k: int,
        sizes: Sequence[int] | np.ndarray,
        losses: Mapping[int, float] | Sequence[float] | np.ndarray | None = None,
    ) -> RoundPlan:
        """The plan of round ``rnd``: who is sampled, who reports, with how many steps.

        ``sizes``: every client's number of training samples ([num_clients]). ``losses``
        (power_of_choice only): the current global model's loss on each candidate, a mapping
        ``{client: loss}`` or a sequence aligned with ``candidates(...)``; a NaN loss counts as
        the highest, ties go to the lower client id. It may be None when there are no more
        candidates than k (nothing to choose).

        ``simulated_seconds``: the slowest reporting client's simulated time, at most the
        deadline; the deadline itself when the round has a straggler (the server waited for it);
        0.0 when nobody reports and nobody straggles. Dropouts do not count."""
        s = self.spec
        self._arguments(num_clients, k, sizes)
        online = self.online_ids(seed, rnd, num_clients)
        candidates = self._draw(seed, rnd, online, k, sizes)
        sampled = choose(candidates, k, losses) if s.sampling == "power_of_choice" else candidates
        # connectivity: who fails before reporting
        if s.dropout > 0 and len(sampled):
            u = generator(DROPOUT, seed, rnd).random(int(sampled[-1]) + 1)  # c-th number: client c
            out = u[sampled] < s.dropout
        else:
            out = np.zeros(len(sampled), dtype=bool)
        # responsiveness and completeness: who is late, and what it finished in time
        steps = self.local_steps(np.asarray(sizes, dtype=np.int64)[sampled])
        speed = self._constants(seed, num_clients)[1][sampled]
        seconds = steps * s.step_seconds / speed
        budget = self._budget(speed)
        late = ~out & (steps > budget) if budget is not None else np.zeros(len(sampled), dtype=bool)
        lost = out | (late & self._nothing_sent(budget, np.asarray(sizes, dtype=np.int64)[sampled]))
        reports = ~lost
        # a late client stops at its budget; under a step cap every client at its work, capped
        capped = [int(n) if any(c is not None for c in self.caps) else None for n in steps]
        limits = tuple(int(budget[i]) if late[i] else capped[i] for i in np.flatnonzero(reports))
        simulated = self._waited(late, seconds[reports])
        return RoundPlan(
            round=int(rnd),
            unavailable=int(num_clients - len(online)),
            candidates=_ids(candidates),
            sampled=_ids(sampled),
            clients=_ids(sampled[reports]),
            step_limits=limits,
            dropouts=_ids(sampled[out]),
            stragglers=_ids(sampled[late]),
            dropped=_ids(sampled[lost]),
            steps=steps,
            seconds=seconds,
            simulated_seconds=simulated,
        )

    def _budget(self, speed: np.ndarray) -> np.ndarray | None:
        """The steps each client finishes by the deadline at its ``speed``; None without a deadline."""
        s = self.spec
        if s.deadline is None:
            return None
        capacity = np.minimum(s.deadline * speed / s.step_seconds * (1 + _IN_TIME), 2.0**62)
        return np.floor(capacity).astype(np.int64)

    def _nothing_sent(self, budget: np.ndarray | None, sizes: np.ndarray) -> np.ndarray | bool:
        """Whether a late client of ``sizes`` samples sends nothing: always when stragglers are
        dropped; when partial, if its ``budget`` of steps ends before its last phase starts (what it
        sends is that phase's weights; with one phase, a budget of no step)."""
        if self.spec.stragglers != "partial" or budget is None:
            return True
        return budget <= self.local_steps(sizes, len(self.phases) - 1)

    def _waited(self, late: np.ndarray, reporting_seconds: np.ndarray) -> float:
        """The round's simulated seconds: the deadline when someone is late, else the slowest
        reporting client's time (at most the deadline), 0.0 when nobody reports."""
        deadline = self.spec.deadline
        if late.any():
            return float(deadline)
        if not len(reporting_seconds):
            return 0.0
        slowest = float(reporting_seconds.max())
        return slowest if deadline is None else min(slowest, float(deadline))

    @staticmethod
    def _arguments(num_clients: int, k: int, sizes) -> None:
        if not 1 <= k <= num_clients:
            raise ValueError(f"k must be in [1, num_clients={num_clients}], got {k}")
        if len(sizes) != num_clients:
            raise ValueError(f"sizes holds {len(sizes)} clients, num_clients is {num_clients}")
