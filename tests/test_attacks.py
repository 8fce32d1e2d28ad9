"""Byzantine clients: the seeded attacker set, the update rewrites (each attack against its
paper's equations written here, and against ByzFL's own implementation where it is installed),
and engine runs."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from support import installed, sample_clients

import fedsim
from fedsim.experiment.config import AttackConfig
from fedsim.fl import aggregation
from fedsim.fl.aggregation.preaggregation import pre_aggregated, pre_aggregator
from fedsim.fl.attacks import ATTACKS, Attack, RoundView, attacker_mask, make_attack
from fedsim.fl.attacks.omniscient import alie_z_max

needs_byzfl = pytest.mark.skipif(not installed("byzfl"), reason="byzfl is not installed")


@pytest.mark.parametrize("fraction,num_clients", [(0.2, 100), (0.1, 10), (0.3, 7), (0.5, 8), (0.01, 30)])
def test_attacker_set_has_round_fraction_times_clients_members(fraction, num_clients):
    mask = attacker_mask(5, num_clients, AttackConfig("sign_flip", fraction))
    assert mask.dtype == torch.bool and mask.shape == (num_clients,)
    assert int(mask.sum()) == round(fraction * num_clients)


def test_attacker_set_is_reproducible_and_depends_on_the_seed():
    attack = AttackConfig("gaussian", 0.2)
    first = attacker_mask(3, 100, attack)
    assert torch.equal(first, attacker_mask(3, 100, attack))
    assert not torch.equal(first, attacker_mask(4, 100, attack))
    # the set is a property of the run, not of the attack type
    assert torch.equal(first, attacker_mask(3, 100, AttackConfig("sign_flip", 0.2)))


def test_no_attack_means_no_attackers():
    assert not attacker_mask(0, 50, AttackConfig("none", 0.0)).any()


def view_of(updates, rows, generator=None, aggregate=None):
    """The round as the attackers of ``rows`` see it."""
    attackers = torch.zeros(len(updates), dtype=torch.bool, device=updates.device)
    attackers[rows] = True
    rule = aggregate or aggregation.get("mean")
    weights = torch.ones(len(updates), device=updates.device)
    return RoundView(updates, weights, attackers, generator or torch.Generator(), rule)


def corrupt_updates(attack_config, updates, rows, generator):
    """What the server does to the attackers' rows: ``updates[rows]`` rewritten in place."""
    if len(rows):
        bad = make_attack(attack_config).rewrite(view_of(updates, rows, generator))
        if bad is not None:
            updates[rows] = bad


def stack():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5000, generator=g) * torch.arange(1, 7)[:, None]


@pytest.mark.parametrize(
    "kind,scale,factor",
    [("sign_flip", 1.0, -1.0), ("sign_flip", 3.0, -3.0), ("scale", 10.0, 10.0), ("scale", -2.0, -2.0)],
)
def test_sign_flip_and_scale_rewrite_exactly_the_attacker_rows(kind, scale, factor):
    honest = stack()
    updates = honest.clone()
    rows = torch.tensor([1, 4])
    corrupt_updates(AttackConfig(kind, 0.3, scale), updates, rows, torch.Generator().manual_seed(1))
    for i in range(6):
        expected = honest[i] * factor if i in (1, 4) else honest[i]
        assert torch.equal(updates[i], expected), i


def test_gaussian_sends_noise_with_the_honest_rows_standard_deviation():
    honest = stack()
    rows = torch.tensor([0, 5])
    updates = honest.clone()
    corrupt_updates(AttackConfig("gaussian", 0.3), updates, rows, torch.Generator().manual_seed(1))
    again = honest.clone()
    corrupt_updates(AttackConfig("gaussian", 0.3), again, rows, torch.Generator().manual_seed(1))
    assert torch.equal(updates, again)  # the generator decides the noise
    assert torch.equal(updates[1:5], honest[1:5])
    for i in (0, 5):
        assert not torch.equal(updates[i], honest[i])
        assert abs(float(updates[i].std()) / float(honest[i].std()) - 1) < 0.05
        assert abs(float(updates[i].mean())) < 0.05 * float(honest[i].std())
        assert abs(float(torch.corrcoef(torch.stack([updates[i], honest[i]]))[0, 1])) < 0.05  # not the update


@pytest.mark.parametrize("kind", ["none", "label_flip"])
def test_attacks_that_do_not_touch_updates(kind):
    honest = stack()
    updates = honest.clone()
    corrupt_updates(AttackConfig(kind, 0.3), updates, torch.tensor([0, 1]), torch.Generator().manual_seed(1))
    assert torch.equal(updates, honest)


def test_no_attacker_rows_means_no_change():
    honest = stack()
    updates = honest.clone()
    corrupt_updates(
        AttackConfig("sign_flip", 0.3), updates, torch.tensor([], dtype=torch.int64), torch.Generator().manual_seed(1)
    )
    assert torch.equal(updates, honest)


def test_every_attack_is_registered_with_a_description():
    described = dict(ATTACKS.describe())
    assert {"none", "sign_flip", "scale", "gaussian", "label_flip"} <= set(described)


@pytest.mark.slow
def test_engine_counts_the_sampled_attackers_each_round(small_config, tmp_path):
    cfg = dict(small_config, aggregator="median", attack={"type": "sign_flip", "fraction": 0.25, "scale": 1.0})
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    resolved = fedsim.load_config(cfg)
    n, k = resolved.data.num_clients, resolved.clients_per_round
    mask = attacker_mask(resolved.seed, n, resolved.attack)
    expected = [int(mask[sample_clients(resolved.seed, r, n, k)].sum()) for r in history.round]
    assert history.attackers == expected
    assert max(history.attackers) > 0
    assert history.test_accuracy[-1] > 0.3, history.test_accuracy  # the median shrugs off 2 of 8 attackers


# ----------------------------------------------------------------------------- omniscient attacks


def honest_round(h=8, p=300, seed=0):
    """h honest updates with a common drift, and 3 attackers' rows (their own honest updates)."""
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(h, p, generator=g) * 0.1 + torch.linspace(-1, 1, p)
    own = torch.randn(3, p, generator=g)
    return torch.cat([honest, own]), torch.arange(h, h + 3)


def sent_by(kind, updates, rows, aggregate=None, **options):
    """What every attacker of ``rows`` sends, as one [P] row (they must all send it)."""
    out = make_attack(AttackConfig(kind, 0.3, options=options)).rewrite(view_of(updates, rows, aggregate=aggregate))
    out = out.expand(len(rows), -1) if out.dim() == 1 else out
    assert all(torch.equal(row, out[0]) for row in out)
    return out[0]


def test_alie_z_max_follows_baruch_et_al():
    # s = floor(n/2 + 1) - f; z = Phi^-1((n - f - s) / (n - f))
    for n, f in [(10, 1), (10, 3), (50, 12), (11, 4)]:
        s = math.floor(n / 2 + 1) - f
        assert alie_z_max(n, f) == pytest.approx(NormalDist().inv_cdf((n - f - s) / (n - f)), abs=1e-12)
    assert alie_z_max(10, 1) == pytest.approx(-0.1397, abs=1e-4)  # negative for few attackers
    assert 0 < alie_z_max(50, 12) < alie_z_max(50, 20)  # more attackers hide farther out


@pytest.mark.parametrize("z", [None, 1.5, -0.3])
def test_alie_sends_mean_plus_z_std_of_the_honest_updates(z):
    updates, rows = honest_round()
    honest = updates[:8].double()
    used = alie_z_max(11, 3) if z is None else z
    # mu + z sigma of the gradients, whose direction is minus the updates'
    expected = honest.mean(0) - used * honest.std(0, correction=1)
    got = sent_by("alie", updates, rows, **({} if z is None else {"z": z}))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_alie_in_a_round_of_attackers_only_sends_their_own_mean(caplog):
    """No honest update to hide among: z_max is +inf (the attackers are all of the round), which the
    attack takes as 0, and what it averages is their own honest updates."""
    assert alie_z_max(3, 3) == math.inf and alie_z_max(1, 1) == math.inf
    updates = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    sent = make_attack(AttackConfig("alie", 0.5)).rewrite(view_of(updates, torch.arange(3)))
    torch.testing.assert_close(sent, updates.mean(0))
    assert any("majority" in r.message for r in caplog.records)


def test_alie_warns_once_when_z_max_is_not_positive(caplog):
    updates = torch.randn(10, 20, generator=torch.Generator().manual_seed(0))
    attack = make_attack(AttackConfig("alie", 0.1))
    for _ in range(3):
        attack.rewrite(view_of(updates, torch.tensor([9])))
    warnings = [r.message for r in caplog.records if "z_max" in r.message]
    assert len(warnings) == 1 and "-0.14" in warnings[0] and "attack.options.z" in warnings[0]


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 2.0])
def test_ipm_sends_minus_epsilon_times_the_honest_mean(epsilon):
    updates, rows = honest_round()
    torch.testing.assert_close(sent_by("ipm", updates, rows, epsilon=epsilon), -epsilon * updates[:8].mean(0))


def minmax_reference(honest, perturbation, minsum):
    """Shejwalkar & Houmansadr's search, as their code writes it (float64 distances)."""
    honest = honest.double()
    mean = honest.mean(0)
    deviation = {"unit_vec": mean / mean.norm(), "sign": mean.sign(), "std": honest.std(0)}[perturbation]
    between = torch.cdist(honest, honest) ** 2
    threshold = between.sum(1).min() if minsum else between.max()
    lamda, lamda_fail, lamda_succ = 10.0, 10.0, 0.0
    while abs(lamda_succ - lamda) > 1e-5:
        distance = ((honest - (mean - lamda * deviation)) ** 2).sum(1)
        if (distance.sum() if minsum else distance.max()) <= threshold:
            lamda_succ = lamda
            lamda = lamda + lamda_fail / 2
        else:
            lamda = lamda - lamda_fail / 2
        lamda_fail = lamda_fail / 2
    return mean - lamda_succ * deviation, lamda_succ


@pytest.mark.parametrize("kind", ["minmax", "minsum"])
@pytest.mark.parametrize("perturbation", ["unit_vec", "sign", "std"])
def test_minmax_and_minsum_follow_the_authors_search(kind, perturbation):
    updates, rows = honest_round()
    # the authors' search on the gradients' direction, minus the updates (equivariant but for std)
    expected, gamma = minmax_reference(-updates[:8], perturbation, kind == "minsum")
    expected = -expected
    assert gamma > 0
    got = sent_by(kind, updates, rows, perturbation=perturbation)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # the defining property: within the threshold
    distances = ((updates[:8].double() - got.double()) ** 2).sum(1)
    between = torch.cdist(updates[:8].double(), updates[:8].double()) ** 2
    if kind == "minmax":
        assert distances.max() <= between.max() * (1 + 1e-6)
    else:
        assert distances.sum() <= between.sum(1).min() * (1 + 1e-6)


@pytest.mark.parametrize("kind", ["minmax", "minsum"])
def test_minmax_and_minsum_send_a_mean_of_no_direction_as_it_is(kind):
    """unit_vec is mu / ||mu||, which a zero mean does not have: honest updates that cancel, or the
    Byzantine clients of attack.count in a round that no honest client reports (what they see is
    their own update, the honest mean of nothing: 0). The perturbation is then 0, and they send mu."""
    v = torch.randn(20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sent_by(kind, torch.stack([v, -v, v]), torch.tensor([2])), torch.zeros(20))
    assert torch.equal(sent_by(kind, torch.zeros(1, 20), torch.tensor([0])), torch.zeros(20))


def test_mimic_copies_the_honest_update_farthest_along_their_main_direction():
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(200, generator=g)
    spread = torch.tensor([0.1, -0.3, 0.2, 2.5, -0.2, 0.0])  # client 3 lies farthest along it
    honest = spread[:, None] * direction + 0.01 * torch.randn(6, 200, generator=g)
    updates = torch.cat([honest, torch.randn(2, 200, generator=g)])
    assert torch.equal(sent_by("mimic", updates, torch.tensor([6, 7])), honest[3])
    assert torch.equal(sent_by("mimic", updates, torch.tensor([6, 7]), target=4), honest[4])


def fang_reference(honest, attackers, seed, b=2.0):
    """Fang et al. 2020 on the median and trimmed mean, each coordinate in turn: values drawn beyond the
    honest extreme that lies against the direction the weight would move (the same uniform draws)."""
    draws = torch.rand(attackers, honest.shape[1], generator=torch.Generator().manual_seed(seed)).double()
    h = honest.double()
    out = torch.zeros(attackers, h.shape[1], dtype=torch.float64)
    for j in range(h.shape[1]):
        direction, low, high = h[:, j].mean(), h[:, j].min(), h[:, j].max()
        if direction > 0:
            a, c = (b * low, low) if low < 0 else (low / b, low)
        elif direction < 0:
            a, c = (high, b * high) if high > 0 else (high, high / b)
        else:
            a = c = 0.0
        out[:, j] = a + draws[:, j] * (c - a)
    return out


@pytest.mark.parametrize("b", [2.0, 3.5])
def test_fang_sends_values_beyond_the_honest_extremes_against_the_mean(b):
    updates, rows = honest_round()
    updates[:8, :5] = 0.0  # coordinates that would not move
    view = view_of(updates, rows)
    view.generator = torch.Generator().manual_seed(9)
    sent = make_attack(AttackConfig("fang", 0.3, options={"b": b})).rewrite(view)
    assert sent.shape == (3, updates.shape[1])
    torch.testing.assert_close(sent.double(), fang_reference(updates[:8], 3, 9, b), rtol=1e-6, atol=1e-6)
    assert (sent[:, :5] == 0).all()
    # against the median, the round's aggregate moves against the honest mean
    honest_mean = updates[:8].mean(0)
    attacked = updates.clone()
    attacked[rows] = sent
    before, after = (
        aggregation.get("median")(updates[:8], torch.ones(8)),
        aggregation.get("median")(attacked, torch.ones(11)),
    )
    assert ((after - before) * honest_mean.sign())[5:].lt(0).float().mean() > 0.95


def test_omniscient_attacks_see_only_the_honest_rows_and_ignore_their_own():
    updates, rows = honest_round()
    changed = updates.clone()
    changed[rows] = 1e6  # the attackers' own updates do not enter what they compute from the honest ones
    for kind in ("alie", "ipm", "minmax", "minsum", "mimic"):
        assert torch.equal(sent_by(kind, updates, rows), sent_by(kind, changed, rows)), kind


def test_an_unknown_attack_option_is_refused_in_one_line():
    with pytest.raises(
        fedsim.core.errors.ConfigError, match=r"attack.options: alie takes no option 'tau'; it takes: z"
    ):
        make_attack(AttackConfig("alie", 0.2, options={"tau": 1.5}))


def test_an_unknown_attack_is_refused_naming_the_import_path_form_as_the_rules_do():
    with pytest.raises(fedsim.core.errors.ConfigError) as info:
        fedsim.load_config({"attack": {"type": "alei", "count": 1}})
    assert str(info.value).startswith("config: attack.type: unknown attack 'alei' (did you mean 'alie'?); choose one")
    assert str(info.value).endswith(", sign_flip, or give an import path (pkg.module:name)")


class Misspelt(Attack):
    def rewite(self, view):  # rewrite, misspelt: the attackers would stay honest
        return -view.honest.mean(dim=0)


def test_an_attack_that_defines_neither_rewrite_nor_relabel_is_refused_in_one_line():
    with pytest.raises(
        fedsim.core.errors.ConfigError,
        match=r"^config: attack.type: Misspelt defines neither rewrite nor relabel, so its attackers would send honest",
    ):
        fedsim.load_config({"attack": {"type": "test_attacks:Misspelt", "count": 1}})
    assert make_attack(AttackConfig("none", 0.0)).rewrite(None) is None  # no attack: the one that defines neither


@pytest.mark.parametrize(
    "options, message",
    [
        ({"delta": 0}, "delta must not be 0: it is the search's first step from start"),
        ({"evals": 0}, "evals"),
        ({"ratio": 1}, "ratio must be in (0.5, 1)"),
        ({"start": "x"}, "start must be a number"),
    ],
)
def test_the_line_searchs_options_are_checked_in_one_line(options, message):
    for attack in ("optimal_alie", "optimal_ipm"):
        with pytest.raises(fedsim.core.errors.ConfigError) as refused:
            fedsim.load_config({"attack": {"type": attack, "count": 1, "options": options}})
        assert "\n" not in str(refused.value) and message in str(refused.value)


class FailsToBuild(Attack):
    def __init__(self, factor=1.0):
        raise RuntimeError("cannot build")

    def rewrite(self, view):
        return view.honest.mean(dim=0)


def test_an_attack_whose_constructor_raises_is_named_in_one_line():
    with pytest.raises(fedsim.core.errors.ConfigError) as refused:
        fedsim.load_config({"attack": {"type": FailsToBuild, "count": 1}})
    assert str(refused.value) == (
        "config: attack.type: FailsToBuild failed when it was built (RuntimeError: cannot build)"
    )


# ----------------------------------------------------------------------------- against ByzFL


def byzfl_server(f, rule="trimmed_mean"):
    """ByzFL's benchmark server: clipping, then NNM, then the trimmed mean or the geometric median
    (and fedsim's same)."""
    from byzfl.aggregators import GeometricMedian, TrMean
    from byzfl.aggregators.preaggregators import NNM, Clipping

    steps = [pre_aggregator({"clipping": {"max_norm": 2.0}}), pre_aggregator({"nnm": {"f": f}})]
    if rule == "trimmed_mean":
        ours, theirs = aggregation.get("trimmed_mean", f=f), TrMean(f=f)
    else:
        ours = aggregation.get("geometric_median", eps=0.1, max_iter=3, tol=0, init="zero")
        theirs = GeometricMedian(nu=0.1, T=3)
    return pre_aggregated(steps, ours, torch.Generator), theirs, [Clipping(c=2.0), NNM(f=f)]


def byzfl_round(h=10, f=3, p=400, seed=1):
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(h, p, generator=g) * 0.3 + torch.linspace(-0.2, 0.4, p)
    return torch.cat([honest, torch.zeros(f, p)]), torch.arange(h, h + f)


@needs_byzfl
@pytest.mark.parametrize("tau", [1.5, 0.5])
def test_alie_matches_byzfl(tau):
    from byzfl.attacks.attacks import ALittleIsEnough

    updates, rows = byzfl_round()
    expected = -ALittleIsEnough(tau=tau)(-updates[:10])  # ByzFL's vectors are gradients: minus the updates
    torch.testing.assert_close(sent_by("alie", updates, rows, z=tau), expected, rtol=1e-5, atol=1e-6)


@needs_byzfl
def test_ipm_and_sign_flipping_match_byzfl():
    from byzfl.attacks.attacks import InnerProductManipulation, SignFlipping

    updates, rows = byzfl_round()
    honest = updates[:10].clone()
    torch.testing.assert_close(sent_by("ipm", updates, rows, epsilon=2.0), InnerProductManipulation(tau=2.0)(honest))
    torch.testing.assert_close(sent_by("ipm", updates, rows, epsilon=1.0), SignFlipping()(honest))


@needs_byzfl
@pytest.mark.parametrize("kind", ["optimal_alie", "optimal_ipm"])
@pytest.mark.parametrize("f", [1, 3])
@pytest.mark.parametrize("rule", ["trimmed_mean", "geometric_median"])
def test_optimal_attacks_match_byzfl_against_its_benchmark_server(kind, f, rule):
    """Against the geometric median, fedsim searches in the span of the honest updates (the server's
    steps are equivariant), ByzFL on the whole vectors. Against it ALIE's vector grows until the
    clipping sends every candidate in nearly one direction: the aggregate then stops moving, up to
    rounding, and which factor past that point each search keeps is rounding too; there the test
    compares how far the two vectors move the aggregate, to float32 rounding (the distances are of
    order 1, each a norm of sums of ~15 rounded terms: 1e-5 relative)."""
    from byzfl.attacks.attacks import Optimal_ALittleIsEnough, Optimal_InnerProductManipulation

    updates, rows = byzfl_round(f=f)
    ours, agg, pre = byzfl_server(f, rule)
    theirs = (Optimal_ALittleIsEnough if kind == "optimal_alie" else Optimal_InnerProductManipulation)(
        agg=agg, pre_agg_list=pre, f=f
    )
    # ByzFL's vectors are gradients, minus the updates; its server's steps are odd functions
    expected = -theirs(-updates[:10])
    got = sent_by(kind, updates, rows, aggregate=ours)
    mean = updates[:10].mean(0)
    view = view_of(updates, rows, aggregate=ours)
    reach = float((ours(view.sending(got), view.weights) - mean).norm())
    if (rule, kind) == ("geometric_median", "optimal_alie"):
        assert expected.norm() > 1e4 and got.norm() > 1e4  # past the point where the aggregate stops
        byzfl_reach = float((ours(view.sending(expected), view.weights) - mean).norm())
        assert reach == pytest.approx(byzfl_reach, rel=1e-5)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the search keeps the farthest factor it tried: at least as far as its start (factor 0)
    start = sent_by(
        "alie" if kind == "optimal_alie" else "ipm",
        updates,
        rows,
        **{"z" if kind == "optimal_alie" else "epsilon": 0.0},
    )
    assert float((ours(view.sending(start), view.weights) - mean).norm()) <= reach


@pytest.mark.parametrize("kind", ["optimal_alie", "optimal_ipm"])
@pytest.mark.parametrize(
    "steps, rule",
    [
        ([], "geometric_median"),
        (["nnm"], "geometric_median"),
        (["bucketing"], "krum"),
        ([], "multi_krum"),
        (["nnm"], "trimmed_mean"),
        (["bucketing", "nnm"], "median"),
    ],
)
def test_the_search_in_the_span_keeps_the_factor_of_the_search_on_whole_vectors(kind, steps, rule):
    """Where the aggregate keeps moving with the factor (no clipping to make it stop), the search in
    coordinates keeps the factor the search on the [k, P] stack keeps: the same distances, up to
    rounding far below their differences. A coordinate-wise rule after equivariant steps reads the
    rows the coordinates stand for. A pipeline that is not marked (the lambda) is searched on the
    whole vectors."""
    updates, rows = byzfl_round(f=2)
    server = pre_aggregated([pre_aggregator(s) for s in steps], aggregation.get(rule), torch.Generator)
    assert aggregation.is_equivariant(server) != (rule in ("trimmed_mean", "median"))
    assert aggregation.is_expanding(server) == (rule in ("trimmed_mean", "median"))
    in_span = sent_by(kind, updates, rows, aggregate=server)
    whole = sent_by(kind, updates, rows, aggregate=lambda u, w: server(u, w))
    torch.testing.assert_close(in_span, whole, rtol=1e-5, atol=0)


def searched_on(device: str, steps: list, rule: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the vector the search keeps on ``device``, on the CPU) for both optimal attacks."""
    updates, rows = byzfl_round(f=2)
    server = pre_aggregated([pre_aggregator(s) for s in steps], aggregation.get(rule), torch.Generator)
    pairs = []
    for kind in ("optimal_alie", "optimal_ipm"):
        there = sent_by(kind, updates.to(device), rows, aggregate=server)
        assert there.device.type == device
        pairs.append((there.cpu(), sent_by(kind, updates, rows, aggregate=server)))
    return pairs


@pytest.mark.cuda
@pytest.mark.parametrize("steps, rule", [(["nnm"], "geometric_median"), (["nnm"], "trimmed_mean"), ([], "median")])
def test_the_optimal_attacks_search_on_a_gpu_as_on_the_cpu(steps, rule):
    """In the span, on the rows the span stands for, and on the whole vectors: the factor the CPU
    keeps, to the rounding of float32 on another device (the aggregate keeps moving here: no
    clipping)."""
    for gpu, cpu in searched_on("cuda", steps, rule):
        torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-5)


def test_a_round_with_a_non_finite_honest_update_is_searched_on_whole_vectors():
    updates, rows = byzfl_round(f=2)
    updates[3] = math.nan
    server = aggregation.get("geometric_median")
    got = sent_by("optimal_ipm", updates, rows, aggregate=server)
    assert torch.equal(got, sent_by("optimal_ipm", updates, rows, aggregate=lambda u, w: server(u, w)))


@needs_byzfl
def test_mimic_with_a_target_matches_byzfl():
    from byzfl.attacks.attacks import Mimic

    updates, rows = byzfl_round()
    for target in (0, 4):
        assert torch.equal(sent_by("mimic", updates, rows, target=target), Mimic(epsilon=target)(updates[:10].clone()))


# ----------------------------------------------------------------------------- runs


def attack_run(small_config, tmp_path, name, workers, **changes):
    cfg = dict(small_config, workers=workers, **changes)
    return fedsim.run(cfg, out=tmp_path / name, quiet=True)


@pytest.mark.slow
@pytest.mark.parametrize("aggregator", ["median", "geometric_median"])  # expanded after the steps; in the span
def test_an_omniscient_attack_gives_the_same_numbers_whatever_workers(small_config, tmp_path, aggregator):
    changes = dict(
        aggregator=aggregator,
        pre_aggregators=[{"clipping": {"max_norm": 1.0}}, "bucketing", "nnm"],
        attack={"type": "optimal_alie", "count": 2},
        clients_per_round=8,
    )
    inline = attack_run(small_config, tmp_path, "inline", 0, **changes)
    pooled = attack_run(small_config, tmp_path, "pooled", 2, **changes)
    assert inline.test_loss == pooled.test_loss and inline.test_accuracy == pooled.test_accuracy
    assert max(inline.attackers) == 2


@pytest.mark.slow
def test_an_attack_named_by_import_path_runs(small_config, tmp_path):
    """It sees the server's rule as the run aggregates, marked equivariant where the rule is."""
    cfg = dict(
        small_config,
        aggregator="geometric_median",
        pre_aggregators=["nnm"],
        attack={"type": "attack_of_mine:Zeros", "fraction": 0.25},
        workers=0,
    )
    (tmp_path / "attack_of_mine.py").write_text(
        "import fedsim\n\n\n"
        "class Zeros(fedsim.attacks.Attack):\n"
        "    seen = []\n\n"
        "    def rewrite(self, view):\n"
        "        self.seen.append(fedsim.aggregation.is_equivariant(view.aggregate))\n"
        "        return 0 * view.honest.mean(dim=0)\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
        from attack_of_mine import Zeros
    finally:
        sys.path.remove(str(tmp_path))
    assert max(history.attackers) > 0 and history.test_accuracy[-1] > 0.3
    assert Zeros.seen and all(Zeros.seen)


@pytest.mark.slow
def test_byzantine_clients_outside_the_federation_send_in_every_round(small_config, tmp_path):
    """attack.count: f Byzantine clients hold no data, are no client of clients.csv, and send beside
    the sampled clients in every round; the rules' f is theirs; the same numbers whatever workers."""
    changes = dict(aggregator="trimmed_mean", pre_aggregators=["nnm"], attack={"type": "ipm", "count": 2})
    inline = attack_run(small_config, tmp_path, "inline", 0, **changes)
    pooled = attack_run(small_config, tmp_path, "pooled", 2, **changes)
    assert inline.test_loss == pooled.test_loss
    assert inline.attackers == [2, 2, 2]
    assert {r["attacker"] for r in inline.client_records} == {0}
    assert {r["client"] for r in inline.client_records} <= set(range(8))
    # f = 2 of the k + f = 6 rows: the trimmed mean drops two at each end, which an explicit f = 1 does not
    explicit = attack_run(
        small_config, tmp_path, "f1", 0, **{**changes, "aggregator_options": {"f": 1}, "pre_aggregators": []}
    )
    assert explicit.test_loss != inline.test_loss


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"attack": {"type": "label_flip", "count": 1}}, "attack label_flip changes the labels an attacker trains"),
        ({"attack": {"type": "ipm", "count": 1}, "algorithm": "scaffold"}, "algorithm scaffold updates the model"),
        ({"attack": {"type": "ipm", "count": 1}, "compression": {"type": "topk"}}, "compression.type: a compressed"),
        ({"attack": {"type": "ipm", "count": 1, "fraction": 0.2}}, "attack.count: set fraction"),
    ],
)
def test_what_byzantine_clients_without_data_cannot_do_is_refused_in_one_line(changes, message):
    with pytest.raises(fedsim.core.errors.ConfigError) as refused:
        fedsim.load_config({"data": {"dataset": "synthetic"}, **changes})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_half_or_more_byzantine_clients_are_warned_before_the_run():
    from fedsim.experiment.validation import unused_settings

    def warnings(attack):
        return unused_settings(fedsim.load_config({"data": {"num_clients": 10}, "attack": attack}))

    assert warnings({"type": "ipm", "fraction": 0.4}) == []
    assert warnings({"type": "ipm", "fraction": 0.6}) == [
        "attack.fraction is 0.6: 6 of the 10 clients are Byzantine, half or more, which no aggregation rule withstands"
    ]
    assert warnings({"type": "ipm", "count": 10}) == [
        "attack.count is 10: 10 of the 20 clients of every round are Byzantine, half or more, which no aggregation "
        "rule withstands"
    ]


def tiny_attacked_step(tmp_path, name, attack=None, **changes):
    """One round of 3 honest clients (one class each) on the tiny linear model, workers 0, with the
    ``attack`` section given: the global model's step, and the run's history."""
    from test_algorithms import CLASSES, COUNTS, initial_weights, tiny_linear, tiny_samples

    from fedsim.data import from_tensors

    samples, labels = tiny_samples(), torch.repeat_interleave(torch.arange(CLASSES), torch.tensor(COUNTS))
    cfg = {
        "name": name,
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 3,
        "aggregator": "mean",
        "data": {"partition": "label_k", "classes_per_client": 1, "num_clients": 3},
        "local": {"batch_size": 2, "lr": 0.1},
        **({"attack": attack} if attack else {}),
        **changes,
    }
    dataset = from_tensors(samples[labels], labels, samples, torch.arange(CLASSES))
    history = fedsim.run(cfg, out=tmp_path / name, quiet=True, model=tiny_linear, dataset=dataset)
    state = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    return state["global"].double() - initial_weights(), history


def test_byzantine_clients_of_count_flip_the_honest_mean_as_byzfls_sign_flipping(tmp_path):
    """Holding no data, their own update is the honest clients' mean: with 3 honest clients and 2 of
    them, the mean rule's step is (3 mu - 2 mu) / 5 = mu / 5, a fifth of the step without them."""
    clean, _ = tiny_attacked_step(tmp_path, "clean")
    flipped, _ = tiny_attacked_step(tmp_path, "flipped", {"type": "sign_flip", "count": 2})
    # float32: the mean's step (|step| <= 0.2) rounded a few times, and the weights (|w| <= 1.5) once
    torch.testing.assert_close(flipped, clean / 5, rtol=0, atol=1e-6)
    assert float(clean.abs().max()) > 0.05


class SendsNaN(fedsim.attacks.Attack):
    def rewrite(self, view):
        return torch.full_like(view.honest[0], float("nan"))


@pytest.mark.slow
def test_non_finite_updates_of_count_byzantine_clients_follow_on_nonfinite(tmp_path, caplog):
    """They have no client id, but what they send is held to the rule for every client's update: fail
    stops the run in one line; drop leaves them out, warns once per run, and counts them as attackers
    and dropped every round."""
    attack = {"type": SendsNaN, "count": 2}
    with pytest.raises(fedsim.core.errors.NonFiniteError, match="for 2 of the 2 Byzantine clients of attack.count"):
        tiny_attacked_step(tmp_path, "fail", attack, on_nonfinite="fail")
    clean, _ = tiny_attacked_step(tmp_path, "clean")
    dropped, history = tiny_attacked_step(tmp_path, "drop", attack, on_nonfinite="drop")
    assert torch.equal(dropped, clean)  # the same three honest updates and rule
    assert history.attackers == [2] and history.dropped_clients == [2]
    assert any("sent non-finite (NaN/Inf) updates for 2 of the 2" in r.message for r in caplog.records)
    caplog.clear()
    _, history = tiny_attacked_step(tmp_path, "rounds", attack, on_nonfinite="drop", rounds=3)
    assert history.dropped_clients == [2, 2, 2]  # counted every round, said once
    assert sum("sent non-finite (NaN/Inf) updates" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize(
    "sent, got",
    [
        (lambda honest: honest[0][:-1], "shape (14,)"),  # the tiny linear model's 15 weights
        (lambda honest: honest[:1].expand(3, -1), "shape (3, 15)"),
        (lambda honest: honest[0].numpy(), "ndarray"),
        (lambda honest: honest[0].long(), "a tensor of torch.int64"),
    ],
)
def test_an_attack_that_returns_what_cannot_be_sent_is_named_in_one_line(tmp_path, sent, got):
    attack = type("Broken", (fedsim.attacks.Attack,), {"rewrite": lambda self, view: sent(view.honest)})
    with pytest.raises(fedsim.core.errors.UserCodeError) as refused:
        tiny_attacked_step(tmp_path, "broken", {"type": attack, "count": 2})
    message = str(refused.value)
    assert "\n" not in message and f"attack test_attacks:Broken returned {got} in round 1" in message
    assert "expected a float tensor of shape (15,)" in message and "or (2, 15), one row per attacker" in message


class Doubles(fedsim.attacks.Attack):
    def __init__(self, graph=False):
        self.graph = graph

    def rewrite(self, view):
        mean = view.honest.mean(dim=0)
        return 2 * (mean.clone().requires_grad_() if self.graph else mean)


def test_what_an_attack_sends_is_its_values_even_from_a_tensor_that_requires_grad(tmp_path):
    # the median sorts into a preallocated stack (torch.stack(out=...)), which refuses a graph
    median = {"aggregator": "median"}
    plain, _ = tiny_attacked_step(tmp_path, "plain", {"type": Doubles, "count": 2}, **median)
    graph, _ = tiny_attacked_step(
        tmp_path, "graph", {"type": Doubles, "count": 2, "options": {"graph": True}}, **median
    )
    clean, _ = tiny_attacked_step(tmp_path, "clean", **median)
    assert torch.equal(graph, plain) and not torch.equal(plain, clean)


@pytest.mark.parametrize(
    "relabelled, got",
    [
        (lambda labels: labels[:1], "torch.int64 labels of shape (1,)"),
        (lambda labels: labels.float(), "torch.float32 labels of shape (2,)"),
        (lambda labels: labels + 100, "labels from 10"),
        (lambda labels: labels.tolist(), "list"),
    ],
)
def test_an_attack_that_relabels_what_cannot_be_trained_on_is_named_in_one_line(tmp_path, relabelled, got):
    attack = type("Mislabels", (fedsim.attacks.Attack,), {"relabel": lambda self, y, classes: relabelled(y)})
    with pytest.raises(fedsim.core.errors.UserCodeError) as refused:
        tiny_attacked_step(tmp_path, "mislabels", {"type": attack, "fraction": 0.34})
    message = str(refused.value)
    assert "\n" not in message and f"attack test_attacks:Mislabels relabelled a batch as {got}" in message
    assert message.endswith("expected torch.int64 labels of shape (2,) in [0, 3)")


def test_an_attack_of_the_starting_script_is_given_again_to_resume_as_the_error_says(tmp_path):
    """config.yaml names it __main__:Name, which another process cannot import: the one-line error
    says to give it again, and the call it shows resumes the run."""
    script_attack = type("OfTheScript", (fedsim.attacks.Attack,), {"rewrite": lambda self, view: -view.honest[0]})
    script_attack.__module__ = "__main__"
    cfg = {
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 3,
        "model": "mnist_2nn",
        "data": {"dataset": "synthetic", "num_clients": 3, "limit": 300},
        "attack": {"type": script_attack, "count": 1},
    }
    fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    with pytest.raises(fedsim.core.errors.ConfigError) as refused:
        fedsim.resume(tmp_path / "run", rounds=2, quiet=True)
    assert "attack.type: __main__:OfTheScript was defined in the script that started the run" in str(refused.value)
    assert "fedsim.resume(run_dir, **{'attack.type': ...})" in str(refused.value)
    resumed = fedsim.resume(tmp_path / "run", rounds=2, quiet=True, **{"attack.type": script_attack})
    assert resumed.round == [1, 2] and resumed.attackers == [1, 1]


def test_a_fraction_that_makes_no_attacker_is_warned_before_the_run():
    from fedsim.experiment.validation import unused_settings

    attack = {"type": "ipm", "fraction": 0.05}
    cfg = fedsim.load_config({"clients_per_round": 4, "data": {"num_clients": 8}, "attack": attack})
    assert unused_settings(cfg) == [
        "attack.fraction is 0.05: round(0.05 x 8) = 0 of the 8 clients are Byzantine; no client attacks"
    ]


@pytest.mark.parametrize(
    "attack, message",
    [
        (
            {"type": "scale", "fraction": 0.2, "scale": 50, "options": {"scale": 1}},
            "attack.scale: set attack.scale or attack.options.scale, not both",
        ),
        (
            {"type": "mimic", "count": 1, "options": {"target": 4}},
            "attack.options: target 4 is past the honest updates of a round, 4 at most (clients_per_round); "
            "choose 0 to 3, or null",
        ),
    ],
)
def test_attack_options_that_would_be_ignored_are_refused_in_one_line(attack, message):
    with pytest.raises(fedsim.core.errors.ConfigError) as refused:
        fedsim.load_config({"clients_per_round": 4, "data": {"dataset": "synthetic"}, "attack": attack})
    assert str(refused.value) == f"config: {message}"


def test_attack_scale_is_read_by_an_attack_of_ones_own_that_takes_it():
    from fedsim.experiment.validation import unused_settings

    class Scaled(fedsim.attacks.Attack):
        def __init__(self, scale=1.0):
            self.scale = scale

        def rewrite(self, view):
            return self.scale * view.own

    def loaded(attack_type):
        attack = {"type": attack_type, "fraction": 0.25, "scale": 3}
        return fedsim.load_config({"clients_per_round": 4, "data": {"num_clients": 8}, "attack": attack})

    assert unused_settings(loaded(Scaled)) == [] and make_attack(loaded(Scaled).attack).scale == 3
    assert unused_settings(loaded("alie")) == ["attack.scale is 3.0 but attack.type alie does not use it"]


@pytest.mark.slow
def test_a_round_whose_every_update_overflows_after_an_attack_blew_up_the_model_says_so(small_config, tmp_path):
    """Scaled by 3e38, the attackers' updates pass the plain mean: the global CNN's weights reach about
    1e35, its next updates overflow, and the run stops naming the attack, not the learning rate."""
    attack = {"type": "scale", "count": 2, "scale": 3e38}
    words = r"the global model's weights reach [\d.]+e\+3\d, blown up by an earlier round's aggregate \(attack scale"
    with pytest.raises(fedsim.core.errors.NonFiniteError, match=words) as stopped:
        attack_run(
            small_config, tmp_path, "blown", 0, rounds=2, attack=attack, data={**small_config["data"], "limit": 400}
        )
    assert "local.lr" not in str(stopped.value)
