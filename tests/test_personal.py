"""Personal models: Ditto, FedPer and FedRep against their papers' updates computed here in
float64, each client's state kept while it is not sampled, the same bits for any workers and
across a resume, and what is refused."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_algorithms import CLASSES, COUNTS, FEATURES, U32, initial_weights, tiny_run, tiny_samples

import fedsim
from fedsim.core.errors import ConfigError

LR, BATCH = 0.1, 2
STEPS = [math.ceil(c / BATCH) for c in COUNTS]  # every batch of a client is its one sample: 2, 3 and 6 steps
WEIGHT = CLASSES * FEATURES  # the tiny model's weight, then its bias (3 values)
# Every value here stays below 2 in magnitude; a step rounds a handful of float32 operations on
# them (the 5-term logits, softmax, the product with lr, the subtraction) and lr = 0.1 keeps the
# problem contracting, so each step adds at most about 10 u 2 to a weight's error. Two rounds of
# at most 2 x 6 steps (Ditto's two models, FedRep's two phases) and a weighted mean: atol is twice
# 2 x 12 x 10 x 2 u, 5.7e-5.
ATOL = 2 * 2 * 12 * 10 * 2 * U32


def sgd(w, cls, steps, mask=None, term=None):
    """``steps`` steps of SGD on the cross-entropy of the class-``cls`` sample, from w, in float64;
    ``term(w)`` added to the gradient, coordinates where ``mask`` is 0 frozen."""
    sample = tiny_samples().double()[cls]
    for _ in range(steps):
        weight, bias = w[:WEIGHT].view(CLASSES, FEATURES).requires_grad_(), w[WEIGHT:].requires_grad_()
        loss = F.cross_entropy(F.linear(sample[None], weight, bias), torch.tensor([cls]))
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, [weight, bias])])
        w = w.detach()
        if term is not None:
            grad = grad + term(w)
        if mask is not None:
            grad = grad * mask
        w = w - LR * grad
    return w


def fedavg(x, models):
    """The fedavg rule: the mean of the clients' updates weighted by their sample counts."""
    total = sum(COUNTS[k] for k in models)
    return x + sum(COUNTS[k] / total * (w - x) for k, w in models.items())


def rows(run, name):
    """The state ``name`` of the clients holding classes 0, 1, 2 (None: a client without one)."""
    held = run.state["client_state"][name]
    return [held.get(run.holder[k]) for k in range(CLASSES)]


def check(got, expected):
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=ATOL)


def test_ditto_trains_the_personal_model_toward_the_global_one_and_keeps_it_between_rounds(tmp_path):
    """Li et al. 2021, Algorithm 1: client k updates v_k by SGD on F_k(v) + lam/2 ||v - w^t||^2 and
    its copy of w^t by plain SGD; the server averages the copies (here by the fedavg rule). v_k
    starts as the global model of the client's first round and is kept while it is not sampled.
    Two rounds of 2 of the 3 clients (one client is in both)."""
    lam = 0.5
    run = tiny_run(tmp_path / "two", "ditto", rounds=2, clients_per_round=2, algorithm_options={"lam": lam})
    x, personal = initial_weights(), {}
    for active in run.trained:
        for k in active:
            start, anchor = personal.get(k, x), x
            personal[k] = sgd(start, k, STEPS[k], term=lambda v, anchor=anchor: lam * (v - anchor))
        x = fedavg(x, {k: sgd(x, k, STEPS[k]) for k in active})
    check(run.state["global"], x)
    for k, row in enumerate(rows(run, "personal")):
        check(row, personal[k])
    # the client of round 1 that round 2 left out still holds what round 1 gave it (checked above),
    # far from the global model, from which a client without state would start
    (left_out,) = set(run.trained[0]) - set(run.trained[1])
    assert float((rows(run, "personal")[left_out] - run.state["global"]).abs().max()) > 100 * ATOL


def test_fedper_keeps_each_clients_head_and_averages_the_body(tmp_path):
    """Arivazhagan et al. 2019: a client trains the global body with its own head (here the bias,
    personal_layers [bias]), keeps the head, and the server averages the bodies; the global head
    stays as it started."""
    run = tiny_run(
        tmp_path / "run", "fedper", rounds=2, clients_per_round=2, algorithm_options={"personal_layers": ["bias"]}
    )
    x, heads = initial_weights(), {}
    for active in run.trained:
        models = {}
        for k in active:
            start = x.clone()
            start[WEIGHT:] = heads.get(k, x[WEIGHT:])
            models[k] = sgd(start, k, STEPS[k])
            heads[k] = models[k][WEIGHT:].clone()
            models[k][WEIGHT:] = x[WEIGHT:]  # the client sends its body alone
        x = fedavg(x, models)
    assert torch.equal(run.state["global"][WEIGHT:].double(), initial_weights()[WEIGHT:])
    check(run.state["global"], x)
    for k, row in enumerate(rows(run, "head")):
        check(row, heads[k])
    # the head travels neither way: each of the 2 clients a round gets and sends the 15 float32 weights of the body
    assert [(row["bytes_down"], row["bytes_up"]) for row in run.rows if row["round"]] == [(2 * 4 * WEIGHT,) * 2] * 2


def fedrep_reference(run, head_steps, body_steps) -> tuple[torch.Tensor, dict]:
    """FedRep in float64 over the run's rounds: each sampled client k trains its head (the bias)
    ``head_steps(k)`` steps from the global body, then the body ``body_steps(k)`` steps; the server
    averages the bodies. The global weights and each client's head."""
    head = torch.zeros_like(initial_weights())
    head[WEIGHT:] = 1
    x, heads = initial_weights(), {}
    for active in run.trained:
        models = {}
        for k in active:
            start = x.clone()
            start[WEIGHT:] = heads.get(k, x[WEIGHT:])
            w = sgd(sgd(start, k, head_steps(k), mask=head), k, body_steps(k), mask=1 - head)
            heads[k] = w[WEIGHT:].clone()
            w[WEIGHT:] = x[WEIGHT:]
            models[k] = w
        x = fedavg(x, models)
    return x, heads


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen(tmp_path):
    """Collins et al. 2021, Algorithm 1: head_epochs of the head alone, then local.epochs of the body
    alone; the server averages the bodies (here by the fedavg rule)."""
    run = tiny_run(
        tmp_path / "run",
        "fedrep",
        rounds=2,
        clients_per_round=2,
        algorithm_options={"personal_layers": ["bias"], "head_epochs": 2},
    )
    x, heads = fedrep_reference(run, head_steps=lambda k: 2 * STEPS[k], body_steps=lambda k: STEPS[k])
    check(run.state["global"], x)
    for k, row in enumerate(rows(run, "head")):
        check(row, heads[k])


def steps_taken(run_dir):
    """Each client's steps in each round, from clients.csv: {(round, class held): steps}."""
    return {(r["round"], COUNTS.index(r["samples"])): r["steps"] for r in fedsim.load_run(run_dir).client_records}


def test_under_local_steps_ditto_trains_the_global_model_for_local_steps_and_the_personal_one_for_its_own(tmp_path):
    """local.steps caps the global model's steps, as under any algorithm, and personal_steps the
    personal model's: with local.steps 2 and personal_steps 4 the clients of 2, 3 and 6 steps an
    epoch take 2, 3 and 4 personal steps and 2 global ones. Before, the personal model spent the
    whole budget of local.steps and the global model took no step."""
    lam = 0.5
    options = {"lam": lam, "personal_steps": 4}
    run = tiny_run(tmp_path / "run", "ditto", rounds=2, clients_per_round=2, algorithm_options=options, steps=2)
    x, personal, expected = initial_weights(), {}, {}
    for rnd, active in enumerate(run.trained, start=1):
        for k in active:
            start, anchor = personal.get(k, x), x
            personal[k] = sgd(start, k, min(STEPS[k], 4), term=lambda v, anchor=anchor: lam * (v - anchor))
            expected[rnd, k] = min(STEPS[k], 4) + 2
        x = fedavg(x, {k: sgd(x, k, 2) for k in active})
    assert not torch.equal(run.state["global"].double(), initial_weights())
    check(run.state["global"], x)
    for k in set(run.trained[0]) | set(run.trained[1]):
        check(rows(run, "personal")[k], personal[k])
    assert steps_taken(tmp_path / "run") == expected


def test_under_local_steps_fedrep_trains_the_body_for_local_steps_and_the_head_for_head_steps(tmp_path):
    """head_steps caps the head's phase (here 3 of its 2 epochs' 4, 6 and 12 steps) and local.steps
    the body's (2 of 2, 3 and 6): both phases train, and the server averages bodies that moved."""
    options = {"personal_layers": ["bias"], "head_epochs": 2, "head_steps": 3}
    run = tiny_run(tmp_path / "run", "fedrep", rounds=2, clients_per_round=2, algorithm_options=options, steps=2)
    x, heads = fedrep_reference(run, head_steps=lambda k: 3, body_steps=lambda k: 2)
    assert not torch.equal(run.state["global"][:WEIGHT].double(), initial_weights()[:WEIGHT])
    check(run.state["global"], x)
    for k in set(run.trained[0]) | set(run.trained[1]):
        check(rows(run, "head")[k], heads[k])
    assert set(steps_taken(tmp_path / "run").values()) == {5}


TINY = {
    "name": "personal",
    "seed": 1,
    "device": "cpu",
    "rounds": 3,
    "workers": 0,
    "clients_per_round": 3,
    "model": "mnist_2nn",
    "eval_per_client": True,
    "data": {
        "dataset": "synthetic",
        "num_clients": 6,
        "limit": 600,
        "partition": "dirichlet",
        "alpha": 0.1,
        "test_partition": True,
    },
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}


@pytest.mark.parametrize("algorithm", ["ditto", "fedrep"])
def test_local_steps_alone_caps_each_phase_and_every_client_sends_a_trained_model(tmp_path, algorithm):
    """local.steps 2 and no cap of the personal phase's own: 2 steps a phase, 4 a client, and every
    update moved with a finite loss (the defect: 2 personal steps, 0 global, update_norm 0, loss nan)."""
    cfg = {**TINY, "algorithm": algorithm, "rounds": 2, "local": {**TINY["local"], "steps": 2}}
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    records = history.client_records
    assert len(records) == 6 and all(r["steps"] == 4 for r in records)
    assert all(r["update_norm"] > 0 and math.isfinite(r["train_loss"]) for r in records)
    assert all(math.isfinite(loss) for loss in history.train_loss)


def test_the_bound_on_the_clients_state_is_refused_naming_the_key(tmp_path):
    # mnist_2nn has 199,210 weights: Ditto keeps 0.76 MiB per client, 4.56 MiB for 6 clients
    with pytest.raises(
        ConfigError,
        match=r"client_state_limit_mb: the clients' state would take up to 4.6 MiB of "
        r"host memory \(algorithm ditto 0.76 MiB per client, 6 clients\), over the "
        r"limit of 4.0 MiB; raise client_state_limit_mb",
    ):
        fedsim.run({**TINY, "algorithm": "ditto", "client_state_limit_mb": 4}, out=tmp_path / "run", quiet=True)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"algorithm": "ditto", "backend": "vmap"}, "config: backend: vmap trains a group's clients in lockstep"),
        (
            {"algorithm": "fedper", "privacy": {"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}},
            "privacy: algorithm fedper cannot be used with differential privacy: it has client state",
        ),
        (
            {"algorithm": "fedrep", "mode": "hogwild", "clients_per_round": 6},
            "algorithm: hogwild trains by plain local SGD",
        ),
        (
            {"algorithm": "ditto", "algorithm_options": {"lam": -1}},
            "config: algorithm_options: lam must be 0 or a number > 0",
        ),
        (
            {"algorithm": "fedrep", "algorithm_options": {"head_epochs": 0}},
            "config: algorithm_options: head_epochs must be an integer >= 1, got 0",
        ),
        (
            {"algorithm": "ditto", "algorithm_options": {"personal_steps": 0}},
            "config: algorithm_options: personal_steps must be an integer >= 1 (or null), got 0",
        ),
        (
            {"algorithm": "fedrep", "algorithm_options": {"head_steps": 1.5}},
            "config: algorithm_options: head_steps must be an integer >= 1 (or null), got 1.5",
        ),
        (
            {"algorithm": "fedper", "algorithm_options": {"personal_layers": ["fc4"]}},
            "config: algorithm_options: personal_layers names 'fc4', which is no layer of the model "
            "(did you mean 'fc3'?); its layers: fc1, fc2, fc3",
        ),
        (
            {"algorithm": "fedper", "algorithm_options": {"personal_layers": ["fc1", "fc2", "fc3"]}},
            "config: algorithm_options: personal_layers names 'fc1', 'fc2', 'fc3', which would leave nothing of "
            "the model to share",
        ),
        (
            {"algorithm": "fedper", "algorithm_options": {"personal_layers": ["fc3", "fc3"]}},
            "config: algorithm_options: personal_layers names 'fc3' twice; name each layer once",
        ),
        (
            {"algorithm": "fedper", "algorithm_options": {"head": "fc3"}},
            "algorithm_options: fedper takes no option 'head'",
        ),
    ],
)
def test_combinations_that_make_no_sense_are_refused_in_one_line(tmp_path, changes, message):
    with pytest.raises(ConfigError) as refused:
        fedsim.run({**TINY, **changes}, out=tmp_path / "run", quiet=True)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def checkpoint(path):
    return torch.load(path / "checkpoint.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, local",
    [("ditto", {}), ("fedrep", {}), ("fedproto", {}), ("ditto", {"steps": 3}), ("fedrep", {"steps": 3})],
)
def test_personal_runs_are_the_same_bits_for_any_workers_and_after_a_resume(tmp_path, algorithm, local):
    """Each client's own state and the personal scores: workers 0 and 2, and 2 rounds then a resume
    to 3, give the same bits, with local.steps too; clients left out of a round keep their rows."""
    cfg = {**TINY, "algorithm": algorithm, "local": {**TINY["local"], **local}}
    zero = fedsim.run(cfg, out=tmp_path / "w0", quiet=True)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    fedsim.run(cfg, out=tmp_path / "resumed", quiet=True, rounds=2)
    shutil.copy(tmp_path / "resumed" / "checkpoint.pt", tmp_path / "round2.pt")
    again = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=3)
    ends = {name: checkpoint(tmp_path / name) for name in ("w0", "w2", "resumed")}
    name = {"ditto": "personal", "fedrep": "head", "fedproto": "model"}[algorithm]
    for run in ("w2", "resumed"):
        assert torch.equal(ends["w0"]["global"], ends[run]["global"]), run
        held, other = ends["w0"]["client_state"][name], ends[run]["client_state"][name]
        assert held.keys() == other.keys() and all(torch.equal(held[c], other[c]) for c in held), run
    for column in ("test_accuracy", "client_accuracy_mean", "client_accuracy_p10", "train_loss", "bytes_up"):
        assert getattr(zero, column) == getattr(two, column) == getattr(again, column), column
    assert {r["model"] for r in zero.client_accuracy} == {"personal"}
    assert zero.summary["client_eval_model"] == "personal"
    round3 = {r["client"] for r in zero.client_records if r["round"] == 3}
    before = torch.load(tmp_path / "round2.pt", weights_only=True)["client_state"][name]
    kept = set(before) - round3
    assert kept and all(torch.equal(before[c], ends["w0"]["client_state"][name][c]) for c in kept)


# ----------------------------------------------------------------------------- FedBN


def fedbn_config(algorithm, **changes):
    return {
        "name": algorithm,
        "seed": 4,
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 1,
        "model": "cifar_cnn_bn",
        "algorithm": algorithm,
        "data": {"dataset": "synthetic", "num_clients": 4, "limit": 400},
        "local": {"batch_size": 16, "lr": 0.05},
        **changes,
    }


def batch_norm_mask():
    """The BN coordinates of cifar_cnn_bn's flat weights (parameters, then floating buffers), and the
    values a fresh model holds there: weight 1, bias 0, running mean 0, running variance 1."""
    from fedsim.models.zoo import CifarCNNBN

    model = CifarCNNBN(1, 10, side=28)
    named = [*model.named_parameters(), *[(n, b) for n, b in model.named_buffers() if b.is_floating_point()]]
    mask = torch.cat([torch.full((t.numel(),), n.startswith("bn")) for n, t in named])
    fresh = torch.cat([t.detach().flatten() for n, t in named if n.startswith("bn")])
    return mask, fresh


def test_fedbn_keeps_each_clients_batch_norm_and_averages_the_rest(tmp_path):
    """Li et al. 2021, Algorithm 1: the server averages every parameter but the BN layers', which
    each client keeps, running statistics included. One client a round: its trained weights are what
    FedAvg's global model becomes, so FedBN's global model must equal FedAvg's off the BN layers,
    keep a fresh model's BN values, and the client must hold FedAvg's BN values as its own."""
    fedbn = fedsim.run(fedbn_config("fedbn"), out=tmp_path / "fedbn", quiet=True)
    fedavg_run = fedsim.run(fedbn_config("fedavg"), out=tmp_path / "fedavg", quiet=True)
    ours = torch.load(tmp_path / "fedbn" / "checkpoint.pt", weights_only=False)
    theirs = torch.load(tmp_path / "fedavg" / "checkpoint.pt", weights_only=False)["global"]
    mask, fresh = batch_norm_mask()
    assert torch.equal(ours["global"][~mask], theirs[~mask])  # the same arithmetic on the shared coordinates
    assert torch.equal(ours["global"][mask], fresh)  # the BN layers never leave the clients
    (head,) = list(ours["client_state"]["head"].values())
    # the client's own BN layers: its trained values, which FedAvg's global became as x + (w - x)
    torch.testing.assert_close(head, theirs[mask], rtol=0, atol=4 * U32 * float(theirs[mask].abs().max()))
    assert not torch.equal(head, fresh)  # trained: the running statistics moved
    assert fedbn.rows[-1]["test_accuracy"] != fedavg_run.rows[-1]["test_accuracy"]
    # the BN layers, running statistics included, travel neither way: 4 bytes a value of the rest, each way
    shared = 4 * int((~mask).sum())
    assert [(r["bytes_down"], r["bytes_up"]) for r in fedbn.rows] == [(shared, shared)] * len(fedbn.rows)
    assert fedavg_run.rows[-1]["bytes_up"] == 4 * len(mask)


@pytest.mark.slow
def test_fedbn_clients_keep_their_statistics_across_rounds_and_a_resume(tmp_path):
    cfg = fedbn_config("fedbn", rounds=4, clients_per_round=2, workers=2, eval_per_client=True)
    cfg["data"] = {**cfg["data"], "test_partition": True, "partition": "dirichlet", "alpha": 0.3}
    full = fedsim.run(cfg, out=tmp_path / "full", quiet=True)
    fedsim.run(cfg, out=tmp_path / "part", quiet=True, rounds=2)
    resumed = fedsim.resume(tmp_path / "part", quiet=True, rounds=4)
    assert (resumed.test_loss, resumed.client_accuracy_mean) == (full.test_loss, full.client_accuracy_mean)
    heads = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["client_state"]["head"]
    resumed_heads = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["client_state"]["head"]
    assert heads.keys() == resumed_heads.keys() and all(torch.equal(heads[c], resumed_heads[c]) for c in heads)
    # the personal models, each with its own statistics, score far above the global model's fresh BN layers
    assert full.summary["final_personal_accuracy"] > full.final_accuracy


def test_fedbn_refuses_a_model_without_batch_norm_before_training(tmp_path):
    from fedsim.runs.parts import check_run

    cfg = fedsim.load_config(fedbn_config("fedbn", model="mnist_cnn"))
    with pytest.raises(ConfigError, match="this model has no batch norm, so fedbn would be fedavg"):
        check_run(cfg)


@pytest.mark.parametrize(
    "algorithm, why", [("fedavg", None), ("ditto", "they use models of their own"), ("fedproto", "it never trains")]
)
def test_power_of_choice_under_personal_models_is_warned_before_the_run(algorithm, why):
    from fedsim.experiment.validation import unused_settings

    cfg = fedsim.load_config(
        {
            "algorithm": algorithm,
            "client_sampling": "power_of_choice",
            "sampling_candidates": 4,
            "clients_per_round": 2,
            "eval_per_client": True,
            "data": {"num_clients": 4, "test_partition": True},
        }
    )
    said = [line for line in unused_settings(cfg) if "power_of_choice" in line]
    assert len(said) == (why is not None)
    assert why is None or f"clients of algorithm {algorithm} do not train with ({why}" in said[0]
