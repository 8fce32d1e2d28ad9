"""The ``system:`` section of an experiment: its dataclass and its checks (see system.py for what
it simulates: clients offline, failing, slow and late)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..core.checks import Checks, is_number
from ..core.errors import cut, shown
from ..core.sections import option
from .sampling import check_sampling


def _without_deadline(key: str, system: Any, config: Any) -> str | None:
    return None if system.deadline is not None else "system.deadline is null: no client can straggle"


@dataclass
class SystemConfig:
    """The ``system:`` section; the defaults simulate none. ``availability`` is a probability or a
    one-key mapping, ``speed`` null or a one-key mapping: typed loosely so that the message of the
    checks below, listing every form, is the one a bad value gets."""

    availability: Any | None = option(
        1.0,
        "p in (0, 1]: every client online with probability p each round; or per-client probabilities, drawn once "
        "per client: `{uniform: [low, high]}` or `{beta: [a, b]}` (see "
        "[System heterogeneity](data.md#system-heterogeneity-and-client-sampling))",
    )
    dropout: float = option(0.0, "in [0, 1): the chance that a sampled client fails before reporting")
    speed: Any | None = option(
        None,
        "relative compute speed, drawn once per client: `null` (every client 1), `{lognormal: sigma}` (median 1) "
        "or `{uniform: [low, high]}`",
    )
    deadline: float | None = option(None, "simulated seconds a round waits; `null`: no deadline, no stragglers")
    step_seconds: float = option(1.0, "simulated seconds one local step takes at speed 1")
    stragglers: str = option(
        "drop", "`drop`, or `partial`: keep the steps a straggler finished by the deadline", unread=_without_deadline
    )

    def check(self) -> None:
        """The section's own values (the sampling keys it is simulated with: ``System.check_config``)."""
        parse_system(self, "uniform", None)


KEYS = tuple(f.name for f in fields(SystemConfig))
STRAGGLERS = ("drop", "partial")
AVAILABILITY_DISTRIBUTIONS = ("uniform", "beta")
SPEED_DISTRIBUTIONS = ("lognormal", "uniform")
MAX_SIGMA = 10.0  # beyond this, lognormal speeds of a large federation over- and underflow float64
# Speeds are kept within [1e-30, 1e30]: a client's simulated time is then at most step_seconds
# (< 3.4e38) x steps (< 2^63) / 1e-30 ~ 3e87 s, and a clock summing 2^63 of them stays finite in
# float64 (~3e106), where a speed of 5e-324 would make it infinite.
SPEED_RANGE = (1e-30, 1e30)
_CHECKS = Checks("system")


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class SystemSpec:
    sampling: str
    candidates: int | None
    availability: tuple  # ("constant", p) | ("uniform", low, high) | ("beta", a, b)
    dropout: float
    speed: tuple  # ("constant", 1.0) | ("lognormal", sigma) | ("uniform", low, high)
    deadline: float | None
    step_seconds: float
    stragglers: str


def _one_key(key: str, value, names: Sequence[str], forms: str):
    """A distribution written as a one-key mapping, ``{name: parameters}``."""
    if not isinstance(value, Mapping) or len(value) != 1:
        _CHECKS.fail(key, f"must be {forms}, got {shown(value)}")
    ((name, params),) = value.items()
    if name not in names:
        _CHECKS.fail(key, f"unknown distribution {cut(str(name))!r}; choose one of: {', '.join(names)} ({forms})")
    return name, params


def _pair(key: str, name: str, params, what: str) -> tuple[float, float]:
    if not isinstance(params, (list, tuple)) or len(params) != 2 or not all(is_number(p) for p in params):
        _CHECKS.fail(key, f"{name} takes [{what}], two finite numbers, got {shown(params)}")
    return float(params[0]), float(params[1])


def _availability(value) -> tuple:
    # as dropout 1 loses every client's work, availability 0 would put every client offline
    key, forms = "availability", "a probability in (0, 1], {uniform: [low, high]} or {beta: [a, b]}"
    offline = " (0 would keep every client offline, and no round would train anyone)"
    if not isinstance(value, Mapping):
        p = _CHECKS.number(key, value, f"must be {forms}")
        if not 0 < p <= 1:
            _CHECKS.fail(key, f"must be a probability in (0, 1], got {p}{offline if p == 0 else ''}")
        return ("constant", p)
    name, params = _one_key(key, value, AVAILABILITY_DISTRIBUTIONS, forms)
    if name == "uniform":
        low, high = _pair(key, name, params, "low, high")
        if not (0 <= low <= high <= 1 and high > 0):
            _CHECKS.fail(
                key,
                f"uniform [low, high] needs 0 <= low <= high <= 1 (probabilities) and high above 0, "
                f"got [{low}, {high}]{offline if high == 0 else ''}",
            )
        return ("uniform", low, high)
    a, b = _pair(key, name, params, "a, b")
    if not (a > 0 and b > 0):
        _CHECKS.fail(key, f"beta [a, b] needs a > 0 and b > 0, got [{a}, {b}]")
    return ("beta", a, b)


def _speed(value) -> tuple:
    key, forms = "speed", "null (every client 1), {lognormal: sigma} or {uniform: [low, high]}"
    if value is None:
        return ("constant", 1.0)
    name, params = _one_key(key, value, SPEED_DISTRIBUTIONS, forms)
    if name == "lognormal":
        sigma = _CHECKS.number(key, params, "lognormal takes sigma, a finite number")
        if not 0 <= sigma <= MAX_SIGMA:
            _CHECKS.fail(key, f"lognormal sigma must be in [0, {MAX_SIGMA:g}], got {sigma}")
        return ("lognormal", sigma)
    low, high = _pair(key, name, params, "low, high")
    if not SPEED_RANGE[0] <= low <= high <= SPEED_RANGE[1]:
        _CHECKS.fail(
            key,
            f"uniform [low, high] needs {SPEED_RANGE[0]:g} <= low <= high <= {SPEED_RANGE[1]:g} (speeds relative to "
            f"1; a speed of 0 never finishes, and one below {SPEED_RANGE[0]:g} would make the simulated clock "
            f"infinite), got [{low}, {high}]",
        )
    return ("uniform", low, high)


def _seconds(key: str, value, null: str = "") -> float:
    """Simulated seconds > 0; ``null`` says what null means where it is allowed."""
    seconds = _CHECKS.number(key, value, f"must be a number of simulated seconds > 0{null}")
    if not seconds > 0:
        _CHECKS.fail(key, f"must be > 0 simulated seconds{null}, got {seconds}")
    return seconds


def parse_system(
    section: Mapping[str, Any] | SystemConfig | None,
    client_sampling: str,
    sampling_candidates: int | None,
    clients_per_round: int | None = None,
    num_clients: int | None = None,
) -> SystemSpec:
    """The checked values of a ``system:`` section (a mapping, a SystemConfig or None) with the
    run's client sampling; bad values raise a one-line ConfigError naming the key."""
    candidates = check_sampling(client_sampling, sampling_candidates, clients_per_round, num_clients)
    values = {**_CHECKS.mapping(SystemConfig(), KEYS), **_CHECKS.mapping(section, KEYS)}
    dropout = _CHECKS.number("dropout", values["dropout"], "must be a probability in [0, 1)")
    deadline = values["deadline"]
    return SystemSpec(
        sampling=client_sampling,
        candidates=candidates,
        availability=_availability(values["availability"]),
        dropout=_CHECKS.within("dropout", dropout, 0, 1, "[)", " (1 would lose every client's work)"),
        speed=_speed(values["speed"]),
        deadline=None if deadline is None else _seconds("deadline", deadline, ", or null for none"),
        step_seconds=_seconds("step_seconds", values["step_seconds"]),
        stragglers=_CHECKS.one_of("stragglers", values["stragglers"], STRAGGLERS),
    )
