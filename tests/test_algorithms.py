"""Client algorithms: FedProx against FedAvg and its own update rule, SCAFFOLD's control variates."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fedsim
from fedsim.client import LocalTrainer
from fedsim.config import LocalConfig
from fedsim.data import load_dataset
from fedsim.flat import FlatModel
from fedsim.models import build_model


U32 = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic", "unused")


def checkpoint(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


# ----------------------------------------------------------------------------- FedProx


def test_fedprox_with_mu_zero_is_exactly_fedavg(small_config, tmp_path):
    fedavg = fedsim.run(dict(small_config, algorithm="fedavg"), out=tmp_path / "fedavg", quiet=True)
    prox_cfg = dict(small_config, algorithm="fedprox", local=dict(small_config["local"], mu=0.0))
    fedprox = fedsim.run(prox_cfg, out=tmp_path / "fedprox", quiet=True)
    for column in ("test_accuracy", "test_loss", "train_loss"):
        assert getattr(fedavg, column) == getattr(fedprox, column), column
    assert torch.equal(checkpoint(tmp_path / "fedavg")["global"], checkpoint(tmp_path / "fedprox")["global"])


def train_client(data, mu, momentum=0.0):
    torch.manual_seed(0)
    model = FlatModel(build_model("mnist_cnn", data.input_shape, data.num_classes), "cpu")
    start = model.flat.clone()
    local = LocalConfig(epochs=1, batch_size=32, lr=0.05, momentum=momentum)
    trainer = LocalTrainer(model, data.train_x, data.train_y, local, num_classes=data.num_classes)
    trainer.train(torch.arange(256), start, seed=11, prox_mu=mu)
    return float(torch.linalg.vector_norm(model.flat - start))


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
    LocalTrainer(model, x, y, local, num_classes=10).train(torch.arange(64), start, seed=1, prox_mu=mu)

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
        "name": "scaffold", "seed": 3, "device": "cpu", "rounds": 2, "workers": 2, "clients_per_round": 4,
        "model": "mnist_cnn", "algorithm": "scaffold",
        "data": {"dataset": "synthetic", "partition": "shards", "num_clients": 4, "shards_per_client": 2},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": momentum},
    }


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
    n = after["server_control"].numel()
    steps, lr = 47, 0.05
    expected = (before["global"][:n] - after["global"][:n]) / (steps * lr)
    # equal in exact arithmetic. Each client's K steps round its weights (|x| <= 0.3) K times: u |x| / lr
    # = 4e-7 once divided by K lr; its K-term gradient sum (|g| averaged over the steps <= 0.5,
    # measured 0.49) rounds by (K + 1) u 0.5 = 1.4e-6; atol about twice the total
    torch.testing.assert_close(after["server_control"], expected, rtol=0, atol=4e-6)
    for state in (before, after):
        # the same deltas (|delta| <= 0.3) summed in other orders: 18 roundings over 3 rounds (4 a round
        # for c, 1 for each c_i, 3 for this mean); atol twice that
        torch.testing.assert_close(state["server_control"], state["client_controls"].mean(dim=0),
                                   rtol=0, atol=2 * 18 * U32 * 0.3)
    assert history.round == [1, 2, 3]
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy  # chance is 0.1


def test_scaffold_with_local_momentum_stays_finite(tmp_path):
    # the option II formula (x - y_i) / (K lr) would make the controls 1 / (1 - 0.9) = 10x too
    # large here and training diverge; the mean uncorrected gradient does not
    cfg = dict(scaffold_config(momentum=0.9), rounds=3, on_nonfinite="fail")
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    assert history.train_loss[-1] < history.train_loss[0]


def test_scaffold_control_variate_is_option_ii_under_plain_sgd():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(50, 1, 28, 28, generator=g), torch.randint(0, 10, (50,), generator=g)
    torch.manual_seed(0)
    model = FlatModel(build_model("mnist_2nn", (1, 28, 28), 10), "cpu")
    start = model.flat.clone()
    local = LocalConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.0)
    correction = torch.randn(model.num_params, generator=g) * 1e-2  # c - c_i
    trainer = LocalTrainer(model, x, y, local, num_classes=10)
    _, steps = trainer.train(torch.arange(50), start, seed=3, correction=correction)
    option_ii = (start - model.flat) / (steps * local.lr) - correction  # c_i+ = c_i - c + (x - y_i)/(K lr)
    # equal in exact arithmetic: the K = 8 updates round |w| <= 0.1 each, u 0.1 / lr = 1.2e-7 once
    # divided by K lr, and the K-term gradient sum and this formula (|g| <= 0.43) (K + 4) u 0.43 = 3e-7;
    # atol about twice the total
    torch.testing.assert_close(trainer.mean_gradient, option_ii, rtol=0, atol=1e-6)
