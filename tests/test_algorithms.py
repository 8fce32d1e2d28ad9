"""Client algorithms: FedProx against FedAvg and its own update rule, SCAFFOLD's control variates,
FedNova and FedDyn against the papers' formulas computed here, and each of them learning."""

from __future__ import annotations

import math
import shutil
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import installed

import fedsim
from fedsim.algorithms import Clients, Round
from fedsim.algorithms.fednova import FedNova
from fedsim.algorithms.fedprox import FedProx
from fedsim.algorithms.local import LocalTrainer
from fedsim.algorithms.scaffold import Scaffold
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.data import from_tensors, load_dataset
from fedsim.experiment import components
from fedsim.experiment.config import LocalConfig
from fedsim.experiment.validation import unused_settings
from fedsim.fl.aggregation import get as aggregation_rule
from fedsim.models.zoo import build_model

U32 = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic", "unused")


def checkpoint(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def client_rows(state, name, clients):
    """The rows ``name`` of ``clients`` in a checkpoint: zeros for a client that has none yet."""
    held = state["client_state"][name]
    like = next(iter(held.values()))
    return torch.stack([held.get(c, torch.zeros_like(like)) for c in clients])


def start_client(algorithm, num_params, *, server=None, state=None, client=0, rnd=1):
    """``local_state`` for one client, as a worker gets it (workers.ClientRunner.train_group): the
    algorithm's declared state, zeros unless given, and this client's rows of the client state."""
    server = server or {name: torch.zeros(shape) for name, shape in algorithm.server_state(num_params).items()}
    state = state or {name: torch.zeros(1, *shape) for name, shape in algorithm.client_state(num_params).items()}
    return algorithm.start_client(Clients(torch.tensor([client]), rnd, server, state))


# ----------------------------------------------------------------------------- FedProx


@pytest.mark.slow
def test_fedprox_with_mu_zero_is_exactly_fedavg(small_config, tmp_path):
    # two rounds: the second starts from the first's aggregate
    fedavg = fedsim.run(dict(small_config, algorithm="fedavg", rounds=2), out=tmp_path / "fedavg", quiet=True)
    prox_cfg = dict(small_config, algorithm="fedprox", algorithm_options={"mu": 0.0}, rounds=2)
    fedprox = fedsim.run(prox_cfg, out=tmp_path / "fedprox", quiet=True)
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(fedavg, column) == getattr(fedprox, column), column
    assert torch.equal(checkpoint(tmp_path / "fedavg")["global"], checkpoint(tmp_path / "fedprox")["global"])


def train_client(data, mu, momentum=0.0):
    torch.manual_seed(0)
    model = FlatModel(build_model("mnist_cnn", data.input_shape, data.num_classes), "cpu")
    start = model.flat.clone()
    local = LocalConfig(epochs=1, batch_size=32, lr=0.05, momentum=momentum)
    algorithm = FedProx(mu=mu)
    trainer = LocalTrainer(model, data.train_x, data.train_y, local, num_classes=data.num_classes, algorithm=algorithm)
    trainer.train(torch.arange(256), start, seed=11, local_state=start_client(algorithm, model.num_params))
    return float(torch.linalg.vector_norm(model.flat - start))


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedprox_keeps_the_client_closer_to_the_global_weights(synthetic, momentum):
    drift = [train_client(synthetic, mu, momentum) for mu in (0.0, 0.1, 1.0)]
    assert drift[0] > drift[1] > drift[2] > 0, drift


def test_fedprox_step_is_sgd_on_the_loss_plus_the_proximal_term(synthetic):
    # a linear model and one batch per epoch: three steps w <- w - lr (grad L(w) + mu (w - w_global))
    x, y = synthetic.train_x[:64], synthetic.train_y[:64]
    torch.manual_seed(0)
    model = FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), "cpu")
    start = model.flat.clone() + 0.01  # the client starts from the global weights, not from its own
    mu, lr = 0.5, 0.1
    local = LocalConfig(epochs=3, batch_size=64, lr=lr)
    algorithm = FedProx(mu=mu)
    LocalTrainer(model, x, y, local, num_classes=10, algorithm=algorithm).train(
        torch.arange(64), start, seed=1, local_state=start_client(algorithm, model.num_params)
    )

    w = start.clone()
    for _ in range(3):
        weight, bias = w[:7840].view(10, 784).requires_grad_(), w[7840:].requires_grad_()
        # F.linear, as in nn.Linear: the same kernels, so the 785-term sums round alike on any BLAS
        loss = F.cross_entropy(F.linear(x.flatten(1), weight, bias), y)
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, [weight, bias])])
        w = (w - lr * (grad + mu * (w - start))).detach()
    # what differs is the update arithmetic: 3 steps x 2 versions x ~5 roundings of values <= max |w|
    # (twice that for atol); lr (max Hessian eigenvalue 3.6 + mu) < 2, so no step amplifies them
    torch.testing.assert_close(model.flat, w, rtol=0, atol=2 * 3 * 2 * 5 * U32 * float(w.abs().max()))


# ----------------------------------------------------------------------------- SCAFFOLD


def scaffold_config(momentum=0.0):
    """Synthetic data, 4 clients holding 2 label-sorted shards each, all trained every round:
    every client has 1500 samples, so every client takes the same K = 47 steps of 32."""
    return {
        "name": "scaffold",
        "seed": 3,
        "device": "cpu",
        "rounds": 2,
        "workers": 2,
        "clients_per_round": 4,
        "model": "mnist_cnn",
        "algorithm": "scaffold",
        "data": {"dataset": "synthetic", "partition": "shards", "num_clients": 4, "shards_per_client": 2},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": momentum},
    }


@pytest.mark.slow
def test_scaffold_control_variates_follow_option_two_and_it_learns_a_non_iid_split(tmp_path):
    """With every client in every round and equal K, option II (Karimireddy et al. 2020) gives

        c_i+ = c_i - c + (x - y_i) / (K lr),   c+ = c + (1/N) sum_i (c_i+ - c_i) = (x - x+) / (K lr)

    where x+ = x + mean_i (y_i - x) is the next global model; and always c = mean_i c_i."""
    run_dir = tmp_path / "run"
    fedsim.run(scaffold_config(), out=run_dir, quiet=True)
    shutil.copy(run_dir / "checkpoint.pt", tmp_path / "round2.pt")
    history = fedsim.resume(run_dir, rounds=3, quiet=True)

    before = torch.load(tmp_path / "round2.pt", weights_only=True)
    after = checkpoint(run_dir)
    assert before["round"] == 2 and after["round"] == 3
    server_control = after["algorithm"]["server"]["control"]
    n = server_control.numel()
    steps, lr = 47, 0.05
    expected = (before["global"][:n] - after["global"][:n]) / (steps * lr)
    # equal in exact arithmetic. Each client's K steps round its weights (|x| <= 0.3) K times: u |x| / lr
    # = 4e-7 once divided by K lr; its K-term gradient sum (|g| averaged over the steps <= 0.5,
    # measured 0.49) rounds by (K + 1) u 0.5 = 1.4e-6; atol about twice the total
    torch.testing.assert_close(server_control, expected, rtol=0, atol=4e-6)
    for state in (before, after):
        # the same deltas (|delta| <= 0.3) summed in other orders: 18 roundings over 3 rounds (4 a round
        # for c, 1 for each c_i, 3 for this mean); atol twice that
        torch.testing.assert_close(
            state["algorithm"]["server"]["control"],
            client_rows(state, "control", range(4)).mean(dim=0),
            rtol=0,
            atol=2 * 18 * U32 * 0.3,
        )
    assert history.round == [1, 2, 3]
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy  # chance is 0.1


@pytest.mark.slow
def test_scaffold_with_local_momentum_stays_finite(tmp_path):
    # the option II formula (x - y_i) / (K lr) would make the controls 1 / (1 - 0.9) = 10x too
    # large here and training diverge; the mean uncorrected gradient does not. Measured at lr 0.02:
    # train loss 0.71 -> 0.29 -> 0.15 (accuracy 0.51 -> 0.93), option II 0.71 -> 1.3 -> 99. (At lr 0.05,
    # an effective step of 0.5 with the momentum, the stale controls of round 2 throw both off by round 3.)
    cfg = dict(scaffold_config(momentum=0.9), rounds=3, on_nonfinite="fail")
    cfg["local"] = dict(cfg["local"], lr=0.02)
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert history.train_loss[-1] < history.train_loss[0]


def test_scaffold_control_variate_is_option_ii_under_plain_sgd():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(50, 1, 28, 28, generator=g), torch.randint(0, 10, (50,), generator=g)
    torch.manual_seed(0)
    model = FlatModel(build_model("mnist_2nn", (1, 28, 28), 10), "cpu")
    start = model.flat.clone()
    local = LocalConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.0)
    algorithm = Scaffold()
    server = {"control": torch.randn(model.num_params, generator=g) * 1e-2}  # c
    own = {"control": torch.randn(1, model.num_params, generator=g) * 1e-2}  # c_i
    correction = server["control"] - own["control"][0]  # c - c_i, the float32 difference the client adds
    trainer = LocalTrainer(model, x, y, local, num_classes=10, algorithm=algorithm)
    trained = trainer.train(
        torch.arange(50), start, seed=3, local_state=start_client(algorithm, model.num_params, server=server, state=own)
    )
    steps = int(trained.steps)
    option_ii = (start - model.flat) / (steps * local.lr) - correction  # c_i+ = c_i - c + (x - y_i)/(K lr)
    # equal in exact arithmetic: the K = 8 updates round |w| <= 0.1 each, u 0.1 / lr = 1.2e-7 once
    # divided by K lr, and the K-term gradient sum and this formula (|g| <= 0.43) (K + 4) u 0.43 = 3e-7;
    # atol about twice the total
    torch.testing.assert_close(trained.mean_gradient[0], option_ii, rtol=0, atol=1e-6)


def test_scaffold_server_update_with_the_rule_a_run_gets_is_the_papers():
    """Karimireddy et al. 2020, Algorithm 1 with eta_g = 1: x <- x + (1/|S|) sum_i (y_i - x) and
    c <- c + (1/N) sum_i Delta c_i, c_i <- c_i + Delta c_i, for a config that sets no aggregator."""
    k, n, p = 3, 5, 200
    cfg = fedsim.load_config({"algorithm": "scaffold", "clients_per_round": k, "data": {"num_clients": n}})
    assert cfg.aggregator == "mean"
    rule = components.aggregator(cfg.aggregator, cfg.aggregator_options)
    g = torch.Generator().manual_seed(0)
    updates, changes = torch.randn(k, p, generator=g), torch.randn(k, p, generator=g)
    counts, clients = torch.tensor([3.0, 60.0, 7.0]), torch.tensor([4, 0, 2])
    server, own = {"control": torch.randn(p, generator=g)}, {"control": torch.randn(n, p, generator=g)}
    c, c_i = server["control"].double(), own["control"].double()
    rows = {"control": own["control"][clients].clone()}  # the round's clients' rows, as the server passes them
    delta = Scaffold().server_update(
        Round(updates, counts, clients, {"control_change": changes}, rule, torch.zeros(p), p, n), server, rows
    )
    own["control"][clients] = rows["control"]
    u, d = updates.double(), changes.double()
    # the mean: 1 / k rounds once, each product once, k - 1 additions; c: k - 1 additions, the product
    # with 1 / N (2 roundings) and the addition to c; c_i: one addition. atol twice that
    mean = u.mean(dim=0)
    torch.testing.assert_close(delta.double(), mean, rtol=0, atol=2 * (k + 1) * U32 * float(u.abs().max()))
    torch.testing.assert_close(
        server["control"].double(),
        c + d.sum(dim=0) / n,
        rtol=0,
        atol=2 * (k + 2) * U32 * float(c.abs().max() + d.abs().sum(dim=0).max()),
    )
    expected = c_i.clone()
    expected[clients] += d
    torch.testing.assert_close(own["control"].double(), expected, rtol=0, atol=2 * U32 * float(expected.abs().max()))
    # the sample-weighted average of the fedavg rule is elsewhere
    weighted = (counts.double()[:, None] * u).sum(dim=0) / counts.double().sum()
    assert float((weighted - mean).abs().max()) > 0.5


def test_algorithms_whose_paper_fixes_the_rule_get_it_unless_a_rule_is_set():
    for algorithm, rule in [
        ("scaffold", "mean"),
        ("feddyn", "mean"),
        ("fedavg", "fedavg"),
        ("fedprox", "fedavg"),
        ("fednova", "fedavg"),
    ]:
        cfg = fedsim.load_config({"algorithm": algorithm})
        assert cfg.aggregator == rule and unused_settings(cfg) == [], algorithm
        assert fedsim.load_config({"algorithm": algorithm, "aggregator": None}).aggregator == rule
    chosen = fedsim.load_config({"algorithm": "feddyn"}, ["aggregator=median"])
    assert chosen.aggregator == "median"
    assert unused_settings(chosen) == [
        "aggregator is median, but the feddyn paper aggregates with mean (what the run gets when aggregator is not set)"
    ]
    assert unused_settings(fedsim.load_config({"algorithm": "scaffold", "aggregator": "mean"})) == []
    # a class of one's own names its paper's rule; an instance of it too
    own = type("Own", (FedProx,), {"paper_aggregator": "median"})
    assert fedsim.load_config({"algorithm": own}).aggregator == "median"
    assert fedsim.load_config({"algorithm": own()}).aggregator == "median"


# ----------------------------------------------------------------------------- FedNova and FedDyn, against the papers
#
# A tiny problem whose rounds can be computed here exactly (in float64) from the papers: logistic
# regression (a linear layer on 4 features, 3 classes) on 3 clients, client k holding COUNTS[k]
# copies of one sample of its own class (partition label_k with one class per client). With
# identical samples every batch's mean gradient is that sample's gradient, whatever the shuffling,
# so batches of 2 give the clients 2, 3 and 6 steps, and unequal shares 3/20, 6/20, 11/20.
# The engine runs it whole (workers, the algorithm's hooks and reports, the server update);
# clients.csv says which client holds which class (their sample counts differ).

FEATURES, CLASSES, COUNTS = 4, 3, (3, 6, 11)


def tiny_linear():
    """The model, with fixed initial weights (a module-level builder: the workers import it)."""
    g = torch.Generator().manual_seed(0)
    module = nn.Linear(FEATURES, CLASSES)
    with torch.no_grad():
        module.weight.copy_(torch.randn(CLASSES, FEATURES, generator=g) * 0.5)
        module.bias.copy_(torch.randn(CLASSES, generator=g) * 0.1)
    return module


def tiny_samples() -> torch.Tensor:
    """One sample per class, |x| <= 1.53."""
    return torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1))


def tiny_run(
    out, algorithm, *, seed=0, rounds=1, clients_per_round=3, aggregator=None, algorithm_options=None, **local
):
    """Run the tiny problem. Return the last checkpoint, the classes trained in each round, and for
    each class the client that holds it. ``aggregator`` None sets none: the algorithm's default."""
    samples = tiny_samples()
    labels = torch.repeat_interleave(torch.arange(CLASSES), torch.tensor(COUNTS))
    cfg = {
        "name": "tiny",
        "seed": seed,
        "device": "cpu",
        "rounds": rounds,
        "workers": 0,
        "clients_per_round": clients_per_round,
        "algorithm": algorithm,
        "algorithm_options": algorithm_options or {},
        **({"aggregator": aggregator} if aggregator else {}),
        "data": {"partition": "label_k", "classes_per_client": 1, "num_clients": 3},
        "local": {"epochs": 1, "batch_size": 2, "lr": 0.1, **local},
    }
    history = fedsim.run(
        cfg,
        out=out,
        quiet=True,
        model=tiny_linear,
        dataset=from_tensors(samples[labels], labels, samples, torch.arange(CLASSES)),
    )
    records = history.client_records
    holder = {COUNTS.index(r["samples"]): r["client"] for r in records}
    assert sorted(holder) == [0, 1, 2]
    trained = [sorted(COUNTS.index(r["samples"]) for r in records if r["round"] == rnd) for rnd in range(1, rounds + 1)]
    return types.SimpleNamespace(
        state=checkpoint(out), trained=trained, holder=[holder[c] for c in range(CLASSES)], rows=history.rows
    )


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """tiny_run, each configuration run once for the whole module."""
    done = {}

    def get(algorithm, **options):
        key = (algorithm, repr(sorted(options.items())))
        if key not in done:
            done[key] = tiny_run(tmp_path_factory.mktemp(algorithm) / "run", algorithm, **options)
        return done[key]

    return get


class Extent:
    """The largest magnitudes met in a reference computation, for the rounding bounds."""

    def __init__(self):
        self.w = self.logits = self.grad = self.term = self.step = 0.0

    def see(self, name, tensor):
        setattr(self, name, max(getattr(self, name), float(tensor.abs().max())))


def local_sgd(x, cls, steps, lr, momentum=0.0, term=None, extent=None):
    """``steps`` steps of SGD (heavy-ball momentum, as torch.optim.SGD) on the cross-entropy of the
    class-``cls`` sample, in float64, from x; ``term(w)`` is added to each gradient."""
    sample = tiny_samples().double()[cls]
    extent = extent or Extent()
    w, buffer = x.clone(), torch.zeros_like(x)
    for _ in range(steps):
        weight, bias = w[: CLASSES * FEATURES].view(CLASSES, FEATURES), w[CLASSES * FEATURES :]
        weight.requires_grad_(), bias.requires_grad_()
        loss = F.cross_entropy(F.linear(sample[None], weight, bias), torch.tensor([cls]))
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, [weight, bias])])
        extent.see("logits", weight.detach().abs() @ sample.abs() + bias.detach().abs())  # sums of |terms|
        extent.see("grad", grad)
        if term is not None:
            added = term(w)
            extent.see("term", added)
            grad = grad + added
        buffer = momentum * buffer + grad
        w = w - lr * buffer
        extent.see("step", buffer)
        extent.see("w", w)
    return w


def initial_weights() -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in tiny_linear().parameters()]).double()


def step_error(extent, lr, batch_size):
    """Bound on what the engine's float32 arithmetic adds to a client's weights in one step.

    The gradient: logits are 5-term sums (4 features and the bias), off by <= 5 u S with S the
    largest sum of |terms|; softmax moves by at most half that (its Jacobian's rows have l1 norm
    2 p (1 - p) <= 1/2), plus ~4 roundings of its own, one more for p - onehot, and the mean over a
    batch of B identical samples by B - 1 (sum) and 1 (product with x): <= (2.5 S + B + 5) u X,
    X = max(|x|, 1) = 1.53. The algorithm's term (<= 4 roundings of |grad| + |term|), the momentum
    buffer (2 of |step|) and the step itself (lr times 1 of |step|, then 1 of |w|)."""
    x = max(float(tiny_samples().abs().max()), 1.0)
    gradient = (2.5 * extent.logits + batch_size + 5) * x + 4 * (extent.grad + extent.term) + 3 * extent.step
    return U32 * (lr * gradient + extent.w)


# The steps do not amplify those errors: the cross-entropy's Hessian in (W, b) is at most
# (|x|^2 + 1) / 2 <= 1.85 (its softmax factor diag(p) - p p^T <= 1/2), and lr (1.85 + alpha) < 1.
# Local momentum rho carries an error of a step into the later ones too: about 1 / (1 - rho) of it.


def fednova_reference(x, lr, batch_size, momentum):
    """One round of FedNova (Wang et al. 2020) with the fedavg rule, from x; the clients' steps tau_i,
    work a_i and models y_i, FedAvg's average of the same y_i, and the magnitudes met."""
    extent = Extent()
    steps = [math.ceil(n / batch_size) for n in COUNTS]  # one epoch
    models = [local_sgd(x, cls, tau, lr, momentum, extent=extent) for cls, tau in enumerate(steps)]
    rho = momentum
    work = [tau if rho == 0 else (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho) for tau in steps]
    share = [n / sum(COUNTS) for n in COUNTS]  # p_i = n_i / n
    effective = sum(p * a for p, a in zip(share, work))  # tau_eff = sum_i p_i a_i
    fednova = x + effective * sum(p * (y - x) / a for p, y, a in zip(share, models, work))
    fedavg = x + sum(p * (y - x) for p, y in zip(share, models))
    return types.SimpleNamespace(
        fednova=fednova, fedavg=fedavg, steps=steps, work=work, models=models, effective=effective, extent=extent
    )


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_fednova_round_is_the_papers_normalized_average(tiny_runs, momentum):
    lr, batch_size = 0.1, 2
    state = tiny_runs("fednova", momentum=momentum).state
    x = initial_weights()
    ref = fednova_reference(x, lr, batch_size, momentum)
    assert ref.steps == [2, 3, 6]
    # Tolerance: the float64 reference is exact to ~2^-53. Each client's weights are off by <= tau e /
    # (1 - rho) (e: step_error, tau <= 6); FedNova's update scales the error of y_i by tau_eff p_i / a_i,
    # summing to <= tau_eff / min a_i, and rounds ~10 times values <= max |y_i - x| (the difference,
    # / a_i, the shares, the 3-term sum, * tau_eff, tau_eff itself) and once |x|. atol: twice the total
    # (about 1e-5 here; the errors measured are ~1e-7).
    client = max(ref.steps) * step_error(ref.extent, lr, batch_size) / (1 - momentum)
    moved = max(float((y - x).abs().max()) for y in ref.models)
    atol = 2 * (ref.effective / min(ref.work) * (client + U32 * moved) + 10 * U32 * moved + U32 * ref.extent.w)
    torch.testing.assert_close(state["global"].double(), ref.fednova, rtol=0, atol=atol)
    # unequal steps: not FedAvg's average of the same client models (they are 0.07 and 0.14 apart here)
    assert float((ref.fednova - ref.fedavg).abs().max()) > 1000 * atol


@pytest.mark.parametrize("counts, steps", [((3, 6, 11), 1), ((3, 6, 11), 2), ((3, 6, 11), 3), ((1, 10, 1), 1)])
def test_fednova_with_equal_steps_and_no_momentum_is_exactly_fedavg(counts, steps):
    """a_i = tau for every client: tau_eff = tau and the update tau sum_i p_i (y_i - x) / tau."""
    algorithm = FedNova()
    algorithm.setup(types.SimpleNamespace(local=LocalConfig(momentum=0.0)))
    updates = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 0.1
    weights = torch.tensor(counts, dtype=torch.float32)
    rule = aggregation_rule("fedavg")
    round_ = Round(
        updates, weights, torch.arange(3), {"steps": torch.full((3,), float(steps))}, rule, torch.zeros(1000), 1000, 3
    )
    assert torch.equal(algorithm.server_update(round_, {}, {}), rule(updates, weights))


def feddyn_reference(x, trained, lr, batch_size, alpha, use_g=True, use_h=True, weighted=False):
    """FedDyn (Acar et al. 2021, Algorithm 1) from x and zero state, training in each round the
    clients (classes) listed in ``trained``, of N = 3: the global model, each class's client state
    g_k, the server's h, and the bound on the engine's rounding errors in each (see below). Without
    ``use_g`` the clients ignore g_k, without ``use_h`` the server ignores h, with ``weighted`` the
    server averages the w_k by sample counts, as the fedavg rule would (to show they matter)."""
    n, extent = len(COUNTS), Extent()
    steps = [math.ceil(c / batch_size) for c in COUNTS]
    g = [torch.zeros_like(x) for _ in COUNTS]
    h = torch.zeros_like(x)
    error = dict(x=0.0, g=0.0, h=0.0)
    for active in trained:
        # client k: SGD on L_k(w) - <g_k, w> + alpha/2 |w - x|^2, whose gradient adds alpha (w - x) - g_k
        models = {
            k: local_sgd(
                x, k, steps[k], lr, extent=extent, term=lambda w, k=k, x=x: alpha * (w - x) - (g[k] if use_g else 0)
            )
            for k in active
        }
        for k, w in models.items():
            g[k] = g[k] - alpha * (w - x)  # g_k <- g_k - alpha (w_k - x), for the clients of the round
        h = h - alpha / n * sum(w - x for w in models.values())  # h <- h - alpha (1/N) sum_k (w_k - x)
        share = {k: (COUNTS[k] / sum(COUNTS[j] for j in models) if weighted else 1 / len(models)) for k in models}
        new = sum(share[k] * w for k, w in models.items()) - (h / alpha if use_h else 0)  # x <- mean_k w_k - h / alpha

        # Rounding bound, propagated from the round's start (errors in x, g_k, h). A client's weights:
        # those of x at most as they are (w depends on x with slope <= 1: every step contracts by
        # 1 - lr alpha and pulls towards x by lr alpha), g_k's in each of the tau steps times lr,
        # and tau e of its own (step_error). The server's updates: alpha (w_k - x) rounds 3 times per
        # g_k, the <= N-term sum for h N + 3 times, and x + mean_k (w_k - x) - h / alpha N + 5 times.
        moved = max(float((w - x).abs().max()) for w in models.values())
        big_g, big_h = max(float(g_k.abs().max()) for g_k in g), float(h.abs().max())
        client = error["x"] + max(steps) * (step_error(extent, lr, batch_size) + lr * error["g"])
        error["g"] += alpha * (client + error["x"]) + 3 * U32 * (big_g + alpha * moved)
        error["h"] += alpha * (client + error["x"]) + (n + 3) * U32 * (big_h + alpha * moved)
        error["x"] = (
            2 * error["x"]
            + client
            + error["h"] / alpha
            + (n + 5) * U32 * (moved + big_h / alpha + float(new.abs().max()))
        )
        x = new
    return types.SimpleNamespace(x=x, g=torch.stack(g), h=h, error=error)


def test_feddyn_rounds_follow_the_papers_algorithm(tiny_runs):
    """Two rounds of 2 of the 3 clients, with no aggregator set: the rule the paper uses, the unweighted
    mean. The client of both rounds has its g_k of round 1 in its objective in round 2, the others start
    from zero and keep their g_k while they are not trained, h averages over all N = 3 clients."""
    lr, batch_size, alpha = 0.1, 2, 0.5
    run = tiny_runs("feddyn", seed=0, rounds=2, clients_per_round=2, algorithm_options={"alpha": alpha})
    assert len(set(run.trained[0]) & set(run.trained[1])) == 1  # one client in both rounds (seed 0)
    ref = feddyn_reference(initial_weights(), run.trained, lr, batch_size, alpha)
    # atol: twice the bound derived in feddyn_reference (5e-5 for x, 1e-5 for g_k and h here; the errors
    # measured are <= 1e-7)
    state = run.state["algorithm"]
    torch.testing.assert_close(run.state["global"].double(), ref.x, rtol=0, atol=2 * ref.error["x"])
    torch.testing.assert_close(
        client_rows(run.state, "gradient", run.holder).double(), ref.g, rtol=0, atol=2 * ref.error["g"]
    )
    torch.testing.assert_close(state["server"]["h"].double(), ref.h, rtol=0, atol=2 * ref.error["h"])
    # the state and the rule matter: without g_k in the clients' objective, without h in the server's
    # model, or with the sample-weighted average of the fedavg rule, the same two rounds end elsewhere
    # (0.045, 0.20 and 0.075 away)
    for ignored in ({"use_g": False}, {"use_h": False}, {"weighted": True}):
        other = feddyn_reference(initial_weights(), run.trained, lr, batch_size, alpha, **ignored)
        assert float((other.x - ref.x).abs().max()) > 500 * ref.error["x"], ignored


# ----------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, options",
    [
        # clients of unequal sizes take unequal numbers of steps: FedNova is not FedAvg here; a smaller
        # step than the fixture's
        ("fednova", {"data": {"partition": "quantity", "sigma": 0.5}, "local": {"lr": 0.02}}),
        # no aggregator: the paper's unweighted average of the clients
        ("feddyn", {"algorithm_options": {"alpha": 0.01}}),
    ],
)
def test_algorithm_learns_mnist(learning_config, tmp_path, algorithm, options):
    """Real MNIST when FEDSIM_DATA has it, the generated stand-in otherwise; 2 workers, 2 rounds."""
    cfg = dict(learning_config, algorithm=algorithm, rounds=2, on_nonfinite="fail", **options)
    for section in ("data", "local"):
        cfg[section] = dict(learning_config[section], **options.get(section, {}))
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert history.round == [1, 2]
    # measured: fednova 0.30 -> 0.52 (generated data), 0.27 -> 0.55 (MNIST); feddyn 0.29 -> 0.79, 0.34 -> 0.71
    assert history.test_accuracy[-1] > 0.3, history.test_accuracy  # chance is 0.1
    assert history.test_accuracy[-1] > history.test_accuracy[0] + 0.1, history.test_accuracy
    assert history.train_loss[-1] < history.train_loss[0], history.train_loss


# ----------------------------------------------------------------------------- worker momentum


def worker_momentum_reference(x, rounds, lr, beta, reset=False):
    """Karimireddy et al. 2021's worker momentum on the tiny problem, all 3 clients a round, one
    step each: m_k <- beta m_k + (1 - beta) g_k(x), the client sends x - lr m_k, the server takes the
    unweighted mean. ``reset``: the momentum starts from 0 every round (what keeping it changes)."""
    extent = Extent()
    momenta = [torch.zeros_like(x) for _ in COUNTS]
    for _ in range(rounds):
        if reset:
            momenta = [torch.zeros_like(x) for _ in COUNTS]
        gradients = [(x - local_sgd(x, k, 1, lr, extent=extent)) / lr for k in range(len(COUNTS))]
        momenta = [beta * m + (1 - beta) * g for m, g in zip(momenta, gradients)]
        x = sum(x - lr * m for m in momenta) / len(COUNTS)
    return types.SimpleNamespace(x=x, momenta=torch.stack(momenta), extent=extent)


def test_worker_momentum_keeps_each_clients_momentum_across_rounds(tiny_runs):
    lr, beta, rounds = 0.1, 0.9, 3
    run = tiny_runs(
        "worker_momentum", rounds=rounds, aggregator="mean", algorithm_options={"beta": beta}, steps=1, momentum=0.0
    )
    ref = worker_momentum_reference(initial_weights(), rounds, lr, beta)
    # Tolerance: each round a client's float32 step is off by at most step_error (one step, batch 2),
    # the momentum's update rounds twice values <= |m| + |g|, and the mean over 3 clients rounds 4 times
    # values <= |x|; the errors add up over the rounds (momentum carries one round's error into the
    # next with a factor beta < 1). atol: twice that, over 1 - beta (4e-5 here; the errors measured are ~1e-7).
    big = max(float(ref.momenta.abs().max()), ref.extent.grad)
    per_round = step_error(ref.extent, lr, 2) + 2 * U32 * big + 4 * U32 * ref.extent.w
    atol = 2 * rounds * per_round / (1 - beta)
    torch.testing.assert_close(run.state["global"].double(), ref.x, rtol=0, atol=atol)
    kept = client_rows(run.state, "momentum", run.holder).double()
    torch.testing.assert_close(kept, ref.momenta, rtol=0, atol=atol / lr)
    # a momentum reset every round ends elsewhere
    reset = worker_momentum_reference(initial_weights(), rounds, lr, beta, reset=True)
    assert float((reset.x - ref.x).abs().max()) > 100 * atol


@pytest.mark.parametrize(
    "local, message",
    [
        ({"momentum": 0.9}, "local.momentum: worker_momentum keeps its own momentum"),
        ({"optimizer": "adamw"}, "local.optimizer: worker_momentum is a momentum of SGD"),
    ],
)
def test_worker_momentum_refuses_a_second_momentum_before_the_run(local, message):
    with pytest.raises(ConfigError, match=message):
        fedsim.load_config({"algorithm": "worker_momentum", "local": local})


# ----------------------------------------------------------------------------- rounds nobody reports

LORA_ALGORITHMS = ("fedsa_lora", "flora", "hetlora")


@pytest.mark.slow
@pytest.mark.parametrize("name", components.tables()["algorithms"].names())
def test_a_round_in_which_no_sampled_client_reports_changes_nothing(name, tmp_path):
    """With system.dropout 0.8, most rounds lose every sampled client's work: such a round must leave
    the global model as it was (its test loss is the round before's), whatever the algorithm."""
    if name in LORA_ALGORITHMS:
        if not installed("peft"):
            pytest.skip("peft is not installed")
        from test_lora_methods import lora_config, play_root

        cfg = lora_config(play_root(tmp_path)[0], name, algorithm=name, rounds=5)
    else:
        cfg = {
            "name": name,
            "seed": 1,
            "rounds": 5,
            "workers": 0,
            "clients_per_round": 3,
            "algorithm": name,
            "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600},
            "local": {"batch_size": 32, "lr": 0.05},
            **({"model": "cifar_cnn_bn"} if name == "fedbn" else {}),  # fedbn needs batch norm
        }
    history = fedsim.run({**cfg, "system": {"dropout": 0.8}}, out=tmp_path / "run", quiet=True)
    rows = history.rows
    empty = [i for i, row in enumerate(rows) if row["dropped_clients"] == row["clients"]]
    assert any(i > 0 for i in empty), [(r["clients"], r["dropped_clients"]) for r in rows]
    for i in empty:
        if i > 0:
            assert rows[i]["test_loss"] == rows[i - 1]["test_loss"], (name, i)
