"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018, "Learning
differentially private recurrent language models").

Each round the server clips every client update (a row of the ``[k, P]`` stack) to L2 norm at
most ``clip`` (C), sums the clipped rows, adds Gaussian noise N(0, (z C)^2 I) to the sum
(z = ``noise_multiplier``) and divides by ``clients_per_round`` (K), the fixed expected number
of clients, not by the number that reported: adding or removing one client then moves the
result by at most C / K whatever the others did or whether some dropped, which is the
sensitivity the Gaussian mechanism's analysis needs. Sample counts are not used: a weight
proportional to a client's data would let one client's share, hence its influence, grow beyond
C / K. The guarantee is client-level: it covers everything one client contributes in a round,
the whole row, batch-norm statistics included (see ``check_model``).

Which rules and algorithms keep the guarantee (``Privacy.check``):

- aggregator ``fedavg`` or ``mean``: under privacy both become the unweighted mean of the clipped
  updates above. Every other rule (median, trimmed_mean, krum, multi_krum, geometric_median,
  norm_clip, a rule of one's own) is refused: its output is not a sum of per-client
  contributions each bounded by C, so the Gaussian mechanism's sensitivity bound does not hold.
- an algorithm that keeps no server or client state, has its clients report nothing and uses
  the base ``server_update`` (fedavg, fedprox, or one of one's own that only changes local
  training). SCAFFOLD, FedNova and FedDyn are refused: their state or reports are computed from
  the clients' un-noised data and would leak it (FedNova's reported steps also change each
  client's weight).
- any server optimizer: it only post-processes the noised aggregate, and post-processing keeps
  a differential-privacy guarantee.
- client_sampling ``uniform`` with every client always online (system.availability 1): the
  accountant's rate q = K / N is then every client's chance to be sampled in a round. by_size and
  power_of_choice make some clients likelier (power_of_choice also ranks clients by their loss on
  their own data, un-noised), and so does an availability below 1 for the clients online more
  often: refused. Clients that drop out or straggle only remove contributions.
- attacks: an attacker's update is rewritten before the server clips it, so it is clipped and
  noised like any other, and moves the aggregate by at most C / K too.

The engine builds one Privacy per run (``from_config``), refuses a model with buffers once it is
built (``check_model``), lets ``rule(seed, rnd)`` stand in for the run's aggregation rule in every
round's ``Round``, and writes ``epsilon(rnd)`` in the ``epsilon`` column of every round's row.

Accounting. ``epsilon(rounds)`` is the epsilon at ``delta`` after ``rounds`` rounds, from Opacus's
RDP accountant (the sampled Gaussian mechanism, Mironov, Talwar and Zhang 2019) stepped once per
round with noise multiplier z and sampling rate q = K / N. That analysis assumes Poisson
sampling (each client joins a round independently with probability q); fedsim samples exactly
K of the N clients without replacement, for which it is not a proven bound, only the customary
approximation: Flower's and TF-Privacy's DP-FedAvg report the same number under the same
assumption. The noise is torch's floating-point Gaussian, as in Opacus; floating-point attacks
on noise samplers (Mironov 2012) are outside this simulation's model. Non-finite updates that
the engine drops, and clients that fail, only remove contributions, which the analysis allows.
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from typing import Callable

import torch

from . import components
from .aggregation import AGGREGATORS, float64_blocks, row_norms
from .algorithms import Algorithm
from .checks import FLOAT32, Checks, is_integer, is_number
from .errors import ConfigError
from .registry import is_import_path
from .streams import privacy_noise_generator

RULES = ("fedavg", "mean")  # the rules that privacy's clipped, noised mean replaces
KEYS = ("clip", "noise_multiplier", "delta")
INSTALL = 'pip install "fedsim-sync[privacy]"'

# Clipping aims at C (1 - 2^-30), not C: in float64 the scale, the products and the norm each
# round by a few units in the last place, and the norm of a clipped row must not come out above
# C. 2^-30 (~1e-9) exceeds those errors (~P 2^-53 even for a naive sum over P = 1e7 values) and is
# far below anything that changes training; the noise stays calibrated to C itself.
_MARGIN = 1 - 2.0**-30
_CHECKS = Checks("privacy")
_TOP = Checks()  # the run's clients_per_round and data.num_clients

Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Privacy:
    """DP-FedAvg with clip C, noise multiplier z and target delta, for a federation of
    ``num_clients`` (N) of which ``clients_per_round`` (K) are sampled each round.

    Call ``aggregate`` (or the rule ``rule(seed, rnd)`` gives) once per round on the server, and
    ``epsilon(rnd)`` after round ``rnd`` for the privacy spent so far. Nothing is kept between
    rounds: the noise is a function of (seed, round) and epsilon of the number of rounds, so a
    resumed run reports the same as an uninterrupted one without a checkpointed accountant.
    """

    def __init__(self, clip, noise_multiplier, delta, clients_per_round: int, num_clients: int):
        self.clip = _CHECKS.positive("clip", clip)  # float32's normal range: a clip of 1e-45 would zero every update
        if not is_number(noise_multiplier) or not 0 <= noise_multiplier <= FLOAT32.max:
            # bounded as config floats are: z C then stays finite in float64
            _CHECKS.fail("noise_multiplier", f"must be a number in [0, {FLOAT32.max:.3g}], got {noise_multiplier!r}")
        if not is_number(delta) or not 0 < delta < 1:
            _CHECKS.fail("delta", f"must be a number in (0, 1), got {delta!r}")
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.num_clients = _TOP.count("data.num_clients", num_clients, 1)
        self.clients_per_round = _TOP.count("clients_per_round", clients_per_round, 1)
        if self.clients_per_round > self.num_clients:
            _TOP.fail("clients_per_round", f"must be <= data.num_clients ({num_clients}), got {clients_per_round}")
        self.sample_rate = self.clients_per_round / self.num_clients  # q
        self._accountant, self._steps = None, 0  # Opacus's, stepped _steps times (see epsilon)

    # ----------------------------------------------------------------- from a config

    @classmethod
    def from_config(cls, cfg) -> "Privacy | None":
        """The run's Privacy, or None without a ``privacy`` section (absent or null). The section
        is a mapping or an object with the attributes ``clip``, ``noise_multiplier``, ``delta``.
        Validates it and its combination with the run's aggregator and algorithm (see ``check``)."""
        section = getattr(cfg, "privacy", None)
        if section is None:
            return None
        values = _section(section)
        for key in KEYS:
            if values.get(key) is None:
                _CHECKS.fail(key, "is required when privacy is on")
        privacy = cls(values["clip"], values["noise_multiplier"], values["delta"],
                      cfg.clients_per_round, cfg.data.num_clients)
        _check_aggregator(cfg.aggregator)
        _check_algorithm(cfg)
        _check_sampling(cfg)
        if importlib.util.find_spec("opacus") is None:  # found now, imported (seconds) only when accounting
            raise ConfigError(f"privacy: its accounting needs the opacus package: {INSTALL}")
        return privacy

    @classmethod
    def check(cls, cfg) -> None:
        """Raise a one-line ConfigError, naming the key, if the ``privacy`` section is invalid or
        cannot be combined with the run's aggregator or algorithm; nothing without the section."""
        cls.from_config(cfg)

    @staticmethod
    def check_model(model: str, num_params: int, length: int) -> None:
        """Refuse a model with floating-point buffers (``length`` > ``num_params`` values in its
        flat vector), once the model is built: batch-norm running statistics are computed from
        client data, so they would need the noise too, and noise can make a running variance
        negative. Opacus refuses BatchNorm for the same reason; fedsim's models use GroupNorm."""
        if length > num_params:
            raise ConfigError(f"privacy: model {model} has {length - num_params:,} buffer values (batch-norm "
                              f"running statistics, say) computed from client data, which DP-FedAvg cannot release; "
                              f"use a model without buffers (GroupNorm instead of BatchNorm)")

    # ----------------------------------------------------------------- one round

    def scales(self, updates: torch.Tensor) -> torch.Tensor:
        """The ``[k]`` float64 factors that clip the rows: 1 for a row within the bound (a zero
        row too), else the bound over its norm. Norms are float64 (``row_norms``): finite for
        any finite float32 row, where a float32 sum of squares overflows past 1.8e19."""
        norms = row_norms(updates)
        bound = self.clip * _MARGIN
        return torch.where(norms > bound, bound / norms, torch.ones_like(norms))

    def clipped(self, updates: torch.Tensor) -> torch.Tensor:
        """The clipped rows, ``[k, P]`` in float64: exactly what ``aggregate`` sums (for tests and
        inspection; ``aggregate`` never makes this copy)."""
        return updates.to(torch.float64) * self.scales(updates)[:, None]

    def aggregate(self, updates: torch.Tensor, seed: int, rnd: int) -> torch.Tensor:
        """Round ``rnd``'s update ``[P]`` from the finite updates ``[k, P]`` of the k <= K clients that
        reported: (sum of clipped rows + N(0, (z C)^2 I)) / K, in the updates' dtype and device.

        The sum is taken in float64, where k rows of norm <= C cannot overflow (C <= 3.4e38), in
        column blocks so that no float64 copy of the stack is made. The noise is drawn on the CPU
        from ``streams.privacy_noise_generator(seed, rnd)``. The result is clamped to the dtype's finite range
        before the cast, so that an absurd z C cannot make the update infinite; clamping only
        post-processes the noised value, which keeps the guarantee.
        """
        k, p = updates.shape
        if k > self.clients_per_round:
            raise ValueError(f"{k} updates for a round of clients_per_round = {self.clients_per_round}")
        total = _weighted_sum(updates, self.scales(updates))
        noise = torch.randn(p, generator=privacy_noise_generator(seed, rnd), dtype=torch.float64)
        total += noise.to(total.device).mul_(self.noise_multiplier * self.clip)
        limit = torch.finfo(updates.dtype).max
        return total.div_(self.clients_per_round).clamp_(-limit, limit).to(updates.dtype)

    def rule(self, seed: int, rnd: int) -> Rule:
        """``aggregate`` for round ``rnd`` as an aggregation rule ``(updates, weights) -> [P]``, to
        stand in for the run's rule in ``Round.aggregate``; the sample counts are ignored."""
        return lambda updates, weights: self.aggregate(updates, seed, rnd)

    # ----------------------------------------------------------------- accounting

    def epsilon(self, rounds: int) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds (0 for none; inf for z = 0, where there is no
        noise and so no guarantee). A function of the round count alone: a resumed run asks for
        its round and gets what an uninterrupted one would; recomputed, not checkpointed.

        One accountant is kept and stepped on, so asking after every round costs one step and
        Opacus's ``get_epsilon`` (tens of milliseconds); asking for fewer rounds than the last
        time starts a fresh one."""
        if not is_integer(rounds) or rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        if rounds == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf  # what Opacus says too, with a warning about its orders
        if self._accountant is None or self._steps > rounds:
            self._accountant, self._steps = _rdp_accountant(), 0
        for _ in range(rounds - self._steps):
            self._accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self._steps = rounds
        return float(self._accountant.get_epsilon(self.delta))


# ----------------------------------------------------------------------------- helpers


def _section(section) -> dict:
    """The section's values: a mapping of KEYS alone, or an object with them as attributes."""
    if isinstance(section, Mapping) or not any(hasattr(section, key) for key in KEYS):
        return _CHECKS.mapping(section, KEYS)
    return {key: getattr(section, key, None) for key in KEYS}


def _weighted_sum(rows: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``coefficients @ rows`` in float64 (``[P]``), a column block at a time (``float64_blocks``)."""
    out = torch.empty(rows.shape[1], dtype=torch.float64, device=rows.device)
    coefficients = coefficients.to(device=rows.device, dtype=torch.float64)
    for start, block in float64_blocks(rows):
        torch.mv(block.T, coefficients, out=out[start:start + block.shape[1]])
    return out


def _check_aggregator(spec) -> None:
    registered = isinstance(spec, str) and not is_import_path(spec)
    if registered and spec in RULES:
        return
    if registered and spec in AGGREGATORS:
        why = "its output is not a sum of per-client contributions each bounded by privacy.clip, so the Gaussian " \
              "mechanism's sensitivity bound does not hold"
    else:
        why = "fedsim cannot tell that its output is a sum of per-client contributions each bounded by " \
              "privacy.clip, which the Gaussian mechanism's sensitivity bound needs"
    raise ConfigError(f"privacy: aggregator {components.describe(spec)} cannot be used with differential privacy: "
                      f"{why}; use aggregator fedavg or mean (under privacy both are the unweighted mean of the "
                      f"clipped updates)")


def _check_algorithm(cfg) -> None:
    algorithm = components.algorithm(cfg.algorithm, cfg.algorithm_options)
    name = components.describe(cfg.algorithm)
    try:
        algorithm.setup(cfg)
        kept = [("server state", algorithm.server_state(1)), ("client state", algorithm.client_state(1)),
                ("client reports", algorithm.report_shapes(1))]
    except ConfigError:
        raise
    except Exception as e:  # the user's code: say whose, in one line
        raise ConfigError(f"algorithm: {name} failed when asked for its state ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    reasons = [f"{what} {', '.join(map(repr, shapes))}" for what, shapes in kept if shapes]
    if type(algorithm).server_update is not Algorithm.server_update:
        reasons.append("its own server_update")
    if reasons:
        listed = reasons[0] if len(reasons) == 1 else f"{', '.join(reasons[:-1])} and {reasons[-1]}"
        raise ConfigError(f"privacy: algorithm {name} cannot be used with differential privacy: it has {listed}, "
                          f"which see the clients' un-noised data and so would leak it; use an algorithm that only "
                          f"changes local training (fedavg, fedprox)")


def _check_sampling(cfg) -> None:
    """The accountant's sampling rate q = K / N holds for every client only when each is equally
    likely to be sampled in each round: uniform sampling among clients that are always online."""
    sampling = getattr(cfg, "client_sampling", "uniform")
    if sampling != "uniform":
        why = " and picks clients by their loss on their own data, which is not noised" \
            if sampling == "power_of_choice" else ""
        raise ConfigError(f"privacy: client_sampling {sampling} cannot be used with differential privacy: it makes "
                          f"some clients likelier to be sampled than clients_per_round / data.num_clients, the "
                          f"sampling rate the accountant assumes{why}; use client_sampling: uniform")
    availability = getattr(getattr(cfg, "system", None), "availability", 1.0)
    if availability != 1:
        raise ConfigError(f"privacy: system.availability {availability!r} cannot be used with differential privacy: "
                          f"clients that are online more often are sampled more often than clients_per_round / "
                          f"data.num_clients, the sampling rate the accountant assumes; leave availability at 1")


def _rdp_accountant():
    """A fresh ``opacus.accountants.RDPAccountant``, imported only now (importing opacus takes
    seconds), with one line naming the extra if it cannot be."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError as e:
        raise ConfigError(f"privacy: its accounting needs the opacus package ({e}): {INSTALL}") from None
    return RDPAccountant()
