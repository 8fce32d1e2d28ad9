"""DP-FedAvg (fedsim.fl.privacy): Poisson sampling, clipping (fixed and adaptive), the noise's scale
and streams, accounting against Google's dp-accounting, and the one-line refusals of what the
guarantee does not cover."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from fedsim.algorithms import Algorithm
from fedsim.core.blocks import row_norms
from fedsim.core.errors import ConfigError
from fedsim.experiment.config import Config
from fedsim.experiment.validation import check_privacy
from fedsim.fl import accounting, aggregation, privacy
from fedsim.fl.aggregation import AGGREGATORS
from fedsim.fl.privacy import Privacy
from fedsim.fl.sampling import draw, poisson_capacity

K, N = 4, 20  # clients per round, clients in all
C = 1.5  # the clip


def make(clip=C, noise_multiplier=1.1, delta=1e-5, k=K, n=N) -> Privacy:
    return Privacy(clip, noise_multiplier, delta, k, n)


def stack(norms, p=300, seed=0) -> torch.Tensor:
    """Float32 rows of the given L2 norms, in random directions."""
    rows = torch.randn(len(norms), p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rows *= torch.tensor(norms, dtype=torch.float64)[:, None] / rows.norm(dim=1, keepdim=True)
    return rows.float()


def config(**privacy_section) -> Config:
    cfg = Config()
    cfg.clients_per_round, cfg.data.num_clients, cfg.client_sampling = K, N, "poisson"
    cfg.privacy = privacy_section or {"clip": C, "noise_multiplier": 1.0, "delta": 1e-5}
    return cfg


def refused(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        check_privacy(cfg)  # the section and what it is combined with
    message = str(err.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- clipping


def test_clipped_norms_are_within_the_bound_and_small_updates_unchanged():
    norms = [0.0, 0.1, 0.5 * C, 0.999 * C, 1.001 * C, 2 * C, 1e3, 1e20]
    updates = stack(norms)
    clipped = make().clipped(updates)
    got = row_norms(clipped)
    assert bool((got <= C).all()), got
    small = torch.tensor(norms) < C
    assert torch.equal(clipped[small], updates[small].double())  # bit for bit
    # the large ones keep their direction and reach the bound (up to the 2^-30 margin)
    assert torch.allclose(got[~small], torch.full_like(got[~small], C), rtol=1e-8, atol=0)
    cosine = (clipped[~small] * updates[~small].double()).sum(1) / (got[~small] * row_norms(updates[~small]))
    assert torch.allclose(cosine, torch.ones_like(cosine), rtol=1e-6, atol=0)


@pytest.mark.parametrize("clip", [1e-3, 1.0, 3.4e38])
def test_huge_finite_updates_stay_finite(clip):
    limit = torch.finfo(torch.float32).max
    updates = torch.full((K, 1000), 1e38)
    updates[1] = -limit  # norm ~1e40: a float32 sum of squares overflows long before
    updates[2, ::2] = limit
    p = make(clip=clip, noise_multiplier=2.0)
    clipped = p.clipped(updates)
    assert bool(torch.isfinite(clipped).all()) and bool((row_norms(clipped) <= clip).all())
    out = p.aggregate(updates, seed=0, rnd=1)
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


def test_the_aggregate_is_the_sum_of_clipped_updates_over_clients_per_round():
    updates = stack([0.2, 3.0, 50.0], p=257)  # 3 of K = 4 reported: one dropped
    p = make(noise_multiplier=0.0)
    weights = torch.tensor([1, 1000, 7])  # sample counts do not matter under privacy
    out = p.rule(seed=0, rnd=1)(updates, weights)
    expected = p.clipped(updates).sum(0) / K  # divided by K = 4, not by the 3 that reported
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=2**-23, atol=0)
    assert torch.equal(out, p.aggregate(updates, seed=0, rnd=1))


def test_one_client_moves_the_aggregate_by_at_most_clip_over_k():
    updates = stack([0.3, 2.0, 1e6, 1e30], p=500)
    p = make(noise_multiplier=3.0)
    full = p.aggregate(updates, seed=4, rnd=9).double()
    for i in range(K):
        without = torch.cat([updates[:i], updates[i + 1 :]])
        moved = (full - p.aggregate(without, seed=4, rnd=9).double()).norm()
        # the noise is the same draw with or without the client; float32 rounding of the
        # noised result (|value| < ~5 z C / K) adds at most sqrt(P) 2^-24 of that
        assert moved <= C / K + math.sqrt(500) * 2**-23 * 5 * 3.0 * C / K, (i, float(moved))


# ----------------------------------------------------------------------------- noise


def test_the_noise_has_standard_deviation_z_times_clip():
    """With zero updates, aggregate * K is P independent N(0, (z C)^2) values. For n samples the
    sample variance s^2 satisfies (n - 1) s^2 / sigma^2 ~ chi^2(n - 1), so s / sigma has standard
    deviation ~ 1 / sqrt(2 (n - 1)) (delta method), and the sample mean sigma / sqrt(n). Six of
    these (a chance of ~2e-9 to fail for a correct noise; the draw is fixed by the seed anyway)
    gives the bounds below: about 0.95% for the std at n = 200,000."""
    n, z = 200_000, 1.3
    p = make(noise_multiplier=z)
    for rnd in (1, 2):
        noise = p.aggregate(torch.zeros(K, n), seed=11, rnd=rnd).double() * K
        sigma = z * C
        assert abs(noise.mean()) <= 6 * sigma / math.sqrt(n)
        assert abs(noise.std() / sigma - 1) <= 6 / math.sqrt(2 * (n - 1)), float(noise.std() / sigma)


def test_the_noise_depends_on_seed_and_round_only():
    p = make()
    zeros = torch.zeros(K, 1000)
    first = p.aggregate(zeros, seed=3, rnd=5)
    assert torch.equal(first, p.aggregate(zeros, seed=3, rnd=5))  # the same (seed, round): the same noise
    assert torch.equal(first, make().aggregate(zeros[:1], seed=3, rnd=5))  # whoever reported
    assert not torch.equal(first, p.aggregate(zeros, seed=3, rnd=6))
    assert not torch.equal(first, p.aggregate(zeros, seed=4, rnd=5))
    # a stream of its own: not the attack noise, nor a client's (seed, round, client) stream
    from fedsim.core import streams

    own = streams.privacy_noise_generator(3, 5).initial_seed()
    assert own not in {
        streams.attack_generator(3, 5).initial_seed(),
        streams.client_seed(3, 5, 0),
        streams.group_seed(3, 5, 0),
        *(streams.client_seed(3, r, 5) for r in range(10)),
    }


def test_zero_noise_multiplier_adds_nothing():
    updates = stack([0.5, 0.7, 0.9, 1.0])
    out = make(noise_multiplier=0.0).aggregate(updates, seed=0, rnd=1)
    assert torch.allclose(out.double(), updates.double().sum(0) / K, rtol=2**-22, atol=1e-12)


def test_an_empty_sample_still_releases_the_noise():
    out = make(noise_multiplier=1.0).aggregate(torch.zeros(0, 1000), seed=3, rnd=5)
    assert torch.equal(out, make(noise_multiplier=1.0).aggregate(torch.zeros(K, 1000), seed=3, rnd=5))
    assert float(out.abs().max()) > 0


# ----------------------------------------------------------------------------- Poisson sampling


def test_poisson_sampling_takes_each_client_independently_with_probability_k_over_n():
    """Over R rounds client c is sampled Binomial(R, q) times; six standard deviations bound
    every client's count. Pairs: P(both) = q^2 for independent coins."""
    n, k, rounds = 50, 5, 4000
    q = k / n
    taken = np.zeros((rounds, n), dtype=bool)
    everyone = np.arange(n)
    for rnd in range(1, rounds + 1):
        taken[rnd - 1, draw("poisson", 7, rnd, everyone, k, np.ones(n))] = True
    sd = math.sqrt(rounds * q * (1 - q))
    assert np.all(np.abs(taken.sum(0) - rounds * q) <= 6 * sd)
    both = (taken[:, 0] & taken[:, 1]).sum()
    assert abs(both - rounds * q * q) <= 6 * math.sqrt(rounds * q * q)
    sizes = taken.sum(1)
    assert sizes.min() < k < sizes.max()  # the sample's size varies around k
    assert poisson_capacity(7, rounds, n, k) == sizes.max()  # the buffers hold the largest sample
    # an offline client that is drawn does not train: the sample is the draw among the online ones
    online = everyone[::2]
    for rnd in range(1, 20):
        assert np.array_equal(
            draw("poisson", 7, rnd, online, k, np.ones(n)),
            np.intersect1d(draw("poisson", 7, rnd, everyone, k, np.ones(n)), online),
        )


# ----------------------------------------------------------------------------- adaptive clipping


def test_adaptive_clipping_follows_andrew_et_al():
    """One round by the paper's formulas, written out: the noised share of rows within C, then
    C <- C exp(-eta (share - gamma)); the updates' noise multiplier z_u = (z^-2 - (2 s)^-2)^(-1/2)."""
    z, s, eta, gamma = 1.0, 2.0, 0.2, 0.7
    p = Privacy(C, z, 1e-5, K, N, target_quantile=gamma, clip_learning_rate=eta, count_noise=s)
    z_u = (z**-2 - (2 * s) ** -2) ** -0.5
    assert p.update_noise == pytest.approx(z_u, rel=1e-15)
    updates = stack([0.5 * C, 0.9 * C, 3 * C], p=400)  # two within C, one above: 3 of K = 4 reported
    out = p.aggregate(updates, seed=5, rnd=2)
    generator = privacy.privacy_noise_generator(5, 2)
    noise = torch.randn(400, generator=generator, dtype=torch.float64)
    count_noise = float(torch.randn(1, generator=generator, dtype=torch.float64))
    clipped_sum = updates[:2].double().sum(0) + updates[2].double() * (C / float(updates[2].double().norm()))
    expected = (clipped_sum + z_u * C * noise) / K
    assert torch.allclose(out.double(), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    share = ((2 - 3 / 2) + s * count_noise) / K + 1 / 2
    assert p.current_clip == pytest.approx(C * math.exp(-eta * (share - gamma)), rel=1e-12)


def test_adaptive_clipping_settles_at_the_target_quantile_of_the_norms():
    """Norms 1, 2, ..., 100 every round and little count noise: C settles where about gamma of
    them are within it (the geometric update's fixed point), from far above or below."""
    updates = stack(list(range(1, 101)), p=50)
    for start in (0.01, 1e4):
        p = Privacy(start, 0.0, 1e-5, 100, 1000, target_quantile=0.3, clip_learning_rate=0.2, count_noise=0.5)
        for rnd in range(1, 301):
            p.aggregate(updates, seed=0, rnd=rnd)
        assert 25 <= p.current_clip <= 35, (start, p.current_clip)


def test_adaptive_settings_without_a_target_quantile_are_warned_about():
    from fedsim.experiment.validation import load_config, unused_settings

    cfg = load_config(
        {
            "client_sampling": "poisson",
            "clients_per_round": 2,
            "data": {"num_clients": 20},
            "privacy": {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5, "count_noise": 2},
        }
    )
    assert unused_settings(cfg) == ["privacy.count_noise is 2.0 but privacy.target_quantile is null: the clip is fixed"]


def test_adaptive_clipping_needs_count_noise_above_half_the_noise_multiplier():
    message = refused(config(clip=C, noise_multiplier=1.0, delta=1e-5, target_quantile=0.5, count_noise=0.4))
    assert message.startswith("privacy.count_noise: must be > noise_multiplier / 2 (0.5)"), message
    assert Privacy(C, 1.0, 1e-5, 100, 1000, target_quantile=0.5).count_noise == 5.0  # K / 20
    # a default that fails names the key that turned adaptive clipping on, and the one to set
    few = config(clip=C, noise_multiplier=1.0, delta=1e-5, target_quantile=0.5)
    few.clients_per_round = 10
    message = refused(few)
    assert message.startswith(
        "privacy.target_quantile: adaptive clipping needs privacy.count_noise > noise_multiplier / 2 (0.5)"
    ), message
    assert message.endswith("its default, clients_per_round / 20, is 0.5: set privacy.count_noise")


# ----------------------------------------------------------------------------- accounting


def library_epsilon(accountant: str, q: float, z: float, rounds: int, delta: float) -> float:
    """dp-accounting's own accountant, at its default settings, for rounds of the Poisson-subsampled
    Gaussian mechanism."""
    import dp_accounting
    from dp_accounting import pld, rdp

    library = pld.PLDAccountant() if accountant == "pld" else rdp.RdpAccountant()
    library.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return library.get_epsilon(delta)


@pytest.mark.slow
@pytest.mark.parametrize("z", [0.8, 1.1])
def test_epsilon_is_dp_accountings_and_pld_is_the_tighter(z):
    """rdp: the library's RDP accountant, exactly. pld: the library's PLD accountant, whose grid
    is 1e-4 where fedsim's is 1e-3: both round every privacy loss up (pessimistic), so fedsim's
    is never below the library's, and above it by at most the grid step per composed round."""
    delta = 1e-5
    pld_, rdp_ = make(noise_multiplier=z, delta=delta), Privacy(C, z, delta, K, N, accountant="rdp")
    rounds = (1, 2, 5, 10, 50)
    pld_eps, rdp_eps = [pld_.epsilon(t) for t in rounds], [rdp_.epsilon(t) for t in rounds]
    assert all(a < b for a, b in zip(pld_eps, pld_eps[1:])), pld_eps
    for t, tight, loose in zip(rounds, pld_eps, rdp_eps):
        assert loose == library_epsilon("rdp", K / N, z, t, delta)
        exact = library_epsilon("pld", K / N, z, t, delta)
        assert exact - 1e-9 <= tight <= exact + t * 1e-3, (t, tight, exact)
        assert tight < loose


@pytest.mark.slow
def test_rdp_is_one_to_three_times_the_pld_epsilon_on_common_settings():
    for q in (0.01, 0.1):
        for z in (0.5, 1.0, 2.0):
            for rounds in (10, 100):
                tight = Privacy(C, z, 1e-5, round(q * 1000), 1000).epsilon(rounds)
                loose = Privacy(C, z, 1e-5, round(q * 1000), 1000, accountant="rdp").epsilon(rounds)
                assert 1 < loose / tight < 3.5, (q, z, rounds, tight, loose)


@pytest.mark.slow
def test_epsilon_is_a_function_of_the_round_count():
    """What a resumed run relies on: a fresh object asked for round t answers what one asked for
    every round up to t does, and asking backwards (a run resumed from an earlier checkpoint)
    too; nothing needs checkpointing."""
    steady = make()
    answers = {t: steady.epsilon(t) for t in range(1, 11)}
    assert make().epsilon(10) == answers[10]
    assert steady.epsilon(4) == answers[4] == make().epsilon(4)
    assert make().epsilon(0) == 0.0
    assert make(noise_multiplier=0.0).epsilon(3) == math.inf


def test_a_missing_dp_accounting_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting.pld.privacy_loss_distribution", None)  # import raises
    with pytest.raises(ConfigError, match=r'pip install "fedsim-sync\[privacy\]"') as err:
        make().epsilon(3)
    assert "\n" not in str(err.value)
    real = privacy.importlib.util.find_spec
    monkeypatch.setattr(
        privacy.importlib.util, "find_spec", lambda name: None if name == "dp_accounting" else real(name)
    )
    assert 'pip install "fedsim-sync[privacy]"' in refused(config())


# ----------------------------------------------------------------------------- configuration


def test_a_run_without_the_section_has_no_privacy():
    assert Privacy.from_config(Config()) is None
    cfg = config()
    cfg.privacy = None
    assert Privacy.from_config(cfg) is None


def test_the_section_as_mapping_or_object():
    section = {"clip": 2, "noise_multiplier": 0.8, "delta": 1e-6}
    for given in (section, types.SimpleNamespace(**section)):
        cfg = config()
        cfg.privacy = given
        p = Privacy.from_config(cfg)
        assert (p.clip, p.noise_multiplier, p.delta, p.sample_rate) == (2.0, 0.8, 1e-6, K / N)


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("clip", 0, "normal range"),
        ("clip", -1.0, "normal range"),
        ("clip", math.inf, "normal range"),
        ("clip", math.nan, "normal range"),
        ("clip", 1e39, "normal range"),
        ("clip", 1e-45, "normal range"),
        ("clip", True, "normal range"),
        ("clip", "1", "normal range"),
        ("noise_multiplier", -0.1, "[0,"),
        ("noise_multiplier", math.nan, "[0,"),
        ("noise_multiplier", 1e300, "[0,"),
        ("delta", 0, "(0, 1)"),
        ("delta", 1, "(0, 1)"),
        ("delta", 1.5, "(0, 1)"),
        ("delta", 0.5, "below 1 / data.num_clients (0.05)"),
        ("delta", 1 / N, "guarantees nothing"),
        ("delta", None, "required"),
        ("accountant", "gdp", "pld, rdp"),
        ("target_quantile", 1.0, "(0, 1)"),
        ("target_quantile", 0, "(0, 1)"),
        ("clip_learning_rate", 0, "normal range"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(key, value, words):
    section = {"clip": C, "noise_multiplier": 1.0, "delta": 1e-5, key: value}
    message = refused(config(**section))
    assert message.startswith(f"privacy.{key}: ") and words in message, message


def test_missing_and_unknown_keys_are_refused():
    assert refused(config(clip=1.0, delta=1e-5)).startswith("privacy.noise_multiplier: is required")
    message = refused(config(clip=1.0, noise_multiplier=1.0, delta=1e-5, sigma=2))
    assert message.startswith("privacy.sigma: unknown key") and "clip, noise_multiplier, delta, accountant" in message


@pytest.mark.parametrize("rule", sorted(set(AGGREGATORS.names()) - {"fedavg", "mean"}))
def test_rules_other_than_means_are_refused(rule):
    cfg = config()
    cfg.aggregator = rule
    message = refused(cfg)
    assert message.startswith("privacy: aggregator ") and rule in message and "fedavg or mean" in message, message


def test_a_rule_of_ones_own_is_refused_even_a_mean():
    for spec in ("fedsim.fl.aggregation:mean_of", aggregation.get("mean")):
        cfg = config()
        cfg.aggregator = spec
        assert refused(cfg).startswith("privacy: aggregator ")


def test_the_means_and_any_server_optimizer_are_allowed():
    for rule in ("fedavg", "mean"):
        for optimizer in ("none", "fedavgm", "fedadam"):
            cfg = config()
            cfg.aggregator, cfg.server_optimizer = rule, optimizer
            assert isinstance(Privacy.from_config(cfg), Privacy)


class LocalOnly(Algorithm):
    """Changes local training only: allowed."""

    def adjust_gradient(self, grad, weights, start, local):
        grad.mul_(0.5)


class OwnServerUpdate(Algorithm):
    def server_update(self, round, server, clients):
        return round.updates.mean(0)


@pytest.mark.parametrize(
    "algorithm,words",
    [
        ("scaffold", "server state"),
        ("fednova", "client reports 'steps'"),
        ("feddyn", "client state 'gradient'"),
        (OwnServerUpdate(), "its own server_update"),
    ],
)
def test_algorithms_with_state_reports_or_their_own_server_update_are_refused(algorithm, words):
    cfg = config()
    cfg.algorithm = algorithm
    message = refused(cfg)
    assert message.startswith("privacy: algorithm ") and words in message and "fedavg, fedprox" in message, message


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", LocalOnly()])
def test_algorithms_that_only_change_local_training_are_allowed(algorithm):
    cfg = config()
    cfg.algorithm = algorithm
    assert isinstance(Privacy.from_config(cfg), Privacy)


def test_models_with_buffers_are_refused():
    Privacy.check_model("mnist_cnn", 100, 100)
    with pytest.raises(ConfigError, match=r"^privacy: model my_bn_net has 8 buffer values") as err:
        Privacy.check_model("my_bn_net", 100, 108)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- in a run

RUN = {
    "name": "dp",
    "seed": 2,
    "device": "cpu",
    "rounds": 1,
    "workers": 0,
    "clients_per_round": 1,
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 5, "limit": 1000},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}


def final_weights(run_dir) -> torch.Tensor:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["global"]


def initial_weights(cfg) -> torch.Tensor:
    from fedsim.core.flat import FlatModel
    from fedsim.experiment.federation import initial_model, load_federation
    from fedsim.experiment.validation import load_config

    cfg = load_config(cfg)
    return FlatModel(initial_model(cfg, load_federation(cfg).data), "cpu").flat.detach().clone()


@pytest.mark.slow
def test_a_round_under_privacy_adds_the_clipped_noised_update(tmp_path):
    """One client per round: with the unweighted mean, the new global weights are x0 + u for the
    client's update u; under privacy they are x0 + (clip(u) + N(0, (z C)^2 I)) / 1, the noise drawn
    from the round's stream. u is read back as (x0 + u) - x0, which float32 rounds by at most
    half a unit in the last place of |x0 + u| (2^-24 relative); clipping scales by <= 1 and
    the final additions round once more each: 4 x 2^-24 x max|x| bounds every difference."""
    import fedsim

    one = {**RUN, "data": {**RUN["data"], "num_clients": 1}}  # q = 1: the one client every round
    fedsim.run({**one, "aggregator": "mean"}, out=tmp_path / "plain", quiet=True)
    section = {"clip": 0.05, "noise_multiplier": 0.7, "delta": 1e-5}
    fedsim.run({**one, "client_sampling": "poisson", "privacy": section}, out=tmp_path / "private", quiet=True)
    x0 = initial_weights(one)
    update = final_weights(tmp_path / "plain") - x0
    assert row_norms(update[None])[0] > 0.05  # the clip binds
    dp = Privacy(0.05, 0.7, 1e-5, clients_per_round=1, num_clients=1)
    expected = x0 + dp.aggregate(update[None], seed=2, rnd=1)
    got = final_weights(tmp_path / "private")
    bound = 4 * 2**-24 * float(torch.maximum(x0.abs(), got.abs()).max())
    assert float((got - expected).abs().max()) <= bound
    # the noise is there, with its scale: (got - x0 - clip(u)) ~ N(0, (0.7 x 0.05)^2), P = 199,210 values
    noise = (got - x0).double() - dp.clipped(update[None])[0]
    assert abs(noise.std() / (0.7 * 0.05) - 1) <= 6 / math.sqrt(2 * (len(noise) - 1)) + 1e-4


@pytest.mark.slow
def test_without_noise_or_clipping_privacy_is_the_unweighted_mean_divided_by_k(tmp_path):
    """z = 0 and a clip no update reaches: (sum of updates) / K, the rule mean; not fedavg, whose
    weights are the clients' unequal sample counts."""
    import fedsim

    cfg = {
        **RUN,
        "clients_per_round": 3,
        "data": {**RUN["data"], "num_clients": 3, "partition": "quantity", "sigma": 1.0},
    }  # q = 1: all three every round
    runs = {
        rule: final_weights(fedsim.run({**cfg, "aggregator": rule}, out=tmp_path / rule, quiet=True).run_dir)
        for rule in ("mean", "fedavg")
    }
    section = {"clip": 1e30, "noise_multiplier": 0.0, "delta": 1e-5}
    history = fedsim.run(
        {**cfg, "client_sampling": "poisson", "privacy": section}, out=tmp_path / "private", quiet=True
    )
    got = final_weights(tmp_path / "private")
    x0 = initial_weights(cfg)
    # the mean's and privacy's sums round differently: a few float32 units of the largest |update|
    bound = 8 * 2**-24 * float((runs["mean"] - x0).abs().max() + torch.maximum(x0.abs(), got.abs()).max())
    assert float((got - runs["mean"]).abs().max()) <= bound
    assert float((got - runs["fedavg"]).abs().max()) > 100 * bound
    assert history.epsilon == [math.inf]  # no noise, no guarantee


@pytest.mark.slow
def test_a_private_run_is_the_same_for_any_workers_resumes_exactly_and_reports_its_epsilon(tmp_path):
    """The sample and the noise are drawn on the server from (seed, round): the workers cannot
    change them; the adaptive clip is in the checkpoint, so a resumed run continues exactly.
    Epsilon after round t is dp-accounting's for t rounds at q = K / N, z, delta."""
    import fedsim

    cfg = {
        **RUN,
        "rounds": 3,
        "clients_per_round": 4,
        "eval_per_client": True,
        "client_sampling": "poisson",
        "data": {**RUN["data"], "num_clients": 10, "partition": "dirichlet", "test_partition": True},
        "privacy": {"clip": 0.5, "noise_multiplier": 1.1, "delta": 1e-5, "target_quantile": 0.5, "count_noise": 1.0},
    }
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    fedsim.run(cfg, out=tmp_path / "resumed", quiet=True, workers=1, rounds=2)
    again = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=3)
    for other in ("w2", "resumed"):
        assert torch.equal(final_weights(tmp_path / "w1"), final_weights(tmp_path / other)), other
    for column in (
        "test_accuracy",
        "test_loss",
        "train_loss",
        "epsilon",
        "clip",
        "client_accuracy_mean",
        "client_accuracy_std",
        "client_accuracy_p10",
        "clients",
    ):
        assert getattr(one, column) == getattr(two, column) == getattr(again, column), column
    assert one.clip[0] == 0.5 and len(set(one.clip)) == 3  # the clip moves every round
    sampled = [len(draw("poisson", 2, rnd, np.arange(10), 4, np.ones(10))) for rnd in (1, 2, 3)]
    assert one.clients == sampled
    for rnd, epsilon in zip(one.round, one.epsilon):
        exact = library_epsilon("pld", 4 / 10, 1.1, rnd, 1e-5)
        assert exact - 1e-9 <= epsilon <= exact + rnd * 1e-3
    assert one.epsilon[0] < one.epsilon[1] < one.epsilon[2]
    assert fedsim.load_run(tmp_path / "w1").epsilon == one.epsilon  # every bit through metrics.csv


def test_a_model_with_buffers_is_refused_in_one_line(tmp_path):
    import fedsim

    def batch_norm_net():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10), torch.nn.BatchNorm1d(10))

    section = {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}
    with pytest.raises(ConfigError, match=r"^config: privacy: model .*batch_norm_net has 20 buffer values") as err:
        fedsim.run(
            {**RUN, "client_sampling": "poisson", "privacy": section},
            model=batch_norm_net,
            out=tmp_path / "bn",
            quiet=True,
        )
    assert "\n" not in str(err.value)


def test_client_sampling_that_is_not_poisson_is_refused():
    cfg = config()
    cfg.client_sampling = "power_of_choice"
    assert refused(cfg).startswith(
        "client_sampling: power_of_choice cannot be used with privacy"
    ) and "loss" in refused(cfg)
    cfg.client_sampling = "uniform"
    assert refused(cfg).startswith(
        "client_sampling: uniform cannot be used with privacy: it samples exactly"
    ) and "use client_sampling: poisson" in refused(cfg)
    cfg = config()
    cfg.system = types.SimpleNamespace(availability=0.5)
    assert "system.availability 0.5" in refused(cfg)


def test_the_experiment_file_plans_its_sweep_and_its_plot():
    import fnmatch
    from pathlib import Path

    from support import documented_commands

    import fedsim
    from fedsim.cli import build_parser
    from fedsim.runs.sweep import plan

    path = Path("experiments/dp_fedavg.yaml")
    text = path.read_text()
    assert text.startswith("# What does client-level differential privacy cost")
    assert "McMahan, Ramage, Talwar, Zhang" in text and "ICLR 2018" in text
    cfg = fedsim.load_config(path)
    assert (cfg.privacy.clip, cfg.privacy.noise_multiplier, cfg.privacy.delta) == (
        0.2,
        1.0,
        1e-5,
    ) and cfg.client_sampling == "poisson"
    assert (cfg.aggregator, cfg.algorithm, cfg.clients_per_round, cfg.data.num_clients) == (
        "fedavg",
        "fedavg",
        100,
        1000,
    )
    sweep_command, plot_command = documented_commands(path)
    args = build_parser().parse_args(sweep_command[1:])
    runs = plan(args.config, args.grid, args.set, args.seeds)  # every point validated
    assert [run.config.privacy.noise_multiplier for run in runs] == [0, 0.5, 1.0, 2.0]
    plot = build_parser().parse_args(plot_command[1:])
    assert plot.x == "epsilon" and plot.label == "privacy.noise_multiplier"
    # the pattern takes the runs with noise: an infinite epsilon has no place on the axis
    directories = [f"runs/dp_fedavg-sweep-20250101-000000/{run.label}" for run in runs]
    assert fnmatch.filter(directories, plot.runs[0]) == directories[1:]


# ----------------------------------------------------------------------------- what the accountant and the update carry

FLOAT32 = torch.finfo(torch.float32)
CLIP_SPAN = math.log(FLOAT32.max / FLOAT32.tiny)  # ln of the range a clip may take, about 176


def tiny_run(**privacy_section) -> dict:
    """Two rounds of two clients of five expected (q = 0.4) under privacy, on 200 synthetic samples."""
    return {
        **RUN,
        "rounds": 2,
        "clients_per_round": 2,
        "client_sampling": "poisson",
        "data": {**RUN["data"], "limit": 200},
        "privacy": {"clip": 0.5, "delta": 1e-5, **privacy_section},
    }


def floor_in(message: str) -> float:
    import re

    return float(re.search(r"must be >= ([0-9.e+-]+)", message).group(1))


def test_a_tiny_noise_multiplier_is_refused_before_the_first_round(tmp_path):
    """z = 1e-30 used to train round 1 and then fail inside dp-accounting (numpy cannot make the
    PLD's 1e60 / 1e-3 grid): now one line at load time, naming the key and what is allowed."""
    import fedsim

    with pytest.raises(ConfigError) as err:
        fedsim.run(tiny_run(noise_multiplier=1e-30), out=tmp_path / "run", quiet=True)
    message = str(err.value)
    assert "\n" not in message and "privacy.noise_multiplier: must be >= " in message, message
    assert "accountant pld" in message and "accountant: rdp" in message, message
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_pld_refuses_a_grid_it_cannot_hold_and_names_the_smallest_multiplier_that_fits():
    """z = 0.001: one round's privacy losses span about 1 / (2 z^2) = 5e5, a grid of 5e8 points of
    1e-3 (minutes, gigabytes). The floor fedsim names is accepted, a quarter below it is not, and
    the RDP accountant takes z = 0.001 at once."""
    message = refused(config(clip=C, noise_multiplier=0.001, delta=1e-5))  # 10 rounds at q = 0.2
    assert message.startswith("privacy.noise_multiplier: must be >= "), message
    floor = floor_in(message)
    assert 0.01 < floor < 0.5, floor
    assert Privacy.from_config(config(clip=C, noise_multiplier=floor, delta=1e-5)).noise_multiplier == floor
    assert refused(config(clip=C, noise_multiplier=floor / 1.25, delta=1e-5)).startswith(
        "privacy.noise_multiplier: must be >= "
    )
    spans = accounting.pld_grid_points(0.001, K / N, 1) * accounting.PLD_DISCRETIZATION
    assert spans >= 0.5 / 0.001**2 - 10 / 0.001  # the losses one round reaches (with probability q)
    rdp_ = Privacy.from_config(config(clip=C, noise_multiplier=0.001, delta=1e-5, accountant="rdp"))
    assert rdp_.epsilon(10) >= 0.5 / 0.001**2 - 10 / 0.001  # a valid bound is at least one round's loss


def test_rdp_takes_tiny_multipliers_and_refuses_where_its_orders_overflow():
    """dp-accounting's RDP at z = 1e-152 returns epsilon 0 (its orders' divergences, up to
    1024^2 / (2 z^2), overflow and the NaN becomes max(0, nan) = 0): below its bound is refused.
    At z = 1e-30 its epsilon is a valid bound: at least the privacy loss of one round,
    1 / (2 z^2) - 10 / z (the loss exceeds it with probability about q / 2 > delta)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert library_epsilon("rdp", K / N, 1e-152, 10, 1e-5) == 0  # the library's silent failure
    message = refused(config(clip=C, noise_multiplier=1e-152, delta=1e-5, accountant="rdp"))
    assert message.startswith("privacy.noise_multiplier: must be >= ") and "accountant rdp" in message, message
    assert 1e-152 < floor_in(message) < 1e-140
    p = Privacy.from_config(config(clip=C, noise_multiplier=1e-30, delta=1e-5, accountant="rdp"))
    assert 0.5 / 1e-30**2 - 10 / 1e-30 <= p.epsilon(2) < math.inf


def test_pld_refuses_a_delta_below_the_mass_its_composition_cuts_off():
    """dp-accounting's PLD composition drops 1e-15 of probability and counts it as infinite loss:
    epsilon at a smaller delta is inf from round 2 on. RDP has no such floor."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    one = pld.from_gaussian_mechanism(1.0, sampling_prob=K / N, value_discretization_interval=1e-3)
    assert one.self_compose(2).get_epsilon_for_delta(1e-16) == math.inf
    message = refused(config(clip=C, noise_multiplier=1.0, delta=1e-16))
    assert message.startswith("privacy.delta: must be >= 1e-14 for accountant pld") and "rdp" in message, message
    assert math.isfinite(
        Privacy.from_config(config(clip=C, noise_multiplier=1.0, delta=1e-16, accountant="rdp")).epsilon(2)
    )
    assert Privacy.from_config(config(clip=C, noise_multiplier=0.0, delta=1e-16)).epsilon(2) == math.inf  # no noise


@pytest.mark.slow
def test_the_checks_cost_the_same_for_a_million_rounds_or_a_trillion():
    import time

    for rounds in (10**6, 10**12):
        cfg = config(clip=C, noise_multiplier=1.0, delta=1e-5)
        cfg.rounds = rounds
        start = time.perf_counter()
        message = refused(cfg)  # q = 0.2 for so many rounds reaches a privacy loss beyond pld's grid
        assert message.startswith("privacy.noise_multiplier: must be >= ") and f"over {rounds:,} rounds" in message
        cfg.privacy["accountant"] = "rdp"
        assert math.isfinite(Privacy.from_config(cfg).epsilon(rounds))
        assert time.perf_counter() - start < 5  # no per-round work


def test_a_clip_learning_rate_whose_one_step_spans_every_clip_is_refused():
    section = {"clip": C, "noise_multiplier": 1.0, "delta": 1e-5, "target_quantile": 0.3, "count_noise": 1.0}
    limit = CLIP_SPAN / 0.7  # a round moves ln C by eta (b - gamma), b in [0, 1]: at most eta * 0.7
    message = refused(config(**section, clip_learning_rate=3000))
    assert message.startswith(f"privacy.clip_learning_rate: must be <= {limit:.4g} ") and "3000" in message, message
    assert Privacy.from_config(config(**section, clip_learning_rate=limit * (1 - 1e-12))) is not None
    fixed = {**section, "target_quantile": None, "clip_learning_rate": 3000}  # unused without a quantile
    assert Privacy.from_config(config(**fixed)) is not None


def test_adaptive_clipping_keeps_the_clip_within_the_range_of_clips_whatever_the_noise():
    """The largest learning rate and a count noise that throws the share far outside [0, 1]: the
    share is clamped to [0, 1] (as tensorflow_privacy's QuantileEstimatorQuery does: a fraction
    cannot leave it, and clamping post-processes the release) and C to privacy.clip's range
    [float32 tiny, float32 max], so no round overflows; the next C is exactly that, round after
    round, from the rounds' own count noise."""
    eta, gamma, s = CLIP_SPAN / 0.5 * (1 - 1e-12), 0.5, 1e30
    p = Privacy(C, 1.0, 1e-5, K, N, target_quantile=gamma, clip_learning_rate=eta, count_noise=s)
    updates = stack([0.5, 1.0, 2.0], p=20)
    expected = C
    for rnd in range(1, 41):
        clip = p.current_clip
        p.aggregate(updates, seed=3, rnd=rnd)
        generator = privacy.privacy_noise_generator(3, rnd)
        torch.randn(20, generator=generator, dtype=torch.float64)
        within = sum(norm <= clip for norm in (0.5, 1.0, 2.0))
        share = (within - 3 / 2 + s * float(torch.randn(1, generator=generator, dtype=torch.float64))) / K + 0.5
        expected = min(max(expected * math.exp(-eta * (min(max(share, 0.0), 1.0) - gamma)), FLOAT32.tiny), FLOAT32.max)
        assert p.current_clip == pytest.approx(expected, rel=1e-12), rnd
        assert FLOAT32.tiny <= p.current_clip <= FLOAT32.max
    # a step this large lands on an end of the range (from the other end, 1.8e-10 past it: e^(176 x 1e-12))
    assert min(abs(math.log(p.current_clip / end)) for end in (FLOAT32.tiny, FLOAT32.max)) < 1e-9


@pytest.mark.slow
def test_a_large_clip_learning_rate_trains_and_privacy_names_its_own_failures(tmp_path, monkeypatch):
    """eta = 300 used to overflow math.exp in round 2, reported as "algorithm fedavg: server_update
    failed"; now the clip stays in range. An error inside privacy's update names privacy."""
    import fedsim

    adaptive = {"noise_multiplier": 1.0, "target_quantile": 0.5, "clip_learning_rate": 300, "count_noise": 1.0}
    history = fedsim.run({**tiny_run(**adaptive), "rounds": 3}, out=tmp_path / "eta", quiet=True)
    assert all(FLOAT32.tiny <= clip <= FLOAT32.max for clip in history.clip), history.clip

    def broken(updates):
        raise ArithmeticError("boom")

    monkeypatch.setattr(privacy, "row_norms", broken)
    with pytest.raises(Exception) as err:
        fedsim.run(tiny_run(noise_multiplier=1.0), out=tmp_path / "broken", quiet=True)
    message = str(err.value)
    assert message.startswith("privacy: ") and "round 1" in message and "ArithmeticError: boom" in message, message
    assert "server_update" not in message and "\n" not in message


@pytest.mark.slow
def test_the_estimated_pld_grid_follows_dp_accountings_own():
    """The grid fedsim estimates before the first round against the one dp-accounting builds: where
    the bound matters (hundreds of thousands of points) within a factor 0.4 to 1.6, and one
    round's span exact to 1%."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    for z, q, rounds in [(0.1, 0.4, 1), (0.2, 0.05, 1000), (1.0, 0.4, 1000), (0.2, 1.0, 3), (2.0, 0.4, 30000)]:
        one = pld.from_gaussian_mechanism(z, sampling_prob=q, value_discretization_interval=1e-3)
        composed = one.self_compose(rounds) if rounds > 1 else one
        actual = max(composed._pmf_remove.size, composed._pmf_add.size)
        estimate = accounting.pld_grid_points(z, q, rounds)
        assert 0.4 <= actual / estimate <= 1.6, (z, q, rounds, actual, estimate)
        if rounds == 1:
            assert actual / estimate == pytest.approx(1, abs=0.01)


def test_the_accountants_leave_the_programs_logging_alone(monkeypatch):
    """dp-accounting warns through absl, whose first message calls logging.basicConfig: a root
    handler that would make fedsim leave its own lines (the run's header) to the program's logging."""
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    configured = []
    basic_config = logging.basicConfig
    monkeypatch.setattr(logging, "basicConfig", lambda *a, **k: (configured.append(1), basic_config(*a, **k)))
    accounting.pld_grid_points(1.0, 0.1, 2)  # an RDP order dp-accounting warns about
    assert configured and root.handlers == []
    own = logging.StreamHandler()
    root.addHandler(own)
    accounting.pld_grid_points(1.0, 0.1, 2)
    assert root.handlers == [own]  # the program's own set-up stays


@pytest.mark.slow
def test_a_run_that_adaptive_clipping_breaks_names_the_clipping_key(tmp_path):
    """A clip_learning_rate that the bounds allow can still move the clip to where training fails:
    the stop names privacy's key beside local.lr, and where the clip went."""
    import fedsim
    from fedsim.core.errors import NonFiniteError

    changes = {"data.dataset": "synthetic", "data.limit": 2000, "data.num_clients": 100, "clients_per_round": 10}
    changes |= {"privacy.target_quantile": 0.5, "privacy.clip_learning_rate": 350, "privacy.count_noise": 1}
    with pytest.raises(NonFiniteError) as error:
        fedsim.run("dp_fedavg", out=tmp_path / "run", quiet=True, device="cpu", workers=0, rounds=6, **changes)
    message = str(error.value)
    assert (
        "lower local.lr or privacy.clip_learning_rate (adaptive clipping has moved privacy.clip from 0.2 to" in message
    )
