"""The simulated clock charges every local step a client takes, whatever the algorithm: Ditto's
personal and global models, FedRep's head and body phases. On the tiny problem of
test_algorithms (3 clients of 3, 6 and 11 samples, one class each), batch 2: one epoch is 2, 3
and 6 steps."""

from __future__ import annotations

import math

import pytest
import torch
from support import Recorder
from test_algorithms import CLASSES, COUNTS, tiny_linear, tiny_samples

import fedsim
from fedsim.data import from_tensors

BATCH = 2
EPOCH_STEPS = {n: math.ceil(n / BATCH) for n in COUNTS}  # samples -> steps of one epoch


def run(tmp_path, algorithm, system, *, rounds=2, clients_per_round=3, steps=None, name=None, **options):
    """The tiny problem under ``algorithm`` (its options), local.steps ``steps`` and the ``system:``
    section, written under ``name`` (None: the algorithm's); the recorder."""
    samples = tiny_samples()
    labels = torch.repeat_interleave(torch.arange(CLASSES), torch.tensor(COUNTS))
    cfg = {
        "name": "clock",
        "seed": 0,
        "device": "cpu",
        "rounds": rounds,
        "workers": 0,
        "clients_per_round": clients_per_round,
        "algorithm": algorithm,
        "algorithm_options": options,
        "data": {"partition": "label_k", "classes_per_client": 1, "num_clients": 3},
        "local": {"epochs": 1, "batch_size": BATCH, "lr": 0.1, "steps": steps},
        "system": system,
    }
    recorder = Recorder()
    fedsim.run(
        cfg,
        out=tmp_path / (name or algorithm),
        quiet=True,
        callbacks=[recorder],
        model=tiny_linear,
        dataset=from_tensors(samples[labels], labels, samples, torch.arange(CLASSES)),
    )
    return recorder


def by_samples(recorder, rnd):
    """Round ``rnd``'s client records, keyed by the client's number of samples (one per client)."""
    return {c["samples"]: c for c in recorder.clients if c["round"] == rnd}


@pytest.mark.parametrize(
    "algorithm, options, phase_epochs",
    [("ditto", {"personal_epochs": 2}, (2, 1)), ("fedrep", {"personal_layers": ["bias"], "head_epochs": 3}, (3, 1))],
)
def test_without_a_deadline_the_round_lasts_every_phase_of_its_slowest_client(
    tmp_path, algorithm, options, phase_epochs
):
    """simulated_seconds is the slowest sampled client's steps over both phases x step_seconds (speed 1),
    and clients.csv counts the steps of both phases."""
    recorder = run(tmp_path, algorithm, {"step_seconds": 0.25}, rounds=3, clients_per_round=2, **options)
    for rnd, row in enumerate(recorder.rows, start=1):
        clients = by_samples(recorder, rnd)
        steps = {n: sum(phase_epochs) * EPOCH_STEPS[n] for n in clients}
        assert {n: c["steps"] for n, c in clients.items()} == steps
        assert row["simulated_seconds"] == max(steps.values()) * 0.25
        assert row["stragglers"] == 0


def test_a_ditto_straggler_spends_one_budget_on_both_models(tmp_path):
    """Deadline 5 s, 1 s a step: 5 steps in all. Ditto's 4, 6 and 12 steps (2, 3 and 6 per model):
    the 3-sample client is in time; the 6-sample one, in time under FedAvg (3 steps), is late and
    takes 3 personal steps and 2 global ones; the 11-sample one spends its 5 steps before its global
    model starts, sends nothing and is dropped."""
    system = {"deadline": 5, "stragglers": "partial"}
    fedavg, ditto = run(tmp_path, "fedavg", system), run(tmp_path, "ditto", system)
    for rnd in (1, 2):
        plain, two = by_samples(fedavg, rnd), by_samples(ditto, rnd)
        assert {n: (c["steps"], c["dropped"]) for n, c in plain.items()} == {3: (2, 0), 6: (3, 0), 11: (5, 0)}
        assert {n: (c["steps"], c["dropped"]) for n, c in two.items()} == {3: (4, 0), 6: (5, 0), 11: (0, "straggler")}
        assert fedavg.rows[rnd - 1]["stragglers"] == 1 and ditto.rows[rnd - 1]["stragglers"] == 2
        assert ditto.rows[rnd - 1]["simulated_seconds"] == 5.0


def test_a_fedrep_straggler_spends_one_budget_on_head_and_body(tmp_path):
    """Deadline 7 steps; FedRep with 2 head epochs: 6, 9 and 18 steps. The 6-sample client, in time
    under FedAvg, is late: 6 head steps and 1 body step; the 11-sample one's 7 steps end within its
    12 head steps, so it is dropped."""
    system = {"deadline": 7, "stragglers": "partial"}
    fedrep = run(tmp_path, "fedrep", system, personal_layers=["bias"], head_epochs=2)
    fedavg = run(tmp_path, "fedavg", system)
    for rnd in (1, 2):
        assert {n: c["dropped"] for n, c in by_samples(fedavg, rnd).items()} == {3: 0, 6: 0, 11: 0}
        assert fedavg.rows[rnd - 1]["stragglers"] == 0
        two = by_samples(fedrep, rnd)
        assert {n: (c["steps"], c["dropped"]) for n, c in two.items()} == {3: (6, 0), 6: (7, 0), 11: (0, "straggler")}
        assert fedrep.rows[rnd - 1]["stragglers"] == 2
        assert max(c["steps"] for c in two.values()) <= 7


def test_under_local_steps_a_ditto_straggler_spends_its_budget_on_both_capped_models(tmp_path):
    """local.steps 2, personal_steps 3: the clients of 2, 3 and 6 steps an epoch work 2 + 2, 3 + 2
    and 3 + 2 steps. Deadline 4 (1 s a step): the 3-sample client is in time; the two others are
    late and send a global model of 1 step. Deadline 3: the 3-sample client sends 1 global step;
    the others' 3 steps end with their personal models, so they are dropped, not sent untrained."""
    options = {"personal_steps": 3}
    free = run(tmp_path, "ditto", {}, rounds=1, steps=2, name="free", **options)
    assert {n: c["steps"] for n, c in by_samples(free, 1).items()} == {3: 4, 6: 5, 11: 5}
    late = run(tmp_path, "ditto", {"deadline": 4, "stragglers": "partial"}, rounds=1, steps=2, name="4", **options)
    assert {n: (c["steps"], c["dropped"]) for n, c in by_samples(late, 1).items()} == {3: (4, 0), 6: (4, 0), 11: (4, 0)}
    assert late.rows[0]["stragglers"] == 2 and all(c["update_norm"] > 0 for c in late.clients)
    later = run(tmp_path, "ditto", {"deadline": 3, "stragglers": "partial"}, rounds=1, steps=2, name="3", **options)
    assert {n: (c["steps"], c["dropped"]) for n, c in by_samples(later, 1).items()} == {
        3: (3, 0),
        6: (0, "straggler"),
        11: (0, "straggler"),
    }
    assert later.rows[0]["dropped_clients"] == 2
