"""Server optimizers against their update equations, written out with numpy."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import fedsim
from fedsim.fl.server_opt import SERVER_OPTIMIZERS, make_server_optimizer

P = 23
U32 = 2.0**-24  # float32 unit roundoff
HYPER = {"momentum": 0.8, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}


def deltas(steps=3, seed=0):
    rng = np.random.default_rng(seed)
    # mixed scales, so that v is larger than delta^2 in some coordinates and smaller in others
    return [rng.normal(scale=rng.choice([1e-3, 1e-1, 1.0], size=P)).astype(np.float32) for _ in range(steps)]


def reference(name, x, ds, lr):
    """x after applying the deltas, in float64, each rule as in Reddi et al. 2021 / Hsu et al. 2019."""
    x = x.astype(np.float64)
    b1, b2, tau = HYPER["beta1"], HYPER["beta2"], HYPER["tau"]
    velocity, m, v = np.zeros(P), np.zeros(P), np.full(P, tau**2)
    for d in ds:
        d = d.astype(np.float64)
        if name == "none":
            x = x + d
            continue
        if name == "fedavgm":
            velocity = HYPER["momentum"] * velocity + d
            x = x + lr * velocity
            continue
        m = b1 * m + (1 - b1) * d
        if name == "fedadagrad":
            v = v + d**2
        elif name == "fedadam":
            v = b2 * v + (1 - b2) * d**2
        else:  # fedyogi
            v = v - (1 - b2) * d**2 * np.sign(v - d**2)
        x = x + lr * m / (np.sqrt(v) + tau)
    return x


def rounding_bound(name, x, ds, lr):
    """Elementwise arithmetic only (no sums, so no summation order): each step rounds x once
    (<= u |x_t|) and its increment through <= ~18 roundings of m, v, the square root, tau, the
    division and lr, each relative to the increment. With M = |x_0| + sum_t |x_t - x_t-1| along
    the reference path, the error is <= (3 + 18) u M; twice that, for second-order terms."""
    path = [reference(name, x, ds[:t], lr) for t in range(len(ds) + 1)]
    moved = sum(abs(b - a) for a, b in zip(path, path[1:]))
    return 2 * 21 * U32 * (abs(x.astype(np.float64)) + moved)


def assert_within(got, expected, bound):
    error = np.abs(np.asarray(got, dtype=np.float64) - expected)
    assert np.all(error <= bound), f"error / bound up to {np.max(error / bound):.3g}, error {np.max(error):.3g}"


def build(name, lr=None):
    return SERVER_OPTIMIZERS.get(name)(lr=lr, num_params=P, device="cpu", **HYPER)


NAMES = ["none", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lr", [None, 0.3])
def test_three_steps_follow_the_update_equations(name, lr):
    opt = build(name, lr)
    x0 = np.random.default_rng(1).normal(size=P).astype(np.float32)
    weights = torch.from_numpy(x0.copy())
    ds = deltas()
    for d in ds:
        opt.step(weights, torch.from_numpy(d))
    assert_within(weights.numpy(), reference(name, x0, ds, opt.lr), rounding_bound(name, x0, ds, opt.lr))


def test_default_learning_rates():
    assert build("none").lr == 1.0
    assert build("fedavgm").lr == 1.0
    assert build("fedadam").lr == 0.01 and build("fedyogi").lr == 0.01
    assert build("fedadagrad").lr == 0.1
    assert build("fedadam", lr=0.5).lr == 0.5


def test_yogi_moves_v_towards_delta_squared_from_both_sides():
    opt = build("fedyogi")
    opt.second_moment.copy_(torch.tensor([4.0] * 12 + [0.25] * 11))
    delta = torch.ones(P)  # delta^2 = 1: below v in the first 12 coordinates, above in the rest
    opt.step(torch.zeros(P), delta)
    assert torch.allclose(opt.second_moment[:12], torch.tensor(4.0 - 0.01))
    assert torch.allclose(opt.second_moment[12:], torch.tensor(0.25 + 0.01))


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trips_through_a_weights_only_checkpoint(name):
    ds = deltas(steps=4, seed=2)
    first = build(name)
    x_first = torch.zeros(P)
    for d in ds[:2]:
        first.step(x_first, torch.from_numpy(d))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(isinstance(value, torch.Tensor) for value in state.values())

    second = build(name)
    second.load_state_dict(state)
    x_second = x_first.clone()
    for d in ds[2:]:
        first.step(x_first, torch.from_numpy(d))
        second.step(x_second, torch.from_numpy(d))
    assert torch.equal(x_first, x_second)


def test_state_dict_is_a_copy():
    opt = build("fedadam")
    state = opt.state_dict()
    opt.step(torch.zeros(P), torch.ones(P))
    assert torch.equal(state["first_moment"], torch.zeros(P))


def test_the_config_builds_the_optimizer_with_its_keys():
    cfg = fedsim.load_config({"server_optimizer": "fedyogi", "server_beta1": 0.5, "server_tau": 0.01})
    opt = make_server_optimizer(cfg, num_params=P, device="cpu")
    assert (opt.lr, opt.beta1, opt.beta2, opt.tau) == (0.01, 0.5, 0.99, 0.01)
    assert torch.allclose(opt.second_moment, torch.full((P,), 1e-4))
    cfg = fedsim.load_config({"server_optimizer": "fedavgm", "server_lr": 0.5, "server_momentum": 0.3})
    opt = make_server_optimizer(cfg, num_params=P, device="cpu")
    assert (opt.lr, opt.momentum) == (0.5, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
def test_cuda_state_and_steps(name):
    opt = SERVER_OPTIMIZERS.get(name)(num_params=P, device="cuda", **HYPER)
    weights = torch.zeros(P, device="cuda")
    for d in deltas():
        opt.step(weights, torch.from_numpy(d).cuda())
    assert all(v.device.type == "cuda" for v in opt.state_dict().values())
    x0 = np.zeros(P, np.float32)  # the same elementwise arithmetic as on the CPU, so the same bound
    assert_within(
        weights.cpu().numpy(), reference(name, x0, deltas(), opt.lr), rounding_bound(name, x0, deltas(), opt.lr)
    )


def test_every_optimizer_is_registered_with_a_description():
    described = dict(SERVER_OPTIMIZERS.describe())
    assert set(NAMES) <= set(described)
    assert all(text and "\n" not in text for text in described.values())
