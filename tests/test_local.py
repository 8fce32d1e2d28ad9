"""The vectorized backend trains each client exactly as the process backend does."""

from __future__ import annotations

import math
import types

import pytest
import torch

import fedsim
from fedsim.algorithms import ALGORITHMS, Clients, LocalResult
from fedsim.algorithms.group import GroupTrainer
from fedsim.algorithms.local import LocalTrainer
from fedsim.core.flat import FlatModel
from fedsim.experiment.config import LocalConfig
from fedsim.fl.attacks.per_client import LabelFlip
from fedsim.models.zoo import build_model

U32 = 2.0**-24  # float32 unit roundoff


def local(**changes):
    values = dict(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return LocalConfig(**{**values, **changes})


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(120, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (120,), generator=g)
    # unequal clients: a short last batch, a client smaller than one batch, an even split
    clients = [torch.arange(0, 37), torch.arange(37, 42), torch.arange(42, 58)]
    return x, y, clients


def algorithm_state(algorithm, num_params, num_clients, generator):
    """The algorithm's server and client state, random and small (as after a few rounds)."""
    server = {
        name: torch.randn(*shape, generator=generator) * 1e-3
        for name, shape in algorithm.server_state(num_params).items()
    }
    clients = {
        name: torch.randn(num_clients, *shape, generator=generator) * 1e-3
        for name, shape in algorithm.client_state(num_params).items()
    }
    return server, clients


def start_clients(algorithm, ids, server, clients, rnd=1):
    """``local_state`` for the clients ``ids``, as a worker gets it (workers.ClientRunner.train_group)."""
    ids = torch.tensor(ids)
    return algorithm.start_client(Clients(ids, rnd, server, {name: state[ids] for name, state in clients.items()}))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"algorithm": "fedprox", "algorithm_options": {"mu": 0.1}},
        {"algorithm": "scaffold"},
        {"algorithm": "fednova"},
        {"algorithm": "feddyn", "algorithm_options": {"alpha": 0.1}},
        {"flip_labels": True},
    ],
    ids=["fedavg", "fedprox", "scaffold", "fednova", "feddyn", "flip_labels"],
)
def test_vmap_group_equals_clients_trained_one_by_one(options):
    x, y, clients = problem()
    cfg = local()
    algorithm = ALGORITHMS.get(options.get("algorithm", "fedavg"))(**options.get("algorithm_options", {}))
    algorithm.setup(types.SimpleNamespace(local=cfg))
    torch.manual_seed(0)
    module = build_model("mnist_2nn", (1, 28, 28), 10)
    start = torch.cat([p.detach().flatten() for p in module.parameters()])
    seeds = [11, 22, 33]
    server, client_state = algorithm_state(algorithm, len(start), 3, torch.Generator().manual_seed(1))
    flip = torch.tensor([True, False, True]) if options.get("flip_labels") else None
    relabel = LabelFlip().relabel if flip is not None else None
    sizes = torch.tensor([float(len(ix)) for ix in clients])

    one = LocalTrainer(
        FlatModel(build_model("mnist_2nn", (1, 28, 28), 10), "cpu"), x, y, cfg, num_classes=10, algorithm=algorithm
    )
    expected, expected_loss, expected_steps, expected_gradients, expected_reports = [], [], [], [], []
    for i, (ix, seed) in enumerate(zip(clients, seeds)):
        state = start_clients(algorithm, [i], server, client_state)
        trained = one.train(
            ix, start, seed, local_state=state, relabel=relabel if flip is not None and flip[i] else None
        )
        expected.append(one.model.flat.clone())
        expected_loss.append(float(trained.loss))
        expected_steps.append(int(trained.steps))
        expected_gradients.append(trained.mean_gradient)
        expected_reports.append(
            algorithm.client_report(
                LocalResult(
                    start, one.model.flat[None].clone(), trained.steps, sizes[i : i + 1], trained.mean_gradient
                ),
                state,
            )
        )

    group = GroupTrainer(build_model("mnist_2nn", (1, 28, 28), 10), x, y, cfg, num_classes=10, algorithm=algorithm)
    state = start_clients(algorithm, [0, 1, 2], server, client_state)
    weights, trained = group.train(
        clients, start, seeds, group_seed=5, local_state=state, relabel=relabel, attacked=flip
    )
    reports = algorithm.client_report(LocalResult(start, weights, trained.steps, sizes, trained.mean_gradient), state)
    assert trained.steps.tolist() == expected_steps == [10, 2, 4]
    # vmap's batched kernels sum in other orders than one client's, so each layer's outputs and
    # input gradients may differ by n u relative, n = 784 the longest sum (the first layer). From an
    # exact common start that moves the weights by <= n u max |w - start| and the mean gradients by
    # <= n u max |g| (injecting random relative errors into every layer over all 10 steps, momentum
    # included, gives 0.65 and 1.0 of these), and the loss by <= 2 max |logit error| <= 2 n u
    # max |logit| = 3.2 n u (logits <= 1.6), under 2 n u loss (loss ~2.06). Tolerances: 2 n u times each.
    # The algorithms' terms (FedProx's mu (w - x), SCAFFOLD's c - c_i, FedDyn's alpha (w - x) - g_k) are
    # the same elementwise arithmetic in both trainers, and contract rather than amplify (mu, alpha > 0).
    twice_nu = 2 * 784 * U32
    for i in range(3):
        moved = float((expected[i] - start).abs().max())
        torch.testing.assert_close(weights[i], expected[i], rtol=0, atol=twice_nu * moved)
    torch.testing.assert_close(trained.loss, torch.tensor(expected_loss), rtol=twice_nu, atol=0)
    assert set(reports) == set(expected_reports[0]) == set(algorithm.report_shapes(len(start)))
    if algorithm.keeps_mean_gradient:  # SCAFFOLD's new control variates agree too
        expected_gradient = torch.cat(expected_gradients)
        atol = twice_nu * float(expected_gradient.abs().max())
        torch.testing.assert_close(trained.mean_gradient, expected_gradient, rtol=0, atol=atol)
        # the change c_i+ - c_i subtracts the same c_i (|c_i| ~ 1e-3) from both: one more rounding, far below atol
        expected_change = torch.cat([r["control_change"] for r in expected_reports])
        torch.testing.assert_close(reports["control_change"], expected_change, rtol=0, atol=atol)
    if "steps" in reports:  # FedNova's report: each client's own number of steps, exactly
        assert reports["steps"].tolist() == [float(r["steps"]) for r in expected_reports] == [10.0, 2.0, 4.0]


@pytest.mark.slow
def test_vmap_refuses_models_with_batch_norm_statistics(tmp_path, monkeypatch):
    from fedsim.core.errors import ConfigError
    from fedsim.models.zoo import MODELS

    class WithBatchNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm2d(1)
            self.fc = torch.nn.Linear(784, 10)

        def forward(self, x):
            return self.fc(self.norm(x).flatten(1))

    monkeypatch.setitem(
        MODELS._entries,
        "test_batchnorm",
        (lambda shape, classes: WithBatchNorm(), "a model with batch-norm statistics"),
    )
    cfg = {
        "device": "cpu",
        "backend": "vmap",
        "model": "test_batchnorm",
        "rounds": 1,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "num_clients": 2},
    }
    with pytest.raises(ConfigError, match="backend: vmap cannot train test_batchnorm"):
        fedsim.run(cfg, out=tmp_path / "run", quiet=True)


@pytest.mark.slow
def test_vmap_results_do_not_depend_on_the_number_of_workers(small_config, tmp_path):
    cfg = dict(small_config, backend="vmap", vmap_group_size=2, rounds=2)  # 4 clients: two groups
    one = fedsim.run(cfg, out=tmp_path / "w1", quiet=True, workers=1)
    two = fedsim.run(cfg, out=tmp_path / "w2", quiet=True, workers=2)
    assert one.test_accuracy == two.test_accuracy and one.train_loss == two.train_loss
    assert one.test_accuracy[-1] > 0.3


@pytest.mark.slow
def test_bf16_autocast_trains_close_to_fp32_and_keeps_fp32_weights():
    x, y, clients = problem(1)
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in build_model("mnist_cnn", (1, 28, 28), 10).parameters()])
    results = {}
    for precision in ("fp32", "bf16"):
        trainer = LocalTrainer(
            FlatModel(build_model("mnist_cnn", (1, 28, 28), 10), "cpu"),
            x,
            y,
            local(precision=precision),
            num_classes=10,
        )
        trained = trainer.train(clients[0], start, seed=4)
        results[precision] = (float(trained.loss), trainer.model.flat.clone())
    assert results["bf16"][1].dtype == torch.float32 and torch.isfinite(results["bf16"][1]).all()
    # bf16 keeps 8 bits (u = 2^-9): logits of size <= 3 come out ~0.015 off (measured), and the
    # cross-entropy moves by at most twice that (its gradient in the logits has l1 norm <= 2): 0.03
    assert abs(results["bf16"][0] - results["fp32"][0]) < 0.05
    assert not torch.equal(results["bf16"][1], results["fp32"][1])  # autocast really ran


# ----------------------------------------------------------------------------- batched adapters


def adapted_transformer(method: str, seed: int = 0):
    """A small char_transformer with LoRA adapters on its attention (``whole``: none, every
    parameter trained), B moved off zero (as after some rounds) so that every adapter's gradient
    is alive from the first step."""
    from fedsim.models.language import char_transformer
    from fedsim.models.lora import LoraConfig, apply_lora

    torch.manual_seed(seed)
    module = char_transformer((12,), 40, layers=2, heads=2, width=32)
    if method != "whole":
        apply_lora(module, LoraConfig(rank=4, alpha=8.0, method=method), "char_transformer")
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return module


def token_problem():
    """Sequences of 12 token ids with next-token targets, the last few positions of some ignored
    (a client's padded end), cut among three clients of unequal sizes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 40, (70, 12), generator=g)
    y = torch.roll(x, -1, dims=1)
    y[::5, 9:] = -100  # IGNORE_INDEX
    return x, y, [torch.arange(0, 29), torch.arange(29, 34), torch.arange(34, 47)]


# Not adamw with a model trained whole: attention's key biases have a gradient that is 0 in exact
# arithmetic and rounding noise in float32, which AdamW's g / (sqrt(v) + eps) turns into steps of
# full size and random sign, different in any two summation orders.
@pytest.mark.parametrize(
    ("method", "optimizer"), [("fedit", "sgd"), ("fedit", "adamw"), ("ffa", "sgd"), ("ffa", "adamw"), ("whole", "sgd")]
)
def test_batched_adapters_give_each_client_what_the_process_trainer_gives_it(method, optimizer):
    """One group of three clients of 29, 5 and 13 sequences, one of them a straggler stopped
    after 3 steps, trained through one pass of the frozen base per step (FedIT, FFA-LoRA; or a
    language model trained whole, by torch.func.vmap): each client's weights, steps and mean loss
    per scored token are those of the process trainer for it alone."""
    from fedsim.models.lora import groupable

    x, y, clients = token_problem()
    if optimizer == "adamw":
        cfg = local(optimizer="adamw", momentum=0.0, lr=1e-2, weight_decay=0.01, epochs=2, batch_size=4)
    else:
        cfg = local(epochs=2, batch_size=4)
    seeds, limits = [7, 8, 9], [None, None, 3]

    one = LocalTrainer(FlatModel(adapted_transformer(method), "cpu"), x, y, cfg, num_classes=40)
    start = one.model.flat.clone()
    assert groupable(one.model.module) == (method != "whole")
    expected, losses, steps = [], [], []
    for ix, seed, limit in zip(clients, seeds, limits):
        trained = one.train(ix, start, seed, max_steps=limit)
        expected.append(one.model.flat.clone())
        losses.append(float(trained.loss))
        steps.append(int(trained.steps))

    model = FlatModel(adapted_transformer(method), "cpu")
    group = GroupTrainer(model.module, x, y, cfg, num_classes=40)
    weights, trained = group.train(clients, start, seeds, group_seed=5, max_steps=limits)
    assert trained.steps.tolist() == steps == [16, 4, 3]
    # The same arithmetic but for the order of the batched sums, whose results differ by at most
    # n u relative (n = 96, the widest layer's outputs), and AdamW's bias corrections, rounded to
    # float32 here and kept in float64 by the process trainer (a few u a step). As in the test
    # above, from an exact common start the weights then differ by <= n u max |w - start| and the
    # loss by <= 2 n u relative; tolerances: 2 n u times each (the SGD cases agree exactly, and the
    # AdamW ones to 0.33 n u, on this machine).
    twice_nu = 2 * 96 * U32
    for i in range(3):
        moved = float((expected[i] - start).abs().max())
        assert moved > 0
        torch.testing.assert_close(weights[i], expected[i], rtol=0, atol=twice_nu * moved)
    torch.testing.assert_close(trained.loss, torch.tensor(losses), rtol=2 * twice_nu, atol=0)


# ----------------------------------------------------------------------------- the learning rate over the rounds


def flowertune_cosine(current_round: int, total_round: int, lrate_max: float, lrate_min: float) -> float:
    """FlowerTune's cosine_annealing, as its LLM templates write it (Flower counts rounds from 1)."""
    cos_inner = math.pi * current_round / total_round
    return lrate_min + 0.5 * (lrate_max - lrate_min) * (1 + math.cos(cos_inner))


def test_the_cosine_schedule_starts_at_lr_and_stays_above_lr_min():
    cfg = local(lr=0.02, lr_schedule="cosine", lr_min=0.001)
    rates = [cfg.round_lr(t, 10) for t in range(1, 11)]
    # torch's CosineAnnealingLR over T_max = 10 steps, one a round, read before each step
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.02)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.001)
    expected = []
    for _ in range(10):
        expected.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)  # torch's recursion rounds otherwise
    assert rates[0] == 0.02 and min(rates) > 0.001 and rates == sorted(rates, reverse=True)
    # FlowerTune's curve, one round on: its round t is round t + 1 here, its last at lr_min
    assert rates[1:] == [flowertune_cosine(t, 10, 0.02, 0.001) for t in range(1, 10)]
    assert flowertune_cosine(10, 10, 0.02, 0.001) == 0.001
    annealed_to_0 = local(lr=0.02, lr_schedule="cosine")
    assert annealed_to_0.round_lr(1, 1) == 0.02 and annealed_to_0.round_lr(5, 5) > 0
    assert local(lr=0.02).round_lr(7, 10) == 0.02


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_cosine_run_trains_each_round_at_its_rate(tmp_path, optimizer):
    """Annealed from lr to 0 over 2 rounds: round 1 trains at lr, exactly as a constant run does
    (and a 1-round run at lr), round 2 at lr / 2, so that each client's one step moves half as far
    as the constant run's from the same weights (SGD's -lr g, AdamW's first step -lr g / (|g| + eps))."""
    cfg = {
        "seed": 2,
        "device": "cpu",
        "workers": 0,
        "rounds": 2,
        "clients_per_round": 2,
        "model": "mnist_2nn",
        "data": {"dataset": "synthetic", "limit": 400, "num_clients": 4},
        "local": {"lr": 0.1 if optimizer == "sgd" else 0.01, "optimizer": optimizer, "steps": 1},
    }
    cosine = {**cfg["local"], "lr_schedule": "cosine"}
    annealed = fedsim.run({**cfg, "local": cosine}, out=tmp_path / "cosine", quiet=True)
    constant = fedsim.run(cfg, out=tmp_path / "constant", quiet=True)
    one = fedsim.run({**cfg, "rounds": 1, "local": cosine}, out=tmp_path / "one", quiet=True)
    assert annealed.rows[0]["test_loss"] == constant.rows[0]["test_loss"] == one.rows[0]["test_loss"]
    assert all(r["update_norm"] > 0 for r in one.client_records)  # a 1-round run trains
    second = [(a["update_norm"], c["update_norm"]) for a, c in zip(annealed.client_records, constant.client_records)]
    for a, c in second[2:]:
        assert a > 0 and a == pytest.approx(c / 2, rel=1e-5)  # a step's float32 rounding, relative
    assert annealed.test_loss[1] != annealed.test_loss[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_client_optimizer_steps_a_client_alone_or_in_a_group_as_torch_does(optimizer):
    """ClientOptimizer, the one step both trainers take: one client's steps are torch.optim's bit for
    bit (SGD's with momentum and decay, AdamW's without decay); in a group, the clients that have a step take it as the
    client alone does and the others keep their weights and state."""
    from fedsim.algorithms.local import ClientOptimizer

    # AdamW's decay rounds otherwise than torch's (w - lr wd w against w (1 - lr wd)): left out of the exact check
    decay = 0.0 if optimizer == "adamw" else 0.01
    cfg = local(optimizer=optimizer, momentum=0.0 if optimizer == "adamw" else 0.9, lr=0.1, weight_decay=decay)
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(5, generator=g), [torch.randn(5, generator=g) for _ in range(3)]
    reference = start.clone().requires_grad_()
    if optimizer == "adamw":
        torch_opt = torch.optim.AdamW([reference], lr=0.1, weight_decay=decay, foreach=False)
    else:
        torch_opt = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    alone, group = start.clone(), torch.stack([start, start])
    one, both = ClientOptimizer(cfg, alone), ClientOptimizer(cfg, group, clients=2)
    for t, grad in enumerate(grads):
        reference.grad = grad.clone()
        torch_opt.step()
        g1 = grad.clone()
        one.decay_in_gradient(g1, alone)
        one.step(alone, g1, 0.1)
        g2 = torch.stack([grad, grad])
        both.decay_in_gradient(g2, group)
        both.step(group, g2, 0.1, active=torch.tensor([[1.0], [float(t == 0)]]))  # client 2 has step 1 only
    assert torch.equal(alone, reference.detach())
    # a group's bias corrections are per client, tensors: within a few float32 roundings of the client's
    torch.testing.assert_close(group[0], alone, rtol=4 * 2.0**-24, atol=1e-7)
    one_step = ClientOptimizer(cfg, start.clone())
    first = start.clone()
    g1 = grads[0].clone()
    one_step.decay_in_gradient(g1, first)
    one_step.step(first, g1, 0.1)
    torch.testing.assert_close(group[1], first, rtol=4 * 2.0**-24, atol=1e-7)  # kept after its one step
