"""Compressed updates (fedsim.fl.compression): top-k keeps the k largest, QSGD is unbiased within its
variance bound, error feedback's invariant, the bytes that travel, and the runs: the same for any
number of workers, exact on resume, one-line refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedsim
from fedsim.algorithms import Algorithm
from fedsim.core.errors import ConfigError, FedsimError
from fedsim.core.flat import FlatModel
from fedsim.engine.state import GlobalState
from fedsim.experiment.components import tables
from fedsim.experiment.validation import load_config, unused_settings
from fedsim.fl.client_state import ClientStates
from fedsim.fl.compression import COMPRESSORS, Compression, CompressionConfig, client_shapes
from fedsim.fl.server_opt import make_server_optimizer
from fedsim.results.rundir import read_clients


def compressor(type_, **options):
    return COMPRESSORS.get(type_)(CompressionConfig(type=type_, **options))


def vector(n, seed=0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("n, ratio", [(1000, 0.01), (1000, 0.1234), (7, 0.5), (50, 1e-6), (50, 1.0)])
def test_topk_sends_exactly_the_k_largest_magnitudes(n, ratio):
    v = vector(n) * torch.linspace(0.5, 2.0, n)  # distinct magnitudes, both signs
    k = max(1, round(ratio * n))
    largest = np.argsort(-np.abs(v.numpy()), kind="stable")[:k]
    sent = compressor("topk", ratio=ratio)(v, None)
    assert set(sent.nonzero().flatten().tolist()) == set(largest.tolist())
    assert torch.equal(sent[largest], v[largest])  # the values themselves, not rescaled


# ----------------------------------------------------------------------------- QSGD


@pytest.mark.parametrize("levels, bucket_size", [(1, None), (4, None), (4, 16), (15, 7)])
def test_qsgd_sends_a_norm_signs_and_levels_per_bucket(levels, bucket_size):
    """Every coordinate the server reads is ||v_b|| sign(v_i) xi_i / s with xi_i in {0..s}, and
    xi_i is floor(s |v_i| / ||v_b||) or one more."""
    n = 100
    v = vector(n, seed=1)
    q = compressor("qsgd", levels=levels, bucket_size=bucket_size)(v, torch.Generator().manual_seed(2))
    d = bucket_size or n
    for start in range(0, n, d):
        vb, qb = v[start : start + d].double(), q[start : start + d].double()
        norm = vb.norm()
        xi = qb.abs() * levels / norm
        assert torch.allclose(xi, xi.round(), atol=1e-5) and xi.min() >= 0 and xi.max() <= levels
        r = vb.abs() * levels / norm
        assert ((xi.round() - r.floor()).abs() <= 1).all() and (xi.round() >= r.floor()).all()
        assert (torch.sign(qb) * torch.sign(vb) >= 0).all()


@pytest.mark.parametrize("levels, bucket_size", [(2, 64), (4, 16)])
def test_qsgd_is_unbiased_within_its_variance_bound(levels, bucket_size):
    """Lemma 3.1 of Alistarh et al.: E[Q(v)] = v and E||Q(v) - v||^2 <= B = min(d/s^2, sqrt(d)/s)
    ||v||^2 for buckets of d values (summed over the buckets). N independent draws come from one
    call on N copies of v (the buckets of a copy are v's own). Their mean has E||mean - v||^2 <=
    B / N, so by Markov's inequality it exceeds 100 B / N with probability <= 1 %.

    Per coordinate, each draw lies in an interval of width ||v_b|| / s, so by Hoeffding and a union
    over the n coordinates every |mean_i - v_i| <= (||v_b|| / s) sqrt(ln(2 n / 1e-6) / (2 N)) with
    probability 1 - 1e-6: a rounding up with 1.1 times the right probability fails both checks.

    The exact variance is sum_i (||v_b|| / s)^2 p_i (1 - p_i) (p_i = r_i - floor(r_i)), at most B;
    each draw's squared error lies in [0, sum_b d (||v_b|| / s)^2], so by Hoeffding the mean of the
    draws' squared errors is within that width x sqrt(ln(2 / 1e-6) / (2 N)) of it."""
    n, draws = 64, 50_000
    v = vector(n, seed=3).double()
    q = compressor("qsgd", levels=levels, bucket_size=bucket_size)
    samples = q(v.repeat(draws), torch.Generator().manual_seed(4)).view(draws, n)
    d = bucket_size
    bound = min(d / levels**2, math.sqrt(d) / levels) * float(v.norm() ** 2)
    error = samples.mean(0) - v
    assert float(error.norm() ** 2) <= 100 * bound / draws
    scale = (v.view(-1, d).norm(dim=1, keepdim=True) / levels).expand(-1, d).flatten()  # ||v_b|| / s per coordinate
    assert (error.abs() <= scale * math.sqrt(math.log(2 * n / 1e-6) / (2 * draws))).all()
    p = (v.abs() / scale).frac()
    variance = float((scale**2 * p * (1 - p)).sum())
    assert variance <= bound
    width = float((scale**2).sum())  # the sum over buckets of d (||v_b|| / s)^2
    squared = ((samples - v) ** 2).sum(1)
    assert abs(float(squared.mean()) - variance) <= width * math.sqrt(math.log(2 / 1e-6) / (2 * draws))


def test_qsgd_of_a_zero_bucket_is_zero_and_the_draws_follow_the_generator():
    v = torch.cat([torch.zeros(8), vector(8)])
    q = compressor("qsgd", levels=3, bucket_size=8)
    first = q(v, torch.Generator().manual_seed(5))
    assert torch.equal(first[:8], torch.zeros(8))
    assert torch.equal(first, q(v, torch.Generator().manual_seed(5)))
    assert not torch.equal(first, q(v, torch.Generator().manual_seed(6)))


def test_qsgd_draws_from_the_stream_of_seed_round_and_client():
    def sent(seed, rnd, client):
        rows = vector(300)[None].clone()
        Compression(CompressionConfig(type="qsgd", levels=2), seed).compress(
            rows, [client], torch.ones(1, dtype=bool), rnd
        )
        return rows[0]

    first = sent(1, 2, 3)
    assert torch.equal(first, sent(1, 2, 3))
    for other in (sent(0, 2, 3), sent(1, 1, 3), sent(1, 2, 4)):
        assert not torch.equal(first, other)


# ----------------------------------------------------------------------------- error feedback


def with_residuals(section, n, seed=0, num_clients=10):
    """A Compression keeping its residuals where a run keeps them, among the clients' state."""
    unit = Compression(section, seed=seed)
    unit.use_states(ClientStates.of({"compression.error_feedback": client_shapes(section, n)}, num_clients, None))
    return unit


def memory(unit):
    return unit.states.rows["error_feedback"]


def rounds_of_error_feedback(type_, rounds=4, **options):
    """Three clients' updates over a few rounds through Compression; yields, per round and
    client, (update, old residual, what was sent, new residual)."""
    section = CompressionConfig(type=type_, error_feedback=True, **options)
    unit = with_residuals(section, 200, seed=7)
    clients = [3, 0, 9]
    for rnd in range(1, rounds + 1):
        updates = torch.stack([vector(200, seed=100 * rnd + c) for c in clients])
        before = {c: memory(unit).get(c, torch.zeros(200)).clone() for c in clients}
        sent = updates.clone()
        usable = torch.ones(len(clients), dtype=torch.bool)
        unit.compress(sent, clients, usable, rnd)
        assert usable.all()
        for i, c in enumerate(clients):
            yield updates[i], before[c], sent[i], memory(unit)[c]


def test_topk_error_feedback_sends_plus_keeps_exactly_the_update_plus_the_old_residual():
    """Top-k splits a = update + old residual (computed in float32, as the client does) into the
    coordinates sent and those kept: each coordinate is a_i + 0 or 0 + a_i, so the sum is exact."""
    for update, old, sent, new in rounds_of_error_feedback("topk", ratio=0.05):
        assert torch.equal(sent + new, update + old)
        assert int((sent != 0).sum()) == 10 and torch.equal(new[sent != 0], torch.zeros(10))


def test_qsgd_error_feedback_invariant_holds_to_one_float32_rounding():
    """QSGD's residual is r = fl(a - q) for a = fl(update + old), q the float32 message: r differs
    from a - q by at most 2^-24 |a - q| (one float32 rounding). In float64, where q + r is exact
    (two float32 values within 2^29 of each other in scale; here far closer), |q + r - a| <=
    2^-24 |a - q| coordinate by coordinate."""
    for update, old, sent, new in rounds_of_error_feedback("qsgd", levels=2, bucket_size=32):
        a = (update + old).double()
        q, r = sent.double(), new.double()
        assert ((q + r - a).abs() <= 2**-24 * (a - q).abs()).all()
        assert not torch.equal(q, a)  # it did quantize


def test_residuals_only_for_clients_that_sent_and_unusable_rows_keep_theirs():
    unit = with_residuals(CompressionConfig(type="topk", ratio=0.1), 20)
    assert unit.error_feedback  # topk's default
    rows = torch.stack([vector(20, seed=1), vector(20, seed=2)])
    unit.compress(rows, [4, 5], torch.tensor([True, False]), rnd=1)
    assert sorted(memory(unit)) == [4]
    huge = torch.full((1, 20), 3e38)
    memory(unit)[4] = torch.full((20,), 3e38)  # update + residual overflows float32
    usable = torch.tensor([True])
    unit.compress(huge, [4], usable, rnd=2)
    assert not usable[0] and torch.equal(memory(unit)[4], torch.full((20,), 3e38))
    assert unit.states.summary() == {
        "client_state_clients": {"error_feedback": 1},
        "client_state_mb": round(80 / 2**20, 2),
        "client_state_bound_mb": round(10 * 80 / 2**20, 2),
    }
    assert not Compression(CompressionConfig(type="qsgd"), seed=0).error_feedback  # qsgd's default


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("n", [1, 511, 512, 513, 199_210])
def test_message_bytes_follow_the_encodings(n):
    """none: n float32. topk: k float32 values and k int32 indices. qsgd: a float32 norm per bucket
    and, per coordinate, a sign bit and ceil(log2(s + 1)) bits of level, packed into whole bytes."""
    assert compressor("none").message_bytes(n) == 4 * n
    assert compressor("topk", ratio=0.01).message_bytes(n) == 8 * max(1, round(0.01 * n))
    for s, level_bits in [(1, 1), (2, 2), (3, 2), (15, 4), (16, 5), (255, 8)]:
        for d in (512, None):
            buckets = math.ceil(n / d) if d else 1
            expected = math.ceil((32 * buckets + n * (1 + level_bits)) / 8)
            assert compressor("qsgd", levels=s, bucket_size=d).message_bytes(n) == expected, (s, d)


# ----------------------------------------------------------------------------- configuration


def refusal(**compression_section) -> str:
    with pytest.raises(ConfigError) as err:
        load_config({"compression": compression_section})
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "section, words",
    [
        ({"type": "zip"}, "config: compression.type: unknown compressor 'zip'; choose one of: none, qsgd, topk"),
        ({"type": "topk", "ratio": 0}, "config: compression.ratio: must be in (0, 1], got 0"),
        ({"type": "topk", "ratio": 1.5}, "config: compression.ratio: must be in (0, 1], got 1.5"),
        ({"type": "qsgd", "levels": 0}, "config: compression.levels: must be in [1, 65535], got 0"),
        ({"type": "qsgd", "levels": 2.5}, "config: compression.levels: expected an integer, got float 2.5"),
        ({"type": "qsgd", "bucket_size": 0}, "config: compression.bucket_size: must be >= 1, got 0"),
        ({"type": "topk", "error_feedback": "yes"}, "config: compression.error_feedback: expected true or false"),
        (
            {"error_feedback": True},
            "config: compression.error_feedback: compression.type none sends every update whole",
        ),
        ({"typ": "topk"}, "config: compression.typ: unknown key; did you mean 'compression.type'?"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(section, words):
    assert refusal(**section).startswith(words)


def test_hogwild_refuses_compression_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^config: compression.type: hogwild has no client updates to compress"
    ) as err:
        load_config({"mode": "hogwild", "clients_per_round": 10, "compression": {"type": "topk"}})
    assert "\n" not in str(err.value)


def test_privacy_allows_compression_without_error_feedback():
    """The server clips whatever a client sends, so a message computed from the client's update and
    a fresh stream keeps DP-FedAvg's sensitivity bound C / K; a residual kept across rounds is
    client state, which the accounting does not cover."""
    private = {"client_sampling": "poisson", "privacy": {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5}}
    for section in ({"type": "qsgd"}, {"type": "topk", "error_feedback": False}):
        assert load_config({**private, "compression": section}).compression.type == section["type"]
    for section in ({"type": "topk"}, {"type": "qsgd", "error_feedback": True}):
        with pytest.raises(
            ConfigError,
            match=r"^config: compression.error_feedback: cannot be used with "
            r"differential privacy: .* set compression.error_feedback: false$",
        ):
            load_config({**private, "compression": section})


def test_options_the_compressor_does_not_read_are_warned_about_and_it_is_listed():
    cfg = load_config({"compression": {"type": "topk", "levels": 7, "ratio": 0.1}})
    assert unused_settings(cfg) == ["compression.levels is 7 but compression.type topk does not use it"]
    assert unused_settings(load_config({"compression": {"type": "qsgd", "ratio": 0.2}})) == [
        "compression.ratio is 0.2 but compression.type qsgd does not use it"
    ]
    assert tables()["compressors"].names() == ["none", "qsgd", "topk"]


def test_residuals_and_the_byte_count_are_restored_and_a_checkpoint_this_run_cannot_use_is_refused(tmp_path):
    cfg = load_config({})
    model = FlatModel(torch.nn.Linear(3, 2), "cpu")  # n = 8

    def state(feedback):
        rows = {"error_feedback": (8,)} if feedback else {}
        return GlobalState(
            model,
            make_server_optimizer(cfg, 8, "cpu"),
            Algorithm(),
            ClientStates.of({"compression.error_feedback": rows}, 5, None),
            "linear",
        )

    saved = {**state(True).state_dict(1), "client_state": {"error_feedback": {2: torch.ones(8)}}}
    keeper = state(True)
    keeper.load_state_dict(saved, tmp_path / "checkpoint.pt")
    held = keeper.clients.rows["error_feedback"]
    assert list(held) == [2] and torch.equal(held[2], torch.ones(8))
    with pytest.raises(FedsimError, match="holds client state 'error_feedback', which this run does not keep"):
        state(False).load_state_dict(saved, tmp_path / "checkpoint.pt")
    for bad in (
        {7: torch.ones(8)},
        {2: torch.ones(9)},
        {2: torch.ones(8, dtype=torch.float64)},
        {2: torch.full((8,), math.nan)},
    ):
        with pytest.raises(
            FedsimError,
            match="holds client state 'error_feedback' for client .* it needs finite "
            r"float32 of shape \(8,\)",
        ):
            state(True).load_state_dict({**saved, "client_state": {"error_feedback": bad}}, tmp_path / "checkpoint.pt")
    with pytest.raises(FedsimError, match="holds a list for client_state where rows by name and client belong"):
        state(True).load_state_dict({**saved, "client_state": [torch.ones(8)]}, tmp_path / "checkpoint.pt")
    with pytest.raises(FedsimError, match="holds -1 for bytes_sent where a count of bytes belongs"):
        state(True).load_state_dict({**saved, "bytes_sent": -1}, tmp_path / "checkpoint.pt")
    older = {k: v for k, v in saved.items() if k not in ("client_state", "bytes_sent")}  # before compression
    keeper.load_state_dict(older, tmp_path / "checkpoint.pt")
    assert keeper.clients.rows["error_feedback"] == {} and keeper.bytes_sent is None  # its bytes were not counted


# ----------------------------------------------------------------------------- in a run

RUN = {
    "name": "compressed",
    "seed": 3,
    "device": "cpu",
    "rounds": 3,
    "workers": 0,
    "clients_per_round": 4,
    "model": "mnist_2nn",
    "data": {"dataset": "synthetic", "num_clients": 8, "limit": 800},
    "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}
P = 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10  # mnist_2nn's weights and biases: 199,210, no buffers


@pytest.mark.slow
def test_bytes_follow_who_receives_and_who_reports(tmp_path):
    """power_of_choice sends the model (and SCAFFOLD's control variate c) to its d = 6 candidates,
    each returns its loss (4 bytes); of the 4 chosen, the dropouts report nothing, and every other
    sends its top-k update (8 bytes per kept coordinate) and SCAFFOLD's control change (P float32)."""
    cfg = {
        **RUN,
        "algorithm": "scaffold",
        "client_sampling": "power_of_choice",
        "sampling_candidates": 6,
        "system": {"dropout": 0.3},
        "compression": {"type": "topk", "ratio": 0.001},
    }
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    records = read_clients(tmp_path / "run" / "clients.csv")
    k = round(0.001 * P)
    total = 0
    for row in history.rows:
        mine = [r for r in records if r["round"] == row["round"]]
        reporting = [r for r in mine if r["dropped"] not in ("dropout", "straggler")]
        assert row["bytes_down"] == 6 * 4 * (P + P)
        assert row["bytes_up"] == len(reporting) * (8 * k + 4 * P) + 6 * 4
        total += row["bytes_down"] + row["bytes_up"]
        assert row["cumulative_bytes"] == total
    assert any(r["dropped"] == "dropout" for r in records)  # the dropouts are there to leave out
    assert history.summary["bytes_sent"] == total
    residuals = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["client_state"]["error_feedback"]
    assert sorted(residuals) == sorted({r["client"] for r in records if r["dropped"] == 0})
    assert history.summary["client_state_clients"]["error_feedback"] == len(residuals)


@pytest.mark.slow
def test_a_compressed_run_is_the_same_for_any_workers_and_resumes_exactly(tmp_path):
    """QSGD draws from (seed, round, client) on the server, and the residuals are in the
    checkpoint: workers 0 and 2, and 2 rounds then a resume to 3, give the same bits."""
    cfg = {**RUN, "compression": {"type": "qsgd", "levels": 3, "bucket_size": 256, "error_feedback": True}}
    zero = fedsim.run(cfg, out=tmp_path / "w0", quiet=True)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    fedsim.run(cfg, out=tmp_path / "resumed", quiet=True, rounds=2)
    again = fedsim.resume(tmp_path / "resumed", quiet=True, rounds=3)
    ends = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("w0", "w2", "resumed")}
    for name in ("w2", "resumed"):
        assert torch.equal(ends["w0"]["global"], ends[name]["global"]), name
        assert (
            ends["w0"]["client_state"]["error_feedback"].keys() == ends[name]["client_state"]["error_feedback"].keys()
        )
        for client, residual in ends["w0"]["client_state"]["error_feedback"].items():
            assert torch.equal(residual, ends[name]["client_state"]["error_feedback"][client]), (name, client)
    for column in ("test_accuracy", "test_loss", "train_loss", "bytes_down", "bytes_up", "cumulative_bytes"):
        assert getattr(zero, column) == getattr(two, column) == getattr(again, column), column
    assert len(ends["w0"]["client_state"]["error_feedback"]) > 4  # residuals of more clients than one round's


def test_the_experiment_file_plans_its_sweep_and_plot_and_its_message_sizes_are_right():
    import fnmatch
    from pathlib import Path

    from support import documented_commands

    from fedsim.cli import build_parser
    from fedsim.models.zoo import MODELS
    from fedsim.runs.sweep import plan

    path = Path("experiments/compression.yaml")
    text = path.read_text()
    assert "Stich, Cordonnier, Jaggi 2018" in text and "Alistarh, Grubic, Li, Tomioka" in text
    sweep_command, plot_command = documented_commands(path)
    args = build_parser().parse_args(sweep_command[1:])
    runs = plan(args.config, args.grid, args.set, args.seeds)  # every point validated
    assert [run.config.compression.type for run in runs] == ["none", "topk", "qsgd"]
    plot = build_parser().parse_args(plot_command[1:])
    assert plot.x == "bytes" and plot.label == "compression.type"
    directories = [f"runs/compression-sweep-20250101-000000/{run.label}" for run in runs]
    assert fnmatch.filter(directories, plot.runs[0]) == directories
    cfg = runs[0].config
    n = sum(p.numel() for p in MODELS.get(cfg.model)((1, 28, 28), 10).parameters())
    assert n == 21_840 and "21,840 weights" in text
    sizes = {
        run.config.compression.type: Compression(run.config.compression, 0).compressor.message_bytes(n)
        for run in runs[1:]
    }
    assert 4 * n == 87_360 and "87,360 bytes" in text
    assert sizes["topk"] == 8 * round(0.01 * n) == 1_744 and "218 values" in text and "1,744 bytes" in text
    assert sizes["qsgd"] == math.ceil((32 * math.ceil(n / 512) + 5 * n) / 8) == 13_822 and "13,822 bytes" in text
    assert f"{4 * n / sizes['topk']:.0f} times" in text and f"{4 * n / sizes['qsgd']:.1f} times" in text
    assert cfg.clients_per_round * 4 * n == 873_600 and "873,600 bytes" in text
    assert runs[1].config.compression.error_feedback is None  # on: topk's default
