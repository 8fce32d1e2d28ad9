"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018, "Learning
differentially private recurrent language models"), with optional adaptive clipping (Andrew,
Thakkar, McMahan, Ramaswamy 2021, "Differentially private learning with adaptive clipping").

Sampling. Each round every client joins independently with probability q = K / N (K =
``clients_per_round``, N = ``data.num_clients``; ``client_sampling: poisson``, which a run with
``privacy:`` must use). That is the sampling the accounting below assumes. Sampling exactly K
clients without replacement, fedsim's usual ``uniform``, is refused: the Poisson analysis is not
a proven bound for it, and the bound that is proven for fixed-size sampling (under the
replace-one relation it needs) is many times larger.

Each round the server clips every client update (a row of the ``[k, P]`` stack) to L2 norm at
most C (``clip``), sums the clipped rows, adds Gaussian noise N(0, (z C)^2 I) to the sum
(z = ``noise_multiplier``) and divides by K, the expected number of clients, not by the number
that was sampled or reported: adding or removing one client then moves the result by at most
C / K whatever the others did, which is the sensitivity the Gaussian mechanism's analysis
needs. A round whose sample is empty still releases the noise. Sample counts are not used: a
weight proportional to a client's data would let one client's influence grow beyond C / K. The
guarantee is client-level: it covers everything one client contributes in a round, the whole
row, batch-norm statistics included (see ``check_model``).

Adaptive clipping (``target_quantile`` set). C follows the ``target_quantile`` (gamma) of the
clients' update norms: each round the server also releases the noised share of clients whose
update was within C, b = (sum_i (1[|u_i| <= C] - 1/2) + N(0, s^2)) / K + 1/2 (s =
``count_noise``, default K / 20), and sets C <- C exp(-eta (b - gamma)) (eta =
``clip_learning_rate``). Releasing b costs privacy too: the updates' noise multiplier becomes
z_u = (z^-2 - (2 s)^-2)^(-1/2), so that the two releases together are one Gaussian mechanism of
noise multiplier z (Andrew et al., Theorem 1), which is what is accounted. C starts at ``clip``,
is part of the checkpoint, and is the ``clip`` column of metrics.csv.

Which rules and algorithms keep the guarantee (``experiment/validation.py``'s ``check_privacy``):

- aggregator ``fedavg`` or ``mean``: under privacy both become the mean above. Every other rule
  (median, trimmed_mean, krum, multi_krum, geometric_median, norm_clip, a rule of one's own) is
  refused: its output is not a sum of per-client contributions each bounded by C, so the
  Gaussian mechanism's sensitivity bound does not hold.
- an algorithm that keeps no server or client state, has its clients report nothing and uses
  the base ``server_update`` (fedavg, fedprox, or one of one's own that only changes local
  training). SCAFFOLD, FedNova and FedDyn are refused: their state or reports are computed from
  the clients' un-noised data and would leak it (FedNova's reported steps also change each
  client's weight).
- any server optimizer: it only post-processes the noised aggregate, and post-processing keeps
  a differential-privacy guarantee.
- every client always online (system.availability 1): clients online more often would be
  sampled more often than q. Clients that drop out or straggle only remove contributions.
- attacks: an attacker's update is rewritten before the server clips it, so it is clipped and
  noised like any other, and moves the aggregate by at most C / K too.
- compression without error feedback: a client's message is a function of its update and a
  fresh random stream (seed, round, client), and the server clips the message, so it too moves
  the aggregate by at most C / K. Error feedback is refused: a client's residual is state kept
  from the rounds it took part in, like an algorithm's client state, and the accounting (each
  round's contribution a function of the client's data and the current model) does not cover it.

Accounting. ``epsilon(rounds)`` is the epsilon at ``delta`` after ``rounds`` rounds of the
Poisson-subsampled Gaussian mechanism (rate q, noise multiplier z), from Google's
``dp-accounting`` library, under the add/remove-one-client relation: ``accountant: pld`` (the
default) composes privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022), a
valid and tight bound, discretised pessimistically at 1e-3 so that each round's number is
quick to compute; ``accountant: rdp`` is the Renyi-DP bound of the sampled Gaussian mechanism
(Mironov, Talwar, Zhang 2019), valid but looser (docs/privacy.md says by how much). The noise is
torch's floating-point Gaussian, as in Opacus; floating-point attacks on noise samplers (Mironov
2012) are outside this simulation's model. Non-finite updates that the
engine drops, and clients that fail, only remove contributions, which the analysis allows.

Bounds, checked before the first round (``check_rounds``) and refused in one line naming the
key. The PLD is a grid of 1e-3 over the privacy losses the run reaches (the outer 1e-15 of
probability is cut off, counted as infinite loss), so it grows with them: about 1 / (2 z^2) a
round for a small z (z = 0.001: 5e8 points, minutes and gigabytes; 1e-30: numpy cannot make it)
and with epsilon over many rounds. ``pld_grid_points`` estimates it (0.45 to 1.5 times the
library's where it matters); more than PLD_POINTS is refused, naming the smallest z that fits
and rdp: refusing rather than coarsening the grid keeps every epsilon within 1e-3 a round of
the exact PLD bound, and such runs have an epsilon in the hundreds anyway. pld also needs delta
>= 1e-14 (below, epsilon is inf). RDP costs the same for any z and rounds, but below z ~ 7e-148
sqrt(rounds) its terms overflow float64 and dp-accounting returns epsilon 0, not a bound.
Adaptive clipping's share is clamped to [0, 1], as tensorflow_privacy's QuantileEstimatorQuery
does (post-processing), so a round moves ln C by at most eta max(gamma, 1 - gamma): an eta for
which that exceeds the width of privacy.clip's range (ln(max / tiny) ~ 176 in float32) is
refused, and C is kept in that range. Privacy's errors in a round are a PrivacyError, naming it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..core.blocks import float64_blocks, row_norms
from ..core.checks import FLOAT32, Checks, is_integer, is_number
from ..core.errors import ConfigError, FedsimError, user_code
from ..core.sections import option, required_keys
from ..core.streams import privacy_noise_generator
from .accounting import (
    INSTALL,
    PLD_DISCRETIZATION,
    PLD_MIN_DELTA,
    PLD_POINTS,
    PLD_TAIL,
    pld_epsilon,
    pld_floor,
    pld_grid_points,
    pld_loss_distribution,
    rdp_epsilon,
    rdp_floor,
)

RULES = ("fedavg", "mean")  # the rules that privacy's clipped, noised mean replaces


def _fixed_clip(key: str, privacy: Any, config: Any) -> str | None:
    return None if privacy.target_quantile is not None else "privacy.target_quantile is null: the clip is fixed"


@dataclass
class PrivacyConfig:
    """The ``privacy:`` section: client-level differential privacy, DP-FedAvg (see
    [Differential privacy](privacy.md#differential-privacy)). Without the section (or with
    ``privacy: null``) privacy is off; with it, its three required keys must be given. Its values
    are checked with the run's sampling (``Privacy.from_config``)."""

    clip: float | None = option(doc="C: every client's update is clipped to this L2 norm", required=True)
    noise_multiplier: float | None = option(
        doc="z: the noise added to the sum has standard deviation z C", required=True
    )
    delta: float | None = option(doc="the target δ of the (ε, δ) guarantee, below 1 / data.num_clients", required=True)
    accountant: str = option("pld", "`pld` (privacy loss distributions) or `rdp` (Rényi DP, looser)")
    target_quantile: float | None = option(
        None,
        "adaptive clipping (Andrew et al. 2021): the share of updates the clip should leave unclipped; `null`: "
        "a fixed clip",
    )
    clip_learning_rate: float = option(0.2, "adaptive clipping: how fast the clip moves", unread=_fixed_clip)
    count_noise: float | None = option(
        None,
        "adaptive clipping: the noise on the count of unclipped updates; `null`: clients_per_round / 20",
        unread=_fixed_clip,
    )


KEYS = tuple(f.name for f in fields(PrivacyConfig))
REQUIRED = required_keys(PrivacyConfig)
DEFAULTS = {key: getattr(PrivacyConfig(), key) for key in KEYS if key not in REQUIRED}
ACCOUNTANTS = ("pld", "rdp")
_CLIP_SPAN = math.log(FLOAT32.max / FLOAT32.tiny)  # ln of the range privacy.clip may take, about 176

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
    ``num_clients`` (N) of which each round samples ``clients_per_round`` (K) in expectation.

    Call ``aggregate`` (or the rule ``rule(seed, rnd)`` gives) once per round on the server, and
    ``epsilon(rnd)`` after round ``rnd`` for the privacy spent so far. The noise is a function of
    (seed, round) and epsilon of the number of rounds; the one thing kept between rounds is the
    adaptive clip, in ``state`` (a checkpoint holds it), so a resumed run continues exactly.
    """

    def __init__(
        self,
        clip: float,
        noise_multiplier: float,
        delta: float,
        clients_per_round: int,
        num_clients: int,
        accountant: str = "pld",
        target_quantile: float | None = None,
        clip_learning_rate: float = 0.2,
        count_noise: float | None = None,
    ):
        self.clip = _CHECKS.positive("clip", clip)  # float32's normal range: a clip of 1e-45 would zero every update
        if not is_number(noise_multiplier) or not 0 <= noise_multiplier <= FLOAT32.max:
            # bounded as config floats are: z C then stays finite in float64
            _CHECKS.fail("noise_multiplier", f"must be a number in [0, {FLOAT32.max:.3g}], got {noise_multiplier!r}")
        if not is_number(delta) or not 0 < delta < 1:
            _CHECKS.fail("delta", f"must be a number in (0, 1), got {delta!r}")
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.accountant = _CHECKS.one_of("accountant", accountant, ACCOUNTANTS)
        if self.accountant == "pld" and self.noise_multiplier > 0 and self.delta < PLD_MIN_DELTA:
            _CHECKS.fail(
                "delta",
                f"must be >= {PLD_MIN_DELTA:g} for accountant pld, got {delta!r}: its composition cuts off "
                f"{PLD_TAIL:g} of probability, counted as infinite loss (epsilon inf); or use accountant: rdp",
            )
        self.num_clients = _TOP.count("data.num_clients", num_clients, 1)
        self.clients_per_round = _TOP.count("clients_per_round", clients_per_round, 1)
        if self.clients_per_round > self.num_clients:
            _TOP.fail("clients_per_round", f"must be <= data.num_clients ({num_clients}), got {clients_per_round}")
        if self.delta >= 1 / self.num_clients:
            # (epsilon, delta) with delta >= 1/n is met by a mechanism that publishes one client's
            # data whole, picked at random (Dwork & Roth 2014, 2.3): the guarantee says nothing
            _CHECKS.fail(
                "delta",
                f"must be below 1 / data.num_clients ({1 / self.num_clients:.3g}), usually far below, got "
                f"{delta!r}: a mechanism that releases a random client's data whole meets any epsilon at a "
                f"delta of 1 / data.num_clients, so such a delta guarantees nothing",
            )
        self.sample_rate = self.clients_per_round / self.num_clients  # q
        self.clip_learning_rate = _CHECKS.positive("clip_learning_rate", clip_learning_rate)
        self.count_noise = (
            self.clients_per_round / 20 if count_noise is None else _CHECKS.positive("count_noise", count_noise)
        )
        self._count_noise_given = count_noise is not None
        self.update_noise = self.noise_multiplier  # z_u: what the updates get (all of z without adaptive clipping)
        self.state: dict[str, torch.Tensor] = {}
        if target_quantile is not None:
            self._adaptive(target_quantile)
        self._loss_distribution, self._epsilons = None, {}  # the PLD of one round; epsilon by round
        self._carried = 0  # the most rounds check_rounds has accepted

    def _adaptive(self, target_quantile) -> None:
        if not is_number(target_quantile) or not 0 < target_quantile < 1:
            _CHECKS.fail(
                "target_quantile", f"must be a number in (0, 1), or null for a fixed clip, got {target_quantile!r}"
            )
        self.target_quantile = float(target_quantile)
        if self.noise_multiplier > 0:
            if not 2 * self.count_noise > self.noise_multiplier:
                bound = f"> noise_multiplier / 2 ({self.noise_multiplier / 2:g})"
                if self._count_noise_given:
                    _CHECKS.fail(
                        "count_noise",
                        f"must be {bound} for adaptive clipping to leave noise for the updates, "
                        f"got {self.count_noise:g}",
                    )
                # the default failed: name the key that turned adaptive clipping on, whoever set it
                _CHECKS.fail(
                    "target_quantile",
                    f"adaptive clipping needs privacy.count_noise {bound} to leave noise for the updates; its "
                    f"default, clients_per_round / 20, is {self.count_noise:g}: set privacy.count_noise",
                )
            z, s = self.noise_multiplier, self.count_noise  # z_u = (z^-2 - (2 s)^-2)^(-1/2), without z^-2
            self.update_noise = z * (1 - (z / (2 * s)) ** 2) ** -0.5  # which overflows for a tiny z
        gamma = max(self.target_quantile, 1 - self.target_quantile)  # the share is clamped to [0, 1]
        if self.clip_learning_rate * gamma > _CLIP_SPAN:
            _CHECKS.fail(
                "clip_learning_rate",
                f"must be <= {_CLIP_SPAN / gamma:.4g} with target_quantile {self.target_quantile:g}, got "
                f"{self.clip_learning_rate!r}: a round moves the clip by a factor of up to exp(clip_learning_rate "
                f"x max(target_quantile, 1 - target_quantile)), and a larger one crosses the whole range a clip "
                f"may take, [{FLOAT32.tiny:.3g}, {FLOAT32.max:.3g}], in one round",
            )
        self.state["clip"] = torch.tensor([self.clip], dtype=torch.float64)

    # ----------------------------------------------------------------- from a config

    @classmethod
    def from_config(cls, cfg: Any) -> Privacy | None:
        """The run's Privacy, or None without a ``privacy`` section (absent or null). The section
        is a mapping or an object with the attributes ``clip``, ``noise_multiplier``, ``delta``
        (and optionally the other KEYS), which it validates, with the accountant against the run's
        ``rounds`` (``check_rounds``). What privacy cannot be combined with (a rule, an algorithm,
        sampling, compression) is checked where the sections meet, ``experiment/validation.py``."""
        section = getattr(cfg, "privacy", None)
        if section is None:
            return None
        values = {**DEFAULTS, **{k: v for k, v in _section(section).items() if v is not None or k in REQUIRED}}
        for key in REQUIRED:
            if values.get(key) is None:
                _CHECKS.fail(key, "is required when privacy is on")
        privacy = cls(**values, clients_per_round=cfg.clients_per_round, num_clients=cfg.data.num_clients)
        if importlib.util.find_spec("dp_accounting") is None:  # found now, imported (seconds) only when accounting
            raise ConfigError(f"privacy: its accounting needs the dp-accounting package: {INSTALL}")
        privacy.check_rounds(cfg.rounds)  # what the accountant cannot carry, before the first round
        return privacy

    @classmethod
    def check(cls, cfg: Any) -> None:
        """Raise a one-line ConfigError, naming the key, if the ``privacy`` section is invalid;
        nothing without it."""
        cls.from_config(cfg)

    @staticmethod
    def check_model(model: str, num_params: int, length: int) -> None:
        """Refuse a model with floating-point buffers (``length`` > ``num_params`` values in its
        flat vector), once the model is built: batch-norm running statistics are computed from
        client data, so they would need the noise too, and noise can make a running variance
        negative. Opacus refuses BatchNorm for the same reason; fedsim's models use GroupNorm."""
        if length > num_params:
            raise ConfigError(
                f"privacy: model {model} has {length - num_params:,} buffer values (batch-norm "
                f"running statistics, say) computed from client data, which DP-FedAvg cannot release; "
                f"use a model without buffers (GroupNorm instead of BatchNorm)"
            )

    def check_rounds(self, rounds: int) -> None:
        """Refuse, in one line naming ``privacy.noise_multiplier``, ``rounds`` rounds whose epsilon the
        accountant cannot compute within the module docstring's bounds; one RDP evaluation at most."""
        if self.noise_multiplier == 0 or rounds <= self._carried:
            return
        z, q = self.noise_multiplier, self.sample_rate
        if self.accountant == "rdp" and z < rdp_floor(rounds):
            _CHECKS.fail(
                "noise_multiplier",
                f"must be >= {rdp_floor(rounds):g} (or 0: no noise) for accountant rdp over {rounds:,} rounds, "
                f"got {z!r}: below it the Renyi divergences dp-accounting sums (terms up to 1024^2 / (2 z^2), over "
                f"the rounds) overflow float64, and the epsilon it then returns, 0, is not a bound",
            )
        points = pld_grid_points(z, q, rounds) if self.accountant == "pld" else 0
        if points > PLD_POINTS:
            _CHECKS.fail(
                "noise_multiplier",
                f"must be >= {pld_floor(q, rounds):g} (or 0: no noise) for accountant pld over {rounds:,} rounds "
                f"at q = {q:.3g}, got {z!r}: the privacy losses they reach would need a grid of "
                f"{f'about {points:.2g}' if points < 1e308 else 'over 1e308'} points of {PLD_DISCRETIZATION:g}, "
                f"past the {PLD_POINTS:,} fedsim allows (a second or two a round); or use accountant: rdp, "
                f"which takes any noise_multiplier >= {rdp_floor(rounds):g} in milliseconds",
            )
        self._carried = rounds

    # ----------------------------------------------------------------- one round

    @property
    def current_clip(self) -> float:
        """This round's C: ``clip``, or where adaptive clipping has taken it."""
        return float(self.state["clip"][0]) if "clip" in self.state else self.clip

    def scales(self, updates: torch.Tensor) -> torch.Tensor:
        """The ``[k]`` float64 factors that clip the rows: 1 for a row within the bound (a zero
        row too), else the bound over its norm. Norms are float64 (``row_norms``): finite for
        any finite float32 row, where a float32 sum of squares overflows past 1.8e19."""
        norms = row_norms(updates)
        bound = self.current_clip * _MARGIN
        return torch.where(norms > bound, bound / norms, torch.ones_like(norms))

    def clipped(self, updates: torch.Tensor) -> torch.Tensor:
        """The clipped rows, ``[k, P]`` in float64: exactly what ``aggregate`` sums (for tests and
        inspection; ``aggregate`` never makes this copy)."""
        return updates.to(torch.float64) * self.scales(updates)[:, None]

    def aggregate(self, updates: torch.Tensor, seed: int, rnd: int) -> torch.Tensor:
        """Round ``rnd``'s update ``[P]`` from the finite updates ``[k, P]`` of the clients that
        reported (k may be 0): (sum of clipped rows + N(0, (z_u C)^2 I)) / K, in the updates'
        dtype and device; with adaptive clipping, then the next round's C.

        The sum is taken in float64, where k rows of norm <= C cannot overflow (C <= 3.4e38), in
        column blocks so that no float64 copy of the stack is made. The noise is drawn on the CPU
        from ``streams.privacy_noise_generator(seed, rnd)`` (the updates' P values, then the
        count's one). The result is clamped to the dtype's finite range before the cast, so that
        an absurd z C cannot make the update infinite; clamping only post-processes the noised
        value, which keeps the guarantee.
        """
        keys = "clip, noise_multiplier" + ("" if "clip" not in self.state else ", target_quantile, clip_learning_rate")
        with user_code(f"privacy: clipping and noising round {rnd}'s updates (privacy.{keys}) failed", PrivacyError):
            return self._aggregate(updates, seed, rnd)

    def _aggregate(self, updates: torch.Tensor, seed: int, rnd: int) -> torch.Tensor:
        clip, scales = self.current_clip, self.scales(updates)
        generator = privacy_noise_generator(seed, rnd)
        total = _weighted_sum(updates, scales)
        noise = torch.randn(updates.shape[1], generator=generator, dtype=torch.float64)
        total += noise.to(total.device).mul_(self.update_noise * clip)
        if "clip" in self.state:
            within = float((scales == 1).sum())  # norm <= C (up to the 1e-9 margin above)
            count_noise = self.count_noise * float(torch.randn(1, generator=generator, dtype=torch.float64))
            share = (within - len(scales) / 2 + count_noise) / self.clients_per_round + 0.5
            share = min(max(share, 0.0), 1.0)  # a fraction, as tensorflow_privacy's QuantileEstimatorQuery clamps it
            step = math.exp(-self.clip_learning_rate * (share - self.target_quantile))  # within e^-176 .. e^176
            self.state["clip"].mul_(step).clamp_(FLOAT32.tiny, FLOAT32.max)  # the range privacy.clip may take
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
        its round and gets what an uninterrupted one would; recomputed, not checkpointed."""
        if not is_integer(rounds) or rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        if rounds == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        self.check_rounds(rounds)  # done before the first round for the run's rounds; here for more
        if rounds not in self._epsilons:
            if self.accountant == "rdp":
                self._epsilons[rounds] = rdp_epsilon(self.noise_multiplier, self.sample_rate, rounds, self.delta)
            else:
                if self._loss_distribution is None:
                    self._loss_distribution = pld_loss_distribution(self.noise_multiplier, self.sample_rate)
                self._epsilons[rounds] = pld_epsilon(self._loss_distribution, rounds, self.delta)
        return self._epsilons[rounds]


class PrivacyError(FedsimError):
    """Privacy's mean failed in a round: a FedsimError, so that the ``user_code`` around the
    algorithm's server_update (engine/update.py), which calls it, lets it pass naming privacy."""

    exit_code = 1


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
        torch.mv(block.T, coefficients, out=out[start : start + block.shape[1]])
    return out
