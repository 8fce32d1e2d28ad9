"""Byzantine clients: the seeded attacker set, the update rewrites, and an engine run."""

from __future__ import annotations

import pytest
import torch
from support import sample_clients

import fedsim
from fedsim.experiment.config import AttackConfig
from fedsim.fl.attacks import ATTACKS, attacker_mask, make_attack


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


def corrupt_updates(attack_config, updates, rows, generator):
    """What the server does to the attackers' rows: ``updates[rows]`` rewritten in place."""
    if len(rows):
        bad = make_attack(attack_config).rewrite(updates[rows], generator)
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
