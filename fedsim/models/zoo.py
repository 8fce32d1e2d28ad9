"""Model architectures, found by name. Each builder takes the dataset's input shape and class count.

Models return class scores; training and evaluation use cross-entropy on them (for a model
that already ends in log-softmax this equals the negative log-likelihood).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import ConfigError
from ..core.registry import Registry

MODELS = Registry("model")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MODELS.get(name)(input_shape, num_classes)


class Represents(nn.Module):
    """A classifier that gives the representation its output layer reads, for the algorithms that
    work on it (MOON's contrastive term, FedProto's class prototypes): ``forward(x)`` is
    ``classify(represent(x))``, ``represent`` gives [B, representation_size]."""

    representation_size: int
    num_classes: int

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.represent(x))

    @staticmethod
    def of(module: nn.Module, algorithm: str) -> Represents:
        """``module``, which ``algorithm`` reads the representation of; a one-line ConfigError if it
        gives none."""
        if not isinstance(module, Represents):
            raise ConfigError(
                f"algorithm: {algorithm} works on the representation a model's output layer reads, which "
                f"{type(module).__name__} does not give; use model: moon_cnn (MOON's, with its projection "
                f"head), mnist_cnn or mnist_2nn, or a model of your own that subclasses fedsim.models.zoo.Represents"
            )
        return module


class MnistCNN(Represents):
    """The small CNN of pytorch/examples' mnist_hogwild: 21,840 parameters. Its representation is
    the 50 units before the output layer (FedProto's MNIST model, whose prototypes they are)."""

    representation_size = 50

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.dropout(x, training=self.training)

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(z), dim=1)


class FedAvgCNN(nn.Module):
    """McMahan et al. 2017's MNIST CNN: two 5x5 conv + pool blocks, fc 512; 1,663,370 parameters."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, side: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (side // 4) ** 2, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MnistMLP(Represents):
    """McMahan et al. 2017's "2NN": two hidden layers of 200 ReLU units; 199,210 parameters. Its
    representation is the second hidden layer."""

    representation_size = 200

    def __init__(self, in_features: int = 784, num_classes: int = 10):
        super().__init__()
        self.num_classes = num_classes
        self.fc1 = nn.Linear(in_features, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc3(z)


class CifarCNN(nn.Module):
    """The CNN of the PyTorch CIFAR-10 tutorial and of many FedAvg papers: conv 6 and conv 16
    (5x5, each followed by 2x2 max-pooling), then fc 400-120-84; 62,006 parameters on 3x32x32."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, side: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        after_convs = ((side - 4) // 2 - 4) // 2  # 5 for 32x32 inputs, 4 for 28x28
        self.fc1 = nn.Linear(16 * after_convs**2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class CifarCNNBN(CifarCNN):
    """``cifar_cnn`` with batch norm after each hidden layer (conv 6, conv 16, fc 120, fc 84), as
    FedBN (Li et al. 2021) places it in its models: 62,458 parameters on 3x32x32, and the running
    statistics of 452 values."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, side: int = 32):
        super().__init__(in_channels, num_classes, side)
        self.bn1, self.bn2 = nn.BatchNorm2d(6), nn.BatchNorm2d(16)
        self.bn3, self.bn4 = nn.BatchNorm1d(120), nn.BatchNorm1d(84)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.fc1(x.flatten(1))))
        x = F.relu(self.bn4(self.fc2(x)))
        return self.fc3(x)


class ByzflCNN(nn.Module):
    """ByzFL's ``cnn_mnist`` (byzfl/fed_framework/models.py), the model of its benchmark, layer for
    layer: conv 20 (5x5), ReLU, 2x2 max-pool, conv 50 (5x5), ReLU, 2x2 max-pool, fc 800 -> 500,
    ReLU, fc -> classes, log-softmax; 431,080 parameters on 1x28x28 with 10 classes."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, side: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(50 * (((side - 4) // 2 - 4) // 2) ** 2, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def _side_after_two_convs(side: int) -> int:
    """The side of a ``side`` x ``side`` image after two 5x5 convolutions, each followed by 2x2
    max-pooling (4 for 28x28 inputs, 5 for 32x32); a ValueError for images too small for them."""
    after = ((side - 4) // 2 - 4) // 2
    if after < 1:
        raise ValueError(
            f"images of {side}x{side} pixels are too small for its two 5x5 convolutions "
            f"and 2x2 poolings (16x16 at least)"
        )
    return after


class SimpleCNN(nn.Module):
    """NIID-Bench's ``simple-cnn`` (Li, Diao, Chen, He, "Federated Learning on Non-IID Data Silos:
    An Experimental Study", ICDE 2022; Xtra-Computing/NIID-Bench, model.py): ``SimpleCNNMNIST``
    on 1x28x28 inputs and ``SimpleCNN`` on 3x32x32, layer for layer: conv 6 (5x5), ReLU, 2x2
    max-pool, conv 16 (5x5), ReLU, 2x2 max-pool, fc 16*4*4 (16*5*5 on 32x32) -> 120 -> 84 ->
    classes with ReLU between, no dropout or normalization, PyTorch's default initialization.
    44,426 parameters on 1x28x28 with 10 classes, 62,006 on 3x32x32."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, side: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * _side_after_two_convs(side) ** 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MoonCNN(Represents):
    """MOON's model (Li, He & Song 2021), as Flower's MOON baseline builds it (``ModelMOON`` with the
    ``simple-cnn`` base, models.py): SimpleCNN's layers up to its 84 ReLU units as the
    base, a projection head (linear 84 -> 84, ReLU, linear 84 -> 256) whose output is the
    representation, and an output layer 256 -> classes. 75,046 parameters on 1x28x28 with 10
    classes, 92,626 on 3x32x32 (the baseline's CIFAR-10 model)."""

    representation_size = 256

    def __init__(self, in_channels: int = 3, num_classes: int = 10, side: int = 32):
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * _side_after_two_convs(side) ** 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.l1 = nn.Linear(84, 84)
        self.l2 = nn.Linear(84, self.representation_size)
        self.l3 = nn.Linear(self.representation_size, num_classes)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))
        return self.l2(F.relu(self.l1(x)))

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return self.l3(z)


class PflCNN(nn.Module):
    """pfl-research's ``simple_cnn`` (benchmarks/model/pytorch/cnn.py), the CNN of its CIFAR-10
    speed benchmark: conv 32 3x3, conv 64 3x3, max-pool 2, dropout .25, fc 128, dropout .5;
    Glorot-uniform weights. Takes NCHW images (pfl's own takes NHWC and transposes first)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, side: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(((side - 4) // 2) ** 2 * 64, 128)
        self.fc2 = nn.Linear(128, num_classes)
        for layer in (self.conv1, self.conv2, self.fc1, self.fc2):
            nn.init.xavier_uniform_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.dropout(torch.flatten(x, 1), 0.25, self.training)
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, self.training))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (a strided 1x1 convolution where the shape changes),
    each followed by ``norm`` (GroupNorm of 2 groups unless given)."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: Callable[[int], nn.Module] = _group_norm):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = norm(channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), norm(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: a 3x3 stem convolution and no max-pool, so the four stages
    see 32, 16, 8 and 4 pixels; 11,173,962 parameters for 10 classes.

    Normalization is GroupNorm (2 groups per layer) rather than BatchNorm: BatchNorm's running
    statistics would be averaged over clients whose label mixes differ, so the global model would
    be evaluated with statistics that match no client, and its batch statistics are noisy at the
    small local batch sizes of federated training. GroupNorm has no running statistics and
    normalizes each sample alone, so training and evaluation behave the same on every client.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), _group_norm(64), nn.ReLU())
        stages, channels = [], 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(nn.Module):
    """He et al. 2016's ResNet-20 for CIFAR (section 4.2): a 3x3 convolution of 16 channels, three
    stages of three basic blocks of 16, 32 and 64 channels (the second and third halving the side),
    global average pooling and one linear layer, with batch norm after every convolution;
    shortcuts that change shape are strided 1x1 convolutions with batch norm. 272,474 parameters
    for 10 classes. The model for batch norm kept per client (FedBN); ``resnet18`` uses GroupNorm."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        blocks, channels = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(BasicBlock(channels, width, stride if i == 0 else 1, nn.BatchNorm2d))
                channels = width
        self.stages = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class FemnistCNN(nn.Module):
    """LEAF's FEMNIST CNN (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings";
    TalwalkarLab/leaf, models/femnist/cnn.py), layer for layer: conv 32 5x5 "same" + ReLU, 2x2
    max-pool, conv 64 5x5 "same" + ReLU, 2x2 max-pool, dense 2048 + ReLU, dense to the classes.
    Glorot-uniform weights and zero biases, what tf.layers gives it there. Takes NCHW images (LEAF
    reshapes its flat pixels to NHWC); 6,603,710 parameters on 1x28x28 with 62 classes."""

    def __init__(self, in_channels: int = 1, num_classes: int = 62, side: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)  # "same" for a 5x5 kernel, stride 1
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * (side // 4) ** 2, 2048)
        self.fc2 = nn.Linear(2048, num_classes)
        for layer in (self.conv1, self.conv2, self.fc1, self.fc2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CharLSTM(nn.Module):
    """The next-character LSTM of McMahan et al. 2017 ("Communication-Efficient Learning of Deep
    Networks from Decentralized Data", Shakespeare) as LEAF builds it (TalwalkarLab/leaf,
    models/shakespeare/stacked_lstm.py; its sizes in models/baseline_constants.py): an
    8-dimensional embedding of the characters, two stacked LSTM layers of 256 units, and a dense
    layer over the characters on the last step's output. Takes character ids [N, steps] (uint8, as
    the Shakespeare datasets hold them, or any integer type);
    819,920 parameters for 80 characters.

    Initialized as LEAF's TensorFlow graph is: Glorot-uniform embedding and weights (a layer's
    input and recurrent weights drawn as the one kernel BasicLSTMCell holds), zero biases, and
    BasicLSTMCell's constant forget bias of 1 placed in the forget gate's input bias. PyTorch keeps
    two bias vectors per layer where TensorFlow keeps one, whose role their sum plays: 2,048 more
    parameters than LEAF's 817,872, and the same function at initialization."""

    def __init__(self, num_characters: int = 80, embedding: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(num_characters, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_characters)
        nn.init.xavier_uniform_(self.embed.weight)
        nn.init.xavier_uniform_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)
        for layer in range(layers):
            inputs, recurrent = getattr(self.lstm, f"weight_ih_l{layer}"), getattr(self.lstm, f"weight_hh_l{layer}")
            # Glorot over TensorFlow's kernel [inputs + hidden, 4 * hidden]
            bound = math.sqrt(6 / (inputs.shape[1] + recurrent.shape[1] + 4 * hidden))
            nn.init.uniform_(inputs, -bound, bound)
            nn.init.uniform_(recurrent, -bound, bound)
            nn.init.zeros_(getattr(self.lstm, f"bias_hh_l{layer}"))
            input_bias = getattr(self.lstm, f"bias_ih_l{layer}")
            nn.init.zeros_(input_bias)
            nn.init.ones_(input_bias[hidden : 2 * hidden])  # PyTorch's gates are ordered input, forget, cell, output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embed(x.long()))  # an embedding takes int64 (or int32) ids
        return self.fc(outputs[:, -1])


@MODELS.register("mnist_cnn", "the small CNN of pytorch/examples' mnist_hogwild, 1x28x28 inputs (21,840 parameters)")
def mnist_cnn(input_shape: tuple[int, ...], num_classes: int) -> MnistCNN:
    return MnistCNN(input_shape[0], num_classes)


@MODELS.register("fedavg_cnn", "McMahan et al. 2017's CNN for 28x28 inputs (1,663,370 parameters)")
def fedavg_cnn(input_shape: tuple[int, ...], num_classes: int) -> FedAvgCNN:
    return FedAvgCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register("mnist_2nn", "McMahan et al. 2017's MLP, two hidden layers of 200 (199,210 parameters on 28x28)")
def mnist_2nn(input_shape: tuple[int, ...], num_classes: int) -> MnistMLP:
    return MnistMLP(math.prod(input_shape), num_classes)


@MODELS.register("cifar_cnn", "the 2-conv + 3-fc CNN of FedAvg papers for 3x32x32 inputs (62,006 parameters)")
def cifar_cnn(input_shape: tuple[int, ...], num_classes: int) -> CifarCNN:
    return CifarCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register(
    "cifar_cnn_bn", "cifar_cnn with batch norm after each hidden layer, as FedBN's models (62,458 parameters)"
)
def cifar_cnn_bn(input_shape: tuple[int, ...], num_classes: int) -> CifarCNNBN:
    return CifarCNNBN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register("byzfl_cnn", "ByzFL's cnn_mnist, its benchmark's model: conv 20, conv 50, fc 500 (431,080 parameters)")
def byzfl_cnn(input_shape: tuple[int, ...], num_classes: int) -> ByzflCNN:
    return ByzflCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register(
    "simple_cnn", "NIID-Bench's simple-cnn (Li et al. 2022): conv 6, conv 16, fc 120-84, 44,426 parameters on 1x28x28"
)
def simple_cnn(input_shape: tuple[int, ...], num_classes: int) -> SimpleCNN:
    return SimpleCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register("resnet18", "ResNet-18 for 32x32 inputs with GroupNorm (11,173,962 parameters)")
def resnet18(input_shape: tuple[int, ...], num_classes: int) -> ResNet18:
    return ResNet18(input_shape[0], num_classes)


@MODELS.register("resnet20", "He et al.'s ResNet-20 for 32x32 inputs, with batch norm (272,474 parameters)")
def resnet20(input_shape: tuple[int, ...], num_classes: int) -> ResNet20:
    return ResNet20(input_shape[0], num_classes)


@MODELS.register(
    "moon_cnn",
    "MOON's model (Li et al. 2021): simple_cnn's base, a projection head 84-84-256 whose output is the "
    "representation, an output layer (75,046 parameters on 1x28x28, 92,626 on 3x32x32)",
)
def moon_cnn(input_shape: tuple[int, ...], num_classes: int) -> MoonCNN:
    return MoonCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register(
    "pfl_cnn", "pfl-research's CIFAR-10 benchmark CNN: conv 32, conv 64, fc 128 (1,626,442 parameters on 3x32x32)"
)
def pfl_cnn(input_shape: tuple[int, ...], num_classes: int) -> PflCNN:
    return PflCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register(
    "femnist_cnn",
    "LEAF's FEMNIST CNN (Caldas et al. 2018): conv 32, conv 64, fc 2048 (6,603,710 parameters on 1x28x28, 62 classes)",
)
def femnist_cnn(input_shape: tuple[int, ...], num_classes: int) -> FemnistCNN:
    return FemnistCNN(input_shape[0], num_classes, side=input_shape[-1])


@MODELS.register(
    "char_lstm",
    "McMahan et al. 2017's and LEAF's next-character LSTM: embedding 8, 2 x LSTM 256 "
    "(819,920 parameters for 80 characters); integer character ids",
)
def char_lstm(input_shape: tuple[int, ...], num_classes: int) -> CharLSTM:
    if len(input_shape) != 1:
        raise ValueError(f"it reads sequences of character ids, shape (steps,), not inputs of shape {input_shape}")
    return CharLSTM(num_classes)
