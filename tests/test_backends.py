"""The vectorized backend trains each client exactly as the process backend does."""
from __future__ import annotations

import types

import pytest
import torch

import fedsim
from fedsim.client import LocalTrainer, VmapTrainer
from fedsim.flat import FlatModel
from fedsim.models import build_model

U32 = 2.0**-24  # float32 unit roundoff


def local(**changes):
    values = dict(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, mu=0.0, precision="fp32")
    return types.SimpleNamespace(**{**values, **changes})


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(120, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (120,), generator=g)
    # unequal clients: a short last batch, a client smaller than one batch, an even split
    clients = [torch.arange(0, 37), torch.arange(37, 42), torch.arange(42, 58)]
    return x, y, clients


@pytest.mark.parametrize("options", [
    {},
    {"prox_mu": 0.1},
    {"correction": True},
    {"flip_labels": True},
])
def test_vmap_group_equals_clients_trained_one_by_one(options):
    x, y, clients = problem()
    cfg = local()
    torch.manual_seed(0)
    module = build_model("mnist_2nn", (1, 28, 28), 10)
    start = torch.cat([p.detach().flatten() for p in module.parameters()])
    seeds = [11, 22, 33]
    correction = torch.randn(3, len(start)) * 1e-3 if options.get("correction") else None
    flip = torch.tensor([True, False, True]) if options.get("flip_labels") else None
    prox_mu = options.get("prox_mu", 0.0)

    one = LocalTrainer(FlatModel(build_model("mnist_2nn", (1, 28, 28), 10), "cpu"), x, y, cfg, num_classes=10)
    expected, expected_loss, expected_steps, expected_gradients = [], [], [], []
    for i, (ix, seed) in enumerate(zip(clients, seeds)):
        loss, steps = one.train(ix, start, seed, prox_mu=prox_mu,
                                correction=None if correction is None else correction[i],
                                flip_labels=bool(flip[i]) if flip is not None else False)
        expected.append(one.model.flat.clone())
        expected_loss.append(float(loss))
        expected_steps.append(steps)
        expected_gradients.append(one.mean_gradient)

    group = VmapTrainer(build_model("mnist_2nn", (1, 28, 28), 10), x, y, cfg, num_classes=10)
    weights, losses, steps = group.train(clients, start, seeds, group_seed=5, prox_mu=prox_mu,
                                         correction=correction, flip_labels=flip)
    assert steps == expected_steps == [10, 2, 4]
    # vmap's batched kernels sum in other orders than one client's, so each layer's outputs and
    # input gradients may differ by n u relative, n = 784 the longest sum (the first layer). From an
    # exact common start that moves the weights by <= n u max |w - start| and the mean gradients by
    # <= n u max |g| (injecting random relative errors into every layer over all 10 steps, momentum
    # included, gives 0.65 and 1.0 of these), and the loss by <= 2 max |logit error| <= 2 n u
    # max |logit| = 3.2 n u (logits <= 1.6), under 2 n u loss (loss ~2.06). Tolerances: 2 n u times each.
    twice_nu = 2 * 784 * U32
    for i in range(3):
        moved = float((expected[i] - start).abs().max())
        torch.testing.assert_close(weights[i], expected[i], rtol=0, atol=twice_nu * moved)
    torch.testing.assert_close(losses, torch.tensor(expected_loss), rtol=twice_nu, atol=0)
    if correction is not None:  # SCAFFOLD's new control variates agree too
        expected_gradient = torch.stack(expected_gradients)
        torch.testing.assert_close(group.mean_gradient, expected_gradient, rtol=0,
                                   atol=twice_nu * float(expected_gradient.abs().max()))


def test_vmap_refuses_models_with_batch_norm_statistics(tmp_path, monkeypatch):
    from fedsim.errors import ConfigError
    from fedsim.models import MODELS

    class WithBatchNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm2d(1)
            self.fc = torch.nn.Linear(784, 10)

        def forward(self, x):
            return self.fc(self.norm(x).flatten(1))

    monkeypatch.setitem(MODELS._entries, "test_batchnorm",
                        (lambda shape, classes: WithBatchNorm(), "a model with batch-norm statistics"))
    cfg = {"device": "cpu", "backend": "vmap", "model": "test_batchnorm", "rounds": 1, "clients_per_round": 2,
           "data": {"dataset": "synthetic", "num_clients": 2}}
    with pytest.raises(ConfigError, match="backend: vmap cannot train test_batchnorm"):
        fedsim.run(cfg, out=tmp_path / "run", quiet=True)


def test_vmap_results_do_not_depend_on_the_number_of_workers(small_config, tmp_path):
    cfg = dict(small_config, backend="vmap", vmap_group_size=2, rounds=2)  # 4 clients: two groups
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    assert one.test_accuracy == two.test_accuracy and one.train_loss == two.train_loss
    assert one.test_accuracy[-1] > 0.3


def test_bf16_autocast_trains_close_to_fp32_and_keeps_fp32_weights():
    x, y, clients = problem(1)
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in build_model("mnist_cnn", (1, 28, 28), 10).parameters()])
    results = {}
    for precision in ("fp32", "bf16"):
        trainer = LocalTrainer(FlatModel(build_model("mnist_cnn", (1, 28, 28), 10), "cpu"), x, y,
                               local(precision=precision), num_classes=10)
        loss, _ = trainer.train(clients[0], start, seed=4)
        results[precision] = (float(loss), trainer.model.flat.clone())
    assert results["bf16"][1].dtype == torch.float32 and torch.isfinite(results["bf16"][1]).all()
    # bf16 keeps 8 bits (u = 2^-9): logits of size <= 3 come out ~0.015 off (measured), and the
    # cross-entropy moves by at most twice that (its gradient in the logits has l1 norm <= 2): 0.03
    assert abs(results["bf16"][0] - results["fp32"][0]) < 0.05
    assert not torch.equal(results["bf16"][1], results["fp32"][1])  # autocast really ran
