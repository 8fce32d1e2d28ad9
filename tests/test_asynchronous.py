"""Asynchronous rounds (mode: async): the simulated clock and FedBuff's and FedAsync's updates
against a reference written here from the papers, then whole runs across workers and resume."""

from __future__ import annotations

import json
import math
import re
import signal
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import fedsim
from fedsim.algorithms import Algorithm
from fedsim.core.errors import ConfigError, NonFiniteError
from fedsim.core.streams import async_start_generator
from fedsim.experiment.validation import load_config, unused_settings
from fedsim.fl.asynchronous import AsyncConfig, staleness_weight
from fedsim.fl.system import System
from fedsim.results.rundir import read_clients, read_metrics
from fedsim.runs.session import Session

RUN = {
    "name": "async",
    "seed": 5,
    "device": "cpu",
    "rounds": 4,
    "workers": 0,
    "clients_per_round": 4,
    "mode": "async",
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 10, "limit": 1000, "partition": "quantity"},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    "system": {"speed": {"lognormal": 1.0}, "step_seconds": 0.5},
}


def test_staleness_weights_are_fedasyncs_functions():
    """Xie et al. 2019, section 5.2: constant 1, polynomial (1 + tau)^-a, hinge 1 up to b then
    1 / (a (tau - b) + 1); FedBuff's 1 / sqrt(1 + tau) is the polynomial of a = 1/2."""
    for tau in range(12):
        assert staleness_weight(AsyncConfig(staleness="constant"), tau) == 1.0
        assert staleness_weight(AsyncConfig(), tau) == pytest.approx(1 / math.sqrt(1 + tau), rel=1e-15)
        hinge = AsyncConfig(staleness="hinge", staleness_a=2.0, staleness_b=3)
        assert staleness_weight(hinge, tau) == (1.0 if tau <= 3 else 1 / (2 * (tau - 3) + 1))


class FakeTraining:
    """An executor whose "training" is a known function of the start, the client and its stream
    key, so that the reference below can compute every client's weights itself."""

    busy_seconds, peak_memory = [0.0], [0]

    def __init__(self, buffers):
        self.buffers = buffers

    @staticmethod
    def trained(start: torch.Tensor, client: int, key: int) -> torch.Tensor:
        return 0.9 * start + 0.01 * (client + 1) - 0.001 * key

    def train(self, rnd, clients, start_from):
        b = self.buffers
        for i, client in enumerate(clients.tolist()):
            b.client_weights[i] = self.trained(b.slot_starts[i], client, int(b.slot_keys[i]))
            b.stats[i] = torch.tensor([len(b.client_samples(client)), 1.0, 3.0])

    def close(self):
        pass


def reference(cfg, sizes, x0: torch.Tensor, rounds: int):
    """FedBuff (Nguyen et al. 2022, Algorithm 1) and FedAsync (Xie et al. 2019, Algorithm 1) on a
    clock of their own: C clients in flight, each taking steps x step_seconds / speed simulated
    seconds and starting from the model of its start, the earliest to finish arriving first.
    Returns the global weights and the clock after each server update, and (client, version,
    staleness) of every update used."""
    a = cfg.asynchronous
    speeds = System.from_config(cfg).speeds(cfg.seed, cfg.data.num_clients)
    steps = [cfg.local.epochs * math.ceil(n / cfg.local.batch_size) for n in sizes]
    x, version, clock, started, in_flight, models, clocks, used = x0.clone(), 0, 0.0, 0, [], [], [], []
    for _ in range(rounds):
        buffer = []
        while True:
            while len(in_flight) < cfg.clients_per_round:
                idle = [c for c in range(cfg.data.num_clients) if c not in {j[2] for j in in_flight}]
                client = idle[async_start_generator(cfg.seed, started).integers(len(idle))]
                seconds = steps[client] * cfg.system.step_seconds / speeds[client]
                in_flight.append((clock + seconds, started, client, version, x.clone()))
                started += 1
            job = min(in_flight, key=lambda j: j[:2])
            in_flight.remove(job)
            clock, key, client, start_version, start = job
            y = FakeTraining.trained(start, client, key)
            tau = version - start_version
            used.append((client, start_version, tau))
            if a.method == "fedasync":
                alpha = a.mixing * staleness_weight(a, tau)
                x = (1 - alpha) * x + alpha * y
                break
            buffer.append(staleness_weight(a, tau) * (y - start))
            if len(buffer) == a.buffer_size:
                x = x + sum(buffer) / a.buffer_size
                break
        version += 1
        models.append(x.clone())
        clocks.append(clock)
    return models, clocks, used


@pytest.mark.parametrize("method", ["fedbuff", "fedasync"])
def test_the_clock_and_the_updates_are_the_papers(method):
    cfg = load_config(RUN, {"asynchronous.method": method, "asynchronous.buffer_size": 3})
    session = Session(cfg, log=lambda line: None)
    engine = session.engine
    engine.executor = FakeTraining(session.buffers)
    x0 = session.state.model.flat.clone()
    models, clocks, used = reference(cfg, engine.sizes.tolist(), x0, rounds=5)
    records = []
    for rnd in range(1, 6):
        result = engine.run_round(rnd)
        records += result.clients
        # float32 sums in the same order; only the association of a few products differs
        torch.testing.assert_close(session.state.model.flat, models[rnd - 1], rtol=1e-5, atol=1e-6)
        assert result.row["simulated_time"] == pytest.approx(clocks[rnd - 1], rel=1e-12)
        assert result.row["clients"] == (3 if method == "fedbuff" else 1)
    assert [(r.client, r.model_version, r.staleness) for r in records] == used
    assert any(tau > 0 for _, _, tau in used)  # stale updates were weighed
    session.executor.close()


@pytest.mark.slow
def test_an_async_run_learns_is_the_same_for_any_workers_and_resumes_exactly(tmp_path):
    """FedBuff with dropouts on heterogeneous speeds: workers 0 and 2, and 3 server updates then a
    resume to 6, give the same bits; the clock moves forward; accuracy rises."""
    cfg = {**RUN, "rounds": 6, "system": {**RUN["system"], "dropout": 0.2}, "asynchronous": {"buffer_size": 2}}
    zero = fedsim.run(cfg, out=tmp_path / "w0", quiet=True)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    fedsim.run(cfg, out=tmp_path / "resumed", quiet=True, rounds=3)
    again = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=6)
    ends = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("w0", "w2", "resumed")}
    for name in ("w2", "resumed"):
        assert torch.equal(ends["w0"]["global"], ends[name]["global"]), name
    for column in ("test_accuracy", "test_loss", "train_loss", "simulated_time", "cumulative_bytes"):
        assert getattr(zero, column) == getattr(two, column) == getattr(again, column), column
    assert (tmp_path / "w0" / "clients.csv").read_text() == (tmp_path / "resumed" / "clients.csv").read_text()
    records = read_clients(tmp_path / "w0" / "clients.csv")
    assert any(r["dropped"] == "dropout" for r in records) and any((r["staleness"] or 0) > 0 for r in records)
    assert all(r["staleness"] is None for r in records if r["dropped"])
    assert np.all(np.diff(zero.simulated_time) > 0)
    assert zero.test_accuracy[-1] > zero.test_accuracy[0] + 0.05, zero.test_accuracy


@pytest.mark.slow
def test_fedasync_on_the_vmap_backend_is_the_same_for_any_workers(tmp_path):
    cfg = {**RUN, "backend": "vmap", "vmap_group_size": 2, "asynchronous": {"method": "fedasync"}}
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    assert one.test_accuracy == two.test_accuracy and one.simulated_time == two.simulated_time
    assert one.clients == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "override, key",
    [
        ("aggregator=median", "aggregator"),
        ("algorithm=scaffold", "algorithm"),
        ("system.deadline=10", "system.deadline"),
        ("system.availability=0.5", "system.availability"),
        ("client_sampling=by_size", "client_sampling"),
        ("compression.type=topk", "compression.type"),
        ("attack.type=sign_flip", "attack.type"),
    ],
)
def test_async_refuses_in_one_line_what_it_would_ignore(override, key):
    overrides = [override] + (["attack.fraction=0.2"] if key == "attack.type" else [])
    with pytest.raises(ConfigError) as error:
        load_config(RUN, overrides)
    message = str(error.value)
    assert "\n" not in message and f"{key}:" in message and "(mode: async)" in message


def test_asynchronous_keys_are_checked_and_warned_about_where_unread():
    with pytest.raises(ConfigError, match=r"asynchronous\.mixing: must be in \(0, 1\]"):
        load_config(RUN, ["asynchronous.mixing=0"])
    with pytest.raises(ConfigError, match=r"server_optimizer: FedAsync mixes"):
        load_config(RUN, ["asynchronous.method=fedasync", "server_optimizer=fedadam"])
    warned = unused_settings(load_config(RUN, ["asynchronous.mixing=0.3"]))
    assert any("asynchronous.mixing" in w and "fedbuff" in w for w in warned)
    warned = unused_settings(load_config({**RUN, "mode": "sync"}, ["asynchronous.buffer_size=3"]))
    assert "asynchronous.buffer_size is 3 but mode is sync: set mode: async to use it" in warned


def test_the_shipped_comparison_runs_three_servers_on_one_federation():
    from pathlib import Path

    from support import documented_commands

    from fedsim.cli import build_parser

    *runs, plot = documented_commands(Path(__file__).parents[1] / "experiments" / "async.yaml")
    parser = build_parser()
    configs = []
    for command in runs:
        args = parser.parse_args(command[1:])
        configs.append(load_config(args.config, args.set))
        assert unused_settings(configs[-1]) == [], command
    assert [(c.name, c.mode) for c in configs] == [("fedbuff", "async"), ("fedasync", "async"), ("fedavg", "sync")]
    assert configs[1].asynchronous.method == "fedasync" and configs[2].system.deadline == 20
    same = lambda c: (c.seed, c.model, c.data, c.local, c.system.speed, c.clients_per_round)  # noqa: E731
    assert same(configs[0]) == same(configs[1]) == same(configs[2])
    assert parser.parse_args(plot[1:]).x == "simulated_seconds"


def test_a_synchronous_round_records_its_model_version_and_no_staleness():
    cfg = load_config({**RUN, "mode": "sync", "rounds": 2, "system": {"dropout": 0.3}})
    session = Session(cfg, log=lambda line: None)
    session.executor.start(session.buffers)
    for rnd in (1, 2):
        records = session.engine.run_round(rnd).clients
        assert all(r.model_version == rnd - 1 for r in records)
        assert [r.staleness for r in records] == [None if r.dropped == "dropout" else 0 for r in records]
    assert any(r.dropped == "dropout" for r in records)
    session.executor.close()


# ----------------------------------------------------------------------------- non-finite updates


@contextmanager
def ends_within(seconds: float):
    """Fail the block if it outlives ``seconds`` (SIGALRM, this process's main thread): an async run
    that spins on non-finite updates completes every batch, so no worker_timeout would stop it."""

    def expire(signum, frame):
        raise TimeoutError(f"the run did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class PoisonsOneClient(Algorithm):
    """FedAvg whose client ``client`` sends a NaN weight whenever it trains: a non-finite update
    now and then among usable ones."""

    def __init__(self, client: int):
        self.client = int(client)

    def start_client(self, clients):
        return [int(c) for c in clients.ids]

    def client_report(self, result, local):
        if self.client in local:
            result.weights[local.index(self.client), 0] = float("nan")
        return {}


def failed_run(run_dir, message: str, rounds: int) -> list[dict]:
    """The summary says failed with ``message`` after ``rounds`` rounds, and metrics.csv holds them."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == message and summary["rounds"] == rounds
    metrics = read_metrics(run_dir / "metrics.csv")
    assert [row["round"] for row in metrics] == list(range(1, rounds + 1))
    return metrics


@pytest.mark.slow
def test_an_async_run_whose_updates_all_turn_nonfinite_after_its_first_stops_in_one_line(tmp_path):
    """FedBuff (K = 2) with server_lr 1e20: the clients that train the initial model send finite
    updates, but the first server update moves the global weights by up to about 1e18 (finite), and
    every client that trains those overflows. A server update whose buffer already held a stale
    finite update then waited forever for a second; it stops once clients_per_round non-finite
    updates have come in a row."""
    cfg = {
        **RUN,
        "rounds": 8,
        "server_optimizer": "fedavgm",
        "server_momentum": 0,
        "server_lr": 1e20,
        "asynchronous": {"buffer_size": 2},
    }
    with ends_within(20), pytest.raises(NonFiniteError) as error:
        fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    message = str(error.value)
    found = re.fullmatch(
        r"round (\d+): the last 4 client updates \(clients_per_round, as many as train at once\) are all "
        r"non-finite \(NaN/Inf\); nothing of this round was saved and the checkpoint of round (\d+) is kept; "
        r"lower local\.lr or server_lr, or check the model's output",
        message,
    )
    assert found, message
    rnd = int(found[1])
    assert rnd >= 2 and int(found[2]) == rnd - 1  # it got past its first update, which it kept
    failed_run(tmp_path / "run", message, rnd - 1)
    records = read_clients(tmp_path / "run" / "clients.csv")
    assert {r["round"] for r in records} == set(range(1, rnd))
    # only the initial model trains to finite weights; everything trained after the first update overflows
    assert all(r["model_version"] == 0 for r in records if r["dropped"] == 0)
    assert all(r["dropped"] == "nonfinite" for r in records if r["model_version"] > 0)


def poisoned(client: int) -> dict:
    """FedBuff (K = 2) in which ``client`` sends non-finite weights whenever it trains."""
    cfg = {
        **RUN,
        "rounds": 5,
        "algorithm": "test_asynchronous:PoisonsOneClient",
        "algorithm_options": {"client": client},
    }
    return {**cfg, "asynchronous": {"buffer_size": 2}}


@pytest.mark.slow
def test_occasional_nonfinite_async_updates_are_dropped_and_the_run_finishes(tmp_path):
    """Client 8 arrives most often, twice in a row once: fewer non-finite updates in a row than
    clients_per_round (4) never stop the run."""
    client = 8
    cfg = poisoned(client)
    with ends_within(20):
        history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"
    metrics, records = read_metrics(tmp_path / "run" / "metrics.csv"), read_clients(tmp_path / "run" / "clients.csv")
    assert [row["round"] for row in metrics] == [1, 2, 3, 4, 5] and len(history.test_accuracy) == 5
    mine = [r for r in records if r["client"] == client]
    assert len(mine) >= 2 and all(r["dropped"] == "nonfinite" for r in mine)  # left out every time, the run went on
    assert all(r["dropped"] == 0 for r in records if r["client"] != client)
    in_order = "".join("x" if r["dropped"] == "nonfinite" else "." for r in records)  # arrivals, as they came
    assert "xx" in in_order and "xxxx" not in in_order
    for row in metrics:  # each server update used K = 2 updates and counted the rest as dropped
        mine = [r for r in records if r["round"] == row["round"]]
        assert sum(r["dropped"] == 0 for r in mine) == 2 and row["clients"] == len(mine)
        assert row["dropped_clients"] == len(mine) - 2


@pytest.mark.slow
def test_on_nonfinite_fail_stops_an_async_run_at_the_first_nonfinite_update(tmp_path):
    """It stops in the server update in which the same run with drop first left an update out,
    with the same rounds before it (client 4 first arrives after two server updates)."""
    client = 4
    cfg = poisoned(client)
    fedsim.run(cfg, out=tmp_path / "drop", quiet=True)
    dropped = read_clients(tmp_path / "drop" / "clients.csv")
    first = min(r["round"] for r in dropped if r["dropped"] == "nonfinite")
    assert first > 1  # rounds before it to compare
    with ends_within(20), pytest.raises(NonFiniteError) as error:
        fedsim.run({**cfg, "on_nonfinite": "fail"}, out=tmp_path / "fail", quiet=True)
    message = str(error.value)
    assert message == (
        f"round {first}: client {client} sent non-finite (NaN/Inf) weights "
        f"(on_nonfinite: fail; use drop to leave such clients out)"
    )
    metrics = failed_run(tmp_path / "fail", message, first - 1)
    same = ("test_accuracy", "test_loss", "train_loss", "simulated_time", "cumulative_bytes")
    before = read_metrics(tmp_path / "drop" / "metrics.csv")[: first - 1]
    assert [[row[c] for c in same] for row in metrics] == [[row[c] for c in same] for row in before]
