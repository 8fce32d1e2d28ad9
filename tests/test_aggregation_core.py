"""fedavg against a computation written independently with numpy."""
import numpy as np
import torch

from fedsim import aggregation


def test_fedavg_is_the_sample_weighted_mean():
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(5, 37)).astype(np.float32)
    counts = np.array([10, 1, 300, 7, 55])
    expected = sum(counts[i] * updates[i].astype(np.float64) for i in range(5)) / counts.sum()
    magnitude = sum(counts[i] * abs(updates[i].astype(np.float64)) for i in range(5)) / counts.sum()
    got = aggregation.get("fedavg")(torch.from_numpy(updates), torch.from_numpy(counts))
    # in any summation order: 4 additions, one rounding per product and per normalized count, each
    # of a partial sum <= the weighted mean of |u|; twice that for second-order terms
    bound = 2 * (5 + 1) * 2.0**-24 * magnitude
    assert np.all(np.abs(got.numpy() - expected) <= bound), np.max(np.abs(got.numpy() - expected) / bound)


def test_fedavg_of_one_client_is_that_client():
    u = torch.randn(1, 10)
    assert torch.equal(aggregation.get("fedavg")(u, torch.tensor([4])), u[0])  # 4 / 4 = 1 and 1 x = x exactly
