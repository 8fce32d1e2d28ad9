"""MOON (algorithms/moon.py): the model-contrastive term, the local step against the paper's loss,
each client's previous model kept as its state, learning, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fedsim
from fedsim.algorithms.local import LocalTrainer
from fedsim.algorithms.moon import Moon, contrastive_loss
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel, flat_size
from fedsim.experiment.config import LocalConfig
from fedsim.models.zoo import MoonCNN, build_model


def test_the_contrastive_term_is_the_papers_on_hand_computed_similarities():
    """Two samples whose cosine similarities are known by hand: sample 1 is its global representation
    (sim 1) and orthogonal to its previous one (sim 0); sample 2 is at 45 degrees to its global one
    (sim 1/sqrt 2) and is its previous one (sim 1). With tau = 0.5, l_con = -log(e^(s_g/tau) /
    (e^(s_g/tau) + e^(s_p/tau))) = log(1 + e^((s_p - s_g)/tau)), averaged over the two."""
    z = torch.tensor([[3.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 0.0], [5.0, 5.0]])
    z_prev = torch.tensor([[0.0, 7.0], [0.0, 1.0]])
    tau = 0.5
    by_hand = [math.log(1 + math.exp((0 - 1) / tau)), math.log(1 + math.exp((1 - 1 / math.sqrt(2)) / tau))]
    # float32 cosines and a log-sum-exp of two terms: a few units of float32 roundoff
    assert float(contrastive_loss(z, z_glob, z_prev, tau)) == pytest.approx(sum(by_hand) / 2, rel=1e-6)
    # equal similarities: log 2 whatever the representation, so a client without a previous model
    # (which uses the global one) trains on cross-entropy alone
    same = contrastive_loss(z, z_glob, z_glob, tau)
    assert float(same) == pytest.approx(math.log(2), rel=1e-6)


def paper_step(start, previous, x, y, mu, tau, lr):
    """One SGD step of a client on the whole batch by the paper's local loss, written out: CE + mu l_con
    with l_con = -log(exp(sim_g / tau) / (exp(sim_g / tau) + exp(sim_p / tau))), the representations
    of the global and previous models without a gradient, those models in eval mode."""
    trained, glob, prev = (FlatModel(MoonCNN(1, 10, 28), "cpu") for _ in range(3))
    for model, weights in ((trained, start), (glob, start), (prev, previous)):
        model.flat.copy_(weights)
    glob.module.eval(), prev.module.eval()
    z = trained.module.represent(x)
    with torch.no_grad():
        z_glob, z_prev = glob.module.represent(x), prev.module.represent(x)
    sim_g, sim_p = F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)
    l_con = -torch.log(torch.exp(sim_g / tau) / (torch.exp(sim_g / tau) + torch.exp(sim_p / tau)))
    loss = F.cross_entropy(trained.module.classify(z), y) + mu * l_con.mean()
    loss.backward()
    return start[: trained.num_params] - lr * trained.grad


def test_a_local_step_is_sgd_on_cross_entropy_plus_mu_times_the_contrastive_term():
    """MOON's objective through the trainer's loss hook, one step on a batch of 6, against the
    paper's loss written out with autograd on separate copies of moon_cnn."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28, generator=g), torch.randint(0, 10, (6,), generator=g)
    torch.manual_seed(0)
    model = FlatModel(MoonCNN(1, 10, 28), "cpu")
    start = model.flat.clone()
    previous = start + 0.05 * torch.randn(start.shape, generator=g)
    moon = Moon(mu=5.0, tau=0.5)
    moon.bind(model.module)
    lr = 0.1
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=1, batch_size=6, lr=lr), num_classes=10, algorithm=moon)
    trained = moon.train_client(lambda w, **phase: trainer.train(torch.arange(6), w, 0, **phase), start, previous)
    want = paper_step(start, previous, x, y, 5.0, 0.5, lr)
    # same loss by another formula (cross-entropy of the logits vs the log of the ratio), batch in another
    # order: float32 roundoff in gradients of size ~1, times lr
    torch.testing.assert_close(trained.weights, want, rtol=0, atol=1e-6)
    assert float((trained.weights - start).abs().max()) > 1e-3  # it moved
    # the contrastive term did something: mu = 0 takes another step
    plain = Moon(mu=0.0)
    plain.bind(model.module)
    trainer.algorithm = plain
    other = plain.train_client(lambda w, **phase: trainer.train(torch.arange(6), w, 0, **phase), start, previous)
    assert float((other.weights - want).abs().max()) > 1e-4


def test_the_contrastive_objective_falls_over_local_steps():
    """Ten epochs of one client's rounds on a batch of 16, each from where the last ended: the
    objective MOON trains on (cross-entropy plus mu l_con, the trainer's mean loss) falls."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    torch.manual_seed(1)
    model = FlatModel(MoonCNN(1, 10, 28), "cpu")
    start = model.flat.clone()
    previous = start + 0.1 * torch.randn(start.shape, generator=g)
    moon = Moon()
    moon.bind(model.module)
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=1, batch_size=16, lr=0.05), num_classes=10, algorithm=moon)
    losses, weights = [], start
    for step in range(10):
        trained = moon.train_client(
            lambda w, step=step, **phase: trainer.train(torch.arange(16), w, step, **phase), weights, previous
        )
        losses.append(float(trained.loss))
        weights = trained.weights.clone()
    assert losses[-1] < losses[0] - 0.3, losses  # measured: 6.20 -> 5.39


def moon_config(**changes):
    return {
        "name": "moon",
        "seed": 2,
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 6,
        "algorithm": "moon",
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600},
        "local": {"batch_size": 32, "lr": 0.05},
        **changes,
    }


@pytest.mark.slow
def test_each_clients_previous_model_is_what_it_sent_and_its_first_round_is_fedavgs(tmp_path):
    """After a round of every client, the global model is the clients' trained weights averaged by
    sample count; those weights are the clients' kept previous models, so their weighted mean must be
    the global model. In that first round each client's previous model is the global one, so l_con is
    log 2 with a gradient of 0 and the round is FedAvg's (to rounding: autograd adds the term's two
    opposite halves to the cross-entropy's gradient one after the other)."""
    history = fedsim.run(moon_config(), out=tmp_path / "run", quiet=True)
    fedavg = fedsim.run(moon_config(algorithm="fedavg"), out=tmp_path / "fedavg", quiet=True)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    fedavg_global = torch.load(tmp_path / "fedavg" / "checkpoint.pt", weights_only=True)["global"]
    torch.testing.assert_close(state["global"], fedavg_global, rtol=0, atol=1e-6)
    assert history.train_loss[0] == pytest.approx(fedavg.train_loss[0] + 5 * math.log(2), abs=1e-4)
    held = state["client_state"]["previous"]
    assert sorted(held) == list(range(6))
    samples = {r["client"]: r["samples"] for r in history.client_records}
    mean = sum(samples[c] * held[c].double() for c in held) / sum(samples.values())
    # the server's float32 average of six rows against this float64 one
    torch.testing.assert_close(state["global"], mean.float(), rtol=0, atol=1e-6)
    assert all(len(row) == len(state["global"]) for row in held.values())  # weights and buffers
    assert not torch.equal(held[0], held[1])


@pytest.mark.slow
def test_moon_runs_are_the_same_bits_for_any_workers(tmp_path):
    """Each worker keeps its own copies of the reference models; what a client trains depends on its
    rows alone: workers 0 and 2 end with the same global model, previous models and figures."""
    cfg = moon_config(rounds=2, clients_per_round=3)
    zero = fedsim.run(cfg, out=tmp_path / "w0", quiet=True)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    ends = [torch.load(tmp_path / run / "checkpoint.pt", weights_only=True) for run in ("w0", "w2")]
    assert torch.equal(ends[0]["global"], ends[1]["global"])
    held, other = (end["client_state"]["previous"] for end in ends)
    assert held.keys() == other.keys() and all(torch.equal(held[c], other[c]) for c in held)
    assert zero.test_accuracy == two.test_accuracy and zero.train_loss == two.train_loss


@pytest.mark.slow
def test_moon_learns_mnist(learning_config, tmp_path):
    """Real MNIST when FEDSIM_DATA has it, the generated stand-in otherwise; 2 workers, 3 rounds."""
    cfg = dict(learning_config, algorithm="moon", on_nonfinite="fail")  # mnist_cnn's 50 units as z
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    # measured on MNIST: 0.42, 0.59, 0.74; train loss (with mu l_con) 5.74, 4.83, 4.64
    assert history.test_accuracy[-1] > 0.5, history.test_accuracy  # chance is 0.1
    assert history.test_accuracy[-1] > history.test_accuracy[0] + 0.1, history.test_accuracy
    assert history.train_loss[-1] < history.train_loss[0], history.train_loss


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"model": "fedavg_cnn"}, ("algorithm: moon", "FedAvgCNN", "moon_cnn")),
        ({"backend": "vmap"}, ("backend", "moon", "process")),
        ({"algorithm_options": {"tau": 0}}, ("algorithm_options", "tau", "> 0")),
        ({"algorithm_options": {"mu": -1}}, ("algorithm_options", "mu", "-1")),
    ],
)
def test_moon_refuses_what_it_cannot_train_in_one_line(changes, fragments, tmp_path):
    with pytest.raises(ConfigError) as error:
        fedsim.run(moon_config(**changes), out=tmp_path / "run", quiet=True)
    one_line(str(error.value), *fragments)


def test_the_client_state_is_the_whole_model_and_bounded(tmp_path):
    """A client's row holds every value of the flat model (a batch-norm model's statistics too): 4
    bytes each, which client_state_limit_mb bounds for the whole federation before the run."""
    bn = build_model("cifar_cnn_bn", (3, 32, 32), 10)
    assert flat_size(bn) == len(FlatModel(bn, "cpu").flat) > sum(p.numel() for p in bn.parameters())
    module = build_model("moon_cnn", (1, 28, 28), 10)
    moon = Moon()
    moon.bind(module)
    assert moon.client_state(1) == {"previous": (flat_size(module),)} == {"previous": (75046,)}
    with pytest.raises(ConfigError) as error:
        fedsim.run(moon_config(model="moon_cnn", client_state_limit_mb=1), out=tmp_path / "run", quiet=True)
    # 6 clients x 75,046 values x 4 bytes = 1.7 MiB
    one_line(str(error.value), "client_state_limit_mb", "1.7 MiB")


def one_line(message: str, *fragments: str) -> None:
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
