"""The engine under simulated system heterogeneity (system.py): who is online, sampled, lost and
late, as a run records it; partial stragglers' fewer steps in both trainers and in FedNova.

Rates are checked as in test_system.py: a count X of n independent Bernoulli(p) events has mean
np and standard deviation sqrt(np(1-p)); |X - np| > 5 sd has probability about 6e-7 (normal
approximation, n in the hundreds or more). The runs are seeded, so each check always passes or
always fails; the bound says a correct engine passes for all but a negligible share of seeds.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from support import Recorder, documented_commands

import fedsim
from fedsim.algorithms.fednova import FedNova
from fedsim.algorithms.group import GroupTrainer
from fedsim.algorithms.local import LocalTrainer
from fedsim.cli import build_parser
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.experiment.config import LocalConfig
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config, unused_settings
from fedsim.fl.system import System, local_steps
from fedsim.results.rundir import RunDirectory, read_clients
from fedsim.runs.launch import _check_same_run
from fedsim.runs.session import run_identity
from fedsim.runs.sweep import plan

U32 = 2.0**-24  # float32 unit roundoff
SD = 5.0


def within(count, n, p, sd=SD) -> bool:
    return abs(count - n * p) <= sd * math.sqrt(n * p * (1 - p))


def phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


# ----------------------------------------------------------------------------- the trainers


def sgd_reference(x, y, indices, w, b, seed, *, epochs, batch_size, lr, max_steps):
    """Plain SGD of a linear softmax model written out in float64: the client's samples shuffled
    per epoch by torch.randperm under torch.manual_seed(seed) (the trainers' convention), cut into
    batches, and stopped after ``max_steps`` steps. Returns (w, b, steps, mean loss over the
    samples trained on)."""
    torch.manual_seed(seed)
    w, b = w.double().clone(), b.double().clone()
    steps, seen, loss_sum = 0, 0, 0.0
    for _ in range(epochs):
        for batch in indices[torch.randperm(len(indices))].split(batch_size):
            if steps == max_steps:
                break
            xb, yb = x[batch].double().flatten(1), y[batch]
            p = torch.softmax(xb @ w.T + b, dim=1)
            loss_sum += float(-p[torch.arange(len(yb)), yb].log().sum())
            p[torch.arange(len(yb)), yb] -= 1  # d(mean cross-entropy)/d(logits) times the batch size
            w -= lr * (p.T @ xb) / len(yb)
            b -= lr * p.sum(dim=0) / len(yb)
            steps, seen = steps + 1, seen + len(yb)
    return w, b, steps, loss_sum / seen


def linear_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))


def test_both_trainers_stop_partial_clients_after_their_step_limit():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 1, 12, generator=g), torch.randint(0, 3, (70,), generator=g)
    # 2 epochs of batches of 8: 37 samples take 5 steps an epoch, 5 take 1, 16 take 2
    clients = [torch.arange(0, 37), torch.arange(37, 42), torch.arange(42, 58)]
    limits = [7, None, 3]  # into the second epoch; all of it; one batch into the second epoch
    seeds = [11, 22, 33]
    cfg = LocalConfig(epochs=2, batch_size=8, lr=0.3)
    module = linear_model()
    w0, b0 = module[1].weight.detach().clone(), module[1].bias.detach().clone()
    start = torch.cat([w0.flatten(), b0])
    expected = [
        sgd_reference(x, y, ix, w0, b0, s, epochs=2, batch_size=8, lr=0.3, max_steps=m)
        for ix, s, m in zip(clients, seeds, limits)
    ]
    assert [e[2] for e in expected] == [7, 2, 3]  # the full work would be 10, 2 and 4 steps

    one = LocalTrainer(FlatModel(linear_model(), "cpu"), x, y, cfg, num_classes=3)
    local = []
    for ix, s, m in zip(clients, seeds, limits):
        trained = one.train(ix, start, s, max_steps=m)
        local.append((one.model.flat.clone(), int(trained.steps), float(trained.loss)))
    weights, group = GroupTrainer(linear_model(), x, y, cfg, num_classes=3).train(
        clients, start, seeds, group_seed=5, max_steps=limits
    )

    # float32 against float64: each step's logits, softmax and batch sums carry a relative error
    # of at most (12 + 3 + 8) u (the longest sums: 12 inputs, 3 classes, 8 samples); over at most
    # 7 steps that is 7 x 23 u of the distance moved, and the mean loss is a sum of at most 37
    # terms, each log of a softmax with the same error: 2 x (23 + 37) u relative. Twice these.
    for i, (w, b, steps, loss) in enumerate(expected):
        reference = torch.cat([w.flatten(), b]).float()
        atol = 2 * 7 * 23 * U32 * float((reference - start).abs().max()) + 2 * U32 * float(reference.abs().max())
        for flat in (local[i][0], weights[i]):
            torch.testing.assert_close(flat, reference, rtol=0, atol=atol)
        assert local[i][1] == int(group.steps[i]) == steps
        assert abs(local[i][2] - loss) <= 4 * (23 + 37) * U32 * loss
        assert abs(float(group.loss[i]) - loss) <= 4 * (23 + 37) * U32 * loss


# ----------------------------------------------------------------------------- rates, whatever the workers

# 1,000 clients of 2 samples (one local step each, 1 simulated second at speed 1); a client
# straggles when 1 / speed > deadline, i.e. speed < 1 / deadline: with lognormal(sigma = 1)
# speeds that is Phi(ln(1 / deadline)), a third at deadline = exp(0.4307)
DEADLINE = math.exp(0.4307)
RATES = {
    "name": "rates",
    "seed": 4,
    "device": "cpu",
    "rounds": 15,
    "eval_every": 15,
    "clients_per_round": 40,
    "model": "mnist_cnn",
    "data": {"dataset": "synthetic", "num_clients": 1000, "limit": 2000},
    "local": {"batch_size": 64, "lr": 0.05},
    "system": {"availability": 0.7, "dropout": 0.2, "speed": {"lognormal": 1.0}, "deadline": DEADLINE},
}


@pytest.mark.slow
def test_availability_dropout_and_stragglers_at_their_rates_for_any_number_of_workers(tmp_path):
    runs = {}
    for workers in (1, 2):
        recorder = Recorder()
        fedsim.run(RATES, out=tmp_path / f"w{workers}", quiet=True, workers=workers, callbacks=[recorder])
        runs[workers] = recorder
    numbers = (
        "test_accuracy",
        "test_loss",
        "train_loss",
        "clients",
        "dropped_clients",
        "unavailable",
        "stragglers",
        "simulated_seconds",
    )
    # repr: NaN (the train loss of a lost client) compares equal to itself
    one, two = ([[repr(r[c]) for c in numbers] for r in runs[w].rows] for w in (1, 2))
    assert one == two
    assert [repr(sorted(c.items())) for c in runs[1].clients] == [repr(sorted(c.items())) for c in runs[2].clients]

    rows, records = runs[1].rows, runs[1].clients
    n, k, rounds = 1000, 40, 15
    # availability: every client, every round, online with probability 0.7
    assert within(sum(r["unavailable"] for r in rows), n * rounds, 0.3)
    # k of the ~700 online clients sampled each round; each fails before reporting with probability 0.2
    assert all(r["clients"] == k for r in rows)
    dropouts = [c for c in records if c["dropped"] == "dropout"]
    assert within(len(dropouts), k * rounds, 0.2)
    # stragglers: a client straggles in every round it reports in, or in none (its speed is drawn
    # once); so count clients, not rounds: of those that reached the deadline at least once, a
    # third are slow (which clients report does not depend on their speed)
    late = {c["client"] for c in records if c["dropped"] == "straggler"}
    reporting = {c["client"] for c in records if c["dropped"] != "dropout"}
    assert not late & {c["client"] for c in records if c["dropped"] == 0}
    assert within(len(late), len(reporting), phi(math.log(1 / DEADLINE)))
    for r in rows:
        mine = [c for c in records if c["round"] == r["round"]]
        assert r["stragglers"] == sum(c["dropped"] == "straggler" for c in mine)
        assert r["dropped_clients"] == sum(c["dropped"] != 0 for c in mine)  # no non-finite update here
        # the server waits until the deadline when someone straggles, else for the slowest reporter
        assert r["simulated_seconds"] == DEADLINE if r["stragglers"] else r["simulated_seconds"] < DEADLINE
        kept = [c for c in mine if c["dropped"] == 0]
        assert all(c["steps"] == 1 for c in kept) and all(c["steps"] == 0 for c in mine if c["dropped"])
        assert all(math.isnan(c["train_loss"]) for c in mine if c["dropped"])


# ----------------------------------------------------------------------------- partial work reaches FedNova


class RecordingFedNova(FedNova):
    """FedNova that keeps, per round, the steps each kept client reported (what it normalizes by)."""

    reported: list[dict] = []

    def server_update(self, round, server, clients):
        RecordingFedNova.reported.append(dict(zip(round.clients.tolist(), round.reports["steps"].tolist())))
        return super().server_update(round, server, clients)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", "vmap"])
def test_partial_stragglers_report_their_fewer_steps_to_fednova(tmp_path, backend):
    # 6 clients of lognormal sizes (data.partition quantity), batches of 10: client i's full work
    # is ceil(n_i / 10) steps of 1 simulated second at speed 1; a deadline of 10 s leaves the
    # larger clients 10 steps
    cfg = {
        "name": "partial",
        "seed": 1,
        "device": "cpu",
        "rounds": 2,
        "workers": 0,
        "backend": backend,
        "clients_per_round": 6,
        "model": "mnist_cnn",
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600, "partition": "quantity", "sigma": 1.0},
        "local": {"batch_size": 10, "lr": 0.05, "momentum": 0.5},
        "system": {"deadline": 10, "stragglers": "partial"},
    }
    RecordingFedNova.reported = []
    recorder = Recorder()
    fedsim.run(cfg, algorithm=RecordingFedNova(), out=tmp_path / "run", quiet=True, callbacks=[recorder])
    full = {c["client"]: -(-c["samples"] // 10) for c in recorder.clients}
    assert min(full.values()) <= 10 < max(full.values())  # full and partial clients both
    for rnd, row in enumerate(recorder.rows, start=1):
        mine = [c for c in recorder.clients if c["round"] == rnd]
        expected = {c["client"]: min(full[c["client"]], 10) for c in mine}
        assert {c["client"]: c["steps"] for c in mine} == expected  # as trained, from the trainer's count
        assert RecordingFedNova.reported[rnd - 1] == expected  # as FedNova normalizes by them
        assert all(c["dropped"] == 0 for c in mine)
        assert row["stragglers"] == sum(f > 10 for f in full.values())
        assert row["simulated_seconds"] == 10.0


# ----------------------------------------------------------------------------- power of choice


class HighestLoss:
    """Before every round, its candidates and the global model's mean loss on each one's training
    data (eval mode, one batch per client); after it, which clients the round sampled."""

    def __init__(self, config):
        federation = load_federation(config)
        self.data, self.parts = federation.data, federation.parts
        self.system, self.seed = System.from_config(config), config.seed
        self.k, self.sizes = config.clients_per_round, [len(p) for p in self.parts]
        self.candidates, self.losses, self.sampled = [], [], []

    @torch.no_grad()
    def _measure(self, model, rnd):
        model.eval()
        candidates = self.system.candidates(self.seed, rnd, len(self.parts), self.k, self.sizes).tolist()
        self.candidates.append(candidates)
        self.losses.append(
            {
                c: float(F.cross_entropy(model(self.data.train_x[self.parts[c]]), self.data.train_y[self.parts[c]]))
                for c in candidates
            }
        )

    def on_run_start(self, run):
        self.model = run.model  # the global model; its weights change every round
        self._measure(self.model, 1)

    def on_round_end(self, row, clients):
        self.sampled.append(sorted(c["client"] for c in clients))
        self._measure(self.model, row["round"] + 1)


@pytest.mark.slow
def test_power_of_choice_keeps_the_candidates_the_global_model_fits_worst(tmp_path):
    cfg = {
        "name": "pow-d",
        "seed": 2,
        "device": "cpu",
        "rounds": 3,
        "workers": 0,
        "clients_per_round": 3,
        "client_sampling": "power_of_choice",
        "sampling_candidates": 6,
        "model": "mnist_2nn",
        "data": {"dataset": "synthetic", "num_clients": 12, "limit": 600, "partition": "dirichlet", "alpha": 0.3},
        "local": {"batch_size": 20, "lr": 0.05},
    }
    observer = HighestLoss(load_config(cfg))
    fedsim.run(cfg, out=tmp_path / "run", quiet=True, callbacks=[observer])
    for candidates, losses, sampled in zip(observer.candidates, observer.losses, observer.sampled):
        assert len(candidates) == 6 and set(sampled) <= set(candidates)
        ranked = sorted(candidates, key=lambda c: -losses[c])
        assert sampled == sorted(ranked[:3]), (candidates, losses, sampled)
        # no near tie decides it (the server sums the same losses in another order)
        assert losses[ranked[2]] - losses[ranked[3]] > 1e-4


# ----------------------------------------------------------------------------- resume, config, old files

SMALL = {
    "name": "small-system",
    "seed": 3,
    "device": "cpu",
    "workers": 0,
    "clients_per_round": 4,
    "model": "mnist_2nn",
    "client_sampling": "by_size",
    "data": {"dataset": "synthetic", "num_clients": 10, "limit": 500, "partition": "quantity"},
    "local": {"batch_size": 10, "lr": 0.05},
    "system": {
        "availability": {"uniform": [0.5, 1.0]},
        "dropout": 0.2,
        "speed": {"uniform": [0.5, 2.0]},
        "deadline": 4.0,
        "stragglers": "partial",
    },
}


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_plan_and_keeps_it(tmp_path):
    full = fedsim.run(SMALL, out=tmp_path / "full", quiet=True, rounds=4)
    fedsim.run(SMALL, out=tmp_path / "part", quiet=True, rounds=2)
    resumed = fedsim.resume(tmp_path / "part", quiet=True, rounds=4)
    for column in (
        "test_accuracy",
        "train_loss",
        "clients",
        "dropped_clients",
        "unavailable",
        "stragglers",
        "simulated_seconds",
    ):
        assert getattr(resumed, column) == getattr(full, column), column
    assert (tmp_path / "part" / "clients.csv").read_text() == (tmp_path / "full" / "clients.csv").read_text()
    assert sum(full.stragglers) > 0 and sum(full.unavailable) > 0  # the settings did something
    with pytest.raises(ConfigError, match="keyword system.deadline: cannot change when resuming"):
        fedsim.resume(tmp_path / "part", quiet=True, rounds=5, **{"system.deadline": 8.0})


def test_the_keys_round_trip_and_settings_that_do_nothing_are_warned_about():
    cfg = load_config(SMALL)
    again = load_config(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.system.speed == {"uniform": [0.5, 2.0]}
    assert again.client_sampling == "by_size" and again.system.deadline == 4.0
    assert load_config({}).to_dict()["system"] == {
        "availability": 1.0,
        "dropout": 0.0,
        "speed": None,
        "deadline": None,
        "step_seconds": 1.0,
        "stragglers": "drop",
    }
    quiet = load_config({"system": {"stragglers": "partial"}, "sampling_candidates": 10})
    assert unused_settings(quiet) == [
        "sampling_candidates is 10 but client_sampling uniform does not use it",
        "system.stragglers is 'partial' but system.deadline is null: no client can straggle",
    ]


def test_files_of_an_older_version_stay_readable(tmp_path):
    # a resumed run rewrites the rows it keeps: cells of columns they lack stay empty and read as None
    old = {
        "round": 1,
        "test_accuracy": 0.5,
        "test_loss": 1.5,
        "train_loss": 1.6,
        "seconds": 2.0,
        "elapsed_seconds": 2.0,
        "clients": 4,
        "dropped_clients": 0,
        "attackers": 0,
        "train_seconds": 1.0,
        "worker_seconds": 0.9,
        "aggregate_seconds": 0.5,
        "eval_seconds": 0.5,
    }
    directory = RunDirectory(tmp_path)
    directory.write_rows([old])
    (row,) = directory.rows()
    assert row["unavailable"] is None and row["stragglers"] is None and row["simulated_seconds"] is None
    assert row["clients"] == 4
    # clients.csv before the steps column, with 1 for a non-finite update
    path = tmp_path / "clients.csv"
    path.write_text("round,client,samples,train_loss,update_norm,dropped,attacker\n1,3,50,2.1,0.5,1,0\n")
    assert read_clients(path) == [
        {"round": 1, "client": 3, "samples": 50, "train_loss": 2.1, "update_norm": 0.5, "dropped": 1, "attacker": 0}
    ]


def test_a_checkpoint_of_an_older_version_resumes_with_the_new_keys_at_their_defaults(tmp_path):
    cfg = load_config({"aggregator": "trimmed_mean", "aggregator_options": {"beta": 0.2}})
    new = ("client_sampling", "sampling_candidates", "system.")
    older = {k: v for k, v in yaml.safe_load(run_identity(cfg)).items() if not k.startswith(new)}
    state = {"config": yaml.safe_dump(older)}
    _check_same_run(tmp_path, state, cfg)  # the same run: its new keys at their defaults
    for changes, key in (
        ({"system": {"deadline": 5.0}}, "system.deadline"),
        ({"aggregator_options": {"beta": 0.3}}, "aggregator_options.beta"),
    ):
        changed = load_config({"aggregator": "trimmed_mean", "aggregator_options": {"beta": 0.2}, **changes})
        with pytest.raises(ConfigError, match=f"config.yaml says {key}: "):
            _check_same_run(tmp_path, state, changed)


def test_the_stragglers_experiment_has_a_third_of_stragglers_as_its_header_says():
    path = Path("experiments/stragglers.yaml")
    text = path.read_text()
    assert "Li et al. 2020" in text and "Wang et al. 2020" in text
    commands = documented_commands(path)
    assert commands[0] == ["fedsim", "sweep", str(path), "--grid", "algorithm=fedavg,fednova,fedprox"]
    args = build_parser().parse_args(commands[0][1:])
    runs = plan(args.config, args.grid, args.set, args.seeds)  # every point validated
    assert [run.config.algorithm for run in runs] == ["fedavg", "fednova", "fedprox"]
    cfg = runs[0].config
    assert (cfg.system.stragglers, cfg.system.deadline, cfg.system.speed) == ("partial", 30.0, {"lognormal": 0.5})
    # MNIST's 60,000 training samples in 200 shards of 300, two per client: 600 samples, 24 steps
    assert (cfg.data.partition, cfg.data.num_clients, cfg.data.shards_per_client) == ("shards", 100, 2)
    sizes = np.full(100, 60_000 // 200 * 2)
    (steps,) = set(local_steps(sizes, cfg.local.epochs, cfg.local.batch_size).tolist())
    assert steps == 24
    # a client straggles when 24 / speed > 30, speed < 0.8: Phi(ln(0.8) / 0.5) of lognormal speeds
    share = phi(math.log(steps * cfg.system.step_seconds / cfg.system.deadline) / 0.5)
    assert round(100 * share, 1) == 32.8 and "32.8 %" in text
    # what seed 0 draws: the header's 20 slow clients, and their share of the sampled clients
    system = System.from_config(cfg)
    assert int((system.speeds(cfg.seed, 100) < 0.8).sum()) == 20 and "20 such" in text
    plans = [system.round(cfg.seed, rnd, 100, 10, sizes) for rnd in range(1, cfg.rounds + 1)]
    late = sum(len(p.stragglers) for p in plans) / sum(len(p.sampled) for p in plans)
    assert f"{100 * late:.1f} %" in text


@pytest.mark.slow
def test_a_round_too_few_for_the_rule_changes_nothing_is_counted_and_resumes(tmp_path):
    """Dropouts thin some rounds below the 2f + 1 updates the trimmed mean needs for f = attack.count
    = 2: those rounds (the optimal attack's search of the rule included) leave the model as it was,
    the run goes on, summary.json counts them, and a resume keeps the count."""
    config = {
        "name": "thin",
        "rounds": 6,
        "clients_per_round": 6,
        "workers": 0,
        "eval_every": 1,
        "checkpoint_every": 1,
        "model": "mnist_2nn",
        "aggregator": "trimmed_mean",
        "data": {"dataset": "synthetic", "num_clients": 8, "limit": 400},
        "local": {"batch_size": 32, "lr": 0.05},
        "attack": {"type": "optimal_alie", "count": 2},
        "system": {"dropout": 0.5},
    }
    whole = fedsim.run(config, out=tmp_path / "whole", quiet=True)
    rows = whole.rows
    short = [i for i, row in enumerate(rows) if row["clients"] - row["dropped_clients"] + 2 < 5]
    assert [i for i in short if i > 0] and whole.summary["rounds_left_out"] == len(short)
    for i in (i for i in short if i > 0):
        assert rows[i]["test_loss"] == rows[i - 1]["test_loss"]
    assert len({row["test_loss"] for row in rows}) == len(rows) - len([i for i in short if i > 0])
    fedsim.run(config, out=tmp_path / "resumed", quiet=True, rounds=3)
    resumed = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=6)
    assert resumed.summary["rounds_left_out"] == whole.summary["rounds_left_out"]
    assert [row["test_loss"] for row in resumed.rows] == [row["test_loss"] for row in rows]
