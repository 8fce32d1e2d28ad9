"""FedProto (algorithms/fedproto.py): the server's prototypes, the nearest-prototype prediction, the
local step against the paper's loss, the clients' own models, learning, and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fedsim
from fedsim.algorithms import Round
from fedsim.algorithms.fedproto import FedProto, NearestPrototype, aggregate_prototypes, prototype_scores
from fedsim.algorithms.local import LocalTrainer
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.experiment.config import LocalConfig
from fedsim.models.zoo import MoonCNN

# two clients, three classes, prototypes of width 2; class 2 is held by neither
PROTOTYPES = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
COUNTS = torch.tensor([[1.0, 3.0, 0.0], [3.0, 1.0, 0.0]])


def test_the_server_averages_each_classs_prototypes_by_count():
    """C_j = sum_i n_ij C_ij / sum_i n_ij: class 0 (1 [1, 0] + 3 [3, 0]) / 4 = [2.5, 0], class 1
    (3 [0, 2] + 1 [0, 0]) / 4 = [0, 1.5]; class 2 has no sample, so no prototype (a total of 0)."""
    prototypes, total = aggregate_prototypes(PROTOTYPES, COUNTS)
    assert torch.equal(prototypes, torch.tensor([[2.5, 0.0], [0.0, 1.5], [0.0, 0.0]]))
    assert torch.equal(total, torch.tensor([4.0, 4.0, 0.0]))
    # the authors' code: the plain mean over the clients holding the class, ([1, 0] + [3, 0]) / 2, ([0, 2] + 0) / 2
    plain, _ = aggregate_prototypes(PROTOTYPES, COUNTS, weighted=False)
    assert torch.equal(plain, torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))


def test_a_round_replaces_the_reported_prototypes_keeps_the_others_and_moves_no_weight():
    algorithm = FedProto()
    algorithm.classes, algorithm.width = 3, 2
    server = {"prototypes": torch.tensor([[9.0, 9.0], [9.0, 9.0], [7.0, 7.0]]), "prototype_counts": torch.ones(3)}
    round = Round(
        updates=torch.zeros(2, 5),
        weights=torch.tensor([4.0, 4.0]),
        clients=torch.tensor([0, 1]),
        reports={"prototypes": PROTOTYPES, "prototype_counts": COUNTS},
        aggregate=None,
        global_weights=torch.arange(5.0),
        num_params=5,
        num_clients=2,
    )
    delta = algorithm.server_update(round, server, {})
    assert torch.equal(delta, torch.zeros(5))  # the global model is never averaged
    assert torch.equal(server["prototypes"], torch.tensor([[2.5, 0.0], [0.0, 1.5], [7.0, 7.0]]))
    assert torch.equal(server["prototype_counts"], torch.tensor([4.0, 4.0, 1.0]))


def test_inference_is_by_the_nearest_global_prototype():
    """Prototypes [0, 0], [10, 0] and class 2 without one: [9, 1] is nearest class 1 (squared
    distance 2 against 82); [1, 9] class 0 (82 against 162; class 2 has no prototype to be near);
    [6, 0] class 1 (16 against 36)."""
    prototypes = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    counts = torch.tensor([5.0, 2.0, 0.0])
    z = torch.tensor([[9.0, 1.0], [1.0, 9.0], [6.0, 0.0]])
    scores = prototype_scores(z, prototypes, counts)
    assert torch.equal(scores[:, :2], -torch.tensor([[82.0, 2.0], [82.0, 162.0], [36.0, 16.0]]))
    assert torch.equal(scores[:, 2], torch.full((3,), -torch.inf))
    assert scores.argmax(1).tolist() == [1, 0, 1]

    class Identity(torch.nn.Module):  # a model whose representation is its input
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(1, 1)

        def represent(self, x):
            return x

    assert NearestPrototype(Identity(), prototypes, counts)(z).argmax(1).tolist() == [1, 0, 1]


def test_a_local_step_is_sgd_on_cross_entropy_plus_lam_times_the_prototype_distance():
    """One step on a batch of 6 whose classes 0 and 1 have global prototypes and class 2 none, against
    the loss written out: CE + lam * sum over the samples of known classes of ||z - C[y]||^2 / (B d)
    (torch's mean squared error, as the authors' code), with autograd on a separate copy. The client
    reports each class's mean representation and count, keeps the stepped model and sends the global
    weights back unchanged."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 28, 28, generator=g), torch.tensor([0, 0, 1, 2, 2, 2])
    torch.manual_seed(0)
    model = FlatModel(MoonCNN(1, 10, 28), "cpu")
    start = model.flat.clone()
    own = start + 0.05 * torch.randn(start.shape, generator=g)  # the client's model, not the global one
    algorithm = FedProto(lam=2.0)
    algorithm.bind(model.module)
    prototypes = torch.randn(10, 256, generator=g)
    counts = torch.zeros(10)
    counts[:2] = 1.0
    server = {"prototypes": prototypes, "prototype_counts": counts}
    local = algorithm.start_client(
        fedsim.algorithms.Clients(torch.tensor([0]), 2, server, {"model": own[None].clone()})
    )
    lr = 0.1
    trainer = LocalTrainer(model, x, y, LocalConfig(epochs=1, batch_size=6, lr=lr), num_classes=10)
    trained = algorithm.train_client(lambda w, **phase: trainer.train(torch.arange(6), w, 0, **phase), start, local)
    reports = algorithm.client_report(None, local)

    reference = FlatModel(MoonCNN(1, 10, 28), "cpu")
    reference.flat.copy_(own)
    z = reference.module.represent(x)
    known = y < 2
    distance = ((z[known] - prototypes[y[known]]) ** 2).sum()
    loss = F.cross_entropy(reference.module.classify(z), y) + 2.0 * distance / z.numel()
    loss.backward()
    want = own[: reference.num_params] - lr * reference.grad
    # the same loss by another formula, the batch in another order: float32 roundoff of gradients ~1, times lr
    torch.testing.assert_close(reports["model"][0], want, rtol=0, atol=1e-6)
    assert torch.equal(trained.weights, start)  # nothing of the model travels
    z = z.detach()
    means = torch.stack([z[y == c].mean(0) for c in range(3)])
    torch.testing.assert_close(reports["prototypes"][0, :3], means, rtol=0, atol=1e-6)
    assert torch.equal(reports["prototypes"][0, 3:], torch.zeros(7, 256))
    assert reports["prototype_counts"][0].tolist() == [2, 1, 3] + [0] * 7


def fedproto_config(**changes):
    return {
        "name": "fedproto",
        "seed": 2,
        "rounds": 3,
        "workers": 0,
        "clients_per_round": 6,
        "algorithm": "fedproto",
        "eval_per_client": True,
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 600, "test_partition": True},
        "local": {"batch_size": 32, "lr": 0.05},
        **changes,
    }


def test_fedproto_clients_learn_their_own_models_and_the_global_one_stays(tmp_path):
    """On 1,600 generated samples split Dir(0.3) over 10 clients: every client's own model, scored by
    the nearest prototype on its own test split, gets better over the rounds; the global model is
    the initial one throughout, and each client keeps a model of its own."""
    cfg = fedproto_config(
        clients_per_round=10,
        data={
            "dataset": "synthetic",
            "limit": 1600,
            "partition": "dirichlet",
            "alpha": 0.3,
            "num_clients": 10,
            "test_partition": True,
        },
    )
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    accuracy = [row["client_accuracy_mean"] for row in history.rows]
    # measured: 0.64, 0.68, 0.78 (chance: 0.1)
    assert accuracy[-1] > 0.7 and accuracy[-1] > accuracy[0] + 0.1, accuracy
    assert len({row["test_accuracy"] for row in history.rows}) == 1  # the untouched initial model
    assert history.summary["global_model_trained"] is False
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    models = state["client_state"]["model"]
    assert len(models) == 10 and not torch.equal(models[0], models[1])
    assert (state["algorithm"]["server"]["prototype_counts"] > 0).all()
    # only prototypes and counts travel, 10 x (50 + 1) float32 each way, for 10 clients in 3 rounds
    assert history.summary["bytes_sent"] == 3 * 10 * 2 * 10 * 51 * 4


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"model": "fedavg_cnn"}, ("algorithm: fedproto", "FedAvgCNN", "moon_cnn")),
        ({"backend": "vmap"}, ("backend", "fedproto", "process")),
        ({"algorithm_options": {"lam": -1}}, ("algorithm_options", "lam", "-1")),
        ({"algorithm_options": {"weighted": "yes"}}, ("algorithm_options", "weighted", "true or false")),
    ],
)
def test_fedproto_refuses_what_it_cannot_train_in_one_line(changes, fragments, tmp_path):
    with pytest.raises(ConfigError) as error:
        fedsim.run(fedproto_config(**changes), out=tmp_path / "run", quiet=True)
    message = str(error.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
