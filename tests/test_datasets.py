import os
import stat

import pytest
import torch
from support import Later, write_fake_cifar

from fedsim.core.errors import DataError
from fedsim.core.flat import FlatModel
from fedsim.data import DATASETS, load_dataset
from fedsim.data.augment import augmentation_for, random_crop_flip
from fedsim.data.datasets import CIFAR10_FOLDER, CIFAR10_MEAN, CIFAR10_STD
from fedsim.experiment.config import DataConfig
from fedsim.models.zoo import MODELS, build_model

torchvision = Later("torchvision")

# ----------------------------------------------------------------------------- CIFAR-10


def test_cifar10_reads_pickled_batches_from_a_read_only_folder(tmp_path):
    batches = write_fake_cifar(tmp_path)
    folder = tmp_path / CIFAR10_FOLDER
    os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR)
    try:
        data = load_dataset("cifar10", tmp_path)
    finally:
        os.chmod(folder, stat.S_IRWXU)
    assert data.train_x.shape == (20, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert data.num_classes == 10 and data.input_shape == (3, 32, 32)
    train_y = sum((batches[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    assert data.train_y.tolist() == train_y and data.test_y.tolist() == batches["test_batch"]["labels"]
    # image 5 is the second of data_batch_2; its green channel starts at byte 1024 of the row
    row = batches["data_batch_2"]["data"][1]
    for channel, (row_index, col) in [(0, (0, 0)), (1, (0, 0)), (2, (31, 31)), (1, (3, 7))]:
        raw = row[1024 * channel + 32 * row_index + col]
        expected = (raw / 255.0 - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel]
        assert data.train_x[5, channel, row_index, col].item() == pytest.approx(expected, abs=1e-5)


def test_cifar10_limit_keeps_the_first_samples(tmp_path):
    write_fake_cifar(tmp_path)
    full, limited = load_dataset("cifar10", tmp_path), load_dataset("cifar10", tmp_path, limit=6)
    assert torch.equal(limited.train_x, full.train_x[:6]) and len(limited.test_y) == 3


def test_missing_cifar10_tries_a_download_and_fails_in_one_line(tmp_path, monkeypatch):
    attempts = []

    def no_network(root, train, download):
        attempts.append((root, train, download))
        raise RuntimeError(
            "Error downloading cifar-10-python.tar.gz:\nTried https://example.org/, got:\n"
            "<urlopen error [Errno -2] Name or service not known>\n"
        )  # torchvision's form

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", no_network)
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path / "empty")
    message = str(info.value)
    assert attempts and attempts[0][2] is True
    assert "\n" not in message and message.startswith("data.root: ") and CIFAR10_FOLDER in message
    assert "Name or service not known" in message


def test_a_corrupt_cifar10_batch_is_one_line_naming_the_file(tmp_path):
    write_fake_cifar(tmp_path)
    (tmp_path / CIFAR10_FOLDER / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path)
    assert "\n" not in str(info.value) and "data_batch_3" in str(info.value)


def test_cifar10_is_registered():
    assert "cifar10" in DATASETS and "3x32x32" in dict(DATASETS.describe())["cifar10"]


# ----------------------------------------------------------------------------- models


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_cifar_cnn_is_the_classic_62006_parameter_network():
    model = build_model("cifar_cnn", (3, 32, 32), 10)
    assert count(model) == 62_006 and "62,006" in dict(MODELS.describe())["cifar_cnn"]
    assert [m.out_features for m in (model.fc1, model.fc2, model.fc3)] == [120, 84, 10]
    assert model.fc1.in_features == 400
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("cifar_cnn", (1, 28, 28), 10)(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.slow
def test_resnet18_uses_group_norm_and_trains_as_a_flat_model():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10)
    assert count(model) == 11_173_962 and "11,173,962" in dict(MODELS.describe())["resnet18"]
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    flat = FlatModel(model, "cpu")
    x = torch.randn(2, 3, 8, 8)  # global pooling takes any size; small images keep the test fast
    torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 7])).backward()
    assert flat.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- augmentation


def candidate_crops(x, padding=4):
    """Every crop of the zero-padded images: [n, c, offsets, offsets, h, w]."""
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    return padded.unfold(2, h, 1).unfold(3, w, 1)


def test_random_crop_flip_is_a_crop_of_the_padded_image_flipped_half_the_time():
    torch.manual_seed(0)
    x = torch.randn(400, 3, 8, 8)
    out = random_crop_flip(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    crops = candidate_crops(x)  # [n, c, 9, 9, h, w]
    target = out[:, :, None, None]
    plain = (crops == target).flatten(4).all(-1).all(1)  # [n, 9, 9]
    flipped = (crops.flip(-1) == target).flatten(4).all(-1).all(1)
    matches = plain.flatten(1).sum(1) + flipped.flatten(1).sum(1)
    assert (matches == 1).all()  # each output is exactly one crop, flipped or not
    flip_rate = flipped.flatten(1).any(1).float().mean().item()
    assert 0.4 < flip_rate < 0.6
    offsets = torch.nonzero(plain | flipped)[:, 1:]  # (row, column) offset of each sample's crop
    assert offsets.min() == 0 and offsets.max() == 8 and len(offsets.unique(dim=0)) > 60


def test_random_crop_flip_is_reproducible_from_the_seed():
    x = torch.randn(16, 3, 32, 32)
    torch.manual_seed(3)
    first = random_crop_flip(x)
    torch.manual_seed(3)
    assert torch.equal(random_crop_flip(x), first)
    torch.manual_seed(4)
    assert not torch.equal(random_crop_flip(x), first)


def test_augmentation_is_on_by_default_for_cifar10_only():
    assert augmentation_for(DataConfig(dataset="cifar10"), (3, 32, 32)) is random_crop_flip
    assert augmentation_for(DataConfig(dataset="mnist"), (1, 28, 28)) is None
    assert augmentation_for(DataConfig(dataset="cifar10", augment=False), (3, 32, 32)) is None
    assert augmentation_for(DataConfig(dataset="mnist", augment=True), (1, 28, 28)) is random_crop_flip


def test_download_false_refuses_at_once_naming_the_folder(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("mnist", tmp_path, download=False)
    message = str(info.value)
    assert "\n" not in message and "data.download is false" in message and str(tmp_path / "MNIST" / "raw") in message


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_is_the_same_every_time_and_its_labels_are_what_the_images_show():
    first, again = load_dataset("synthetic", "unused"), load_dataset("synthetic", "unused")
    for key in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(first, key), getattr(again, key)), key
    assert first.train_x.shape == (6000, 1, 28, 28) and first.test_x.shape == (1000, 1, 28, 28)
    assert sorted(first.train_y.unique().tolist()) == list(range(10))
    # a nearest-class-mean classifier, fitted on the training images, reads the test labels off the
    # test images: the labels depend on the images (chance would be 0.1)
    means = torch.stack([first.train_x[first.train_y == c].mean(0) for c in range(10)]).flatten(1)
    nearest = torch.cdist(first.test_x.flatten(1), means).argmin(1)
    assert (nearest == first.test_y).float().mean() > 0.9
    # but not every image is its template: the same class holds images that differ
    one_class = first.train_x[first.train_y == 0].flatten(1)
    assert float((one_class - one_class.mean(0)).norm(dim=1).min()) > 1.0


@pytest.mark.slow
def test_the_offline_quick_start_visibly_learns(tmp_path):
    """What the README promises: mnist_seed on generated data climbs to over 80 % in 3 rounds."""
    import fedsim

    history = fedsim.run("mnist_seed", dataset="synthetic", device="cpu", workers=0, out=tmp_path / "run", quiet=True)
    assert history.test_accuracy == [0.575, 0.851, 0.954]  # the numbers the README quotes
