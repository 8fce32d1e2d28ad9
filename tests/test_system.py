"""fedsim.fl.system: availability, dropout, stragglers and client sampling.

Rates are checked against binomial bounds. A count X of n independent events of probability p has
mean np and standard deviation sqrt(np(1-p)); for the n used here (thousands) X is close to normal,
and |X - np| > 5 sd has probability about 6e-7 (per comparison; a test makes at most a few dozen).
The draws are seeded, so a test either always passes or always fails: the bound says that a
correct implementation passes for all but a negligible share of seeds, while a wrong rate (off by
more than a few percent of p) fails.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import sample_clients

from fedsim.core.errors import ConfigError
from fedsim.core.yamlfile import parse_yaml
from fedsim.experiment.validation import load_config, unused_settings
from fedsim.fl.system import RoundPlan, System, local_steps
from fedsim.fl.system_config import SystemConfig

SD = 5.0  # standard deviations allowed (see the module docstring)


def within(count, n, p, sd=SD) -> bool:
    """``count`` successes of ``n`` Bernoulli(p) trials is within ``sd`` standard deviations."""
    return abs(count - n * p) <= sd * math.sqrt(n * p * (1 - p))


def phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


# ----------------------------------------------------------------------------- sampling


def test_uniform_with_everyone_online_is_todays_sample():
    for system in (System(), System({"dropout": 0.3, "speed": {"lognormal": 1.0}, "deadline": 5.0})):
        for seed in (0, 1, 12345):
            for n, k in ((10, 1), (10, 4), (10, 10), (100, 7), (1000, 50)):
                for rnd in range(1, 21):
                    plan = system.round(seed, rnd, n, k, np.full(n, 30))
                    assert torch.equal(torch.from_numpy(plan.sampled), sample_clients(seed, rnd, n, k))
                    assert plan.unavailable == 0


def test_fewer_online_than_k_samples_every_online_client():
    sizes = np.arange(1, 31)
    for sampling, d in (("uniform", None), ("by_size", None), ("power_of_choice", 12)):
        system = System({"availability": 0.3}, client_sampling=sampling, sampling_candidates=d)
        short = 0
        for rnd in range(1, 101):
            online = np.flatnonzero(system.online(0, rnd, 30))
            cands = system.candidates(0, rnd, 30, 10, sizes)
            plan = system.round(0, rnd, 30, 10, sizes, losses={int(c): float(c % 7) for c in cands})
            assert plan.unavailable == 30 - len(online)
            assert set(plan.sampled) <= set(online) and len(plan.sampled) == min(10, len(online))
            if len(online) <= 10:
                short += 1
                assert np.array_equal(plan.sampled, online)
        assert short > 10  # E[online] = 9 of 30: most rounds have fewer than k online


def test_by_size_one_client_at_the_rate_of_its_size():
    # k = 1: client i is drawn with probability n_i / sum(n); over R rounds its count is Bin(R, p_i)
    sizes = np.array([1, 2, 3, 4, 10])
    system, rounds = System(client_sampling="by_size"), 4000
    counts = np.zeros(5, dtype=int)
    for rnd in range(1, rounds + 1):
        counts[system.round(7, rnd, 5, 1, sizes).sampled] += 1
    for i, p in enumerate(sizes / sizes.sum()):
        assert within(counts[i], rounds, p), (i, counts[i], rounds * p)


def test_by_size_without_replacement_at_the_exact_inclusion_rate():
    # k = 2 of 4, drawn one after another proportional to size: client i is in the sample with
    # probability pi_i = p_i + sum_{j != i} p_j p_i / (1 - p_j) (first, or second after j);
    # over R rounds its count is Bin(R, pi_i)
    sizes = np.array([1, 2, 3, 4])
    p = sizes / sizes.sum()
    pi = [p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(4) if j != i) for i in range(4)]
    assert math.isclose(sum(pi), 2)
    system, rounds = System(client_sampling="by_size"), 4000
    counts = np.zeros(4, dtype=int)
    for rnd in range(1, rounds + 1):
        plan = system.round(3, rnd, 4, 2, sizes)
        assert len(set(plan.sampled)) == 2
        counts[plan.sampled] += 1
    for i in range(4):
        assert within(counts[i], rounds, pi[i]), (i, counts[i], rounds * pi[i])
    assert counts[3] > counts[0] * 2  # large clients are favoured (pi = 0.77 vs 0.19)


def test_power_of_choice_keeps_the_highest_loss_candidates():
    n, k, d = 50, 5, 15
    sizes = np.random.default_rng(0).integers(10, 500, n)
    system = System(client_sampling="power_of_choice", sampling_candidates=d)
    assert system.needs_losses
    for rnd in range(1, 51):
        cands = system.candidates(1, rnd, n, k, sizes)
        assert len(cands) == d and len(set(cands)) == d and np.all(np.diff(cands) > 0)
        losses = np.random.default_rng(rnd).random(d)
        plan = system.round(1, rnd, n, k, sizes, losses=losses)
        assert np.array_equal(plan.candidates, cands)
        chosen = np.isin(cands, plan.sampled)
        assert chosen.sum() == k and losses[chosen].min() > losses[~chosen].max()
        by_client = system.round(1, rnd, n, k, sizes, losses=dict(zip(cands.tolist(), losses)))
        assert np.array_equal(by_client.sampled, plan.sampled)
        assert np.array_equal(plan.sampled, np.sort(cands[np.argsort(-losses)[:k]]))


def test_power_of_choice_ties_nans_and_missing_losses():
    sizes = np.full(6, 10)
    system = System(client_sampling="power_of_choice", sampling_candidates=6)
    cands = system.candidates(0, 1, 6, 2, sizes)
    assert np.array_equal(cands, np.arange(6))  # d = N: every client is a candidate
    assert list(system.round(0, 1, 6, 2, sizes, losses=[1, 3, 3, 3, 0, 2]).sampled) == [1, 2]  # tie: lower id
    assert list(system.round(0, 1, 6, 2, sizes, losses=[1, 3, math.nan, 0, 0, 2]).sampled) == [1, 2]  # NaN highest
    with pytest.raises(ValueError, match="needs the losses"):
        system.round(0, 1, 6, 2, sizes)
    with pytest.raises(ValueError, match="candidate client 5"):
        system.round(0, 1, 6, 2, sizes, losses=dict.fromkeys(range(5), 1.0))
    with pytest.raises(ValueError, match="5 losses for 6 candidates"):
        system.round(0, 1, 6, 2, sizes, losses=[1.0] * 5)
    # candidates are drawn proportional to size: with d = k = 1, exactly by_size's draw
    pick = System(client_sampling="power_of_choice", sampling_candidates=1)
    by_size = System(client_sampling="by_size")
    skewed = np.array([1, 5, 20, 2, 50, 7])
    for rnd in range(1, 30):
        assert np.array_equal(pick.round(2, rnd, 6, 1, skewed).sampled, by_size.round(2, rnd, 6, 1, skewed).sampled)


# ----------------------------------------------------------------------------- availability


def test_availability_rate_over_rounds_and_clients():
    # every (round, client) is online independently with p: the total is Bin(R N, p), and each
    # client's count over R rounds is Bin(R, p) (5.5 sd for the largest of 200 clients)
    p, n, rounds = 0.7, 200, 250
    system = System({"availability": p})
    online = np.stack([system.online(5, rnd, n) for rnd in range(1, rounds + 1)])
    assert within(online.sum(), rounds * n, p)
    assert all(within(c, rounds, p, 5.5) for c in online.sum(axis=0))  # not the same clients each round
    plan = system.round(5, 3, n, 10, np.full(n, 20))
    assert plan.unavailable == n - online[2].sum() and set(plan.sampled) <= set(np.flatnonzero(online[2]))
    assert System({"availability": 1.0}).online(0, 1, 50).all()


@pytest.mark.parametrize(
    "spec, mean, var", [({"uniform": [0.2, 0.6]}, 0.4, 0.4**2 / 12), ({"beta": [2, 5]}, 2 / 7, 2 * 5 / (7**2 * 8))]
)
def test_availability_drawn_once_per_client(spec, mean, var):
    n, rounds = 2000, 100
    system = System({"availability": spec})
    p = system.availabilities(9, n)
    assert np.all((p >= 0) & (p <= 1))
    if "uniform" in spec:
        assert p.min() >= 0.2 and p.max() <= 0.6
    # the mean of N iid probabilities: within 5 sd of E[p], sd = sqrt(Var[p] / N)
    assert abs(p.mean() - mean) <= SD * math.sqrt(var / n)
    # given the probabilities, the online count is a sum of independent Bin(R, p_i):
    # mean R sum p_i, variance R sum p_i (1 - p_i)
    count = sum(system.online(9, rnd, n).sum() for rnd in range(1, rounds + 1))
    assert abs(count - rounds * p.sum()) <= SD * math.sqrt(rounds * (p * (1 - p)).sum())
    assert np.array_equal(p, System({"availability": spec, "dropout": 0.5}).availabilities(9, n))


# ----------------------------------------------------------------------------- dropout


def test_dropout_rate_and_what_reports():
    # each sampled client drops out independently with q: R rounds of k clients give Bin(R k, q)
    q, n, k, rounds = 0.2, 100, 40, 300
    system = System({"dropout": q})
    total = 0
    for rnd in range(1, rounds + 1):
        plan = system.round(4, rnd, n, k, np.full(n, 64))
        assert set(plan.dropouts) <= set(plan.sampled)
        assert np.array_equal(plan.clients, np.setdiff1d(plan.sampled, plan.dropouts))
        assert np.array_equal(plan.dropped, plan.dropouts) and plan.step_limits == (None,) * len(plan.clients)
        assert plan.metrics()["dropped_clients"] == len(plan.dropouts)
        assert all(plan.outcome(c) == "dropout" for c in plan.dropouts)
        total += len(plan.dropouts)
    assert within(total, rounds * k, q)


# ----------------------------------------------------------------------------- stragglers


@pytest.mark.parametrize(
    "speed, p_late",
    [
        # 10 steps of 1 s, deadline 8 s: late iff 10 / speed > 8, i.e. speed < 1.25
        ({"lognormal": 0.5}, phi(math.log(1.25) / 0.5)),  # speed = exp(0.5 z): z < ln(1.25) / 0.5
        ({"uniform": [0.5, 1.5]}, 0.75),  # (1.25 - 0.5) / (1.5 - 0.5)
    ],
)
def test_straggler_rate(speed, p_late):
    # speeds are drawn once per client, independently: the stragglers of a round that samples all
    # N clients are Bin(N, p_late)
    n = 20000
    system = System({"speed": speed, "deadline": 8.0}, epochs=1, batch_size=10)
    plan = system.round(0, 1, n, n, np.full(n, 100))
    assert np.all(plan.steps == 10)
    assert within(len(plan.stragglers), n, p_late), (len(plan.stragglers), n * p_late)
    assert np.array_equal(plan.dropped, plan.stragglers)  # stragglers: drop
    assert plan.simulated_seconds == 8.0
    speeds = system.speeds(0, n)
    if "lognormal" in speed:  # median 1
        assert within((speeds < 1).sum(), n, 0.5)


def test_partial_stragglers_keep_the_steps_they_finished():
    n, deadline, step = 400, 10.0, 3.0
    sizes = np.random.default_rng(1).integers(1, 400, n)
    system = System(
        {"speed": {"lognormal": 1.0}, "deadline": deadline, "step_seconds": step, "stragglers": "partial"},
        epochs=2,
        batch_size=16,
    )
    plan = system.round(2, 1, n, n, sizes)
    speeds, full = system.speeds(2, n), system.local_steps(sizes)
    late = set(plan.stragglers.tolist())
    assert late == {c for c in range(n) if full[c] * step / speeds[c] > deadline}
    partial = kept = 0
    for c in range(n):
        budget = math.floor(deadline * speeds[c] / step)
        if c not in late:
            assert plan.step_limit(c) is None and plan.outcome(c) == "full"
        elif budget == 0:  # finished no step in time: dropped
            assert c in plan.dropped and c not in plan.clients and plan.outcome(c) == "straggler"
        else:
            assert plan.step_limit(c) == budget and 0 < budget < full[c] and plan.outcome(c) == "partial"
            partial += 1
        kept += c in plan.clients
    assert partial > 20 and len(plan.dropped) > 5  # both kinds happen in this federation
    assert plan.metrics() == {
        "unavailable": 0,
        "dropped_clients": len(plan.dropped),
        "stragglers": len(late),
        "simulated_seconds": deadline,
    }
    assert kept == len(plan.clients) == len(plan.step_limits)
    # 3 s at 0.1 s a step is 30 steps, although 3 / 0.1 is 29.999999999999996
    exact = System({"deadline": 3.0, "step_seconds": 0.1, "stragglers": "partial"}, batch_size=1)
    assert exact.round(0, 1, 2, 2, [30, 31]).step_limits == (None, 30)


def test_simulated_seconds():
    sizes = np.array([10, 20, 40, 80])  # 1, 2, 4, 8 steps at batch size 10
    plain = System({"step_seconds": 2.0}, batch_size=10).round(0, 1, 4, 4, sizes)
    assert plain.simulated_seconds == 16.0 and list(plain.seconds) == [2, 4, 8, 16] and not len(plain.stragglers)
    roomy = System({"step_seconds": 2.0, "deadline": 20.0}, batch_size=10).round(0, 1, 4, 4, sizes)
    assert roomy.simulated_seconds == 16.0 and not len(roomy.stragglers)
    tight = System({"step_seconds": 2.0, "deadline": 10.0}, batch_size=10).round(0, 1, 4, 4, sizes)
    assert tight.simulated_seconds == 10.0 and list(tight.stragglers) == [3] and list(tight.clients) == [0, 1, 2]
    # dropouts do not count: the slowest client that reports sets the time
    lossy = System({"dropout": 0.5, "step_seconds": 2.0}, batch_size=10)
    for rnd in range(1, 30):
        plan = lossy.round(0, rnd, 4, 4, sizes)
        expected = max((2.0 * sizes[c] / 10 for c in plan.clients), default=0.0)
        assert plan.simulated_seconds == expected


# ----------------------------------------------------------------------------- streams


def _plan_fields(plan: RoundPlan) -> list:
    return [
        np.asarray(getattr(plan, f)).tolist() if isinstance(getattr(plan, f), np.ndarray) else getattr(plan, f)
        for f in plan.__dataclass_fields__
    ]


def test_same_seed_and_round_give_the_same_plan_whatever_ran_before():
    config = {
        "availability": {"beta": [2, 1]},
        "dropout": 0.2,
        "speed": {"lognormal": 0.8},
        "deadline": 6.0,
        "stragglers": "partial",
    }
    sizes = np.random.default_rng(0).integers(1, 100, 60)
    forward = System(config, batch_size=8)
    plans = [_plan_fields(forward.round(11, rnd, 60, 12, sizes)) for rnd in range(1, 31)]
    backward = System(config, batch_size=8)  # a resumed run: a fresh object, rounds in another order
    assert [_plan_fields(backward.round(11, rnd, 60, 12, sizes)) for rnd in range(30, 0, -1)] == plans[::-1]
    assert plans[0] != plans[1]
    assert _plan_fields(forward.round(12, 1, 60, 12, sizes)) != plans[0]


def test_a_clients_draws_depend_on_seed_round_and_client_only():
    both = System({"availability": {"uniform": [0.3, 0.9]}, "speed": {"uniform": [0.5, 2]}})
    assert np.array_equal(both.availabilities(3, 50), both.availabilities(3, 80)[:50])  # not on N
    assert np.array_equal(both.speeds(3, 50), both.speeds(3, 80)[:50])
    for rnd in range(1, 10):
        assert np.array_equal(both.online(3, rnd, 50), both.online(3, rnd, 80)[:50])
    # availability does not change with the other settings
    masks = [
        System({"availability": 0.5, **extra}, client_sampling=sampling, sampling_candidates=d).online(3, 4, 100)
        for extra, sampling, d in (
            ({}, "uniform", None),
            ({"dropout": 0.4}, "by_size", None),
            ({"speed": {"lognormal": 2}, "deadline": 1}, "power_of_choice", 30),
        )
    ]
    assert all(np.array_equal(masks[0], m) for m in masks[1:])
    # dropout of a client does not depend on k, nor on who else was sampled; a higher rate only adds
    low, high = System({"dropout": 0.2}), System({"dropout": 0.4})
    sizes = np.full(100, 10)
    for rnd in range(1, 40):
        small, large = low.round(8, rnd, 100, 10, sizes), low.round(8, rnd, 100, 60, sizes)
        for c in np.intersect1d(small.sampled, large.sampled):
            assert (c in small.dropouts) == (c in large.dropouts)
        assert set(large.dropouts) <= set(high.round(8, rnd, 100, 60, sizes).dropouts)


# ----------------------------------------------------------------------------- config


def test_documented_yaml_forms_and_defaults():
    section = parse_yaml("""
availability: {beta: [2, 1]}
dropout: 0.1
speed: {lognormal: 0.5}
deadline: 30
step_seconds: 0.5
stragglers: partial
""")
    system = System(section, client_sampling="power_of_choice", sampling_candidates=20)
    assert system.spec.availability == ("beta", 2.0, 1.0) and system.spec.speed == ("lognormal", 0.5)
    uniform = System(parse_yaml("availability: {uniform: [0.5, 1]}\nspeed: {uniform: [0.5, 2]}"))
    assert uniform.spec.availability == ("uniform", 0.5, 1.0) and uniform.spec.speed == ("uniform", 0.5, 2.0)
    assert System(SystemConfig()).spec == System().spec == System({}).spec
    plan = System(SystemConfig(), batch_size=10).round(0, 1, 10, 3, np.full(10, 25))
    assert plan.metrics() == {"unavailable": 0, "dropped_clients": 0, "stragglers": 0, "simulated_seconds": 3.0}
    assert plan.metrics(left_out=2)["dropped_clients"] == 2
    assert np.array_equal(plan.clients, plan.sampled) and plan.step_limits == (None, None, None)
    # partial without a deadline is accepted (a sweep may cross deadline: [null, 10] with it) and warned about
    assert unused_settings(load_config({"system": {"stragglers": "partial"}})) == [
        "system.stragglers is 'partial' but system.deadline is null: no client can straggle"
    ]
    assert unused_settings(load_config({"sampling_candidates": 10})) == [
        "sampling_candidates is 10 but client_sampling uniform does not use it"
    ]


def test_local_steps_count_the_last_short_batch():
    sizes = [1, 9, 10, 11, 64, 65]
    assert local_steps(sizes, 1, 10).tolist() == [len(torch.arange(n).split(10)) for n in sizes]
    assert local_steps(sizes, 3, 64).tolist() == [3, 3, 3, 3, 3, 6]
    assert System(epochs=2, batch_size=10).local_steps(sizes).tolist() == [2, 2, 2, 4, 14, 14]


@pytest.mark.parametrize(
    "section, top, key",
    [
        ({"availability": 1.5}, {}, "system.availability"),
        ({"availability": -0.1}, {}, "system.availability"),
        ({"availability": 0.0}, {}, "system.availability"),  # no one would ever train, as with dropout 1
        ({"availability": {"uniform": [0, 0]}}, {}, "system.availability"),
        ({"availability": True}, {}, "system.availability"),
        ({"availability": "often"}, {}, "system.availability"),
        ({"availability": {"uniform": [0.6, 0.2]}}, {}, "system.availability"),
        ({"availability": {"uniform": [0.5, 1.2]}}, {}, "system.availability"),
        ({"availability": {"uniform": 0.5}}, {}, "system.availability"),
        ({"availability": {"beta": [0, 1]}}, {}, "system.availability"),
        ({"availability": {"gamma": [1, 1]}}, {}, "system.availability"),
        ({"dropout": 1.0}, {}, "system.dropout"),
        ({"dropout": -0.1}, {}, "system.dropout"),
        ({"deadline": -1}, {}, "system.deadline"),
        ({"deadline": 0}, {}, "system.deadline"),
        ({"deadline": float("inf")}, {}, "system.deadline"),
        ({"deadline": "soon"}, {}, "system.deadline"),
        ({"speed": {"lognormal": -0.5}}, {}, "system.speed"),
        ({"speed": {"lognormal": 11}}, {}, "system.speed"),
        ({"speed": {"gamma": 1}}, {}, "system.speed"),
        ({"speed": {"uniform": [0, 1]}}, {}, "system.speed"),
        ({"speed": {"uniform": [2, 1]}}, {}, "system.speed"),
        ({"speed": {"uniform": [5e-324, 1]}}, {}, "system.speed"),  # a clock of inf simulated seconds
        ({"speed": {"uniform": [1, 1e31]}}, {}, "system.speed"),
        ({"speed": 2}, {}, "system.speed"),
        ({"speed": {"lognormal": 0.5, "uniform": [1, 2]}}, {}, "system.speed"),
        ({"step_seconds": 0}, {}, "system.step_seconds"),
        ({"stragglers": "wait"}, {}, "system.stragglers"),
        ({"latency": 3}, {}, "system.latency"),
        ([0.5], {}, "system"),
        ({}, {"client_sampling": "random"}, "client_sampling"),
        ({}, {"client_sampling": "power_of_choice"}, "sampling_candidates"),
        ({}, {"client_sampling": "power_of_choice", "sampling_candidates": 2.5}, "sampling_candidates"),
        ({}, {"sampling_candidates": True}, "sampling_candidates"),
        (
            {},
            {"client_sampling": "power_of_choice", "sampling_candidates": 3, "clients_per_round": 5},
            "sampling_candidates",
        ),
        (
            {},
            {"client_sampling": "power_of_choice", "sampling_candidates": 30, "num_clients": 20},
            "sampling_candidates",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_key(section, top, key):
    with pytest.raises(ConfigError) as caught:
        System.check(section, **top)
    message = str(caught.value)
    assert message.startswith(key + ": ") and "\n" not in message, message
    bounds = {"clients_per_round", "num_clients"}
    if top.keys() & bounds:  # the bounds need the run's k and N, which check_config reads from a Config
        cfg = SimpleNamespace(
            system=section,
            client_sampling=top.get("client_sampling", "uniform"),
            sampling_candidates=top.get("sampling_candidates"),
            local=SimpleNamespace(epochs=1, batch_size=8),
            clients_per_round=top.get("clients_per_round", 1),
            data=SimpleNamespace(num_clients=top.get("num_clients", 100)),
        )
        with pytest.raises(ConfigError, match=f"^{key}: "):
            System.check_config(cfg)
        System.from_config(cfg)  # built without the bounds, it has nothing to refuse
    else:
        with pytest.raises(ConfigError, match=f"^{key}: "):
            System(section, **top)


def test_the_slowest_speeds_keep_the_simulated_clock_finite():
    """Speeds are held within [1e-30, 1e30] (uniform bounds outside are refused, lognormal draws
    held there), so that the largest simulated time a run can sum, 2^63 rounds of 2^63 steps of
    3.4e38 s at the slowest speed, is finite in float64."""
    from fedsim.fl.system_config import SPEED_RANGE

    speeds = System({"speed": {"lognormal": 10.0}}).speeds(0, 100_000)
    assert SPEED_RANGE[0] <= speeds.min() < 1e-10 and 1e10 < speeds.max() <= SPEED_RANGE[1]
    assert np.isfinite(2.0**63 * 2.0**63 * 3.4e38 / SPEED_RANGE[0])
