"""Byzantine clients, to test robust aggregation: each attack is one registered class.

A seeded set of the federation's clients (``attack.fraction`` of them, fixed for the run)
misbehaves whenever it is sampled; or ``attack.count`` Byzantine clients outside the federation,
holding no data, send beside the sampled clients in every round (the papers' n honest and f
Byzantine clients). The attackers collude and see the whole
round, the omniscient threat model of the robustness papers: after every sampled client has
trained, an attack rewrites the attackers' rows of the round's stack from what it sees
(``rewrite(view)``, a ``RoundView``: every update of the round, which rows are the attackers',
and the server's own pre-aggregators and rule), before pre-aggregation and the rule. An attack
may instead change the labels the attackers train on (``relabel``).

The families are the modules of this package, each registering its own: ``per_client.py`` (an
attacker rewrites its own update: sign flip, scale, noise, flipped labels) and ``omniscient.py``
(the attackers send what the round's honest updates make worst: ALIE, IPM, MinMax, MinSum,
Mimic, and the line searches of ALIE and IPM against the server's aggregate).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core.blocks import finite_rows
from ...core.checks import Checks, refuse_unknown
from ...core.errors import ConfigError, UserCodeError, user_code
from ...core.registry import Registry, is_import_path, load_attr, registered
from ...core.sections import option
from ...core.streams import attackers_rng
from ...data.tensors import IGNORE_INDEX

ATTACKS = Registry("attack")


def _no_attack(key: str, attack: Any, config: Any) -> str | None:
    return "attack.type is none" if attack.type == "none" else None


def _not_scaled(key: str, attack: Any, config: Any) -> str | None:
    takes = "scale" in inspect.signature(attack_class(attack.type)).parameters
    return None if takes else f"attack.type {attack.type} does not use it"


def _counted(key: str, attack: Any, config: Any) -> str | None:
    return _no_attack(key, attack, config) or ("attack.count sets the attackers" if attack.count is not None else None)


@dataclass
class AttackConfig:
    """The ``attack:`` section: Byzantine clients (see [Attacks](algorithms.md#attacks))."""

    type: Any = option(
        "none",
        "what the Byzantine clients do (see [Attacks](algorithms.md#attacks)), or an import path "
        "(`pkg.module:Class`) to an `Attack` of one's own; `none`: no attack",
    )
    fraction: float = option(
        0.0, "the share of all clients that are Byzantine, in [0, 1) (a seeded set)", unread=_counted
    )
    scale: float = option(1.0, "`sign_flip` sends -scale x update, `scale` sends scale x update", unread=_not_scaled)
    count: int | None = option(
        None,
        "Byzantine clients outside the federation, instead of `fraction`: this many send in every round beside "
        "the sampled clients, hold no data and see the round (the robustness papers' n honest and f Byzantine); "
        "the `f` of the rules and pre-aggregators unless their options set it",
        unread=_no_attack,
    )
    options: dict = option(doc="the attack's own options (see [Attacks](algorithms.md#attacks))", factory=dict)

    def check(self) -> None:
        checks = Checks("attack")
        if isinstance(self.type, str) and not is_import_path(self.type):
            registered("attack.type", ATTACKS, self.type)
        checks.within("fraction", self.fraction, 0, 1, "[)")
        checks.count("count", self.count, 1, optional=True)
        if self.count is not None and self.fraction:
            checks.fail("count", "set fraction (attackers among the clients) or count (outside them), not both")
        if self.type != "none" and self.fraction == 0 and self.count is None:
            checks.fail(
                "fraction", f"attack.type is {self.type} but fraction is 0; set a fraction in (0, 1) or a count"
            )
        if "scale" in self.options and self.scale != 1.0:
            checks.fail("scale", "set attack.scale or attack.options.scale, not both")
        make_attack(self)  # its options, checked now

    def members(self, num_clients: int) -> int:
        """How many of the federation's ``num_clients`` clients are Byzantine: round(fraction x
        num_clients) (Python's round, so an exact half goes to the even count); none where
        ``count`` puts the Byzantine clients outside the federation."""
        if self.type == "none" or self.count is not None:
            return 0
        return int(round(self.fraction * num_clients))


@dataclass
class RoundView:
    """What the round's colluding attackers see: every client's update of the round, the
    attackers' rows still holding their own honest updates."""

    updates: torch.Tensor  # [k, P]: the round's updates, client weights minus global weights
    weights: torch.Tensor  # [k]: the clients' sample counts
    attackers: torch.Tensor  # [k] bool, on the updates' device: the attackers' rows
    generator: torch.Generator  # the attack's own stream of the round (CPU)
    # the server's pre-aggregators and rule as they aggregate this round, buckets included
    aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def own(self) -> torch.Tensor:
        """The attackers' own honest updates ``[a, P]`` (for the Byzantine clients of attack.count,
        which hold no data, the honest clients' mean)."""
        return self.updates[self.attackers]

    @functools.cached_property
    def honest(self) -> torch.Tensor:
        """The honest clients' finite updates ``[h, P]``; where the round has none, the attackers'
        own (they trained honestly on their data too)."""
        rows = ~self.attackers & finite_rows(self.updates)
        return self.updates[rows] if bool(rows.any()) else self.own

    def sending(self, vector: torch.Tensor) -> torch.Tensor:
        """The round's stack with every attacker sending ``vector``."""
        return torch.where(self.attackers[:, None], vector, self.updates)


class Attack:
    """Every client is honest: nothing is rewritten and nothing relabelled."""

    def rewrite(self, view: RoundView) -> torch.Tensor | None:
        """What the attackers send instead of their honest updates, ``[a, P]`` (one row each, in the
        order of ``view.own``, or one ``[P]`` row that every attacker sends); None: unchanged."""
        return None

    def relabel(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels an attacker trains on instead of ``labels``."""
        return labels

    @property
    def relabels(self) -> bool:
        return type(self).relabel is not Attack.relabel


ATTACKS.register("none", "every client is honest")(Attack)


def attack_class(spec: Any) -> type:
    """The Attack class ``attack.type`` names: registered, an import path, or the class itself."""
    if not isinstance(spec, str):
        target = spec
    else:
        target = load_attr("attack.type", spec) if is_import_path(spec) else registered("attack.type", ATTACKS, spec)
    if not (isinstance(target, type) and issubclass(target, Attack)):
        what = type(target).__name__ if not isinstance(target, type) else f"class {target.__name__}"
        Checks("attack").fail("type", f"{spec!r} is a {what}, not a subclass of fedsim.attacks.Attack")
    if target is not Attack and target.rewrite is Attack.rewrite and target.relabel is Attack.relabel:
        Checks("attack").fail(  # a misspelt method would otherwise leave every attacker honest, unsaid
            "type",
            f"{target.__name__} defines neither rewrite nor relabel, so its attackers would send honest "
            "updates; define one of them (see docs/extending.md)",
        )
    return target


def make_attack(attack_config: Any) -> Attack:
    """The attack of ``attack_config``, built with its ``options`` (and ``scale`` where it takes one)."""
    cls = attack_class(attack_config.type)
    takes = list(inspect.signature(cls).parameters)
    options = dict(attack_config.options)
    name = cls.__name__ if not isinstance(attack_config.type, str) else attack_config.type
    refuse_unknown("attack.options", name, options, takes)
    if "scale" in takes:
        options.setdefault("scale", attack_config.scale)
    with user_code(f"attack.type: {name} failed when it was built", ConfigError):  # the class may be the user's
        return cls(**options)


def checked_relabel(attack: Attack, name: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``attack.relabel``, named in one line where it raises or returns what an attacker cannot train
    on (the attack may be the user's): labels of another shape or dtype, or a scored label outside
    ``[0, num_classes)``, which the loss would otherwise report without naming the attack."""

    def relabel(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        with user_code(f"attack {name} failed relabelling"):
            out = attack.relabel(labels, num_classes)
        expected = f"{labels.dtype} labels of shape {tuple(labels.shape)} in [0, {num_classes})"
        if not isinstance(out, torch.Tensor):
            got = type(out).__name__
        elif (out.shape, out.dtype) != (labels.shape, labels.dtype):
            got = f"{out.dtype} labels of shape {tuple(out.shape)}"
        elif bool(((out < 0) | (out >= num_classes))[labels != IGNORE_INDEX].any()):
            got = f"labels from {int(out.min())} to {int(out.max())}"
        else:
            return out
        raise UserCodeError(f"attack {name} relabelled a batch as {got}; expected {expected}")

    return relabel


def attacker_mask(seed: int, num_clients: int, attack_config: Any) -> torch.Tensor:
    """Bool tensor over clients: True for ``attack_config.members(num_clients)`` clients drawn
    from their own stream of ``seed``."""
    mask = torch.zeros(num_clients, dtype=torch.bool)
    count = attack_config.members(num_clients)
    if count:
        mask[torch.from_numpy(attackers_rng(seed).choice(num_clients, size=count, replace=False))] = True
    return mask


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
