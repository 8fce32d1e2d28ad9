"""CIFAR-shaped generated data for workload W3, where the CIFAR-10 files are absent: speed does
not depend on pixel values. Named by import path in a config (`w3data:cifar_shaped`, with benchmarks/ on the path)."""

import torch


def cifar_shaped():
    """50,000 training and 10,000 test images, 3x32x32, 10 classes, as CIFAR-10."""
    return generate(50_000, 10_000)


def cifar_shaped_small():
    """5,000 training and 1,000 test images, for a few CPU cores."""
    return generate(5_000, 1_000)


def generate(num_train: int, num_test: int, seed: int = 0):
    """Gaussian noise around one random template per class, so that the labels can be learnt."""
    from fedsim.data import Dataset

    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 32, 32, generator=g)

    def sample(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return templates[y].mul_(0.5).add_(torch.randn(n, 3, 32, 32, generator=g)), y

    train_x, train_y = sample(num_train)
    test_x, test_y = sample(num_test)
    return Dataset(train_x, train_y, test_x, test_y, num_classes=10, name="cifar_shaped")
