import pytest
import torch
import torch.nn.functional as F
from support import installed

from fedsim.core.flat import FlatModel
from fedsim.models.zoo import MODELS, build_model


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_the_papers():
    assert count(build_model("mnist_cnn", (1, 28, 28), 10)) == 21_840
    assert count(build_model("fedavg_cnn", (1, 28, 28), 10)) == 1_663_370
    assert count(build_model("pfl_cnn", (3, 32, 32), 10)) == 1_626_442


def test_every_model_maps_a_batch_to_class_scores():
    for name in MODELS.names():
        if name in ("mnist_cnn", "fedavg_cnn", "simple_cnn"):
            out = build_model(name, (1, 28, 28), 10)(torch.randn(3, 1, 28, 28))
            assert out.shape == (3, 10)


def test_flat_model_views_share_memory_with_the_module():
    torch.manual_seed(0)
    module = build_model("mnist_cnn", (1, 28, 28), 10)
    before = torch.cat([p.detach().flatten() for p in module.parameters()])
    flat = FlatModel(module, "cpu")
    assert torch.equal(flat.params, before)
    flat.flat.zero_()
    assert all((p == 0).all() for p in module.parameters())
    module(torch.randn(2, 1, 28, 28)).sum().backward()
    assert flat.grad.abs().sum() > 0  # gradients land in the flat buffer


def test_simple_cnn_is_niid_benchs_simple_cnn_layer_for_layer():
    """NIID-Bench's SimpleCNNMNIST (model.py): conv 6 5x5, max-pool 2, conv 16 5x5, max-pool 2,
    fc 16*4*4 -> 120 -> 84 -> 10, ReLU between; its SimpleCNN on 3x32x32 has fc1 16*5*5 -> 120."""
    model = build_model("simple_cnn", (1, 28, 28), 10)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "conv1.weight": (6, 1, 5, 5),
        "conv1.bias": (6,),
        "conv2.weight": (16, 6, 5, 5),
        "conv2.bias": (16,),
        "fc1.weight": (120, 256),
        "fc1.bias": (120,),
        "fc2.weight": (84, 120),
        "fc2.bias": (84,),
        "fc3.weight": (10, 84),
        "fc3.bias": (10,),
    }
    assert count(model) == 156 + 2_416 + 30_840 + 10_164 + 850 == 44_426
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    assert not any(isinstance(m, (torch.nn.Dropout, torch.nn.Dropout2d)) for m in model.modules())

    x = torch.randn(2, 1, 28, 28)  # the forward pass, spelled out
    h = F.max_pool2d(F.relu(model.conv1(x)), 2)
    h = F.max_pool2d(F.relu(model.conv2(h)), 2).flatten(1)
    expected = model.fc3(F.relu(model.fc2(F.relu(model.fc1(h)))))
    assert torch.allclose(model(x), expected)

    cifar = build_model("simple_cnn", (3, 32, 32), 10)
    assert cifar.fc1.in_features == 400 and count(cifar) == 62_006
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_pfl_cnn_is_pfl_researchs_simple_cnn_layer_for_layer():
    """pfl-research benchmarks/model/pytorch/cnn.py simple_cnn on (32, 32, 3): conv 32 3x3,
    conv 64 3x3, max-pool 2, fc 14*14*64 -> 128 -> 10."""
    model = build_model("pfl_cnn", (3, 32, 32), 10)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == {
        "conv1.weight": (32, 3, 3, 3),
        "conv1.bias": (32,),
        "conv2.weight": (64, 32, 3, 3),
        "conv2.bias": (64,),
        "fc1.weight": (128, 12_544),
        "fc1.bias": (128,),
        "fc2.weight": (10, 128),
        "fc2.bias": (10,),
    }
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.skipif(not installed("byzfl"), reason="byzfl is not installed")
def test_byzfl_cnn_is_byzfls_cnn_mnist_layer_for_layer():
    from byzfl.fed_framework.models import cnn_mnist

    ours, theirs = build_model("byzfl_cnn", (1, 28, 28), 10), cnn_mnist()
    assert [tuple(p.shape) for p in ours.parameters()] == [tuple(p.shape) for p in theirs.parameters()]
    assert count(ours) == 431_080
    ours.load_state_dict(dict(zip(ours.state_dict(), theirs.state_dict().values())))
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(x), theirs(x))
