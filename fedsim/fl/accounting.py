"""What dp-accounting's accountants can carry, and the calls into them (privacy.py's accounting).

The PLD accountant keeps a grid of PLD_DISCRETIZATION over the privacy losses a run reaches; its
size, estimated by ``pld_grid_points`` before the first round, bounds the noise multipliers a
run may use (``pld_floor``); the RDP accountant overflows below ``rdp_floor``. privacy.py's
docstring says why each bound is what it is.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from statistics import NormalDist
from typing import Any

import numpy as np

from ..core.errors import ConfigError, install

INSTALL = install("privacy")
PLD_DISCRETIZATION = 1e-3  # pessimistic: epsilon within rounds x 1e-3 above the exact PLD bound, never below
PLD_POINTS = 2**20  # the largest PLD grid (estimated) a run may need: a second or two a round at most
PLD_MIN_DELTA = 1e-14  # ten times the probability dp-accounting's composition cuts off as infinite loss
PLD_TAIL = 1e-15  # that probability: dp-accounting's tail_mass_truncation
_NOISE_SDS = -NormalDist().inv_cdf(0.5 * math.exp(-50))  # ~9.75: dp-accounting cuts each tail of the noise at 0.5 e^-50


def pld_grid_points(noise_multiplier: float, sample_rate: float, rounds: int) -> float:
    """About how many points dp-accounting's PLD grid needs after ``rounds`` rounds (tests compare it with the
    library's): min(rounds, 3) times one round's span of privacy losses (exact to 1%), or, if larger, the RDP
    epsilon at delta 5e-16 (half the tail the composition cuts off), near the highest loss the grid keeps."""
    first = min(rounds, 3) * _round_span(noise_multiplier, sample_rate)
    if first > PLD_POINTS * PLD_DISCRETIZATION:  # refused already (and RDP may overflow for such a z)
        return first / PLD_DISCRETIZATION
    return max(first, rdp_epsilon(noise_multiplier, sample_rate, rounds, PLD_TAIL / 2)) / PLD_DISCRETIZATION


def _round_span(z: float, q: float) -> float:
    """The range of one round's privacy loss in dp-accounting's PLD: the Gaussian's (x - 1/2) / z^2
    for x within _NOISE_SDS deviations, through the subsampling's log(1 - q + q e^loss)."""
    with np.errstate(all="ignore"):
        loss = (0.5 + _NOISE_SDS * z) / np.float64(z) ** 2
        if q == 1:
            return float(2 * loss)
        keep, log_q = math.log1p(-q), math.log(q)
        return float(np.logaddexp(keep, log_q + loss) - np.logaddexp(keep, log_q - loss))


def pld_floor(q: float, rounds: int) -> float:
    """The smallest z whose PLD grid fits PLD_POINTS (it shrinks as z grows), within 1%, rounded up to 2 digits."""
    fits = lambda z: pld_grid_points(z, q, rounds) <= PLD_POINTS  # noqa: E731
    low = high = 0.05
    while fits(low):
        low /= 4
    while not fits(high):
        high *= 4
    while high > 1.01 * low:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    return _two_digits_up(high)


def rdp_floor(rounds: int) -> float:
    """The smallest z for which dp-accounting's RDP stays below 1e300: its terms reach 1024^2 / (2 z^2)
    (1024: its top order) and a round's divergence about 512 / z^2, summed over the rounds."""
    return _two_digits_up(math.sqrt(512 * max(1024, rounds) / 1e300))


def _two_digits_up(x: float) -> float:
    """``x`` rounded up to two significant digits: a floor that holds as the message prints it."""
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(x / step) * step:.2g}")


def rdp_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds, by dp-accounting's RDP accountant."""
    dp = _import("dp_accounting")
    accountant = _import("dp_accounting.rdp").RdpAccountant()
    with _library_logging():
        accountant.compose(dp.PoissonSampledDpEvent(sample_rate, dp.GaussianDpEvent(noise_multiplier)), rounds)
        return float(accountant.get_epsilon(delta))


def pld_loss_distribution(noise_multiplier: float, sample_rate: float) -> Any:
    """One round's privacy loss distribution, on dp-accounting's grid of PLD_DISCRETIZATION."""
    pld = _import("dp_accounting.pld.privacy_loss_distribution")
    with _library_logging():
        return pld.from_gaussian_mechanism(
            noise_multiplier, sampling_prob=sample_rate, value_discretization_interval=PLD_DISCRETIZATION
        )


def pld_epsilon(loss_distribution: Any, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds of ``loss_distribution`` composed."""
    with _library_logging():
        composed = loss_distribution.self_compose(rounds) if rounds > 1 else loss_distribution
        return float(composed.get_epsilon_for_delta(delta))


@contextmanager
def _library_logging() -> Iterator[None]:
    """dp-accounting warns through absl (orders its RDP leaves out, for one), and absl's first
    message configures the program's root logger (``logging.basicConfig``), after which fedsim,
    finding the program's logging set up, would leave its own lines to it and print none
    (results/progress.py): a handler that a call adds to the root is taken away again."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in before:
                root.removeHandler(handler)


def _import(module: str):
    """A module of dp-accounting, imported only when first needed (it takes seconds), with one
    line naming the extra if it cannot be. Its warnings (absl's) are not the user's concern."""
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"privacy: its accounting needs the dp-accounting package ({e}): {INSTALL}") from None
    logging.getLogger("absl").setLevel(logging.ERROR)
    return found
